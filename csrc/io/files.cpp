#include "io/files.hpp"

#include <fcntl.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>

#include "core/aligned_buffer.hpp"
#include "core/error.hpp"

#ifndef RENAME_EXCHANGE
#define RENAME_EXCHANGE (1 << 1)
#endif

namespace fw {

static int retry_open(const char* path, int flags, mode_t mode) {
  int fd;
  do fd = ::open(path, flags, mode);
  while (fd < 0 && errno == EINTR);
  return fd;
}

static OpenedFile open_maybe_direct(const std::string& path, int flags, bool direct, const char* op) {
  OpenedFile f;
  if (direct) {
    f.fd = retry_open(path.c_str(), flags | O_DIRECT, 0644);
    if (f.fd >= 0) {
      f.direct = true;
      return f;
    }
    if (errno != EINVAL) throw_errno(errno, op, path);
    // Some file systems (ramfs, some FUSE) create the file before refusing
    // O_DIRECT, so the buffered retry must not insist on creating it.
    flags &= ~O_EXCL;
  }
  f.fd = retry_open(path.c_str(), flags, 0644);
  if (f.fd < 0) throw_errno(errno, op, path);
  return f;
}

OpenedFile open_for_write(const std::string& path, bool direct) {
  return open_maybe_direct(path, O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, direct, "open for write");
}

int reopen_buffered_for_write(const std::string& path) {
  int fd = retry_open(path.c_str(), O_WRONLY | O_CLOEXEC, 0644);
  if (fd < 0) throw_errno(errno, "reopen buffered", path);
  return fd;
}

OpenedFile open_for_read(const std::string& path, bool direct) {
  return open_maybe_direct(path, O_RDONLY | O_CLOEXEC, direct, "open for read");
}

void preallocate(int fd, uint64_t bytes, const std::string& path) {
  if (!bytes) return;
  int rc;
  do rc = ::fallocate(fd, 0, 0, static_cast<off_t>(bytes));
  while (rc < 0 && errno == EINTR);
  if (rc < 0 && errno != EOPNOTSUPP && errno != ENOSYS && errno != EINVAL)
    throw_errno(errno, "fallocate", path, 0, static_cast<int64_t>(bytes));
}

void truncate_to(int fd, uint64_t bytes, const std::string& path) {
  int rc;
  do rc = ::ftruncate(fd, static_cast<off_t>(bytes));
  while (rc < 0 && errno == EINTR);
  if (rc < 0) throw_errno(errno, "ftruncate", path, static_cast<int64_t>(bytes));
}

void fsync_fd(int fd, const std::string& path) {
  int rc;
  do rc = ::fsync(fd);
  while (rc < 0 && errno == EINTR);
  if (rc < 0) throw_errno(errno, "fsync", path);
}

void fsync_dir(const std::string& path) {
  int fd = retry_open(path.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC, 0);
  if (fd < 0) throw_errno(errno, "open directory", path);
  int rc;
  do rc = ::fsync(fd);
  while (rc < 0 && errno == EINTR);
  int err = errno;
  ::close(fd);
  // Some file systems (network ones for directories) refuse fsync on a directory.
  if (rc < 0 && err != EINVAL && err != EROFS) throw_errno(err, "fsync directory", path);
}

void close_fd(int fd) {
  if (fd >= 0) ::close(fd);
}

uint64_t file_size(int fd, const std::string& path) {
  struct stat st;
  if (::fstat(fd, &st) < 0) throw_errno(errno, "fstat", path);
  return static_cast<uint64_t>(st.st_size);
}

bool rename_exchange(const std::string& a, const std::string& b) {
  long rc = ::syscall(SYS_renameat2, AT_FDCWD, a.c_str(), AT_FDCWD, b.c_str(), RENAME_EXCHANGE);
  if (rc == 0) return true;
  if (errno == EINVAL || errno == ENOSYS || errno == EOPNOTSUPP) return false;
  throw_errno(errno, "renameat2(RENAME_EXCHANGE) to '" + b + "'", a);
}

bool probe_direct(const std::string& dir) {
  // Allocated before the probe file exists: nothing below throws, so the file
  // and its fd cannot leak.
  AlignedBuffer buf(kAlign);
  std::memset(buf.data(), 0, kAlign);
  std::string tmpl = dir + "/.flashwrite-probe-XXXXXX";
  int fd = ::mkstemp(tmpl.data());
  if (fd < 0) throw_errno(errno, "create probe file", dir);
  ::close(fd);
  bool ok = false;
  fd = retry_open(tmpl.c_str(), O_WRONLY | O_DIRECT | O_CLOEXEC, 0);
  if (fd >= 0) {
    ok = ::pwrite(fd, buf.data(), kAlign, 0) == static_cast<ssize_t>(kAlign);
    ::close(fd);
  }
  ::unlink(tmpl.c_str());
  return ok;
}

}  // namespace fw
