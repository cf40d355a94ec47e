// Host placements of a load: chunks holding bytes of CPU tensors that own
// their memory are read into bounce slots, verified, then copied out to each
// tensor on the load's verifier threads, so the copies (and the page faults of
// fresh destinations) overlap later reads and no whole-file buffer is held.
#pragma once
#include <condition_variable>
#include <cstdint>
#include <mutex>
#include <vector>

#include "core/aligned_buffer.hpp"
#include "read/chunk_placer.hpp"
#include "read/placements.hpp"

namespace fw {

class HostPlacer final : public ChunkPlacer {
 public:
  // Every placement is in host memory (device -1). `slots` bounce slots of
  // slot_bytes (the load's chunk size) are mapped now, in transparent huge pages where
  // the kernel gives them and they fault in fast (HugePageWatch), and faulted
  // in on first use.
  HostPlacer(PlacementMap map, uint64_t slot_bytes, size_t slots);

  void begin() override {}
  bool wants(uint32_t file, uint64_t offset, uint64_t len) const override { return map_.touches(file, offset, len); }
  bool covers(uint32_t file, uint64_t size) const override { return map_.covers(file, size); }
  std::vector<Placement> direct(uint32_t file) const override { return map_.direct(file); }
  char* acquire(const std::atomic<bool>* cancel) override;
  void prepare(uint32_t file, uint64_t offset, uint64_t len) override { map_.prefault_host(file, offset, len); }
  void place(uint32_t file, uint64_t offset, uint64_t len, char* slot, char* host_dst, bool ok) override;
  void discard(char* slot) override { release(slot); }
  void finish() override {}

 private:
  void release(char* slot);

  const PlacementMap map_;
  const uint64_t slot_bytes_;
  AlignedBuffer mem_;
  HugePageWatch pages_;  // after mem_: it watches mem_
  std::mutex mu_;
  std::condition_variable cv_;
  std::vector<char*> free_;  // last in, first out: a warm slot is reused first
  std::vector<char> faulted_;  // per slot
};

}  // namespace fw
