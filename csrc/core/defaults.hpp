// The engine's tuned defaults, in one place. The bindings export the public
// ones to Python as _core.DEFAULTS, which python/flashwrite/defaults.py reads:
// nothing else restates these numbers. Chosen by the sweeps in
// benchmarks/README.md unless a comment says otherwise.
#pragma once
#include <cstddef>
#include <cstdint>

namespace fw::defaults {

// -- exported to Python (_core.DEFAULTS) --
constexpr unsigned kStripes = 4;
constexpr uint64_t kChunkBytes = 16ull << 20;      // 16 MiB beat 1-8 and 32 MiB (to durable and stall)
constexpr unsigned kWriteQueueDepth = 32;          // 32-64 beat 2-16; 32 keeps in-flight memory at half of 64's
constexpr unsigned kReadQueueDepth = 32;           // matched or beat 16 in both load sweeps
constexpr uint64_t kReadChunkBytes = 8ull << 20;
constexpr unsigned kCopyThreads = 2;               // host memcpy + checksum threads per save
constexpr unsigned kVerifyThreads = 2;             // checksum threads per load
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
constexpr unsigned kPrefaultMaxThreads = 8;        // threads faulting in a new slab
constexpr int kPoolPollMs = 20;                    // acquire() re-checks its cancel flag this often
constexpr double kWaitSliceS = 0.05;               // binding waits wake this often for Ctrl-C

}  // namespace fw::defaults
