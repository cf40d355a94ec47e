// The load side of the boundary: start_load, the LoadJob it returns, the aligned
// Buffers a load fills, and the pinned bounce pool kept for loads to GPUs.
#include <pybind11/stl.h>

#include <memory>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "core/aligned_buffer.hpp"
#include "engine/engine.hpp"
#include "io/backend.hpp"
#include "python/bindings.hpp"
#include "read/owned_memory.hpp"
#include "read/placements.hpp"

namespace fw {
namespace {

struct PyLoadJob {
  py::object keepalive;  // owners of the placements' destinations: dropped only after the job is joined
  std::unique_ptr<LoadJob> job;
  ~PyLoadJob() {
    {
      py::gil_scoped_release nogil;
      job.reset();  // cancels and joins a job still running
    }
    keepalive = py::none();
  }
};

// DLPack's C ABI (dlpack.h, v0.x "dltensor" capsules, which every torch release
// reads): a tensor handed to torch with the deleter that frees its memory, so the
// extension needs no libtorch.
struct DLDevice {
  int32_t device_type;  // 1: kDLCPU
  int32_t device_id;
};
struct DLDataType {
  uint8_t code;  // 1: kDLUInt
  uint8_t bits;
  uint16_t lanes;
};
struct DLTensor {
  void* data;
  DLDevice device;
  int32_t ndim;
  DLDataType dtype;
  int64_t* shape;
  int64_t* strides;
  uint64_t byte_offset;
};
struct DLManagedTensor {
  DLTensor dl_tensor;
  void* manager_ctx;
  void (*deleter)(DLManagedTensor*);
};

struct OwnedTensor {
  DLManagedTensor managed;
  int64_t shape;
  OwnedExtent extent;
};

// May run on any thread, without the GIL (torch frees storages anywhere).
void free_owned(DLManagedTensor* t) {
  auto* o = static_cast<OwnedTensor*>(t->manager_ctx);
  release_extent(o->extent);
  delete o;
}

// A capsule torch has not taken still owns its tensor.
void free_unused_capsule(PyObject* cap) {
  if (!PyCapsule_IsValid(cap, "dltensor")) return;  // renamed "used_dltensor" once torch took it
  auto* t = static_cast<DLManagedTensor*>(PyCapsule_GetPointer(cap, "dltensor"));
  if (t && t->deleter) t->deleter(t);
}

py::object owned_tensor(uint64_t file_offset, uint64_t nbytes) {
  auto o = std::make_unique<OwnedTensor>();
  o->extent = map_extent(file_offset, nbytes);
  o->shape = static_cast<int64_t>(nbytes);
  DLTensor& t = o->managed.dl_tensor;
  t.data = o->extent.data;
  t.device = DLDevice{1, 0};
  t.ndim = 1;
  t.dtype = DLDataType{1, 8, 1};
  t.shape = &o->shape;
  t.strides = nullptr;  // compact
  t.byte_offset = 0;
  o->managed.manager_ctx = o.get();
  o->managed.deleter = free_owned;
  PyObject* cap = PyCapsule_New(&o->managed, "dltensor", free_unused_capsule);
  if (!cap) {
    release_extent(o->extent);
    throw py::error_already_set();
  }
  o.release();
  return py::reinterpret_steal<py::object>(cap);
}

using PyPlacement = std::tuple<uint32_t, uint64_t, uint64_t, int, uintptr_t>;  // (file, offset, nbytes, device, address)

// The arguments are parsed with the GIL held; the files are opened and the job
// started without it.
std::unique_ptr<PyLoadJob> start_load_py(const std::vector<std::pair<std::string, uint64_t>>& files,
                                         const std::vector<std::tuple<uint32_t, uint64_t, uint64_t, uint64_t>>& pieces,
                                         const std::string& backend, unsigned queue_depth, uint64_t chunk_bytes,
                                         unsigned verify_threads, bool direct,
                                         const std::vector<PyPlacement>& placements,
                                         const std::vector<std::pair<int, uintptr_t>>& streams,
                                         const py::object& remote, py::object keepalive,
                                         const std::vector<std::vector<uint64_t>>& frames) {
  std::vector<ReadFileSpec> fs;
  for (auto& [p, n] : files) fs.push_back(ReadFileSpec{p, n});
  std::vector<VerifyPiece> ps;
  ps.reserve(pieces.size());
  for (auto& [f, off, len, h] : pieces) ps.push_back(VerifyPiece{f, off, len, h});
  LoadOptions opt;
  opt.files = job_files_of(remote, backend, direct);
  opt.queue_depth = queue_depth;
  opt.chunk_bytes = chunk_bytes;
  opt.verify_threads = verify_threads;
  opt.frames = frames;
  std::vector<Placement> pl;
  for (auto& [f, off, len, dev, ptr] : placements) {
    if (f >= fs.size() || dev < kDirect || (len && !ptr))
      throw py::value_error("a placement is (file, offset, nbytes, device >= -2, address)");
    if (dev == kDirect && (ptr - off) % kAlign)
      throw py::value_error("a direct placement's address must agree with its file offset modulo 4096");
    pl.push_back(Placement{f, off, len, dev, reinterpret_cast<char*>(ptr)});
  }
  auto out = std::make_unique<PyLoadJob>();
  out->keepalive = std::move(keepalive);
  py::gil_scoped_release nogil;
  out->job = fw::start_load(std::move(fs), std::move(ps), std::move(opt), std::move(pl), streams);
  return out;
}

void register_buffer(py::module_& m) {
  py::class_<AlignedBuffer, std::shared_ptr<AlignedBuffer>>(m, "Buffer", py::buffer_protocol(),
                                                            "Page-aligned host memory filled by a load")
      .def_buffer([](AlignedBuffer& b) {
        return py::buffer_info(b.data(), 1, py::format_descriptor<uint8_t>::format(), 1, {b.size()}, {1}, false);
      })
      .def("__len__", &AlignedBuffer::size)
      .def_property_readonly("address", [](const AlignedBuffer& b) { return reinterpret_cast<uintptr_t>(b.data()); });
}

void register_load_job(py::module_& m) {
  py::class_<PyLoadJob>(m, "LoadJob")
      .def("wait",
           [](PyLoadJob& l, std::optional<double> timeout) {
             // Interrupted: cancel, and raise once no destination is written any more (the
             // reads in flight go to the job's own buffers; keepalive holds the destinations
             // until the job is joined, by whoever holds it last: loading/read.py hands it to
             // a thread that joins it, so the caller need not wait for those reads).
             auto stop = [&l] {
               l.job->cancel();
               l.job->wait_quiet(-1);
             };
             return wait_interruptible([&](double t) { return l.job->wait(t); }, timeout, stop);
           },
           py::arg("timeout") = py::none())
      .def("cancel", [](PyLoadJob& l) { l.job->cancel(); })
      .def("rethrow", [](const PyLoadJob& l) { l.job->rethrow(); })
      .def("buffers", [](const PyLoadJob& l) { return l.job->buffers(); })
      .def("mismatches",
           [](const PyLoadJob& l) {
             std::vector<std::pair<size_t, uint64_t>> out;
             for (auto& mm : l.job->mismatches()) out.emplace_back(mm.piece, mm.actual);
             return out;
           })
      .def_property_readonly("elapsed_s", [](const PyLoadJob& l) { return l.job->elapsed_s(); })
      .def_property_readonly("backend", [](const PyLoadJob& l) { return l.job->backend(); })
      .def_property_readonly("files_direct", [](const PyLoadJob& l) { return l.job->files_direct(); })
      .def_property_readonly("received_uncopied", [](const PyLoadJob& l) { return l.job->received_uncopied(); },
                             "Bytes received from an NFS server straight into their destinations (no copy).");
}

}  // namespace

void register_load(py::module_& m) {
  register_buffer(m);
  register_load_job(m);
  m.def("start_load", &start_load_py, py::arg("files"), py::arg("pieces"), py::arg("backend") = "auto",
        py::arg("queue_depth") = defaults::kReadQueueDepth, py::arg("chunk_bytes") = defaults::kReadChunkBytes,
        py::arg("verify_threads") = defaults::verify_threads(), py::arg("direct") = true,
        py::arg("placements") = std::vector<PyPlacement>{},
        py::arg("streams") = std::vector<std::pair<int, uintptr_t>>{}, py::arg("remote") = py::none(),
        py::arg("keepalive") = py::none(), py::arg("frames") = std::vector<std::vector<uint64_t>>{},
        "Read files [(path, size)], verifying [(file, offset, len, xxh3)] pieces. placements: [(file, offset, "
        "nbytes, device, address)] byte ranges copied to GPU memory (device >= 0) or host memory (device -1) "
        "instead, through bounce buffers, each chunk verified before it is copied, or read straight into host "
        "memory (device -2: owned_tensor's, its edge pages included); the destinations must stay "
        "valid until the job is done. A file wholly covered by placements gets no buffer (None in buffers()), "
        "the others are read whole into aligned buffers. streams: [(device, cudaStream_t)] the GPU copies are "
        "ordered after. remote: None (local files), or (a remote target's client, directory on its "
        "server): the files are read from there, by their names (the paths given are local placeholders of "
        "the same names). keepalive: owners of the "
        "placements' destinations, released only once the job is joined. frames: [] or per file [] (plain) or "
        "each chunk's frame length (0: stored plain), chunk_bytes being the save's: decoded before verifying.");
  m.def("owned_tensor", &owned_tensor, py::arg("file_offset"), py::arg("nbytes"),
        "A DLPack capsule (torch.from_dlpack) of nbytes uint8 of fresh memory that owns itself, placed as file "
        "byte file_offset is in its page, for a direct placement (device -2) of those bytes: the load reads "
        "them there with O_DIRECT. Freed with the tensor torch makes of it.");
  m.def(
      "bounce_pool_bytes",
      [] {
        py::gil_scoped_release nogil;  // a load may hold the pool's lock while it makes the pool
        return bounce_pool_bytes();
      },
      "Bytes of the pinned bounce pool kept for loads to GPUs.");
  m.def(
      "release_bounce_pool",
      [] {
        py::gil_scoped_release nogil;  // unpinning takes time
        return release_bounce_pool();
      },
      "Drop the pinned bounce pool kept for loads to GPUs; returns its bytes.");
}

}  // namespace fw
