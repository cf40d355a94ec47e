// An NFSv3 client in user space: libnfs (LGPL-2.1), loaded at run time with dlopen,
// never linked. One TCP connection (libnfs context) per stream, many WRITE/READ RPCs
// in flight on each, driven by a poll loop per connection.
//
// Durability: data goes out as UNSTABLE WRITEs and is then COMMITted. Every WRITE
// reply's verifier is compared with the COMMIT reply's; a piece written under another
// verifier (the server restarted between the WRITE and the COMMIT and may have lost
// it) is written again and committed again. After a few rounds that still disagree,
// the write fails: bytes are never reported durable unless the server committed them.
//
// Errors are IoError: errno (mapped from the NFS status), the operation, and the
// object named as nfs://SERVER[:PORT]/EXPORT/PATH. Every wait is bounded by
// timeout_ms without progress.
#pragma once
#include <atomic>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "io/job_files.hpp"

namespace fw::nfs {

// Whether libnfs could be loaded, and if not why (what to install).
bool available();
std::string unavailable_reason();
// Compiled with libnfs's headers (the client exists in this build), and their version.
bool compiled();
const char* headers_version();
// The name libnfs was loaded by ("" when it cannot be).
std::string library();

struct Options {
  std::string server;           // host name or address
  std::string export_path;      // the export, as the server lists it ("" = find it from path)
  int nfs_port = 0;             // 0: ask the portmapper
  int mount_port = 0;           // 0: ask the portmapper
  unsigned connections = 4;     // TCP connections for bulk I/O
  unsigned depth = 16;          // RPCs in flight per connection
  uint64_t io_bytes = 1 << 20;  // bytes per WRITE/READ (capped by the server's wsize/rsize)
  int timeout_ms = 10000;       // longest wait without progress before an operation fails
};

struct Stat {
  bool exists = false;
  bool is_dir = false;
  uint64_t size = 0;
};

struct WriteResult {
  uint64_t bytes = 0;
  unsigned rewrites = 0;   // pieces written again because the verifier changed
  unsigned commit_rounds = 0;
};

// The exports a server lists (MOUNT EXPORT), through the portmapper.
std::vector<std::string> list_exports(const std::string& server, int timeout_ms);

class Client {
 public:
  // Connects (one connection; the rest on the first bulk transfer) and mounts
  // opts.export_path. Throws IoError naming the server when it cannot.
  explicit Client(Options opts);
  ~Client();
  Client(const Client&) = delete;
  Client& operator=(const Client&) = delete;

  const Options& options() const { return opts_; }
  // nfs://server[:port]/export/path, for messages.
  std::string url(const std::string& path) const;

  // Namespace operations (paths relative to the export, "/"-separated). NFSv3
  // servers make these stable before they reply, so there is no directory fsync.
  Stat stat(const std::string& path);
  std::vector<std::string> listdir(const std::string& path);
  void mkdir(const std::string& path);
  void rmdir(const std::string& path);
  void unlink(const std::string& path);
  void rename(const std::string& from, const std::string& to);
  // A hard link: `to` names the file `from` names (NFS LINK; the server makes it stable before replying).
  void link(const std::string& from, const std::string& to);

  // Creates `path` (exclusive=true: fails if it exists; else truncates), writes
  // buf[0, len) over the connections, COMMITs and checks the verifiers. The caller
  // keeps buf alive and unchanged until this returns. Thread-safe (one at a time).
  WriteResult write_file(const std::string& path, const char* buf, uint64_t len, bool exclusive);
  // Reads [offset, offset + len) of `path` into buf; returns the bytes read (less
  // than len only where the file ends first).
  uint64_t read_file(const std::string& path, char* buf, uint64_t offset, uint64_t len);

  struct Conn;  // one libnfs context (internal)

  // For the save path (make_job_files): create `path` and return its file handle's
  // bytes; bulk connections taken from (and given back to) a pool of idle ones.
  std::string create(const std::string& path, bool exclusive);
  std::string lookup(const std::string& path, uint64_t* size);  // an existing file's handle and size
  std::unique_ptr<Conn> take_connection();
  void give_back(std::unique_ptr<Conn> c);
  uint64_t write_max() const { return wmax_; }
  uint64_t read_max() const { return rmax_; }
  // After a transport failure (timeout, lost connection), every connection is made
  // afresh before the next operation.
  void note_failure(int err);

 private:
  Conn& meta();
  void ensure_connections();
  std::unique_ptr<Conn> connect();
  std::mutex idle_mu_;
  std::vector<std::unique_ptr<Conn>> idle_;  // bulk connections no save uses now
  std::atomic<bool> reconnect_meta_{false}, reconnect_bulk_{false}, reconnect_idle_{false};

  Options opts_;
  std::mutex meta_mu_, bulk_mu_;
  std::vector<std::unique_ptr<Conn>> conns_;
  uint64_t wmax_ = 0, rmax_ = 0;
};

// A job's files on the server (JobFiles): a save's stripes sent straight from its
// staging slots over client->options().connections connections, each request
// reported once committed with a matching verifier; a load's read straight into
// its slots and destinations. Paths are inside the export.
// dir: for a load, the directory on the server whose files the job's paths name
// (by their last component; the job sees local placeholders of the same names).
std::shared_ptr<JobFiles> make_job_files(std::shared_ptr<Client> client, std::string dir = "");

}  // namespace fw::nfs
