// The staging pool: fixed-size, page-aligned slots carved from slabs that are
// allocated once per Writer and reused across saves (allocating and pinning
// tens of GiB takes seconds; a training loop must pay that once, not per save).
//
// Unbounded (max_bytes == 0): reserve() grows the pool to hold a whole save, so
// staging never waits for the disk. Bounded: at most max_bytes of slots exist;
// staging waits for written slots to come back, overlapping copy and write.
//
// Thread-safe. Slabs can be page-locked through a hook (the CUDA runtime's
// cudaHostRegister) once, when they are created or when pinning is enabled.
#pragma once
#include <atomic>
#include <condition_variable>
#include <cstddef>
#include <functional>
#include <memory>
#include <mutex>
#include <vector>

#include "core/aligned_buffer.hpp"

namespace fw {

struct PinHooks {
  std::function<bool(void*, size_t)> pin;  // returns true when the range is now page-locked
  std::function<void(void*)> unpin;
};

class StagingPool {
 public:
  StagingPool(size_t slot_bytes, size_t max_bytes);
  ~StagingPool();

  size_t slot_bytes() const noexcept { return slot_bytes_; }
  size_t max_slots() const noexcept { return max_slots_; }  // 0 = unbounded
  size_t capacity_bytes() const;
  bool pinned() const;

  // Make sure up to `slots` slots exist (capped by the bound), allocating one
  // slab, and hold them for a job until unreserve(): trim() frees nothing while
  // a reservation is held, so a job that has reserved but not yet acquired
  // never waits for slots that trim() unmapped.
  void reserve(size_t slots);
  void unreserve();
  // Blocks until a slot is free (returns it), *cancel becomes true or
  // interrupt() returns true (returns nullptr). interrupt is checked under the
  // pool's lock (it must not take a lock that is held around release()) each
  // time wake() or release() is called and every 20 ms: a waiter that has
  // other work which would free slots (a landed chunk to write) gets back to
  // it instead of starving the pool.
  char* acquire(const std::atomic<bool>* cancel, const std::function<bool()>& interrupt = {});
  void release(char* slot);
  // Wakes every acquire() to re-check its cancel flag and interrupt.
  void wake();
  // Frees every slab (only when no slot is in use or reserved). Returns bytes freed.
  size_t trim();

  void set_pin_hooks(PinHooks hooks);

 private:
  struct Slab {
    AlignedBuffer mem;
    bool pinned = false;
  };
  void pin_slab(Slab& s);

  const size_t slot_bytes_;
  const size_t max_slots_;
  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::vector<std::unique_ptr<Slab>> slabs_;
  std::vector<char*> free_;
  size_t total_slots_ = 0;
  size_t reservations_ = 0;
  PinHooks hooks_;
};

}  // namespace fw
