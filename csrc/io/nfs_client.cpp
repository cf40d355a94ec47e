#include "io/nfs_client.hpp"

#include <dlfcn.h>
#include <fcntl.h>
#include <poll.h>
#include <sys/eventfd.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <condition_variable>
#include <deque>
#include <list>
#include <unordered_map>
#include <thread>

#include "core/error.hpp"

#if FLASHWRITE_HAVE_LIBNFS_HEADERS
// Headers for types and prototypes only: nothing here links against libnfs; every
// function is looked up with dlsym (decltype of a declaration does not use it).
#include <nfsc/libnfs.h>
#include <nfsc/libnfs-raw.h>
#include <nfsc/libnfs-raw-mount.h>
#include <nfsc/libnfs-raw-nfs.h>
#endif

namespace fw::nfs {

#if !FLASHWRITE_HAVE_LIBNFS_HEADERS

bool compiled() { return false; }
bool available() { return false; }
std::string unavailable_reason() {
  return "this build of flashwrite has no NFS client (built without libnfs's headers: apt-get install "
         "libnfs-dev, then rebuild)";
}
std::vector<std::string> list_exports(const std::string&, int) { throw std::runtime_error(unavailable_reason()); }
struct Client::Conn {};
Client::Client(Options) { throw std::runtime_error(unavailable_reason()); }
Client::~Client() = default;
// Never reached (no Client can be made); defined so the binding links.
std::string Client::url(const std::string& p) const { return p; }
Stat Client::stat(const std::string&) { return {}; }
std::vector<std::string> Client::listdir(const std::string&) { return {}; }
void Client::mkdir(const std::string&) {}
void Client::rmdir(const std::string&) {}
void Client::unlink(const std::string&) {}
void Client::rename(const std::string&, const std::string&) {}
void Client::link(const std::string&, const std::string&) {}
WriteResult Client::write_file(const std::string&, const char*, uint64_t, bool) { return {}; }
uint64_t Client::read_file(const std::string&, char*, uint64_t, uint64_t) { return 0; }
std::string Client::create(const std::string&, bool) { return {}; }
std::unique_ptr<Client::Conn> Client::take_connection() { return nullptr; }
void Client::give_back(std::unique_ptr<Conn>) {}
void Client::note_failure(int) {}
std::string Client::lookup(const std::string&, uint64_t*) { return {}; }
std::shared_ptr<RemoteFiles> make_remote_files(std::shared_ptr<Client>, std::string) {
  throw std::runtime_error(unavailable_reason());
}

#else

namespace {

// libnfs keeps struct nfs_fh private; nfs_get_fh returns one. Its layout has been
// {int len; char* val;} since libnfs 1.x (lib/libnfs-private.h).
struct FhView {
  int len;
  char* val;
};

#define FW_NFS_FUNCS(X)                                                                                   \
  X(nfs_init_context) X(nfs_destroy_context) X(nfs_parse_url_dir) X(nfs_destroy_url) X(nfs_mount)         \
  X(nfs_get_error) X(nfs_get_fd) X(nfs_which_events) X(nfs_service) X(nfs_set_timeout)                    \
  X(nfs_set_autoreconnect) X(nfs_get_rpc_context) X(nfs_get_fh) X(nfs_create) X(nfs_close) X(nfs_stat64)  \
  X(nfs_mkdir) X(nfs_rmdir) X(nfs_unlink) X(nfs_rename) X(nfs_link) X(nfs_opendir) X(nfs_readdir) X(nfs_closedir)     \
  X(nfs_get_readmax) X(nfs_get_writemax) X(rpc_nfs3_write_async) X(rpc_nfs3_commit_async)                 \
  X(rpc_nfs3_read_async) X(mount_getexports) X(mount_free_export_list) X(nfs_open)

struct Lib {
  void* handle = nullptr;
  std::string error;
#define X(f) decltype(&::f) f = nullptr;
  FW_NFS_FUNCS(X)
#undef X
};

const Lib& lib() {
  static const Lib l = [] {
    Lib out;
    // The Debian/Ubuntu runtime package is libnfs13 (libnfs.so.13); a plain
    // libnfs.so comes with the -dev package.
    // FLASHWRITE_LIBNFS names the library instead (a path or a soname).
    std::vector<std::string> names;
    const char* env = std::getenv("FLASHWRITE_LIBNFS");
    if (env && *env) names.emplace_back(env);
    else names = {"libnfs.so.13", "libnfs.so.14", "libnfs.so.16", "libnfs.so"};
    for (const auto& name : names) {
      out.handle = dlopen(name.c_str(), RTLD_NOW | RTLD_LOCAL);
      if (out.handle) break;
    }
    if (!out.handle) {
      out.error = std::string("libnfs could not be loaded (") + (env && *env ? env : "libnfs.so.13") +
                  "): install it (apt-get install libnfs13; dnf install libnfs)";
      return out;
    }
#define X(f)                                                                         \
  out.f = reinterpret_cast<decltype(&::f)>(dlsym(out.handle, #f));                   \
  if (!out.f && out.error.empty()) out.error = "libnfs lacks " #f " (libnfs >= 4 is needed)";
    FW_NFS_FUNCS(X)
#undef X
    return out;
  }();
  return l;
}

const Lib& L() {
  const Lib& l = lib();
  if (!l.error.empty()) throw IoError(ENOSYS, "load libnfs: " + l.error, "");
  return l;
}

int errno_of_status(int st) {
  switch (st) {
    case NFS3ERR_PERM: return EPERM;
    case NFS3ERR_NOENT: return ENOENT;
    case NFS3ERR_ACCES: return EACCES;
    case NFS3ERR_EXIST: return EEXIST;
    case NFS3ERR_NOTDIR: return ENOTDIR;
    case NFS3ERR_ISDIR: return EISDIR;
    case NFS3ERR_INVAL: return EINVAL;
    case NFS3ERR_FBIG: return EFBIG;
    case NFS3ERR_NOSPC: return ENOSPC;
    case NFS3ERR_ROFS: return EROFS;
    case NFS3ERR_NAMETOOLONG: return ENAMETOOLONG;
    case NFS3ERR_NOTEMPTY: return ENOTEMPTY;
    case NFS3ERR_DQUOT: return EDQUOT;
    case NFS3ERR_STALE: return ESTALE;
    case NFS3ERR_JUKEBOX: return EAGAIN;
    default: return EIO;
  }
}

using Clock = std::chrono::steady_clock;

}  // namespace

bool compiled() { return true; }
bool available() { return lib().error.empty(); }
std::string unavailable_reason() { return lib().error; }

struct Client::Conn {
  nfs_context* ctx = nullptr;
  ~Conn() {
    if (ctx) L().nfs_destroy_context(ctx);
  }
};

namespace {

// One bulk transfer of a file over several connections.
struct Piece {
  uint64_t off = 0, len = 0;
  unsigned char verf[NFS3_WRITEVERFSIZE] = {};
  bool mixed = false;  // a short write left parts under different verifiers
};

struct Transfer {
  bool write = true;
  const char* wbuf = nullptr;
  char* rbuf = nullptr;
  uint64_t base = 0;  // reads: file offset of rbuf[0]
  std::string fh;     // the file handle's bytes
  std::vector<Piece>* pieces = nullptr;
  std::vector<size_t> todo;
  std::atomic<size_t> next{0};
  std::atomic<bool> failed{false};
  std::mutex mu;
  int err = 0;
  std::string op;
  int64_t err_off = -1, err_len = -1;

  void fail(int e, std::string what, int64_t off, int64_t len) {
    std::lock_guard<std::mutex> g(mu);
    if (err) return;
    err = e;
    op = std::move(what);
    err_off = off;
    err_len = len;
    failed = true;
  }
};

struct Loop;

struct Op {
  Loop* loop = nullptr;
  size_t piece = 0;
  uint64_t off = 0, len = 0;
  WRITE3args wargs{};
  READ3args rargs{};
};

struct Loop {
  nfs_context* ctx = nullptr;
  Transfer* t = nullptr;
  unsigned depth = 1;
  unsigned inflight = 0;
  Clock::time_point progress = Clock::now();
  std::list<Op> ops;  // stable addresses: libnfs holds pointers to them until each callback
};

const char* rpc_status_name(int status) {
  switch (status) {
    case RPC_STATUS_TIMEOUT: return "timed out";
    case RPC_STATUS_CANCEL: return "cancelled (connection lost)";
    default: return "failed";
  }
}

int errno_of_rpc(int status) { return status == RPC_STATUS_TIMEOUT ? ETIMEDOUT : status == RPC_STATUS_CANCEL ? ECONNABORTED : EIO; }

void submit(Op& op);

// The transport's and then the server's verdict on a WRITE or READ reply: the reply when
// both are OK, else nullptr after failing the transfer (errno, operation, offset).
template <class Res>
Res* reply_ok(Op& op, int status, void* data, const char* kind) {
  Loop& lp = *op.loop;
  Transfer& t = *lp.t;
  lp.inflight--;
  if (status != RPC_STATUS_SUCCESS) {
    std::string msg = std::string("NFS ") + kind + " " + rpc_status_name(status);
    if (status == RPC_STATUS_ERROR && data) msg += std::string(": ") + static_cast<const char*>(data);
    t.fail(errno_of_rpc(status), msg, op.off, op.len);
    return nullptr;
  }
  auto* res = static_cast<Res*>(data);
  if (res->status != NFS3_OK) {
    t.fail(errno_of_status(res->status), std::string("NFS ") + kind + " (status " + std::to_string(res->status) + ")",
           op.off, op.len);
    return nullptr;
  }
  lp.progress = Clock::now();
  return res;
}

void on_write(rpc_context*, int status, void* data, void* priv) {
  Op& op = *static_cast<Op*>(priv);
  Transfer& t = *op.loop->t;
  auto* res = reply_ok<WRITE3res>(op, status, data, "WRITE");
  if (!res) return;
  const WRITE3resok& ok = res->WRITE3res_u.resok;
  Piece& p = (*t.pieces)[op.piece];
  if (op.off != p.off && std::memcmp(p.verf, ok.verf, NFS3_WRITEVERFSIZE) != 0) p.mixed = true;
  std::memcpy(p.verf, ok.verf, NFS3_WRITEVERFSIZE);
  if (ok.count == 0 && op.len > 0) {
    t.fail(EIO, "NFS WRITE wrote nothing", op.off, op.len);
    return;
  }
  if (ok.count < op.len) {  // a short write: send the rest
    op.off += ok.count;
    op.len -= ok.count;
    submit(op);
  }
}

void on_read(rpc_context*, int status, void* data, void* priv) {
  Op& op = *static_cast<Op*>(priv);
  Transfer& t = *op.loop->t;
  auto* res = reply_ok<READ3res>(op, status, data, "READ");
  if (!res) return;
  const READ3resok& ok = res->READ3res_u.resok;
  uint64_t n = std::min<uint64_t>(ok.data.data_len, op.len);
  std::memcpy(t.rbuf + (op.off - t.base), ok.data.data_val, n);
  if (n < op.len) {
    if (ok.eof || n == 0) {
      t.fail(EIO, "NFS READ: the file ended early (changed while read?)", op.off + n, op.len - n);
      return;
    }
    op.off += n;
    op.len -= n;
    submit(op);
  }
}

void submit(Op& op) {
  Loop& lp = *op.loop;
  Transfer& t = *lp.t;
  rpc_context* rpc = L().nfs_get_rpc_context(lp.ctx);
  int rc;
  if (t.write) {
    op.wargs.file.data.data_len = static_cast<u_int>(t.fh.size());
    op.wargs.file.data.data_val = const_cast<char*>(t.fh.data());
    op.wargs.offset = op.off;
    op.wargs.count = static_cast<count3>(op.len);
    op.wargs.stable = UNSTABLE;
    op.wargs.data.data_len = static_cast<u_int>(op.len);
    op.wargs.data.data_val = const_cast<char*>(t.wbuf + op.off);
    rc = L().rpc_nfs3_write_async(rpc, on_write, &op.wargs, &op);
  } else {
    op.rargs.file.data.data_len = static_cast<u_int>(t.fh.size());
    op.rargs.file.data.data_val = const_cast<char*>(t.fh.data());
    op.rargs.offset = op.off;
    op.rargs.count = static_cast<count3>(op.len);
    rc = L().rpc_nfs3_read_async(rpc, on_read, &op.rargs, &op);
  }
  if (rc != 0) {
    t.fail(EIO, std::string(t.write ? "NFS WRITE" : "NFS READ") + " not queued: " + L().nfs_get_error(lp.ctx),
           op.off, op.len);
    return;
  }
  lp.inflight++;
}

// Polls ctx until `done()` or no progress for timeout_ms. False on timeout or a
// broken connection (the reason in *why).
template <typename Done>
bool pump(nfs_context* ctx, int timeout_ms, Clock::time_point& progress, Done done, std::string* why) {
  while (!done()) {
    pollfd pfd{L().nfs_get_fd(ctx), static_cast<short>(L().nfs_which_events(ctx)), 0};
    int pr = poll(&pfd, pfd.fd >= 0 ? 1 : 0, 100);
    if (pr < 0 && errno != EINTR) {
      *why = std::string("poll: ") + std::strerror(errno);
      return false;
    }
    if (L().nfs_service(ctx, pr > 0 ? pfd.revents : 0) < 0) {
      *why = std::string("connection lost: ") + L().nfs_get_error(ctx);
      return false;
    }
    if (Clock::now() - progress > std::chrono::milliseconds(timeout_ms)) {
      *why = "no reply within " + std::to_string(timeout_ms) + " ms";
      return false;
    }
  }
  return true;
}

void run_loop(Loop& lp, int timeout_ms) {
  Transfer& t = *lp.t;
  lp.progress = Clock::now();
  auto fill = [&] {
    while (!t.failed && lp.inflight < lp.depth) {
      size_t i = t.next++;
      if (i >= t.todo.size()) break;
      Piece& p = (*t.pieces)[t.todo[i]];
      lp.ops.emplace_back();
      Op& op = lp.ops.back();
      op.loop = &lp;
      op.piece = t.todo[i];
      op.off = p.off;
      op.len = p.len;
      submit(op);
    }
    return lp.inflight == 0 && (t.failed || t.next >= t.todo.size());
  };
  std::string why;
  if (!pump(lp.ctx, timeout_ms, lp.progress, fill, &why))
    t.fail(why.rfind("no reply", 0) == 0 ? ETIMEDOUT : ECONNRESET,
           std::string(t.write ? "NFS WRITE: " : "NFS READ: ") + why, -1, -1);
}

}  // namespace

std::vector<std::string> list_exports(const std::string& server, int) {
  const Lib& l = L();
  exportnode* ex = l.mount_getexports(server.c_str());
  if (!ex) throw IoError(ECONNREFUSED, "NFS MOUNT EXPORT (list the server's exports)", "nfs://" + server);
  std::vector<std::string> out;
  for (exportnode* e = ex; e; e = e->ex_next) out.emplace_back(e->ex_dir);
  l.mount_free_export_list(ex);
  return out;
}

Client::Client(Options opts) : opts_(std::move(opts)) {
  L();
  if (opts_.connections == 0) opts_.connections = 1;
  if (opts_.depth == 0) opts_.depth = 1;
  conns_.reserve(opts_.connections + 1);
  conns_.push_back(connect());
  wmax_ = std::min<uint64_t>(opts_.io_bytes, L().nfs_get_writemax(conns_[0]->ctx));
  rmax_ = std::min<uint64_t>(opts_.io_bytes, L().nfs_get_readmax(conns_[0]->ctx));
  if (wmax_ == 0) wmax_ = 1 << 16;
  if (rmax_ == 0) rmax_ = 1 << 16;
}

Client::~Client() = default;

std::string Client::url(const std::string& path) const {
  std::string s = "nfs://" + opts_.server;
  if (opts_.nfs_port) s += ":" + std::to_string(opts_.nfs_port);
  s += opts_.export_path;
  if (!path.empty() && path != "/") s += (path[0] == '/' ? "" : "/") + path;
  return s;
}

std::unique_ptr<Client::Conn> Client::connect() {
  const Lib& l = L();
  auto c = std::make_unique<Conn>();
  c->ctx = l.nfs_init_context();
  if (!c->ctx) throw IoError(ENOMEM, "NFS: create a libnfs context", url(""));
  std::string u = "nfs://" + opts_.server + opts_.export_path + "?version=3";
  if (opts_.nfs_port) u += "&nfsport=" + std::to_string(opts_.nfs_port);
  if (opts_.mount_port) u += "&mountport=" + std::to_string(opts_.mount_port);
  nfs_url* parsed = l.nfs_parse_url_dir(c->ctx, u.c_str());  // applies the ports to the context
  if (!parsed) throw IoError(EINVAL, std::string("NFS: bad URL: ") + l.nfs_get_error(c->ctx), u);
  l.nfs_destroy_url(parsed);
  l.nfs_set_timeout(c->ctx, opts_.timeout_ms);
  // A server that restarts comes back on the same connection; one that stays away
  // fails each RPC at the timeout (and pump's own bound ends the wait).
  l.nfs_set_autoreconnect(c->ctx, -1);
  int rc = l.nfs_mount(c->ctx, opts_.server.c_str(), opts_.export_path.c_str());
  if (rc != 0)
    throw IoError(rc < 0 ? -rc : EIO, std::string("NFS MOUNT of the export: ") + l.nfs_get_error(c->ctx), url(""));
  return c;
}

Client::Conn& Client::meta() {
  // A connection that failed in transport is replaced rather than trusted again.
  if (reconnect_meta_) {
    conns_[0] = connect();  // throws while the server stays away; tried again next time
    reconnect_meta_ = false;
  }
  return *conns_[0];
}

void Client::note_failure(int err) {
  switch (err) {
    case ENOENT: case EEXIST: case ENOTDIR: case EISDIR: case ENOTEMPTY: case EACCES: case EROFS: case EPERM:
    case ENOSPC: case EDQUOT: case EFBIG: case ENAMETOOLONG: case EINVAL:
      return;  // the server answered: the connection is fine
    default:
      reconnect_meta_ = true;
      reconnect_bulk_ = true;
      reconnect_idle_ = true;
  }
}

void Client::ensure_connections() {
  // conns_[0] serves namespace operations; bulk transfers use 1..connections (the
  // vector's capacity is reserved up front, so growing it never moves conns_[0]
  // under a namespace operation on another thread).
  if (reconnect_bulk_.exchange(false))
    for (size_t i = 1; i < conns_.size(); ++i) conns_[i].reset();
  for (size_t i = 1; i < conns_.size(); ++i)
    if (!conns_[i] || !conns_[i]->ctx) conns_[i] = connect();
  while (conns_.size() < opts_.connections + 1) conns_.push_back(connect());
}

Stat Client::stat(const std::string& path) {
  std::lock_guard<std::mutex> g(meta_mu_);
  nfs_stat_64 st{};
  int rc = L().nfs_stat64(meta().ctx, path.c_str(), &st);
  Stat out;
  if (rc == -ENOENT) return out;
  if (rc != 0) note_failure(-rc);
  if (rc != 0) throw IoError(-rc, std::string("NFS GETATTR: ") + L().nfs_get_error(meta().ctx), url(path));
  out.exists = true;
  out.is_dir = (st.nfs_mode & S_IFMT) == S_IFDIR;
  out.size = st.nfs_size;
  return out;
}

std::vector<std::string> Client::listdir(const std::string& path) {
  std::lock_guard<std::mutex> g(meta_mu_);
  nfsdir* d = nullptr;
  int rc = L().nfs_opendir(meta().ctx, path.c_str(), &d);
  if (rc != 0) note_failure(-rc);
  if (rc != 0) throw IoError(-rc, std::string("NFS READDIR: ") + L().nfs_get_error(meta().ctx), url(path));
  std::vector<std::string> out;
  while (nfsdirent* e = L().nfs_readdir(meta().ctx, d)) {
    if (std::strcmp(e->name, ".") != 0 && std::strcmp(e->name, "..") != 0) out.emplace_back(e->name);
  }
  L().nfs_closedir(meta().ctx, d);
  return out;
}

#define FW_NFS_META(call, opname, path)                                                                  \
  do {                                                                                                   \
    std::lock_guard<std::mutex> g(meta_mu_);                                                             \
    int rc = (call);                                                                                     \
    if (rc != 0) note_failure(-rc);                                                                      \
    if (rc != 0) throw IoError(-rc, std::string(opname) + ": " + L().nfs_get_error(meta().ctx), url(path)); \
  } while (0)

void Client::mkdir(const std::string& path) { FW_NFS_META(L().nfs_mkdir(meta().ctx, path.c_str()), "NFS MKDIR", path); }
void Client::rmdir(const std::string& path) { FW_NFS_META(L().nfs_rmdir(meta().ctx, path.c_str()), "NFS RMDIR", path); }
void Client::unlink(const std::string& path) {
  FW_NFS_META(L().nfs_unlink(meta().ctx, path.c_str()), "NFS REMOVE", path);
}
void Client::rename(const std::string& from, const std::string& to) {
  FW_NFS_META(L().nfs_rename(meta().ctx, from.c_str(), to.c_str()), "NFS RENAME to " + url(to), from);
}
void Client::link(const std::string& from, const std::string& to) {
  FW_NFS_META(L().nfs_link(meta().ctx, from.c_str(), to.c_str()), "NFS LINK to " + url(to), from);
}

namespace {

std::vector<Piece> split(uint64_t off, uint64_t len, uint64_t piece) {
  std::vector<Piece> out;
  for (uint64_t o = 0; o < len; o += piece) {
    Piece p;
    p.off = off + o;
    p.len = std::min(piece, len - o);
    out.push_back(p);
  }
  return out;
}

// Runs transfer t over min(connections, items) bulk connections (conns[1..]), one poll loop
// a thread, the first on the caller's; a connection with RPCs still out afterwards is
// dropped (that cancels them), to be made afresh.
void run_transfer(std::vector<std::unique_ptr<Client::Conn>>& conns, Transfer& t, size_t items, const Options& o) {
  size_t n = std::min<size_t>(o.connections, std::max<size_t>(1, items));
  std::vector<Loop> loops(n);
  std::vector<std::thread> threads;
  for (size_t c = 0; c < n; ++c) {
    loops[c].ctx = conns[c + 1]->ctx;
    loops[c].t = &t;
    loops[c].depth = o.depth;
  }
  for (size_t c = 1; c < n; ++c) threads.emplace_back(run_loop, std::ref(loops[c]), o.timeout_ms);
  if (items) run_loop(loops[0], o.timeout_ms);
  for (auto& th : threads) th.join();
  for (size_t c = 0; c < n; ++c)
    if (loops[c].inflight > 0) conns[c + 1].reset();
}

}  // namespace

std::string Client::create(const std::string& path, bool exclusive) {
  std::lock_guard<std::mutex> g(meta_mu_);
  nfsfh* f = nullptr;
  int flags = O_WRONLY | O_CREAT | (exclusive ? O_EXCL : O_TRUNC);
  int rc = L().nfs_create(meta().ctx, path.c_str(), flags, 0644, &f);
  if (rc != 0) note_failure(-rc);
  if (rc != 0) throw IoError(-rc, std::string("NFS CREATE: ") + L().nfs_get_error(meta().ctx), url(path));
  auto* v = reinterpret_cast<FhView*>(L().nfs_get_fh(f));
  std::string fh(v->val, static_cast<size_t>(v->len));
  L().nfs_close(meta().ctx, f);
  return fh;
}

std::string Client::lookup(const std::string& path, uint64_t* size) {
  std::lock_guard<std::mutex> g(meta_mu_);
  nfsfh* f = nullptr;
  int rc = L().nfs_open(meta().ctx, path.c_str(), O_RDONLY, &f);
  if (rc != 0) note_failure(-rc);
  if (rc != 0) throw IoError(-rc, std::string("NFS LOOKUP: ") + L().nfs_get_error(meta().ctx), url(path));
  auto* v = reinterpret_cast<FhView*>(L().nfs_get_fh(f));
  std::string fh(v->val, static_cast<size_t>(v->len));
  L().nfs_close(meta().ctx, f);
  nfs_stat_64 st{};
  rc = L().nfs_stat64(meta().ctx, path.c_str(), &st);
  if (rc != 0) note_failure(-rc);
  if (rc != 0) throw IoError(-rc, std::string("NFS GETATTR: ") + L().nfs_get_error(meta().ctx), url(path));
  *size = st.nfs_size;
  return fh;
}

std::unique_ptr<Client::Conn> Client::take_connection() {
  {
    std::lock_guard<std::mutex> g(idle_mu_);
    if (reconnect_idle_.exchange(false)) idle_.clear();
    if (!idle_.empty()) {
      auto c = std::move(idle_.back());
      idle_.pop_back();
      return c;
    }
  }
  return connect();
}

void Client::give_back(std::unique_ptr<Conn> c) {
  std::lock_guard<std::mutex> g(idle_mu_);
  if (c && c->ctx && !reconnect_idle_) idle_.push_back(std::move(c));
}

WriteResult Client::write_file(const std::string& path, const char* buf, uint64_t len, bool exclusive) {
  std::lock_guard<std::mutex> bulk(bulk_mu_);
  ensure_connections();
  std::string fh = create(path, exclusive);
  std::vector<Piece> pieces = split(0, len, wmax_);
  WriteResult result;
  result.bytes = len;
  std::vector<size_t> todo(pieces.size());
  for (size_t i = 0; i < todo.size(); ++i) todo[i] = i;
  constexpr unsigned kRounds = 5;
  for (unsigned round = 0; round < kRounds; ++round) {
    Transfer t;
    t.write = true;
    t.wbuf = buf;
    t.fh = fh;
    t.pieces = &pieces;
    t.todo = todo;
    for (auto& i : todo) pieces[i].mixed = false;
    run_transfer(conns_, t, todo.size(), opts_);
    if (t.err) {
      note_failure(t.err);
      throw IoError(t.err, t.op + " (server " + opts_.server + ")", url(path), t.err_off, t.err_len);
    }

    // Fault tests restart the server here, between the WRITEs and their COMMIT.
    if (const char* pause = std::getenv("FLASHWRITE_NFS_TEST_PAUSE_BEFORE_COMMIT_MS"))
      std::this_thread::sleep_for(std::chrono::milliseconds(std::atoi(pause)));
    // COMMIT the whole file on the first bulk connection, then compare verifiers.
    nfs_context* ctx = conns_[1]->ctx;
    struct CommitState {
      bool done = false;
      int status = 0, nfs_status = 0;
      std::string error;
      unsigned char verf[NFS3_WRITEVERFSIZE] = {};
    } cs;
    COMMIT3args ca{};
    ca.file.data.data_len = static_cast<u_int>(fh.size());
    ca.file.data.data_val = fh.data();
    ca.offset = 0;
    ca.count = 0;  // to the end of the file
    auto cb = [](rpc_context*, int status, void* data, void* priv) {
      auto& s = *static_cast<CommitState*>(priv);
      s.done = true;
      s.status = status;
      if (status == RPC_STATUS_SUCCESS) {
        auto* r = static_cast<COMMIT3res*>(data);
        s.nfs_status = r->status;
        if (r->status == NFS3_OK) std::memcpy(s.verf, r->COMMIT3res_u.resok.verf, NFS3_WRITEVERFSIZE);
      } else if (status == RPC_STATUS_ERROR && data) {
        s.error = static_cast<const char*>(data);
      }
    };
    if (L().rpc_nfs3_commit_async(L().nfs_get_rpc_context(ctx), cb, &ca, &cs) != 0)
      throw IoError(EIO, std::string("NFS COMMIT not queued: ") + L().nfs_get_error(ctx), url(path));
    auto progress = Clock::now();
    std::string why;
    if (!pump(ctx, opts_.timeout_ms, progress, [&] { return cs.done; }, &why)) {
      conns_[1].reset();
      note_failure(ETIMEDOUT);
      throw IoError(why.rfind("no reply", 0) == 0 ? ETIMEDOUT : ECONNRESET,
                    "NFS COMMIT: " + why + " (server " + opts_.server + ")", url(path));
    }
    if (cs.status != RPC_STATUS_SUCCESS) note_failure(ECONNRESET);
    if (cs.status != RPC_STATUS_SUCCESS)
      throw IoError(errno_of_rpc(cs.status), std::string("NFS COMMIT ") + rpc_status_name(cs.status) + " " + cs.error +
                    " (server " + opts_.server + ")", url(path));
    if (cs.nfs_status != NFS3_OK)
      throw IoError(errno_of_status(cs.nfs_status), "NFS COMMIT (status " + std::to_string(cs.nfs_status) + ")",
                    url(path));
    result.commit_rounds = round + 1;
    todo.clear();
    for (size_t i = 0; i < pieces.size(); ++i)
      if (pieces[i].mixed || std::memcmp(pieces[i].verf, cs.verf, NFS3_WRITEVERFSIZE) != 0) todo.push_back(i);
    if (todo.empty()) return result;
    result.rewrites += static_cast<unsigned>(todo.size());  // the server restarted: those may be lost
  }
  throw IoError(EIO, "NFS COMMIT: the server's write verifier kept changing over " + std::to_string(kRounds) +
                " rounds of rewrites (server " + opts_.server + " restarting?)", url(path));
}

uint64_t Client::read_file(const std::string& path, char* buf, uint64_t offset, uint64_t len) {
  std::lock_guard<std::mutex> bulk(bulk_mu_);
  ensure_connections();
  std::string fh;
  uint64_t size = 0;
  {
    std::lock_guard<std::mutex> g(meta_mu_);
    nfsfh* f = nullptr;
    int rc = L().nfs_create(meta().ctx, path.c_str(), O_RDONLY, 0, &f);
    if (rc != 0) note_failure(-rc);
    if (rc != 0) throw IoError(-rc, std::string("NFS LOOKUP: ") + L().nfs_get_error(meta().ctx), url(path));
    auto* v = reinterpret_cast<FhView*>(L().nfs_get_fh(f));
    fh.assign(v->val, static_cast<size_t>(v->len));
    L().nfs_close(meta().ctx, f);
    nfs_stat_64 st{};
    rc = L().nfs_stat64(meta().ctx, path.c_str(), &st);
    if (rc != 0) note_failure(-rc);
    if (rc != 0) throw IoError(-rc, std::string("NFS GETATTR: ") + L().nfs_get_error(meta().ctx), url(path));
    size = st.nfs_size;
  }
  if (offset >= size) return 0;
  len = std::min(len, size - offset);
  std::vector<Piece> pieces = split(offset, len, rmax_);
  Transfer t;
  t.write = false;
  t.rbuf = buf;
  t.base = offset;
  t.fh = fh;
  t.pieces = &pieces;
  t.todo.resize(pieces.size());
  for (size_t i = 0; i < pieces.size(); ++i) t.todo[i] = i;
  run_transfer(conns_, t, pieces.size(), opts_);
  if (t.err) {
    note_failure(t.err);
    throw IoError(t.err, t.op + " (server " + opts_.server + ")", url(path), t.err_off, t.err_len);
  }
  return len;
}

// ---------------------------------------------------------------- save and load jobs
//
// NfsFiles (RemoteFiles) creates a save's stripes (or opens a load's); its backend,
// WriteBackend, carries the save job's chunk writes straight from their staging
// slots (and a load job's reads straight into its slots and destinations: each
// request cut into READs of at most rsize bytes, reported once all have replied). Each request (one
// chunk) is cut into WRITEs of at most wsize bytes, taken from one queue by every
// connection's loop (a thread each, `depth` RPCs in flight). A request whose WRITEs
// have all replied waits on its file's uncommitted list until a COMMIT of the file
// (sent when the file is fully written, when a lot is uncommitted, or when nothing
// else is left to send: a bounded staging pool waits for these slots). A COMMIT whose
// verifier differs from a request's WRITE verifier sends the request again (the
// server restarted and may have lost it); a request is reported to the job only once
// committed under its own verifier, so its slot stays untouched until then.

namespace {

constexpr unsigned kMaxRounds = 5;              // commit rounds before a request fails
constexpr uint64_t kCommitBytes = 256ull << 20;  // uncommitted bytes per file that trigger a COMMIT

struct WFile;

struct WReq {
  IoRequest* r = nullptr;
  WFile* file = nullptr;
  uint64_t off = 0, len = 0;  // cut at the file's size
  unsigned outstanding = 0;   // WRITEs not yet replied
  bool have_verf = false, mixed = false, failed = false;
  unsigned char verf[NFS3_WRITEVERFSIZE] = {};
  int err = 0;
  std::string msg;
  int64_t err_off = -1, err_len = -1;
  unsigned rounds = 0;
  uint64_t eof_at = UINT64_MAX;  // reads: where the file ended, if inside the request
};

struct WFile {
  std::string path, fh;
  uint64_t size = 0;
  uint64_t submitted = 0;  // bytes of requests the job has sent (first time)
  unsigned open = 0;       // requests with WRITEs not yet all replied
  std::vector<WReq*> uncommitted;
  uint64_t uncommitted_bytes = 0;
  uint64_t durable = 0;
};

struct SubOp {
  WReq* q = nullptr;
  uint64_t off = 0, len = 0;
};

struct WLoop;

struct WOp {
  WLoop* loop = nullptr;
  bool abandoned = false;
  bool commit = false;
  SubOp sub;
  WFile* file = nullptr;
  std::vector<WReq*> list;  // a COMMIT's requests
  WRITE3args wargs{};
  READ3args rargs{};
  COMMIT3args cargs{};
  std::list<WOp>::iterator self;
};

class WriteBackend;

struct WLoop {
  WriteBackend* be = nullptr;
  std::unique_ptr<Client::Conn> conn;
  int efd = -1;
  std::thread th;
  unsigned inflight = 0;
  Clock::time_point progress = Clock::now();
  bool dead = false;
  int dead_err = 0;
  std::string dead_msg;
  std::list<WOp> ops;
  std::vector<std::pair<IoRequest*, int64_t>> done;  // to report once out of nfs_service
};

struct ErrInfo {
  std::string msg;
  int64_t off = -1, len = -1;
};

class NfsFiles;

class WriteBackend : public IoBackend {
 public:
  WriteBackend(NfsFiles* files, std::shared_ptr<Client> client, IoCallback cb);
  ~WriteBackend() override;
  void submit(IoRequest* req) override;
  void resubmit(IoRequest* req) override { submit(req); }
  void drain() override;
  const char* name() const override { return "nfs"; }

  void run(WLoop& lp);
  void on_write(WOp& op, int status, void* data);
  void on_read(WOp& op, int status, void* data);
  void on_commit(WOp& op, int status, void* data);

 private:
  void fill(WLoop& lp);
  void send_write(WLoop& lp, const SubOp& s);
  void sub_done(WLoop& lp, WReq* q, std::vector<WFile*>& commit);  // under mu_
  void fail_req(WReq* q, int err, const std::string& msg, int64_t off, int64_t len);  // under mu_
  void report(WLoop& lp, WReq* q, int64_t res);  // under mu_
  void send_commits(WLoop& lp, std::vector<WFile*>& files);  // under mu_
  void abandon(WLoop& lp, int err, const std::string& why);
  void flush(WLoop& lp);
  void wake();

  NfsFiles* files_;
  std::shared_ptr<Client> client_;
  IoCallback cb_;
  const Options& o_;
  uint64_t wmax_, rmax_;
  int pause_ms_ = 0;
  std::mutex mu_;
  std::condition_variable drained_;
  std::deque<SubOp> queue_;
  std::unordered_map<IoRequest*, std::unique_ptr<WReq>> reqs_;
  unsigned open_ = 0;      // requests with WRITEs not yet all replied
  uint64_t pending_ = 0;   // requests not yet reported (or their callback still running)
  bool stop_ = false;
  std::vector<std::unique_ptr<WLoop>> loops_;
};

class NfsFiles : public RemoteFiles {
 public:
  NfsFiles(std::shared_ptr<Client> c, std::string dir) : client_(std::move(c)), dir_(std::move(dir)) {}
  int open(const std::string& path, uint64_t* size) override {
    auto f = std::make_unique<WFile>();
    f->path = dir_.empty() ? path : dir_ + "/" + path.substr(path.rfind('/') + 1);
    f->fh = client_->lookup(f->path, size);
    f->size = *size;
    std::lock_guard<std::mutex> g(mu_);
    files_.push_back(std::move(f));
    return static_cast<int>(files_.size() - 1);
  }
  int create(const std::string& path, uint64_t size) override {
    auto f = std::make_unique<WFile>();
    f->path = path;
    f->size = size;
    f->fh = client_->create(path, true);
    std::lock_guard<std::mutex> g(mu_);
    files_.push_back(std::move(f));
    return static_cast<int>(files_.size() - 1);
  }
  std::unique_ptr<IoBackend> backend(unsigned, IoCallback cb) override {
    return std::make_unique<WriteBackend>(this, client_, std::move(cb));
  }
  void finish(int h) override {
    WFile& f = file(h);
    std::lock_guard<std::mutex> g(mu_);
    if (f.durable != f.size)
      throw IoError(EIO, "NFS COMMIT: " + std::to_string(f.durable) + " of " + std::to_string(f.size) +
                    " bytes committed (server " + client_->options().server + ")", client_->url(f.path));
  }
  std::exception_ptr error(const IoRequest* r, int64_t res) override {
    ErrInfo e;
    {
      std::lock_guard<std::mutex> g(mu_);
      auto it = errors_.find(r);
      if (it != errors_.end()) e = it->second;
    }
    if (e.msg.empty()) e.msg = r->write ? "NFS WRITE" : "NFS READ";
    WFile& f = file(r->fd);
    return std::make_exception_ptr(IoError(static_cast<int>(-res), e.msg + " (server " + client_->options().server + ")",
                                           client_->url(f.path), e.off >= 0 ? e.off : static_cast<int64_t>(r->offset),
                                           e.len >= 0 ? e.len : static_cast<int64_t>(r->len)));
  }
  const char* name() const override { return "nfs"; }

  WFile& file(int h) {
    std::lock_guard<std::mutex> g(mu_);
    return *files_.at(static_cast<size_t>(h));
  }
  void note_error(const IoRequest* r, ErrInfo e) {
    std::lock_guard<std::mutex> g(mu_);
    errors_.emplace(r, std::move(e));
  }
  void add_durable(WFile& f, uint64_t n) {
    std::lock_guard<std::mutex> g(mu_);
    f.durable += n;
  }

 private:
  std::shared_ptr<Client> client_;
  std::string dir_;
  std::mutex mu_;
  std::vector<std::unique_ptr<WFile>> files_;
  std::unordered_map<const IoRequest*, ErrInfo> errors_;
};

void wb_on_write(rpc_context*, int status, void* data, void* priv) {
  WOp& op = *static_cast<WOp*>(priv);
  if (op.abandoned) return;
  op.loop->be->on_write(op, status, data);
}

void wb_on_read(rpc_context*, int status, void* data, void* priv) {
  WOp& op = *static_cast<WOp*>(priv);
  if (op.abandoned) return;
  op.loop->be->on_read(op, status, data);
}

void wb_on_commit(rpc_context*, int status, void* data, void* priv) {
  WOp& op = *static_cast<WOp*>(priv);
  if (op.abandoned) return;
  op.loop->be->on_commit(op, status, data);
}

WriteBackend::WriteBackend(NfsFiles* files, std::shared_ptr<Client> client, IoCallback cb)
    : files_(files), client_(std::move(client)), cb_(std::move(cb)), o_(client_->options()),
      wmax_(client_->write_max()), rmax_(client_->read_max()) {
  if (const char* pause = std::getenv("FLASHWRITE_NFS_TEST_PAUSE_BEFORE_COMMIT_MS")) pause_ms_ = std::atoi(pause);
  try {
    for (unsigned i = 0; i < std::max(1u, o_.connections); ++i) {
      auto lp = std::make_unique<WLoop>();
      lp->be = this;
      lp->conn = client_->take_connection();
      // No per-RPC deadline from the moment an RPC is queued: with depth RPCs of 1 MiB
      // queued per connection, the last waits for all before it. The loop's own bound
      // (timeout_ms without any reply while RPCs are out) decides instead.
      L().nfs_set_timeout(lp->conn->ctx, -1);
      lp->efd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
      if (lp->efd < 0) throw IoError(errno, "eventfd", "");
      loops_.push_back(std::move(lp));
    }
    for (auto& lp : loops_) {
      WLoop* p = lp.get();
      lp->th = std::thread([this, p] { run(*p); });
    }
  } catch (...) {
    {
      std::lock_guard<std::mutex> g(mu_);
      stop_ = true;
    }
    wake();
    for (auto& lp : loops_) {
      if (lp->th.joinable()) lp->th.join();
      if (lp->efd >= 0) close(lp->efd);
    }
    throw;
  }
}

WriteBackend::~WriteBackend() {
  {
    std::lock_guard<std::mutex> g(mu_);
    stop_ = true;
  }
  wake();
  for (auto& lp : loops_) {
    if (lp->th.joinable()) lp->th.join();
    close(lp->efd);
    if (!lp->dead && lp->inflight == 0) client_->give_back(std::move(lp->conn));
    for (auto& op : lp->ops) op.abandoned = true;
    lp->conn.reset();  // before the ops its callbacks could still name
  }
}

void WriteBackend::wake() {
  uint64_t one = 1;
  for (auto& lp : loops_)
    if (lp->efd >= 0) (void)!::write(lp->efd, &one, sizeof one);
}

void WriteBackend::submit(IoRequest* req) {
  {
    std::lock_guard<std::mutex> g(mu_);
    auto q = std::make_unique<WReq>();
    q->r = req;
    q->file = &files_->file(req->fd);
    q->off = req->offset;
    q->len = req->offset >= q->file->size ? 0 : std::min(req->len, q->file->size - req->offset);
    q->file->submitted += q->len;
    q->file->open++;
    open_++;
    pending_++;
    WReq* qp = q.get();
    reqs_[req] = std::move(q);
    const uint64_t piece = req->write ? wmax_ : rmax_;
    if (qp->len == 0) {
      qp->outstanding = 1;
      queue_.push_back(SubOp{qp, qp->off, 0});
    } else {
      for (uint64_t o = 0; o < qp->len; o += piece) {
        queue_.push_back(SubOp{qp, qp->off + o, std::min(piece, qp->len - o)});
        qp->outstanding++;
      }
    }
  }
  wake();
}

void WriteBackend::drain() {
  std::unique_lock<std::mutex> g(mu_);
  drained_.wait(g, [&] { return pending_ == 0; });
}

void WriteBackend::fail_req(WReq* q, int err, const std::string& msg, int64_t off, int64_t len) {
  if (q->failed) return;
  q->failed = true;
  q->err = err;
  q->msg = msg;
  q->err_off = off;
  q->err_len = len;
}

void WriteBackend::report(WLoop& lp, WReq* q, int64_t res) {
  IoRequest* r = q->r;
  if (res < 0) files_->note_error(r, ErrInfo{q->msg, q->err_off, q->err_len});
  reqs_.erase(r);
  lp.done.emplace_back(r, res);
}

// A WRITE of q replied (or was dropped): once all have, q waits for a COMMIT.
void WriteBackend::sub_done(WLoop& lp, WReq* q, std::vector<WFile*>& commit) {
  if (--q->outstanding > 0) return;
  WFile& f = *q->file;
  f.open--;
  open_--;
  if (q->failed) {
    report(lp, q, -q->err);
  } else if (!q->r->write) {  // a file that ended early: the job names it truncated
    report(lp, q, static_cast<int64_t>(q->eof_at != UINT64_MAX ? q->eof_at - q->off : q->len));
  } else {
    f.uncommitted.push_back(q);
    f.uncommitted_bytes += q->len;
    if ((f.open == 0 && f.submitted >= f.size) || f.uncommitted_bytes >= kCommitBytes) commit.push_back(&f);
  }
  if (queue_.empty() && open_ == 0) {
    // Nothing else to send: commit what waits (the job may be waiting for these slots).
    std::unordered_map<WFile*, bool> seen;
    for (WFile* c : commit) seen[c] = true;
    for (auto& [r, qq] : reqs_) {
      WFile* ff = qq->file;
      if (!ff->uncommitted.empty() && !seen[ff]) {
        seen[ff] = true;
        commit.push_back(ff);
      }
    }
  }
}

void WriteBackend::send_write(WLoop& lp, const SubOp& s) {
  lp.ops.emplace_back();
  WOp& op = lp.ops.back();
  op.self = std::prev(lp.ops.end());
  op.loop = &lp;
  op.sub = s;
  WFile& f = *s.q->file;
  if (!s.q->r->write) {
    op.rargs.file.data.data_len = static_cast<u_int>(f.fh.size());
    op.rargs.file.data.data_val = const_cast<char*>(f.fh.data());
    op.rargs.offset = s.off;
    op.rargs.count = static_cast<count3>(s.len);
    if (lp.inflight == 0) lp.progress = Clock::now();
    if (L().rpc_nfs3_read_async(L().nfs_get_rpc_context(lp.conn->ctx), wb_on_read, &op.rargs, &op) != 0) {
      std::string why = std::string("NFS READ not queued: ") + L().nfs_get_error(lp.conn->ctx);
      lp.ops.erase(op.self);
      std::vector<WFile*> commit;
      std::lock_guard<std::mutex> g(mu_);
      fail_req(s.q, EIO, why, static_cast<int64_t>(s.off), static_cast<int64_t>(s.len));
      sub_done(lp, s.q, commit);
      return;
    }
    lp.inflight++;
    return;
  }
  op.wargs.file.data.data_len = static_cast<u_int>(f.fh.size());
  op.wargs.file.data.data_val = const_cast<char*>(f.fh.data());
  op.wargs.offset = s.off;
  op.wargs.count = static_cast<count3>(s.len);
  op.wargs.stable = UNSTABLE;
  op.wargs.data.data_len = static_cast<u_int>(s.len);
  op.wargs.data.data_val = s.q->r->buf + (s.off - s.q->r->offset);
  if (lp.inflight == 0) lp.progress = Clock::now();
  if (L().rpc_nfs3_write_async(L().nfs_get_rpc_context(lp.conn->ctx), wb_on_write, &op.wargs, &op) != 0) {
    std::string why = std::string("NFS WRITE not queued: ") + L().nfs_get_error(lp.conn->ctx);
    lp.ops.erase(op.self);
    std::vector<WFile*> commit;
    std::lock_guard<std::mutex> g(mu_);
    fail_req(s.q, EIO, why, static_cast<int64_t>(s.off), static_cast<int64_t>(s.len));
    sub_done(lp, s.q, commit);
    send_commits(lp, commit);
    return;
  }
  lp.inflight++;
}

// Under mu_: a COMMIT of each file in `files` that has requests waiting for one.
void WriteBackend::send_commits(WLoop& lp, std::vector<WFile*>& files) {
  for (WFile* f : files) {
    if (f->uncommitted.empty()) continue;
    std::vector<WReq*> list;
    list.swap(f->uncommitted);
    f->uncommitted_bytes = 0;
    if (lp.dead) {
      for (WReq* q : list) {
        fail_req(q, lp.dead_err, "NFS COMMIT: " + lp.dead_msg, -1, -1);
        report(lp, q, -q->err);
      }
      continue;
    }
    if (pause_ms_ > 0) {  // fault tests restart the server here, between the WRITEs and their COMMIT
      mu_.unlock();
      std::this_thread::sleep_for(std::chrono::milliseconds(pause_ms_));
      mu_.lock();
    }
    lp.ops.emplace_back();
    WOp& op = lp.ops.back();
    op.self = std::prev(lp.ops.end());
    op.loop = &lp;
    op.commit = true;
    op.file = f;
    op.list = std::move(list);
    op.cargs.file.data.data_len = static_cast<u_int>(f->fh.size());
    op.cargs.file.data.data_val = const_cast<char*>(f->fh.data());
    op.cargs.offset = 0;
    op.cargs.count = 0;  // to the end of the file
    if (lp.inflight == 0) lp.progress = Clock::now();
    if (L().rpc_nfs3_commit_async(L().nfs_get_rpc_context(lp.conn->ctx), wb_on_commit, &op.cargs, &op) != 0) {
      std::string why = std::string("NFS COMMIT not queued: ") + L().nfs_get_error(lp.conn->ctx);
      for (WReq* q : op.list) {
        fail_req(q, EIO, why, -1, -1);
        report(lp, q, -q->err);
      }
      lp.ops.erase(op.self);
      continue;
    }
    lp.inflight++;
  }
  files.clear();
}

void WriteBackend::on_write(WOp& op, int status, void* data) {
  WLoop& lp = *op.loop;
  lp.inflight--;
  SubOp s = op.sub;
  WReq* q = s.q;
  std::vector<WFile*> commit;
  std::lock_guard<std::mutex> g(mu_);
  if (status != RPC_STATUS_SUCCESS) {
    std::string msg = std::string("NFS WRITE ") + rpc_status_name(status);
    if (status == RPC_STATUS_ERROR && data) msg += std::string(": ") + static_cast<const char*>(data);
    fail_req(q, errno_of_rpc(status), msg, static_cast<int64_t>(s.off), static_cast<int64_t>(s.len));
    client_->note_failure(errno_of_rpc(status));
  } else {
    auto* res = static_cast<WRITE3res*>(data);
    if (res->status != NFS3_OK) {
      fail_req(q, errno_of_status(res->status), "NFS WRITE (status " + std::to_string(res->status) + ")",
               static_cast<int64_t>(s.off), static_cast<int64_t>(s.len));
    } else {
      lp.progress = Clock::now();
      const WRITE3resok& ok = res->WRITE3res_u.resok;
      if (q->have_verf && std::memcmp(q->verf, ok.verf, NFS3_WRITEVERFSIZE) != 0) q->mixed = true;
      std::memcpy(q->verf, ok.verf, NFS3_WRITEVERFSIZE);
      q->have_verf = true;
      if (ok.count == 0) {
        fail_req(q, EIO, "NFS WRITE wrote nothing", static_cast<int64_t>(s.off), static_cast<int64_t>(s.len));
      } else if (ok.count < s.len && !q->failed) {  // a short write: send the rest from here
        SubOp rest{q, s.off + ok.count, s.len - ok.count};
        lp.ops.erase(op.self);
        mu_.unlock();
        send_write(lp, rest);
        mu_.lock();
        return;
      }
    }
  }
  lp.ops.erase(op.self);
  sub_done(lp, q, commit);
  send_commits(lp, commit);
}

void WriteBackend::on_read(WOp& op, int status, void* data) {
  WLoop& lp = *op.loop;
  lp.inflight--;
  SubOp s = op.sub;
  WReq* q = s.q;
  std::vector<WFile*> commit;
  std::lock_guard<std::mutex> g(mu_);
  if (status != RPC_STATUS_SUCCESS) {
    std::string msg = std::string("NFS READ ") + rpc_status_name(status);
    if (status == RPC_STATUS_ERROR && data) msg += std::string(": ") + static_cast<const char*>(data);
    fail_req(q, errno_of_rpc(status), msg, static_cast<int64_t>(s.off), static_cast<int64_t>(s.len));
    client_->note_failure(errno_of_rpc(status));
  } else {
    auto* res = static_cast<READ3res*>(data);
    if (res->status != NFS3_OK) {
      fail_req(q, errno_of_status(res->status), "NFS READ (status " + std::to_string(res->status) + ")",
               static_cast<int64_t>(s.off), static_cast<int64_t>(s.len));
    } else {
      lp.progress = Clock::now();
      const READ3resok& ok = res->READ3res_u.resok;
      uint64_t n = std::min<uint64_t>(ok.data.data_len, s.len);
      if (!q->failed) std::memcpy(q->r->buf + (s.off - q->r->offset), ok.data.data_val, n);
      if (n < s.len && !q->failed) {
        if (ok.eof || n == 0) {
          q->eof_at = std::min(q->eof_at, s.off + n);
        } else {  // a short read: ask for the rest from here
          SubOp rest{q, s.off + n, s.len - n};
          lp.ops.erase(op.self);
          mu_.unlock();
          send_write(lp, rest);
          mu_.lock();
          return;
        }
      }
    }
  }
  lp.ops.erase(op.self);
  sub_done(lp, q, commit);
}

void WriteBackend::on_commit(WOp& op, int status, void* data) {
  WLoop& lp = *op.loop;
  lp.inflight--;
  std::vector<WReq*> list = std::move(op.list);
  WFile& f = *op.file;
  lp.ops.erase(op.self);
  std::lock_guard<std::mutex> g(mu_);
  int err = 0;
  std::string msg;
  unsigned char verf[NFS3_WRITEVERFSIZE] = {};
  if (status != RPC_STATUS_SUCCESS) {
    err = errno_of_rpc(status);
    msg = std::string("NFS COMMIT ") + rpc_status_name(status);
    if (status == RPC_STATUS_ERROR && data) msg += std::string(": ") + static_cast<const char*>(data);
    client_->note_failure(err);
  } else {
    auto* res = static_cast<COMMIT3res*>(data);
    if (res->status != NFS3_OK) {
      err = errno_of_status(res->status);
      msg = "NFS COMMIT (status " + std::to_string(res->status) + ")";
    } else {
      lp.progress = Clock::now();
      std::memcpy(verf, res->COMMIT3res_u.resok.verf, NFS3_WRITEVERFSIZE);
    }
  }
  bool requeued = false;
  for (WReq* q : list) {
    if (err) {
      fail_req(q, err, msg, -1, -1);
      report(lp, q, -err);
    } else if (!q->mixed && q->have_verf && std::memcmp(q->verf, verf, NFS3_WRITEVERFSIZE) == 0) {
      files_->add_durable(f, q->len);
      report(lp, q, static_cast<int64_t>(q->r->len));
    } else if (++q->rounds >= kMaxRounds) {
      fail_req(q, EIO, "NFS COMMIT: the server's write verifier kept changing over " + std::to_string(kMaxRounds) +
               " rounds of rewrites (server restarting?)", static_cast<int64_t>(q->off), static_cast<int64_t>(q->len));
      report(lp, q, -EIO);
    } else {
      // Written under another verifier: the server restarted and may have lost it.
      q->have_verf = q->mixed = false;
      f.open++;
      open_++;
      std::vector<SubOp> subs;
      for (uint64_t o = 0; o < q->len; o += wmax_) subs.push_back(SubOp{q, q->off + o, std::min(wmax_, q->len - o)});
      if (subs.empty()) subs.push_back(SubOp{q, q->off, 0});
      q->outstanding = static_cast<unsigned>(subs.size());
      for (auto it = subs.rbegin(); it != subs.rend(); ++it) queue_.push_front(*it);
      requeued = true;
    }
  }
  if (requeued) {
    mu_.unlock();
    wake();
    mu_.lock();
  }
}

// Drops every RPC in flight on this connection (each request fails with err) and the
// connection itself; the loop then fails what it takes from the queue.
void WriteBackend::abandon(WLoop& lp, int err, const std::string& why) {
  std::vector<WFile*> commit;
  std::lock_guard<std::mutex> g(mu_);
  lp.dead = true;
  lp.dead_err = err;
  lp.dead_msg = why;
  client_->note_failure(err);
  for (auto& op : lp.ops) {
    op.abandoned = true;
    if (op.commit) {
      for (WReq* q : op.list) {
        fail_req(q, err, "NFS COMMIT: " + why, -1, -1);
        report(lp, q, -err);
      }
    } else {
      fail_req(op.sub.q, err, std::string(op.sub.q->r->write ? "NFS WRITE: " : "NFS READ: ") + why, static_cast<int64_t>(op.sub.off), static_cast<int64_t>(op.sub.len));
      sub_done(lp, op.sub.q, commit);
    }
  }
  lp.inflight = 0;
  send_commits(lp, commit);  // fails them: the loop is dead
  lp.conn.reset();           // cancels what libnfs still holds; the callbacks see abandoned ops
  lp.ops.clear();
}

void WriteBackend::fill(WLoop& lp) {
  for (;;) {
    SubOp s;
    {
      std::lock_guard<std::mutex> g(mu_);
      if (queue_.empty() || (!lp.dead && lp.inflight >= o_.depth)) return;
      s = queue_.front();
      queue_.pop_front();
      bool cancelled = request_cancelled(s.q->r);
      if (s.len == 0 || s.q->failed || cancelled || lp.dead) {
        const std::string kind = s.q->r->write ? "NFS WRITE" : "NFS READ";
        if (cancelled) fail_req(s.q, ECANCELED, kind + " cancelled", -1, -1);
        if (lp.dead) fail_req(s.q, lp.dead_err, kind + ": " + lp.dead_msg, static_cast<int64_t>(s.off),
                              static_cast<int64_t>(s.len));
        std::vector<WFile*> commit;
        sub_done(lp, s.q, commit);
        send_commits(lp, commit);
        continue;
      }
    }
    send_write(lp, s);
  }
}

void WriteBackend::flush(WLoop& lp) {
  if (lp.done.empty()) return;
  std::vector<std::pair<IoRequest*, int64_t>> done;
  done.swap(lp.done);
  for (auto& [r, res] : done) cb_(r, res);
  {
    std::lock_guard<std::mutex> g(mu_);
    pending_ -= done.size();
  }
  drained_.notify_all();
}

void WriteBackend::run(WLoop& lp) {
  for (;;) {
    fill(lp);
    flush(lp);
    {
      std::lock_guard<std::mutex> g(mu_);
      if (stop_ && lp.inflight == 0) break;
    }
    pollfd p[2] = {{lp.efd, POLLIN, 0}, {-1, 0, 0}};
    nfs_context* ctx = lp.dead ? nullptr : lp.conn->ctx;
    if (ctx) p[1] = pollfd{L().nfs_get_fd(ctx), static_cast<short>(L().nfs_which_events(ctx)), 0};
    int pr = poll(p, ctx ? 2 : 1, 100);
    if (pr < 0 && errno != EINTR) {
      abandon(lp, EIO, std::string("poll: ") + std::strerror(errno));
      continue;
    }
    if (pr > 0 && (p[0].revents & POLLIN)) {
      uint64_t v;
      (void)!::read(lp.efd, &v, sizeof v);
    }
    if (!ctx) continue;
    if (L().nfs_service(ctx, pr > 0 ? p[1].revents : 0) < 0) {
      abandon(lp, ECONNRESET, std::string("connection lost: ") + L().nfs_get_error(ctx));
    } else if (lp.inflight > 0 && Clock::now() - lp.progress > std::chrono::milliseconds(o_.timeout_ms)) {
      abandon(lp, ETIMEDOUT, "no reply within " + std::to_string(o_.timeout_ms) + " ms");
    }
    flush(lp);
  }
  flush(lp);
}

}  // namespace

std::shared_ptr<RemoteFiles> make_remote_files(std::shared_ptr<Client> client, std::string dir) {
  return std::make_shared<NfsFiles>(std::move(client), std::move(dir));
}

#endif  // FLASHWRITE_HAVE_LIBNFS_HEADERS

}  // namespace fw::nfs
