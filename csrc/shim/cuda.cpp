#include "shim/cuda.hpp"

#include <dlfcn.h>
#include <link.h>

#include <cstdlib>
#include <cstring>
#include <mutex>
#include <vector>

namespace fw::cuda {
namespace {

// Finds a libcudart that is already mapped (e.g. by `import torch` on a CUDA
// build), so we use the same runtime instance as PyTorch.
std::string mapped_cudart() {
  std::string found;
  dl_iterate_phdr(
      [](dl_phdr_info* info, size_t, void* data) {
        const char* name = info->dlpi_name;
        if (name && std::strstr(name, "libcudart.so")) {
          *static_cast<std::string*>(data) = name;
          return 1;
        }
        return 0;
      },
      &found);
  return found;
}

template <typename F>
bool bind(void* h, const char* sym, F& fn) {
  fn = reinterpret_cast<F>(dlsym(h, sym));
  return fn != nullptr;
}

Runtime load() {
  Runtime rt;
  std::vector<std::string> candidates;
  const char* env = std::getenv("FLASHWRITE_CUDA_RUNTIME");
  bool forced = env && *env;
  if (forced) {
    candidates.push_back(env);
  } else {
    std::string m = mapped_cudart();
    if (!m.empty()) candidates.push_back(m);
    for (const char* s : {"libcudart.so.13", "libcudart.so.12", "libcudart.so.11.0", "libcudart.so"}) candidates.push_back(s);
  }
  void* h = nullptr;
  std::string errors;
  for (auto& c : candidates) {
    h = dlopen(c.c_str(), RTLD_NOW | RTLD_LOCAL);
    if (h) {
      rt.library = c;
      break;
    }
    const char* e = dlerror();
    errors += (errors.empty() ? "" : "; ") + std::string(e ? e : c);
  }
  if (!h) {
    rt.reason = forced ? "FLASHWRITE_CUDA_RUNTIME=" + std::string(env) + " could not be loaded: " + errors
                       : "no CUDA runtime found (" + errors + ")";
    return rt;
  }
  bool ok = bind(h, "cudaGetDeviceCount", rt.GetDeviceCount) && bind(h, "cudaGetDevice", rt.GetDevice) &&
            bind(h, "cudaSetDevice", rt.SetDevice) && bind(h, "cudaHostRegister", rt.HostRegister) &&
            bind(h, "cudaHostUnregister", rt.HostUnregister) && bind(h, "cudaMemcpyAsync", rt.MemcpyAsync) &&
            bind(h, "cudaStreamCreateWithFlags", rt.StreamCreateWithFlags) &&
            bind(h, "cudaStreamDestroy", rt.StreamDestroy) && bind(h, "cudaStreamSynchronize", rt.StreamSynchronize) &&
            bind(h, "cudaStreamWaitEvent", rt.StreamWaitEvent) &&
            bind(h, "cudaEventCreateWithFlags", rt.EventCreateWithFlags) && bind(h, "cudaEventRecord", rt.EventRecord) &&
            bind(h, "cudaEventSynchronize", rt.EventSynchronize) && bind(h, "cudaEventDestroy", rt.EventDestroy) &&
            bind(h, "cudaGetErrorString", rt.GetErrorString);
  if (!ok) {
    rt.reason = rt.library + " lacks CUDA runtime symbols";
    return rt;
  }
  int n = 0;
  cudaError_t err = rt.GetDeviceCount(&n);
  if (err != 0) {
    rt.reason = std::string("cudaGetDeviceCount failed: ") + rt.GetErrorString(err);
    return rt;
  }
  if (n == 0) {
    rt.reason = "CUDA runtime loaded but no GPU is visible";
    return rt;
  }
  rt.device_count = n;
  rt.available = true;
  return rt;
}

}  // namespace

const Runtime& runtime() {
  static std::once_flag once;
  static Runtime rt;
  std::call_once(once, [] { rt = load(); });
  return rt;
}

}  // namespace fw::cuda
