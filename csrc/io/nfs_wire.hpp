// A save's WRITE3 and COMMIT3 calls, and a load's READ3 calls, on a TCP connection
// of flashwrite's own: a WRITE sent straight from the caller's buffer (sendmsg with
// the payload as its own iovec), a READ's payload received straight into the
// caller's destination (recv into it once the reply's header is decoded).
//
// libnfs 4.0 and 5.0.2 (the versions distributions ship) encode each WRITE's payload
// into a freshly allocated send buffer (rpc_nfs3_write_async: zdr_WRITE3args copies
// args->data), one user-space copy of every byte saved on top of the staging copy;
// only libnfs 6 can send from the caller's memory; and they take each READ reply
// into a buffer of their own, which the caller then copies out of. So the save
// job's WRITEs and COMMITs and the load job's READs go out here, and libnfs keeps
// everything else (MOUNT, LOOKUP, CREATE, the namespace): this connection reaches the same server address and port
// as the libnfs connection it is opened beside, and binds a reserved local port
// when that one has one (as libnfs does for servers that insist on one).
//
// The protocol: ONC RPC over TCP (RFC 5531, record marking: one fragment per call),
// AUTH_SYS with this process's uid and gid (what libnfs sends), NFSv3 WRITE
// (UNSTABLE), COMMIT and READ (RFC 1813). Replies are matched by xid, and taken
// record by record: a record mark, then the record's bytes into a small buffer,
// except a READ reply's payload, which goes to its destination once the header
// before it is decoded (at most the few bytes of one recv after the header are
// copied there); a reply record may come in several fragments. A connection that
// fails is made again and every call not yet answered is sent again (WRITE and
// COMMIT are idempotent; libnfs's autoreconnect does the same); how long to keep
// trying is the caller's bound (no reply within its timeout).
#pragma once
#include <sys/socket.h>

#include <chrono>
#include <cstdint>
#include <deque>
#include <memory>
#include <string>
#include <unordered_map>
#include <vector>

namespace fw::nfs::detail {

struct WireReply {
  void* tag = nullptr;
  bool ok = false;          // the RPC was accepted and its result decoded
  std::string error;        // else why not
  uint32_t status = 0;      // nfsstat3
  uint32_t count = 0;       // WRITE: bytes written; READ: bytes placed in the destination
  bool eof = false;         // READ: the file ends at the end of what was read
  unsigned char verf[8] = {};
};

class WireConn {
 public:
  // A connection to the peer of `like_fd` (a connected TCP socket, libnfs's), from a
  // reserved port when like_fd has one. nullptr with *why set when it cannot be made.
  static std::unique_ptr<WireConn> open_like(int like_fd, int timeout_ms, std::string* why);
  ~WireConn();
  WireConn(const WireConn&) = delete;
  WireConn& operator=(const WireConn&) = delete;

  // Queue an UNSTABLE WRITE of data[0, len) at off of the file `fh`, and a COMMIT of
  // the whole file. `data` is borrowed until the call's reply (or this is destroyed).
  void write(const std::string& fh, uint64_t off, const char* data, uint32_t len, void* tag);
  void commit(const std::string& fh, void* tag);
  // Queue a READ of [off, off + len) of `fh` into dest[0, len), which must stay
  // valid until the call's reply (or until this is destroyed or its connection is
  // made again: then the call is sent again and dest written again from its start).
  void read(const std::string& fh, uint64_t off, uint32_t len, char* dest, void* tag);

  int fd() const { return fd_; }  // -1 while disconnected
  short events() const;
  // Sends what the socket takes, reads what arrived (revents from poll, or 0), and
  // appends each reply to `out`. False when the connection failed and could not be
  // made again just now (*err says why); it is tried again at the next call.
  bool service(short revents, std::vector<WireReply>& out, std::string* err);
  size_t unanswered() const { return calls_.size(); }

 private:
  enum class Kind : uint8_t { kWrite, kCommit, kRead };
  struct Call {
    void* tag = nullptr;
    Kind kind = Kind::kWrite;
    std::vector<char> head;  // record mark + RPC header + arguments up to the payload
    const char* data = nullptr;
    uint32_t len = 0;        // WRITE: the payload sent
    uint32_t want = 0;       // READ: the most it may place
    char* dest = nullptr;    // READ: where the payload goes
  };
  WireConn() = default;
  bool connect_now(std::string* why);
  void queue(uint32_t xid, Call c);
  bool send_some(std::string* err);
  bool recv_some(std::vector<WireReply>& out, std::string* err);
  ssize_t recv_into(char* to, size_t n, std::string* err);  // >0, 0 (would block) or -1
  bool read_head(std::string* err);  // a READ reply's header decoded: its payload goes to dest
  void end_record(std::vector<WireReply>& out);
  void parse(const char* p, size_t n, std::vector<WireReply>& out);
  void reset_stream();
  void drop_connection();
  std::vector<char> header(uint32_t xid, uint32_t proc, const std::string& fh, size_t args_after_fh);

  sockaddr_storage peer_{};
  socklen_t peer_len_ = 0;
  bool reserved_port_ = false;
  int timeout_ms_ = 10000;
  int fd_ = -1;
  uint32_t next_xid_ = 0;
  std::vector<char> cred_;  // AUTH_SYS body
  std::unordered_map<uint32_t, Call> calls_;  // not yet answered
  std::deque<uint32_t> sendq_;                // of calls_, in order; the front partly sent
  size_t sent_ = 0;                           // bytes of sendq_.front() sent
  size_t reads_ = 0;      // READ calls in calls_
  // The reply being received: its record mark, the fragment's bytes left, the
  // record's bytes but a READ's payload (record_), and that payload's place.
  char mark_[4] = {};
  size_t mark_have_ = 0;
  bool in_frag_ = false, last_frag_ = false;
  size_t frag_left_ = 0;
  std::string record_;
  bool head_done_ = false;   // record_ held a READ reply's whole header
  bool discard_ = false;     // the rest of this record is dropped (a reply nobody waits for)
  uint32_t data_xid_ = 0;
  char* data_at_ = nullptr;  // where the payload's next byte goes
  size_t data_left_ = 0, placed_ = 0;
  bool data_eof_ = false;
  std::vector<char> scratch_;
  std::chrono::steady_clock::time_point retry_at_{};
};

}  // namespace fw::nfs::detail
