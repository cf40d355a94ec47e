#include "core/aligned_buffer.hpp"

#include <sys/mman.h>

#include <cerrno>
#include <algorithm>
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

void AlignedBuffer::prefault(size_t offset, size_t len) const noexcept {
  if (!ptr_ || offset >= cap_) return;
  len = std::min(len, cap_ - offset);
  if (madvise(ptr_ + offset, len, MADV_POPULATE_WRITE) == 0) return;
  for (size_t i = 0; i < len; i += kAlign) *static_cast<volatile char*>(ptr_ + offset + i) = 0;
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
