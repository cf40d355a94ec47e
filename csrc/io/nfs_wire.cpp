// WRITE3/COMMIT3/READ3 on flashwrite's own connection (see nfs_wire.hpp).
#include "io/nfs_wire.hpp"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/uio.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <ctime>

namespace fw::nfs::detail {

namespace {

constexpr uint32_t kNfsProgram = 100003, kNfsV3 = 3, kProcRead = 6, kProcWrite = 7, kProcCommit = 21;
constexpr uint32_t kAuthSys = 1;
constexpr int kMaxIov = 64;

void put32(std::vector<char>& b, uint32_t v) {
  v = htonl(v);
  const char* p = reinterpret_cast<const char*>(&v);
  b.insert(b.end(), p, p + 4);
}
void put64(std::vector<char>& b, uint64_t v) {
  put32(b, static_cast<uint32_t>(v >> 32));
  put32(b, static_cast<uint32_t>(v));
}
void put_opaque(std::vector<char>& b, const char* p, size_t n) {
  put32(b, static_cast<uint32_t>(n));
  b.insert(b.end(), p, p + n);
  b.insert(b.end(), (4 - n % 4) % 4, '\0');
}


bool set_nonblocking(int fd) {
  int fl = fcntl(fd, F_GETFL, 0);
  return fl >= 0 && fcntl(fd, F_SETFL, fl | O_NONBLOCK) == 0;
}

uint16_t port_of(const sockaddr_storage& s) {
  if (s.ss_family == AF_INET) return ntohs(reinterpret_cast<const sockaddr_in&>(s).sin_port);
  if (s.ss_family == AF_INET6) return ntohs(reinterpret_cast<const sockaddr_in6&>(s).sin6_port);
  return 0;
}

}  // namespace

std::unique_ptr<WireConn> WireConn::open_like(int like_fd, int timeout_ms, std::string* why) {
  std::unique_ptr<WireConn> c(new WireConn());
  c->timeout_ms_ = timeout_ms > 0 ? timeout_ms : 10000;
  c->peer_len_ = sizeof c->peer_;
  if (like_fd < 0 || getpeername(like_fd, reinterpret_cast<sockaddr*>(&c->peer_), &c->peer_len_) != 0 ||
      (c->peer_.ss_family != AF_INET && c->peer_.ss_family != AF_INET6)) {
    *why = "the libnfs connection has no TCP peer";
    return nullptr;
  }
  sockaddr_storage local{};
  socklen_t llen = sizeof local;
  if (getsockname(like_fd, reinterpret_cast<sockaddr*>(&local), &llen) == 0) {
    const uint16_t p = port_of(local);
    c->reserved_port_ = p > 0 && p < 1024;
  }
  // AUTH_SYS as libnfs sends it by default: this process's uid and gid, no groups.
  put32(c->cred_, static_cast<uint32_t>(std::time(nullptr)));
  const char* host = "flashwrite";
  put_opaque(c->cred_, host, std::strlen(host));
  put32(c->cred_, static_cast<uint32_t>(getuid()));
  put32(c->cred_, static_cast<uint32_t>(getgid()));
  put32(c->cred_, 0);
  c->next_xid_ = static_cast<uint32_t>(std::time(nullptr)) * 2654435761u ^ static_cast<uint32_t>(getpid()) << 16 ^
                 static_cast<uint32_t>(like_fd);
  c->scratch_.resize(64 << 10);
  if (!c->connect_now(why)) return nullptr;
  return c;
}

WireConn::~WireConn() { drop_connection(); }

void WireConn::drop_connection() {
  if (fd_ >= 0) ::close(fd_);
  fd_ = -1;
  reset_stream();
}

void WireConn::reset_stream() {
  mark_have_ = 0;
  in_frag_ = last_frag_ = false;
  frag_left_ = 0;
  record_.clear();
  head_done_ = discard_ = data_eof_ = false;
  data_at_ = nullptr;
  data_left_ = placed_ = 0;
}

bool WireConn::connect_now(std::string* why) {
  drop_connection();
  int fd = ::socket(peer_.ss_family, SOCK_STREAM | SOCK_CLOEXEC, IPPROTO_TCP);
  if (fd < 0) return *why = std::string("socket: ") + std::strerror(errno), false;
  if (reserved_port_) {  // as libnfs: 512-1023, the first one free
    static unsigned next = static_cast<unsigned>(getpid());
    for (unsigned i = 0; i < 512; ++i) {
      const uint16_t port = static_cast<uint16_t>(512 + (next++ % 512));
      sockaddr_storage a{};
      a.ss_family = peer_.ss_family;
      if (a.ss_family == AF_INET) reinterpret_cast<sockaddr_in&>(a).sin_port = htons(port);
      else reinterpret_cast<sockaddr_in6&>(a).sin6_port = htons(port);
      if (::bind(fd, reinterpret_cast<sockaddr*>(&a), peer_len_) == 0) break;
      if (errno != EADDRINUSE) break;  // EACCES: no privilege after all; connect from any port
    }
  }
  int one = 1;
  setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);  // a COMMIT after a WRITE goes out at once
  if (!set_nonblocking(fd)) {
    *why = std::string("fcntl: ") + std::strerror(errno);
    ::close(fd);
    return false;
  }
  if (::connect(fd, reinterpret_cast<sockaddr*>(&peer_), peer_len_) != 0 && errno != EINPROGRESS) {
    *why = std::string("connect: ") + std::strerror(errno);
    ::close(fd);
    return false;
  }
  pollfd p{fd, POLLOUT, 0};
  int pr;
  do pr = ::poll(&p, 1, std::min(timeout_ms_, 2000));
  while (pr < 0 && errno == EINTR);
  int err = 0;
  socklen_t elen = sizeof err;
  if (pr <= 0) err = pr == 0 ? ETIMEDOUT : errno;
  else if (getsockopt(fd, SOL_SOCKET, SO_ERROR, &err, &elen) != 0) err = errno;
  if (err) {
    *why = std::string("connect: ") + std::strerror(err);
    ::close(fd);
    return false;
  }
  fd_ = fd;
  // Every call not yet answered goes out again, in xid order of queueing (a partly
  // sent one from its start).
  std::vector<uint32_t> xids;
  xids.reserve(calls_.size());
  for (auto& [x, c] : calls_) xids.push_back(x);
  std::sort(xids.begin(), xids.end(), [this](uint32_t a, uint32_t b) { return a - next_xid_ < b - next_xid_; });
  sendq_.assign(xids.begin(), xids.end());
  sent_ = 0;
  return true;
}

std::vector<char> WireConn::header(uint32_t xid, uint32_t proc, const std::string& fh, size_t args_after_fh) {
  std::vector<char> b;
  b.reserve(4 + 40 + cred_.size() + 4 + fh.size() + 4 + args_after_fh);
  put32(b, 0);  // the record mark, set by queue()
  put32(b, xid);
  put32(b, 0);  // CALL
  put32(b, 2);  // RPC version
  put32(b, kNfsProgram);
  put32(b, kNfsV3);
  put32(b, proc);
  put32(b, kAuthSys);
  put_opaque(b, cred_.data(), cred_.size());
  put32(b, 0);  // verifier: AUTH_NONE
  put32(b, 0);
  put_opaque(b, fh.data(), fh.size());
  return b;
}

void WireConn::write(const std::string& fh, uint64_t off, const char* data, uint32_t len, void* tag) {
  const uint32_t xid = next_xid_++;
  Call c;
  c.tag = tag;
  c.head = header(xid, kProcWrite, fh, 20);
  put64(c.head, off);
  put32(c.head, len);
  put32(c.head, 0);  // UNSTABLE
  put32(c.head, len);
  c.data = data;
  c.len = len;
  queue(xid, std::move(c));
}

void WireConn::read(const std::string& fh, uint64_t off, uint32_t len, char* dest, void* tag) {
  const uint32_t xid = next_xid_++;
  Call c;
  c.tag = tag;
  c.kind = Kind::kRead;
  c.head = header(xid, kProcRead, fh, 12);
  put64(c.head, off);
  put32(c.head, len);
  c.want = len;
  c.dest = dest;
  queue(xid, std::move(c));
}

void WireConn::commit(const std::string& fh, void* tag) {
  const uint32_t xid = next_xid_++;
  Call c;
  c.tag = tag;
  c.kind = Kind::kCommit;
  c.head = header(xid, kProcCommit, fh, 12);
  put64(c.head, 0);  // offset 0, count 0: the whole file
  put32(c.head, 0);
  queue(xid, std::move(c));
}

void WireConn::queue(uint32_t xid, Call c) {
  const size_t body = c.head.size() - 4 + c.len + (4 - c.len % 4) % 4;
  const uint32_t mark = htonl(0x80000000u | static_cast<uint32_t>(body));  // the last (only) fragment
  std::memcpy(c.head.data(), &mark, 4);
  reads_ += c.kind == Kind::kRead;
  calls_.emplace(xid, std::move(c));
  sendq_.push_back(xid);
}

short WireConn::events() const { return fd_ < 0 ? 0 : static_cast<short>(POLLIN | (sendq_.empty() ? 0 : POLLOUT)); }

bool WireConn::send_some(std::string* err) {
  static const char zeros[4] = {};
  while (!sendq_.empty()) {
    iovec iov[kMaxIov];
    int n = 0;
    size_t skip = sent_;
    for (uint32_t xid : sendq_) {
      if (n + 3 > kMaxIov) break;
      const Call& c = calls_.at(xid);
      const size_t pad = (4 - c.len % 4) % 4;
      const std::pair<const char*, size_t> parts[3] = {{c.head.data(), c.head.size()}, {c.data, c.len}, {zeros, pad}};
      for (const auto& [p, len] : parts) {
        if (skip >= len) {
          skip -= len;
          continue;
        }
        iov[n++] = iovec{const_cast<char*>(p + skip), len - skip};
        skip = 0;
      }
    }
    msghdr m{};
    m.msg_iov = iov;
    m.msg_iovlen = static_cast<size_t>(n);
    ssize_t k = ::sendmsg(fd_, &m, MSG_NOSIGNAL | MSG_DONTWAIT);
    if (k < 0) {
      if (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR) return true;
      *err = std::string("send: ") + std::strerror(errno);
      return false;
    }
    size_t left = static_cast<size_t>(k);
    while (left > 0 && !sendq_.empty()) {
      const Call& c = calls_.at(sendq_.front());
      const size_t whole = c.head.size() + c.len + (4 - c.len % 4) % 4;
      const size_t take = std::min(left, whole - sent_);
      sent_ += take;
      left -= take;
      if (sent_ == whole) {
        sendq_.pop_front();
        sent_ = 0;
      }
    }
  }
  return true;
}

bool WireConn::service(short revents, std::vector<WireReply>& out, std::string* err) {
  if (fd_ < 0) {
    if (calls_.empty()) return true;  // made again when there is something to send
    if (std::chrono::steady_clock::now() < retry_at_) return true;
    if (!connect_now(err)) {
      retry_at_ = std::chrono::steady_clock::now() + std::chrono::milliseconds(100);
      return false;
    }
  }
  std::string why;
  bool ok = true;
  if (revents & (POLLERR | POLLHUP)) revents |= POLLIN;  // recv says what happened
  if (revents & POLLIN) ok = recv_some(out, &why);
  if (ok) ok = send_some(&why);
  if (ok) return true;
  // Lost: made again now (the calls not answered go out again), or at a later call.
  if (connect_now(err)) {
    ok = send_some(err);
    if (ok) return true;
    drop_connection();
  }
  *err = why + (err->empty() ? "" : "; again: " + *err);
  retry_at_ = std::chrono::steady_clock::now() + std::chrono::milliseconds(100);
  return false;
}

}  // namespace fw::nfs::detail
