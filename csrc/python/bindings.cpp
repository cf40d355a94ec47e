// The module: its constants, the defaults, and native errors as Python sees them
// (OSError subclasses with errno, path and offset, or flashwrite's
// CorruptCheckpointError). Each area registers itself (bindings.hpp).
#include "python/bindings.hpp"

#include <pybind11/stl.h>

#include "core/aligned_buffer.hpp"
#include "core/checksum.hpp"
#include "core/defaults.hpp"
#include "core/error.hpp"

#ifndef FLASHWRITE_VERSION
#define FLASHWRITE_VERSION "0+unknown"
#endif

namespace fw {
namespace {

// The thread counts that follow the CPU count are counted once, here, at import.
py::dict defaults_dict() {
  py::dict d;
  d["stripes"] = defaults::kStripes;
  d["chunk_bytes"] = defaults::kChunkBytes;
  d["write_queue_depth"] = defaults::kWriteQueueDepth;
  d["read_queue_depth"] = defaults::kReadQueueDepth;
  d["read_chunk_bytes"] = defaults::kReadChunkBytes;
  d["direct_tensor_bytes"] = defaults::kDirectTensorBytes;
  d["copy_threads"] = defaults::copy_threads();
  d["verify_threads"] = defaults::verify_threads();
  d["d2h_batches_in_flight"] = defaults::kD2hBatchesInFlight;
  d["bounce_min_slots"] = defaults::kBounceMinSlots;
  d["bounce_extra_slots"] = defaults::kBounceExtraSlots;
  d["gather_tensor_bytes"] = defaults::kGatherTensorBytes;
  d["gather_run_bytes"] = defaults::kGatherRunBytes;
  return d;
}

void translate_errors(std::exception_ptr p) {
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
}

}  // namespace

std::shared_ptr<JobFiles> job_files_of(const py::object& remote, const std::string& backend, bool direct) {
  const BackendKind kind = parse_backend(backend);  // checked for remote ones too
  if (remote.is_none()) return make_local_files(kind, direct);
  return remote_job_files(remote);
}

}  // namespace fw

PYBIND11_MODULE(_core, m) {
  using namespace fw;
  m.doc() = "flashwrite native engine: staging pool, io_uring / thread-pool I/O, checksums";
  m.attr("__version__") = FLASHWRITE_VERSION;
  m.attr("CHECKSUM_ALGORITHM") = kChecksumAlgorithm;
  m.attr("ALIGN") = kAlign;
  m.attr("DEFAULTS") = defaults_dict();
  py::register_exception_translator(&translate_errors);

  register_save(m);  // before Engine, whose start_save returns a SaveJob
  register_engine(m);
  register_load(m);
  register_snapshot(m);
  register_walk(m);
  register_plan(m);
  register_system(m);
  register_codec(m);
  register_remote(m);
}
