// Local snapshots from the Python side: copy (and check) their pieces, punch
// the holes of a pool file, map a snapshot's pages. All without the GIL.
#include <pybind11/stl.h>

#include <atomic>
#include <condition_variable>
#include <exception>
#include <memory>
#include <mutex>
#include <thread>
#include <tuple>
#include <utility>
#include <vector>

#include "python/bindings.hpp"
#include "read/snapshot_copy.hpp"

namespace fw {
namespace {

using PyCopyPiece = std::tuple<uintptr_t, uintptr_t, uint64_t, uint64_t>;  // (dst or 0, src, nbytes, xxh3)

std::vector<std::pair<size_t, uint64_t>> copy_verify_py(const std::vector<PyCopyPiece>& pieces, bool verify,
                                                        unsigned threads) {
  std::vector<SnapshotPiece> ps;
  ps.reserve(pieces.size());
  for (auto& [dst, src, len, expected] : pieces)
    ps.push_back(SnapshotPiece{reinterpret_cast<char*>(dst), reinterpret_cast<const char*>(src), len, expected});
  // On a thread of its own while this one waits in slices: Ctrl-C sets `stop`,
  // the copy threads finish the piece they are in (16 MiB at most as saves cut
  // them) and are joined before KeyboardInterrupt leaves and the caller's frames
  // free the pool mapping and the destinations (issue 34).
  std::atomic<bool> stop{false};
  std::mutex mu;
  std::condition_variable cv;
  bool over = false;
  std::vector<std::pair<size_t, uint64_t>> bad;
  std::exception_ptr error;
  std::thread runner;
  {
    py::gil_scoped_release nogil;
    runner = std::thread([&] {
      try {
        bad = copy_verify(ps, verify, threads, &stop);
      } catch (...) {
        error = std::current_exception();
      }
      std::lock_guard<std::mutex> lk(mu);
      over = true;
      cv.notify_all();
    });
  }
  auto finished = [&](double t) {
    std::unique_lock<std::mutex> lk(mu);
    return cv.wait_for(lk, std::chrono::duration<double>(t), [&] { return over; });
  };
  wait_interruptible(finished, std::nullopt, [&] {
    stop.store(true);
    runner.join();
  });
  {
    py::gil_scoped_release nogil;
    runner.join();
  }
  if (error) std::rethrow_exception(error);
  return bad;
}

void register_mapping(py::module_& m) {
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
}

}  // namespace

void register_snapshot(py::module_& m) {
  m.def("copy_verify", &copy_verify_py, py::arg("pieces"), py::arg("verify") = true, py::arg("threads") = 1,
        "Copy [(dst, src, len, xxh3)] pieces (dst 0: check src in place) on `threads` threads, each piece "
        "checksummed as it is copied, its pages populated first; returns [(index, actual)] of the pieces that "
        "did not match. The caller keeps every buffer alive for the call (GIL released). Ctrl-C stops it between "
        "pieces; the copy threads are joined before KeyboardInterrupt leaves.");
  m.def(
      "punch_holes",
      [](int fd, std::vector<std::pair<uint64_t, uint64_t>> keep, uint64_t size) {
        py::gil_scoped_release nogil;
        return punch_holes(fd, std::move(keep), size);
      },
      py::arg("fd"), py::arg("keep"), py::arg("size"),
      "Free the pages of fd in [0, size) outside the (offset, nbytes) ranges of `keep` (hole punching); the "
      "bytes freed (GIL released).");
  register_mapping(m);
}

}  // namespace fw
