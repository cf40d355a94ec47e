// One load: read stripe files with large O_DIRECT requests, queue_depth in
// flight across all files, and verify each checksummed piece on worker
// threads as soon as its chunk has arrived, so verification overlaps the
// reads. A file whose bytes are all placed (read/placements.hpp) goes through
// the placer's bounce slots only; the others are read whole into page-aligned
// buffers that tensors then view.
//
// Fresh destination memory costs more to fault in than the disk takes to fill
// it on some hosts (a VM that hands freed pages back to its host: ~1 s per GiB
// per core, against ~1 GB/s of reads), so the reading thread does not fault
// anything in: the workers fault in the destinations of chunks in read order
// whenever they have nothing to verify or copy out, ahead of the reads.
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
#include "core/defaults.hpp"
#include "core/job_control.hpp"
#include "io/backend.hpp"
#include "io/job_files.hpp"
#include "read/chunk_placer.hpp"

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
  // Where the stripes are (local files, or a remote target's): opened and
  // size-checked there, read by its backend straight into the slots and
  // destinations. Required.
  std::shared_ptr<JobFiles> files;
  unsigned queue_depth = defaults::kReadQueueDepth;
  uint64_t chunk_bytes = defaults::kReadChunkBytes;  // multiple of every piece-aligning block
  unsigned verify_threads = defaults::verify_threads();
  std::shared_ptr<ChunkPlacer> placer;  // set when some bytes are placed
  // Compressed files (core/codec.hpp): per file, empty (plain), or per chunk of
  // chunk_bytes its frame's length (0: stored as it is). Frames are read into
  // a buffer of their own and decoded on the worker threads, then verified.
  std::vector<std::vector<uint64_t>> frames;
};

class LoadJob {
 public:
  LoadJob(std::vector<ReadFileSpec> files, std::vector<VerifyPiece> pieces, LoadOptions opt);
  ~LoadJob();
  void start();
  bool wait(double timeout_s);
  void cancel();  // no-op once the load is done
  // After cancel(): wait until no destination is written any more (no chunk is being
  // copied out; later chunks are not placed), true then, false at the timeout. Reads
  // still in flight go to the job's own buffers and slots, so the caller may go on
  // while they drain; the job itself must still be joined (wait) before it is freed.
  // With a placer whose copies land asynchronously (GPUs), it waits for the whole job.
  bool wait_quiet(double timeout_s);
  void rethrow() const;
  // Per file: its whole-file buffer, or nullptr for a file wholly placed.
  std::vector<std::shared_ptr<AlignedBuffer>> buffers() const { return buffers_; }
  std::vector<Mismatch> mismatches() const;
  double elapsed_s() const { return done_s_; }
  std::string backend() const { return backend_name_; }
  unsigned files_direct() const { return files_direct_.load(); }
  uint64_t received_uncopied() const { return opt_.files->bytes_received_uncopied(); }

 private:
  void run();
  void add_requests(uint32_t file);  // its chunks, in file order
  void map_pieces();                 // chunk_pieces_, once requests_ are sorted
  void on_io(IoRequest* r, int64_t res);
  void verify_worker();
  // Fault-ahead state per request: 0 not yet, 1 being faulted in, 2 done or
  // not wanted. claim_fault moves 0 to `to`; whoever claims it does the work.
  bool claim_fault(size_t request, uint8_t to);
  void fault_in(size_t request);  // the request's destinations (placed bytes or buffer)
  void fault_in_once(size_t request);  // fault_in unless someone has claimed it
  void fault_ahead_one();  // the next unclaimed request in read order
  void fail(std::exception_ptr e);
  bool fall_back_to_buffered(IoRequest* r, uint32_t file);
  int read_fd(uint32_t file);
  // Compressed chunks (load_frames.cpp).
  void init_frames();
  bool framed(size_t request) const { return !zframe_.empty() && zframe_[request]; }
  uint64_t raw_len(size_t request) const;
  char* dst_of(size_t request) const { return framed(request) ? zdst_[request] : requests_[request].buf; }
  bool decode(size_t request);  // false: the frame is bad (the job failed, naming file and offset)

  std::vector<ReadFileSpec> specs_;
  std::vector<VerifyPiece> pieces_;
  LoadOptions opt_;
  std::vector<std::shared_ptr<AlignedBuffer>> buffers_;
  std::vector<int> fds_;           // as opened (O_DIRECT where the file system took it)
  std::vector<char> opened_direct_;
  std::vector<int> buffered_fds_;  // per file: -1, or the buffered fd after a fallback
  std::mutex fallback_mu_;
  std::vector<IoRequest> requests_;
  std::vector<uint32_t> file_of_request_;  // per request (by tag)
  std::vector<char> to_placer_;  // per request: read into a placer slot
  std::vector<char> direct_;     // per request: read straight into a kDirect placement's memory
  std::vector<std::vector<uint32_t>> chunk_pieces_;  // per request: pieces inside it
  std::unique_ptr<std::atomic<uint8_t>[]> fault_state_;  // per request, see claim_fault
  std::atomic<size_t> fault_next_{0};  // requests below it are claimed by someone
  std::atomic<unsigned> placing_{0};  // chunks being copied out to their destinations now
  // Test only (FLASHWRITE_TEST_LOAD_PLACE_DELAY_MS): a copy out, once decided, lands this
  // much later, so a cancel always finds copies under way (what wait_quiet must outwait).
  int test_place_delay_ms_ = 0;
  std::unique_ptr<IoBackend> backend_;
  std::string backend_name_;
  std::atomic<unsigned> files_direct_{0};

  // Fail, cancel, done, wait, join; its mutex guards the state below.
  JobControl ctl_{"load cancelled"};
  double done_s_ = -1;
  std::chrono::steady_clock::time_point t0_;
  std::condition_variable verify_cv_;
  std::deque<uint32_t> verify_queue_;
  bool reads_done_ = false;
  std::vector<Mismatch> mismatches_;
  std::vector<uint64_t> zframe_;   // per request: frame length, 0 plain
  std::vector<char*> zdst_;        // per framed request: where its bytes go (buffer or placer slot)
  std::vector<std::unique_ptr<AlignedBuffer>> zbuf_;  // per file: its frames, packed
};

}  // namespace fw
