// The save and load jobs' files on an NFS server (make_job_files): the files of a
// job (NfsFiles, a JobFiles) and the backend that carries its requests (WriteBackend).
// Internal to nfs_job_backend.cpp (life cycle, queue, poll loops) and
// nfs_job_replies.cpp (WRITE/READ/COMMIT sent and answered).
//
// NfsFiles (JobFiles) creates a save's stripes (or opens a load's); its backend,
// WriteBackend, carries the save job's chunk writes straight from their staging
// slots (and a load job's reads straight into its slots and destinations: each
// request cut into READs of at most rsize bytes, reported once all have replied). Each request (one
// chunk) is cut into WRITEs of at most wsize bytes, taken from one queue by every
// connection's loop (a thread each, `depth` RPCs in flight). A request whose WRITEs
// have all replied waits on its file's uncommitted list until a COMMIT of the file
// (sent once its WRITEs have all replied). A COMMIT whose
// verifier differs from a request's WRITE verifier sends the request again (the
// server restarted and may have lost it); a request is reported to the job only once
// committed under its own verifier, so its slot stays untouched until then; each
// request sent again counts in NfsFiles::rewrites() (the save's stats).
#pragma once
#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <list>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <unordered_map>
#include <utility>
#include <vector>

#include "core/error.hpp"
#include "io/backend.hpp"
#include "io/nfs_lib.hpp"
#include "io/nfs_wire.hpp"
#include "io/job_files.hpp"

namespace fw::nfs::detail {

constexpr unsigned kMaxRounds = 5;              // commit rounds before a request fails
// A file's request is committed as soon as its WRITEs have replied. A server writes
// UNSTABLE data back only when asked (or when its page cache says so), and a request
// (with a compressed save's frame, of which there are 8 + copy threads) is handed back
// only once committed. Committed at 256 MiB or once whole, a save's write-back waited
// for the last COMMITs, after the last byte had crossed the link (0.75-0.79x of a
// shaped 4 Gbit/s link, 0.86-0.88x at 2; nfs-cp 0.78x), and a compressed save ran out
// of frames, so the link idled until the queue drained (1.2 GiB of trained state at
// 0.91x of 1 Gbit/s). Committing each request overlaps the write-back with the
// transfer: 0.93-0.99x at 1-4 Gbit/s, compressed 0.98x (docs/nfs.md sections 11-12).

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
  uint64_t durable = 0;
  uint64_t holes = 0;  // of size, left unwritten by a compressed save (frames shorter than their chunks)
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
  // The save's WRITEs and COMMITs, sent from the staging slots, and the load's READs,
  // received into their slots and tensors (nfs_wire.hpp); made on the first WRITE or
  // READ. Without it (FLASHWRITE_NFS_WIRE=0, or it could not connect) they go through
  // conn, whose libnfs copies each payload.
  std::unique_ptr<WireConn> wire;
  bool wire_tried = false;
  std::string wire_err;  // why the wire connection is down now ("" while it is up)
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
  // Under mu_: the transport's and then the server's verdict on a WRITE or READ reply
  // (kind) of s: the reply when both are OK, else nullptr after failing s's request.
  template <class Res>
  Res* reply_ok(WLoop& lp, const SubOp& s, int status, void* data, const char* kind);
  // Under mu_: op's WRITE or READ moved only part of it; drops op and sends the rest
  // (mu_ released meanwhile).
  void send_rest(WLoop& lp, WOp& op, const SubOp& rest);
  // A WRITE or READ reply: reply_ok, then body(reply, sub) under mu_, which returns the
  // part still to move (sent with send_rest) or nothing; else the sub-op is done.
  template <class Res, class Body>
  void on_reply(WOp& op, int status, void* data, const char* kind, Body body);
  void report(WLoop& lp, WReq* q, int64_t res);  // under mu_
  void send_commits(WLoop& lp, std::vector<WFile*>& files);  // under mu_
  void abandon(WLoop& lp, int err, const std::string& why);
  WireConn* wire(WLoop& lp);  // lp's wire connection, made on first use; nullptr: use libnfs
  void on_wire_replies(std::vector<WireReply>& replies);
  void flush(WLoop& lp);
  void wake();

  NfsFiles* files_;
  std::shared_ptr<Client> client_;
  IoCallback cb_;
  const Options& o_;
  uint64_t wmax_, rmax_;
  int pause_ms_ = 0;
  bool use_wire_ = true;  // FLASHWRITE_NFS_WIRE=0: WRITEs, COMMITs and READs through libnfs
  // Test only (FLASHWRITE_NFS_TEST_SPOIL_COMMIT_VERIFIER=N, read per job): the first N
  // COMMIT replies are taken as if the server had restarted (their verifier altered),
  // so the rewrite of what they cover is exercised deterministically. 0: off.
  int spoil_commits_ = 0;
  // Test only (FLASHWRITE_NFS_TEST_SPOIL_WRITE_VERIFIER=N): the first N WRITE replies
  // for a piece before the last of its request come back under another verifier, so
  // that request's pieces are mixed while its last one matches the COMMIT. 0: off.
  int spoil_writes_ = 0;
  std::mutex mu_;
  std::condition_variable drained_;
  std::deque<SubOp> queue_;
  std::unordered_map<IoRequest*, std::unique_ptr<WReq>> reqs_;
  unsigned open_ = 0;      // requests with WRITEs not yet all replied
  uint64_t pending_ = 0;   // requests not yet reported (or their callback still running)
  bool stop_ = false;
  std::vector<std::unique_ptr<WLoop>> loops_;
};

class NfsFiles : public JobFiles {
 public:
  NfsFiles(std::shared_ptr<Client> c, std::string dir) : client_(std::move(c)), dir_(std::move(dir)) {}
  OpenedFile open(const std::string& path, uint64_t size) override {
    auto f = std::make_unique<WFile>();
    f->path = dir_.empty() ? path : dir_ + "/" + path.substr(path.rfind('/') + 1);
    uint64_t actual = 0;
    f->fh = client_->lookup(f->path, &actual);
    f->size = actual;
    const int h = add(std::move(f));
    if (actual != size)
      throw FormatError("'" + path + "' is " + std::to_string(actual) + " bytes on the server, the manifest says " +
                        std::to_string(size) + (actual < size ? " (truncated)" : ""));
    return OpenedFile{h, false};
  }
  // Writes past `size` (a chunk's aligned tail) are cut at it, so finish() truncates nothing.
  OpenedFile create(const std::string& path, uint64_t size) override {
    auto f = std::make_unique<WFile>();
    f->path = path;
    f->size = size;
    f->fh = client_->create(path, true);
    return OpenedFile{add(std::move(f)), false};
  }
  void reserve(int, const std::string&, uint64_t) override {}  // NFSv3 has no ALLOCATE
  int reopen_buffered(const std::string&, bool) override { return -1; }  // never O_DIRECT
  std::unique_ptr<IoBackend> backend(unsigned, IoCallback cb) override {
    return std::make_unique<WriteBackend>(this, client_, std::move(cb));
  }
  // Every request was reported once committed: all `size` bytes must be.
  void finish(int h, const std::string&, uint64_t) override {
    WFile& f = file(h);
    std::lock_guard<std::mutex> g(mu_);
    if (f.durable + f.holes != f.size)
      throw IoError(EIO, "NFS COMMIT: " + std::to_string(f.durable) + " of " + std::to_string(f.size) +
                    " bytes committed (server " + client_->options().server + ")", client_->url(f.path));
  }
  bool sized_by_writes() const override { return true; }  // no SETATTR here: the last write sets the size
  void leave_holes(int h, uint64_t n) override {
    WFile& f = file(h);
    std::lock_guard<std::mutex> g(mu_);
    f.holes += n;
  }
  void close(int) override {}  // file handles need no closing in NFSv3
  std::exception_ptr error(const IoRequest* r, int64_t res, const std::string&) override {
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
  // Held files stay local (as before JobFiles): the server's LINK is not offered to jobs.
  bool can_link() const override { return false; }
  int link(const std::string&, const std::string&) override { return ENOTSUP; }

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
  void note_rewrite() { rewrites_.fetch_add(1); }
  uint64_t rewrites() const override { return rewrites_.load(); }
  void note_uncopied(uint64_t n) { uncopied_.fetch_add(n, std::memory_order_relaxed); }
  uint64_t bytes_sent_uncopied() const override { return uncopied_.load(); }
  void note_received(uint64_t n) { received_.fetch_add(n, std::memory_order_relaxed); }
  uint64_t bytes_received_uncopied() const override { return received_.load(); }

 private:
  int add(std::unique_ptr<WFile> f) {
    std::lock_guard<std::mutex> g(mu_);
    files_.push_back(std::move(f));
    return static_cast<int>(files_.size() - 1);
  }
  std::shared_ptr<Client> client_;
  std::string dir_;
  std::mutex mu_;
  std::vector<std::unique_ptr<WFile>> files_;
  std::unordered_map<const IoRequest*, ErrInfo> errors_;
  std::atomic<uint64_t> rewrites_{0};
  std::atomic<uint64_t> uncopied_{0};
  std::atomic<uint64_t> received_{0};
};

}  // namespace fw::nfs::detail
