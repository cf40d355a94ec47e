// The Python boundary. Everything blocking runs with the GIL released; waits
// wake every 50 ms to let Ctrl-C through (PyErr_CheckSignals). Native errors
// become OSError subclasses (errno, path, offset) or flashwrite's
// CorruptCheckpointError.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <Python.h>

#include <algorithm>
#include <chrono>
#include <deque>
#include <cmath>
#include <map>
#include <mutex>
#include <optional>
#include <string_view>
#include <thread>

#include "core/checksum.hpp"
#include "core/defaults.hpp"
#include "core/error.hpp"
#include "io/backend.hpp"
#include "io/files.hpp"
#include "read/snapshot_copy.hpp"
#include "engine/engine.hpp"
#include "shim/cuda.hpp"
#include "write/chunk_plan.hpp"
#include "write/stripe_layout.hpp"
#include "python/state_walk.hpp"
#include "io/remote_files.hpp"

namespace fw {
// Engine.start_save's remote= (nfs_bindings.cpp): None, or an NfsClient.
std::shared_ptr<RemoteFiles> remote_files_of(const pybind11::object& remote);
}

namespace py = pybind11;
using namespace fw;

#ifndef FLASHWRITE_VERSION
#define FLASHWRITE_VERSION "0+unknown"
#endif

namespace {

// Waits in short slices without the GIL, checking for signals in between.
// The time left is kept in double seconds and never converted to a clock
// duration: a timeout of inf, 1e300 or 1e10 s just never runs out (converting
// it to nanoseconds overflows). NaN is refused; negative means poll once.
template <typename F>
bool wait_interruptible(F&& wait_for, std::optional<double> timeout) {
  if (timeout && std::isnan(*timeout)) throw py::value_error("timeout must be a number of seconds or None, not NaN");
  using clock = std::chrono::steady_clock;
  const auto start = clock::now();
  auto left = [&] { return *timeout - std::chrono::duration<double>(clock::now() - start).count(); };
  for (;;) {
    double slice = defaults::kWaitSliceS;
    if (timeout) slice = std::max(0.0, std::min(slice, left()));
    bool ok;
    {
      py::gil_scoped_release nogil;
      ok = wait_for(slice);
    }
    if (ok) return true;
    if (PyErr_CheckSignals() != 0) throw py::error_already_set();
    if (timeout && left() <= 0) return false;
  }
}

std::string buffer_bytes(const py::object& o) {
  py::buffer_info bi = py::buffer(o).request();
  return std::string(static_cast<const char*>(bi.ptr), static_cast<size_t>(bi.size * bi.itemsize));
}

struct PySaveJob {
  std::unique_ptr<SaveJob> job;
  py::object keepalive;  // owners of the segment sources; dropped once staged

  ~PySaveJob() {
    py::gil_scoped_release nogil;  // joining worker threads never needs the GIL
    job.reset();
  }
};

struct PyLoadJob {
  std::unique_ptr<LoadJob> job;
  ~PyLoadJob() {
    py::gil_scoped_release nogil;
    job.reset();
  }
};

// Segments: (address, nbytes, file, offset[, device]); device -1 = host memory.
std::vector<Segment> parse_segments(const py::sequence& segments, std::vector<int>& devices) {
  std::vector<Segment> segs;
  segs.reserve(py::len(segments));
  for (py::handle h : segments) {
    if (!py::isinstance<py::tuple>(h)) throw py::type_error("a segment is a tuple (address, nbytes, file, offset[, device])");
    auto t = py::reinterpret_borrow<py::tuple>(h);
    if (t.size() != 4 && t.size() != 5) throw py::value_error("a segment is (address, nbytes, file, offset[, device])");
    Segment sg{reinterpret_cast<const char*>(t[0].cast<uintptr_t>()), t[1].cast<uint64_t>(), t[2].cast<uint32_t>(),
               t[3].cast<uint64_t>()};
    if (t.size() == 5) sg.device = t[4].cast<int32_t>();
    if (sg.device >= 0 && std::find(devices.begin(), devices.end(), sg.device) == devices.end())
      devices.push_back(sg.device);
    segs.push_back(sg);
  }
  return segs;
}

// Host-memory segments straight from a plan's columns, with no tuple per tensor:
// (file, members, offsets, ptrs, nbytes) per file; member k is tensor members[k],
// at offsets[k] in the file, at address ptrs[j] with nbytes[j] bytes (empty ones skipped).
void append_host_segments(const py::sequence& host_files, std::vector<Segment>& segs) {
  auto u64 = [](PyObject* list, Py_ssize_t i, const char* what) {
    if (i < 0 || i >= PyList_GET_SIZE(list))
      throw py::index_error(std::string("host_files: ") + what + " out of range");
    unsigned long long v = PyLong_AsUnsignedLongLong(PyList_GET_ITEM(list, i));
    if (v == static_cast<unsigned long long>(-1) && PyErr_Occurred()) throw py::error_already_set();
    return static_cast<uint64_t>(v);
  };
  for (py::handle h : host_files) {
    auto t = py::reinterpret_borrow<py::tuple>(h);
    if (t.size() != 5) throw py::value_error("a host file is (file, members, offsets, ptrs, nbytes)");
    const uint32_t file = t[0].cast<uint32_t>();
    PyObject* members = t[1].ptr();
    PyObject* offsets = t[2].ptr();
    PyObject* ptrs = t[3].ptr();
    PyObject* nbytes = t[4].ptr();
    for (PyObject* l : {members, offsets, ptrs, nbytes})
      if (!PyList_Check(l)) throw py::type_error("host_files: members, offsets, ptrs and nbytes are lists");
    if (PyList_GET_SIZE(members) != PyList_GET_SIZE(offsets)) throw py::value_error("host_files: members != offsets");
    for (Py_ssize_t k = 0; k < PyList_GET_SIZE(members); ++k) {
      const auto j = static_cast<Py_ssize_t>(u64(members, k, "member"));
      const uint64_t n = u64(nbytes, j, "member");
      if (!n) continue;
      const uint64_t addr = u64(ptrs, j, "member");
      if (!addr) throw py::value_error("host_files: a tensor with bytes has no address");
      segs.push_back(Segment{reinterpret_cast<const char*>(addr), n, file, u64(offsets, k, "offset")});
    }
  }
}

// Engine.start_save's arguments, parsed with the GIL held.
std::unique_ptr<PySaveJob> start_save(Engine& eng, const std::vector<std::tuple<std::string, py::object, uint64_t>>& files,
                                      const py::sequence& segments, py::object keepalive, const std::string& backend,
                                      unsigned queue_depth, unsigned copy_threads, bool direct, const GivenStreams& streams,
                                      bool hold_slots, const py::sequence& host_files, const py::object& remote) {
  std::vector<FileSpec> fs;
  for (auto& [path, header, size] : files) fs.push_back(FileSpec{path, buffer_bytes(header), size});
  std::vector<int> devices;
  std::vector<Segment> segs = parse_segments(segments, devices);
  append_host_segments(host_files, segs);
  SaveOptions opt;
  opt.backend = parse_backend(backend);
  opt.queue_depth = queue_depth;
  opt.copy_threads = copy_threads;
  opt.direct = direct;
  opt.hold_slots = hold_slots;
  opt.remote = remote_files_of(remote);
  auto out = std::make_unique<PySaveJob>();
  out->keepalive = std::move(keepalive);
  py::gil_scoped_release nogil;
  out->job = eng.start_save(std::move(fs), std::move(segs), std::move(opt), devices, streams);
  return out;
}

py::dict defaults_dict() {
  py::dict d;
  d["stripes"] = defaults::kStripes;
  d["chunk_bytes"] = defaults::kChunkBytes;
  d["write_queue_depth"] = defaults::kWriteQueueDepth;
  d["read_queue_depth"] = defaults::kReadQueueDepth;
  d["read_chunk_bytes"] = defaults::kReadChunkBytes;
  d["copy_threads"] = defaults::kCopyThreads;
  d["verify_threads"] = defaults::kVerifyThreads;
  d["d2h_batches_in_flight"] = defaults::kD2hBatchesInFlight;
  d["bounce_min_slots"] = defaults::kBounceMinSlots;
  d["bounce_extra_slots"] = defaults::kBounceExtraSlots;
  d["gather_tensor_bytes"] = defaults::kGatherTensorBytes;
  d["gather_run_bytes"] = defaults::kGatherRunBytes;
  return d;
}

py::dict save_stats(const SaveJob& j) {
  SaveStats s = j.stats();
  py::dict d;
  d["bytes_total"] = s.bytes_total;
  d["bytes_written"] = s.bytes_written;
  d["staged_s"] = s.staged_s;
  d["done_s"] = s.done_s;
  d["backend"] = s.backend;
  d["files_direct"] = s.files_direct;
  d["files_buffered"] = s.files_buffered;
  d["device_bytes"] = s.device_bytes;
  d["pin_s"] = s.pin_s;
  return d;
}

// initialize=false: what can be said without initialising CUDA (cuda::locate()):
// then, unless CUDA was initialised already, "available" is None (a runtime was
// found, whether it sees a GPU is unknown) and "device_count" None.
py::dict cuda_info(bool initialize) {
  const auto& rt = initialize ? cuda::runtime() : cuda::locate();
  py::dict d;
  const bool unknown = !rt.initialized && rt.available;
  d["available"] = unknown ? py::none() : py::object(py::bool_(rt.available));
  d["reason"] = unknown ? py::object(py::str("a CUDA runtime was found but not initialised (asked without initialising "
                                              "CUDA, so that processes forked later can still use it)"))
                : rt.available ? py::none()
                               : py::object(py::str(rt.reason));
  d["initialized"] = rt.initialized;
  d["skipped"] = rt.skipped.empty() ? py::none() : py::object(py::str(rt.skipped));
  d["library"] = rt.library.empty() ? py::none() : py::object(py::str(rt.library));
  d["via"] = rt.via.empty() ? py::none() : py::object(py::str(rt.via));
  d["device_count"] = unknown ? py::none() : py::object(py::int_(rt.device_count));
  d["runtime_version"] = rt.runtime_version;
  d["driver_version"] = rt.driver_version;
  return d;
}

}  // namespace

namespace fw {
void register_nfs(py::module_& m);  // nfs_bindings.cpp
}

PYBIND11_MODULE(_core, m) {
  m.doc() = "flashwrite native engine: staging pool, io_uring / thread-pool I/O, checksums";
  m.attr("__version__") = FLASHWRITE_VERSION;
  m.attr("CHECKSUM_ALGORITHM") = kChecksumAlgorithm;
  m.attr("ALIGN") = kAlign;
  m.attr("DEFAULTS") = defaults_dict();

  py::register_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const IoError& e) {
      py::object exc = py::reinterpret_steal<py::object>(
          PyObject_CallFunction(PyExc_OSError, "isO", e.err(), e.detail().c_str(),
                                e.path().empty() ? Py_None : py::str(e.path()).ptr()));
      if (!exc) return;  // error already set
      exc.attr("offset") = e.offset() >= 0 ? py::object(py::int_(e.offset())) : py::none();
      exc.attr("op") = e.op();
      PyErr_SetObject(reinterpret_cast<PyObject*>(Py_TYPE(exc.ptr())), exc.ptr());
    } catch (const FormatError& e) {
      py::object cls = py::module_::import("flashwrite.errors").attr("CorruptCheckpointError");
      PyErr_SetString(cls.ptr(), e.what());
    }
  });

  py::class_<AlignedBuffer, std::shared_ptr<AlignedBuffer>>(m, "Buffer", py::buffer_protocol(),
                                                            "Page-aligned host memory filled by a load")
      .def_buffer([](AlignedBuffer& b) {
        return py::buffer_info(b.data(), 1, py::format_descriptor<uint8_t>::format(), 1, {b.size()}, {1}, false);
      })
      .def("__len__", &AlignedBuffer::size)
      .def_property_readonly("address", [](const AlignedBuffer& b) { return reinterpret_cast<uintptr_t>(b.data()); });

  py::class_<PySaveJob>(m, "SaveJob")
      .def("wait_staged",
           [](PySaveJob& s, std::optional<double> timeout) {
             return wait_interruptible([&](double t) { return s.job->wait_staged(t); }, timeout);
           },
           py::arg("timeout") = py::none(), "Wait (GIL released, interruptible) until every byte is staged.")
      .def("wait",
           [](PySaveJob& s, std::optional<double> timeout) {
             return wait_interruptible([&](double t) { return s.job->wait_done(t); }, timeout);
           },
           py::arg("timeout") = py::none(), "Wait until written and fsync'd (or failed).")
      .def("release_sources", [](PySaveJob& s) { s.keepalive = py::none(); },
           "Drop the references that kept the source tensors alive; call once staged.")
      .def("cancel", [](PySaveJob& s) { s.job->cancel(); })
      .def_property_readonly("staged", [](const PySaveJob& s) { return s.job->staged(); })
      .def_property_readonly("done", [](const PySaveJob& s) { return s.job->done(); })
      .def_property_readonly("failed", [](const PySaveJob& s) { return s.job->failed(); })
      .def("rethrow", [](const PySaveJob& s) { s.job->rethrow(); })
      .def("checksums", [](const PySaveJob& s) { return s.job->checksums(); })
      .def("wait_checksummed",
           [](PySaveJob& s, std::optional<double> timeout) {
             return wait_interruptible([&](double t) { return s.job->wait_checksummed(t); }, timeout);
           },
           py::arg("timeout") = py::none(),
           "Wait until every chunk is staged and checksummed, or the job ended; see `checksummed`.")
      .def_property_readonly("checksummed", [](const PySaveJob& s) { return s.job->checksummed(); })
      .def_property_readonly("holds_slots", [](const PySaveJob& s) { return s.job->holds_slots(); })
      .def_property_readonly("pool_wait_s", [](const PySaveJob& s) { return s.job->pool_wait_s(); })
      .def("chunk_slots",
           [](const PySaveJob& s) {
             std::vector<std::tuple<uint32_t, uint64_t, uint64_t, int64_t>> out;
             for (auto& c : s.job->chunk_slots()) out.emplace_back(c.file, c.file_offset, c.data_len, c.pool_offset);
             return out;
           },
           "[(stripe, offset in it, bytes, offset of its slot in the pool file or -1)] per chunk (held saves).")
      .def("release_slots",
           [](PySaveJob& s) {
             py::gil_scoped_release nogil;
             s.job->release_slots();
           },
           "Give a held save's slots back to the pool (after the job is done).")
      .def("progress", [](const PySaveJob& s) { return std::make_pair(s.job->bytes_written(), s.job->bytes_total()); })
      .def("stats", [](const PySaveJob& s) { return save_stats(*s.job); });

  py::class_<Engine>(m, "Engine")
      .def(py::init<uint64_t, uint64_t>(), py::arg("chunk_bytes"), py::arg("max_staging_bytes") = 0)
      .def("start_save", &start_save, py::arg("files"), py::arg("segments"), py::arg("keepalive"),
           py::arg("backend") = "auto", py::arg("queue_depth") = defaults::kWriteQueueDepth,
           py::arg("copy_threads") = defaults::kCopyThreads,
           py::arg("direct") = true, py::arg("streams") = std::vector<std::pair<int, uintptr_t>>{},
           py::arg("hold_slots") = false, py::arg("host_files") = py::list(), py::arg("remote") = py::none(),
           "Open the stripes and start staging + writing. files: [(path, header, size)], segments: "
           "[(address, nbytes, file, offset[, device])] with device -1 for host memory; host_files: more "
           "host-memory segments as columns, [(file, members, offsets, ptrs, nbytes)] (member k of a file is "
           "tensor members[k] at offsets[k], with ptrs[members[k]] and nbytes[members[k]]); keepalive must own "
           "every address until staged. streams: [(device, cudaStream_t)] the GPU copies are ordered after "
           "(PyTorch's current streams; a device without one uses its legacy default stream). Returns once "
           "that ordering is in place. hold_slots: keep the staged image whole in the pool until "
           "SaveJob.release_slots() (a local snapshot). remote: an NfsClient: the files are paths in its export, "
           "created there and written over its connections straight from the staging slots (nfs://).")
      .def("reserve",
           [](Engine& e, uint64_t bytes, int device) {
             py::gil_scoped_release nogil;
             e.reserve(bytes, device);
           },
           py::arg("nbytes"), py::arg("device") = -1,
           "Allocate and fault in (device >= 0: also page-lock) pool slots for nbytes now (GIL released).")
      .def("set_backing_file", &Engine::set_backing_file, py::arg("path"),
           "Map the pool's slabs from this file from now on (created when the first slab is).")
      .def_property_readonly("file_backed", &Engine::file_backed)
      .def_property_readonly(
          "backing_error",
          [](const Engine& e) {
            std::string err = e.backing_error();
            return err.empty() ? py::none() : py::object(py::str(err));
          },
          "Why the pool's backing file could not grow (the pool then uses private memory), or None.")
      .def_property_readonly("chunk_bytes", &Engine::chunk_bytes)
      .def_property_readonly("pool_bytes", &Engine::pool_bytes)
      .def_property_readonly("max_staging_bytes", &Engine::max_staging_bytes)
      .def_property_readonly("pool_pinned", &Engine::pool_pinned)
      .def_property_readonly(
          "pin_error",
          [](const Engine& e) {
            std::string err = e.pin_error();
            return err.empty() ? py::none() : py::object(py::str(err));
          },
          "Why the pool could not be page-locked, or None.")
      .def("trim", [](Engine& e) {
        py::gil_scoped_release nogil;
        return e.trim();
      });

  py::class_<PyLoadJob>(m, "LoadJob")
      .def("wait",
           [](PyLoadJob& l, std::optional<double> timeout) {
             return wait_interruptible([&](double t) { return l.job->wait(t); }, timeout);
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
      .def_property_readonly("files_direct", [](const PyLoadJob& l) { return l.job->files_direct(); });

  m.def(
      "start_load",
      [](const std::vector<std::pair<std::string, uint64_t>>& files,
         const std::vector<std::tuple<uint32_t, uint64_t, uint64_t, uint64_t>>& pieces, const std::string& backend,
         unsigned queue_depth, uint64_t chunk_bytes, unsigned verify_threads, bool direct,
         const std::vector<std::tuple<uint32_t, uint64_t, uint64_t, int, uintptr_t>>& placements,
         const std::vector<std::pair<int, uintptr_t>>& streams, const py::object& remote) {
        std::vector<ReadFileSpec> fs;
        for (auto& [p, n] : files) fs.push_back(ReadFileSpec{p, n});
        std::vector<VerifyPiece> ps;
        ps.reserve(pieces.size());
        for (auto& [f, off, len, h] : pieces) ps.push_back(VerifyPiece{f, off, len, h});
        LoadOptions opt;
        opt.backend = parse_backend(backend);
        opt.queue_depth = queue_depth;
        opt.chunk_bytes = chunk_bytes;
        opt.verify_threads = verify_threads;
        opt.direct = direct;
        opt.remote = remote_files_of(remote);
        std::vector<Placement> pl;
        for (auto& [f, off, len, dev, ptr] : placements) {
          if (f >= fs.size() || dev < -1 || (len && !ptr))
            throw py::value_error("a placement is (file, offset, nbytes, device >= -1, address)");
          pl.push_back(Placement{f, off, len, dev, reinterpret_cast<char*>(ptr)});
        }
        auto out = std::make_unique<PyLoadJob>();
        py::gil_scoped_release nogil;
        out->job = fw::start_load(std::move(fs), std::move(ps), std::move(opt), std::move(pl), streams);
        return out;
      },
      py::arg("files"), py::arg("pieces"), py::arg("backend") = "auto",
      py::arg("queue_depth") = defaults::kReadQueueDepth, py::arg("chunk_bytes") = defaults::kReadChunkBytes,
      py::arg("verify_threads") = defaults::kVerifyThreads, py::arg("direct") = true,
      py::arg("placements") = std::vector<std::tuple<uint32_t, uint64_t, uint64_t, int, uintptr_t>>{},
      py::arg("streams") = std::vector<std::pair<int, uintptr_t>>{}, py::arg("remote") = py::none(),
      "Read files [(path, size)], verifying [(file, offset, len, xxh3)] pieces. placements: [(file, offset, "
      "nbytes, device, address)] byte ranges copied to GPU memory (device >= 0) or host memory (device -1) "
      "instead, through bounce buffers, each chunk verified before it is copied; the destinations must stay "
      "valid until the job is done. A file wholly covered by placements gets no buffer (None in buffers()), "
      "the others are read whole into aligned buffers. streams: [(device, cudaStream_t)] the GPU copies are "
      "ordered after. remote: (NfsClient, directory on the server): the files are read from there, by "
      "their names (the paths given are local placeholders of the same names, nfs://).");

  m.def(
      "checksum",
      [](py::buffer b) {
        py::buffer_info bi = b.request();
        const void* p = bi.ptr;
        size_t n = static_cast<size_t>(bi.size * bi.itemsize);
        py::gil_scoped_release nogil;
        return checksum(p, n);
      },
      "XXH3-64 of a contiguous buffer (GIL released).");

  m.def(
      "copy_verify",
      [](const std::vector<std::tuple<uintptr_t, uintptr_t, uint64_t, uint64_t>>& pieces, bool verify,
         unsigned threads) {
        std::vector<SnapshotPiece> ps;
        ps.reserve(pieces.size());
        for (auto& [dst, src, len, expected] : pieces)
          ps.push_back(SnapshotPiece{reinterpret_cast<char*>(dst), reinterpret_cast<const char*>(src), len, expected});
        py::gil_scoped_release nogil;
        return copy_verify(ps, verify, threads);
      },
      py::arg("pieces"), py::arg("verify") = true, py::arg("threads") = 1,
      "Copy [(dst, src, len, xxh3)] pieces (dst 0: check src in place) on `threads` threads, each piece "
      "checksummed as it is copied, its pages populated first; returns [(index, actual)] of the pieces that "
      "did not match. The caller keeps every buffer alive for the call (GIL released).");

  m.def(
      "punch_holes",
      [](int fd, std::vector<std::pair<uint64_t, uint64_t>> keep, uint64_t size) {
        py::gil_scoped_release nogil;
        return punch_holes(fd, std::move(keep), size);
      },
      py::arg("fd"), py::arg("keep"), py::arg("size"),
      "Free the pages of fd in [0, size) outside the (offset, nbytes) ranges of `keep` (hole punching); the "
      "bytes freed (GIL released).");

  py::class_<SnapshotMapping, std::shared_ptr<SnapshotMapping>>(m, "SnapshotMapping", py::buffer_protocol(),
      "Page-aligned ranges of a file mapped contiguously, copy-on-write or (shared=True, for a file this process "
      "has taken for itself) shared; the buffer is `size` bytes from `lead` bytes into the first range. It "
      "holds the open file (and a flock on it) while it lives. A private mapping's file must not be written or "
      "truncated meanwhile.")
      .def(py::init([](int fd, const std::vector<std::pair<uint64_t, uint64_t>>& segments, uint64_t lead,
                       uint64_t size, bool shared) {
             py::gil_scoped_release nogil;
             return std::make_shared<SnapshotMapping>(fd, segments, lead, size, shared);
           }),
           py::arg("fd"), py::arg("segments"), py::arg("lead"), py::arg("size"), py::arg("shared") = false)
      .def_property_readonly("address", [](const SnapshotMapping& m) { return reinterpret_cast<uintptr_t>(m.data()); })
      .def_buffer([](SnapshotMapping& m) {
        return py::buffer_info(m.data(), 1, py::format_descriptor<uint8_t>::format(), 1,
                               {static_cast<py::ssize_t>(m.size())}, {static_cast<py::ssize_t>(1)}, false);
      });

  m.def(
      "plan_chunks",
      [](const std::vector<uint64_t>& sizes, const std::vector<std::tuple<uint64_t, uint32_t, uint64_t>>& segs,
         uint64_t chunk_bytes) {
        std::vector<Segment> s;
        for (auto& [n, f, off] : segs) s.push_back(Segment{nullptr, n, f, off});
        ChunkPlan plan = plan_chunks(sizes, s, chunk_bytes);
        py::list chunks;
        for (auto& c : plan.chunks) {
          py::list ps;
          for (uint32_t i = 0; i < c.piece_count; ++i) {
            const Piece& p = plan.pieces[c.first_piece + i];
            ps.append(py::make_tuple(p.segment, p.src_offset, p.chunk_offset, p.len, p.hash_index));
          }
          chunks.append(py::make_tuple(c.file, c.file_offset, c.data_len, c.write_len, c.has_gaps, ps));
        }
        return py::make_tuple(chunks, plan.segment_hash_start);
      },
      "The chunk arithmetic of a save, exposed for tests: ([(file, offset, data_len, write_len, has_gaps, "
      "[(segment, src_offset, chunk_offset, len, hash_index)])], segment_hash_start).");

  m.attr("HEADER_ALIGN") = kHeaderAlign;
  m.attr("MAX_HEADER_BYTES") = kMaxHeaderBytes;
  m.attr("WALK_CPU") = static_cast<long long>(kCpu);
  m.attr("WALK_PARAM") = static_cast<long long>(kParam);
  m.attr("WALK_REQUIRES_GRAD") = static_cast<long long>(kRequiresGrad);
  m.attr("WALK_DENSE") = static_cast<long long>(kDense);
  m.def(
      "walk_state",
      [](py::handle state, py::type tensor, py::type parameter, py::type odict, py::object other, py::object leaf,
         py::object check, bool check_all, int max_depth) {
        WalkTypes types{reinterpret_cast<PyTypeObject*>(tensor.ptr()), reinterpret_cast<PyTypeObject*>(parameter.ptr()),
                        reinterpret_cast<PyTypeObject*>(odict.ptr())};
        WalkResult r = walk_state(state.ptr(), types, std::move(other), std::move(leaf), std::move(check), check_all,
                                  max_depth);
        return py::make_tuple(r.tree, r.tensors, r.keys, r.nodes, r.dtypes, r.shapes, r.ptrs, r.bases, r.nbytes,
                              r.flags, r.used);
      },
      py::arg("state"), py::arg("tensor"), py::arg("parameter"), py::arg("odict"), py::arg("other"), py::arg("leaf"),
      py::arg("check"), py::arg("check_all"), py::arg("max_depth"),
      "flatten.py's tree walk: (tree, tensors, keys, nodes, dtypes, shapes, ptrs, bases, nbytes, flags, used keys), "
      "one column entry per tensor met. See csrc/python/state_walk.hpp.");

  m.def(
      "layout_stripes",
      [](const py::list& keys, const py::list& dtypes, const py::list& shapes, const py::list& nbytes,
         const py::dict& dtype_codes, const std::vector<std::string>& names, const std::string& metadata_json,
         const py::object& quote) {
        const size_t n = keys.size();
        if (dtypes.size() != n || shapes.size() != n || nbytes.size() != n)
          throw py::value_error("layout_stripes: keys, dtypes, shapes and nbytes differ in length");
        std::vector<LayoutTensor> ts(n);
        std::deque<std::string> made;  // strings made here (escaped keys, byte counts): ts views them
        auto utf8 = [](PyObject* o) -> std::optional<std::string_view> {
          Py_ssize_t len = 0;
          const char* p = PyUnicode_Check(o) ? PyUnicode_AsUTF8AndSize(o, &len) : nullptr;
          if (!p) {
            PyErr_Clear();
            return std::nullopt;
          }
          return std::string_view(p, static_cast<size_t>(len));
        };
        for (size_t i = 0; i < n; ++i) {
          LayoutTensor& t = ts[i];
          PyObject* k = PyList_GET_ITEM(keys.ptr(), i);
          auto key = utf8(k);
          bool plain = key.has_value();
          for (size_t c = 0; plain && c < key->size(); ++c) {
            unsigned char ch = static_cast<unsigned char>((*key)[c]);
            plain = ch >= 0x20 && ch < 0x7f && ch != '"' && ch != '\\';
          }
          if (plain) {
            t.key = *key;
          } else {
            t.key = made.emplace_back(quote(py::handle(k)).cast<std::string>());  // json.dumps' escapes
            t.quoted = true;
          }
          PyObject* info = PyDict_GetItemWithError(dtype_codes.ptr(), PyList_GET_ITEM(dtypes.ptr(), i));
          if (!info) {
            if (PyErr_Occurred()) throw py::error_already_set();
            throw py::value_error("layout_stripes: a dtype missing from dtype_codes");
          }
          if (!PyTuple_Check(info) || PyTuple_GET_SIZE(info) != 2)
            throw py::type_error("layout_stripes: dtype_codes values are (code or None, itemsize)");
          PyObject* code = PyTuple_GET_ITEM(info, 0);
          t.nbytes = PyLong_AsUnsignedLongLong(PyList_GET_ITEM(nbytes.ptr(), i));
          t.itemsize = static_cast<unsigned>(PyLong_AsUnsignedLong(PyTuple_GET_ITEM(info, 1)));
          if (PyErr_Occurred()) throw py::error_already_set();
          if (code == Py_None) {  // stored as bytes: U8 of its byte count
            t.code = "U8";
            t.shape = made.emplace_back(std::to_string(t.nbytes));
          } else {
            auto c = utf8(code);
            auto shape = utf8(PyList_GET_ITEM(shapes.ptr(), i));
            if (!c || !shape) throw py::type_error("layout_stripes: codes and shapes are str");
            t.code = *c;
            t.shape = *shape;
          }
        }
        std::vector<LayoutFile> files;
        try {
          files = layout_stripes(ts, names, metadata_json);
        } catch (const std::invalid_argument& e) {
          throw py::value_error(e.what());
        }
        py::list out;
        for (auto& f : files)
          out.append(py::make_tuple(py::bytes(f.header), f.size, py::cast(f.members), py::cast(f.offsets)));
        return out;
      },
      py::arg("keys"), py::arg("dtypes"), py::arg("shapes"), py::arg("nbytes"), py::arg("dtype_codes"),
      py::arg("names"), py::arg("metadata_json"), py::arg("quote"),
      "plan.py's stripe layout, one file per name: [(header, size, members, offsets)]. shapes: as text "
      "(\"4096,1024\"). dtype_codes: {dtype: (safetensors "
      "code or None for bytes, itemsize)}; quote(key) -> the key as a JSON string, for keys that need escapes.");

  m.def("fsync_dir", [](const std::string& p) {
    py::gil_scoped_release nogil;
    fsync_dir(p);
  });
  m.def("rename_exchange", [](const std::string& a, const std::string& b) {
    py::gil_scoped_release nogil;
    return rename_exchange(a, b);
  });
  m.def("probe_direct", [](const std::string& dir) {
    py::gil_scoped_release nogil;
    return probe_direct(dir);
  });
  m.def("io_uring_compiled", &uring_compiled);
  m.def("io_uring_probe", [] { return -uring_probe(); }, "0 when a ring can be set up here, else the errno.");
  m.def("cuda_info", &cuda_info, py::arg("initialize") = true);
  m.def("bounce_pool_bytes", &bounce_pool_bytes, "Bytes of the pinned bounce pool kept for loads to GPUs.");
  m.def(
      "release_bounce_pool",
      [] {
        py::gil_scoped_release nogil;  // unpinning takes time
        return release_bounce_pool();
      },
      "Drop the pinned bounce pool kept for loads to GPUs; returns its bytes.");
  // For tests: the staging pool's page-locking of freshly mapped memory.
  m.def(
      "_cuda_pin",
      [](uintptr_t p, size_t n, int device) {
        py::gil_scoped_release nogil;
        return cuda::pin(reinterpret_cast<void*>(p), n, device);
      },
      py::arg("addr"), py::arg("nbytes"), py::arg("device") = 0);
  register_nfs(m);
}
