// The NFS client's connections and namespace: mounting the export, the exports a
// server lists, the namespace operations (GETATTR, READDIR, MKDIR, ...), file handles
// for the bulk paths, the pool of idle bulk connections, and reconnecting after a
// transport failure. The bulk transfers are in nfs_bulk.cpp, the save/load jobs'
// backend in nfs_job_backend.cpp; libnfs itself in nfs_lib.cpp.
#include "io/nfs_client.hpp"

#include <fcntl.h>
#include <sys/stat.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <stdexcept>

#include "core/error.hpp"

#if FLASHWRITE_HAVE_LIBNFS_HEADERS
#include "io/nfs_lib.hpp"
#endif

namespace fw::nfs {

#if !FLASHWRITE_HAVE_LIBNFS_HEADERS

bool compiled() { return false; }
bool available() { return false; }
const char* headers_version() { return ""; }
std::string library() { return {}; }
std::string unavailable_reason() {
  return "this build of flashwrite has no NFS client (built with FLASHWRITE_NFS=OFF, or without "
         "third_party/libnfs: rebuild with FLASHWRITE_NFS=ON)";
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
std::shared_ptr<JobFiles> make_job_files(std::shared_ptr<Client>, std::string) {
  throw std::runtime_error(unavailable_reason());
}

#else

using namespace detail;

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

#endif  // FLASHWRITE_HAVE_LIBNFS_HEADERS

}  // namespace fw::nfs
