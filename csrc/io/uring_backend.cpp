// Primary backend: one io_uring per job, owned by one thread that does all
// submission and reaping. io_uring ties a request to the task that submitted
// it and cancels its pending work (-ECANCELED) when that task exits, so the
// short-lived copy threads never touch the ring: they queue requests and kick
// an eventfd that the ring thread keeps a read armed on.
#include "io/backend.hpp"

#ifdef FLASHWRITE_HAVE_URING
#include <liburing.h>
#include <sys/eventfd.h>
#include <unistd.h>

#include <cerrno>
#include <condition_variable>
#include <deque>
#include <mutex>
#include <thread>
#include <vector>

#include "core/error.hpp"

namespace fw {
namespace {

constexpr uint64_t kKickTag = 1;  // user_data of the eventfd read (requests are real pointers)

class UringBackend final : public IoBackend {
 public:
  UringBackend(unsigned qd, IoCallback cb) : qd_(qd), cb_(std::move(cb)) {
    efd_ = eventfd(0, EFD_CLOEXEC);
    if (efd_ < 0) throw IoError(errno, "eventfd", "");
    // Room for every request in flight, their resubmits and the eventfd read.
    int rc = io_uring_queue_init(2 * qd + 2, &ring_, 0);
    if (rc < 0) {
      ::close(efd_);
      throw IoError(-rc, "io_uring_queue_init", "");
    }
    try {
      thread_ = std::thread([this] { loop(); });
    } catch (...) {
      io_uring_queue_exit(&ring_);
      ::close(efd_);
      throw;
    }
  }

  ~UringBackend() override {
    drain();
    {
      std::lock_guard<std::mutex> lk(mu_);
      stop_ = true;
    }
    kick();
    thread_.join();
    io_uring_queue_exit(&ring_);
    ::close(efd_);
  }

  // Counted only once queued: a push that throws must not leave drain() waiting.
  void submit(IoRequest* req) override {
    {
      std::lock_guard<std::mutex> lk(mu_);
      pending_.push_back(req);
      ++outstanding_;
    }
    kick();
  }

  // Only called from the completion callback, i.e. on the ring thread, which
  // refills the ring right after the callback returns.
  void resubmit(IoRequest* req) override {
    std::lock_guard<std::mutex> lk(mu_);
    pending_.push_front(req);
    ++outstanding_;
  }

  void drain() override {
    std::unique_lock<std::mutex> lk(mu_);
    idle_cv_.wait(lk, [&] { return outstanding_ == 0; });
  }

  const char* name() const override { return "io_uring"; }

 private:
  void kick() {
    uint64_t one = 1;
    ssize_t n;
    do n = ::write(efd_, &one, sizeof one);
    while (n < 0 && errno == EINTR);
  }

  io_uring_sqe* get_sqe() {
    io_uring_sqe* sqe;
    while (!(sqe = io_uring_get_sqe(&ring_))) flush();
    return sqe;
  }

  void flush() {
    int rc;
    do rc = io_uring_submit(&ring_);
    while (rc == -EINTR || rc == -EAGAIN);
  }

  void push(IoRequest* r) {
    io_uring_sqe* sqe = get_sqe();
    if (r->write)
      io_uring_prep_write(sqe, r->fd, r->buf + r->done, static_cast<unsigned>(r->len - r->done), r->offset + r->done);
    else
      io_uring_prep_read(sqe, r->fd, r->buf + r->done, static_cast<unsigned>(r->len - r->done), r->offset + r->done);
    io_uring_sqe_set_data(sqe, r);
  }

  void arm_kick() {
    io_uring_sqe* sqe = get_sqe();
    io_uring_prep_read(sqe, efd_, &kick_buf_, sizeof kick_buf_, 0);
    io_uring_sqe_set_data64(sqe, kKickTag);
  }

  void finish(IoRequest* r, int64_t res) {
    --in_ring_;
    cb_(r, res);
    {
      std::lock_guard<std::mutex> lk(mu_);
      if (--outstanding_ == 0) idle_cv_.notify_all();
    }
    fill();
  }

  // Moves queued requests into the ring, up to queue_depth in flight; those
  // whose job was cancelled are reported instead (request_cancelled).
  // Returns false when asked to stop.
  bool fill() {
    for (;;) {
      bool stop, pushed = false;
      std::vector<IoRequest*> skipped;
      {
        std::lock_guard<std::mutex> lk(mu_);
        while (in_ring_ < qd_ && !pending_.empty()) {
          IoRequest* r = pending_.front();
          pending_.pop_front();
          if (request_cancelled(r)) {
            skipped.push_back(r);
            continue;
          }
          push(r);
          ++in_ring_;
          pushed = true;
        }
        stop = stop_;
      }
      if (pushed) flush();
      if (skipped.empty()) return !stop;
      for (IoRequest* r : skipped) {
        cb_(r, -ECANCELED);
        std::lock_guard<std::mutex> lk(mu_);
        if (--outstanding_ == 0) idle_cv_.notify_all();
      }
      // A callback may have queued a request again: look once more.
    }
  }

  void loop() {
    arm_kick();
    flush();
    for (;;) {
      io_uring_cqe* cqe = nullptr;
      int rc = io_uring_wait_cqe(&ring_, &cqe);
      if (rc < 0) continue;  // -EINTR and friends: the ring is still usable
      uint64_t data = io_uring_cqe_get_data64(cqe);
      int res = cqe->res;
      io_uring_cqe_seen(&ring_, cqe);
      if (data == kKickTag) {
        if (!fill()) return;
        arm_kick();
        flush();
        continue;
      }
      auto* r = reinterpret_cast<IoRequest*>(data);
      if (res == -EAGAIN || res == -EINTR) {
        push(r);
        flush();
        continue;
      }
      if (res < 0) {
        finish(r, res);
        continue;
      }
      if (res == 0) {
        finish(r, r->write ? -EIO : static_cast<int64_t>(r->done));  // write without progress / EOF
        continue;
      }
      r->done += static_cast<uint64_t>(res);
      if (!request_complete(r)) {
        push(r);  // short transfer: continue where it stopped
        flush();
        continue;
      }
      finish(r, static_cast<int64_t>(r->done));
    }
  }

  const unsigned qd_;
  IoCallback cb_;
  io_uring ring_{};
  int efd_ = -1;
  uint64_t kick_buf_ = 0;
  std::mutex mu_;
  std::condition_variable idle_cv_;
  std::deque<IoRequest*> pending_;  // queued, not yet in the ring
  size_t outstanding_ = 0;          // queued + in the ring + in their callback
  unsigned in_ring_ = 0;            // ring thread only
  bool stop_ = false;
  std::thread thread_;
};

}  // namespace

bool uring_compiled() { return true; }

#ifndef FLASHWRITE_URING_SOURCE
#define FLASHWRITE_URING_SOURCE "system"
#endif
const char* uring_library_source() { return FLASHWRITE_URING_SOURCE; }

// The header compiled against says so from liburing 2.4 on; for older ones the
// build's own finding (pkg-config).
std::string uring_library_version() {
#ifdef IO_URING_VERSION_MAJOR
  return std::to_string(IO_URING_VERSION_MAJOR) + "." + std::to_string(IO_URING_VERSION_MINOR);
#elif defined(FLASHWRITE_URING_VERSION)
  return FLASHWRITE_URING_VERSION;
#else
  return "unknown";
#endif
}

int uring_probe() {
  io_uring ring;
  int rc = io_uring_queue_init(2, &ring, 0);
  if (rc == 0) io_uring_queue_exit(&ring);
  return rc;
}

std::unique_ptr<IoBackend> make_uring_backend(unsigned queue_depth, IoCallback cb) {
  return std::make_unique<UringBackend>(queue_depth, std::move(cb));
}

}  // namespace fw

#else  // built without liburing

#include <cerrno>

namespace fw {
bool uring_compiled() { return false; }
const char* uring_library_source() { return ""; }
std::string uring_library_version() { return ""; }
int uring_probe() { return -ENOSYS; }
std::unique_ptr<IoBackend> make_uring_backend(unsigned, IoCallback) { return nullptr; }
}  // namespace fw

#endif
