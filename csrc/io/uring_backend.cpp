// Primary backend: one io_uring per job. Producers (copy threads) submit under a
// mutex; one reaper thread waits for completions, resubmits short transfers and
// -EAGAIN/-EINTR, and reports finished requests. Shutdown is a NOP whose
// completion tells the reaper to stop, so no timeouts are needed.
#include "io/backend.hpp"

#ifdef FLASHWRITE_HAVE_URING
#include <liburing.h>

#include <cerrno>
#include <condition_variable>
#include <mutex>
#include <thread>

#include "core/error.hpp"

namespace fw {
namespace {

constexpr uint64_t kStopTag = 0;  // user_data of the shutdown NOP (requests are never null)

class UringBackend final : public IoBackend {
 public:
  UringBackend(unsigned qd, IoCallback cb) : qd_(qd), cb_(std::move(cb)) {
    // Twice the depth in the SQ: resubmits from the reaper never find it full.
    int rc = io_uring_queue_init(2 * qd, &ring_, 0);
    if (rc < 0) throw IoError(-rc, "io_uring_queue_init", "");
    reaper_ = std::thread([this] { reap(); });
  }

  ~UringBackend() override {
    drain();
    {
      std::lock_guard<std::mutex> lk(mu_);
      io_uring_sqe* sqe = get_sqe_locked();
      io_uring_prep_nop(sqe);
      io_uring_sqe_set_data64(sqe, kStopTag);
      io_uring_submit(&ring_);
    }
    reaper_.join();
    io_uring_queue_exit(&ring_);
  }

  void submit(IoRequest* req) override {
    std::unique_lock<std::mutex> lk(mu_);
    room_cv_.wait(lk, [&] { return inflight_ < qd_; });
    ++inflight_;
    push_locked(req);
  }

  void resubmit(IoRequest* req) override {
    std::lock_guard<std::mutex> lk(mu_);
    ++inflight_;
    push_locked(req);
  }

  void drain() override {
    std::unique_lock<std::mutex> lk(mu_);
    room_cv_.wait(lk, [&] { return inflight_ == 0; });
  }

  const char* name() const override { return "io_uring"; }

 private:
  io_uring_sqe* get_sqe_locked() {
    io_uring_sqe* sqe;
    while (!(sqe = io_uring_get_sqe(&ring_))) io_uring_submit(&ring_);
    return sqe;
  }

  void push_locked(IoRequest* r) {
    io_uring_sqe* sqe = get_sqe_locked();
    if (r->write)
      io_uring_prep_write(sqe, r->fd, r->buf + r->done, static_cast<unsigned>(r->len - r->done), r->offset + r->done);
    else
      io_uring_prep_read(sqe, r->fd, r->buf + r->done, static_cast<unsigned>(r->len - r->done), r->offset + r->done);
    io_uring_sqe_set_data(sqe, r);
    int rc;
    do rc = io_uring_submit(&ring_);
    while (rc == -EINTR || rc == -EAGAIN);
  }

  void finish(IoRequest* r, int64_t res) {
    {
      std::lock_guard<std::mutex> lk(mu_);
      --inflight_;
    }
    cb_(r, res);
    room_cv_.notify_all();
  }

  void reap() {
    for (;;) {
      io_uring_cqe* cqe = nullptr;
      int rc = io_uring_wait_cqe(&ring_, &cqe);
      if (rc == -EINTR || rc == -EAGAIN) continue;
      if (rc < 0) continue;  // transient; the ring itself is still usable
      uint64_t data = io_uring_cqe_get_data64(cqe);
      int res = cqe->res;
      io_uring_cqe_seen(&ring_, cqe);
      if (data == kStopTag) return;
      auto* r = reinterpret_cast<IoRequest*>(data);
      if (res == -EAGAIN || res == -EINTR) {
        std::lock_guard<std::mutex> lk(mu_);
        push_locked(r);
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
        std::lock_guard<std::mutex> lk(mu_);
        push_locked(r);  // short transfer: continue where it stopped
        continue;
      }
      finish(r, static_cast<int64_t>(r->done));
    }
  }

  const unsigned qd_;
  IoCallback cb_;
  io_uring ring_{};
  std::mutex mu_;
  std::condition_variable room_cv_;
  unsigned inflight_ = 0;
  std::thread reaper_;
};

}  // namespace

bool uring_compiled() { return true; }

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
int uring_probe() { return -ENOSYS; }
std::unique_ptr<IoBackend> make_uring_backend(unsigned, IoCallback) { return nullptr; }
}  // namespace fw

#endif
