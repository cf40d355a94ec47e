/* LD_PRELOAD recorder for test_durability_order.py: appends one line per open, fsync,
 * fdatasync, rename (rename, renameat, renameat2, syscall(SYS_renameat2)), linkat and
 * removal (unlink, rmdir, unlinkat: "unlink" or "rmdir", the path resolved against the
 * directory fd) to the file named by FW_SYSCALL_LOG, with each fd resolved to its path
 * when it is synced.
 * No root and no ptrace needed; appended to LD_PRELOAD, so it stacks on libasan.
 * FW_SYSCALL_SLOW_SUFFIX/FW_SYSCALL_SLOW_MS: fsyncs of paths ending so take that much
 * longer, which makes "the manifest was created before the stripes were durable"
 * show in the log every time instead of by chance. */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

static int log_fd = -2;
static pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;

static void record(const char* what, const char* a, const char* b, long n) {
  int saved = errno;
  pthread_mutex_lock(&mu);
  if (log_fd == -2) {
    const char* p = getenv("FW_SYSCALL_LOG");
    log_fd = p ? (int)syscall(SYS_openat, AT_FDCWD, p, O_WRONLY | O_APPEND | O_CREAT | O_CLOEXEC, 0644) : -1;
  }
  if (log_fd >= 0) {
    char line[3 * PATH_MAX];
    int len = snprintf(line, sizeof line, "%s\t%ld\t%s\t%s\n", what, n, a ? a : "", b ? b : "");
    if (len > 0) (void)!write(log_fd, line, (size_t)len < sizeof line ? (size_t)len : sizeof line - 1);
  }
  pthread_mutex_unlock(&mu);
  errno = saved;
}

static void fd_path(int fd, char* path) {
  char link[64];
  snprintf(link, sizeof link, "/proc/self/fd/%d", fd);
  ssize_t n = readlink(link, path, PATH_MAX - 1);
  path[n > 0 ? n : 0] = 0;
}

/* Before an fsync: stall it when its file is one the test wants slow. */
static void maybe_slow(const char* path) {
  const char* suffix = getenv("FW_SYSCALL_SLOW_SUFFIX");
  const char* ms = getenv("FW_SYSCALL_SLOW_MS");
  size_t lp = strlen(path), ls = suffix ? strlen(suffix) : 0;
  if (suffix && ms && ls && lp >= ls && strcmp(path + lp - ls, suffix) == 0) usleep((useconds_t)atoi(ms) * 1000);
}

static int synced(int fd, int (*real)(int)) {
  char path[PATH_MAX];
  fd_path(fd, path);
  maybe_slow(path);
  int rc = real(fd);
  if (rc == 0) record("fsync", path, NULL, fd);
  return rc;
}

#define REAL(name, type) static type real_##name; if (!real_##name) real_##name = (type)dlsym(RTLD_NEXT, #name)

typedef int (*open_t)(const char*, int, ...);
typedef int (*fd_t)(int);
typedef int (*ren_t)(const char*, const char*);
typedef int (*renat_t)(int, const char*, int, const char*);
typedef int (*renat2_t)(int, const char*, int, const char*, unsigned);
typedef long (*sys_t)(long, ...);
typedef int (*openat_t)(int, const char*, int, ...);

static mode_t mode_of(int flags, va_list ap) { return (flags & (O_CREAT | O_TMPFILE)) ? va_arg(ap, mode_t) : 0; }

int open(const char* p, int flags, ...) {
  va_list ap; va_start(ap, flags); mode_t m = mode_of(flags, ap); va_end(ap);
  REAL(open, open_t);
  int fd = real_open(p, flags, m);
  if (fd >= 0) record("open", p, NULL, flags);
  return fd;
}
int open64(const char* p, int flags, ...) {
  va_list ap; va_start(ap, flags); mode_t m = mode_of(flags, ap); va_end(ap);
  REAL(open64, open_t);
  int fd = real_open64(p, flags, m);
  if (fd >= 0) record("open", p, NULL, flags);
  return fd;
}
int openat(int d, const char* p, int flags, ...) {
  va_list ap; va_start(ap, flags); mode_t m = mode_of(flags, ap); va_end(ap);
  REAL(openat, openat_t);
  int fd = real_openat(d, p, flags, m);
  if (fd >= 0) record("open", p, NULL, flags);
  return fd;
}
int openat64(int d, const char* p, int flags, ...) {
  va_list ap; va_start(ap, flags); mode_t m = mode_of(flags, ap); va_end(ap);
  REAL(openat64, openat_t);
  int fd = real_openat64(d, p, flags, m);
  if (fd >= 0) record("open", p, NULL, flags);
  return fd;
}
int fsync(int fd) {
  REAL(fsync, fd_t);
  return synced(fd, real_fsync);
}
int fdatasync(int fd) {
  REAL(fdatasync, fd_t);
  return synced(fd, real_fdatasync);
}
int rename(const char* a, const char* b) {
  REAL(rename, ren_t);
  int rc = real_rename(a, b);
  if (rc == 0) record("rename", a, b, 0);
  return rc;
}
int renameat(int da, const char* a, int db, const char* b) {
  REAL(renameat, renat_t);
  int rc = real_renameat(da, a, db, b);
  if (rc == 0) record("rename", a, b, 0);
  return rc;
}
int renameat2(int da, const char* a, int db, const char* b, unsigned flags) {
  REAL(renameat2, renat2_t);
  int rc = real_renameat2(da, a, db, b, flags);
  if (rc == 0) record("rename", a, b, flags);
  return rc;
}
typedef int (*linkat_t)(int, const char*, int, const char*, int);
int linkat(int da, const char* a, int db, const char* b, int flags) {
  REAL(linkat, linkat_t);
  int rc = real_linkat(da, a, db, b, flags);
  if (rc == 0) record("link", a, b, flags);
  return rc;
}
/* The path `p` names relative to directory fd `d` (as the call sees it: before it runs). */
static void at_path(int d, const char* p, char* out) {
  if (p[0] == '/' || d == AT_FDCWD) {
    snprintf(out, PATH_MAX, "%s", p);
    return;
  }
  char dir[PATH_MAX];
  fd_path(d, dir);
  snprintf(out, PATH_MAX, "%s/%s", dir, p);
}
typedef int (*unlinkat_t)(int, const char*, int);
typedef int (*path_t)(const char*);
int unlink(const char* p) {
  REAL(unlink, path_t);
  int rc = real_unlink(p);
  if (rc == 0) record("unlink", p, NULL, 0);
  return rc;
}
int rmdir(const char* p) {
  REAL(rmdir, path_t);
  int rc = real_rmdir(p);
  if (rc == 0) record("rmdir", p, NULL, 0);
  return rc;
}
int unlinkat(int d, const char* p, int flags) {
  REAL(unlinkat, unlinkat_t);
  char path[PATH_MAX];
  at_path(d, p, path);
  int rc = real_unlinkat(d, p, flags);
  if (rc == 0) record(flags & AT_REMOVEDIR ? "rmdir" : "unlink", path, NULL, flags);
  return rc;
}
long syscall(long nr, ...) {
  va_list ap; va_start(ap, nr);
  long a1 = va_arg(ap, long), a2 = va_arg(ap, long), a3 = va_arg(ap, long), a4 = va_arg(ap, long),
       a5 = va_arg(ap, long), a6 = va_arg(ap, long);
  va_end(ap);
  REAL(syscall, sys_t);
  char path[PATH_MAX];
  if (nr == SYS_fsync || nr == SYS_fdatasync) {
    fd_path((int)a1, path);
    maybe_slow(path);
  }
  long rc = real_syscall(nr, a1, a2, a3, a4, a5, a6);
  if (nr == SYS_renameat2 && rc == 0) record("rename", (const char*)a2, (const char*)a4, a5);
  if ((nr == SYS_fsync || nr == SYS_fdatasync) && rc == 0) record("fsync", path, NULL, (int)a1);
  return rc;
}
