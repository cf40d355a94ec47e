// The save and load jobs' NFS backend (see nfs_job_backend.hpp): its connections and
// their poll loops (a thread each), the queue of WRITEs/READs the job's requests are
// cut into, dropping a connection that fails, and reporting requests to the job.
// What is sent and how replies are taken is in nfs_job_replies.cpp.
#include "io/nfs_client.hpp"

#if FLASHWRITE_HAVE_LIBNFS_HEADERS
#include "io/nfs_job_backend.hpp"

#include <poll.h>
#include <sys/eventfd.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdlib>
#include <cstring>

namespace fw::nfs {

namespace detail {

WriteBackend::WriteBackend(NfsFiles* files, std::shared_ptr<Client> client, IoCallback cb)
    : files_(files), client_(std::move(client)), cb_(std::move(cb)), o_(client_->options()),
      wmax_(client_->write_max()), rmax_(client_->read_max()) {
  if (const char* pause = std::getenv("FLASHWRITE_NFS_TEST_PAUSE_BEFORE_COMMIT_MS")) pause_ms_ = std::atoi(pause);
  if (const char* spoil = std::getenv("FLASHWRITE_NFS_TEST_SPOIL_COMMIT_VERIFIER")) spoil_commits_ = std::atoi(spoil);
  if (const char* spoil = std::getenv("FLASHWRITE_NFS_TEST_SPOIL_WRITE_VERIFIER")) spoil_writes_ = std::atoi(spoil);
  if (const char* w = std::getenv("FLASHWRITE_NFS_WIRE")) use_wire_ = std::string(w) != "0";
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
    lp->wire.reset();
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
  lp.wire.reset();           // drops what it still holds (no callbacks)
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

WireConn* WriteBackend::wire(WLoop& lp) {
  if (!use_wire_ || lp.dead) return nullptr;
  if (!lp.wire_tried) {
    lp.wire_tried = true;
    std::string why;
    lp.wire = WireConn::open_like(L().nfs_get_fd(lp.conn->ctx), o_.timeout_ms, &why);
    // Not made (a peer libnfs reaches some other way): this loop sends through libnfs.
  }
  return lp.wire.get();
}

// Replies the wire connection decoded, handed to the same code as libnfs's.
void WriteBackend::on_wire_replies(std::vector<WireReply>& replies) {
  for (WireReply& r : replies) {
    WOp& op = *static_cast<WOp*>(r.tag);
    if (op.abandoned) continue;
    const int status = r.ok ? RPC_STATUS_SUCCESS : RPC_STATUS_ERROR;
    void* data = const_cast<char*>(r.error.c_str());
    if (op.commit) {
      COMMIT3res res{};
      res.status = static_cast<nfsstat3>(r.status);
      std::memcpy(res.COMMIT3res_u.resok.verf, r.verf, NFS3_WRITEVERFSIZE);
      on_commit(op, status, r.ok ? static_cast<void*>(&res) : data);
    } else if (!op.sub.q->r->write) {
      READ3res res{};
      res.status = static_cast<nfsstat3>(r.status);
      res.READ3res_u.resok.count = r.count;
      res.READ3res_u.resok.eof = r.eof;
      res.READ3res_u.resok.data.data_len = r.count;
      res.READ3res_u.resok.data.data_val = nullptr;  // in its destination already
      if (r.ok) files_->note_received(r.count);
      on_read(op, status, r.ok ? static_cast<void*>(&res) : data);
    } else {
      WRITE3res res{};
      res.status = static_cast<nfsstat3>(r.status);
      res.WRITE3res_u.resok.count = r.count;
      std::memcpy(res.WRITE3res_u.resok.verf, r.verf, NFS3_WRITEVERFSIZE);
      on_write(op, status, r.ok ? static_cast<void*>(&res) : data);
    }
  }
  replies.clear();
}

void WriteBackend::run(WLoop& lp) {
  std::vector<WireReply> replies;
  for (;;) {
    fill(lp);
    flush(lp);
    {
      std::lock_guard<std::mutex> g(mu_);
      if (stop_ && lp.inflight == 0) break;
    }
    pollfd p[3] = {{lp.efd, POLLIN, 0}, {-1, 0, 0}, {-1, 0, 0}};
    nfs_context* ctx = lp.dead ? nullptr : lp.conn->ctx;
    WireConn* w = lp.dead ? nullptr : lp.wire.get();
    if (ctx) p[1] = pollfd{L().nfs_get_fd(ctx), static_cast<short>(L().nfs_which_events(ctx)), 0};
    if (w) p[2] = pollfd{w->fd(), w->events(), 0};
    int pr = poll(p, ctx ? 3 : 1, 100);
    if (pr < 0 && errno != EINTR) {
      abandon(lp, EIO, std::string("poll: ") + std::strerror(errno));
      continue;
    }
    if (pr > 0 && (p[0].revents & POLLIN)) {
      uint64_t v;
      (void)!::read(lp.efd, &v, sizeof v);
    }
    if (!ctx) continue;
    if (w) {
      // A connection lost is made again here (every call not answered sent again) until
      // the bound below gives up on the server.
      std::string err;
      lp.wire_err = w->service(pr > 0 ? p[2].revents : 0, replies, &err) ? "" : err;
      on_wire_replies(replies);
    }
    if (lp.dead) continue;
    if (L().nfs_service(ctx, pr > 0 ? p[1].revents : 0) < 0) {
      abandon(lp, ECONNRESET, std::string("connection lost: ") + L().nfs_get_error(ctx));
    } else if (lp.inflight > 0 && Clock::now() - lp.progress > std::chrono::milliseconds(o_.timeout_ms)) {
      abandon(lp, ETIMEDOUT, "no reply within " + std::to_string(o_.timeout_ms) + " ms" +
                                 (lp.wire_err.empty() ? "" : " (connection lost: " + lp.wire_err + ")"));
    }
    flush(lp);
  }
  flush(lp);
}

}  // namespace detail

std::shared_ptr<JobFiles> make_job_files(std::shared_ptr<Client> client, std::string dir) {
  return std::make_shared<detail::NfsFiles>(std::move(client), std::move(dir));
}

}  // namespace fw::nfs

#endif  // FLASHWRITE_HAVE_LIBNFS_HEADERS
