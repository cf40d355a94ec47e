#include "read/owned_memory.hpp"

#include <sys/mman.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>

#include "core/aligned_buffer.hpp"
#include "core/error.hpp"

namespace fw {
namespace {

constexpr uint64_t kHuge = 2ull << 20;

bool huge_pages_on() {
  const char* v = std::getenv("FLASHWRITE_HUGE_PAGES");
  return v && (!std::strcmp(v, "on") || !std::strcmp(v, "1"));
}

}  // namespace

OwnedExtent map_extent(uint64_t file_offset, uint64_t nbytes) {
  const uint64_t first = file_offset / kAlign * kAlign;
  const size_t len = round_up(std::max<uint64_t>(file_offset + nbytes, first + 1), kAlign) - first;
  const bool huge = len >= kHuge && huge_pages_on();
  const size_t slack = huge ? kHuge : 0;
  void* p = mmap(nullptr, len + slack, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (p == MAP_FAILED) throw_errno(errno, "mmap tensor memory", "", static_cast<int64_t>(file_offset),
                                   static_cast<int64_t>(len + slack));
  auto at = reinterpret_cast<uintptr_t>(p);
  if (huge) {
    // The first address at or above p that agrees with the file modulo 2 MiB: each
    // chunk read (cut at multiples of 2 MiB in the file) starts on a huge page.
    const uintptr_t start = at + (first % kHuge + kHuge - at % kHuge) % kHuge;
    if (start > at) munmap(p, start - at);
    if (at + len + slack > start + len) munmap(reinterpret_cast<void*>(start + len), at + len + slack - (start + len));
    at = start;
#ifdef MADV_HUGEPAGE
    madvise(reinterpret_cast<void*>(at), len, MADV_HUGEPAGE);  // advisory: 4 KiB pages where THP is off
#endif
  }
  OwnedExtent e;
  e.map = reinterpret_cast<void*>(at);
  e.map_len = len;
  e.data = reinterpret_cast<char*>(at) + (file_offset - first);
  return e;
}

void release_extent(const OwnedExtent& e) noexcept {
  if (e.map) munmap(e.map, e.map_len);
}

}  // namespace fw
