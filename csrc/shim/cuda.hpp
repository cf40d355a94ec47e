// The only place that knows how CUDA is reached: the runtime library is
// dlopen'ed at run time (never linked), and its entry points are typed
// function pointers. With no runtime, `available` is false and `reason` says why.
#pragma once
#include <cstddef>
#include <string>

namespace fw::cuda {

using cudaError_t = int;
using cudaStream_t = void*;
using cudaEvent_t = void*;

struct Runtime {
  bool available = false;
  std::string reason;   // why not available
  std::string library;  // path or soname that was loaded
  int device_count = 0;

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
  cudaError_t (*EventDestroy)(cudaEvent_t) = nullptr;
  const char* (*GetErrorString)(cudaError_t) = nullptr;
};

// Loads once (thread-safe). Search order: $FLASHWRITE_CUDA_RUNTIME (a path;
// an error if it cannot be loaded), the libcudart already mapped into the
// process (PyTorch's), then the sonames libcudart.so.13/.12/.11.0/libcudart.so.
const Runtime& runtime();

}  // namespace fw::cuda
