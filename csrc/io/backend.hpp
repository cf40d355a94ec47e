// I/O backends: io_uring (primary) and a pread/pwrite thread pool (fallback).
// Both keep up to queue_depth requests in flight, resubmit short transfers,
// -EAGAIN and -EINTR themselves, and report each request once, from their own
// completion thread, with the bytes moved or -errno.
#pragma once
#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>

namespace fw {

struct IoRequest {
  int fd = -1;
  char* buf = nullptr;
  uint64_t len = 0;
  uint64_t offset = 0;
  bool write = true;
  uint64_t want = 0;     // reads: enough bytes to complete (the file may end inside the
                         // aligned tail); 0 means len
  uint64_t done = 0;     // bytes already transferred (backend-owned)
  uint64_t tag = 0;      // caller's identifier
  // When set and true by the time the request's turn comes, it is not issued but
  // reported at once with -ECANCELED: a cancelled or failed job does not wait for
  // every write it queued (a save far ahead of slow storage queues the whole
  // checkpoint), only for those already in the kernel.
  const std::atomic<bool>* cancel = nullptr;
};

inline bool request_cancelled(const IoRequest* r) { return r->cancel && r->cancel->load(); }

// res >= 0: bytes transferred (== len for writes; >= want for reads unless EOF came first).
// res < 0: -errno. The callback may call resubmit() on the same request.
using IoCallback = std::function<void(IoRequest*, int64_t res)>;

enum class BackendKind { Auto, IoUring, Threads };

class IoBackend {
 public:
  virtual ~IoBackend() = default;
  // Queues a request and returns at once; the backend keeps at most
  // queue_depth of them in flight. Never blocking here matters: the copy
  // threads that stage a save must not wait for the disk. Thread-safe.
  virtual void submit(IoRequest* req) = 0;
  // Queues a request again from the completion callback, ahead of the rest.
  virtual void resubmit(IoRequest* req) = 0;
  // Blocks until every queued request is done and its callback has returned.
  virtual void drain() = 0;
  virtual const char* name() const = 0;
};

BackendKind parse_backend(const std::string& name);
// Auto: io_uring when compiled in and the kernel lets us set up a ring, else threads.
std::unique_ptr<IoBackend> make_backend(BackendKind kind, unsigned queue_depth, IoCallback cb);
std::unique_ptr<IoBackend> make_thread_backend(unsigned queue_depth, IoCallback cb);
// nullptr when io_uring is not compiled in; throws IoError when ring setup fails.
std::unique_ptr<IoBackend> make_uring_backend(unsigned queue_depth, IoCallback cb);

bool uring_compiled();
// Which liburing the build links: "system" or "vendored" (third_party/liburing), and
// its version ("2.15"); both "" when io_uring is not compiled in.
const char* uring_library_source();
std::string uring_library_version();
// Result of one ring setup attempt at run time: 0 or -errno.
int uring_probe();

}  // namespace fw

namespace fw {
inline bool request_complete(const IoRequest* r) {
  return r->done >= (r->want && !r->write ? r->want : r->len);
}
}  // namespace fw
