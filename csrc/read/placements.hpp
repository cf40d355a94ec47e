// Where the bytes of a load go when they do not stay in a whole-file buffer:
// byte ranges of the stripe files, each bound for GPU memory (device >= 0) or
// for host memory the caller owns (device -1). Shared by the placers
// (read/host_placer.hpp, read/device_placer.hpp), which differ only in how a
// verified chunk's bytes reach their destinations.
#pragma once
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

namespace fw {

struct Placement {
  uint32_t file;
  uint64_t offset, len;  // in the stripe file
  int device;            // -1: host memory (copied there); kDirect: read straight into it
  char* dst;             // len bytes, owned by the caller until the load is done
};

// A host placement the load reads into with O_DIRECT, no bounce slot and no
// copy: dst - (offset % 4096) is page-aligned and the caller's memory runs
// from there to the page boundary past dst + len (the file's edge pages, which
// a neighbour's read may fill again with the same bytes).
constexpr int kDirect = -2;

class PlacementMap {
 public:
  // Empty ranges are dropped; overlapping ones are refused (std::invalid_argument).
  explicit PlacementMap(std::vector<Placement> placements);

  bool touches(uint32_t file, uint64_t offset, uint64_t len) const;
  // Whether every byte of [0, size) of the file is placed: such a file needs no
  // whole-file buffer.
  bool covers(uint32_t file, uint64_t size) const;
  bool has_device() const { return has_device_; }
  // The kDirect placements of the file, in file order.
  std::vector<Placement> direct(uint32_t file) const;
  bool empty() const { return by_file_.empty(); }
  // Faults in the pages of the host destinations of [offset, offset + len)
  // (MADV_POPULATE_WRITE: no byte is written, so memory next to them that
  // others own is safe; nothing where the kernel lacks it).
  void prefault_host(uint32_t file, uint64_t offset, uint64_t len) const noexcept;

  // Splits [offset, offset + len) of the file: part(p, a, b) for each range
  // [a, b) placed by p, gap(a, b) for each range between them, in file order.
  template <class Part, class Gap>
  void split(uint32_t file, uint64_t offset, uint64_t len, Part&& part, Gap&& gap) const {
    uint64_t pos = offset;
    const uint64_t end = offset + len;
    if (file < by_file_.size()) {
      const auto& v = by_file_[file];
      for (auto it = first_ending_after(v, offset); it != v.end() && it->offset < end; ++it) {
        uint64_t a = std::max(pos, it->offset), b = std::min(end, it->offset + it->len);
        if (a > pos) gap(pos, a);
        part(*it, a, b);
        pos = b;
      }
    }
    if (pos < end) gap(pos, end);
  }

 private:
  static std::vector<Placement>::const_iterator first_ending_after(const std::vector<Placement>& v, uint64_t offset) {
    return std::upper_bound(v.begin(), v.end(), offset,
                            [](uint64_t off, const Placement& p) { return off < p.offset + p.len; });
  }

  std::vector<std::vector<Placement>> by_file_;  // sorted by offset, disjoint
  std::vector<uint64_t> placed_bytes_;            // per file
  bool has_device_ = false;
};

// Copies the host-bound parts of a verified chunk (slot holds file bytes
// [offset, offset + len)) to their destinations and the unplaced bytes to
// host_dst (when there is one); calls device(p, a, b) for each range bound for a GPU.
template <class Device>
void copy_out(const PlacementMap& map, uint32_t file, uint64_t offset, uint64_t len, const char* slot, char* host_dst,
              Device&& device) {
  map.split(
      file, offset, len,
      [&](const Placement& p, uint64_t a, uint64_t b) {
        if (p.device == -1)
          std::memcpy(p.dst + (a - p.offset), slot + (a - offset), b - a);
        else if (p.device >= 0)
          device(p, a, b);  // kDirect: its own read filled it
      },
      [&](uint64_t a, uint64_t b) {
        if (host_dst) std::memcpy(host_dst + (a - offset), slot + (a - offset), b - a);
      });
}

}  // namespace fw
