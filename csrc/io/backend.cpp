#include "io/backend.hpp"

#include <stdexcept>

#include "core/error.hpp"

namespace fw {

BackendKind parse_backend(const std::string& name) {
  if (name == "auto") return BackendKind::Auto;
  if (name == "io_uring") return BackendKind::IoUring;
  if (name == "threads") return BackendKind::Threads;
  throw std::invalid_argument("backend must be 'auto', 'io_uring' or 'threads', not '" + name + "'");
}

std::unique_ptr<IoBackend> make_backend(BackendKind kind, unsigned queue_depth, IoCallback cb) {
  if (queue_depth == 0) throw std::invalid_argument("queue_depth must be at least 1");
  switch (kind) {
    case BackendKind::Threads:
      return make_thread_backend(queue_depth, std::move(cb));
    case BackendKind::IoUring: {
      if (!uring_compiled()) throw std::runtime_error("backend='io_uring' requested but flashwrite was built without liburing");
      return make_uring_backend(queue_depth, std::move(cb));
    }
    case BackendKind::Auto:
    default:
      if (uring_compiled() && uring_probe() == 0) {
        try {
          return make_uring_backend(queue_depth, cb);
        } catch (const IoError&) {
          // e.g. RLIMIT_MEMLOCK or seccomp after the probe: fall back below.
        }
      }
      return make_thread_backend(queue_depth, std::move(cb));
  }
}

}  // namespace fw
