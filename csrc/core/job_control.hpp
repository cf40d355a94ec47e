// The life cycle of a native job (a save or a load), written once: start the
// control thread, record the first error (which also cancels), cancel, mark
// done, wait with a timeout, and join exactly once however many threads wait.
//
// Rules every job gets from here:
//  - fail(e) records e if no error is recorded yet and sets the cancel flag,
//    both under the lock, so a worker that sees the flag also sees the error.
//  - cancel() after the job is done is a no-op (a finished job stays as it
//    finished); before, it is fail("... cancelled").
//  - The control thread object is touched only by start() and inside the
//    join-once, never read concurrently (started() is a flag of its own).
//
// The job may keep state of its own under mutex() and signal it on cv()
// (the done flag is signalled there too).
#pragma once
#include <atomic>
#include <condition_variable>
#include <exception>
#include <functional>
#include <mutex>
#include <string>
#include <thread>

namespace fw {

class JobControl {
 public:
  explicit JobControl(std::string cancelled_what) : cancelled_what_(std::move(cancelled_what)) {}
  ~JobControl();  // cancels and joins a thread still running
  JobControl(const JobControl&) = delete;
  JobControl& operator=(const JobControl&) = delete;

  // Runs body on the control thread; body must call finish() last. Throws
  // std::system_error when no thread can be started (nothing runs then).
  void start(std::function<void()> body);
  bool started() const { return started_.load(); }

  void fail(std::exception_ptr e);
  void cancel();  // no-op once done
  const std::atomic<bool>& cancel_flag() const { return cancel_; }
  bool cancelled() const { return cancel_.load(); }

  // Marks the job done (after its last write to shared state) and wakes waiters.
  // `last` runs under the lock just before the flag is set.
  void finish(const std::function<void()>& last = {});
  bool done() const { return done_.load(); }

  // Waits until `flag` (set under mutex(), signalled on cv()) or the job is
  // done; timeout_s < 0 or not finite waits forever. Jobs never started count
  // as done.
  bool wait_until(const std::atomic<bool>& flag, double timeout_s);
  // Waits until done, then joins the control thread once.
  bool wait(double timeout_s);

  bool failed() const;
  void rethrow() const;

  std::mutex& mutex() const { return mu_; }
  std::condition_variable& cv() { return cv_; }
  void notify() { cv_.notify_all(); }

 private:
  void join();

  const std::string cancelled_what_;
  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::exception_ptr error_;
  std::atomic<bool> cancel_{false}, done_{false}, started_{false};
  std::thread thread_;
  std::once_flag join_once_;
};

}  // namespace fw
