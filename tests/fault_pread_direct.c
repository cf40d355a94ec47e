/* LD_PRELOAD shim for test_native_faults.py: reads of files opened with O_DIRECT
 * misbehave as on file systems that take O_DIRECT at open but not the I/O.
 *   FAULT_PREAD_MODE=einval  every pread on an O_DIRECT fd fails with EINVAL;
 *   FAULT_PREAD_MODE=short   an aligned pread on an O_DIRECT fd returns at most
 *                            1000 bytes (a short read), and an unaligned one fails
 *                            with EINVAL, as the kernel refuses it;
 *   FAULT_PREAD_MODE=eio     a pread on an O_DIRECT fd at or past offset
 *                            FAULT_PREAD_EIO_AT fails with EIO (a bad sector
 *                            mid-load).
 * The threads backend reads with pread, so this reaches the load's fallback. */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <fcntl.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/types.h>
#include <unistd.h>

static ssize_t odd_read(int fd, void* buf, size_t n, off_t off, const char* name) {
  ssize_t (*real)(int, void*, size_t, off_t) = (ssize_t (*)(int, void*, size_t, off_t))dlsym(RTLD_NEXT, name);
  const char* mode = getenv("FAULT_PREAD_MODE");
  int fl = fcntl(fd, F_GETFL);
  if (!mode || fl == -1 || !(fl & O_DIRECT)) return real(fd, buf, n, off);
  if (!strcmp(mode, "einval")) {
    errno = EINVAL;
    return -1;
  }
  if (!strcmp(mode, "eio")) {
    const char* at = getenv("FAULT_PREAD_EIO_AT");
    if (off >= (at ? atoll(at) : 0)) {
      errno = EIO;
      return -1;
    }
    return real(fd, buf, n, off);
  }
  if (off % 4096 || n % 4096 || (uintptr_t)buf % 4096) {
    errno = EINVAL;
    return -1;
  }
  return real(fd, buf, n < 1000 ? n : 1000, off);
}

ssize_t pread(int fd, void* buf, size_t n, off_t off) { return odd_read(fd, buf, n, off, "pread"); }
ssize_t pread64(int fd, void* buf, size_t n, off_t off) { return odd_read(fd, buf, n, off, "pread64"); }
