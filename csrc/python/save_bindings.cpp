// The save side of the boundary: Engine (the staging pool that outlives one save)
// and the SaveJob it starts. start_save parses its arguments with the GIL held,
// then opens the stripes and starts the job without it.
#include <pybind11/stl.h>

#include <algorithm>
#include <memory>
#include <string>
#include <tuple>
#include <vector>

#include "engine/engine.hpp"
#include "io/backend.hpp"
#include "python/bindings.hpp"

namespace fw {
namespace {

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

// Engine::start_save on a thread of its own while the caller waits for it in
// slices without the GIL: a first save may fault in (and pin) its slab of the
// pool for seconds, and Ctrl-C must land meanwhile. Interrupted, the start is
// aborted (the pool gives the slab up) and joined, and a job it made anyway is
// cancelled and joined, before KeyboardInterrupt leaves.
std::unique_ptr<SaveJob> start_interruptible(Engine& eng, std::vector<FileSpec> fs, std::vector<Segment> segs,
                                             SaveOptions opt, const std::vector<int>& devices,
                                             const GivenStreams& streams) {
  auto abort = std::make_shared<std::atomic<bool>>(false);
  opt.abort = abort;
  std::mutex mu;
  std::condition_variable cv;
  bool over = false;
  std::unique_ptr<SaveJob> job;
  std::exception_ptr error;
  std::thread starter;
  {
    py::gil_scoped_release nogil;
    starter = std::thread([&] {
      try {
        job = eng.start_save(std::move(fs), std::move(segs), std::move(opt), devices, streams);
      } catch (...) {
        error = std::current_exception();
      }
      std::lock_guard<std::mutex> lk(mu);
      over = true;
      cv.notify_all();
    });
  }
  auto started = [&](double t) {
    std::unique_lock<std::mutex> lk(mu);
    return cv.wait_for(lk, std::chrono::duration<double>(t), [&] { return over; });
  };
  auto stop = [&] {
    abort->store(true);
    starter.join();
    job.reset();  // cancels and joins a job that started all the same
  };
  wait_interruptible(started, std::nullopt, stop);  // raises (after stop) when interrupted
  {
    py::gil_scoped_release nogil;
    starter.join();
  }
  if (error) std::rethrow_exception(error);
  return job;
}

// A held file: (index into files, the base stripe to link from, [(offset, len, checksum)]).
using HeldSpec = std::tuple<size_t, std::string, std::vector<std::tuple<uint64_t, uint64_t, uint64_t>>>;

// Per file: (offset, element width) runs for a compressed file, or none.
using PlaneRuns = std::vector<std::pair<uint64_t, unsigned>>;

// Engine.start_save's arguments, parsed with the GIL held.
std::unique_ptr<PySaveJob> start_save(Engine& eng, const std::vector<std::tuple<std::string, py::object, uint64_t>>& files,
                                      const py::sequence& segments, py::object keepalive, const std::string& backend,
                                      unsigned queue_depth, unsigned copy_threads, bool direct, const GivenStreams& streams,
                                      bool hold_slots, const py::sequence& host_files, const py::object& remote,
                                      const std::vector<HeldSpec>& held, const std::vector<PlaneRuns>& planes,
                                      int compress_level, bool hash_while_copying) {
  std::vector<FileSpec> fs;
  for (auto& [path, header, size] : files) fs.push_back(FileSpec{path, buffer_bytes(header), size});
  if (!planes.empty() && planes.size() != fs.size()) throw py::value_error("planes: one list per file");
  for (size_t f = 0; f < planes.size(); ++f) {
    for (size_t i = 0; i < planes[f].size(); ++i) {
      const auto& [off, width] = planes[f][i];
      if (width != 1 && width != 2 && width != 4 && width != 8) throw py::value_error("planes: width must be 1, 2, 4 or 8");
      if (off > fs[f].size || (i && off < planes[f][i - 1].first)) throw py::value_error("planes: offsets out of order");
    }
    fs[f].planes = planes[f];
  }
  for (auto& [file, link_from, expected] : held) {
    if (file >= fs.size()) throw py::index_error("held: no such file");
    if (link_from.empty()) throw py::value_error("held: a held file needs the path of its base stripe");
    fs[file].link_from = link_from;
    for (auto& [off, len, sum] : expected) fs[file].expected.push_back(ExpectedPiece{off, len, sum});
  }
  std::vector<int> devices;
  std::vector<Segment> segs = parse_segments(segments, devices);
  append_host_segments(host_files, segs);
  SaveOptions opt;
  opt.files = job_files_of(remote, backend, direct);
  opt.queue_depth = queue_depth;
  opt.copy_threads = copy_threads;
  opt.hold_slots = hold_slots;
  opt.compress_level = compress_level;
  opt.hash_while_copying = hash_while_copying;
  auto out = std::make_unique<PySaveJob>();
  out->keepalive = std::move(keepalive);
  out->job = start_interruptible(eng, std::move(fs), std::move(segs), std::move(opt), devices, streams);
  return out;
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
  d["staging_wait_s"] = s.staging_wait_s;
  d["staging_wait_reason"] = s.staging_wait_reason;
  d["unpinned_bytes"] = s.unpinned_bytes;
  d["rewrites"] = s.rewrites;
  d["bytes_sent_uncopied"] = s.bytes_sent_uncopied;
  d["bytes_stored"] = s.bytes_stored;
  d["compress_s"] = s.compress_s;
  return d;
}

// The pool's getters take its lock, which a reserve() holds while it faults in a
// new slab (seconds for GiBs): they wait for it without the GIL.
template <typename R, typename... A>
auto without_gil(R (Engine::*get)(A...) const) {
  return [get](const Engine& e, A... a) {
    py::gil_scoped_release nogil;
    return (e.*get)(a...);
  };
}
template <typename R, typename... A>
auto without_gil(R (Engine::*call)(A...)) {
  return [call](Engine& e, A... a) {
    py::gil_scoped_release nogil;
    return (e.*call)(a...);
  };
}
// A reason, or None when there is none (also read without the GIL).
auto none_if_empty(std::string (Engine::*get)() const) {
  return [get](const Engine& e) {
    std::string s;
    {
      py::gil_scoped_release nogil;
      s = (e.*get)();
    }
    return s.empty() ? py::none() : py::object(py::str(s));
  };
}

// What an interrupted wait does before it raises: the save is abandoned (cancelled).
// Its writes in flight come from the pool's slots and its sources stay alive
// (keepalive) until the job is joined, so it need not be joined here: whoever
// holds it last joins it (~PySaveJob), and future.SaveFuture.start hands an
// interrupted save to a thread that joins it and then removes what it wrote.
auto stop(PySaveJob& s) {
  return [&s] { s.job->cancel(); };
}

}  // namespace

void register_save(py::module_& m) {
  py::class_<PySaveJob>(m, "SaveJob")
      .def("wait_staged",
           [](PySaveJob& s, std::optional<double> timeout) {
             return wait_interruptible([&](double t) { return s.job->wait_staged(t); }, timeout, stop(s));
           },
           py::arg("timeout") = py::none(), "Wait (GIL released, interruptible) until every byte is staged.")
      .def("wait",
           [](PySaveJob& s, std::optional<double> timeout) {
             return wait_interruptible([&](double t) { return s.job->wait_done(t); }, timeout, stop(s));
           },
           py::arg("timeout") = py::none(), "Wait until written and fsync'd (or failed).")
      .def("release_sources", [](PySaveJob& s) { s.keepalive = py::none(); },
           "Drop the references that kept the source tensors alive; call once staged.")
      .def("cancel",
           [](PySaveJob& s) {
             py::gil_scoped_release nogil;  // it wakes the pool's waiters under the pool's lock
             s.job->cancel();
           })
      .def_property_readonly("staged", [](const PySaveJob& s) { return s.job->staged(); })
      .def_property_readonly("done", [](const PySaveJob& s) { return s.job->done(); })
      .def_property_readonly("failed", [](const PySaveJob& s) { return s.job->failed(); })
      .def("rethrow", [](const PySaveJob& s) { s.job->rethrow(); })
      .def("checksums", [](const PySaveJob& s) { return s.job->checksums(); })
      .def("wait_checksummed",
           [](PySaveJob& s, std::optional<double> timeout) {
             return wait_interruptible([&](double t) { return s.job->wait_checksummed(t); }, timeout, stop(s));
           },
           py::arg("timeout") = py::none(),
           "Wait until every chunk is staged and checksummed, or the job ended; see `checksummed`.")
      .def_property_readonly("checksummed", [](const PySaveJob& s) { return s.job->checksummed(); })
      .def_property_readonly("holds_slots", [](const PySaveJob& s) { return s.job->holds_slots(); })
      .def_property_readonly("pool_wait_s", [](const PySaveJob& s) { return s.job->pool_wait_s(); })
      .def("chunk_slots",
           [](const PySaveJob& s) {
             std::vector<std::tuple<uint32_t, uint64_t, uint64_t, int64_t>> out;
             py::gil_scoped_release nogil;  // each slot's offset takes the pool's lock
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
      .def("held_results",
           [](const PySaveJob& s) {
             std::vector<std::pair<int, int>> out;
             for (auto& r : s.job->held_results()) out.emplace_back(static_cast<int>(r.outcome), r.err);
             return out;
           },
           "[(outcome, errno)] per file: 0 not held, 1 linked, 2 changed (written), 3 link refused "
           "(written; errno), 4 pool too small to hold (written), 5 undecided (the job failed). "
           "Final once checksummed.")
      .def("chunk_frames", [](const PySaveJob& s) { return s.job->chunk_frames(); },
           "Per file, per chunk in file order: its frame's length, 0 where written as staged. Final once done.")
      .def("progress", [](const PySaveJob& s) { return std::make_pair(s.job->bytes_done(), s.job->bytes_total()); })
      .def("stats", [](const PySaveJob& s) { return save_stats(*s.job); });
}

void register_engine(py::module_& m) {
  py::class_<Engine>(m, "Engine")
      .def(py::init<uint64_t, uint64_t>(), py::arg("chunk_bytes"), py::arg("max_staging_bytes") = 0)
      .def("start_save", &start_save, py::arg("files"), py::arg("segments"), py::arg("keepalive"),
           py::arg("backend") = "auto", py::arg("queue_depth") = defaults::kWriteQueueDepth,
           py::arg("copy_threads") = defaults::copy_threads(),
           py::arg("direct") = true, py::arg("streams") = std::vector<std::pair<int, uintptr_t>>{},
           py::arg("hold_slots") = false, py::arg("host_files") = py::list(), py::arg("remote") = py::none(),
           py::arg("held") = std::vector<HeldSpec>{}, py::arg("planes") = std::vector<PlaneRuns>{},
           py::arg("compress_level") = defaults::kCompressLevel, py::arg("hash_while_copying") = false,
           "Open the stripes and start staging + writing. files: [(path, header, size)], segments: "
           "[(address, nbytes, file, offset[, device])] with device -1 for host memory; host_files: more "
           "host-memory segments as columns, [(file, members, offsets, ptrs, nbytes)] (member k of a file is "
           "tensor members[k] at offsets[k], with ptrs[members[k]] and nbytes[members[k]]); keepalive must own "
           "every address until staged. streams: [(device, cudaStream_t)] the GPU copies are ordered after "
           "(PyTorch's current streams; a device without one uses its legacy default stream). Returns once "
           "that ordering is in place. hold_slots: keep the staged image whole in the pool until "
           "SaveJob.release_slots() (a local snapshot). remote: None (local files), or a remote target's client: "
           "the files are paths on its server, created there and written over its connections straight from "
           "the staging slots. held: [(file, base stripe path, [(offset, len, checksum)])]: files staged but "
           "written only if a checksum differs, else hard-linked from the base stripe (see "
           "SaveJob.held_results; only where the target can hard-link: local files). planes: [] (nothing compressed), "
           "or per file [(offset, element width)] runs ([] for a file written plain): its chunks are framed by the "
           "codec (byte planes + zstd at compress_level) and SaveJob.chunk_frames says how. hash_while_copying: "
           "the caller waits for the whole save: checksum each chunk as it is copied, not in a pass after staging.")
      .def("reserve",
           [](Engine& e, uint64_t bytes, int device) {
             py::gil_scoped_release nogil;
             e.reserve(bytes, device);
           },
           py::arg("nbytes"), py::arg("device") = -1,
           "Allocate and fault in (device >= 0: also page-lock) pool slots for nbytes now (GIL released).")
      .def("set_backing_file", without_gil(&Engine::set_backing_file), py::arg("path"),
           "Map the pool's slabs from this file from now on (created when the first slab is).")
      .def_property_readonly("file_backed", without_gil(&Engine::file_backed))
      .def_property_readonly("backing_error", none_if_empty(&Engine::backing_error),
                             "Why the pool's backing file could not grow (the pool then uses private memory), or None.")
      .def_property_readonly("chunk_bytes", &Engine::chunk_bytes)
      .def_property_readonly("pool_bytes", without_gil(&Engine::pool_bytes))
      .def_property_readonly("max_staging_bytes", &Engine::max_staging_bytes)
      .def_property_readonly("pool_pinned", without_gil(&Engine::pool_pinned))
      .def_property_readonly("pool_unpinned_bytes", without_gil(&Engine::pool_unpinned_bytes))
      .def_property_readonly("pool_numa_node", without_gil(&Engine::pool_numa_node),
                             "The NUMA node the pool's new slabs prefer (the first GPU's, or "
                             "FLASHWRITE_STAGING_NUMA_NODE), or -1 for the kernel's default.")
      .def_property_readonly("pool_numa_error", none_if_empty(&Engine::pool_numa_error),
                             "Why the last slab could not be placed on that node, or None.")
      .def_property_readonly("pool_pages", none_if_empty(&Engine::pool_pages),
                             "The page size the newest slab got and why (FLASHWRITE_HUGE_PAGES=auto|on|off), "
                             "or None before the first.")
      .def_property_readonly("pin_error", none_if_empty(&Engine::pin_error),
                             "Why the pool could not be page-locked, or None.")
      .def("trim", without_gil(&Engine::trim));
}

}  // namespace fw
