/* LD_PRELOAD shim for test_engine.py: pwrite on a file opened with O_DIRECT fails
 * with EINVAL, as on file systems that accept O_DIRECT at open but refuse the I/O.
 * The threads backend writes with pwrite, so this reaches the write-time fallback. */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <fcntl.h>
#include <sys/types.h>
#include <unistd.h>

static ssize_t refuse_direct(int fd, const void* buf, size_t n, off_t off, const char* name) {
  ssize_t (*real)(int, const void*, size_t, off_t) = (ssize_t (*)(int, const void*, size_t, off_t))dlsym(RTLD_NEXT, name);
  int fl = fcntl(fd, F_GETFL);
  if (fl != -1 && (fl & O_DIRECT)) {
    usleep(2000); /* let several writes reach the refusal while others are in flight */
    errno = EINVAL;
    return -1;
  }
  return real(fd, buf, n, off);
}

ssize_t pwrite(int fd, const void* buf, size_t n, off_t off) { return refuse_direct(fd, buf, n, off, "pwrite"); }
ssize_t pwrite64(int fd, const void* buf, size_t n, off_t off) { return refuse_direct(fd, buf, n, off, "pwrite64"); }
