// The NFS client's bulk transfers (Client::write_file, Client::read_file): a file cut
// into pieces of at most wsize/rsize bytes, sent over the bulk connections, one poll
// loop a connection with `depth` RPCs in flight; a write is then COMMITted and every
// piece's WRITE verifier compared with the COMMIT's, rewriting those that differ.
#include <fcntl.h>
#include <poll.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <list>
#include <mutex>
#include <thread>

#include "core/error.hpp"
#include "io/nfs_client.hpp"

#if FLASHWRITE_HAVE_LIBNFS_HEADERS
#include "io/nfs_lib.hpp"

namespace fw::nfs {

using namespace detail;

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
    fill_write_args(op.wargs, t.fh, op.off, op.len, t.wbuf + op.off);
    rc = L().rpc_nfs3_write_async(rpc, on_write, &op.wargs, &op);
  } else {
    fill_read_args(op.rargs, t.fh, op.off, op.len);
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

}  // namespace fw::nfs

#endif  // FLASHWRITE_HAVE_LIBNFS_HEADERS
