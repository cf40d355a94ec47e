// Restoring a local snapshot (python/flashwrite/local.py) out of its pool file
// in shared memory: no I/O, so the cost is page faults, the copy and the
// checksums. copy_verify does copy and checksum in one pass (each block hashed
// right after it is copied, while in cache) on several threads, with the pages
// of each piece populated in one call first (a fault per 4 KiB page costs more
// than copying it, more so in a VM). SnapshotMapping adopts a snapshot's bytes
// instead of copying them: the pool pages are mapped copy-on-write, or shared
// when the restoring process has taken the pool file for itself.
#pragma once
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <utility>
#include <vector>

namespace fw {

struct SnapshotPiece {
  char* dst;        // nullptr: check src in place
  const char* src;  // len bytes; both stay valid for the call
  uint64_t len;
  uint64_t expected;  // XXH3-64, checked when verify
};

// Copies (or checks in place) every piece on `threads` threads; returns
// (index, actual checksum) of the pieces that did not match, by index.
// Destinations are written only by their own piece; their pages are populated
// with MADV_POPULATE_WRITE, which writes no byte, so neighbours are safe.
// stop (may be null): checked between pieces; once set, no further piece is
// started and the call returns (its result meaningless) when every thread has
// finished the piece it was in, so a caller that sets it and then joins the
// call may free the buffers (the Python binding's Ctrl-C, issue 34).
std::vector<std::pair<size_t, uint64_t>> copy_verify(const std::vector<SnapshotPiece>& pieces, bool verify,
                                                     unsigned threads, const std::atomic<bool>* stop = nullptr);

// Frees the pages of fd in [0, size) that no range of `keep` covers ((offset,
// length), whole pages, any order) with FALLOC_FL_PUNCH_HOLE: a taken pool's
// stripe headers, small tensors (copied out) and slack. Returns the bytes freed.
uint64_t punch_holes(int fd, std::vector<std::pair<uint64_t, uint64_t>> keep, uint64_t size);

// Page-aligned ranges of one file mapped contiguously, in the order given;
// data() is `lead` bytes into the first.
// - shared == false: copy-on-write. Writes stay in this process; the file must
//   not be written or truncated while the mapping lives (local.py adopts only
//   pool files no Writer holds, and holds a shared flock meanwhile).
// - shared == true: the file's own pages, read-write. Only for a file this
//   process has taken for itself (local.py: an exclusive flock, the file
//   unlinked), so nobody else sees the writes.
// A mapping holds the open file description it was made from, and with it the
// flock taken on it: the lock lasts until the last mapping of the restore is
// gone, with no descriptor kept open.
class SnapshotMapping {
 public:
  // segments: (file offset, length), both multiples of 4096. Nothing is
  // faulted in here (copy_verify with dst == nullptr populates for reading; a
  // private page is copied only when it is first written).
  SnapshotMapping(int fd, const std::vector<std::pair<uint64_t, uint64_t>>& segments, uint64_t lead, uint64_t size,
                  bool shared);
  ~SnapshotMapping();
  SnapshotMapping(const SnapshotMapping&) = delete;
  SnapshotMapping& operator=(const SnapshotMapping&) = delete;

  char* data() const noexcept { return base_ + lead_; }
  uint64_t size() const noexcept { return size_; }

 private:
  char* base_ = nullptr;
  uint64_t map_len_ = 0, lead_ = 0, size_ = 0;
};

}  // namespace fw
