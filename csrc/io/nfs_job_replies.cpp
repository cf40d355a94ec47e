// The save and load jobs' NFS backend (see nfs_job_backend.hpp), its RPCs: a request's
// WRITEs or READs sent and their replies taken (short ones sent again for the rest),
// COMMITs of a file's written requests, and the verifier check that reports a request
// durable or sends it again.
#include "io/nfs_client.hpp"

#if FLASHWRITE_HAVE_LIBNFS_HEADERS
#include "io/nfs_job_backend.hpp"

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <optional>

namespace fw::nfs::detail {

namespace {

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

}  // namespace

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
    commit.push_back(&f);  // committed at once (nfs_job_backend.hpp: why)
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
    if (lp.inflight == 0) lp.progress = Clock::now();
    if (WireConn* w = wire(lp)) {  // received straight into the slot or the tensor (nfs_wire.hpp)
      w->read(f.fh, s.off, static_cast<uint32_t>(s.len), s.q->r->buf + (s.off - s.q->r->offset), &op);
      lp.inflight++;
      return;
    }
    fill_read_args(op.rargs, f.fh, s.off, s.len);
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
  const char* data = s.q->r->buf + (s.off - s.q->r->offset);
  if (lp.inflight == 0) lp.progress = Clock::now();
  if (WireConn* w = wire(lp)) {  // from the slot itself (nfs_wire.hpp)
    w->write(f.fh, s.off, data, static_cast<uint32_t>(s.len), &op);
    files_->note_uncopied(s.len);
    lp.inflight++;
    return;
  }
  fill_write_args(op.wargs, f.fh, s.off, s.len, data);
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
    if (WireConn* w = lp.wire.get()) {  // on the connection its WRITEs went over, if any
      w->commit(f->fh, &op);
      lp.inflight++;
      continue;
    }
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

template <class Res>
Res* WriteBackend::reply_ok(WLoop& lp, const SubOp& s, int status, void* data, const char* kind) {
  if (status != RPC_STATUS_SUCCESS) {
    std::string msg = std::string("NFS ") + kind + " " + rpc_status_name(status);
    if (status == RPC_STATUS_ERROR && data) msg += std::string(": ") + static_cast<const char*>(data);
    fail_req(s.q, errno_of_rpc(status), msg, static_cast<int64_t>(s.off), static_cast<int64_t>(s.len));
    client_->note_failure(errno_of_rpc(status));
    return nullptr;
  }
  auto* res = static_cast<Res*>(data);
  if (res->status != NFS3_OK) {
    fail_req(s.q, errno_of_status(res->status), std::string("NFS ") + kind + " (status " + std::to_string(res->status) + ")",
             static_cast<int64_t>(s.off), static_cast<int64_t>(s.len));
    return nullptr;
  }
  lp.progress = Clock::now();
  return res;
}

void WriteBackend::send_rest(WLoop& lp, WOp& op, const SubOp& rest) {
  lp.ops.erase(op.self);
  mu_.unlock();
  send_write(lp, rest);
  mu_.lock();
}

template <class Res, class Body>
void WriteBackend::on_reply(WOp& op, int status, void* data, const char* kind, Body body) {
  WLoop& lp = *op.loop;
  lp.inflight--;
  const SubOp s = op.sub;
  std::vector<WFile*> commit;
  std::lock_guard<std::mutex> g(mu_);
  if (auto* res = reply_ok<Res>(lp, s, status, data, kind)) {
    if (std::optional<SubOp> rest = body(*res, s)) {
      send_rest(lp, op, *rest);
      return;
    }
  }
  lp.ops.erase(op.self);
  sub_done(lp, s.q, commit);
  send_commits(lp, commit);  // nothing for reads: only writes wait for a COMMIT
}

void WriteBackend::on_write(WOp& op, int status, void* data) {
  on_reply<WRITE3res>(op, status, data, "WRITE", [this](const WRITE3res& res, const SubOp& s) -> std::optional<SubOp> {
    WReq* q = s.q;
    const WRITE3resok& ok = res.WRITE3res_u.resok;
    unsigned char verf[NFS3_WRITEVERFSIZE];
    std::memcpy(verf, ok.verf, NFS3_WRITEVERFSIZE);
    if (spoil_writes_ > 0 && s.off + s.len < q->off + q->len) {  // test only: a piece before the last
      --spoil_writes_;
      verf[0] ^= 0xFF;
    }
    if (q->have_verf && std::memcmp(q->verf, verf, NFS3_WRITEVERFSIZE) != 0) q->mixed = true;
    std::memcpy(q->verf, verf, NFS3_WRITEVERFSIZE);
    q->have_verf = true;
    if (ok.count == 0) {
      fail_req(q, EIO, "NFS WRITE wrote nothing", static_cast<int64_t>(s.off), static_cast<int64_t>(s.len));
    } else if (ok.count < s.len && !q->failed) {  // a short write: send the rest from here
      return SubOp{q, s.off + ok.count, s.len - ok.count};
    }
    return std::nullopt;
  });
}

void WriteBackend::on_read(WOp& op, int status, void* data) {
  on_reply<READ3res>(op, status, data, "READ", [](const READ3res& res, const SubOp& s) -> std::optional<SubOp> {
    WReq* q = s.q;
    const READ3resok& ok = res.READ3res_u.resok;
    uint64_t n = std::min<uint64_t>(ok.data.data_len, s.len);
    if (!q->failed && ok.data.data_val)  // none: the wire connection placed it already
      std::memcpy(q->r->buf + (s.off - q->r->offset), ok.data.data_val, n);
    if (n < s.len && !q->failed) {
      if (ok.eof || n == 0) {
        q->eof_at = std::min(q->eof_at, s.off + n);
      } else {  // a short read: ask for the rest from here
        return SubOp{q, s.off + n, s.len - n};
      }
    }
    return std::nullopt;
  });
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
      if (spoil_commits_ > 0) {  // test only: as if the server had restarted since the WRITEs
        --spoil_commits_;
        verf[0] ^= 0xFF;
      }
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
      files_->note_rewrite();
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

}  // namespace fw::nfs::detail

#endif  // FLASHWRITE_HAVE_LIBNFS_HEADERS
