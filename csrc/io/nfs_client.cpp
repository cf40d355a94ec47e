#include "io/nfs_client.hpp"

#include <dlfcn.h>
#include <fcntl.h>
#include <poll.h>

#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <list>
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
  X(rpc_nfs3_read_async) X(mount_getexports) X(mount_free_export_list)

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

WriteResult Client::write_file(const std::string& path, const char* buf, uint64_t len, bool exclusive) {
  std::lock_guard<std::mutex> bulk(bulk_mu_);
  ensure_connections();
  std::string fh;
  {
    std::lock_guard<std::mutex> g(meta_mu_);
    nfsfh* f = nullptr;
    int flags = O_WRONLY | O_CREAT | (exclusive ? O_EXCL : O_TRUNC);
    int rc = L().nfs_create(meta().ctx, path.c_str(), flags, 0644, &f);
    if (rc != 0) note_failure(-rc);
    if (rc != 0) throw IoError(-rc, std::string("NFS CREATE: ") + L().nfs_get_error(meta().ctx), url(path));
    auto* v = reinterpret_cast<FhView*>(L().nfs_get_fh(f));
    fh.assign(v->val, static_cast<size_t>(v->len));
    L().nfs_close(meta().ctx, f);
  }
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

#endif  // FLASHWRITE_HAVE_LIBNFS_HEADERS

}  // namespace fw::nfs
