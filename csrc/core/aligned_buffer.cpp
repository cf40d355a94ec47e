#include "core/aligned_buffer.hpp"

#include <sys/mman.h>

#include <cerrno>
#include <utility>

#include "core/error.hpp"

namespace fw {

AlignedBuffer::AlignedBuffer(size_t bytes, bool populate) : size_(bytes), cap_(round_up(bytes ? bytes : 1, kAlign)) {
  int flags = MAP_PRIVATE | MAP_ANONYMOUS | (populate ? MAP_POPULATE : 0);
  void* p = mmap(nullptr, cap_, PROT_READ | PROT_WRITE, flags, -1, 0);
  if (p == MAP_FAILED) throw_errno(errno, "mmap staging buffer", "", -1, static_cast<int64_t>(cap_));
  ptr_ = static_cast<char*>(p);
}

AlignedBuffer::~AlignedBuffer() { reset(); }

AlignedBuffer::AlignedBuffer(AlignedBuffer&& o) noexcept
    : ptr_(std::exchange(o.ptr_, nullptr)), size_(std::exchange(o.size_, 0)), cap_(std::exchange(o.cap_, 0)) {}

AlignedBuffer& AlignedBuffer::operator=(AlignedBuffer&& o) noexcept {
  if (this != &o) {
    reset();
    ptr_ = std::exchange(o.ptr_, nullptr);
    size_ = std::exchange(o.size_, 0);
    cap_ = std::exchange(o.cap_, 0);
  }
  return *this;
}

void AlignedBuffer::reset() noexcept {
  if (ptr_) munmap(ptr_, cap_);
  ptr_ = nullptr;
  size_ = cap_ = 0;
}

}  // namespace fw
