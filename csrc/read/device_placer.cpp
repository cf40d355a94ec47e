#include "read/device_placer.hpp"

#include <algorithm>
#include <cstring>
#include <stdexcept>

namespace fw {

DevicePlacer::DevicePlacer(std::vector<Placement> placements, std::vector<StreamRef> callers,
                           std::shared_ptr<StagingPool> bounce, std::shared_ptr<CopyStreams> streams,
                           size_t max_pending)
    : callers_(std::move(callers)),
      bounce_(std::move(bounce)),
      pipe_(std::move(streams), CopyDirection::HostToDevice, max_pending) {
  for (auto& p : placements) {
    if (!p.len) continue;
    if (p.file >= by_file_.size()) by_file_.resize(p.file + 1);
    by_file_[p.file].push_back(p);
  }
  for (auto& v : by_file_) {
    std::sort(v.begin(), v.end(), [](const Placement& a, const Placement& b) { return a.offset < b.offset; });
    for (size_t i = 1; i < v.size(); ++i)
      if (v[i - 1].offset + v[i - 1].len > v[i].offset) throw std::invalid_argument("device placements overlap");
  }
}

void DevicePlacer::begin() { pipe_.order_after(callers_); }

bool DevicePlacer::wants(uint32_t file, uint64_t offset, uint64_t len) const {
  if (file >= by_file_.size()) return false;
  const auto& v = by_file_[file];
  // First placement that ends after `offset`.
  auto it = std::upper_bound(v.begin(), v.end(), offset,
                             [](uint64_t off, const Placement& p) { return off < p.offset + p.len; });
  return it != v.end() && it->offset < offset + len;
}

char* DevicePlacer::acquire(const std::atomic<bool>* cancel) { return bounce_->acquire(cancel); }

void DevicePlacer::discard(char* slot) { bounce_->release(slot); }

void DevicePlacer::place(uint32_t file, uint64_t offset, uint64_t len, char* slot, char* host_dst, bool ok) {
  if (!ok || pipe_.failed() || file >= by_file_.size()) {
    bounce_->release(slot);
    return;
  }
  const auto& v = by_file_[file];
  auto it = std::upper_bound(v.begin(), v.end(), offset,
                             [](uint64_t off, const Placement& p) { return off < p.offset + p.len; });
  std::vector<DeviceCopy> copies;
  uint64_t pos = offset, end = offset + len;
  for (; it != v.end() && it->offset < end; ++it) {
    uint64_t a = std::max(pos, it->offset), b = std::min(end, it->offset + it->len);
    if (a > pos) std::memcpy(host_dst + (pos - offset), slot + (pos - offset), a - pos);  // bytes that stay on the host
    copies.push_back(DeviceCopy{it->device, it->dst + (a - it->offset), slot + (a - offset), b - a});
    pos = b;
  }
  if (pos < end) std::memcpy(host_dst + (pos - offset), slot + (pos - offset), end - pos);
  auto pool = bounce_;
  pipe_.issue(copies, [pool, slot](bool) { pool->release(slot); });
}

void DevicePlacer::finish() { pipe_.finish(); }

}  // namespace fw
