#include "engine/engine.hpp"

#include <algorithm>
#include <cstdlib>
#include <map>
#include <stdexcept>
#include <string>

#include <unistd.h>

#include "core/defaults.hpp"
#include "shim/cuda.hpp"

namespace fw {

std::vector<StreamRef> wait_streams(const GivenStreams& given, const std::vector<int>& devices) {
  std::vector<StreamRef> out;
  for (int d : devices) {
    uintptr_t handle = 0;
    for (auto& [gd, gh] : given)
      if (gd == d) handle = gh;
    out.push_back(StreamRef{d, handle});
  }
  return out;
}

// FLASHWRITE_STAGING_NUMA_NODE: the NUMA node of the staging pool, for every
// save (a process bound to one socket); otherwise the pool follows the node of
// the first GPU it is pinned for, and host-only saves leave it to the kernel.
static int numa_node_from_env() {
  const char* v = std::getenv("FLASHWRITE_STAGING_NUMA_NODE");
  if (!v || !*v) return -2;
  char* end = nullptr;
  const long n = std::strtol(v, &end, 10);
  if (*end || n < -1 || n > 1023)
    throw std::invalid_argument(std::string("FLASHWRITE_STAGING_NUMA_NODE=") + v +
                                ": expected a NUMA node number (0-1023), or -1 for the kernel's default");
  return static_cast<int>(n);
}

Engine::Engine(uint64_t chunk_bytes, uint64_t max_staging_bytes)
    : pool_(std::make_shared<StagingPool>(chunk_bytes, max_staging_bytes)) {
  HugePageWatch::check_setting();  // a bad FLASHWRITE_HUGE_PAGES fails here, not at a save
  const int node = numa_node_from_env();
  if (node != -2) {
    numa_given_ = true;
    pool_->set_numa_node(node);
  }
}

std::unique_ptr<SaveJob> Engine::start_save(std::vector<FileSpec> files, std::vector<Segment> segments,
                                            SaveOptions opt, const std::vector<int>& devices,
                                            const GivenStreams& streams) {
  const double pin0 = pool_->pin_seconds();
  if (!devices.empty()) {
    cuda::require("saving tensors that live on a GPU");
    opt.wait_streams = wait_streams(streams, devices);
    check_not_capturing(opt.wait_streams, "a save of GPU tensors was started");
    opt.copy_streams = copy_streams();
    pin_pool(devices.front(), /*now=*/false);
  }
  auto job = std::make_unique<SaveJob>(pool_, std::move(files), std::move(segments), std::move(opt));
  job->start();
  // Pinning done for this save (the hooks set now, or a new slab at reserve());
  // another save growing the pool at the same time may add to it.
  job->set_pin_s(pool_->pin_seconds() - pin0);
  return job;
}

void Engine::reserve(uint64_t bytes, int device) {
  if (device >= 0) {
    cuda::require("pinning the staging pool");
    pin_pool(device);
    pool_->pin_existing();  // what a save left unpinned (a preparation waits for it)
  }
  const uint64_t slot = pool_->slot_bytes();
  const auto slots = static_cast<size_t>((bytes + slot - 1) / slot);
  // The slots stay; no hold against trim() is kept. One locked step: a save that
  // starts meanwhile waits for this growth instead of adding its slots on top.
  pool_->reserve(slots, /*hold=*/false);
}

// Later slabs are pinned as they are created (the hooks stay set).
void Engine::adopt_after_fork() {
  const int pid = ::getpid();
  if (cuda_pid_ == pid) return;
  if (cuda_pid_ && streams_) new std::shared_ptr<CopyStreams>(std::move(streams_));  // leaked on purpose
  streams_.reset();
  pinning_ = false;  // the pool dropped the parent's pin hooks too (StagingPool on fork())
  cuda_pid_ = pid;
}

void Engine::pin_pool(int device, bool now) {
  std::lock_guard<std::mutex> lk(cuda_mu_);
  adopt_after_fork();
  if (pinning_) return;
  pinning_ = true;
  // Slabs made from now on are faulted in on the GPU's node: DMA from memory
  // on the other socket crosses the link between them.
  if (!numa_given_) pool_->set_numa_node(cuda::numa_node(device));
  pool_->set_pin_hooks(cuda_pin_hooks(device, pin_error_), now);
}

std::shared_ptr<CopyStreams> Engine::copy_streams() {
  std::lock_guard<std::mutex> lk(cuda_mu_);
  adopt_after_fork();
  if (!streams_) streams_ = std::make_shared<CopyStreams>();
  return streams_;
}

std::string Engine::pin_error() const { return pin_error_->get(); }

size_t bounce_slots(unsigned queue_depth) {
  return std::max<size_t>(defaults::kBounceMinSlots, size_t{queue_depth} + defaults::kBounceExtraSlots);
}

size_t host_bounce_slots(unsigned queue_depth, uint64_t chunk_bytes, uint64_t chunks) {
  uint64_t budget = std::max<uint64_t>(defaults::kBounceMinSlots, defaults::kHostBounceBytes / std::max<uint64_t>(chunk_bytes, 1));
  return static_cast<size_t>(std::max<uint64_t>(1, std::min<uint64_t>({budget, bounce_slots(queue_depth), chunks})));
}

namespace {

// One pinned bounce pool is kept between loads: pinning costs far more than a
// small load. A load with another (slot size, depth) replaces it; the old one
// is unpinned and freed when the last load using it ends, so a process holds
// at most one idle pool (about bounce_slots() x chunk_bytes) besides those of
// loads in flight, and release_bounce_pool() gives even that back. The one kept
// is never destroyed at exit (the holder is leaked on purpose), so nothing
// calls into CUDA while the runtime unloads. A forked child never reuses its
// parent's (see StagingPool on fork()).
struct BounceCache {
  std::mutex mu;
  std::shared_ptr<StagingPool> pool;
  uint64_t slot_bytes = 0;
  size_t slots = 0;
  int device = -1;
  int pid = 0;
};
BounceCache& bounce_cache() {
  static auto* c = new BounceCache();
  return *c;
}

std::shared_ptr<StagingPool> bounce_pool(uint64_t slot_bytes, size_t slots, int device) {
  BounceCache& c = bounce_cache();
  std::shared_ptr<StagingPool> old;  // freed after the lock is released (unpinning takes time)
  std::lock_guard<std::mutex> lk(c.mu);
  // Not keyed on the device: the slabs are registered portable (cudaHostRegisterPortable),
  // pinned for every GPU, so loads alternating between GPUs do not re-pin it each time.
  if (c.pool && c.slot_bytes == slot_bytes && c.slots == slots && c.pid == ::getpid()) return c.pool;
  old = std::move(c.pool);
  auto p = std::make_shared<StagingPool>(slot_bytes, slot_bytes * slots);
  p->set_numa_node(cuda::numa_node(device));
  p->set_pin_hooks(cuda_pin_hooks(device));
  p->reserve(slots);  // held for good: trim() is never called on these
  c.pool = p;
  c.slot_bytes = slot_bytes;
  c.slots = slots;
  c.device = device;
  c.pid = ::getpid();
  return p;
}

}  // namespace

uint64_t bounce_pool_bytes() {
  BounceCache& c = bounce_cache();
  std::lock_guard<std::mutex> lk(c.mu);
  return c.pool ? c.pool->capacity_bytes() : 0;
}

uint64_t release_bounce_pool() {
  BounceCache& c = bounce_cache();
  std::shared_ptr<StagingPool> old;
  uint64_t bytes = 0;
  {
    std::lock_guard<std::mutex> lk(c.mu);
    if (c.pool) bytes = c.pool->capacity_bytes();
    old = std::move(c.pool);
  }
  return bytes;  // `old` goes here, or with the last load still using it
}

namespace {

std::shared_ptr<CopyStreams> load_streams() {
  static auto* s = new std::shared_ptr<CopyStreams>(std::make_shared<CopyStreams>());
  return *s;
}

}  // namespace

std::unique_ptr<LoadJob> start_load(std::vector<ReadFileSpec> files, std::vector<VerifyPiece> pieces, LoadOptions opt,
                                    std::vector<Placement> placements, const GivenStreams& streams) {
  std::vector<int> devices;
  for (auto& p : placements)
    if (p.len && p.device >= 0 && std::find(devices.begin(), devices.end(), p.device) == devices.end()) devices.push_back(p.device);
  PlacementMap map(std::move(placements));
  size_t slots = bounce_slots(opt.queue_depth);
  if (!devices.empty()) {
    cuda::require("loading tensors to a GPU");
    std::vector<StreamRef> callers = wait_streams(streams, devices);
    check_not_capturing(callers, "a load to GPU tensors was started");
    opt.placer = std::make_shared<DevicePlacer>(std::move(map), std::move(callers),
                                                bounce_pool(opt.chunk_bytes, slots, devices.front()), load_streams(),
                                                slots);
  } else if (!map.empty()) {
    uint64_t chunks = 0;
    for (auto& f : files) chunks += (f.size + opt.chunk_bytes - 1) / std::max<uint64_t>(opt.chunk_bytes, 1);
    opt.placer = std::make_shared<HostPlacer>(std::move(map), opt.chunk_bytes,
                                              host_bounce_slots(opt.queue_depth, opt.chunk_bytes, chunks));
  }
  auto job = std::make_unique<LoadJob>(std::move(files), std::move(pieces), std::move(opt));
  job->start();
  return job;
}

}  // namespace fw
