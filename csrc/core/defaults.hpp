// The engine's tuned defaults, in one place. The bindings export the public
// ones to Python as _core.DEFAULTS, which python/flashwrite/defaults.py reads:
// nothing else restates these numbers, or the rule for the ones that follow the
// CPU count (cpu_threads below). Chosen by the sweeps in benchmarks/README.md
// unless a comment says otherwise.
#pragma once
#include <sched.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <thread>

namespace fw::defaults {

// Thread counts that follow the machine: one thread per CPU this process may run
// on (its affinity mask, as len(os.sched_getaffinity(0)) counts them), at least
// one and at most `most`.
inline unsigned cpu_threads(unsigned most) {
  cpu_set_t set;
  CPU_ZERO(&set);
  unsigned cpus = sched_getaffinity(0, sizeof set, &set) == 0 ? static_cast<unsigned>(CPU_COUNT(&set))
                                                               : std::thread::hardware_concurrency();
  return std::max(1u, std::min(most, cpus));
}

// -- exported to Python (_core.DEFAULTS) --
constexpr unsigned kStripes = 4;
constexpr uint64_t kChunkBytes = 16ull << 20;      // 16 MiB beat 1-8 and 32 MiB (to durable and stall)
constexpr unsigned kWriteQueueDepth = 32;
// Compressed saves: frames queued or in flight at once (each a chunk's bound), beyond
// one per copy thread. Enough to keep a link of a few Gbit/s busy; bounds the memory.
constexpr unsigned kCompressFramesInFlight = 8;
constexpr int kCompressLevel = 1;  // zstd level of compress="zstd" (1-3 measured alike on byte planes)          // 32-64 beat 2-16; 32 keeps in-flight memory at half of 64's
constexpr unsigned kReadQueueDepth = 32;           // matched or beat 16 in both load sweeps
constexpr uint64_t kReadChunkBytes = 8ull << 20;
// Owned CPU tensors of a local load from this size up are read with O_DIRECT
// straight into their own memory (no copy); smaller ones are copied out of the
// bounce slots, where their pages read twice would cost more than the copy.
constexpr uint64_t kDirectTensorBytes = 1ull << 20;
// Host memcpy + checksum threads per save (and per local snapshot restore):
// cpu_threads(kCopyThreadsMost). _core.DEFAULTS["copy_threads"] holds it as
// counted when _core was imported.
constexpr unsigned kCopyThreadsMost = 8;
inline unsigned copy_threads() { return cpu_threads(kCopyThreadsMost); }
// Checksum threads per load: cpu_threads(kVerifyThreadsMost); DEFAULTS["verify_threads"].
constexpr unsigned kVerifyThreadsMost = 4;
inline unsigned verify_threads() { return cpu_threads(kVerifyThreadsMost); }
constexpr size_t kD2hBatchesInFlight = 64;         // device chunks copying while older ones are written
constexpr size_t kBounceMinSlots = 8;              // bounce slots of a load with placements: at least this many,
constexpr size_t kBounceExtraSlots = 4;            // and the read queue depth plus this many
// GPU tensors of at most this many bytes that lie next to each other in a stripe
// are gathered into one device buffer (torch.cat on the caller's stream; on load,
// one buffer scattered with one _foreach_copy_) so the engine moves them with one
// cudaMemcpyAsync per chunk instead of one per tensor (2-5 us of CPU each). Not
// measured on a GPU yet (benchmarks/gpu_check.py times a state of 50k of them).
constexpr uint64_t kGatherTensorBytes = 64ull << 10;
constexpr uint64_t kGatherRunBytes = 64ull << 20;  // one gather buffer at most (device memory it costs)

// -- internal --
// A load to host placements only (owned CPU tensors) maps at most this much
// bounce memory (but kBounceMinSlots slots, and no more than its chunks), so an
// owned load peaks well under twice its size: read chunks follow the save's
// chunk size (16 MiB by default), and a read queue's worth of them would be
// 512 MiB. Not swept: whether more in flight would speed owned loads up was not
// settled on the shared 2-core VM (benchmarks/README.md, owned against views).
constexpr uint64_t kHostBounceBytes = 128ull << 20;
constexpr unsigned kThreadBackendMaxThreads = 32;  // pread/pwrite threads at most
constexpr unsigned kPrefaultMaxThreads = 8;        // threads faulting in a new slab: cpu_threads() of it
constexpr uint64_t kPinSlabBytes = uint64_t{1} << 30;  // with pinning, a slab holds at most this (FLASHWRITE_PIN_SLAB_BYTES)
constexpr int kPoolPollMs = 20;                    // acquire() re-checks its cancel flag this often
constexpr double kWaitSliceS = 0.01;               // binding waits wake this often for Ctrl-C

}  // namespace fw::defaults
