// One save: stage (parallel copy + checksum into pool slots) and write
// (O_DIRECT requests on the I/O backend as soon as each chunk is staged), then
// truncate and fsync every stripe. Commit (manifest, rename) is Python's.
//
// Segments whose source is on a GPU (device >= 0) are copied into their slots
// by the CUDA copy engine (stage/device_copy.hpp) on the engine's streams,
// ordered after the callers' streams, and checksummed on the host once landed;
// start() returns only once every copy is enqueued and the callers' streams
// wait for them (a "copies done" event): GPU work the caller queues afterwards
// runs after the snapshot's copies, so block=False cannot tear it. The CPU does
// not wait for the copies; with a pool smaller than the save it waits until the
// last GPU chunk has a slot.
//
// Lifetime: the segment sources must stay valid until wait_staged() returns
// true; the binding keeps the owning Python objects alive until then. Worker
// threads never touch Python objects.
#pragma once
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "core/aligned_buffer.hpp"
#include "core/defaults.hpp"
#include "core/job_control.hpp"
#include "io/backend.hpp"
#include "io/job_files.hpp"
#include "stage/device_copy.hpp"
#include "stage/staging_pool.hpp"
#include "write/chunk_plan.hpp"

namespace fw {

// The checksum an unchanged piece of a held file must have: the piece of its
// stripe at `offset` (chunk-aligned pieces, as the base checkpoint's manifest has them).
struct ExpectedPiece {
  uint64_t offset, len, checksum;
};

struct FileSpec {
  std::string path;
  std::string header;  // bytes at offset 0 (the padded safetensors header)
  uint64_t size = 0;   // exact final size
  // A held file (incremental saves, save_held.cpp): when not empty, `link_from`
  // is a stripe of the base checkpoint with the same header and layout. The file
  // is staged and checksummed like any other, but its writes wait until all its
  // chunks are: if every piece's checksum is the one in `expected`, `link_from`
  // is hard-linked to `path` and nothing is written.
  std::string link_from;
  std::vector<ExpectedPiece> expected;
  // Compressed (save_compress.cpp) when not empty: (offset, element width) runs
  // sorted by offset, each up to the next; a chunk's planes are cut at the width
  // that covers most of its bytes (1 before the first run: the header).
  std::vector<std::pair<uint64_t, unsigned>> planes;
};

// What became of a held file (SaveJob::held_results).
enum class HeldOutcome : int {
  NotHeld = 0,       // an ordinary file
  Linked = 1,        // its checksums matched: hard-linked from the base stripe
  Changed = 2,       // a checksum differed: written
  LinkRefused = 3,   // matched, but link(2) failed (errno given): written
  PoolTooSmall = 4,  // the pool could not hold the save's slots at once: written, not held
  Undecided = 5,     // the job failed or was cancelled first
};

struct HeldResult {
  HeldOutcome outcome = HeldOutcome::NotHeld;
  int err = 0;
};

struct SaveOptions {
  // Where the stripes go (local files, or a remote target's): created, reserved,
  // written by its backend, finished and closed there. Required.
  std::shared_ptr<JobFiles> files;
  unsigned queue_depth = defaults::kWriteQueueDepth;
  unsigned copy_threads = defaults::copy_threads();
  // Needed when a segment is on a GPU: the engine's copy streams, and the
  // callers' current streams (one per device) the copies are ordered after.
  std::shared_ptr<CopyStreams> copy_streams;
  std::vector<StreamRef> wait_streams;
  // Keep every chunk's slot until release_slots() instead of giving it back
  // once written, so the staged image stays whole in the pool (a local
  // snapshot). Ignored when the pool is bounded below the save's chunk count.
  bool hold_slots = false;
  // Set by the caller to stop a start() that still waits for the staging pool
  // (a first save faulting in its slab): start() then throws, nothing started.
  std::shared_ptr<std::atomic<bool>> abort;
  // zstd level for the files whose FileSpec has planes (codec.hpp).
  int compress_level = defaults::kCompressLevel;
  // The caller waits for the whole save (a blocking save): each chunk is
  // checksummed as it is copied, from cache, instead of in a pass after staging
  // that reads every slot again (which only shortens a save's stall, the time
  // until save_async returns).
  bool hash_while_copying = false;
};

// Where one chunk of a held save lies: stripe, offset in it, bytes, and the
// offset of its slot in the pool's backing file (-1: private memory).
struct ChunkSlot {
  uint32_t file;
  uint64_t file_offset, data_len;
  int64_t pool_offset;
};

struct SaveStats {
  uint64_t bytes_total = 0, bytes_written = 0;
  uint64_t device_bytes = 0;  // copied from GPUs
  double staged_s = -1, done_s = -1;
  double pin_s = 0;  // page-locking the pool for this save: at its start, and by its grower thread (GPU saves)
  // How long the save waited for staging memory (the caller's reserve and its
  // copy threads' waits for a slot, as wall time), and the reason that took
  // longest: "fault-in", "pin" or "pool busy" (StagingWait); "" when it never waited.
  double staging_wait_s = 0;
  std::string staging_wait_reason;
  uint64_t unpinned_bytes = 0;  // bytes of the pool left pageable by failed registrations
  std::string backend;
  unsigned files_direct = 0, files_buffered = 0;
  uint64_t rewrites = 0;  // chunks written again (JobFiles::rewrites)
  uint64_t bytes_sent_uncopied = 0;  // JobFiles::bytes_sent_uncopied
  uint64_t bytes_stored = 0;  // sent to the files: frames of compressed chunks, padded, and the others
  double compress_s = 0;      // thread-seconds spent compressing
};

class SaveJob {
 public:
  SaveJob(std::shared_ptr<StagingPool> pool, std::vector<FileSpec> files, std::vector<Segment> segments,
          SaveOptions opt);
  ~SaveJob();  // cancels and joins if still running

  void start();
  bool wait_staged(double timeout_s);  // true once staged or finished (possibly failed)
  bool wait_done(double timeout_s);
  void cancel();
  bool staged() const { return staged_.load(); }
  bool done() const { return ctl_.done(); }
  // Rethrows the first error, if any (call after done()).
  void rethrow() const;
  bool failed() const;

  // True once every chunk is in its slot and checksummed (or the job ended);
  // checksummed() says which.
  bool wait_checksummed(double timeout_s);
  bool checksummed() const { return checksummed_.load(); }
  bool holds_slots() const { return hold_; }
  // Seconds start() waited for the staging pool to hold this save's slots: a
  // preparation in the background still under way (Engine::reserve), or the
  // pool grown (allocated and faulted in) by this save. ~0 when it was ready.
  double pool_wait_s() const { return pool_wait_s_; }
  // Valid once checksummed, while the slots are held.
  std::vector<ChunkSlot> chunk_slots() const;
  // Give the held slots back to the pool (their bytes stay until reused).
  // Idempotent; also done by the destructor. Only after the job is done.
  void release_slots();

  // Checksums per input segment, one per chunk_bytes-aligned piece.
  std::vector<std::vector<uint64_t>> checksums() const;
  SaveStats stats() const;
  void set_pin_s(double s) { pin_s_ = s; }  // before the caller sees the job
  uint64_t bytes_written() const { return bytes_written_.load(); }
  // Written or linked (a held file's bytes count once linked): for progress.
  uint64_t bytes_done() const { return bytes_written_.load() + bytes_linked_.load(); }
  uint64_t bytes_total() const { return bytes_total_; }
  // Per file (held or not): what became of it. Final once checksummed().
  std::vector<HeldResult> held_results() const;
  // Per file, per chunk in file order: the frame's length, 0 where the chunk was
  // written as staged (not compressed, or zstd did not shrink it a page). Final once done.
  std::vector<std::vector<uint64_t>> chunk_frames() const;

 private:
  struct File {
    std::string path;
    uint64_t size;
    std::atomic<int> fd{-1};
    std::atomic<bool> direct{false};
    int direct_fd = -1;  // kept open until the end after a fallback, closed then
  };

  // A held file's state (save_held.cpp): its chunks, those still to stage,
  // and the staged ones parked in their slots (under park_mu_) until decided.
  struct Held {
    std::vector<size_t> chunks;
    std::atomic<size_t> unstaged{0};
    std::vector<size_t> parked;
    std::vector<ExpectedPiece> expected;  // sorted by offset
    HeldResult result{HeldOutcome::Undecided, 0};
  };

  // The life cycle, the writes and the slots (save_job.cpp).
  void run();
  void open_file(size_t f);
  // Held files (save_held.cpp).
  void init_held();
  bool is_held(size_t ci) const;
  void chunk_ready(size_t ci);  // staged and checksummed: write it, or park it
  void decide(uint32_t f);
  bool matches(uint32_t f) const;
  void write_held(uint32_t f, std::vector<size_t>& chunks);
  void stop_holding();      // the pool is too small: every held file is written
  void release_parked();    // after a failure: parked slots back to the pool
  void return_slot(char* buf, bool written);
  void slot_done(size_t ci);
  void write_chunk(size_t ci);
  // Compressed saves (save_compress.cpp).
  void init_compress();
  bool compress_chunk(size_t ci);  // false: cancelled (the slot went back)
  void frame_written(size_t ci);
  char* slot_of(size_t ci) const;
  void wake_frames();
  void on_io(IoRequest* req, int64_t res);
  void fail(std::exception_ptr e);
  bool has_landed() const;
  void finish_files();
  double since_start() const;
  // Staging (save_staging.cpp).
  void copy_worker();
  void write_staged(std::vector<size_t>& unwritten);
  bool write_landed_chunk();
  void stage_host_chunk(size_t& claimed, const std::function<bool()>& interrupt, std::vector<size_t>& unhashed,
                        std::vector<size_t>& unwritten);
  bool hash_own_chunks(std::vector<size_t>& unhashed);
  void copy_host_chunk(size_t ci, char* slot, bool hash);
  void hash_host_chunk(size_t ci);
  void stage_device_chunks();  // D2H issuer thread
  void landed(size_t ci, bool ok);
  void chunk_staged();
  void mark_staged();

  std::shared_ptr<StagingPool> pool_;
  std::vector<FileSpec> specs_;
  std::vector<Segment> segments_;  // caller's, then one per header
  size_t user_segments_;
  SaveOptions opt_;
  ChunkPlan plan_;
  std::vector<uint64_t> hashes_;
  std::vector<IoRequest> requests_;
  std::vector<std::unique_ptr<File>> files_;
  std::unique_ptr<IoBackend> backend_;
  std::string backend_name_;

  uint64_t bytes_total_ = 0;
  std::atomic<uint64_t> bytes_written_{0};
  std::atomic<uint64_t> bytes_linked_{0};  // of held files linked, not written
  std::atomic<size_t> next_chunk_{0};  // into host_chunks_
  std::vector<size_t> host_chunks_, device_chunks_;  // chunks with no / some GPU bytes
  uint64_t device_bytes_ = 0;
  std::atomic<size_t> unstaged_{0};  // chunks whose bytes are not yet all in their slot
  // Fail, cancel, done, wait, join; its mutex guards the state below and its
  // cv signals staged_ and fenced_.
  JobControl ctl_{"save cancelled"};
  // Landed device chunks wait here (under ctl_.mutex()) for their checksums;
  // landed_count_ mirrors its size for waits that must not take that lock.
  std::deque<size_t> landed_;
  std::atomic<size_t> landed_count_{0};
  bool d2h_done_ = false, fenced_ = false;
  bool reserved_ = false;  // holds a reservation on pool_ (control thread drops it)
  std::condition_variable work_cv_;
  std::atomic<bool> staged_{false};
  std::atomic<bool> checksummed_{false};
  bool hold_ = false;
  // When the pool has a slot for every chunk, host chunks are copied first and
  // checksummed after staging (the caller resumes at memcpy speed): such a
  // chunk's slot is free again only once both its write and its checksum are
  // done; slot_refs_[ci] counts them down from 2 (0: not deferred).
  bool defer_hash_ = false;
  // Test only (FLASHWRITE_TEST_DEFER_HASH_DELAY_MS, read per job): each copy thread
  // waits this long before its deferred checksums, so a slot given back before its
  // checksum read it is reused by another save first, every time. 0: off.
  int test_hash_delay_ms_ = 0;
  std::unique_ptr<std::atomic<uint8_t>[]> slot_refs_;
  std::mutex held_mu_;
  std::vector<char*> held_;  // written slots kept for the snapshot
  double staged_s_ = -1, done_s_ = -1;
  double pin_s_ = 0;
  double pool_wait_s_ = 0;
  // A GPU save grows (and pins) the pool on a thread of its own (grower in
  // run()): the slots its reserve() left to grow, and the seconds it pinned.
  size_t grow_slots_ = 0;
  bool grow_later_ = false;
  std::atomic<double> grow_pin_s_{0};
  StagingWait staging_wait_;
  std::chrono::steady_clock::time_point t0_;

  // Compressed saves: per chunk the plane width (0: written as staged), its
  // frame's length (0: none), the frame while its write is queued, and the slot
  // it was made from; frames are recycled through zfree_ (at most zmax_ made).
  std::vector<uint8_t> zwidth_;
  std::vector<uint64_t> zframe_;
  std::vector<std::unique_ptr<AlignedBuffer>> zheld_;
  std::vector<char*> zslot_;
  std::mutex zmu_;
  std::condition_variable zcv_;
  std::vector<std::unique_ptr<AlignedBuffer>> zfree_;
  size_t zmade_ = 0, zmax_ = 0;
  std::atomic<uint64_t> zstored_{0};
  std::atomic<uint64_t> zns_{0};  // compress time, ns

  std::mutex fallback_mu_;
  // Per file, null when not held; holding_ once the pool holds every slot of the save.
  std::vector<std::unique_ptr<Held>> held_files_;
  bool holding_ = false;
  mutable std::mutex park_mu_;
};

}  // namespace fw
