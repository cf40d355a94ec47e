// Fallback backend: blocking pread/pwrite on a small pool of threads, for
// kernels or sandboxes without io_uring. Same contract as the io_uring one.
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <condition_variable>
#include <deque>
#include <mutex>
#include <thread>
#include <vector>

#include "core/defaults.hpp"
#include "io/backend.hpp"

namespace fw {
namespace {

class ThreadBackend final : public IoBackend {
 public:
  // queue_depth threads, each with one blocking request in flight.
  ThreadBackend(unsigned qd, IoCallback cb) : cb_(std::move(cb)) {
    unsigned n = std::min(qd, defaults::kThreadBackendMaxThreads);
    try {
      for (unsigned i = 0; i < n; ++i) workers_.emplace_back([this] { run(); });
    } catch (...) {
      stop();  // the threads already running must be joined, not destroyed joinable
      throw;
    }
  }
  ~ThreadBackend() override { stop(); }

  // Counted only once queued: a push that throws must not leave drain() waiting
  // for a request that was never queued.
  void submit(IoRequest* req) override {
    std::lock_guard<std::mutex> lk(mu_);
    queue_.push_back(req);
    ++outstanding_;
    work_cv_.notify_one();
  }

  void resubmit(IoRequest* req) override {
    std::lock_guard<std::mutex> lk(mu_);
    queue_.push_front(req);
    ++outstanding_;
    work_cv_.notify_one();
  }

  void drain() override {
    std::unique_lock<std::mutex> lk(mu_);
    idle_cv_.wait(lk, [&] { return outstanding_ == 0; });
  }

  const char* name() const override { return "threads"; }

 private:
  void stop() {
    {
      std::lock_guard<std::mutex> lk(mu_);
      stop_ = true;
    }
    work_cv_.notify_all();
    for (auto& t : workers_) t.join();
    workers_.clear();
  }

  static int64_t transfer(IoRequest* r) {
    while (!request_complete(r)) {
      ssize_t n = r->write ? ::pwrite(r->fd, r->buf + r->done, r->len - r->done, r->offset + r->done)
                           : ::pread(r->fd, r->buf + r->done, r->len - r->done, r->offset + r->done);
      if (n < 0) {
        if (errno == EINTR || errno == EAGAIN) continue;
        return -errno;
      }
      if (n == 0) {
        if (r->write) return -EIO;  // a write that makes no progress
        break;                       // EOF
      }
      r->done += static_cast<uint64_t>(n);
    }
    return static_cast<int64_t>(r->done);
  }

  void run() {
    for (;;) {
      IoRequest* req;
      {
        std::unique_lock<std::mutex> lk(mu_);
        work_cv_.wait(lk, [&] { return stop_ || !queue_.empty(); });
        if (queue_.empty()) return;
        req = queue_.front();
        queue_.pop_front();
      }
      int64_t res = request_cancelled(req) ? -ECANCELED : transfer(req);
      cb_(req, res);
      // Counted out after the callback: a resubmit from it keeps drain() waiting.
      std::lock_guard<std::mutex> lk(mu_);
      if (--outstanding_ == 0) idle_cv_.notify_all();
    }
  }

  IoCallback cb_;
  std::mutex mu_;
  std::condition_variable work_cv_, idle_cv_;
  std::deque<IoRequest*> queue_;
  size_t outstanding_ = 0;  // queued + being transferred + in their callback
  bool stop_ = false;
  std::vector<std::thread> workers_;
};

}  // namespace

std::unique_ptr<IoBackend> make_thread_backend(unsigned queue_depth, IoCallback cb) {
  return std::make_unique<ThreadBackend>(queue_depth, std::move(cb));
}

}  // namespace fw
