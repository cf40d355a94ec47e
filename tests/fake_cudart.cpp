// A stand-in for libcudart, for tests on machines without a GPU: it implements the
// few runtime entry points flashwrite's shim binds, with "device memory" that is
// ordinary host memory. Streams are worker threads that run their operations in
// order (copies really are asynchronous, and can be slowed down); events and
// cudaStreamWaitEvent follow CUDA's semantics (a wait or synchronize refers to the
// most recent record at the time of the call). It exercises the native copy
// engine's logic (chunking, ordering, callbacks, slot accounting, error paths);
// it says nothing about real GPUs or their speed.
//
// Environment: FAKE_CUDART_DEVICES (default 1), FAKE_CUDART_COPY_DELAY_US (per
// copy), FAKE_CUDART_FAIL_COPY (the N-th cudaMemcpyAsync returns
// cudaErrorIllegalAddress), FAKE_CUDART_FAIL_REGISTER=1 (cudaHostRegister fails).
// Build: c++ -std=c++17 -O1 -shared -fPIC -o libfakecudart.so fake_cudart.cpp -lpthread
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <functional>
#include <map>
#include <mutex>
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
  void push(std::function<void()> op) {
    {
      std::lock_guard<std::mutex> lk(mu);
      ops.push_back(std::move(op));
    }
    cv.notify_all();
  }
  void sync() {
    std::unique_lock<std::mutex> lk(mu);
    cv.wait(lk, [&] { return ops.empty(); });
  }
};

struct Event {
  std::mutex mu;
  std::condition_variable cv;
  unsigned long long recorded = 0, completed = 0;
  void wait_for(unsigned long long gen) {
    std::unique_lock<std::mutex> lk(mu);
    cv.wait(lk, [&] { return completed >= gen; });
  }
};

thread_local int current_device = 0;
std::mutex g_mu;
std::map<int, Stream*> legacy;  // per-device legacy default stream (handle 0)
std::atomic<int> copies{0}, registered{0}, events_live{0}, streams_live{0};

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
  *n = env_int("FAKE_CUDART_DEVICES", 1);
  return 0;
}
int cudaGetDevice(int* d) {
  *d = current_device;
  return 0;
}
int cudaSetDevice(int d) {
  if (d < 0 || d >= env_int("FAKE_CUDART_DEVICES", 1)) return 101;  // cudaErrorInvalidDevice
  current_device = d;
  return 0;
}
int cudaHostRegister(void*, size_t, unsigned) {
  if (env_int("FAKE_CUDART_FAIL_REGISTER", 0)) return 2;  // cudaErrorMemoryAllocation
  ++registered;
  return 0;
}
int cudaHostUnregister(void*) {
  --registered;
  return 0;
}
int cudaMemcpyAsync(void* dst, const void* src, size_t n, int, void* stream) {
  int k = ++copies;
  if (k == env_int("FAKE_CUDART_FAIL_COPY", 0)) return 700;  // cudaErrorIllegalAddress
  int delay = env_int("FAKE_CUDART_COPY_DELAY_US", 0);
  S(stream)->push([=] {
    if (delay) std::this_thread::sleep_for(std::chrono::microseconds(delay));
    std::memcpy(dst, src, n);
  });
  return 0;
}
int cudaStreamCreateWithFlags(void** s, unsigned) {
  *s = new Stream();
  ++streams_live;
  return 0;
}
int cudaStreamDestroy(void* s) {
  S(s)->sync();
  --streams_live;  // the worker thread and the object are leaked on purpose
  return 0;
}
int cudaStreamSynchronize(void* s) {
  S(s)->sync();
  return 0;
}
int cudaEventCreateWithFlags(void** e, unsigned) {
  *e = new Event();
  ++events_live;
  return 0;
}
int cudaEventDestroy(void* e) {
  delete static_cast<Event*>(e);
  --events_live;
  return 0;
}
int cudaEventRecord(void* e, void* s) {
  auto* ev = static_cast<Event*>(e);
  unsigned long long gen;
  {
    std::lock_guard<std::mutex> lk(ev->mu);
    gen = ++ev->recorded;
  }
  S(s)->push([ev, gen] {
    {
      std::lock_guard<std::mutex> lk(ev->mu);
      if (ev->completed < gen) ev->completed = gen;
    }
    ev->cv.notify_all();
  });
  return 0;
}
int cudaStreamWaitEvent(void* s, void* e, unsigned) {
  auto* ev = static_cast<Event*>(e);
  unsigned long long gen;
  {
    std::lock_guard<std::mutex> lk(ev->mu);
    gen = ev->recorded;
  }
  S(s)->push([ev, gen] { ev->wait_for(gen); });
  return 0;
}
int cudaEventSynchronize(void* e) {
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
  auto* ev = static_cast<Event*>(e);
  std::lock_guard<std::mutex> lk(ev->mu);
  return ev->completed >= ev->recorded ? 0 : 600;
}
int cudaGetLastError() { return 0; }
const char* cudaGetErrorString(int e) {
  return e == 700 ? "an illegal memory access was encountered (fake)" : e == 0 ? "no error" : "fake CUDA error";
}
const char* cudaGetErrorName(int e) {
  return e == 700 ? "cudaErrorIllegalAddress" : e == 101 ? "cudaErrorInvalidDevice" : "cudaErrorUnknown";
}
int cudaRuntimeGetVersion(int* v) {
  *v = 12040;
  return 0;
}
int cudaDriverGetVersion(int* v) {
  *v = 12040;
  return 0;
}

// For the tests: what the engine did with the runtime.
int fake_cudart_registered() { return registered.load(); }
int fake_cudart_copies() { return copies.load(); }
int fake_cudart_events_live() { return events_live.load(); }
// Queues "sleep delay_us, then memset(p, byte, n)" on a stream: the caller's work
// that a save must wait for.
int fake_cudart_enqueue_fill(void* stream, void* p, int byte, size_t n, int delay_us) {
  S(stream)->push([=] {
    std::this_thread::sleep_for(std::chrono::microseconds(delay_us));
    std::memset(p, byte, n);
  });
  return 0;
}
int fake_cudart_stream_create(void** s) { return cudaStreamCreateWithFlags(s, 1); }

}  // extern "C"
