// The chunk codec's Python face: whether zstd is usable here, and one-shot
// compress/decompress of a buffer (tests, benchmarks: the save and load jobs
// call the codec themselves, on their own threads).
#include <pybind11/pybind11.h>

#include <chrono>
#include <string>

#include "core/codec.hpp"
#include "python/bindings.hpp"

namespace fw {
namespace {

std::string_view bytes_of(const py::buffer& b, py::buffer_info& info) {
  info = b.request();
  return std::string_view(static_cast<const char*>(info.ptr), static_cast<size_t>(info.size * info.itemsize));
}

}  // namespace

void register_codec(py::module_& m) {
  m.def("zstd_support", [] {
    py::dict d;
    const std::string& why = codec::unavailable();
    d["usable"] = why.empty();
    d["version"] = why.empty() ? py::object(py::str(codec::zstd_version())) : py::none();
    d["error"] = why.empty() ? py::none() : py::object(py::str(why));
    return d;
  }, "{'usable', 'version', 'error'}: whether libzstd could be loaded (at run time) for compress=.");
  m.def("codec_compress", [](const py::buffer& src, unsigned width, int level) {
    py::buffer_info info;
    std::string_view s = bytes_of(src, info);
    std::string out(codec::bound(s.size()), '\0');
    size_t n;
    {
      py::gil_scoped_release nogil;
      codec::Coder c;
      n = c.compress(s.data(), s.size(), width, level, out.data());
    }
    out.resize(n);
    return py::bytes(out);
  }, py::arg("data"), py::arg("width"), py::arg("level") = 1,
     "One frame of `data` split into `width`-byte planes, each zstd-compressed at `level` (or stored).");
  m.def("codec_decompress", [](const py::buffer& src, size_t raw_len) {
    py::buffer_info info;
    std::string_view s = bytes_of(src, info);
    std::string out(raw_len, '\0');
    {
      py::gil_scoped_release nogil;
      codec::Coder c;
      c.decompress(s.data(), s.size(), out.data(), raw_len);
    }
    return py::bytes(out);
  }, py::arg("data"), py::arg("raw_len"),
     "The `raw_len` bytes a frame holds; CorruptCheckpointError when it is malformed or short.");
  m.def("codec_rate", [](const py::buffer& src, unsigned width, int level, unsigned repeat) {
    // Seconds per pass of one thread (compress, decompress) and the frame length.
    py::buffer_info info;
    std::string_view s = bytes_of(src, info);
    std::string z(codec::bound(s.size()), '\0'), back(s.size(), '\0');
    size_t n = 0;
    double tc = 0, td = 0;
    {
      py::gil_scoped_release nogil;
      codec::Coder c;
      using clk = std::chrono::steady_clock;
      for (unsigned r = 0; r < (repeat ? repeat : 1); ++r) {
        auto t0 = clk::now();
        n = c.compress(s.data(), s.size(), width, level, z.data());
        auto t1 = clk::now();
        c.decompress(z.data(), n, back.data(), s.size());
        auto t2 = clk::now();
        tc += std::chrono::duration<double>(t1 - t0).count();
        td += std::chrono::duration<double>(t2 - t1).count();
      }
    }
    if (back != s) throw std::runtime_error("codec round trip differs");
    const double k = repeat ? repeat : 1;
    return py::make_tuple(n, tc / k, td / k);
  }, py::arg("data"), py::arg("width"), py::arg("level") = 1, py::arg("repeat") = 1,
     "(frame bytes, compress s, decompress s) per pass on one thread, round trip checked (benchmarks).");
}

}  // namespace fw
