// The interface through which a load hands chunks bound for GPUs to a placer
// (read/device_placer.hpp implements it on the CUDA copy engine). Owned by
// read/: the copy engine in stage/ knows nothing about loads.
#pragma once
#include <atomic>
#include <cstdint>

namespace fw {

// Takes the chunks of a load that hold bytes bound for GPUs (implemented by
// the CUDA copy engine, stage/device_copy.hpp): such a chunk is read into a
// slot from acquire() instead of the file's host buffer and, once verified,
// handed to place(). Called on the load's own threads only.
class ChunkPlacer {
 public:
  virtual ~ChunkPlacer() = default;
  virtual void begin() = 0;  // before the first read
  virtual bool wants(uint32_t file, uint64_t offset, uint64_t len) const = 0;
  virtual char* acquire(const std::atomic<bool>* cancel) = 0;  // nullptr once *cancel
  // ok=false: a checksum did not match or the load failed; only the slot comes back.
  // host_dst: where the chunk would sit in the file's host buffer (bytes not
  // bound for a GPU go there).
  virtual void place(uint32_t file, uint64_t offset, uint64_t len, char* slot, char* host_dst, bool ok) = 0;
  virtual void discard(char* slot) = 0;  // the read into this slot failed
  virtual void finish() = 0;  // waits until every placed byte has landed; rethrows
};

}  // namespace fw
