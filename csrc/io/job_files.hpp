// Where a job's stripes live: the one interface the save and load jobs get their
// files from, whatever the target. A job holds one JobFiles and never asks which
// kind it has: local files (make_local_files: open(2) with O_DIRECT where the file
// system takes it, the io_uring or thread-pool backend, ftruncate + fsync), or a
// remote target's (files on a server, implemented in io/ beside its client: written
// and read over its own backend straight from and into the job's slots).
//
// A handle is what the job's requests carry in IoRequest::fd: a descriptor for
// local files, the implementation's own number otherwise. Every request of a save
// is reported by backend() only once its bytes are written (a remote target: once
// they are durable there), so the job may reuse its slot as soon as it hears back.
#pragma once
#include <cstdint>
#include <exception>
#include <memory>
#include <string>

#include "io/backend.hpp"
#include "io/files.hpp"

namespace fw {

class JobFiles {
 public:
  virtual ~JobFiles() = default;

  // A save's file: creates `path` (fails if it exists) to hold exactly `size` bytes.
  // .direct: opened with O_DIRECT (writes of a direct file are cut to `size` by finish()).
  virtual OpenedFile create(const std::string& path, uint64_t size) = 0;
  // Reserves a created file's space up front, so that ENOSPC or EDQUOT shows up
  // before any data moves (IoError); nothing where the target cannot.
  virtual void reserve(int handle, const std::string& path, uint64_t size) = 0;
  // A load's file: opens the existing `path` and checks that it holds exactly
  // `size` bytes (FormatError naming both sizes, "truncated" when shorter).
  virtual OpenedFile open(const std::string& path, uint64_t size) = 0;
  // The file system took O_DIRECT at open but refused a transfer (EINVAL): `path`
  // opened again without O_DIRECT (for writing when `write`), or -1 where there
  // is nothing to fall back to (the files are not opened O_DIRECT).
  virtual int reopen_buffered(const std::string& path, bool write) = 0;
  // The backend that carries one job's requests.
  virtual std::unique_ptr<IoBackend> backend(unsigned queue_depth, IoCallback cb) = 0;
  // After every write of a save's file was reported: the file is exactly `size`
  // bytes and durable, or this throws.
  virtual void finish(int handle, const std::string& path, uint64_t size) = 0;
  // Once the job is done with the handle (and every handle it got, -1 included).
  virtual void close(int handle) = 0;
  // The error to raise for request `r` of the file `path`, reported with res < 0.
  virtual std::exception_ptr error(const IoRequest* r, int64_t res, const std::string& path) = 0;
  // Whether link() can make a new name for a file of the target (the held files
  // of an incremental save need it).
  virtual bool can_link() const = 0;
  // Makes `to` a hard link to `from`: 0, or the errno of the refusal.
  virtual int link(const std::string& from, const std::string& to) = 0;
  // Requests written again because the target may have lost them (a remote
  // server that restarted before committing them); 0 for local files.
  virtual uint64_t rewrites() const { return 0; }
  // Bytes sent to a remote server straight from the job's buffers, with no user-space
  // copy on the way (nfs:// saves, nfs_wire.hpp); 0 for local files.
  virtual uint64_t bytes_sent_uncopied() const { return 0; }
  // Bytes received from a remote server straight into the job's destinations (slots,
  // tensors), with no user-space copy on the way (nfs:// loads); 0 for local files.
  virtual uint64_t bytes_received_uncopied() const { return 0; }
  // Compressed saves: a file's size is set by its writes only (no truncate: the
  // last chunk of a file is then never framed), and `bytes` of its span will stay
  // holes (finish() must not wait for them).
  virtual bool sized_by_writes() const { return false; }
  virtual void leave_holes(int /*handle*/, uint64_t /*bytes*/) {}
};

// Files on the local file systems: `direct` opens them with O_DIRECT where the
// file system takes it; the requests go to make_backend(backend, ...).
std::shared_ptr<JobFiles> make_local_files(BackendKind backend, bool direct);

}  // namespace fw
