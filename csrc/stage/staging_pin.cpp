// The staging pool's pinning (see staging_pool.hpp): slabs made before the pin
// hooks were set are registered one at a time, their free slots kept back
// meanwhile, and the figures of what a save waited for (StagingWait).
#include "stage/staging_pool.hpp"

#include <algorithm>
#include <chrono>
#include <mutex>
#include <vector>

namespace fw {

double StagingPool::pin_seconds() const {
  std::lock_guard<std::mutex> lk(mu_);
  return pin_s_;
}

uint64_t StagingPool::unpinned_bytes() const {
  std::lock_guard<std::mutex> lk(mu_);
  const_cast<StagingPool*>(this)->adopt_after_fork();
  uint64_t n = 0;
  for (auto& s : slabs_)
    if (s->pin_tried && !s->pinned) n += s->mem.capacity();
  return n;
}

void StagingWait::begin(const char* reason) {
  std::lock_guard<std::mutex> lk(mu_);
  if (waiters_++ == 0) {
    since_ = std::chrono::steady_clock::now();
    reason_now_ = reason;
  }
}

void StagingWait::end() {
  std::lock_guard<std::mutex> lk(mu_);
  if (waiters_ == 0 || --waiters_ != 0) return;
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - since_).count();
  total_ += s;
  by_[reason_now_] += s;
}

void StagingWait::add(const char* reason, double seconds) {
  if (seconds <= 0) return;
  std::lock_guard<std::mutex> lk(mu_);
  total_ += seconds;
  by_[reason] += seconds;
}

double StagingWait::seconds() const {
  std::lock_guard<std::mutex> lk(mu_);
  return total_;
}

std::string StagingWait::reason() const {
  std::lock_guard<std::mutex> lk(mu_);
  std::string best;
  double most = 0;
  for (auto& [r, s] : by_)
    if (s > most) most = s, best = r;
  return best;
}

const char* StagingPool::wait_reason() const {
  return growing_slots_ || pinning_slabs_ || busy_ ? phase_.load() : "pool busy";
}

// Called under mu_: the free slots of `s` wait in its `parked` list.
void StagingPool::park(Slab& s) {
  if (s.pinning) return;
  char* base = s.mem.data();
  const size_t cap = s.mem.capacity();
  auto in_slab = [&](char* p) { return p >= base && p < base + cap; };
  for (char* p : free_)
    if (in_slab(p)) s.parked.push_back(p);
  free_.erase(std::remove_if(free_.begin(), free_.end(), in_slab), free_.end());
  s.pinning = true;
  ++pinning_slabs_;
}

// Called under mu_: the slots of `s` are handed out again.
void StagingPool::unpark(Slab& s) {
  if (!s.pinning) return;
  free_.insert(free_.end(), s.parked.begin(), s.parked.end());
  s.parked.clear();
  s.pinning = false;
  --pinning_slabs_;
}

void StagingPool::claim_unpinned() {
  std::lock_guard<std::mutex> lk(mu_);
  if (adopt_after_fork() || !hooks_.pin) return;
  for (auto& s : slabs_)
    if (!s->pinned && !s->pin_tried) park(*s);
}

double StagingPool::pin_existing(const std::atomic<bool>* abort) {
  std::unique_lock<std::mutex> lk(mu_);
  if (adopt_after_fork()) return 0;
  double secs = 0;
  for (;;) {
    cv_.wait(lk, [&] { return !busy_; });
    Slab* s = nullptr;
    for (auto& sl : slabs_)
      if (sl->pinning || (!sl->pin_tried && !sl->pinned)) {
        s = sl.get();
        break;
      }
    if (!s) return secs;
    if (!hooks_.pin || (abort && abort->load())) {
      // Not pinned after all: what claim_unpinned() kept back is handed out pageable.
      for (auto& sl : slabs_) unpark(*sl);
      cv_.notify_all();
      return secs;
    }
    // Its free slots are kept back while it is registered: a copy started
    // into it meanwhile would be a pageable one.
    park(*s);
    busy_ = true;
    phase_ = "pin";
    const PinHooks hooks = hooks_;
    lk.unlock();
    const auto t0 = std::chrono::steady_clock::now();
    bool ok = false;
    try {
      ok = hooks.pin(s->mem.data(), s->mem.capacity());
    } catch (...) {
      ok = false;  // the hook reports its failures itself; the slab stays pageable
    }
    const double took = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    lk.lock();
    s->pinned = ok;
    s->pin_tried = true;
    unpark(*s);
    busy_ = false;
    secs += took;
    pin_s_ += took;
    cv_.notify_all();
  }
}

void StagingPool::set_pin_hooks(PinHooks hooks, bool pin_now) {
  std::unique_lock<std::mutex> lk(mu_);
  adopt_after_fork();
  cv_.wait(lk, [&] { return !busy_; });
  hooks_ = std::move(hooks);
  std::vector<Slab*> todo;
  for (auto& s : slabs_)
    if (!s->pinned) {
      s->pin_tried = false;  // these hooks have not tried it
      todo.push_back(s.get());
    }
  if (todo.empty() || !hooks_.pin || !pin_now) return;
  // Pinning the slabs made before (seconds for tens of GiB) is not done under
  // the lock: running jobs acquire and release slots meanwhile.
  const PinHooks pin = hooks_;
  busy_ = true;
  lk.unlock();
  double secs = 0;
  std::vector<bool> done(todo.size(), false);
  try {
    for (size_t i = 0; i < todo.size(); ++i) {
      const auto t0 = std::chrono::steady_clock::now();
      done[i] = pin.pin(todo[i]->mem.data(), todo[i]->mem.capacity());
      secs += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    }
  } catch (...) {
    lk.lock();
    for (size_t i = 0; i < todo.size(); ++i) todo[i]->pinned = done[i];
    busy_ = false;
    cv_.notify_all();
    throw;
  }
  lk.lock();
  for (size_t i = 0; i < todo.size(); ++i) todo[i]->pinned = done[i], todo[i]->pin_tried = true;
  pin_s_ += secs;
  busy_ = false;
  cv_.notify_all();
}

}  // namespace fw
