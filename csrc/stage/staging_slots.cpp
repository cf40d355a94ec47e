// The staging pool's slot bookkeeping: each slot is handed to one chunk at a time.
// A slot listed twice in the free list would have two chunks staged into it, one
// written under the other's name and checksum; before these checks only the strict
// stand-in CUDA runtime noticed (issue 44 item 8a). acquire() and release() keep a
// handed-out flag per slot (StagingPool::Slab::out) and note a fault here;
// check() scans the whole free list once per save.
#include <algorithm>
#include <cstdio>
#include <stdexcept>
#include <string>
#include <vector>

#include "stage/staging_pool.hpp"

namespace fw {

void StagingPool::check() {
  std::lock_guard<std::mutex> lk(mu_);
  if (fault_.empty()) {
    // The whole invariant, O(n log n) in the free slots: once per job, not per slot.
    std::vector<char*> listed(free_);
    for (auto& s : slabs_) listed.insert(listed.end(), s->parked.begin(), s->parked.end());
    std::sort(listed.begin(), listed.end());
    auto twice = std::adjacent_find(listed.begin(), listed.end());
    if (twice != listed.end()) note_fault("is listed twice in the free list (two chunks would be staged into it)", *twice);
    for (char* p : listed) {
      if (!fault_.empty()) break;
      const uint8_t* out = out_flag(p);
      if (!out || *out) note_fault(out ? "is in the free list while handed out" : "in the free list is no slot of this pool", p);
    }
  }
  if (!fault_.empty()) throw std::logic_error(fault_);
}

uint8_t* StagingPool::out_flag(const char* slot) {
  for (auto& s : slabs_) {
    const char* base = s->mem.data();
    if (slot < base || slot >= base + s->mem.capacity()) continue;
    const size_t i = static_cast<size_t>(slot - base) / slot_bytes_;
    return (slot - base) % slot_bytes_ == 0 && i < s->out.size() ? &s->out[i] : nullptr;
  }
  return nullptr;
}

void StagingPool::note_fault(const char* what, const char* slot) {
  if (!fault_.empty()) return;
  char addr[32];
  std::snprintf(addr, sizeof addr, "%p", static_cast<const void*>(slot));
  fault_ = std::string("staging pool: slot ") + addr + " " + what +
           "; a bug in flashwrite: this pool's saves fail from now on (a new Writer makes a new pool)";
  cv_.notify_all();
}

}  // namespace fw
