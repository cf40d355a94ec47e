// The interface through which a load hands the chunks that hold placed bytes
// (read/placements.hpp) to a placer: read/host_placer.hpp copies them to host
// memory the caller owns, read/device_placer.hpp to GPUs (and host memory) on
// the CUDA copy engine. Owned by read/: the copy engine in stage/ knows
// nothing about loads.
#pragma once
#include <atomic>
#include <cstdint>
#include <vector>

#include "read/placements.hpp"

namespace fw {

// A chunk that holds placed bytes is read into a bounce slot from acquire()
// instead of the file's host buffer and, once verified, handed to place().
// A file that covers() says is wholly placed gets no host buffer at all.
// Called on the load's own threads only; place() on several at once.
class ChunkPlacer {
 public:
  virtual ~ChunkPlacer() = default;
  virtual void begin() = 0;  // before the first read
  virtual bool wants(uint32_t file, uint64_t offset, uint64_t len) const = 0;
  virtual bool covers(uint32_t file, uint64_t size) const = 0;
  // The file's placements read straight into their memory (kDirect), in file order.
  virtual std::vector<Placement> direct(uint32_t file) const = 0;
  virtual char* acquire(const std::atomic<bool>* cancel) = 0;  // nullptr once *cancel
  // On the reading thread, as the chunk's read is submitted: fault in its host
  // destinations while earlier reads are in flight, so the copy out of the
  // chunk does not trap on every fresh page.
  virtual void prepare(uint32_t file, uint64_t offset, uint64_t len) = 0;
  // ok=false: a checksum did not match or the load failed; only the slot comes back.
  // host_dst: where the chunk would sit in the file's host buffer (bytes not
  // placed go there); nullptr for a file that covers() says is wholly placed.
  virtual void place(uint32_t file, uint64_t offset, uint64_t len, char* slot, char* host_dst, bool ok) = 0;
  virtual void discard(char* slot) = 0;  // the read into this slot failed
  virtual void finish() = 0;  // waits until every placed byte has landed; rethrows
  // Whether a placement may still be landing after place() returned (GPU copies on
  // streams): then only finish() says the destinations are written no more.
  virtual bool copies_async() const { return false; }
};

}  // namespace fw
