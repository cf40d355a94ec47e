#include "stage/device_copy.hpp"

#include <algorithm>
#include <stdexcept>

namespace fw {

using namespace cuda;

// ---------------------------------------------------------------- CopyStreams

CopyStreams::~CopyStreams() {
  const Runtime& rt = runtime();
  if (!rt.available) return;
  // Errors are ignored: at interpreter exit the runtime may already be unloading.
  for (auto& [dev, d] : devices_) {
    try {
      on_device_thread(dev, [&, &d = d] {
        for (cudaEvent_t ev : d.events) rt.EventDestroy(ev);
        if (d.stream) {
          rt.StreamSynchronize(d.stream);
          rt.StreamDestroy(d.stream);
        }
        rt.GetLastError();
      });
    } catch (...) {
    }
  }
}

cudaStream_t CopyStreams::stream(int device) {
  const Runtime& rt = require("a GPU copy");
  use_device(device);
  std::lock_guard<std::mutex> lk(mu_);
  Device& d = devices_[device];
  if (!d.stream) check(rt.StreamCreateWithFlags(&d.stream, cudaStreamNonBlocking), "cudaStreamCreateWithFlags",
                       "cuda:" + std::to_string(device));
  return d.stream;
}

cudaEvent_t CopyStreams::take_event(int device) {
  const Runtime& rt = require("a GPU copy");
  use_device(device);
  {
    std::lock_guard<std::mutex> lk(mu_);
    auto& evs = devices_[device].events;
    if (!evs.empty()) {
      cudaEvent_t ev = evs.back();
      evs.pop_back();
      return ev;
    }
  }
  cudaEvent_t ev = nullptr;
  check(rt.EventCreateWithFlags(&ev, cudaEventBlockingSync | cudaEventDisableTiming), "cudaEventCreateWithFlags",
        "cuda:" + std::to_string(device));
  return ev;
}

void CopyStreams::give_event(int device, cudaEvent_t ev) {
  std::lock_guard<std::mutex> lk(mu_);
  devices_[device].events.push_back(ev);
}

// --------------------------------------------------------------- CopyPipeline

CopyPipeline::CopyPipeline(std::shared_ptr<CopyStreams> streams, CopyDirection dir, size_t max_pending)
    : streams_(std::move(streams)),
      kind_(dir == CopyDirection::DeviceToHost ? cudaMemcpyDeviceToHost : cudaMemcpyHostToDevice),
      max_pending_(std::max<size_t>(1, max_pending)) {
  thread_ = std::thread([this] { land(); });
}

CopyPipeline::~CopyPipeline() {
  try {
    finish();
  } catch (...) {
  }
}

void CopyPipeline::fail(std::exception_ptr e) {
  std::lock_guard<std::mutex> lk(mu_);
  if (!error_) error_ = e;
}

bool CopyPipeline::failed() const {
  std::lock_guard<std::mutex> lk(mu_);
  return static_cast<bool>(error_);
}

void CopyPipeline::order_after(const std::vector<StreamRef>& callers) {
  const Runtime& rt = require("ordering GPU copies");
  for (const StreamRef& c : callers) {
    std::string where = "cuda:" + std::to_string(c.device);
    cudaStream_t ours = streams_->stream(c.device);
    cudaEvent_t ev = streams_->take_event(c.device);
    auto* theirs = reinterpret_cast<cudaStream_t>(c.handle);
    cudaError_t e = rt.EventRecord(ev, theirs);
    if (e == cudaSuccess) e = rt.StreamWaitEvent(ours, ev, 0);
    // The wait captured the event's state: the event can be reused right away.
    streams_->give_event(c.device, ev);
    check(e, "ordering the copy stream after the caller's stream", where);
  }
}

void CopyPipeline::order_before(const std::vector<StreamRef>& callers) {
  const Runtime& rt = require("ordering the caller's stream after GPU copies");
  std::lock_guard<std::mutex> issue_lk(issue_mu_);  // after every batch issued so far
  for (const StreamRef& c : callers) {
    cudaStream_t ours = streams_->stream(c.device);
    cudaEvent_t ev = streams_->take_event(c.device);
    cudaError_t e = rt.EventRecord(ev, ours);
    if (e == cudaSuccess) e = rt.StreamWaitEvent(reinterpret_cast<cudaStream_t>(c.handle), ev, 0);
    streams_->give_event(c.device, ev);
    check(e, "ordering the caller's stream after the snapshot's copies", "cuda:" + std::to_string(c.device));
  }
}

std::vector<DeviceCopy> coalesce(const std::vector<DeviceCopy>& copies) {
  std::vector<DeviceCopy> out;
  out.reserve(copies.size());
  for (const DeviceCopy& c : copies) {
    if (!out.empty()) {
      DeviceCopy& b = out.back();
      if (b.device == c.device && static_cast<char*>(b.dst) + b.len == c.dst &&
          static_cast<const char*>(b.src) + b.len == c.src) {
        b.len += c.len;
        continue;
      }
    }
    out.push_back(c);
  }
  return out;
}

void check_not_capturing(const std::vector<StreamRef>& callers, const char* what) {
  for (const StreamRef& c : callers) {
    int st = capture_status(c.device, reinterpret_cast<cudaStream_t>(c.handle));
    if (st != cudaStreamCaptureStatusNone)
      throw std::runtime_error(std::string(what) + " while the current stream of cuda:" + std::to_string(c.device) +
                               (st == cudaStreamCaptureStatusInvalidated ? " is in an invalidated CUDA graph capture"
                                                                         : " is being captured into a CUDA graph") +
                               ": flashwrite's copies would become part of the graph. Save or load outside "
                               "torch.cuda.graph() (or the stream capture), e.g. before or after it.");
  }
}

bool CopyPipeline::issue(const std::vector<DeviceCopy>& given, Landed landed) {
  const std::vector<DeviceCopy> copies = coalesce(given);
  std::lock_guard<std::mutex> issue_lk(issue_mu_);
  {
    std::unique_lock<std::mutex> lk(mu_);
    cv_.wait(lk, [&] { return queue_.size() < max_pending_; });
  }
  Batch b;
  b.landed = std::move(landed);
  std::vector<int> devices;
  try {
    const Runtime& rt = require("a GPU copy");
    for (const DeviceCopy& c : copies) {
      if (std::find(devices.begin(), devices.end(), c.device) == devices.end()) devices.push_back(c.device);
      cudaStream_t s = streams_->stream(c.device);
      cudaError_t e = rt.MemcpyAsync(c.dst, c.src, c.len, kind_, s);
      if (e != cudaSuccess)
        throw CudaError(e, std::string("cudaMemcpyAsync ") + (kind_ == cudaMemcpyDeviceToHost ? "device-to-host" : "host-to-device") +
                               " of " + std::to_string(c.len) + " bytes on cuda:" + std::to_string(c.device));
    }
  } catch (...) {
    fail(std::current_exception());
    b.ok = false;
  }
  // Whatever was issued must be waited for before the host memory is reused.
  for (int dev : devices) {
    cudaEvent_t ev = nullptr;
    try {
      ev = streams_->take_event(dev);
      check(runtime().EventRecord(ev, streams_->stream(dev)), "cudaEventRecord", "cuda:" + std::to_string(dev));
    } catch (...) {
      if (ev) streams_->give_event(dev, ev);
      ev = nullptr;  // the landing thread synchronizes the whole stream instead
      fail(std::current_exception());
      b.ok = false;
    }
    b.events.emplace_back(dev, ev);
  }
  bool ok = b.ok;
  {
    std::lock_guard<std::mutex> lk(mu_);
    queue_.push_back(std::move(b));
  }
  cv_.notify_all();
  return ok;
}

void CopyPipeline::land() {
  for (;;) {
    Batch b;
    {
      std::unique_lock<std::mutex> lk(mu_);
      cv_.wait(lk, [&] { return closed_ || !queue_.empty(); });
      if (queue_.empty()) return;
      b = std::move(queue_.front());
    }
    const Runtime& rt = runtime();
    for (auto& [dev, ev] : b.events) {
      // Nothing may leave this thread: a throw here (stream() when a batch
      // carries no event, give_event's allocation) would terminate the process.
      try {
        cudaError_t e;
        std::string what;
        try {
          use_device(dev);  // never let this thread fall back to device 0's context
        } catch (...) {
        }
        if (ev) {
          e = rt.EventSynchronize(ev);
          what = "cudaEventSynchronize";
          cudaEvent_t done = ev;
          ev = nullptr;
          streams_->give_event(dev, done);
        } else {
          e = rt.StreamSynchronize(streams_->stream(dev));
          what = "cudaStreamSynchronize";
        }
        if (e != cudaSuccess) throw CudaError(e, what + " after copies on cuda:" + std::to_string(dev));
      } catch (...) {
        fail(std::current_exception());
        b.ok = false;
      }
    }
    b.landed(b.ok);
    {
      std::lock_guard<std::mutex> lk(mu_);
      queue_.pop_front();  // only now: finish() must not return before the callback ran
    }
    cv_.notify_all();
  }
}

void CopyPipeline::finish() {
  {
    std::lock_guard<std::mutex> lk(mu_);
    closed_ = true;
  }
  cv_.notify_all();
  if (thread_.joinable()) thread_.join();
  std::lock_guard<std::mutex> lk(mu_);
  if (error_) std::rethrow_exception(error_);
}

// ------------------------------------------------------------------- pinning

PinHooks cuda_pin_hooks(int device, std::shared_ptr<PinError> error) {
  PinHooks h;
  h.pin = [device, error](void* p, size_t n) {
    std::string e = pin(p, n, device);
    if (!e.empty() && error) error->set_if_empty(e);
    return e.empty();
  };
  h.unpin = [device](void* p) { unpin(p, device); };
  return h;
}

}  // namespace fw
