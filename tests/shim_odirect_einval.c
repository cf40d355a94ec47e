/* LD_PRELOAD shim for test_io_shims.py: open/openat with O_DIRECT fail with EINVAL, as
 * on file systems that refuse O_DIRECT at open time (ramfs, some FUSE and network
 * mounts), so the open-time fallback to buffered I/O is tested without root or a
 * mount. FW_SHIM_CREATE_FIRST=1 creates the file before refusing, as ramfs does. */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <fcntl.h>
#include <stdarg.h>
#include <stdlib.h>
#include <sys/stat.h>
#include <unistd.h>

#define REAL(name, type) static type real_##name; if (!real_##name) real_##name = (type)dlsym(RTLD_NEXT, #name)
typedef int (*openat_t)(int, const char*, int, ...);
typedef int (*open_t)(const char*, int, ...);

static int refuse(int dirfd, const char* p, int flags, mode_t m) {
  const char* c = getenv("FW_SHIM_CREATE_FIRST");
  if (c && *c == '1' && (flags & O_CREAT)) {
    REAL(openat, openat_t);
    int fd = real_openat(dirfd, p, (flags & ~O_DIRECT), m);
    if (fd >= 0) close(fd);
  }
  errno = EINVAL;
  return -1;
}

static mode_t mode_of(int flags, va_list ap) { return (flags & (O_CREAT | O_TMPFILE)) ? va_arg(ap, mode_t) : 0; }

#define WRAP(name, call)                                                      \
  int name(const char* p, int flags, ...) {                                   \
    va_list ap; va_start(ap, flags); mode_t m = mode_of(flags, ap); va_end(ap); \
    if (flags & O_DIRECT) return refuse(AT_FDCWD, p, flags, m);               \
    REAL(name, open_t);                                      \
    return real_##name(p, flags, m);                                          \
  }
WRAP(open, 0)
WRAP(open64, 0)
#define WRAPAT(name)                                                          \
  int name(int d, const char* p, int flags, ...) {                            \
    va_list ap; va_start(ap, flags); mode_t m = mode_of(flags, ap); va_end(ap); \
    if (flags & O_DIRECT) return refuse(d, p, flags, m);                      \
    REAL(name, openat_t);                                                     \
    return real_##name(d, p, flags, m);                                       \
  }
WRAPAT(openat)
WRAPAT(openat64)
