// The staging pool: fixed-size, page-aligned slots carved from slabs that are
// allocated once per Writer and reused across saves (allocating and pinning
// tens of GiB takes seconds; a training loop must pay that once, not per save).
//
// Unbounded (max_bytes == 0): reserve() grows the pool to hold a whole save, so
// staging never waits for the disk. Bounded: at most max_bytes of slots exist;
// staging waits for written slots to come back, overlapping copy and write.
//
// Backing file (set_backing_file): slabs are then mapped shared from one file
// (on tmpfs: named shared memory), each at its own offset, so staged bytes
// outlive the process and slot_file_offset() says where a slot's bytes are.
// When the file cannot grow (a small /dev/shm), the pool says why once
// (backing_error()) and allocates private memory from then on.
//
// Thread-safe. Slabs can be page-locked through a hook (the CUDA runtime's
// cudaHostRegister) once, when they are created or when pinning is enabled.
// With a pin hook set, the pool grows in slabs of at most slab_bytes()
// (FLASHWRITE_PIN_SLAB_BYTES, default 1 GiB), each faulted in and registered
// on its own: a slab's slots are handed out as soon as it is ready (copies
// start while later slabs are still being pinned), and a failed registration
// leaves only that slab pageable (unpinned_bytes()).
//
// fork(): private slabs are MADV_DONTFORK (see AlignedBuffer::dont_fork), so a
// child process does not have them. The first call on the pool in a child
// forgets every slab the parent made (without unmapping: the addresses are not
// the child's) and starts empty, so a child that saves through an inherited
// Writer stages into memory of its own. A child never grows the parent's
// backing file: it stages into private memory, and backing_error() says why.
#pragma once
#include <atomic>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <chrono>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "core/aligned_buffer.hpp"

namespace fw {

struct PinHooks {
  std::function<bool(void*, size_t)> pin;  // returns true when the range is now page-locked
  std::function<void(void*)> unpin;
};

// How long a save waited for staging memory: the union of the waits of its
// threads (two threads waiting at once count once), by reason ("fault-in": a
// slab being faulted in; "pin": a slab being page-locked; "pool busy": every
// slot in use, by this save's writes or another save's).
class StagingWait {
 public:
  void begin(const char* reason);  // a thread starts waiting
  void end();                      // ... and stops
  void add(const char* reason, double seconds);  // a wait timed by the caller
  double seconds() const;
  std::string reason() const;  // the reason that took longest; "" when it never waited

 private:
  mutable std::mutex mu_;
  int waiters_ = 0;
  std::chrono::steady_clock::time_point since_;
  std::string reason_now_;
  std::map<std::string, double> by_;
  double total_ = 0;
};

class StagingPool {
 public:
  StagingPool(size_t slot_bytes, size_t max_bytes);
  ~StagingPool();

  size_t slot_bytes() const noexcept { return slot_bytes_; }
  size_t max_slots() const noexcept { return max_slots_; }  // 0 = unbounded
  size_t capacity_bytes() const;
  bool pinned() const;

  // Reserve `slots` slots for a job on top of every reservation still held,
  // growing the pool (one slab, capped by the bound), until unreserve(slots):
  // trim() frees nothing while a reservation is held, so a job that has
  // reserved but not yet acquired never waits for slots that trim() unmapped.
  // Returns true when the pool holds every slot reserved by all jobs: then each
  // can hold all of its slots at once (two saves staging at once on one pool,
  // each holding its slots until it is staged, would otherwise wait for each
  // other for good).
  // hold=false: prepare for a save to come: grow the pool to hold `slots`
  // (or what the reservations held need, if more) and keep no reservation.
  // A job that reserves meanwhile waits for the growth and then finds its
  // slots there, instead of being counted on top of the preparation's.
  // abort (optional): once it is true, a reserve() still waiting for a growth,
  // or faulting in its own slab of private memory, stops and throws ("save
  // cancelled"), the reservation undone; a slab it had begun joins the pool
  // unpinned, faulted in as far as it got (the rest faults in when used).
  // grow_later (hold only): the growth is not done here; *grow_later says how
  // many slots are to be added, by grow() on another thread (a GPU save's own
  // thread, so that its caller neither faults in nor pins). acquire() hands
  // out each slab's slots as it becomes ready. The return value is the same.
  bool reserve(size_t slots, bool hold = true, const std::atomic<bool>* abort = nullptr, size_t* grow_later = nullptr);
  // Adds the `slots` a reserve(grow_later) left to grow, slab by slab; returns
  // the seconds spent pinning. Aborted: throws ("save cancelled"), the slots
  // not yet grown given up.
  double grow(size_t slots, const std::atomic<bool>* abort);
  // Pins the slabs made before the pin hooks were set (set_pin_hooks(.., false)),
  // one at a time; a slab's free slots are not handed out while it is being
  // registered. Returns the seconds spent pinning.
  // Aborted (or the hooks gone), the slabs kept back are handed out unpinned.
  double pin_existing(const std::atomic<bool>* abort = nullptr);
  // Cheap (no pinning): keeps the free slots of the slabs pin_existing() is to
  // pin from being handed out until it has; called before the copies start.
  void claim_unpinned();
  void unreserve(size_t slots);
  // Blocks until a slot is free (returns it), *cancel becomes true or
  // interrupt() returns true (returns nullptr). interrupt is checked under the
  // pool's lock (it must not take a lock that is held around release()) each
  // time wake() or release() is called and every 20 ms: a waiter that has
  // other work which would free slots (a landed chunk to write) gets back to
  // it instead of starving the pool.
  // wait (optional): the time acquire() waits is added to it, with its reason.
  // Each slot is handed out once until it is released: a slot released while free
  // (it would be listed twice in the free list, and two chunks staged into it) or
  // found in the list while handed out is a fault of the pool's bookkeeping or of
  // its caller. It is not listed again; acquire() and check() throw
  // std::logic_error naming it from then on (the pool's slots can no longer be
  // trusted to be one chunk's each).
  char* acquire(const std::atomic<bool>* cancel, const std::function<bool()>& interrupt = {},
                StagingWait* wait = nullptr);
  void release(char* slot);
  // Throws std::logic_error if a fault of the slot bookkeeping was seen, or is seen
  // now in the whole free list (a slot listed twice, or listed while handed out).
  void check();
  // Wakes every acquire() to re-check its cancel flag and interrupt.
  void wake();
  // Frees every slab (only when no slot is in use or reserved). Returns bytes freed.
  size_t trim();

  // pin_now=false: the slabs made before are pinned later, by pin_existing().
  void set_pin_hooks(PinHooks hooks, bool pin_now = true);
  size_t slab_bytes() const noexcept { return slab_bytes_; }
  // Bytes of slabs whose registration failed (they stay pageable; copies to
  // them are slower, not wrong).
  uint64_t unpinned_bytes() const;
  // Seconds spent page-locking slabs so far (the pin hook's calls).
  double pin_seconds() const;
  // The page size the newest private slab got, and why (AlignedBuffer::
  // HugePageWatch), or empty before the first one.
  std::string pages() const;
  // Slabs created from now on prefer this NUMA node (mbind MPOL_PREFERRED before
  // they are faulted in): the GPU's node, so DMA does not cross the socket
  // link. -1: the kernel's default (first touch). numa_error() says why the
  // last placement failed, or is empty.
  void set_numa_node(int node);
  int numa_node() const;
  std::string numa_error() const;

  // Call before the first reserve(). The file is created (mode 0600) when the
  // first slab is; the caller names it and removes it.
  void set_backing_file(std::string path);
  // Offset in the backing file of `slot`'s bytes, or -1 when its slab is private.
  int64_t slot_file_offset(const char* slot) const;
  bool file_backed() const;         // every slab is in the backing file (and there is one)
  std::string backing_error() const;  // why the file could not grow, or empty

 private:
  struct Slab {
    AlignedBuffer mem;
    bool pinned = false;
    int64_t file_offset = -1;  // -1: private memory
    bool dont_fork = false;    // absent from a forked child
    bool pin_tried = false;    // the pin hook was called for it
    bool pinning = false;      // being registered by pin_existing(): its slots wait in `parked`
    std::vector<char*> parked;
    std::vector<uint8_t> out;  // per slot: handed out by acquire() and not yet released
  };
  // Grows `add` slots (already counted in growing_slots_), one slab at a time;
  // called and returns with lk held. Returns the seconds spent pinning.
  double grow_locked(std::unique_lock<std::mutex>& lk, size_t add, const std::atomic<bool>* abort);
  const char* wait_reason() const;  // under mu_
  void park(Slab& s);    // under mu_
  void unpark(Slab& s);  // under mu_
  // Called under mu_ by every entry point: in a forked child, drops what the
  // parent made. Returns true when it did so now.
  bool adopt_after_fork();
  bool owns(const char* slot) const;  // under mu_
  // Under mu_: the slot's handed-out flag; nullptr for an address that is no slot of this pool.
  uint8_t* out_flag(const char* slot);
  void note_fault(const char* what, const char* slot);  // under mu_: the first fault is kept
  // Faults in (on numa_node_ when set) and pins a new slab; called with mu_
  // released while busy_ is set. Returns the seconds spent pinning.
  // pages: what its HugePageWatch chose for a private slab.
  double fill_slab(Slab& s, const PinHooks& hooks, int node, std::string& numa_err, std::string& pages,
                   const std::atomic<bool>* abort);
  AlignedBuffer new_slab_memory(size_t bytes, int64_t& file_offset);

  const size_t slot_bytes_;
  const size_t max_slots_;
  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::vector<std::unique_ptr<Slab>> slabs_;
  std::vector<char*> free_;
  size_t total_slots_ = 0;
  size_t reservations_ = 0;
  size_t reserved_slots_ = 0;  // the sum of the reservations held
  PinHooks hooks_;
  std::string backing_path_, backing_error_;
  int backing_fd_ = -1;
  uint64_t backing_bytes_ = 0;  // the file's allocated length
  double pin_s_ = 0;
  int numa_node_ = -1;
  std::string numa_error_;
  std::string pages_;
  // A slab is being faulted in, pinned or unpinned with mu_ released (seconds
  // for tens of GiB): acquire() and release() of running jobs go on meanwhile;
  // reserve(), set_pin_hooks() and trim() wait for it (cv_), so one slab at a
  // time changes and a reserve() finds the slots the growth made.
  bool busy_ = false;
  size_t growing_slots_ = 0;  // reserved for growth, not yet in the pool
  size_t pinning_slabs_ = 0;  // slabs being registered by pin_existing()
  std::atomic<const char*> phase_{"fault-in"};  // what the slab being grown is at
  size_t slab_bytes_;  // with pin hooks: the most one slab may hold
  // pthread_atfork handlers: every live pool's lock is held across fork().
  static void before_fork();
  static void after_fork();
  int test_hold_us_ = 0;  // FLASHWRITE_TEST_POOL_LOCK_HOLD_US: release() holds mu_ this long
  // Test only, planting the faults check() is for: the Nth release() lists its slot
  // twice in the free list (FLASHWRITE_TEST_POOL_LIST_TWICE=N), or is made twice, as
  // by a caller that gives a slot back twice (FLASHWRITE_TEST_POOL_RELEASE_TWICE=N).
  long test_list_twice_ = 0, test_release_twice_ = 0, test_releases_ = 0;
  std::string fault_;  // the first fault of the slot bookkeeping seen, or empty
  int owner_pid_;       // the process the slabs belong to
  bool forked_ = false;  // adopted after a fork: release() checks its slots
};

}  // namespace fw
