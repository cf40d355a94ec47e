#include "stage/staging_pool.hpp"

#include "core/defaults.hpp"

#include <chrono>
#include <stdexcept>
#include <system_error>
#include <thread>
#include <vector>

namespace fw {

StagingPool::StagingPool(size_t slot_bytes, size_t max_bytes)
    : slot_bytes_(slot_bytes), max_slots_(max_bytes ? std::max<size_t>(2, max_bytes / slot_bytes) : 0) {
  if (slot_bytes == 0 || slot_bytes % kAlign) throw std::invalid_argument("chunk_bytes must be a positive multiple of 4096");
}

StagingPool::~StagingPool() {
  std::lock_guard<std::mutex> lk(mu_);
  for (auto& s : slabs_)
    if (s->pinned && hooks_.unpin) hooks_.unpin(s->mem.data());
}

size_t StagingPool::capacity_bytes() const {
  std::lock_guard<std::mutex> lk(mu_);
  return total_slots_ * slot_bytes_;
}

bool StagingPool::pinned() const {
  std::lock_guard<std::mutex> lk(mu_);
  if (slabs_.empty()) return false;
  for (auto& s : slabs_)
    if (!s->pinned) return false;
  return true;
}

void StagingPool::pin_slab(Slab& s) {
  if (!s.pinned && hooks_.pin) s.pinned = hooks_.pin(s.mem.data(), s.mem.capacity());
}

void StagingPool::reserve(size_t slots) {
  std::lock_guard<std::mutex> lk(mu_);
  ++reservations_;
  if (max_slots_) slots = std::min(slots, max_slots_);
  if (slots <= total_slots_) return;
  size_t add = slots - total_slots_;
  auto slab = std::make_unique<Slab>();
  struct Undo {  // the reservation does not outlive a failed allocation
    size_t* n;
    ~Undo() {
      if (n) --*n;
    }
  } undo{&reservations_};
  // Faulted in now, in parallel: every slot is then resident for good, so
  // later saves neither pay for page faults nor grow the process (slots are
  // reused last-in-first-out, and a save may touch only some of them).
  slab->mem = AlignedBuffer(add * slot_bytes_);
  {
    const size_t bytes = slab->mem.capacity();
    const unsigned n = static_cast<unsigned>(std::min<size_t>(std::max(1u, std::thread::hardware_concurrency()), defaults::kPrefaultMaxThreads));
    const size_t part = round_up((bytes + n - 1) / n, kAlign);
    std::vector<std::thread> faulters;
    unsigned i = 0;
    try {
      for (; i < n && i * part < bytes; ++i) faulters.emplace_back([&, i] { slab->mem.prefault(i * part, part); });
    } catch (const std::system_error&) {
      // No thread to spare: fault the rest in here (a joinable thread must not
      // be destroyed, so never leave this block without the joins below).
      for (; i < n && i * part < bytes; ++i) slab->mem.prefault(i * part, part);
    }
    for (auto& t : faulters) t.join();
  }
  pin_slab(*slab);
  for (size_t i = 0; i < add; ++i) free_.push_back(slab->mem.data() + i * slot_bytes_);
  total_slots_ += add;
  slabs_.push_back(std::move(slab));
  undo.n = nullptr;
  cv_.notify_all();
}

void StagingPool::unreserve() {
  std::lock_guard<std::mutex> lk(mu_);
  if (reservations_) --reservations_;
}

char* StagingPool::acquire(const std::atomic<bool>* cancel, const std::function<bool()>& interrupt) {
  std::unique_lock<std::mutex> lk(mu_);
  for (;;) {
    if (cancel && cancel->load()) return nullptr;
    if (!free_.empty()) {
      char* p = free_.back();
      free_.pop_back();
      return p;
    }
    if (interrupt && interrupt()) return nullptr;
    // Poll the cancel flag too: it is set without a wake() by some callers.
    cv_.wait_for(lk, std::chrono::milliseconds(defaults::kPoolPollMs));
  }
}

void StagingPool::release(char* slot) {
  {
    std::lock_guard<std::mutex> lk(mu_);
    free_.push_back(slot);
  }
  // All waiters: one of them may be waiting only for its interrupt and would
  // swallow a notify_one meant for a waiter that needs the slot.
  cv_.notify_all();
}

void StagingPool::wake() {
  { std::lock_guard<std::mutex> lk(mu_); }
  cv_.notify_all();
}

size_t StagingPool::trim() {
  std::lock_guard<std::mutex> lk(mu_);
  if (reservations_ || free_.size() != total_slots_) return 0;  // slots reserved or in use
  size_t freed = total_slots_ * slot_bytes_;
  for (auto& s : slabs_)
    if (s->pinned && hooks_.unpin) hooks_.unpin(s->mem.data());
  slabs_.clear();
  free_.clear();
  total_slots_ = 0;
  return freed;
}

void StagingPool::set_pin_hooks(PinHooks hooks) {
  std::lock_guard<std::mutex> lk(mu_);
  hooks_ = std::move(hooks);
  for (auto& s : slabs_) pin_slab(*s);
}

}  // namespace fw
