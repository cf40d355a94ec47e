// What the machine offers and small file-system calls: XXH3 of a buffer, fsync
// and atomic exchange of directories, the O_DIRECT, io_uring and CUDA probes, and
// the kernel's write watch over memory.
#include <pybind11/stl.h>

#include <string>

#include "core/checksum.hpp"
#include "core/write_watch.hpp"
#include "io/backend.hpp"
#include "io/files.hpp"
#include "python/bindings.hpp"
#include "shim/cuda.hpp"

namespace fw {
namespace {

// initialize=false: what can be said without initialising CUDA (cuda::locate()):
// then, unless CUDA was initialised already, "available" is None (a runtime was
// found, whether it sees a GPU is unknown) and "device_count" None.
py::dict cuda_info(bool initialize) {
  const cuda::Runtime* found;
  {
    py::gil_scoped_release nogil;  // dlopen, and cudaGetDeviceCount when initialising: seconds on some machines
    found = initialize ? &cuda::runtime() : &cuda::locate();
  }
  const cuda::Runtime& rt = *found;
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

void register_system(py::module_& m) {
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
  m.def("checksum_path", &checksum_path, "Which XXH3 the checksums run: \"avx2\" or \"scalar\".");

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
  m.def(
      "io_uring_library",
      []() -> py::object {
        if (!uring_compiled()) return py::none();
        py::dict d;
        d["source"] = uring_library_source();
        d["version"] = uring_library_version();
        return d;
      },
      "Which liburing the build links: {'source': 'system' | 'vendored', 'version': '2.15'}; None without io_uring.");
  m.def("io_uring_probe", [] { return -uring_probe(); }, "0 when a ring can be set up here, else the errno.");
  m.def("cuda_info", &cuda_info, py::arg("initialize") = true);
  py::class_<WriteWatch>(m, "WriteWatch",
                         "The kernel's record of which memory was written (userfaultfd asynchronous write-protection "
                         "and PAGEMAP_SCAN, Linux 6.7); OSError with the errno where the kernel cannot. Ranges are "
                         "[(address, nbytes)], widened to whole pages.")
      .def(py::init([] {
        py::gil_scoped_release nogil;
        return new WriteWatch();
      }))
      .def(
          "arm",
          [](WriteWatch& w, const std::vector<WriteWatch::Range>& ranges) {
            py::gil_scoped_release nogil;
            return w.arm(ranges);
          },
          py::arg("ranges"), "Register the ranges' pages for write-protection; False where refused.")
      .def(
          "scan",
          [](WriteWatch& w, const std::vector<WriteWatch::Range>& ranges) {
            py::gil_scoped_release nogil;
            return w.scan(ranges);
          },
          py::arg("ranges"),
          "For each range, which of its pages may have changed since the last scan that covered them "
          "(written, absent, not anonymous, not registered): 0 none, | 1 a page of its own (or not "
          "scannable), | 2 its first page, | 4 its last page, where it shares that page with other memory. "
          "Protects them all again.")
      .def_property_readonly("pid", &WriteWatch::pid);
  // For tests: the staging pool's page-locking of freshly mapped memory.
  m.def(
      "_cuda_pin",
      [](uintptr_t p, size_t n, int device) {
        py::gil_scoped_release nogil;
        return cuda::pin(reinterpret_cast<void*>(p), n, device);
      },
      py::arg("addr"), py::arg("nbytes"), py::arg("device") = 0);
}

}  // namespace fw
