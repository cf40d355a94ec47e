// Stripes that live on a server (an nfs:// target) rather than on a local file
// system. A save job given RemoteFiles creates its stripes here and sends each
// chunk's write to backend() straight from its staging slot: no local copy in
// between; a load job opens them here and reads each chunk straight into its
// bounce slot or destination. A request is reported only once its bytes are durable on the server
// (written, committed, and the server's verifier checked), so the job may reuse
// the slot as soon as it hears back.
#pragma once
#include <cstdint>
#include <exception>
#include <memory>
#include <string>

#include "io/backend.hpp"

namespace fw {

class RemoteFiles {
 public:
  virtual ~RemoteFiles() = default;
  // Creates the new file `path` (fails if it exists) that will hold exactly `size`
  // bytes; returns the handle the job's requests carry in IoRequest::fd. Writes past
  // `size` (a chunk's aligned tail) are cut at it, so no truncate follows.
  virtual int create(const std::string& path, uint64_t size) = 0;
  // Opens the existing file `path` to read; returns its handle and sets *size.
  virtual int open(const std::string& path, uint64_t* size) = 0;
  // The backend that carries the job's requests (one per job).
  virtual std::unique_ptr<IoBackend> backend(unsigned queue_depth, IoCallback cb) = 0;
  // After every request of the file was reported: throws unless all `size` bytes
  // are durable.
  virtual void finish(int handle) = 0;
  // The error to raise for a request reported with res < 0 (names the server and
  // the operation).
  virtual std::exception_ptr error(const IoRequest* r, int64_t res) = 0;
  virtual const char* name() const = 0;
  // Requests (chunks) written again because the server's COMMIT came back under
  // another write verifier than their WRITEs (it restarted and may have lost them).
  virtual uint64_t rewrites() const { return 0; }
};

}  // namespace fw
