// The Python boundary, one file per area: bindings.cpp makes the module (its
// constants, DEFAULTS and the translation of native errors) and calls each
// register_* below. Everything blocking runs with the GIL released; waits wake
// every defaults::kWaitSliceS to let Ctrl-C through (PyErr_CheckSignals).
#pragma once

#include <pybind11/pybind11.h>

#include <Python.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <memory>
#include <optional>

#include "core/defaults.hpp"
#include "io/job_files.hpp"

namespace fw {

namespace py = pybind11;

void register_engine(py::module_& m);    // save_bindings.cpp: Engine (the staging pool) and its start_save
void register_save(py::module_& m);      // save_bindings.cpp: SaveJob
void register_load(py::module_& m);      // load_bindings.cpp: start_load, LoadJob, Buffer, the bounce pool
void register_snapshot(py::module_& m);  // snapshot_bindings.cpp: copy_verify, punch_holes, SnapshotMapping
void register_walk(py::module_& m);      // plan_bindings.cpp: walk_state and its WalkResult
void register_plan(py::module_& m);      // plan_bindings.cpp: plan_chunks, layout_stripes
void register_codec(py::module_& m);     // codec_bindings.cpp: zstd_support, codec_compress/decompress/rate
void register_system(py::module_& m);    // system_bindings.cpp: checksum, directory ops, io_uring and CUDA probes
// The remote target's client and its support, defined beside that client in io/
// (which alone names the target).
void register_remote(py::module_& m);

// The files a save or load job gets (io/job_files.hpp), from start_save's and
// start_load's remote=: None: local files, opened with O_DIRECT when `direct`, the
// requests on `backend` ('auto', 'io_uring', 'threads'); else the remote target's
// files (remote_job_files, beside its client in io/), its own backend.
std::shared_ptr<JobFiles> job_files_of(const py::object& remote, const std::string& backend, bool direct);
std::shared_ptr<JobFiles> remote_job_files(const py::object& remote);

// Waits in short slices without the GIL, checking for signals in between.
// The time left is kept in double seconds and never converted to a clock
// duration: a timeout of inf, 1e300 or 1e10 s just never runs out (converting
// it to nanoseconds overflows). NaN is refused; negative means poll once.
//
// When a signal handler raises (Ctrl-C: KeyboardInterrupt), `stop` runs first,
// without the GIL: it cancels the job and joins it. Only then does the
// exception leave, and the caller's frames unwind and free what the job reads
// from or writes into (a load's destinations, a save's sources). Stopping is
// bounded by the I/O in flight, and a second Ctrl-C meanwhile waits its turn.
template <typename F, typename S>
bool wait_interruptible(F&& wait_for, std::optional<double> timeout, S&& stop) {
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
    if (PyErr_CheckSignals() != 0) {
      py::error_already_set raised;  // takes the pending exception, so the GIL can go
      {
        py::gil_scoped_release nogil;
        stop();
      }
      throw raised;
    }
    if (timeout && left() <= 0) return false;
  }
}

}  // namespace fw
