// Waiting on a job's control thread, shared by save and load jobs.
#pragma once
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <mutex>
#include <thread>

namespace fw {

// Waits until `flag` is set (notified through `cv` under `mu`); timeout_s < 0 waits
// forever. Returns whether the flag is set.
inline bool wait_for_flag(std::mutex& mu, std::condition_variable& cv, const std::atomic<bool>& flag,
                          double timeout_s) {
  std::unique_lock<std::mutex> lk(mu);
  if (timeout_s < 0) {
    cv.wait(lk, [&] { return flag.load(); });
    return true;
  }
  return cv.wait_for(lk, std::chrono::duration<double>(timeout_s), [&] { return flag.load(); });
}

// Joins `t` exactly once, however many threads (a Python caller and the commit
// thread, say) finish waiting for it at the same time.
inline void join_once(std::thread& t, std::once_flag& once) {
  std::call_once(once, [&] {
    if (t.joinable()) t.join();
  });
}

}  // namespace fw
