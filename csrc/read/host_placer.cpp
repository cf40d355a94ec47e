#include "read/host_placer.hpp"

#include <chrono>

#include "core/defaults.hpp"

namespace fw {

HostPlacer::HostPlacer(PlacementMap map, uint64_t slot_bytes, size_t slots)
    : map_(std::move(map)),
      slot_bytes_(slot_bytes),
      mem_(AlignedBuffer::huge_pages(slot_bytes * slots)),
      pages_(mem_),
      faulted_(slots, 0) {
  for (size_t i = slots; i-- > 0;) free_.push_back(mem_.data() + i * slot_bytes_);
}

char* HostPlacer::acquire(const std::atomic<bool>* cancel) {
  char* slot;
  bool fault;
  {
    std::unique_lock<std::mutex> lk(mu_);
    while (free_.empty()) {
      if (cancel && cancel->load()) return nullptr;
      cv_.wait_for(lk, std::chrono::milliseconds(defaults::kPoolPollMs));
    }
    if (cancel && cancel->load()) return nullptr;
    slot = free_.back();
    free_.pop_back();
    size_t i = static_cast<size_t>(slot - mem_.data()) / slot_bytes_;
    fault = !faulted_[i];
    faulted_[i] = 1;
  }
  // On the reading thread while earlier reads are in flight, not in the
  // kernel's direct-I/O path where a fault stalls the request. Small loads
  // touch only the slots they use.
  if (fault) pages_.fault_in(static_cast<size_t>(slot - mem_.data()), slot_bytes_);
  return slot;
}

void HostPlacer::release(char* slot) {
  {
    std::lock_guard<std::mutex> lk(mu_);
    free_.push_back(slot);
  }
  cv_.notify_one();
}

void HostPlacer::place(uint32_t file, uint64_t offset, uint64_t len, char* slot, char* host_dst, bool ok) {
  // Verified before it is copied: damaged bytes never reach a tensor.
  if (ok) copy_out(map_, file, offset, len, slot, host_dst, [](const Placement&, uint64_t, uint64_t) {});
  release(slot);
}

}  // namespace fw
