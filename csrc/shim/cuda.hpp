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
constexpr cudaError_t cudaErrorStreamCaptureImplicit = 906;

// cudaStreamIsCapturing's answer.
enum cudaStreamCaptureStatus : int {
  cudaStreamCaptureStatusNone = 0,
  cudaStreamCaptureStatusActive = 1,
  cudaStreamCaptureStatusInvalidated = 2,
};
// cudaThreadExchangeStreamCaptureMode: which of the calling thread's calls a
// capture sequence elsewhere forbids. Relaxed: none (the thread's syncs do not
// invalidate another thread's global-mode capture, torch.cuda.graph's default).
enum cudaStreamCaptureMode : int {
  cudaStreamCaptureModeGlobal = 0,
  cudaStreamCaptureModeThreadLocal = 1,
  cudaStreamCaptureModeRelaxed = 2,
};

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
  std::string skipped;  // runtimes that loaded but were unusable (device count failed), and why
  bool initialized = false;  // cudaGetDeviceCount was called (the driver is initialised)
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
  // Optional (CUDA 10.1+): graph capture awareness; skipped where missing.
  cudaError_t (*StreamIsCapturing)(cudaStream_t, int*) = nullptr;
  cudaError_t (*ThreadExchangeStreamCaptureMode)(int*) = nullptr;
  // Optional: where the device sits (its NUMA node, through sysfs).
  cudaError_t (*DeviceGetPCIBusId)(char*, int, int) = nullptr;
};

// Loads once (thread-safe). Search order: $FLASHWRITE_CUDA_RUNTIME (a path;
// if it cannot be loaded CUDA is unavailable and `reason` says why, nothing
// else is tried), the libcudart already mapped into the process (PyTorch's,
// so streams and the current device are shared with it), then the sonames
// libcudart.so.13/.12/.11.0/libcudart.so. A runtime that loads but whose
// cudaGetDeviceCount fails (a CUDA 13 runtime on a CUDA 12 driver) is skipped
// for the next one; `skipped` says what was passed over and why.
const Runtime& runtime();

// What runtime() would load, found without initialising CUDA: dlopen, symbols
// and versions only, no cudaGetDeviceCount (which initialises the driver, and
// a process that forks after that has children that cannot use CUDA). Once
// runtime() has run, this is runtime(). `initialized` says which it is; when
// false, `available` means "a runtime was found", device_count is 0 and
// unknown, and no soname fallback on a failed device count was tried.
const Runtime& locate();

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

// An error that leaves the context unusable (an illegal address, a kernel's
// assert or fault): every later call of the process returns it. CudaError's
// text then says an earlier kernel may have faulted.
bool is_sticky(cudaError_t code);

// "an illegal memory access was encountered (cudaErrorIllegalAddress)".
std::string describe(cudaError_t code);

inline void check(cudaError_t err, const char* call, const std::string& context = {}) {
  if (err != cudaSuccess) throw CudaError(err, context.empty() ? std::string(call) : std::string(call) + " (" + context + ")");
}

// Makes `device` current on the calling thread if it is not already. Only for
// flashwrite's own threads: since CUDA 12 cudaSetDevice creates the device's
// primary context, so it is never called on a caller's thread. The first call
// on a thread also puts it in relaxed capture mode: its synchronising calls
// (cudaEventSynchronize on landed copies, cudaHostRegister) would otherwise
// invalidate a CUDA graph that a caller's thread captures in global mode.
void use_device(int device);

// The capture status (cudaStreamCaptureStatus) of a caller's stream, asked on
// a helper thread with `device` current; None where the runtime cannot say.
// cudaErrorStreamCaptureImplicit (the legacy stream while a blocking stream
// captures) counts as Active.
int capture_status(int device, cudaStream_t stream);

// Runs fn on a short-lived helper thread whose current device is `device`:
// for calls made on behalf of a caller's thread, so neither its current device
// nor a context on device 0 is touched (a runtime call on a thread with no
// current device may create device 0's primary context).
void on_device_thread(int device, const std::function<void()>& fn);

// Page-locks [p, p+n) for every context (cudaHostRegisterPortable), on a
// helper thread with `device` current. Returns "" on success, else the error.
// [p, p+n) must be memory just mapped by the caller: a registration the
// runtime already holds at p then belongs to an earlier mapping at the same
// address (unmapped without cudaHostUnregister) and pins pages that are no
// longer these, so it is dropped and p registered again; one that merely
// overlaps the range cannot be dropped from here and is an error.
std::string pin(void* p, size_t n, int device);

// The NUMA node of `device` (/sys/bus/pci/devices/<its PCI bus id>/numa_node),
// or -1 where the runtime or the kernel cannot say (one node, a VM).
int numa_node(int device);
void unpin(void* p, int device);

}  // namespace fw::cuda
