// One load: read whole stripe files into page-aligned buffers with large
// O_DIRECT requests, queue_depth in flight across all files, and verify each
// checksummed piece on verifier threads as soon as its chunk has arrived, so
// verification overlaps the reads. Tensors are then views of these buffers.
#pragma once
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <exception>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "core/aligned_buffer.hpp"
#include "io/backend.hpp"

namespace fw {

struct ReadFileSpec {
  std::string path;
  uint64_t size = 0;  // expected exact size (checked before reading)
};

struct VerifyPiece {
  uint32_t file;
  uint64_t offset, len;
  uint64_t expected;
};

struct Mismatch {
  size_t piece;
  uint64_t actual;
};

struct LoadOptions {
  BackendKind backend = BackendKind::Auto;
  unsigned queue_depth = 16;
  uint64_t chunk_bytes = 8 << 20;  // multiple of every piece-aligning block
  unsigned verify_threads = 2;
  bool direct = true;
};

class LoadJob {
 public:
  LoadJob(std::vector<ReadFileSpec> files, std::vector<VerifyPiece> pieces, LoadOptions opt);
  ~LoadJob();
  void start();
  bool wait(double timeout_s);
  void cancel();
  void rethrow() const;
  std::vector<std::shared_ptr<AlignedBuffer>> buffers() const { return buffers_; }
  std::vector<Mismatch> mismatches() const;
  double elapsed_s() const { return done_s_; }
  std::string backend() const { return backend_name_; }
  unsigned files_direct() const { return files_direct_; }

 private:
  void run();
  void on_io(IoRequest* r, int64_t res);
  void verify_worker();
  void fail(std::exception_ptr e);

  std::vector<ReadFileSpec> specs_;
  std::vector<VerifyPiece> pieces_;
  LoadOptions opt_;
  std::vector<std::shared_ptr<AlignedBuffer>> buffers_;
  std::vector<int> fds_;
  std::vector<IoRequest> requests_;
  std::vector<uint32_t> file_of_request_;  // per request (by tag)
  std::vector<std::vector<uint32_t>> chunk_pieces_;  // per request: pieces inside it
  std::unique_ptr<IoBackend> backend_;
  std::string backend_name_;
  unsigned files_direct_ = 0;

  std::atomic<bool> cancel_{false}, done_{false};
  double done_s_ = -1;
  std::chrono::steady_clock::time_point t0_;
  mutable std::mutex mu_;
  std::condition_variable cv_, verify_cv_;
  std::deque<uint32_t> verify_queue_;
  bool reads_done_ = false;
  std::vector<Mismatch> mismatches_;
  std::exception_ptr error_;
  std::thread control_;
};

}  // namespace fw
