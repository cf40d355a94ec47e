// The replies on flashwrite's own NFS connection (see nfs_wire.hpp): record marks,
// fragments, a READ reply's payload received straight into its destination, and the
// decoding of WRITE, COMMIT and failed READ replies. nfs_wire.cpp makes and sends the calls.
#include "io/nfs_wire.hpp"

#include <arpa/inet.h>
#include <sys/socket.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

namespace fw::nfs::detail {

namespace {

constexpr size_t kMaxRecord = 1 << 20;  // of a reply but a READ's payload: a WRITE or COMMIT reply is ~150 bytes
// While READs wait, one recv takes at most this much of a record before its header is
// decoded (a READ reply's header is ~130 bytes): the rest of the payload is received
// straight into its destination, only what came with the header is copied there.
constexpr size_t kHeadCap = 512;

// A reader of XDR that fails (ok = false) instead of running past the end.
struct Xdr {
  const char* p;
  size_t n;
  bool ok = true;
  uint32_t u32() {
    if (n < 4) return ok = false, 0;
    uint32_t v;
    std::memcpy(&v, p, 4);
    p += 4, n -= 4;
    return ntohl(v);
  }
  void skip(size_t k) {
    k = (k + 3) & ~size_t(3);
    if (n < k) return void(ok = false);
    p += k, n -= k;
  }
  void bytes(unsigned char* out, size_t k) {
    if (n < k) return void(ok = false);
    std::memcpy(out, p, k);
    p += k, n -= k;
  }
};

}  // namespace

ssize_t WireConn::recv_into(char* to, size_t n, std::string* err) {
  ssize_t k = ::recv(fd_, to, n, MSG_DONTWAIT);
  if (k == 0) return *err = "the server closed the connection", -1;
  if (k < 0) {
    if (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR) return 0;
    return *err = std::string("recv: ") + std::strerror(errno), -1;
  }
  return k;
}

bool WireConn::recv_some(std::vector<WireReply>& out, std::string* err) {
  for (;;) {
    if (!in_frag_) {  // a fragment's record mark
      const ssize_t k = recv_into(mark_ + mark_have_, 4 - mark_have_, err);
      if (k <= 0) return k == 0;
      mark_have_ += static_cast<size_t>(k);
      if (mark_have_ < 4) continue;
      uint32_t mark;
      std::memcpy(&mark, mark_, 4);
      mark = ntohl(mark);
      mark_have_ = 0;
      in_frag_ = true;
      last_frag_ = mark & 0x80000000u;
      frag_left_ = mark & 0x7FFFFFFFu;
    } else if (data_left_ > 0) {  // a READ's payload, straight into its destination
      const ssize_t k = recv_into(data_at_, std::min(data_left_, frag_left_), err);
      if (k <= 0) return k == 0;
      data_at_ += k;
      data_left_ -= static_cast<size_t>(k);
      placed_ += static_cast<size_t>(k);
      frag_left_ -= static_cast<size_t>(k);
    } else if (frag_left_ > 0) {
      const size_t cap = reads_ && !discard_ && !head_done_ ? kHeadCap : scratch_.size();
      const ssize_t k = recv_into(scratch_.data(), std::min(frag_left_, cap), err);
      if (k <= 0) return k == 0;
      frag_left_ -= static_cast<size_t>(k);
      if (!discard_) {
        if (record_.size() + static_cast<size_t>(k) > kMaxRecord) return *err = "a reply record of more than 1 MiB", false;
        record_.append(scratch_.data(), static_cast<size_t>(k));
        if (!head_done_ && !read_head(err)) return false;
      }
    }
    if (in_frag_ && frag_left_ == 0) {
      in_frag_ = false;
      if (last_frag_) end_record(out);
    }
  }
}

bool WireConn::read_head(std::string* err) {
  Xdr x{record_.data(), record_.size()};
  const uint32_t xid = x.u32(), mtype = x.u32(), reply_stat = x.u32();
  if (!x.ok) return true;  // more to come
  auto it = calls_.find(xid);
  if (mtype != 1 || reply_stat != 0 || it == calls_.end() || it->second.kind != Kind::kRead) {
    head_done_ = true;  // parsed whole once it has ended (an unknown xid is dropped there)
    discard_ = it == calls_.end() && mtype == 1;  // answered already: its payload is not kept
    return true;
  }
  if (!sendq_.empty() && sendq_.front() == xid && sent_ > 0) {  // answered before it was sent whole
    head_done_ = discard_ = true;  // sent whole, it is answered again
    return true;
  }
  x.u32();          // verifier flavor
  x.skip(x.u32());  // and body
  const uint32_t accept = x.u32();
  const uint32_t status = x.u32();
  if (!x.ok) return true;
  if (accept != 0 || status != 0) {  // a short record, parsed once it has ended
    head_done_ = true;
    return true;
  }
  if (x.u32()) x.skip(84);  // post_op_attr (fattr3)
  x.u32();                  // count (the payload's length says it again)
  const uint32_t eof = x.u32();
  const uint32_t len = x.u32();
  if (!x.ok) return true;
  const Call& c = it->second;
  if (len > c.want) {
    *err = "a READ reply of " + std::to_string(len) + " bytes to a READ of " + std::to_string(c.want);
    return false;
  }
  head_done_ = true;
  data_xid_ = xid;
  data_at_ = c.dest;
  data_left_ = len;
  data_eof_ = eof != 0;
  placed_ = 0;
  // The payload's first bytes came with the header (one recv of at most kHeadCap).
  const size_t early = std::min<size_t>(x.n, len);
  std::memcpy(data_at_, x.p, early);
  data_at_ += early;
  data_left_ -= early;
  placed_ += early;
  record_.clear();  // what follows the payload is its padding
  return true;
}

void WireConn::end_record(std::vector<WireReply>& out) {
  if (discard_) {
    // a reply nobody waits for: dropped
  } else if (data_at_ != nullptr) {  // a READ reply, its payload placed
    auto it = calls_.find(data_xid_);
    if (it != calls_.end()) {
      WireReply r;
      r.tag = it->second.tag;
      if (data_left_ > 0) {
        r.error = "NFS READ reply cut short (" + std::to_string(placed_) + " of its bytes)";
      } else {
        r.ok = true;
        r.count = static_cast<uint32_t>(placed_);
        r.eof = data_eof_;
      }
      auto qi = std::find(sendq_.begin(), sendq_.end(), data_xid_);
      if (qi != sendq_.end()) sendq_.erase(qi);
      calls_.erase(it);
      --reads_;
      out.push_back(std::move(r));
    }
  } else {
    parse(record_.data(), record_.size(), out);
  }
  record_.clear();
  head_done_ = discard_ = data_eof_ = false;
  data_at_ = nullptr;
  data_left_ = placed_ = 0;
}

void WireConn::parse(const char* p, size_t n, std::vector<WireReply>& out) {
  Xdr x{p, n};
  const uint32_t xid = x.u32();
  const uint32_t mtype = x.u32();
  if (!x.ok || mtype != 1) return;  // not a reply
  auto it = calls_.find(xid);
  if (it == calls_.end()) return;  // answered already (sent twice across a reconnect)
  // A reply to a call still being sent (the server answered early, e.g. with an error)
  // takes the call off the queue; a partly sent one must still be sent whole.
  bool partly_sent = !sendq_.empty() && sendq_.front() == xid && sent_ > 0;
  if (partly_sent) return;  // its reply comes again when it has been sent whole
  auto qi = std::find(sendq_.begin(), sendq_.end(), xid);
  if (qi != sendq_.end()) sendq_.erase(qi);
  const Kind kind = it->second.kind;
  const bool commit = kind == Kind::kCommit;
  WireReply r;
  r.tag = it->second.tag;
  reads_ -= kind == Kind::kRead;
  calls_.erase(it);
  const uint32_t reply_stat = x.u32();
  if (reply_stat != 0) {
    r.error = "RPC call denied (reject_stat " + std::to_string(x.u32()) + ")";
    out.push_back(std::move(r));
    return;
  }
  x.u32();         // verifier flavor
  x.skip(x.u32()); // and body
  const uint32_t accept = x.u32();
  if (!x.ok || accept != 0) {
    r.error = x.ok ? "RPC call not accepted (accept_stat " + std::to_string(accept) + ")" : "RPC reply cut short";
    out.push_back(std::move(r));
    return;
  }
  r.status = x.u32();
  if (kind == Kind::kRead) {  // here only when it failed (a READ that succeeded is taken by read_head)
    if (r.status == 0) r.error = "NFS READ reply cut short";
    else r.ok = true;
    out.push_back(std::move(r));
    return;
  }
  if (x.u32()) x.skip(24);  // wcc_data: pre_op_attr
  if (x.u32()) x.skip(84);  //           post_op_attr (fattr3)
  if (r.status == 0) {
    if (!commit) {
      r.count = x.u32();
      x.u32();  // committed
    }
    x.bytes(r.verf, 8);
  }
  if (!x.ok) {
    r.error = commit ? "NFS COMMIT reply cut short" : "NFS WRITE reply cut short";
    out.push_back(std::move(r));
    return;
  }
  r.ok = true;
  out.push_back(std::move(r));
}

}  // namespace fw::nfs::detail
