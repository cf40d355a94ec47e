// The CUDA copy engine: moves bytes between GPUs and pinned host slots on
// flashwrite's own streams, ordered after the caller's work, and tells the
// host side when each batch of copies has landed.
//
//   save (D2H): caller's stream ──event──▶ copy stream waits ──▶ chunk copies ──event──▶ landing thread
//               ──▶ checksum + write of that chunk, while later chunks are still copying
//   load (H2D): read chunk into a pinned slot ──▶ verify ──▶ copies to the destination tensors
//               ──event──▶ landing thread returns the slot for the next read
//
// Nothing here sees Python objects; device pointers and stream handles come in
// as integers. All CUDA calls go through shim/cuda.hpp.
#pragma once
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <exception>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "shim/cuda.hpp"
#include "stage/staging_pool.hpp"

namespace fw {

// A stream of the caller's (PyTorch's current stream of a device); handle 0 is
// the legacy default stream.
struct StreamRef {
  int device;
  uintptr_t handle;
};

// One copy; `device` is its GPU end.
struct DeviceCopy {
  int device;
  void* dst;
  const void* src;
  size_t len;
};

enum class CopyDirection { DeviceToHost, HostToDevice };

// An engine's CUDA resources: per device, one non-blocking copy stream and a
// pool of events, created on first use and reused by every job. Thread-safe.
// stream() and take_event() make the device current on the calling thread, so
// they are called on flashwrite's threads only.
class CopyStreams {
 public:
  CopyStreams() = default;
  ~CopyStreams();
  CopyStreams(const CopyStreams&) = delete;
  CopyStreams& operator=(const CopyStreams&) = delete;

  cuda::cudaStream_t stream(int device);
  cuda::cudaEvent_t take_event(int device);
  void give_event(int device, cuda::cudaEvent_t ev);

 private:
  struct Device {
    cuda::cudaStream_t stream = nullptr;
    std::vector<cuda::cudaEvent_t> events;
  };
  std::mutex mu_;
  std::map<int, Device> devices_;
};

// Issues batches of copies on CopyStreams and runs each batch's `landed`
// callback, in issue order, on the pipeline's own thread once all of its
// copies completed. Every issued batch gets exactly one callback, also when
// CUDA failed (ok=false: the bytes are undefined), so the owner of the host
// slot can always take it back. issue() is thread-safe.
class CopyPipeline {
 public:
  using Landed = std::function<void(bool ok)>;  // must not throw

  CopyPipeline(std::shared_ptr<CopyStreams> streams, CopyDirection dir, size_t max_pending);
  ~CopyPipeline();  // finish(), errors dropped
  CopyPipeline(const CopyPipeline&) = delete;
  CopyPipeline& operator=(const CopyPipeline&) = delete;

  // Makes the copy stream of each device wait for the work queued so far on
  // the caller's stream of that device (cudaEventRecord on the caller's
  // stream, cudaStreamWaitEvent on ours). Every later copy on that device is
  // ordered after it. The reverse does not hold: work the caller queues on its
  // stream afterwards is not ordered after our copies and may change a source
  // before its copy lands unless order_before() follows the last issue().
  // Throws CudaError.
  void order_after(const std::vector<StreamRef>& callers);
  // Makes each caller's stream wait for every copy issued so far on its device
  // (cudaEventRecord on our stream, cudaStreamWaitEvent on theirs): the GPU
  // work the caller queues afterwards (an optimizer step after a block=False
  // save) runs only once the snapshot's copies are done. The CPU does not wait.
  // Throws CudaError.
  void order_before(const std::vector<StreamRef>& callers);
  // Enqueues the copies (asynchronous) and returns; blocks while max_pending
  // batches have not landed. Copies that continue each other on both ends (the
  // small tensors of a chunk gathered into one device buffer, in file order)
  // go as one cudaMemcpyAsync: each call costs microseconds of CPU. Returns false when CUDA refused a copy: the
  // pipeline then holds the error and `landed(false)` still comes.
  bool issue(const std::vector<DeviceCopy>& copies, Landed landed);
  // No more batches: waits until every batch landed and its callback ran,
  // then rethrows the first CUDA error, if any.
  void finish();
  bool failed() const;

 private:
  struct Batch {
    std::vector<std::pair<int, cuda::cudaEvent_t>> events;  // nullptr event: synchronize the stream
    Landed landed;
    bool ok = true;
  };
  void land();
  void fail(std::exception_ptr e);

  std::shared_ptr<CopyStreams> streams_;
  const int kind_;
  const size_t max_pending_;
  std::mutex issue_mu_;  // one batch at a time, so the queue is in stream order
  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::deque<Batch> queue_;
  bool closed_ = false;
  std::exception_ptr error_;
  std::thread thread_;
};

// Throws std::runtime_error naming `what` when a caller's stream is being
// captured into a CUDA graph: an event recorded on it would pull flashwrite's
// copies into the user's graph (and a capture cannot be waited for).
void check_not_capturing(const std::vector<StreamRef>& callers, const char* what);

// Merges copies that continue each other on both ends and on the same device.
std::vector<DeviceCopy> coalesce(const std::vector<DeviceCopy>& copies);

// The first pinning failure's text. Written by the pin hook (under the pool's
// lock), read by anyone: it has a lock of its own.
class PinError {
 public:
  void set_if_empty(const std::string& e) {
    std::lock_guard<std::mutex> lk(mu_);
    if (text_.empty()) text_ = e;
  }
  std::string get() const {
    std::lock_guard<std::mutex> lk(mu_);
    return text_;
  }

 private:
  mutable std::mutex mu_;
  std::string text_;
};

// Page-locking hooks for a StagingPool: cudaHostRegister(Portable) with
// `device` current on a helper thread. The first failure's text is kept in
// *error (if given) and the pool stays pageable (copies still work, slower).
PinHooks cuda_pin_hooks(int device, std::shared_ptr<PinError> error = nullptr);

}  // namespace fw
