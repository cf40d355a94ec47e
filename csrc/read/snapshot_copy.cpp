#include "read/snapshot_copy.hpp"

#include <fcntl.h>
#include <sys/mman.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstring>
#include <mutex>
#include <stdexcept>
#include <thread>

#include "core/aligned_buffer.hpp"
#include "core/checksum.hpp"
#include "core/error.hpp"

#ifndef MADV_POPULATE_READ
#define MADV_POPULATE_READ 22
#endif
#ifndef MADV_POPULATE_WRITE
#define MADV_POPULATE_WRITE 23
#endif

namespace fw {

namespace {

void populate(const void* p, uint64_t len, int advice) noexcept {
  auto lo = reinterpret_cast<uintptr_t>(p) / kAlign * kAlign;
  auto hi = round_up(reinterpret_cast<uintptr_t>(p) + len, kAlign);
  if (hi > lo) madvise(reinterpret_cast<void*>(lo), hi - lo, advice);  // faults happen anyway where it fails
}

}  // namespace

std::vector<std::pair<size_t, uint64_t>> copy_verify(const std::vector<SnapshotPiece>& pieces, bool verify,
                                                     unsigned threads, const std::atomic<bool>* stop) {
  std::vector<std::pair<size_t, uint64_t>> bad;
  std::mutex mu;
  std::atomic<size_t> next{0};
  auto work = [&] {
    for (size_t i; (i = next.fetch_add(1)) < pieces.size();) {
      if (stop && stop->load(std::memory_order_relaxed)) return;
      const SnapshotPiece& p = pieces[i];
      if (!p.len) continue;
      populate(p.src, p.len, MADV_POPULATE_READ);
      uint64_t h = 0;
      if (p.dst) {
        populate(p.dst, p.len, MADV_POPULATE_WRITE);
        if (verify)
          h = copy_and_checksum(p.dst, p.src, p.len);
        else
          std::memcpy(p.dst, p.src, p.len);
      } else if (verify) {
        h = checksum(p.src, p.len);
      }
      if (verify && h != p.expected) {
        std::lock_guard<std::mutex> lk(mu);
        bad.emplace_back(i, h);
      }
    }
  };
  threads = std::max(1u, std::min<unsigned>(threads, static_cast<unsigned>(pieces.size())));
  std::vector<std::thread> pool;
  for (unsigned t = 1; t < threads; ++t) pool.emplace_back(work);
  work();
  for (auto& t : pool) t.join();
  std::sort(bad.begin(), bad.end());
  return bad;
}

uint64_t punch_holes(int fd, std::vector<std::pair<uint64_t, uint64_t>> keep, uint64_t size) {
  std::sort(keep.begin(), keep.end());
  uint64_t at = 0, freed = 0;
  auto punch = [&](uint64_t lo, uint64_t hi) {
    lo = round_up(lo, kAlign);
    hi = std::min(hi, size) / kAlign * kAlign;
    if (hi <= lo) return;
    if (fallocate(fd, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, static_cast<off_t>(lo), static_cast<off_t>(hi - lo)))
      throw_errno(errno, "free the unused pages of a taken snapshot", "", static_cast<int64_t>(lo),
                  static_cast<int64_t>(hi - lo));
    freed += hi - lo;
  };
  for (auto& [off, len] : keep) {
    if (off > at) punch(at, off);
    at = std::max(at, off + len);
  }
  if (size > at) punch(at, size);
  return freed;
}

SnapshotMapping::SnapshotMapping(int fd, const std::vector<std::pair<uint64_t, uint64_t>>& segments, uint64_t lead,
                                 uint64_t size, bool shared)
    : lead_(lead), size_(size) {
  for (auto& [off, len] : segments) {
    if (off % kAlign || len % kAlign || !len) throw std::invalid_argument("segments must be whole pages");
    map_len_ += len;
  }
  if (!map_len_ || lead + size > map_len_) throw std::invalid_argument("the mapping does not hold the bytes");
  // Reserve the whole range first, then map each segment over it.
  void* r = mmap(nullptr, map_len_, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (r == MAP_FAILED) throw_errno(errno, "reserve address space for a snapshot", "", -1, static_cast<int64_t>(map_len_));
  base_ = static_cast<char*>(r);
  const int flags = (shared ? MAP_SHARED : MAP_PRIVATE) | MAP_FIXED;
  uint64_t pos = 0;
  for (auto& [off, len] : segments) {
    void* p = mmap(base_ + pos, len, PROT_READ | PROT_WRITE, flags, fd, static_cast<off_t>(off));
    if (p == MAP_FAILED) {
      int err = errno;
      munmap(base_, map_len_);
      base_ = nullptr;
      throw_errno(err, "map a snapshot's pages", "", static_cast<int64_t>(off), static_cast<int64_t>(len));
    }
    pos += len;
  }
}

SnapshotMapping::~SnapshotMapping() {
  if (base_) munmap(base_, map_len_);
}

}  // namespace fw
