/* A passthrough FUSE file system that injects the faults only a file system can make.
 *
 *   fuse_faults BACKING MOUNTPOINT -f [-o FAULT=VALUE,...]
 *
 * Every path under MOUNTPOINT is BACKING's. Faults are chosen per mount (tests/fuse_util.py):
 *   fsync_eio=SUBSTR   the first fsync of a file whose path holds SUBSTR fails with EIO, once
 *                      per mount (later fsyncs succeed: after a failed fsync the data may be
 *                      gone, so a caller that retries and believes the success is wrong)
 *   write_eio_at=N     a write that reaches byte N of a file (or past it) fails with EIO
 *   read_eio_at=N      a read whose range holds byte N of a file fails with EIO
 *   only=SUBSTR        write_eio_at and read_eio_at apply only to paths that hold SUBSTR
 *   enospc_after=N     writes fail with ENOSPC once the mount has taken N bytes of writes
 *   short=N            each read and write moves at most N bytes and says so
 *   direct_io          open every file in FUSE's direct_io mode (FOPEN_DIRECT_IO): no page
 *                      cache, so a short count reaches the caller; without it buffered I/O
 *                      hides a short transfer, and the kernel turns a short O_DIRECT write
 *                      into EIO
 *   delay_ms=A-B       every operation first sleeps a random A..B ms
 *   rename_errno=E     every rename fails with errno E (18 = EXDEV, 5 = EIO)
 *   report=PATH        counts of the faults injected, rewritten to PATH as they happen
 *
 * Built by the tests with `cc ... $(pkg-config --cflags --libs fuse3)`.
 */
#define FUSE_USE_VERSION 31
#define _GNU_SOURCE

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <fuse.h>
#include <pthread.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <sys/syscall.h>
#include <sys/time.h>
#include <time.h>
#include <unistd.h>

struct faults {
  char* fsync_eio;
  long long write_eio_at;
  long long read_eio_at;
  long long enospc_after;
  long long shorten;
  char* delay_ms;
  int rename_errno;
  char* report;
  int direct_io;
  char* only;
};

static struct faults F = {NULL, -1, -1, -1, 0, NULL, 0, NULL, 0, NULL};
static const char* backing;
static int delay_lo, delay_hi;

static pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;
static long long written;  /* bytes taken by writes, for enospc_after */
static int fsync_failed;
static long long n_fsync_eio, n_write_eio, n_read_eio, n_enospc, n_short_write, n_short_read, n_delay, n_rename;

#define OPT(t, p) {t, offsetof(struct faults, p), 0}
static const struct fuse_opt fault_opts[] = {
    OPT("fsync_eio=%s", fsync_eio),       OPT("write_eio_at=%lld", write_eio_at),
    OPT("read_eio_at=%lld", read_eio_at), OPT("enospc_after=%lld", enospc_after),
    OPT("short=%lld", shorten),           OPT("delay_ms=%s", delay_ms),
    OPT("rename_errno=%d", rename_errno), OPT("report=%s", report),
    OPT("only=%s", only),                 {"direct_io", offsetof(struct faults, direct_io), 1},
    FUSE_OPT_END};

/* Called with mu held. */
static void report(void) {
  if (!F.report) return;
  char buf[512];
  int n = snprintf(buf, sizeof buf,
                   "fsync_eio=%lld write_eio=%lld read_eio=%lld enospc=%lld short_write=%lld short_read=%lld "
                   "delay=%lld rename=%lld\n",
                   n_fsync_eio, n_write_eio, n_read_eio, n_enospc, n_short_write, n_short_read, n_delay, n_rename);
  /* Written aside and renamed over the report: a test reading it mid-update (a fault
   * injected by a request still in flight) sees the old counts or the new, never none. */
  char tmp[PATH_MAX];
  snprintf(tmp, sizeof tmp, "%s.tmp", F.report);
  int fd = open(tmp, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) return;
  int ok = write(fd, buf, (size_t)n) == n;
  close(fd);
  if (ok) rename(tmp, F.report);  /* else the old counts stay: the test sees too few */
}

static void count(long long* c) {
  pthread_mutex_lock(&mu);
  ++*c;
  report();
  pthread_mutex_unlock(&mu);
}

static void delay(void) {
  if (delay_hi <= 0) return;
  unsigned seed = (unsigned)(uintptr_t)pthread_self() ^ (unsigned)time(NULL);
  static __thread unsigned state;
  if (!state) state = seed | 1;
  int ms = delay_lo + (int)(rand_r(&state) % (unsigned)(delay_hi - delay_lo + 1));
  struct timespec ts = {ms / 1000, (long)(ms % 1000) * 1000000L};
  while (nanosleep(&ts, &ts) < 0 && errno == EINTR) {}
  count(&n_delay);
}

static void real(char* out, const char* path) { snprintf(out, PATH_MAX, "%s%s", backing, path); }

#define REAL(p) char real_path[PATH_MAX]; real(real_path, p); delay()

static int fs_getattr(const char* path, struct stat* st, struct fuse_file_info* fi) {
  REAL(path);
  int rc = fi ? fstat((int)fi->fh, st) : lstat(real_path, st);
  return rc < 0 ? -errno : 0;
}

static int fs_access(const char* path, int mask) {
  REAL(path);
  return access(real_path, mask) < 0 ? -errno : 0;
}

static int fs_readdir(const char* path, void* buf, fuse_fill_dir_t fill, off_t off, struct fuse_file_info* fi,
                      enum fuse_readdir_flags flags) {
  (void)off; (void)fi; (void)flags;
  REAL(path);
  DIR* d = opendir(real_path);
  if (!d) return -errno;
  struct dirent* e;
  while ((e = readdir(d))) {
    struct stat st = {0};
    st.st_ino = e->d_ino;
    st.st_mode = (mode_t)DTTOIF(e->d_type);
    if (fill(buf, e->d_name, &st, 0, 0)) break;
  }
  closedir(d);
  return 0;
}

static int fs_mkdir(const char* path, mode_t mode) {
  REAL(path);
  return mkdir(real_path, mode) < 0 ? -errno : 0;
}

static int fs_unlink(const char* path) {
  REAL(path);
  return unlink(real_path) < 0 ? -errno : 0;
}

static int fs_rmdir(const char* path) {
  REAL(path);
  return rmdir(real_path) < 0 ? -errno : 0;
}

static int fs_rename(const char* from, const char* to, unsigned int flags) {
  REAL(from);
  char real_to[PATH_MAX];
  real(real_to, to);
  if (F.rename_errno) {
    count(&n_rename);
    return -F.rename_errno;
  }
  return syscall(SYS_renameat2, AT_FDCWD, real_path, AT_FDCWD, real_to, flags) < 0 ? -errno : 0;
}

static int fs_link(const char* from, const char* to) {
  REAL(from);
  char real_to[PATH_MAX];
  real(real_to, to);
  return link(real_path, real_to) < 0 ? -errno : 0;
}

static int fs_chmod(const char* path, mode_t mode, struct fuse_file_info* fi) {
  REAL(path);
  int rc = fi ? fchmod((int)fi->fh, mode) : chmod(real_path, mode);
  return rc < 0 ? -errno : 0;
}

static int fs_truncate(const char* path, off_t size, struct fuse_file_info* fi) {
  REAL(path);
  int rc = fi ? ftruncate((int)fi->fh, size) : truncate(real_path, size);
  return rc < 0 ? -errno : 0;
}

static int fs_utimens(const char* path, const struct timespec tv[2], struct fuse_file_info* fi) {
  REAL(path);
  int rc = fi ? futimens((int)fi->fh, tv) : utimensat(AT_FDCWD, real_path, tv, AT_SYMLINK_NOFOLLOW);
  return rc < 0 ? -errno : 0;
}

/* The caller's O_DIRECT is the kernel's business: the daemon's own buffers are not
 * aligned, so the backing file is opened without it. */
static int fs_create(const char* path, mode_t mode, struct fuse_file_info* fi) {
  REAL(path);
  int fd = open(real_path, (fi->flags & ~O_DIRECT) | O_CLOEXEC, mode);
  if (fd < 0) return -errno;
  fi->fh = (uint64_t)fd;
  fi->direct_io = (unsigned)F.direct_io;
  return 0;
}

static int fs_open(const char* path, struct fuse_file_info* fi) {
  REAL(path);
  int fd = open(real_path, (fi->flags & ~O_DIRECT) | O_CLOEXEC);
  if (fd < 0) return -errno;
  fi->fh = (uint64_t)fd;
  fi->direct_io = (unsigned)F.direct_io;
  return 0;
}

static int chosen(const char* path) { return !F.only || strstr(path, F.only); }

static int fs_read(const char* path, char* buf, size_t size, off_t off, struct fuse_file_info* fi) {
  delay();
  if (F.read_eio_at >= 0 && chosen(path) && off <= F.read_eio_at && F.read_eio_at < off + (off_t)size) {
    count(&n_read_eio);
    return -EIO;
  }
  if (F.shorten > 0 && size > (size_t)F.shorten) {
    size = (size_t)F.shorten;
    count(&n_short_read);
  }
  ssize_t n = pread((int)fi->fh, buf, size, off);
  return n < 0 ? -errno : (int)n;
}

static int fs_write(const char* path, const char* buf, size_t size, off_t off, struct fuse_file_info* fi) {
  delay();
  if (F.write_eio_at >= 0 && chosen(path) && off + (off_t)size > F.write_eio_at) {
    count(&n_write_eio);
    return -EIO;
  }
  if (F.shorten > 0 && size > (size_t)F.shorten) {
    size = (size_t)F.shorten;
    count(&n_short_write);
  }
  if (F.enospc_after >= 0) {
    pthread_mutex_lock(&mu);
    int full = written + (long long)size > F.enospc_after;
    if (!full) written += (long long)size;
    pthread_mutex_unlock(&mu);
    if (full) {
      count(&n_enospc);
      return -ENOSPC;
    }
  }
  ssize_t n = pwrite((int)fi->fh, buf, size, off);
  return n < 0 ? -errno : (int)n;
}

static int fs_statfs(const char* path, struct statvfs* st) {
  REAL(path);
  return statvfs(real_path, st) < 0 ? -errno : 0;
}

static int fs_release(const char* path, struct fuse_file_info* fi) {
  (void)path;
  close((int)fi->fh);
  return 0;
}

static int fs_fsync(const char* path, int datasync, struct fuse_file_info* fi) {
  delay();
  if (F.fsync_eio && strstr(path, F.fsync_eio)) {
    pthread_mutex_lock(&mu);
    int fail = !fsync_failed;
    fsync_failed = 1;
    pthread_mutex_unlock(&mu);
    if (fail) {
      count(&n_fsync_eio);
      return -EIO;
    }
  }
  int rc = datasync ? fdatasync((int)fi->fh) : fsync((int)fi->fh);
  return rc < 0 ? -errno : 0;
}

static void* fs_init(struct fuse_conn_info* conn, struct fuse_config* cfg) {
  (void)conn;
  cfg->use_ino = 1;
  /* Every read reaches the daemon: no page cache kept across opens, no attribute cache
   * hiding a size. */
  cfg->kernel_cache = 0;
  cfg->attr_timeout = 0;
  cfg->entry_timeout = 0;
  cfg->negative_timeout = 0;
  return NULL;
}

static void fs_destroy(void* data) {
  (void)data;
  pthread_mutex_lock(&mu);
  report();
  pthread_mutex_unlock(&mu);
}

static const struct fuse_operations ops = {
    .getattr = fs_getattr, .access = fs_access,     .readdir = fs_readdir, .mkdir = fs_mkdir,
    .unlink = fs_unlink,   .rmdir = fs_rmdir,       .rename = fs_rename,   .link = fs_link,
    .chmod = fs_chmod,     .truncate = fs_truncate, .utimens = fs_utimens, .create = fs_create,
    .open = fs_open,       .read = fs_read,         .write = fs_write,     .statfs = fs_statfs,
    .release = fs_release, .fsync = fs_fsync,       .init = fs_init,       .destroy = fs_destroy,
};

int main(int argc, char* argv[]) {
  if (argc < 3) {
    fprintf(stderr, "usage: %s BACKING MOUNTPOINT [fuse options] [-o fault=value,...]\n", argv[0]);
    return 2;
  }
  backing = realpath(argv[1], NULL);
  if (!backing) {
    perror(argv[1]);
    return 2;
  }
  argv[1] = argv[0];  /* drop BACKING: fuse_main sees "prog MOUNTPOINT options" */
  struct fuse_args args = FUSE_ARGS_INIT(argc - 1, argv + 1);
  if (fuse_opt_parse(&args, &F, fault_opts, NULL) < 0) return 2;
  if (F.delay_ms && sscanf(F.delay_ms, "%d-%d", &delay_lo, &delay_hi) != 2) {
    if (sscanf(F.delay_ms, "%d", &delay_lo) != 1) {
      fprintf(stderr, "delay_ms=A-B, not %s\n", F.delay_ms);
      return 2;
    }
    delay_hi = delay_lo;
  }
  if (delay_hi < delay_lo || delay_lo < 0) {
    fprintf(stderr, "delay_ms: %d-%d is not a range\n", delay_lo, delay_hi);
    return 2;
  }
  pthread_mutex_lock(&mu);
  report();
  pthread_mutex_unlock(&mu);
  int rc = fuse_main(args.argc, args.argv, &ops, NULL);
  fuse_opt_free_args(&args);
  return rc;
}
