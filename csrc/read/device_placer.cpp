#include "read/device_placer.hpp"

namespace fw {

DevicePlacer::DevicePlacer(PlacementMap map, std::vector<StreamRef> callers, std::shared_ptr<StagingPool> bounce,
                           std::shared_ptr<CopyStreams> streams, size_t max_pending)
    : map_(std::move(map)),
      callers_(std::move(callers)),
      bounce_(std::move(bounce)),
      pipe_(std::move(streams), CopyDirection::HostToDevice, max_pending) {}

void DevicePlacer::begin() { pipe_.order_after(callers_); }

char* DevicePlacer::acquire(const std::atomic<bool>* cancel) { return bounce_->acquire(cancel); }

void DevicePlacer::discard(char* slot) { bounce_->release(slot); }

void DevicePlacer::place(uint32_t file, uint64_t offset, uint64_t len, char* slot, char* host_dst, bool ok) {
  if (!ok || pipe_.failed()) {
    bounce_->release(slot);
    return;
  }
  std::vector<DeviceCopy> copies;
  copy_out(map_, file, offset, len, slot, host_dst, [&](const Placement& p, uint64_t a, uint64_t b) {
    copies.push_back(DeviceCopy{p.device, p.dst + (a - p.offset), slot + (a - offset), b - a});
  });
  if (copies.empty()) {  // host bytes only: the slot is free again now
    bounce_->release(slot);
    return;
  }
  auto pool = bounce_;
  pipe_.issue(copies, [pool, slot](bool) { pool->release(slot); });
}

void DevicePlacer::finish() { pipe_.finish(); }

}  // namespace fw
