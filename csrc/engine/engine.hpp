// The policy around jobs, which outlives any one save or load:
//  - a save Engine owns one staging pool (reused by every save of a Writer),
//    page-locks it once, on the first save that copies from a GPU (a CPU-only
//    process never initialises CUDA), and owns the copy streams of its saves;
//  - loads to GPUs share a process-wide pinned bounce pool (the last slot size
//    and depth used; see bounce_pool()) and copy streams, sized from the read
//    queue depth.
// No Python here: the bindings parse arguments and hand plain structs in.
#pragma once
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "read/device_placer.hpp"
#include "read/host_placer.hpp"
#include "read/load_job.hpp"
#include "stage/device_copy.hpp"
#include "stage/staging_pool.hpp"
#include "write/save_job.hpp"

namespace fw {

// (device, cudaStream_t) pairs the caller names; see wait_streams().
using GivenStreams = std::vector<std::pair<int, uintptr_t>>;

// The callers' streams the copies wait for: the given ones, and the legacy
// default stream of any device used without one.
std::vector<StreamRef> wait_streams(const GivenStreams& given, const std::vector<int>& devices);

class Engine {
 public:
  Engine(uint64_t chunk_bytes, uint64_t max_staging_bytes);

  // Starts a save on this engine's pool. `devices`: the GPUs some segments live
  // on (empty for a host-only save). Returns once the GPU copies are ordered
  // after `streams` (see SaveJob::start()).
  std::unique_ptr<SaveJob> start_save(std::vector<FileSpec> files, std::vector<Segment> segments, SaveOptions opt,
                                      const std::vector<int>& devices, const GivenStreams& streams);

  // Allocates, faults in (and, with device >= 0, page-locks) slots for
  // `bytes` now, so the first save finds them ready. Blocking; thread-safe.
  void reserve(uint64_t bytes, int device);
  // Slabs from now on are mapped from this file (see StagingPool).
  void set_backing_file(const std::string& path) { pool_->set_backing_file(path); }
  bool file_backed() const { return pool_->file_backed(); }
  std::string backing_error() const { return pool_->backing_error(); }

  std::string pin_error() const;  // empty when pinning worked or was never tried
  uint64_t chunk_bytes() const { return pool_->slot_bytes(); }
  uint64_t pool_bytes() const { return pool_->capacity_bytes(); }
  uint64_t max_staging_bytes() const { return pool_->max_slots() * pool_->slot_bytes(); }
  bool pool_pinned() const { return pool_->pinned(); }
  uint64_t pool_unpinned_bytes() const { return pool_->unpinned_bytes(); }
  // The NUMA node the pool's new slabs prefer (-1: the kernel's default), and
  // why placing the last one failed (empty if it did not).
  int pool_numa_node() const { return pool_->numa_node(); }
  std::string pool_numa_error() const { return pool_->numa_error(); }
  // The page size of the newest slab and why (2 MiB unless they fault in slowly here).
  std::string pool_pages() const { return pool_->pages(); }
  uint64_t trim() { return pool_->trim(); }

 private:
  // now=false: the slabs already made are pinned later, by the save's own
  // thread (StagingPool::pin_existing), not by the caller's.
  void pin_pool(int device, bool now = true);
  std::shared_ptr<CopyStreams> copy_streams();

  std::shared_ptr<StagingPool> pool_;
  // In a forked child: drops the parent's pinning state and copy streams
  // (never destroyed here: CUDA cannot be called). Under cuda_mu_.
  void adopt_after_fork();

  std::mutex cuda_mu_;  // guards pinning_, streams_ and cuda_pid_
  bool pinning_ = false;
  int cuda_pid_ = 0;  // the process pinning_ and streams_ belong to
  bool numa_given_ = false;  // FLASHWRITE_STAGING_NUMA_NODE chose the pool's node
  std::shared_ptr<CopyStreams> streams_;
  const std::shared_ptr<PinError> pin_error_ = std::make_shared<PinError>();
};

// Starts a load. Placements bound for GPUs go through the process-wide pinned
// bounce pool and streams (CUDA is required then), and host placements of the
// same load with them; a load with host placements only uses bounce slots of
// its own and never touches CUDA. The placements' destinations must stay valid
// until the job is done.
std::unique_ptr<LoadJob> start_load(std::vector<ReadFileSpec> files, std::vector<VerifyPiece> pieces, LoadOptions opt,
                                    std::vector<Placement> placements, const GivenStreams& streams);

// Bytes of the pinned bounce pool kept for loads to GPUs (0: none).
uint64_t bounce_pool_bytes();
// Drops the kept bounce pool (unpinned and freed now, or when the last load
// using it ends). Returns its bytes.
uint64_t release_bounce_pool();

// Bounce slots a load with placements uses: a full read queue plus chunks
// being verified and copied.
size_t bounce_slots(unsigned queue_depth);
// Bounce slots of a load to host placements only: bounce_slots(), capped by
// defaults::kHostBounceBytes and by the `chunks` the load reads.
size_t host_bounce_slots(unsigned queue_depth, uint64_t chunk_bytes, uint64_t chunks);

}  // namespace fw
