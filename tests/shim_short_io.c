/* LD_PRELOAD shim for test_io_shims.py: every pwrite/pwrite64/pwritev/pwritev2 (and,
 * with FW_SHIM_SHORT_READS=1, pread/pread64) moves at most 4 KiB, as a network or FUSE
 * file system may; a correct caller resubmits the rest. The threads backend writes
 * with pwrite, so this reaches its short-write handling. FW_SHIM_REPORT names a file
 * that receives the number of shortened calls at exit. */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <fcntl.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/types.h>
#include <sys/uio.h>
#include <unistd.h>

#define CAP 4096
static atomic_long shortened;

#define REAL(name, type) static type real_##name; if (!real_##name) real_##name = (type)dlsym(RTLD_NEXT, #name)
typedef ssize_t (*pw_t)(int, const void*, size_t, off_t);
typedef ssize_t (*pr_t)(int, void*, size_t, off_t);
typedef ssize_t (*pwv_t)(int, const struct iovec*, int, off_t);
typedef ssize_t (*pwv2_t)(int, const struct iovec*, int, off_t, int);

static size_t cap(size_t n) {
  if (n <= CAP) return n;
  atomic_fetch_add(&shortened, 1);
  return CAP;
}
static int reads(void) { const char* s = getenv("FW_SHIM_SHORT_READS"); return s && *s == '1'; }

ssize_t pwrite(int fd, const void* b, size_t n, off_t o) { REAL(pwrite, pw_t); return real_pwrite(fd, b, cap(n), o); }
ssize_t pwrite64(int fd, const void* b, size_t n, off_t o) { REAL(pwrite64, pw_t); return real_pwrite64(fd, b, cap(n), o); }
ssize_t pread(int fd, void* b, size_t n, off_t o) { REAL(pread, pr_t); return real_pread(fd, b, reads() ? cap(n) : n, o); }
ssize_t pread64(int fd, void* b, size_t n, off_t o) { REAL(pread64, pr_t); return real_pread64(fd, b, reads() ? cap(n) : n, o); }

/* The first iovecs up to 4 KiB in all (the last one cut). */
static int cut(const struct iovec* iov, int cnt, struct iovec* out) {
  size_t left = CAP, total = 0;
  int k = 0;
  for (int i = 0; i < cnt; ++i) total += iov[i].iov_len;
  if (total > CAP) atomic_fetch_add(&shortened, 1);
  for (int i = 0; i < cnt && left && k < 64; ++i) {
    out[k] = iov[i];
    if (out[k].iov_len > left) out[k].iov_len = left;
    left -= out[k].iov_len;
    ++k;
  }
  return k;
}
ssize_t pwritev(int fd, const struct iovec* iov, int cnt, off_t o) {
  struct iovec v[64]; REAL(pwritev, pwv_t); return real_pwritev(fd, v, cut(iov, cnt, v), o);
}
ssize_t pwritev64(int fd, const struct iovec* iov, int cnt, off_t o) {
  struct iovec v[64]; REAL(pwritev64, pwv_t); return real_pwritev64(fd, v, cut(iov, cnt, v), o);
}
ssize_t pwritev2(int fd, const struct iovec* iov, int cnt, off_t o, int fl) {
  struct iovec v[64]; REAL(pwritev2, pwv2_t); return real_pwritev2(fd, v, cut(iov, cnt, v), o, fl);
}

__attribute__((destructor)) static void report(void) {
  const char* p = getenv("FW_SHIM_REPORT");
  if (!p) return;
  FILE* f = fopen(p, "w");
  if (f) {
    fprintf(f, "%ld\n", (long)atomic_load(&shortened));
    fclose(f);
  }
}
