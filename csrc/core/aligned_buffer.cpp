#include "core/aligned_buffer.hpp"

#include <sys/mman.h>

#include <algorithm>
#include <cerrno>
#include <ctime>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <stdexcept>
#include <utility>

#include "core/error.hpp"

namespace fw {

#ifndef MADV_POPULATE_WRITE
#define MADV_POPULATE_WRITE 23
#endif

AlignedBuffer::AlignedBuffer(size_t bytes, bool populate) : size_(bytes), cap_(round_up(bytes ? bytes : 1, kAlign)) {
  map_len_ = cap_;
  void* p = mmap(nullptr, map_len_, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (p == MAP_FAILED) throw_errno(errno, "mmap host buffer", "", -1, static_cast<int64_t>(map_len_));
  map_ = p;
  ptr_ = static_cast<char*>(p);
  if (populate) prefault(0, cap_);
}

AlignedBuffer AlignedBuffer::huge_pages(size_t bytes) {
  constexpr size_t kHuge = 2 << 20;
  AlignedBuffer b;
  b.size_ = bytes;
  b.cap_ = round_up(bytes ? bytes : 1, kAlign);
  b.map_len_ = b.cap_ + kHuge;  // room to align up
  void* p = mmap(nullptr, b.map_len_, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (p == MAP_FAILED) throw_errno(errno, "mmap host buffer", "", -1, static_cast<int64_t>(b.map_len_));
  b.map_ = p;
  b.ptr_ = reinterpret_cast<char*>(round_up(reinterpret_cast<uintptr_t>(p), kHuge));
#ifdef MADV_HUGEPAGE
  madvise(b.ptr_, b.cap_, MADV_HUGEPAGE);  // advisory: 4 KiB pages where THP is off
#endif
  return b;
}

AlignedBuffer AlignedBuffer::map_shared(int fd, uint64_t file_offset, size_t bytes) {
  AlignedBuffer b;
  b.size_ = bytes;
  b.cap_ = b.map_len_ = round_up(bytes ? bytes : 1, kAlign);
  void* p = mmap(nullptr, b.map_len_, PROT_READ | PROT_WRITE, MAP_SHARED, fd, static_cast<off_t>(file_offset));
  if (p == MAP_FAILED) throw_errno(errno, "mmap shared staging file", "", static_cast<int64_t>(file_offset),
                                   static_cast<int64_t>(b.map_len_));
  b.map_ = p;
  b.ptr_ = static_cast<char*>(p);
  return b;
}

void prefault_pages(char* p, size_t len) noexcept {
  if (madvise(p, len, MADV_POPULATE_WRITE) == 0) return;
  for (size_t i = 0; i < len; i += kAlign) *static_cast<volatile char*>(p + i) = 0;
}

void AlignedBuffer::prefault(size_t offset, size_t len) const noexcept {
  if (!ptr_ || offset >= cap_) return;
  prefault_pages(ptr_ + offset, std::min(len, cap_ - offset));
}

namespace {

enum class HugeMode { Auto, On, Off };

HugeMode huge_mode() {
  const char* v = std::getenv("FLASHWRITE_HUGE_PAGES");
  if (!v || !*v || !std::strcmp(v, "auto")) return HugeMode::Auto;
  if (!std::strcmp(v, "on") || !std::strcmp(v, "1")) return HugeMode::On;
  if (!std::strcmp(v, "off") || !std::strcmp(v, "0")) return HugeMode::Off;
  throw std::invalid_argument(std::string("FLASHWRITE_HUGE_PAGES=") + v + ": expected auto, on or off");
}

bool thp_never() {
  FILE* f = std::fopen("/sys/kernel/mm/transparent_hugepage/enabled", "r");
  if (!f) return true;
  char line[128] = {};
  const bool read = std::fgets(line, sizeof line, f) != nullptr;
  std::fclose(f);
  return !read || std::strstr(line, "[never]") != nullptr;
}

std::string ms(double v) {
  char b[32];
  std::snprintf(b, sizeof b, "%.2f ms", v);
  return b;
}

double thread_cpu_ms() {
  timespec t{};
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t);
  return t.tv_sec * 1e3 + t.tv_nsec * 1e-6;
}

constexpr size_t kHugePage = 2 << 20;

}  // namespace

void HugePageWatch::check_setting() { huge_mode(); }

HugePageWatch::HugePageWatch(const AlignedBuffer& buf) : buf_(buf) {
  const HugeMode mode = huge_mode();
  char* p = buf.data();
  const size_t cap = buf.capacity();
  if (!p) return;
  if (mode == HugeMode::Off || thp_never()) {
    madvise(p, cap, MADV_NOHUGEPAGE);
    small_ = true;
    why_ = mode == HugeMode::Off ? "4 KiB pages (FLASHWRITE_HUGE_PAGES=off)" : "4 KiB pages (transparent huge pages are off)";
    return;
  }
  if (mode == HugeMode::On) {
    why_ = "2 MiB pages (FLASHWRITE_HUGE_PAGES=on)";
    return;
  }
  if (cap < 8 * kHugePage) {
    why_ = "2 MiB pages (too small a buffer to watch)";
    return;
  }
  const size_t probe = cap - 2 * kHugePage;
  madvise(p + probe, 2 * kHugePage, MADV_NOHUGEPAGE);
  const double t0 = thread_cpu_ms();
  buf.prefault(probe, 2 * kHugePage);
  small_ms_ = (thread_cpu_ms() - t0) / 2;
  watch_ = true;
}

void HugePageWatch::fault_in(size_t offset, size_t len) {
  constexpr size_t kStep = 4 * kHugePage;
  const size_t end = std::min(offset + len, buf_.capacity());
  while (offset < end) {
    const size_t n = std::min(kStep, end - offset);
    if (!watch_ || small_.load() || n < kHugePage) {
      buf_.prefault(offset, end - offset);
      return;
    }
    const double t0 = thread_cpu_ms();
    buf_.prefault(offset, n);
    const double per_page = (thread_cpu_ms() - t0) / (static_cast<double>(n) / kHugePage);
    offset += n;
    std::lock_guard<std::mutex> lk(mu_);
    worst_ms_ = std::max(worst_ms_, per_page);
    if (per_page > 3 * small_ms_ && !small_.exchange(true)) {
      madvise(buf_.data(), buf_.capacity(), MADV_NOHUGEPAGE);  // what is already huge stays so
      why_ = "4 KiB pages: faulting in a 2 MiB page took " + ms(per_page) + " of CPU, 2 MiB of 4 KiB pages " + ms(small_ms_);
    }
  }
}

std::string HugePageWatch::why() const {
  std::lock_guard<std::mutex> lk(mu_);
  if (!watch_ || small_.load()) return why_;
  return "2 MiB pages: at most " + ms(worst_ms_) + " of CPU per page to fault in, 2 MiB of 4 KiB pages " + ms(small_ms_);
}

bool AlignedBuffer::dont_fork() const noexcept { return map_ && madvise(map_, map_len_, MADV_DONTFORK) == 0; }

void AlignedBuffer::forget() noexcept {
  map_ = nullptr;
  reset();
}

AlignedBuffer::~AlignedBuffer() { reset(); }

AlignedBuffer::AlignedBuffer(AlignedBuffer&& o) noexcept
    : ptr_(std::exchange(o.ptr_, nullptr)),
      map_(std::exchange(o.map_, nullptr)),
      size_(std::exchange(o.size_, 0)),
      cap_(std::exchange(o.cap_, 0)),
      map_len_(std::exchange(o.map_len_, 0)) {}

AlignedBuffer& AlignedBuffer::operator=(AlignedBuffer&& o) noexcept {
  if (this != &o) {
    reset();
    ptr_ = std::exchange(o.ptr_, nullptr);
    map_ = std::exchange(o.map_, nullptr);
    size_ = std::exchange(o.size_, 0);
    cap_ = std::exchange(o.cap_, 0);
    map_len_ = std::exchange(o.map_len_, 0);
  }
  return *this;
}

void AlignedBuffer::reset() noexcept {
  if (map_) munmap(map_, map_len_);
  map_ = nullptr;
  ptr_ = nullptr;
  size_ = cap_ = map_len_ = 0;
}

}  // namespace fw
