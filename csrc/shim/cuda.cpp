#include "shim/cuda.hpp"

#include <dlfcn.h>
#include <link.h>

#include <atomic>
#include <cctype>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <fstream>
#include <mutex>
#include <thread>
#include <utility>
#include <vector>

namespace fw::cuda {
namespace {

// The path of the first mapped object whose name contains `part`, or "".
std::string mapped(const char* part) {
  struct Find {
    const char* part;
    std::string found;
  } f{part, {}};
  dl_iterate_phdr(
      [](dl_phdr_info* info, size_t, void* data) {
        auto* f = static_cast<Find*>(data);
        const char* name = info->dlpi_name;
        if (name && std::strstr(name, f->part)) {
          f->found = name;
          return 1;
        }
        return 0;
      },
      &f);
  return f.found;
}

// Finds a libcudart that is already mapped (e.g. by `import torch` on a CUDA
// build), so we use the same runtime instance as PyTorch. PyTorch's is the one
// libtorch_cuda resolves cudaGetDeviceCount to (its own handle searches its
// dependencies): the first mapping named libcudart.so may be another
// framework's (CuPy, JAX) loaded before torch, with a runtime of its own.
std::string mapped_cudart() {
  const std::string torch_cuda = mapped("libtorch_cuda.so");
  if (!torch_cuda.empty()) {
    if (void* h = dlopen(torch_cuda.c_str(), RTLD_NOW | RTLD_NOLOAD)) {
      Dl_info info{};
      void* sym = dlsym(h, "cudaGetDeviceCount");
      std::string found;
      if (sym && dladdr(sym, &info) && info.dli_fname && std::strstr(info.dli_fname, "libcudart.so")) found = info.dli_fname;
      dlclose(h);  // only drops the reference RTLD_NOLOAD took
      if (!found.empty()) return found;
    }
  }
  return mapped("libcudart.so");
}

template <typename F>
bool bind(void* h, const char* sym, F& fn) {
  fn = reinterpret_cast<F>(dlsym(h, sym));
  return fn != nullptr;
}

// Binds the entry points of the library `h`; false (rt.reason says why) when
// one that is needed is missing.
bool bind_all(void* h, Runtime& rt, bool forced) {
  std::string missing;
  auto need = [&](const char* sym, auto& fn) {
    if (!bind(h, sym, fn)) missing += (missing.empty() ? "" : ", ") + std::string(sym);
  };
  need("cudaGetDeviceCount", rt.GetDeviceCount);
  need("cudaGetDevice", rt.GetDevice);
  need("cudaSetDevice", rt.SetDevice);
  need("cudaHostRegister", rt.HostRegister);
  need("cudaHostUnregister", rt.HostUnregister);
  need("cudaMemcpyAsync", rt.MemcpyAsync);
  need("cudaStreamCreateWithFlags", rt.StreamCreateWithFlags);
  need("cudaStreamDestroy", rt.StreamDestroy);
  need("cudaStreamSynchronize", rt.StreamSynchronize);
  need("cudaStreamWaitEvent", rt.StreamWaitEvent);
  need("cudaEventCreateWithFlags", rt.EventCreateWithFlags);
  need("cudaEventRecord", rt.EventRecord);
  need("cudaEventSynchronize", rt.EventSynchronize);
  need("cudaEventQuery", rt.EventQuery);
  need("cudaEventDestroy", rt.EventDestroy);
  need("cudaGetLastError", rt.GetLastError);
  need("cudaGetErrorString", rt.GetErrorString);
  if (!missing.empty()) {
    rt.reason = std::string(forced ? "FLASHWRITE_CUDA_RUNTIME=" : "") + rt.library +
                " is not a usable CUDA runtime (missing " + missing + ")";
    return false;
  }
  bind(h, "cudaGetErrorName", rt.GetErrorName);
  bind(h, "cudaRuntimeGetVersion", rt.RuntimeGetVersion);
  bind(h, "cudaDriverGetVersion", rt.DriverGetVersion);
  bind(h, "cudaStreamIsCapturing", rt.StreamIsCapturing);
  bind(h, "cudaThreadExchangeStreamCaptureMode", rt.ThreadExchangeStreamCaptureMode);
  bind(h, "cudaDeviceGetPCIBusId", rt.DeviceGetPCIBusId);
  // Neither initialises the driver.
  if (rt.RuntimeGetVersion) rt.RuntimeGetVersion(&rt.runtime_version);
  if (rt.DriverGetVersion) rt.DriverGetVersion(&rt.driver_version);
  return true;
}

// init=false stops at the first runtime that binds, before cudaGetDeviceCount
// (see locate()); init=true counts devices and, unless the runtime was forced,
// passes over one whose count fails for the next candidate.
Runtime load(bool init) {
  std::vector<std::pair<std::string, const char*>> candidates;  // (name, via)
  const char* env = std::getenv("FLASHWRITE_CUDA_RUNTIME");
  bool forced = env && *env;
  if (forced) {
    candidates.emplace_back(env, "FLASHWRITE_CUDA_RUNTIME");
  } else {
    std::string m = mapped_cudart();
    if (!m.empty()) candidates.emplace_back(m, "already loaded");
    for (const char* s : {"libcudart.so.13", "libcudart.so.12", "libcudart.so.11.0", "libcudart.so"})
      candidates.emplace_back(s, "soname");
  }
  std::string errors, skipped;
  Runtime last;  // the last runtime that loaded and failed, for its reason
  bool any = false;
  for (auto& [name, via] : candidates) {
    void* h = dlopen(name.c_str(), RTLD_NOW | RTLD_LOCAL);
    if (!h) {
      const char* e = dlerror();
      errors += (errors.empty() ? "" : "; ") + std::string(e ? e : name.c_str());
      continue;
    }
    Runtime rt;
    rt.library = name;
    rt.via = via;
    any = true;
    if (!bind_all(h, rt, forced)) {
      skipped += (skipped.empty() ? "" : "; ") + rt.reason;
      last = Runtime{};  // no pointers into a library about to be closed
      last.library = rt.library;
      last.via = rt.via;
      last.reason = rt.reason;
      dlclose(h);  // only drops our reference (PyTorch's mapping stays)
      continue;
    }
    if (!init) {
      rt.available = true;
      rt.skipped = skipped;
      return rt;
    }
    rt.initialized = true;
    int n = 0;
    cudaError_t err = rt.GetDeviceCount(&n);
    if (err == cudaSuccess && n > 0) {
      rt.device_count = n;
      rt.available = true;
      rt.skipped = skipped;
      return rt;
    }
    rt.reason = err != cudaSuccess ? "cudaGetDeviceCount failed: " + std::string(rt.GetErrorString(err))
                                   : "CUDA runtime loaded but no GPU is visible";
    // Another runtime may match the driver (a CUDA 13 runtime on a CUDA 12
    // driver fails here, CUDA 12's works); none sees a GPU that this one lacks
    // when the count was 0, but trying costs nothing.
    skipped += (skipped.empty() ? "" : "; ") + name + ": " + rt.reason;
    last = rt;
    // Not dlclose'd: the runtime may have started threads or registered atexit work.
  }
  if (any) {
    last.available = false;
    last.skipped = skipped;
    if (!forced && candidates.size() > 1 && skipped.find(';') != std::string::npos) last.reason += " (tried: " + skipped + ")";
    return last;
  }
  Runtime rt;
  rt.reason = forced ? "FLASHWRITE_CUDA_RUNTIME=" + std::string(env) + " could not be loaded: " + errors
                     : "no CUDA runtime found (" + errors + ")";
  return rt;
}

std::atomic<bool> g_loaded{false};  // runtime() has run

}  // namespace

const Runtime& runtime() {
  static std::once_flag once;
  static Runtime rt;
  std::call_once(once, [] {
    rt = load(true);
    g_loaded = true;
  });
  return rt;
}

const Runtime& locate() {
  if (g_loaded.load()) return runtime();
  static std::once_flag once;
  static Runtime rt;
  std::call_once(once, [] { rt = load(false); });
  return rt;
}

const Runtime& require(const char* what) {
  const Runtime& rt = runtime();
  if (!rt.available) throw std::runtime_error(std::string(what) + " needs the CUDA runtime, which is unavailable: " + rt.reason);
  return rt;
}

std::string describe(cudaError_t code) {
  const Runtime& rt = runtime();
  std::string s = rt.GetErrorString ? rt.GetErrorString(code) : "CUDA error";
  s += " (";
  s += rt.GetErrorName ? rt.GetErrorName(code) : "cudaError";
  s += " " + std::to_string(code) + ")";
  return s;
}

bool is_sticky(cudaError_t code) {
  // cudaErrorIllegalAddress, cudaErrorAssert, cudaErrorHardwareStackError,
  // cudaErrorIllegalInstruction, cudaErrorMisalignedAddress,
  // cudaErrorInvalidAddressSpace, cudaErrorInvalidPc, cudaErrorLaunchFailure.
  return code == 700 || code == 710 || (code >= 714 && code <= 719);
}

namespace {
std::string sticky_note(cudaError_t code) {
  if (!is_sticky(code)) return "";
  return ". This error is sticky: an earlier kernel (the program's, not necessarily flashwrite's copies) may have "
         "faulted, and every later CUDA call of this process fails the same way; nothing was saved or loaded "
         "by this call. Restart the process (e.g. from the last checkpoint); CUDA_LAUNCH_BLOCKING=1 names the "
         "kernel that faulted";
}
}  // namespace

CudaError::CudaError(cudaError_t code, const std::string& what)
    : std::runtime_error("CUDA error in " + what + ": " + describe(code) + sticky_note(code)), code_(code) {}

void use_device(int device) {
  // The runtime keeps the current device per thread; so do we, to skip the call.
  thread_local int current = -1;
  if (current == device) return;
  check(runtime().SetDevice(device), "cudaSetDevice", "cuda:" + std::to_string(device));
  current = device;
  // After cudaSetDevice: a runtime call on a thread with no current device
  // may create device 0's primary context.
  thread_local bool relaxed = false;
  if (!relaxed) {
    relaxed = true;
    const Runtime& rt = runtime();
    int mode = cudaStreamCaptureModeRelaxed;
    if (rt.ThreadExchangeStreamCaptureMode && rt.ThreadExchangeStreamCaptureMode(&mode) != cudaSuccess) rt.GetLastError();
  }
}

void on_device_thread(int device, const std::function<void()>& fn) {
  std::exception_ptr err;
  std::thread([&] {
    try {
      use_device(device);
      fn();
    } catch (...) {
      err = std::current_exception();
    }
  }).join();
  if (err) std::rethrow_exception(err);
}

int capture_status(int device, cudaStream_t stream) {
  const Runtime& rt = runtime();
  if (!rt.available || !rt.StreamIsCapturing) return cudaStreamCaptureStatusNone;
  int status = cudaStreamCaptureStatusNone;
  cudaError_t e = cudaSuccess;
  on_device_thread(device, [&] { e = rt.StreamIsCapturing(stream, &status); });
  if (e == cudaErrorStreamCaptureImplicit) {
    rt.GetLastError();
    return cudaStreamCaptureStatusActive;
  }
  check(e, "cudaStreamIsCapturing", "cuda:" + std::to_string(device));
  return status;
}

std::string pin(void* p, size_t n, int device) {
  const Runtime& rt = runtime();
  if (!rt.available) return rt.reason;
  std::string err;
  try {
    on_device_thread(device, [&] {
      cudaError_t e = rt.HostRegister(p, n, cudaHostRegisterPortable);
      std::string stale;
      if (e == cudaErrorHostMemoryAlreadyRegistered) {
        rt.GetLastError();
        // Not ours: the range was just mapped. A registration starting at p is
        // a stale one of an earlier mapping there; drop it and pin these pages.
        if (rt.HostUnregister(p) == cudaSuccess) {
          e = rt.HostRegister(p, n, cudaHostRegisterPortable);
          stale = " (after dropping a stale registration at this address)";
        } else {
          rt.GetLastError();
          stale = " (a registration overlapping this range, made for memory mapped here before, is still held: "
                  "copies into it could land in pages that are no longer these)";
        }
      }
      if (e != cudaSuccess) {
        rt.GetLastError();  // not sticky: clear it so it does not surface in PyTorch's next check
        err = "cudaHostRegister of " + std::to_string(n) + " bytes: " + describe(e) + stale;
      }
    });
  } catch (const std::exception& e) {
    err = e.what();
  }
  return err;
}

int numa_node(int device) {
  const Runtime& rt = runtime();
  if (!rt.available || !rt.DeviceGetPCIBusId) return -1;
  char bus[64] = {};
  cudaError_t e = cudaSuccess;
  try {
    on_device_thread(device, [&] { e = rt.DeviceGetPCIBusId(bus, sizeof bus - 1, device); });
  } catch (const std::exception&) {
    return -1;
  }
  if (e != cudaSuccess) {
    rt.GetLastError();
    return -1;
  }
  std::string id(bus);
  for (auto& c : id) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));  // sysfs names are lower case
  std::ifstream f("/sys/bus/pci/devices/" + id + "/numa_node");
  int node = -1;
  if (!(f >> node)) return -1;
  return node;
}

void unpin(void* p, int device) {
  const Runtime& rt = runtime();
  if (!rt.available) return;
  try {
    on_device_thread(device, [&] {
      if (rt.HostUnregister(p) != cudaSuccess) rt.GetLastError();
    });
  } catch (...) {  // at exit the runtime may be unloading: the pages go with the process anyway
  }
}

}  // namespace fw::cuda
