#include "core/write_watch.hpp"

#include <fcntl.h>
#include <linux/fs.h>
#include <linux/userfaultfd.h>
#include <sys/ioctl.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>

#include "core/error.hpp"

// The kernel ABI of Linux 6.7, for headers older than the kernel that runs us.
#ifndef UFFD_FEATURE_WP_ASYNC
#define UFFD_FEATURE_WP_ASYNC (1 << 15)
#endif
#ifndef PAGEMAP_SCAN
struct page_region {
  __u64 start;
  __u64 end;
  __u64 categories;
};
struct pm_scan_arg {
  __u64 size;
  __u64 flags;
  __u64 start;
  __u64 end;
  __u64 walk_end;
  __u64 vec;
  __u64 vec_len;
  __u64 max_pages;
  __u64 category_inverted;
  __u64 category_mask;
  __u64 category_anyof_mask;
  __u64 return_mask;
};
#define PAGEMAP_SCAN _IOWR('f', 16, struct pm_scan_arg)
#define PM_SCAN_WP_MATCHING (1 << 0)
#define PM_SCAN_CHECK_WPASYNC (1 << 1)
#define PAGE_IS_WRITTEN (1 << 1)
#define PAGE_IS_FILE (1 << 2)
#define PAGE_IS_PRESENT (1 << 3)
#endif

namespace fw {
namespace {

constexpr uintptr_t kPage = 4096;
constexpr size_t kRegions = 512;  // page regions per PAGEMAP_SCAN call

struct Span {
  uintptr_t lo, hi;  // whole pages
};

Span pages_of(const WriteWatch::Range& r) {
  uintptr_t lo = r.first & ~(kPage - 1);
  uintptr_t hi = (r.first + std::max<uint64_t>(r.second, 1) + kPage - 1) & ~(kPage - 1);
  return {lo, hi};
}

// The ranges' pages, merged where they share a page: (span, indices of its ranges).
std::vector<std::pair<Span, std::vector<size_t>>> groups_of(const std::vector<WriteWatch::Range>& ranges) {
  std::vector<size_t> order(ranges.size());
  for (size_t i = 0; i < order.size(); ++i) order[i] = i;
  std::sort(order.begin(), order.end(), [&](size_t a, size_t b) { return ranges[a].first < ranges[b].first; });
  std::vector<std::pair<Span, std::vector<size_t>>> out;
  for (size_t i : order) {
    Span s = pages_of(ranges[i]);
    if (!out.empty() && s.lo < out.back().first.hi) {
      out.back().first.hi = std::max(out.back().first.hi, s.hi);
      out.back().second.push_back(i);
    } else {
      out.push_back({s, {i}});
    }
  }
  return out;
}

}  // namespace

WriteWatch::WriteWatch() : pid_(getpid()) {
  // User-mode-only: allowed without privilege where vm.unprivileged_userfaultfd is 0.
  // Asynchronous write-protection resolves a write fault in the kernel (it only
  // clears the page's bit), so nothing ever waits on this descriptor.
  uffd_ = static_cast<int>(syscall(SYS_userfaultfd, O_CLOEXEC | O_NONBLOCK | UFFD_USER_MODE_ONLY));
  if (uffd_ < 0) throw_errno(errno, "userfaultfd", "");
  uffdio_api api{};
  api.api = UFFD_API;
  api.features = UFFD_FEATURE_WP_ASYNC;
  if (ioctl(uffd_, UFFDIO_API, &api) != 0) {
    int e = errno;
    close(uffd_);
    throw_errno(e, "UFFDIO_API with asynchronous write-protection (Linux 6.7)", "");
  }
  pagemap_ = open("/proc/self/pagemap", O_RDONLY | O_CLOEXEC);
  if (pagemap_ < 0) {
    int e = errno;
    close(uffd_);
    throw_errno(e, "open", "/proc/self/pagemap");
  }
  // PAGEMAP_SCAN itself (Linux 6.7): an empty scan answers 0, or EINVAL/ENOTTY without it.
  pm_scan_arg probe{};
  probe.size = sizeof(probe);
  probe.start = probe.end = 0;
  probe.return_mask = PAGE_IS_WRITTEN;
  if (ioctl(pagemap_, PAGEMAP_SCAN, &probe) < 0) {
    int e = errno;
    close(uffd_);
    close(pagemap_);
    throw_errno(e, "PAGEMAP_SCAN (Linux 6.7)", "/proc/self/pagemap");
  }
}

WriteWatch::~WriteWatch() {
  if (pid_ != getpid()) return;  // a fork's copy: the descriptors belong to the parent's watch
  close(pagemap_);
  close(uffd_);  // unregisters every range
}

std::vector<bool> WriteWatch::arm(const std::vector<Range>& ranges) {
  std::lock_guard<std::mutex> lock(mu_);
  std::vector<bool> ok(ranges.size(), false);
  if (pid_ != getpid()) return ok;
  for (auto& [span, members] : groups_of(ranges)) {
    uffdio_register reg{};
    reg.range.start = span.lo;
    reg.range.len = span.hi - span.lo;
    reg.mode = UFFDIO_REGISTER_MODE_WP;
    bool done = ioctl(uffd_, UFFDIO_REGISTER, &reg) == 0;
    for (size_t i : members) ok[i] = done;
  }
  return ok;
}

std::vector<uint8_t> WriteWatch::scan(const std::vector<Range>& ranges) {
  std::lock_guard<std::mutex> lock(mu_);
  std::vector<uint8_t> flags(ranges.size(), kInside);
  if (pid_ != getpid()) return flags;
  std::vector<page_region> vec(kRegions);
  for (auto& [span, members] : groups_of(ranges)) {
    // The pages that may have changed: written, or not present, or not anonymous.
    // WP_MATCHING protects them again; CHECK_WPASYNC fails the call if any page of
    // the span is not registered (freed and mapped anew, say): all then count.
    std::vector<Span> changed;
    // The walk skips holes: a span not wholly mapped (freed since) counts as changed.
    // msync(MS_ASYNC) does nothing but check that (ENOMEM for a hole).
    bool failed = msync(reinterpret_cast<void*>(span.lo), span.hi - span.lo, MS_ASYNC) != 0;
    uintptr_t at = failed ? span.hi : span.lo;
    while (at < span.hi) {
      pm_scan_arg a{};
      a.size = sizeof(a);
      a.flags = PM_SCAN_WP_MATCHING | PM_SCAN_CHECK_WPASYNC;
      a.start = at;
      a.end = span.hi;
      a.vec = reinterpret_cast<uintptr_t>(vec.data());
      a.vec_len = vec.size();
      a.category_inverted = PAGE_IS_PRESENT;
      a.category_anyof_mask = PAGE_IS_WRITTEN | PAGE_IS_PRESENT | PAGE_IS_FILE;
      a.return_mask = PAGE_IS_WRITTEN | PAGE_IS_PRESENT | PAGE_IS_FILE;
      long n = ioctl(pagemap_, PAGEMAP_SCAN, &a);
      if (n < 0) {
        failed = true;
        break;
      }
      for (long k = 0; k < n; ++k) changed.push_back({vec[k].start, vec[k].end});
      if (a.walk_end <= at) {  // no progress: never trust the rest
        failed = true;
        break;
      }
      at = a.walk_end;
    }
    if (failed) continue;  // every member stays kInside
    for (size_t i : members) {
      const Range& r = ranges[i];
      Span s = pages_of(r);
      // A first or last page the range shares with other memory is told apart: a write
      // there may be the neighbour's (the allocator's bookkeeping beside a heap tensor).
      Span head{s.lo, (r.first % kPage) ? s.lo + kPage : s.lo};
      Span tail{((r.first + r.second) % kPage) ? s.hi - kPage : s.hi, s.hi};
      Span inside{head.hi, std::max(head.hi, tail.lo)};
      uint8_t f = 0;
      for (const Span& c : changed) {
        auto hits = [&](const Span& x) { return x.lo < x.hi && c.lo < x.hi && x.lo < c.hi; };
        if (hits(inside)) f |= kInside;
        if (hits(head)) f |= kHead;
        if (hits(tail)) f |= kTail;
      }
      flags[i] = f;
    }
  }
  return flags;
}

}  // namespace fw
