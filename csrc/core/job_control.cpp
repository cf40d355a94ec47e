#include "core/job_control.hpp"

#include <chrono>
#include <cmath>
#include <stdexcept>

namespace fw {

JobControl::~JobControl() {
  if (started_.load()) {
    cancel();
    join();
  }
}

void JobControl::start(std::function<void()> body) {
  std::lock_guard<std::mutex> lk(mu_);
  thread_ = std::thread(std::move(body));
  started_ = true;  // only once the thread exists: wait() on a job never started returns at once
}

void JobControl::fail(std::exception_ptr e) {
  {
    std::lock_guard<std::mutex> lk(mu_);
    if (!error_) error_ = e;
    cancel_ = true;
  }
  cv_.notify_all();
}

void JobControl::cancel() {
  {
    std::lock_guard<std::mutex> lk(mu_);
    if (done_.load()) return;  // finished as it finished; a late cancel changes nothing
    if (!error_) error_ = std::make_exception_ptr(std::runtime_error(cancelled_what_));
    cancel_ = true;
  }
  cv_.notify_all();
}

void JobControl::finish(const std::function<void()>& last) {
  {
    std::lock_guard<std::mutex> lk(mu_);
    if (last) last();
    done_ = true;
  }
  cv_.notify_all();
}

bool JobControl::wait_until(const std::atomic<bool>& flag, double timeout_s) {
  std::unique_lock<std::mutex> lk(mu_);
  if (!started_.load()) return true;
  auto ready = [&] { return flag.load() || done_.load(); };
  // Beyond a day, or not finite: forever. duration<double> of 1e10 s would
  // overflow steady_clock's nanoseconds inside wait_for.
  if (!(timeout_s >= 0) || !(timeout_s < 86400.0)) {
    cv_.wait(lk, ready);
    return true;
  }
  return cv_.wait_for(lk, std::chrono::duration<double>(timeout_s), ready);
}

bool JobControl::wait(double timeout_s) {
  if (!started_.load()) return true;  // never started: nothing to join (the once stays unspent)
  if (!wait_until(done_, timeout_s)) return false;
  join();
  return true;
}

void JobControl::join() {
  std::call_once(join_once_, [&] {
    if (thread_.joinable()) thread_.join();
  });
}

bool JobControl::failed() const {
  std::lock_guard<std::mutex> lk(mu_);
  return static_cast<bool>(error_);
}

void JobControl::rethrow() const {
  std::exception_ptr e;
  {
    std::lock_guard<std::mutex> lk(mu_);
    e = error_;
  }
  if (e) std::rethrow_exception(e);
}

}  // namespace fw
