// The load side of the CUDA copy engine: chunks of a load that hold bytes of
// GPU-resident tensors go through pinned bounce slots and host-to-device
// copies on the engine's streams (stage/device_copy.hpp); host placements of
// the same load are copied out of the same slots.
#pragma once
#include <cstdint>
#include <memory>
#include <vector>

#include "read/chunk_placer.hpp"
#include "read/placements.hpp"
#include "stage/device_copy.hpp"
#include "stage/staging_pool.hpp"

namespace fw {

// Places the chunks of a load that hold placed bytes: such a chunk is read
// into a pinned bounce slot, verified, then copied host-to-device to every GPU
// destination it overlaps and memcpy'd to every host one; the rest of its
// bytes go to the file's host buffer. The slot returns to the pool when the
// copies have landed, so reading chunk k+1 overlaps copying chunk k and no
// full-size host copy of the checkpoint is made.
class DevicePlacer final : public ChunkPlacer {
 public:
  DevicePlacer(PlacementMap map, std::vector<StreamRef> callers, std::shared_ptr<StagingPool> bounce,
               std::shared_ptr<CopyStreams> streams, size_t max_pending);

  void begin() override;
  bool wants(uint32_t file, uint64_t offset, uint64_t len) const override { return map_.touches(file, offset, len); }
  bool covers(uint32_t file, uint64_t size) const override { return map_.covers(file, size); }
  std::vector<Placement> direct(uint32_t file) const override { return map_.direct(file); }
  char* acquire(const std::atomic<bool>* cancel) override;
  void prepare(uint32_t file, uint64_t offset, uint64_t len) override { map_.prefault_host(file, offset, len); }
  void place(uint32_t file, uint64_t offset, uint64_t len, char* slot, char* host_dst, bool ok) override;
  void discard(char* slot) override;
  void finish() override;
  bool copies_async() const override { return true; }

 private:
  const PlacementMap map_;
  std::vector<StreamRef> callers_;
  std::shared_ptr<StagingPool> bounce_;
  CopyPipeline pipe_;
};

}  // namespace fw
