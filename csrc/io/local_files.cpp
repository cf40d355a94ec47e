// JobFiles on the local file systems (see job_files.hpp): the system calls of
// io/files.hpp and the io_uring or thread-pool backend.
#include <unistd.h>

#include <cerrno>

#include "core/aligned_buffer.hpp"
#include "core/error.hpp"
#include "io/job_files.hpp"

namespace fw {
namespace {

class LocalFiles : public JobFiles {
 public:
  LocalFiles(BackendKind backend, bool direct) : backend_(backend), direct_(direct) {}

  OpenedFile create(const std::string& path, uint64_t) override { return open_for_write(path, direct_); }

  void reserve(int fd, const std::string& path, uint64_t size) override {
    preallocate(fd, round_up(size, kAlign), path);
  }

  OpenedFile open(const std::string& path, uint64_t size) override {
    OpenedFile of = open_for_read(path, direct_);
    uint64_t actual = 0;
    try {
      actual = file_size(of.fd, path);
    } catch (...) {
      close_fd(of.fd);
      throw;
    }
    if (actual != size) {
      close_fd(of.fd);
      throw FormatError("'" + path + "' is " + std::to_string(actual) + " bytes, the manifest says " +
                        std::to_string(size) + (actual < size ? " (truncated)" : ""));
    }
    return of;
  }

  int reopen_buffered(const std::string& path, bool write) override {
    if (!direct_) return -1;
    return write ? reopen_buffered_for_write(path) : open_for_read(path, false).fd;
  }

  std::unique_ptr<IoBackend> backend(unsigned queue_depth, IoCallback cb) override {
    return make_backend(backend_, queue_depth, std::move(cb));
  }

  // A direct file's last write covers the aligned tail: cut it to the exact size.
  void finish(int fd, const std::string& path, uint64_t size) override {
    truncate_to(fd, size, path);
    fsync_fd(fd, path);
  }

  void close(int fd) override { close_fd(fd); }

  std::exception_ptr error(const IoRequest* r, int64_t res, const std::string& path) override {
    return std::make_exception_ptr(IoError(static_cast<int>(-res), r->write ? "write" : "read", path,
                                           static_cast<int64_t>(r->offset + r->done), static_cast<int64_t>(r->len)));
  }

  bool can_link() const override { return true; }

  int link(const std::string& from, const std::string& to) override {
    return ::link(from.c_str(), to.c_str()) == 0 ? 0 : errno;
  }

 private:
  BackendKind backend_;
  bool direct_;
};

}  // namespace

std::shared_ptr<JobFiles> make_local_files(BackendKind backend, bool direct) {
  return std::make_shared<LocalFiles>(backend, direct);
}

}  // namespace fw
