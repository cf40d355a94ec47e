#include "read/placements.hpp"

#include <sys/mman.h>

#include <cstddef>
#include <stdexcept>

#include "core/aligned_buffer.hpp"

namespace fw {

PlacementMap::PlacementMap(std::vector<Placement> placements) {
  for (auto& p : placements) {
    if (!p.len) continue;
    if (p.offset + p.len < p.offset) throw std::invalid_argument("a placement wraps around");
    if (p.file >= by_file_.size()) by_file_.resize(p.file + 1);
    by_file_[p.file].push_back(p);
    has_device_ |= p.device >= 0;
  }
  placed_bytes_.assign(by_file_.size(), 0);
  for (size_t f = 0; f < by_file_.size(); ++f) {
    auto& v = by_file_[f];
    std::sort(v.begin(), v.end(), [](const Placement& a, const Placement& b) { return a.offset < b.offset; });
    for (size_t i = 0; i < v.size(); ++i) {
      if (i && v[i - 1].offset + v[i - 1].len > v[i].offset) throw std::invalid_argument("placements overlap");
      placed_bytes_[f] += v[i].len;
    }
  }
}

bool PlacementMap::touches(uint32_t file, uint64_t offset, uint64_t len) const {
  if (file >= by_file_.size()) return false;
  const auto& v = by_file_[file];
  auto it = first_ending_after(v, offset);
  return it != v.end() && it->offset < offset + len;
}

void PlacementMap::prefault_host(uint32_t file, uint64_t offset, uint64_t len) const noexcept {
#ifdef MADV_POPULATE_WRITE
  split(
      file, offset, len,
      [](const Placement& p, uint64_t a, uint64_t b) {
        if (p.device != -1) return;  // kDirect: faulted in by its own read
        // The pages holding the range: each is mapped, since the range is.
        auto lo = reinterpret_cast<uintptr_t>(p.dst + (a - p.offset)) / kAlign * kAlign;
        auto hi = round_up(reinterpret_cast<uintptr_t>(p.dst + (b - p.offset)), kAlign);
        madvise(reinterpret_cast<void*>(lo), hi - lo, MADV_POPULATE_WRITE);
      },
      [](uint64_t, uint64_t) {});
#else
  (void)file, (void)offset, (void)len;
#endif
}

std::vector<Placement> PlacementMap::direct(uint32_t file) const {
  std::vector<Placement> out;
  if (file < by_file_.size())
    for (const auto& p : by_file_[file])
      if (p.device == kDirect) out.push_back(p);
  return out;
}

bool PlacementMap::covers(uint32_t file, uint64_t size) const {
  // Disjoint ranges: they cover the file exactly when their lengths add up to
  // it and none reaches past its end.
  if (file >= by_file_.size() || by_file_[file].empty()) return false;
  const auto& last = by_file_[file].back();
  return placed_bytes_[file] == size && last.offset + last.len == size;
}

}  // namespace fw
