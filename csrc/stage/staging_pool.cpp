#include "stage/staging_pool.hpp"

#include "core/defaults.hpp"
#include "core/error.hpp"

#include <fcntl.h>
#include <pthread.h>
#include <sys/file.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <mutex>
#include <set>
#include <stdexcept>
#include <system_error>
#include <thread>
#include <vector>

namespace fw {

// fork(): a copy or write thread may hold a pool's lock at the moment another
// thread forks (DataLoader workers fork during saves); the child would inherit
// it locked, with no thread to unlock it, and hang at its first save. The
// pthread_atfork handlers take every live pool's lock before the fork and give
// it back on both sides, so the child starts with them free.
namespace {
struct PoolRegistry {
  std::mutex mu;
  std::set<StagingPool*> pools;
};
PoolRegistry& registry() {
  static auto* r = new PoolRegistry();  // never destroyed: a fork at exit still finds it
  return *r;
}
}  // namespace

void StagingPool::before_fork() {
  registry().mu.lock();
  for (StagingPool* p : registry().pools) p->mu_.lock();
}

void StagingPool::after_fork() {
  for (StagingPool* p : registry().pools) p->mu_.unlock();
  registry().mu.unlock();
}

StagingPool::StagingPool(size_t slot_bytes, size_t max_bytes)
    : slot_bytes_(slot_bytes),
      max_slots_(max_bytes ? std::max<size_t>(2, max_bytes / slot_bytes) : 0),
      slab_bytes_(defaults::kPinSlabBytes),
      owner_pid_(::getpid()) {
  if (slot_bytes == 0 || slot_bytes % kAlign) throw std::invalid_argument("chunk_bytes must be a positive multiple of 4096");
  if (const char* h = std::getenv("FLASHWRITE_TEST_POOL_LOCK_HOLD_US")) test_hold_us_ = std::atoi(h);
  if (const char* n = std::getenv("FLASHWRITE_TEST_POOL_LIST_TWICE")) test_list_twice_ = std::atol(n);
  if (const char* n = std::getenv("FLASHWRITE_TEST_POOL_RELEASE_TWICE")) test_release_twice_ = std::atol(n);
  uint64_t slab = defaults::kPinSlabBytes;
  if (const char* v = std::getenv("FLASHWRITE_PIN_SLAB_BYTES"); v && *v) {
    char* end = nullptr;
    const unsigned long long n = std::strtoull(v, &end, 10);
    if (*end || n == 0)
      throw std::invalid_argument(std::string("FLASHWRITE_PIN_SLAB_BYTES=") + v + ": expected a positive number of bytes");
    slab = n;
  }
  slab_bytes_ = static_cast<size_t>(slab);
  static std::once_flag once;
  std::call_once(once, [] { pthread_atfork(&StagingPool::before_fork, &StagingPool::after_fork, &StagingPool::after_fork); });
  std::lock_guard<std::mutex> lk(registry().mu);
  registry().pools.insert(this);
}

StagingPool::~StagingPool() {
  {
    std::lock_guard<std::mutex> reg(registry().mu);
    registry().pools.erase(this);
  }
  std::lock_guard<std::mutex> lk(mu_);
  adopt_after_fork();
  for (auto& s : slabs_)
    if (s->pinned && hooks_.unpin) hooks_.unpin(s->mem.data());
  if (backing_fd_ >= 0) ::close(backing_fd_);
}

bool StagingPool::adopt_after_fork() {
  const int pid = ::getpid();
  if (pid == owner_pid_) return false;
  for (auto& s : slabs_)
    if (s->dont_fork) s->mem.forget();  // not mapped here; a shared slab is, and is unmapped
  slabs_.clear();
  free_.clear();
  total_slots_ = reservations_ = reserved_slots_ = 0;  // the parent's jobs do not run here
  busy_ = false;  // a growth in a thread of the parent's does not continue here
  growing_slots_ = pinning_slabs_ = 0;
  if (backing_fd_ >= 0) {
    ::close(backing_fd_);  // the parent's descriptor keeps its lock
    backing_fd_ = -1;
    backing_bytes_ = 0;
  }
  if (!backing_path_.empty() && backing_error_.empty())
    backing_error_ = "the shared staging file " + backing_path_ + " belongs to process " + std::to_string(owner_pid_) +
                     ", of which this process is a fork: staging into private memory instead";
  // CUDA cannot be used in a child forked after it was initialised: the
  // parent's pin hooks would call cudaSetDevice and cudaHostRegister here.
  hooks_ = PinHooks{};
  owner_pid_ = pid;
  forked_ = true;
  return true;
}

void StagingPool::set_backing_file(std::string path) {
  std::lock_guard<std::mutex> lk(mu_);
  backing_path_ = std::move(path);
}

std::string StagingPool::backing_error() const {
  std::lock_guard<std::mutex> lk(mu_);
  const_cast<StagingPool*>(this)->adopt_after_fork();
  return backing_error_;
}

bool StagingPool::file_backed() const {
  std::lock_guard<std::mutex> lk(mu_);
  const_cast<StagingPool*>(this)->adopt_after_fork();
  if (backing_path_.empty() || slabs_.empty()) return false;
  for (auto& s : slabs_)
    if (s->file_offset < 0) return false;
  return true;
}

int64_t StagingPool::slot_file_offset(const char* slot) const {
  std::lock_guard<std::mutex> lk(mu_);
  const_cast<StagingPool*>(this)->adopt_after_fork();
  for (auto& s : slabs_) {
    const char* base = s->mem.data();
    if (slot >= base && slot < base + s->mem.capacity())
      return s->file_offset < 0 ? -1 : s->file_offset + (slot - base);
  }
  return -1;
}

namespace {
std::string prefer_node(void* p, size_t n, int node);
}  // namespace

// Called under mu_. The file's blocks are allocated up front (fallocate): a
// full tmpfs then says ENOSPC here instead of SIGBUS on the first fault. The
// range is mapped and given its NUMA policy first: on tmpfs the policy of a
// shared mapping is the file's, and fallocate allocates the pages by it (set
// after, as fill_slab does for private slabs, it would move nothing).
AlignedBuffer StagingPool::new_slab_memory(size_t bytes, int64_t& file_offset) {
  file_offset = -1;
  if (!backing_path_.empty() && backing_error_.empty()) {
    const std::string& path = backing_path_;
    try {
      if (backing_fd_ < 0) {
        backing_fd_ = ::open(path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0600);
        if (backing_fd_ < 0) throw_errno(errno, "create shared staging file", path);
        // Held while this pool may write the file: a restore adopts a pool's
        // pages (copy-on-write, local.py) only when it can take this lock.
        if (::flock(backing_fd_, LOCK_EX | LOCK_NB) != 0) { /* a new name: nobody else holds it */ }
      }
      const uint64_t off = backing_bytes_;
      AlignedBuffer mem = AlignedBuffer::map_shared(backing_fd_, off, bytes);
      // Its error, if any, is fill_slab's to report (it sets the policy again).
      (void)prefer_node(mem.data(), mem.capacity(), numa_node_);
      int rc;
      do rc = ::posix_fallocate(backing_fd_, static_cast<off_t>(off), static_cast<off_t>(bytes));
      while (rc == EINTR);
      if (rc != 0) {
        // Give back what a partial allocation took (tmpfs may keep it).
        if (::ftruncate(backing_fd_, static_cast<off_t>(off)) != 0) { /* best effort */ }
        throw_errno(rc, "allocate shared staging memory", path, static_cast<int64_t>(off), static_cast<int64_t>(bytes));
      }
      backing_bytes_ = off + bytes;
      file_offset = static_cast<int64_t>(off);
      return mem;
    } catch (const std::exception& e) {
      backing_error_ = e.what();
    }
  }
  // Huge pages where THP allows: every save's O_DIRECT writes go out of these
  // slots, in requests that 4 KiB pages would cut at the device's segment limit
  // (254 pages on virtio-blk), and the kernel pins 512x fewer pages per write.
  // 2 GiB on the benchmark VM: stall 0.24-0.27 s against 0.30-0.33 s, durable
  // 2.8-3.0 s against 3.1-3.5 s. Unless they fault in slowly: fill_slab()
  // watches (HugePageWatch; 2 GiB there took 10-15 s in huge pages, 0.6 s in
  // 4 KiB pages), and reserve() faults in before the first save when asked to.
  return AlignedBuffer::huge_pages(bytes);
}

size_t StagingPool::capacity_bytes() const {
  std::lock_guard<std::mutex> lk(mu_);
  const_cast<StagingPool*>(this)->adopt_after_fork();
  return total_slots_ * slot_bytes_;
}

bool StagingPool::pinned() const {
  std::lock_guard<std::mutex> lk(mu_);
  const_cast<StagingPool*>(this)->adopt_after_fork();
  if (slabs_.empty()) return false;
  for (auto& s : slabs_)
    if (!s->pinned) return false;
  return true;
}

std::string StagingPool::pages() const {
  std::lock_guard<std::mutex> lk(mu_);
  return pages_;
}

namespace {

// A slab is faulted in in steps of this size, each thread checking for an abort
// between steps: 32 MiB take ~10 ms at the ~3 GB/s one core faults in.
constexpr size_t kAbortStep = size_t{32} << 20;

// mbind(MPOL_PREFERRED) through the system call (no libnuma): pages faulted in
// from now on come from `node` while it has memory, else from any node.
std::string prefer_node(void* p, size_t n, int node) {
  constexpr int kMaxNodes = 1024;
  constexpr int kPreferred = 1;  // MPOL_PREFERRED
  if (node < 0) return {};
  if (node >= kMaxNodes) return "NUMA node " + std::to_string(node) + " is out of range";
  unsigned long mask[kMaxNodes / (8 * sizeof(unsigned long))] = {};
  mask[node / (8 * sizeof(unsigned long))] |= 1UL << (node % (8 * sizeof(unsigned long)));
  if (::syscall(SYS_mbind, p, n, kPreferred, mask, static_cast<unsigned long>(kMaxNodes + 1), 0u) == 0) return {};
  const int e = errno;
  return "mbind(MPOL_PREFERRED, node " + std::to_string(node) + ") of " + std::to_string(n) +
         " bytes: " + std::strerror(e) + " (errno " + std::to_string(e) + "); the pages come from any node";
}

}  // namespace

double StagingPool::fill_slab(Slab& s, const PinHooks& hooks, int node, std::string& numa_err, std::string& pages,
                              const std::atomic<bool>* abort) {
  numa_err = prefer_node(s.mem.data(), s.mem.capacity(), node);
  // Faulted in now, in parallel: every slot is then resident for good, so
  // later saves neither pay for page faults nor grow the process (slots are
  // reused last-in-first-out, and a save may touch only some of them). Private
  // slabs keep huge pages unless they fault in slowly here (HugePageWatch); a
  // shared file's pages are the file system's.
  std::unique_ptr<HugePageWatch> watch;
  if (s.file_offset < 0) watch = std::make_unique<HugePageWatch>(s.mem);
  // In steps of kAbortStep, so that an abort (Ctrl-C in a first save) lands within one step.
  auto fault = [&](size_t off, size_t len) {
    for (size_t at = off, end = std::min(off + len, s.mem.capacity()); at < end; at += kAbortStep) {
      if (abort && abort->load()) return;
      const size_t n = std::min(kAbortStep, end - at);
      watch ? watch->fault_in(at, n) : s.mem.prefault(at, n);
    }
  };
  const size_t bytes = s.mem.capacity();
  const unsigned n = defaults::cpu_threads(defaults::kPrefaultMaxThreads);
  const size_t part = round_up((bytes + n - 1) / n, kAlign);
  std::vector<std::thread> faulters;
  unsigned i = 0;
  try {
    for (; i < n && i * part < bytes; ++i) faulters.emplace_back([&, i] { fault(i * part, part); });
  } catch (const std::system_error&) {
    // No thread to spare: fault the rest in here (a joinable thread must not
    // be destroyed, so never leave this block without the joins below).
    for (; i < n && i * part < bytes; ++i) fault(i * part, part);
  }
  for (auto& t : faulters) t.join();
  // Aborted: the slab joins the pool as it is (freeing GiBs just faulted in would
  // take longer than the abort may), unpinned; the rest faults in when used.
  if (abort && abort->load()) return 0;
  if (watch) pages = watch->why();
  if (!hooks.pin) return 0;
  phase_ = "pin";
  const auto t0 = std::chrono::steady_clock::now();
  s.pin_tried = true;
  s.pinned = hooks.pin(s.mem.data(), s.mem.capacity());
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

bool StagingPool::reserve(size_t slots, bool hold, const std::atomic<bool>* abort, size_t* grow_later) {
  std::unique_lock<std::mutex> lk(mu_);
  adopt_after_fork();
  if (!hold) grow_later = nullptr;
  // Not held: the pool is to hold `slots` for a save to come, or what the
  // reservations held now need if that is more (never the sum of the two).
  const size_t held = hold ? 0 : slots;
  if (hold) ++reservations_;
  reserved_slots_ += slots - held;
  struct Undo {  // the reservation does not outlive a failed allocation (runs with mu_ held)
    StagingPool* pool;
    size_t slots;
    ~Undo() {
      if (pool) --pool->reservations_, pool->reserved_slots_ -= slots;
    }
  } undo{hold ? this : nullptr, slots};
  // A growth under way may already hold what this reservation needs (waited
  // for in slices, to see abort). A growth left to grow() is counted instead.
  auto aborted = [&] { return abort && abort->load(); };
  if (!grow_later)
    while (!cv_.wait_for(lk, std::chrono::milliseconds(20), [&] { return !busy_ && !growing_slots_; }))
      if (aborted()) throw std::runtime_error("save cancelled");
  size_t want = std::max(reserved_slots_, held);
  if (max_slots_) want = std::min(want, max_slots_);
  const size_t have = total_slots_ + growing_slots_;
  const size_t add = want > have ? want - have : 0;
  const bool whole = std::max(have, want) >= reserved_slots_;
  growing_slots_ += add;
  if (grow_later) {
    *grow_later = add;
    undo.pool = nullptr;
    return whole;
  }
  if (add) grow_locked(lk, add, abort);
  if (aborted()) throw std::runtime_error("save cancelled");  // the reservation is undone (undo)
  undo.pool = nullptr;
  return total_slots_ >= reserved_slots_;
}

double StagingPool::grow(size_t slots, const std::atomic<bool>* abort) {
  std::unique_lock<std::mutex> lk(mu_);
  if (adopt_after_fork() || !slots) return 0;
  return grow_locked(lk, slots, abort);
}

double StagingPool::grow_locked(std::unique_lock<std::mutex>& lk, size_t add, const std::atomic<bool>* abort) {
  struct Left {  // the slots not grown (an abort, a failure) are given up (runs with mu_ held)
    StagingPool* pool;
    size_t n;
    ~Left() {
      pool->growing_slots_ -= std::min(n, pool->growing_slots_);
      pool->cv_.notify_all();
    }
  } left{this, add};
  auto aborted = [&] { return abort && abort->load(); };
  double pin_total = 0;
  while (left.n) {
    // One slab at a time changes (another growth, a pinning, a trim).
    while (!cv_.wait_for(lk, std::chrono::milliseconds(20), [&] { return !busy_; }))
      if (aborted()) throw std::runtime_error("save cancelled");
    if (aborted()) throw std::runtime_error("save cancelled");
    // Pinned slabs are bounded: each is registered on its own (a failure leaves
    // only it pageable), and copies start into the first while the next pins.
    const size_t per = hooks_.pin ? std::max<size_t>(1, slab_bytes_ / slot_bytes_) : left.n;
    const size_t n = std::min(per, left.n);
    auto slab = std::make_unique<Slab>();
    slab->mem = new_slab_memory(n * slot_bytes_, slab->file_offset);  // under mu_: it may grow the backing file
    // Before it is faulted in or pinned: a fork from then on leaves it out.
    if (slab->file_offset < 0) slab->dont_fork = slab->mem.dont_fork();
    // Faulting and pinning tens of GiB take seconds: not under the lock, so the
    // jobs running on this pool acquire and release their slots meanwhile.
    const PinHooks hooks = hooks_;
    const int node = numa_node_;
    std::string numa_err, pages;
    double pin_s = 0;
    busy_ = true;
    phase_ = "fault-in";
    lk.unlock();
    try {
      // A slab of the pool's file is faulted in whole: its offset in the file is spent.
      pin_s = fill_slab(*slab, hooks, node, numa_err, pages, slab->file_offset < 0 ? abort : nullptr);
    } catch (...) {
      lk.lock();
      busy_ = false;
      throw;
    }
    lk.lock();
    busy_ = false;
    pin_s_ += pin_s;
    pin_total += pin_s;
    if (node >= 0) numa_error_ = numa_err;
    if (!pages.empty()) pages_ = pages;
    for (size_t i = 0; i < n; ++i) free_.push_back(slab->mem.data() + i * slot_bytes_);
    slab->out.assign(n, 0);
    total_slots_ += n;
    growing_slots_ -= n;
    left.n -= n;
    slabs_.push_back(std::move(slab));
    cv_.notify_all();
    if (aborted()) throw std::runtime_error("save cancelled");
  }
  return pin_total;
}

void StagingPool::set_numa_node(int node) {
  std::lock_guard<std::mutex> lk(mu_);
  numa_node_ = node;
}

int StagingPool::numa_node() const {
  std::lock_guard<std::mutex> lk(mu_);
  return numa_node_;
}

std::string StagingPool::numa_error() const {
  std::lock_guard<std::mutex> lk(mu_);
  return numa_error_;
}

void StagingPool::unreserve(size_t slots) {
  std::lock_guard<std::mutex> lk(mu_);
  if (adopt_after_fork()) return;  // a reservation of the parent's
  if (reservations_) --reservations_;
  reserved_slots_ -= std::min(slots, reserved_slots_);
}

char* StagingPool::acquire(const std::atomic<bool>* cancel, const std::function<bool()>& interrupt,
                           StagingWait* wait) {
  std::unique_lock<std::mutex> lk(mu_);
  adopt_after_fork();
  for (;;) {
    if (cancel && cancel->load()) return nullptr;
    if (!fault_.empty()) throw std::logic_error(fault_);
    if (!free_.empty()) {
      char* p = free_.back();
      free_.pop_back();
      uint8_t* out = out_flag(p);
      if (!out || *out) {
        note_fault("was found in the free list while handed out (listed twice: two chunks would be staged into it)", p);
        throw std::logic_error(fault_);
      }
      *out = 1;
      return p;
    }
    if (interrupt && interrupt()) return nullptr;
    // Poll the cancel flag too: it is set without a wake() by some callers.
    if (wait) wait->begin(wait_reason());
    cv_.wait_for(lk, std::chrono::milliseconds(defaults::kPoolPollMs));
    if (wait) wait->end();
  }
}

void StagingPool::release(char* slot) {
  bool again = false;
  {
    std::lock_guard<std::mutex> lk(mu_);
    if ((adopt_after_fork() || forked_) && !owns(slot)) return;  // a slot of the parent's
    uint8_t* out = out_flag(slot);
    if (!out || !*out) {  // never listed twice: the fault is reported instead
      note_fault(out ? "was released while free (two chunks would be staged into it)" : "is no slot of this pool", slot);
      return;
    }
    *out = 0;
    const long nth = ++test_releases_;
    again = nth == test_release_twice_;
    if (nth == test_list_twice_) free_.push_back(slot);  // test: the fault acquire() must see
    bool parked = false;
    if (pinning_slabs_)  // a slot of a slab being registered waits for the registration
      for (auto& s : slabs_)
        if (s->pinning && slot >= s->mem.data() && slot < s->mem.data() + s->mem.capacity()) {
          s->parked.push_back(slot);
          parked = true;
        }
    if (!parked) free_.push_back(slot);
    // Test only: the lock is held a while, so a fork from another thread finds it taken.
    if (test_hold_us_) std::this_thread::sleep_for(std::chrono::microseconds(test_hold_us_));
  }
  // All waiters: one of them may be waiting only for its interrupt and would
  // swallow a notify_one meant for a waiter that needs the slot.
  cv_.notify_all();
  if (again) release(slot);  // test: a caller that gives the slot back twice
}

void StagingPool::wake() {
  { std::lock_guard<std::mutex> lk(mu_); }
  cv_.notify_all();
}

size_t StagingPool::trim() {
  std::unique_lock<std::mutex> lk(mu_);
  adopt_after_fork();
  if (busy_ || growing_slots_ || reservations_ || free_.size() != total_slots_) return 0;  // reserved, in use or growing
  size_t freed = total_slots_ * slot_bytes_;
  std::vector<std::unique_ptr<Slab>> gone = std::move(slabs_);
  slabs_.clear();
  free_.clear();
  total_slots_ = 0;
  // Unregistering costs what registering did: not under the lock.
  const PinHooks hooks = hooks_;
  busy_ = true;
  lk.unlock();
  for (auto& s : gone)
    if (s->pinned && hooks.unpin) hooks.unpin(s->mem.data());
  gone.clear();  // unmapped
  lk.lock();
  busy_ = false;
  // The file's pages are the memory (tmpfs): give them back too.
  if (backing_fd_ >= 0 && backing_bytes_ && ::ftruncate(backing_fd_, 0) == 0) backing_bytes_ = 0;
  cv_.notify_all();
  return freed;
}

bool StagingPool::owns(const char* slot) const {
  for (auto& s : slabs_)
    if (slot >= s->mem.data() && slot < s->mem.data() + s->mem.capacity()) return true;
  return false;
}

}  // namespace fw
