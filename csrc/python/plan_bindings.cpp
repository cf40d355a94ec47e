// The plan side of a save, natively: the tree walk (flatten.py), the stripe
// layout (plan.py) and, for tests, the chunk arithmetic. These need the GIL:
// they read and build Python objects, in microseconds per tensor.
#include <pybind11/stl.h>

#include <deque>
#include <optional>
#include <string>
#include <string_view>
#include <tuple>
#include <vector>

#include "python/bindings.hpp"
#include "python/state_walk.hpp"
#include "write/chunk_plan.hpp"
#include "write/stripe_layout.hpp"

namespace fw {
namespace {

// A str's UTF-8 (the str keeps it), or nothing for another type or a str that
// cannot be encoded (surrogates).
std::optional<std::string_view> utf8_view(PyObject* o) {
  Py_ssize_t len = 0;
  const char* p = PyUnicode_Check(o) ? PyUnicode_AsUTF8AndSize(o, &len) : nullptr;
  if (!p) {
    PyErr_Clear();
    return std::nullopt;
  }
  return std::string_view(p, static_cast<size_t>(len));
}

// A key as JSON string content: as it is when printable ASCII with nothing to
// escape, else quote(key) (json.dumps' escapes, quotes included), kept in `made`.
void read_key(PyObject* k, const py::object& quote, LayoutTensor& t, std::deque<std::string>& made) {
  auto key = utf8_view(k);
  bool plain = key.has_value();
  for (size_t c = 0; plain && c < key->size(); ++c) {
    unsigned char ch = static_cast<unsigned char>((*key)[c]);
    plain = ch >= 0x20 && ch < 0x7f && ch != '"' && ch != '\\';
  }
  if (plain) {
    t.key = *key;
  } else {
    t.key = made.emplace_back(quote(py::handle(k)).cast<std::string>());
    t.quoted = true;
  }
}

// dtype_codes[dtype] = (code or None, itemsize); None: stored as bytes, U8 of its byte count.
void read_dtype(PyObject* dtype_codes, PyObject* dtype, PyObject* nbytes, PyObject* shape, LayoutTensor& t,
                std::deque<std::string>& made) {
  PyObject* info = PyDict_GetItemWithError(dtype_codes, dtype);
  if (!info) {
    if (PyErr_Occurred()) throw py::error_already_set();
    throw py::value_error("layout_stripes: a dtype missing from dtype_codes");
  }
  if (!PyTuple_Check(info) || PyTuple_GET_SIZE(info) != 2)
    throw py::type_error("layout_stripes: dtype_codes values are (code or None, itemsize)");
  PyObject* code = PyTuple_GET_ITEM(info, 0);
  t.nbytes = PyLong_AsUnsignedLongLong(nbytes);
  t.itemsize = static_cast<unsigned>(PyLong_AsUnsignedLong(PyTuple_GET_ITEM(info, 1)));
  if (PyErr_Occurred()) throw py::error_already_set();
  if (code == Py_None) {
    t.code = "U8";
    t.shape = made.emplace_back(std::to_string(t.nbytes));
    return;
  }
  auto c = utf8_view(code);
  auto s = utf8_view(shape);
  if (!c || !s) throw py::type_error("layout_stripes: codes and shapes are str");
  t.code = *c;
  t.shape = *s;
}

// plan.py's columns as LayoutTensors, read from the lists' items directly (no
// cast per item: a state of 100k tensors lays out in milliseconds). They view the
// items' UTF-8 and the strings made here, kept in `made`.
std::vector<LayoutTensor> read_layout_tensors(const py::list& keys, const py::list& dtypes, const py::list& shapes,
                                              const py::list& nbytes, const py::dict& dtype_codes,
                                              const py::object& quote, std::deque<std::string>& made) {
  const size_t n = keys.size();
  if (dtypes.size() != n || shapes.size() != n || nbytes.size() != n)
    throw py::value_error("layout_stripes: keys, dtypes, shapes and nbytes differ in length");
  std::vector<LayoutTensor> ts(n);
  for (size_t i = 0; i < n; ++i) {
    read_key(PyList_GET_ITEM(keys.ptr(), i), quote, ts[i], made);
    read_dtype(dtype_codes.ptr(), PyList_GET_ITEM(dtypes.ptr(), i), PyList_GET_ITEM(nbytes.ptr(), i),
               PyList_GET_ITEM(shapes.ptr(), i), ts[i], made);
  }
  return ts;
}

py::list layout_stripes_py(const py::list& keys, const py::list& dtypes, const py::list& shapes,
                           const py::list& nbytes, const py::dict& dtype_codes, const std::vector<std::string>& names,
                           const std::string& metadata_json, const py::object& quote) {
  std::deque<std::string> made;  // strings made while reading (escaped keys, byte counts): the tensors view them
  std::vector<LayoutTensor> ts = read_layout_tensors(keys, dtypes, shapes, nbytes, dtype_codes, quote, made);
  std::vector<LayoutFile> files;
  try {
    files = layout_stripes(ts, names, metadata_json);
  } catch (const std::invalid_argument& e) {
    throw py::value_error(e.what());
  }
  py::list out;
  for (auto& f : files) out.append(py::make_tuple(py::bytes(f.header), f.size, py::cast(f.members), py::cast(f.offsets)));
  return out;
}

py::tuple plan_chunks_py(const std::vector<uint64_t>& sizes,
                         const std::vector<std::tuple<uint64_t, uint32_t, uint64_t>>& segs, uint64_t chunk_bytes) {
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
}

WalkResult walk_state_py(py::handle state, py::type tensor, py::type parameter, py::type odict, py::object other,
                         py::object leaf, py::object check, bool check_all, int max_depth) {
  WalkTypes types{reinterpret_cast<PyTypeObject*>(tensor.ptr()), reinterpret_cast<PyTypeObject*>(parameter.ptr()),
                  reinterpret_cast<PyTypeObject*>(odict.ptr())};
  return walk_state(state.ptr(), types, std::move(other), std::move(leaf), std::move(check), check_all, max_depth);
}

}  // namespace

void register_walk(py::module_& m) {
  m.attr("WALK_CPU") = static_cast<long long>(kCpu);
  m.attr("WALK_PARAM") = static_cast<long long>(kParam);
  m.attr("WALK_REQUIRES_GRAD") = static_cast<long long>(kRequiresGrad);
  m.attr("WALK_DENSE") = static_cast<long long>(kDense);
  py::class_<WalkResult>(m, "WalkResult",
                         "What walk_state met: the tree, and one entry per tensor in each column, in walk order.")
      .def_readonly("tree", &WalkResult::tree, "The state with every tensor replaced by its node.")
      .def_readonly("tensors", &WalkResult::tensors)
      .def_readonly("keys", &WalkResult::keys)
      .def_readonly("nodes", &WalkResult::nodes)
      .def_readonly("dtypes", &WalkResult::dtypes)
      .def_readonly("shapes", &WalkResult::shapes, "As text: \"4096,1024\", \"\" for a scalar.")
      .def_readonly("ptrs", &WalkResult::ptrs, "data_ptr(), 0 for an empty tensor.")
      .def_readonly("bases", &WalkResult::bases, "Address of storage element 0 in the tensor's dtype, 0 if empty.")
      .def_readonly("nbytes", &WalkResult::nbytes, "Bytes each tensor shows.")
      .def_readonly("flags", &WalkResult::flags, "WALK_* bits.")
      .def_readonly("used", &WalkResult::used, "Every key handed out (a set).");
  m.def("walk_state", &walk_state_py, py::arg("state"), py::arg("tensor"), py::arg("parameter"), py::arg("odict"),
        py::arg("other"), py::arg("leaf"), py::arg("check"), py::arg("check_all"), py::arg("max_depth"),
        "flatten.py's tree walk: a WalkResult (the tree, and per tensor met its key, node, dtype, shape, "
        "address, storage base, bytes and flags). See csrc/python/state_walk.hpp.");
}

void register_plan(py::module_& m) {
  m.attr("HEADER_ALIGN") = kHeaderAlign;
  m.attr("MAX_HEADER_BYTES") = kMaxHeaderBytes;
  m.def("layout_stripes", &layout_stripes_py, py::arg("keys"), py::arg("dtypes"), py::arg("shapes"), py::arg("nbytes"),
        py::arg("dtype_codes"), py::arg("names"), py::arg("metadata_json"), py::arg("quote"),
        "plan.py's stripe layout, one file per name: [(header, size, members, offsets)]. shapes: as text "
        "(\"4096,1024\"). dtype_codes: {dtype: (safetensors code or None for bytes, itemsize)}; quote(key) -> "
        "the key as a JSON string, for keys that need escapes.");
  m.def("plan_chunks", &plan_chunks_py,
        "The chunk arithmetic of a save, exposed for tests: ([(file, offset, data_len, write_len, has_gaps, "
        "[(segment, src_offset, chunk_offset, len, hash_index)])], segment_hash_start).");
}

}  // namespace fw
