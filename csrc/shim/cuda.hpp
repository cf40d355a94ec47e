// The only place that knows how CUDA is reached: the runtime library is
// dlopen'ed at run time (never linked), and its entry points are typed
// function pointers. No CUDA header is needed to build: the few types, flags
// and enum values used are declared here with the values of the CUDA runtime
// ABI (stable since CUDA 10). With no runtime, `available` is false and
// `reason` says why.
#pragma once
#include <cstddef>
#include <cstdint>
#include <functional>
#include <stdexcept>
#include <string>

namespace fw::cuda {

using cudaError_t = int;
using cudaStream_t = void*;
using cudaEvent_t = void*;

constexpr cudaError_t cudaSuccess = 0;
constexpr cudaError_t cudaErrorCudartUnloading = 4;
constexpr cudaError_t cudaErrorNotReady = 600;
constexpr cudaError_t cudaErrorHostMemoryAlreadyRegistered = 712;

enum cudaMemcpyKind : int {
  cudaMemcpyHostToHost = 0,
  cudaMemcpyHostToDevice = 1,
  cudaMemcpyDeviceToHost = 2,
  cudaMemcpyDeviceToDevice = 3,
  cudaMemcpyDefault = 4,
};

// cudaHostRegister: pinned for every CUDA context, not only the current one
// (a multi-GPU process copies from several devices into one pool).
constexpr unsigned cudaHostRegisterPortable = 0x01;
// cudaStreamCreateWithFlags: no implicit synchronisation with the legacy default stream.
constexpr unsigned cudaStreamNonBlocking = 0x01;
// cudaEventCreateWithFlags: waiters sleep instead of spinning a core; no timestamps.
constexpr unsigned cudaEventBlockingSync = 0x01;
constexpr unsigned cudaEventDisableTiming = 0x02;

struct Runtime {
  bool available = false;
  std::string reason;   // why not available
  std::string library;  // path or soname that was loaded
  std::string via;      // "FLASHWRITE_CUDA_RUNTIME", "already loaded" (PyTorch's) or "soname"
  int device_count = 0;
  int runtime_version = 0;  // e.g. 12040; 0 when unknown
  int driver_version = 0;

  cudaError_t (*GetDeviceCount)(int*) = nullptr;
  cudaError_t (*GetDevice)(int*) = nullptr;
  cudaError_t (*SetDevice)(int) = nullptr;
  cudaError_t (*HostRegister)(void*, size_t, unsigned) = nullptr;
  cudaError_t (*HostUnregister)(void*) = nullptr;
  cudaError_t (*MemcpyAsync)(void*, const void*, size_t, int, cudaStream_t) = nullptr;
  cudaError_t (*StreamCreateWithFlags)(cudaStream_t*, unsigned) = nullptr;
  cudaError_t (*StreamDestroy)(cudaStream_t) = nullptr;
  cudaError_t (*StreamSynchronize)(cudaStream_t) = nullptr;
  cudaError_t (*StreamWaitEvent)(cudaStream_t, cudaEvent_t, unsigned) = nullptr;
  cudaError_t (*EventCreateWithFlags)(cudaEvent_t*, unsigned) = nullptr;
  cudaError_t (*EventRecord)(cudaEvent_t, cudaStream_t) = nullptr;
  cudaError_t (*EventSynchronize)(cudaEvent_t) = nullptr;
  cudaError_t (*EventQuery)(cudaEvent_t) = nullptr;
  cudaError_t (*EventDestroy)(cudaEvent_t) = nullptr;
  cudaError_t (*GetLastError)() = nullptr;
  const char* (*GetErrorString)(cudaError_t) = nullptr;
  // Optional: only used to make messages and backend_info() richer.
  const char* (*GetErrorName)(cudaError_t) = nullptr;
  cudaError_t (*RuntimeGetVersion)(int*) = nullptr;
  cudaError_t (*DriverGetVersion)(int*) = nullptr;
};

// Loads once (thread-safe). Search order: $FLASHWRITE_CUDA_RUNTIME (a path;
// if it cannot be loaded CUDA is unavailable and `reason` says why, nothing
// else is tried), the libcudart already mapped into the process (PyTorch's,
// so streams and the current device are shared with it), then the sonames
// libcudart.so.13/.12/.11.0/libcudart.so.
const Runtime& runtime();

// The runtime, or a std::runtime_error saying why it is unavailable.
const Runtime& require(const char* what);

// A failed CUDA call: the code, the runtime's name and text for it, and what
// was being done.
class CudaError : public std::runtime_error {
 public:
  CudaError(cudaError_t code, const std::string& what);
  cudaError_t code() const noexcept { return code_; }

 private:
  cudaError_t code_;
};

// "an illegal memory access was encountered (cudaErrorIllegalAddress)".
std::string describe(cudaError_t code);

inline void check(cudaError_t err, const char* call, const std::string& context = {}) {
  if (err != cudaSuccess) throw CudaError(err, context.empty() ? std::string(call) : std::string(call) + " (" + context + ")");
}

// Makes `device` current on the calling thread if it is not already. Only for
// flashwrite's own threads: since CUDA 12 cudaSetDevice creates the device's
// primary context, so it is never called on a caller's thread.
void use_device(int device);

// Runs fn on a short-lived helper thread whose current device is `device`:
// for calls made on behalf of a caller's thread, so neither its current device
// nor a context on device 0 is touched (a runtime call on a thread with no
// current device may create device 0's primary context).
void on_device_thread(int device, const std::function<void()>& fn);

// Page-locks [p, p+n) for every context (cudaHostRegisterPortable), on a
// helper thread with `device` current. Returns "" on success, else the error.
std::string pin(void* p, size_t n, int device);
void unpin(void* p, int device);

}  // namespace fw::cuda
