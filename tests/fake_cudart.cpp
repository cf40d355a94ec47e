// A stand-in for libcudart, for tests on machines without a GPU: it implements the
// few runtime entry points flashwrite's shim binds. Streams are worker threads that
// run their operations in order (copies really are asynchronous, and can be slowed
// down); events and cudaStreamWaitEvent follow CUDA's semantics (a wait or
// synchronize refers to the most recent record at the time of the call). It
// exercises the native copy engine's logic (chunking, ordering, callbacks, slot
// accounting, error paths); it says nothing about real GPUs or their speed.
//
// It is as strict as CUDA where a host-memory stand-in could hide a bug:
//  - "Device memory" (cudaMalloc / fake_cudart_malloc) is a memfd mapped twice: the
//    address handed out is PROT_NONE, so a CPU read or write of a device pointer
//    faults at once; only the stand-in's stream threads copy, through a private
//    read-write alias of the same pages.
//  - cudaMemcpyAsync checks its kind against which pointers are device memory
//    (HostToDevice: device dst, host src; DeviceToHost: the reverse) and refuses
//    (cudaErrorInvalidValue, with the reason on stderr) a wrong direction, a copy
//    that runs past an allocation, and an async copy from or to host memory that
//    was never cudaHostRegister'ed. With FAKE_CUDART_FAIL_REGISTER=1 or
//    FAKE_CUDART_ALLOW_PAGEABLE=1 a pageable copy is accepted and, as on CUDA,
//    done synchronously (the engine's documented fallback when pinning fails).
//  - Events are destroyed as CUDA destroys them: cudaEventDestroy on an event whose
//    record is still pending returns at once and the event is freed when the
//    stream has passed it (the engine may return an event to its pool, or destroy
//    it, while a record is in flight).
//
//  - CUDA is initialised by the first call that needs a context or the driver
//    (not cudaRuntimeGetVersion/cudaDriverGetVersion); every such call in a
//    process forked after that fails with cudaErrorInitializationError, as
//    CUDA's do (the stand-in's stream threads do not survive a fork either).
//  - Graph capture (cudaStreamBeginCapture/EndCapture/IsCapturing,
//    cudaThreadExchangeStreamCaptureMode): work queued on a capturing stream is
//    recorded, not run (fake_cudart_captured counts it); a "potentially unsafe"
//    call (cudaStreamSynchronize, cudaEventSynchronize, cudaHostRegister,
//    cudaHostUnregister, cudaMalloc) made while a capture forbids it, by CUDA's
//    rules for the calling thread's capture mode (global: a global-mode capture
//    on any other thread, or a non-relaxed one of its own; thread-local: its
//    own non-relaxed one; relaxed: never), fails with
//    cudaErrorStreamCaptureUnsupported and invalidates those captures, whose
//    cudaStreamEndCapture then fails with cudaErrorStreamCaptureInvalidated.
//    Not modelled: streams joining a capture through an event recorded in it.
//
// Environment: FAKE_CUDART_DEVICES (default 1), FAKE_CUDART_COPY_DELAY_US (per
// copy), FAKE_CUDART_FAIL_COPY (the N-th cudaMemcpyAsync returns
// cudaErrorIllegalAddress), FAKE_CUDART_FAIL_RECORD (the N-th cudaEventRecord
// fails likewise), FAKE_CUDART_FAIL_REGISTER=1 (cudaHostRegister fails),
// FAKE_CUDART_FAIL_REGISTER_NTH=N (only the N-th cudaHostRegister call fails),
// FAKE_CUDART_FAIL_CODE (what those failures return, default 700; a sticky code
// (700, 710, 714-719) makes every later call that needs the context, and
// cudaGetLastError, return it for the rest of the process, as CUDA does; 1,
// cudaErrorInvalidValue, is not sticky), FAKE_CUDART_ALLOW_PAGEABLE=1 (see
// above), FAKE_CUDART_NO_DRIVER=<text>
// (cudaGetDeviceCount fails with cudaErrorInsufficientDriver in a copy of the
// stand-in whose file path contains <text>: a runtime too new for the driver).
// Build: c++ -std=c++17 -O1 -shared -fPIC -o libfakecudart.so fake_cudart.cpp -lpthread
#include <dlfcn.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <functional>
#include <iterator>
#include <map>
#include <algorithm>
#include <mutex>
#include <set>
#include <string>
#include <thread>

namespace {

int env_int(const char* name, int dflt) {
  const char* v = std::getenv(name);
  return v && *v ? std::atoi(v) : dflt;
}

struct Stream {
  std::mutex mu;
  std::condition_variable cv;
  std::deque<std::function<void()>> ops;
  bool busy = false;
  // Capture state, under cap_mu (below).
  bool capturing = false, invalidated = false;
  int cap_mode = 0;
  std::thread::id cap_thread;
  explicit Stream() {
    std::thread([this] {
      for (;;) {
        std::function<void()> op;
        {
          std::unique_lock<std::mutex> lk(mu);
          cv.wait(lk, [&] { return !ops.empty(); });
          op = std::move(ops.front());
          busy = true;
        }
        op();
        {
          std::lock_guard<std::mutex> lk(mu);
          ops.pop_front();
          busy = false;
        }
        cv.notify_all();
      }
    }).detach();  // streams live as long as the test process
  }
  void push(std::function<void()> op);
  void sync() {
    std::unique_lock<std::mutex> lk(mu);
    cv.wait(lk, [&] { return ops.empty(); });
  }
};

// refs: one for the handle (dropped by cudaEventDestroy) and one per queued stream
// operation that touches the event; the last one frees it.
struct Event {
  std::mutex mu;
  std::condition_variable cv;
  unsigned long long recorded = 0, completed = 0;
  std::atomic<int> refs{1};
  void wait_for(unsigned long long gen) {
    std::unique_lock<std::mutex> lk(mu);
    cv.wait(lk, [&] { return completed >= gen; });
  }
  void ref() { refs.fetch_add(1); }
  void unref() {
    if (refs.fetch_sub(1) == 1) delete this;
  }
};

// ------------------------------------------------------------ memory model

constexpr int kErrInvalidValue = 1;
constexpr int kErrHostMemoryAlreadyRegistered = 712;
constexpr int kErrHostMemoryNotRegistered = 713;

struct DeviceAlloc {
  size_t size;
  char* alias;  // read-write view of the same pages, for the stream threads only
};
std::mutex mem_mu;
std::map<uintptr_t, DeviceAlloc> device_allocs;  // by PROT_NONE base address
std::map<uintptr_t, size_t> host_registered;      // by base address

// The alias of [p, p+n) when it lies inside one device allocation, else nullptr.
char* device_alias(const void* p, size_t n) {
  auto a = reinterpret_cast<uintptr_t>(p);
  std::lock_guard<std::mutex> lk(mem_mu);
  auto it = device_allocs.upper_bound(a);
  if (it == device_allocs.begin()) return nullptr;
  --it;
  if (a - it->first > it->second.size || n > it->second.size - (a - it->first)) return nullptr;
  return it->second.alias + (a - it->first);
}

bool is_device(const void* p) {
  auto a = reinterpret_cast<uintptr_t>(p);
  std::lock_guard<std::mutex> lk(mem_mu);
  auto it = device_allocs.upper_bound(a);
  if (it == device_allocs.begin()) return false;
  --it;
  return a - it->first < it->second.size;
}

bool host_is_registered(const void* p, size_t n) {
  auto a = reinterpret_cast<uintptr_t>(p);
  std::lock_guard<std::mutex> lk(mem_mu);
  auto it = host_registered.upper_bound(a);
  if (it == host_registered.begin()) return false;
  --it;
  return a - it->first <= it->second && n <= it->second - (a - it->first);
}

int refuse(const char* why, const void* dst, const void* src, size_t n) {
  std::fprintf(stderr, "fake_cudart: cudaMemcpyAsync(dst=%p, src=%p, %zu bytes) refused: %s\n", dst, src, n, why);
  return kErrInvalidValue;
}

void* device_malloc(size_t n) {
  size_t page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
  size_t len = (std::max<size_t>(n, 1) + page - 1) / page * page;
  int fd = static_cast<int>(syscall(SYS_memfd_create, "fake_cudart_device", 0));
  if (fd < 0) return nullptr;
  void* dev = MAP_FAILED;
  void* alias = MAP_FAILED;
  if (ftruncate(fd, static_cast<off_t>(len)) == 0) {
    dev = mmap(nullptr, len, PROT_NONE, MAP_SHARED, fd, 0);
    alias = mmap(nullptr, len, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  }
  close(fd);
  if (dev == MAP_FAILED || alias == MAP_FAILED) {
    if (dev != MAP_FAILED) munmap(dev, len);
    if (alias != MAP_FAILED) munmap(alias, len);
    return nullptr;
  }
  std::lock_guard<std::mutex> lk(mem_mu);
  device_allocs[reinterpret_cast<uintptr_t>(dev)] = DeviceAlloc{n, static_cast<char*>(alias)};
  return dev;
}

// ------------------------------------------------------------ capture and fork

constexpr int kErrInitialization = 3;
constexpr int kErrCaptureUnsupported = 900;
constexpr int kErrCaptureInvalidated = 901;
constexpr int kErrIllegalState = 401;
constexpr int kModeGlobal = 0, kModeThreadLocal = 1, kModeRelaxed = 2;

std::mutex cap_mu;
std::set<Stream*> capture_set;  // streams with a capture sequence in progress
std::atomic<int> captured_ops{0};
thread_local int thread_mode = kModeGlobal;

void Stream::push(std::function<void()> op) {
  {
    std::lock_guard<std::mutex> lk(cap_mu);
    if (capturing) {  // recorded into the graph, never run here
      ++captured_ops;
      return;
    }
  }
  {
    std::lock_guard<std::mutex> lk(mu);
    ops.push_back(std::move(op));
  }
  cv.notify_all();
}

// A potentially unsafe call: false (and the captures that forbid it
// invalidated) when the calling thread may not make it now.
bool capture_allows_unsafe_call() {
  if (thread_mode == kModeRelaxed) return true;
  std::lock_guard<std::mutex> lk(cap_mu);
  bool ok = true;
  for (Stream* s : capture_set) {
    const bool own = s->cap_thread == std::this_thread::get_id();
    const bool forbids = own ? s->cap_mode != kModeRelaxed : (thread_mode == kModeGlobal && s->cap_mode == kModeGlobal);
    if (forbids) {
      s->invalidated = true;
      ok = false;
    }
  }
  return ok;
}

std::atomic<int> init_pid{0};
std::atomic<int> after_fork_calls{0};  // calls refused because CUDA was initialised before a fork
// CUDA is initialised by this call (if not yet); false in a process forked
// after it was.
bool init_ok() {
  int pid = static_cast<int>(getpid());
  int expected = 0;
  if (init_pid.compare_exchange_strong(expected, pid)) return true;
  if (expected == pid) return true;
  ++after_fork_calls;
  return false;
}

// Sticky errors: after an illegal address (or another fault of a kernel) the
// context is unusable and every later call returns the same error, as on CUDA.
std::atomic<int> sticky{0};
bool is_sticky(int code) { return code == 700 || code == 710 || (code >= 714 && code <= 719); }
// What a failure injected by FAKE_CUDART_FAIL_COPY/_RECORD returns:
// FAKE_CUDART_FAIL_CODE (default 700, cudaErrorIllegalAddress, which is sticky).
int injected_failure() {
  int code = env_int("FAKE_CUDART_FAIL_CODE", 700);
  if (is_sticky(code)) {
    int zero = 0;
    sticky.compare_exchange_strong(zero, code);
  }
  return code;
}
// The error every call that needs the context returns now, or 0.
int gate() {
  if (!init_ok()) return kErrInitialization;
  return sticky.load();
}

thread_local int current_device = 0;
thread_local bool device_set = false;  // cudaSetDevice was called on this thread
std::atomic<int> exchange_without_device{0};  // capture-mode exchanges before it
std::mutex g_mu;
std::map<int, Stream*> legacy;  // per-device legacy default stream (handle 0)
std::atomic<int> copies{0}, registered{0}, events_live{0}, streams_live{0};
// The call log for the tests (fake_cudart_log): "register <tid> <bytes> <rc>;"
// for every cudaHostRegister as it returns, "d2h <tid>;" for every
// device-to-host cudaMemcpyAsync as it is called, in the order they happened.
std::mutex log_mu;
std::string call_log;
std::atomic<int> register_calls{0};
void log_call(const std::string& what) {
  std::lock_guard<std::mutex> lk(log_mu);
  call_log += what + " " + std::to_string(static_cast<long>(::syscall(SYS_gettid))) + ";";
}

Stream* S(void* s) {
  if (s) return static_cast<Stream*>(s);
  std::lock_guard<std::mutex> lk(g_mu);
  Stream*& d = legacy[current_device];
  if (!d) d = new Stream();
  return d;
}

}  // namespace

extern "C" {

int cudaGetDeviceCount(int* n) {
  *n = 0;
  if (!init_ok()) return kErrInitialization;
  const char* broken = std::getenv("FAKE_CUDART_NO_DRIVER");
  Dl_info info;
  if (broken && *broken && dladdr(reinterpret_cast<void*>(&cudaGetDeviceCount), &info) && info.dli_fname &&
      std::strstr(info.dli_fname, broken))
    return 35;  // cudaErrorInsufficientDriver
  *n = env_int("FAKE_CUDART_DEVICES", 1);
  return 0;
}
int cudaGetDevice(int* d) {
  if (int err = gate()) return err;
  *d = current_device;
  return 0;
}
int cudaSetDevice(int d) {
  if (int err = gate()) return err;
  if (d < 0 || d >= env_int("FAKE_CUDART_DEVICES", 1)) return 101;  // cudaErrorInvalidDevice
  current_device = d;
  device_set = true;
  return 0;
}
int cudaHostRegister(void* p, size_t n, unsigned flags);
int host_register(void* p, size_t n, unsigned);
int cudaHostRegister(void* p, size_t n, unsigned flags) {
  const int rc = host_register(p, n, flags);
  std::lock_guard<std::mutex> lk(log_mu);
  call_log += "register " + std::to_string(static_cast<long>(::syscall(SYS_gettid))) + " " + std::to_string(n) + " " +
              std::to_string(rc) + ";";
  return rc;
}
int host_register(void* p, size_t n, unsigned) {
  if (int err = gate()) return err;
  if (!capture_allows_unsafe_call()) return kErrCaptureUnsupported;
  if (env_int("FAKE_CUDART_FAIL_REGISTER", 0)) return 2;  // cudaErrorMemoryAllocation
  if (++register_calls == env_int("FAKE_CUDART_FAIL_REGISTER_NTH", 0)) return 2;
  // Pinning tens of GiB takes seconds on real hardware.
  if (int ms = env_int("FAKE_CUDART_REGISTER_DELAY_MS", 0)) std::this_thread::sleep_for(std::chrono::milliseconds(ms));
  if (!p || !n || is_device(p)) return kErrInvalidValue;
  {
    std::lock_guard<std::mutex> lk(mem_mu);
    auto a = reinterpret_cast<uintptr_t>(p);
    auto it = host_registered.upper_bound(a + n - 1);  // any registered range overlapping [a, a+n)
    if (it != host_registered.begin() && std::prev(it)->first + std::prev(it)->second > a)
      return kErrHostMemoryAlreadyRegistered;
    host_registered[a] = n;
  }
  ++registered;
  return 0;
}
int cudaHostUnregister(void* p) {
  if (int err = gate()) return err;
  if (!capture_allows_unsafe_call()) return kErrCaptureUnsupported;
  {
    std::lock_guard<std::mutex> lk(mem_mu);
    if (!host_registered.erase(reinterpret_cast<uintptr_t>(p))) return kErrHostMemoryNotRegistered;
  }
  --registered;
  return 0;
}
int cudaMalloc(void** p, size_t n) {
  if (int err = gate()) return err;
  if (!capture_allows_unsafe_call()) return kErrCaptureUnsupported;
  *p = device_malloc(n);
  return *p ? 0 : 2;  // cudaErrorMemoryAllocation
}
int cudaFree(void* p) {
  std::lock_guard<std::mutex> lk(mem_mu);
  auto it = device_allocs.find(reinterpret_cast<uintptr_t>(p));
  if (it == device_allocs.end()) return kErrInvalidValue;
  // Unmapped only when no stream could still use it: kept, like the streams.
  device_allocs.erase(it);
  return 0;
}
int cudaMemcpyAsync(void* dst, const void* src, size_t n, int kind, void* stream) {
  if (int err = gate()) return err;
  int k = ++copies;
  if (k == env_int("FAKE_CUDART_FAIL_COPY", 0)) return injected_failure();
  char* to = nullptr;
  const char* from = nullptr;
  const void* host = nullptr;
  if (kind == 1) {  // cudaMemcpyHostToDevice
    if (is_device(src)) return refuse("HostToDevice from a device pointer", dst, src, n);
    if (!(to = device_alias(dst, n)))
      return refuse(is_device(dst) ? "past the end of a device allocation" : "HostToDevice to host memory", dst, src, n);
    from = static_cast<const char*>(src);
    host = src;
  } else if (kind == 2) {  // cudaMemcpyDeviceToHost
    log_call("d2h");
    if (is_device(dst)) return refuse("DeviceToHost to a device pointer", dst, src, n);
    if (!(from = device_alias(src, n)))
      return refuse(is_device(src) ? "past the end of a device allocation" : "DeviceToHost from host memory", dst, src, n);
    to = static_cast<char*>(dst);
    host = dst;
  } else {
    return refuse("only HostToDevice and DeviceToHost are modelled", dst, src, n);
  }
  int delay = env_int("FAKE_CUDART_COPY_DELAY_US", 0);
  auto op = [=] {
    if (delay) std::this_thread::sleep_for(std::chrono::microseconds(delay));
    if (n) std::memcpy(to, from, n);
  };
  if (n && !host_is_registered(host, n)) {
    if (!env_int("FAKE_CUDART_ALLOW_PAGEABLE", 0) && !env_int("FAKE_CUDART_FAIL_REGISTER", 0))
      return refuse("async copy with pageable (unregistered) host memory", dst, src, n);
    // CUDA's pageable path: the copy is done before the call returns.
    Stream* st = S(stream);
    st->sync();
    op();
    return 0;
  }
  S(stream)->push(op);
  return 0;
}
int cudaStreamCreateWithFlags(void** s, unsigned) {
  if (int err = gate()) return err;
  *s = new Stream();
  ++streams_live;
  return 0;
}
int cudaStreamDestroy(void* s) {
  if (int e = sticky.load()) return e;  // the stream is not drained: the context is gone
  S(s)->sync();
  --streams_live;  // the worker thread and the object are leaked on purpose
  return 0;
}
int cudaStreamSynchronize(void* s) {
  if (int err = gate()) return err;
  if (!capture_allows_unsafe_call()) return kErrCaptureUnsupported;
  S(s)->sync();
  return 0;
}
int cudaEventCreateWithFlags(void** e, unsigned) {
  if (int err = gate()) return err;
  *e = new Event();
  ++events_live;
  return 0;
}
// CUDA: "if the event has been recorded but has not completed, the call returns
// at once and its resources are released once the device has completed it".
int cudaEventDestroy(void* e) {
  static_cast<Event*>(e)->unref();
  --events_live;
  return 0;
}
int cudaEventRecord(void* e, void* s) {
  if (int err = gate()) return err;
  static std::atomic<int> records{0};
  if (++records == env_int("FAKE_CUDART_FAIL_RECORD", 0)) return injected_failure();
  auto* ev = static_cast<Event*>(e);
  unsigned long long gen;
  {
    std::lock_guard<std::mutex> lk(ev->mu);
    gen = ++ev->recorded;
  }
  ev->ref();
  S(s)->push([ev, gen] {
    {
      std::lock_guard<std::mutex> lk(ev->mu);
      if (ev->completed < gen) ev->completed = gen;
      ev->cv.notify_all();  // under the lock: a waiter may drop the last ref right after
    }
    ev->unref();
  });
  return 0;
}
int cudaStreamWaitEvent(void* s, void* e, unsigned) {
  if (int err = gate()) return err;
  auto* ev = static_cast<Event*>(e);
  unsigned long long gen;
  {
    std::lock_guard<std::mutex> lk(ev->mu);
    gen = ev->recorded;
  }
  ev->ref();
  S(s)->push([ev, gen] {
    ev->wait_for(gen);
    ev->unref();
  });
  return 0;
}
int cudaEventSynchronize(void* e) {
  if (int err = gate()) return err;
  if (!capture_allows_unsafe_call()) return kErrCaptureUnsupported;
  auto* ev = static_cast<Event*>(e);
  unsigned long long gen;
  {
    std::lock_guard<std::mutex> lk(ev->mu);
    gen = ev->recorded;
  }
  ev->wait_for(gen);
  return 0;
}
int cudaEventQuery(void* e) {
  if (int err = gate()) return err;
  auto* ev = static_cast<Event*>(e);
  std::lock_guard<std::mutex> lk(ev->mu);
  return ev->completed >= ev->recorded ? 0 : 600;
}
int cudaStreamBeginCapture(void* s, int mode) {
  if (int err = gate()) return err;
  if (!s) return kErrInvalidValue;  // the legacy stream cannot be captured
  Stream* st = S(s);
  std::lock_guard<std::mutex> lk(cap_mu);
  if (st->capturing) return kErrIllegalState;
  st->capturing = true;
  st->invalidated = false;
  st->cap_mode = mode;
  st->cap_thread = std::this_thread::get_id();
  capture_set.insert(st);
  return 0;
}
int cudaStreamEndCapture(void* s, void** graph) {
  if (int err = gate()) return err;
  Stream* st = S(s);
  std::lock_guard<std::mutex> lk(cap_mu);
  *graph = nullptr;
  if (!st->capturing) return kErrIllegalState;
  st->capturing = false;
  capture_set.erase(st);
  if (st->invalidated) return kErrCaptureInvalidated;
  *graph = st;  // a non-null stand-in for the graph; nothing can launch it
  return 0;
}
// FAKE_CUDART_PCI_BUS_ID names the device's PCI slot (a real one of this
// machine, so /sys/bus/pci/devices/<id>/numa_node exists); unset: not supported.
int cudaDeviceGetPCIBusId(char* buf, int len, int device) {
  if (int err = gate()) return err;
  if (device < 0 || device >= env_int("FAKE_CUDART_DEVICES", 1)) return 101;  // cudaErrorInvalidDevice
  const char* id = std::getenv("FAKE_CUDART_PCI_BUS_ID");
  if (!id || !*id) return 801;  // cudaErrorNotSupported
  if (!buf || len <= 0) return kErrInvalidValue;
  std::snprintf(buf, static_cast<size_t>(len), "%s", id);
  return 0;
}

int cudaStreamIsCapturing(void* s, int* status) {
  if (int err = gate()) return err;
  Stream* st = S(s);
  std::lock_guard<std::mutex> lk(cap_mu);
  *status = !st->capturing ? 0 : st->invalidated ? 2 : 1;
  return 0;
}
int cudaThreadExchangeStreamCaptureMode(int* mode) {
  if (*mode < kModeGlobal || *mode > kModeRelaxed) return kErrInvalidValue;
  if (!device_set) ++exchange_without_device;  // on CUDA: device 0's context, made here
  std::swap(*mode, thread_mode);
  return 0;
}

int cudaGetLastError() { return sticky.load(); }  // a sticky error is never cleared
const char* cudaGetErrorString(int e) {
  return e == 700   ? "an illegal memory access was encountered (fake)"
         : e == 3   ? "initialization error (fake: CUDA was initialised before this process forked)"
         : e == 35  ? "CUDA driver version is insufficient for CUDA runtime version (fake)"
         : e == 900 ? "operation not permitted when stream is capturing (fake)"
         : e == 901 ? "operation failed due to a previous error during capture (fake)"
         : e == 0 ? "no error"
         : e == 1 ? "invalid argument (fake: see stderr)"
                  : "fake CUDA error";
}
const char* cudaGetErrorName(int e) {
  return e == 700   ? "cudaErrorIllegalAddress"
         : e == 101 ? "cudaErrorInvalidDevice"
         : e == 1   ? "cudaErrorInvalidValue"
         : e == 712 ? "cudaErrorHostMemoryAlreadyRegistered"
         : e == 713 ? "cudaErrorHostMemoryNotRegistered"
         : e == 3   ? "cudaErrorInitializationError"
         : e == 35  ? "cudaErrorInsufficientDriver"
         : e == 900 ? "cudaErrorStreamCaptureUnsupported"
         : e == 901 ? "cudaErrorStreamCaptureInvalidated"
                    : "cudaErrorUnknown";
}
int cudaRuntimeGetVersion(int* v) {
  *v = 12040;
  return 0;
}
int cudaDriverGetVersion(int* v) {
  *v = 12040;
  return 0;
}

// For the tests: a kernel of the caller's faulted (code: e.g. 700, sticky).
void fake_cudart_fault(int code) {
  int zero = 0;
  if (is_sticky(code)) sticky.compare_exchange_strong(zero, code);
}
// For the tests: the call log (see log_call), copied into buf (NUL-terminated);
// returns its full length.
int fake_cudart_log(char* buf, int len) {
  std::lock_guard<std::mutex> lk(log_mu);
  if (buf && len > 0) std::snprintf(buf, static_cast<size_t>(len), "%s", call_log.c_str());
  return static_cast<int>(call_log.size());
}
// For the tests: what the engine did with the runtime.
int fake_cudart_registered() { return registered.load(); }
int fake_cudart_calls_after_fork() { return after_fork_calls.load(); }
int fake_cudart_exchange_without_device() { return exchange_without_device.load(); }
int fake_cudart_copies() { return copies.load(); }
int fake_cudart_events_live() { return events_live.load(); }
int fake_cudart_captured() { return captured_ops.load(); }
// Queues "sleep delay_us, then memset(p, byte, n)" on a stream: the caller's work
// that a save must wait for.
int fake_cudart_enqueue_fill(void* stream, void* p, int byte, size_t n, int delay_us) {
  char* dst = n ? device_alias(p, n) : nullptr;
  if (n && !dst) return kErrInvalidValue;  // the caller's kernels write device memory only
  S(stream)->push([=] {
    std::this_thread::sleep_for(std::chrono::microseconds(delay_us));
    if (n) std::memset(dst, byte, n);
  });
  return 0;
}
// Device memory for the tests, and synchronous peek/poke through the alias (the
// device address itself cannot be touched by the CPU).
void* fake_cudart_malloc(size_t n) { return device_malloc(n); }
int fake_cudart_poke(void* dev, const void* host, size_t n) {
  char* a = device_alias(dev, n);
  if (!a) return kErrInvalidValue;
  std::memcpy(a, host, n);
  return 0;
}
int fake_cudart_peek(void* host, const void* dev, size_t n) {
  char* a = device_alias(dev, n);
  if (!a) return kErrInvalidValue;
  std::memcpy(host, a, n);
  return 0;
}
int fake_cudart_stream_create(void** s) { return cudaStreamCreateWithFlags(s, 1); }

}  // extern "C"
