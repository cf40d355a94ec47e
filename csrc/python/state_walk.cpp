// The tree walk of a save (flatten.py's fast path), in one native pass.
//
// States of optimizer steps, MoE experts and per-layer buffers hold tens of
// thousands of tensors; walking them in Python cost about 3 µs per tensor (a
// node, a key, the attributes the plan needs), most of a save's stall. This
// walks the plain containers (dict, OrderedDict, list, tuple) natively, builds
// the same typed tree nodes flatten.py documents, makes each tensor's unique key,
// and reads the attributes the later stages need once, into columns. Everything
// that is not a plain container or tensor (leaves, numpy values, torch.Size, keys
// other than str) goes to flatten.py's own functions, so the tree's meaning has
// one definition. Storage sharing and tied weights are resolved by flatten.py
// from the columns (address and storage base per tensor).
#include "python/state_walk.hpp"

#include <pybind11/pybind11.h>

#include <Python.h>

#include <string>
#include <unordered_map>

namespace py = pybind11;

namespace fw {
namespace {

py::object steal(PyObject* o) {
  if (!o) throw py::error_already_set();
  return py::reinterpret_steal<py::object>(o);
}

long long as_ll(PyObject* o) {
  long long v = PyLong_AsLongLong(o);
  if (v == -1 && PyErr_Occurred()) throw py::error_already_set();
  return v;
}

bool truth(PyObject* o) {
  int r = PyObject_IsTrue(o);
  if (r < 0) throw py::error_already_set();
  return r != 0;
}

// Attribute and method names, interned once.
struct Names {
  py::object t, v, k, items, param, rg, tensor_, dict_, odict_, list_, tuple_, str_, ndarray;
  py::object requires_grad, data_ptr, storage_offset, is_cpu, dtype, shape, is_contiguous, is_neg, is_conj,
      itemsize, is_complex, qualname;
  Names() {
    auto s = [](const char* c) { return steal(PyUnicode_InternFromString(c)); };
    t = s("t"), v = s("v"), k = s("k"), items = s("items"), param = s("param"), rg = s("rg");
    tensor_ = s("tensor"), dict_ = s("dict"), odict_ = s("odict"), list_ = s("list"), tuple_ = s("tuple");
    str_ = s("str"), ndarray = s("ndarray");
    requires_grad = s("requires_grad"), data_ptr = s("data_ptr");
    storage_offset = s("storage_offset"), is_cpu = s("is_cpu"), dtype = s("dtype"), shape = s("shape");
    is_contiguous = s("is_contiguous"), is_neg = s("is_neg"), is_conj = s("is_conj");
    itemsize = s("itemsize"), is_complex = s("is_complex"), qualname = s("__qualname__");
  }
};

struct DtypeInfo {
  long long itemsize;
  bool complex;
};

// A tensor attribute or no-argument method, read through torch.Tensor's own
// descriptor found once: the lookup through the type per call is skipped (the
// getter itself is torch's, as `t.requires_grad` runs it). Only for tensors whose
// type is exactly torch.Tensor or nn.Parameter, which override none of them.
class Getter {
 public:
  Getter(PyTypeObject* type, PyObject* name) : name_(name) {
    descr_ = steal(PyObject_GetAttr(reinterpret_cast<PyObject*>(type), name));
    getter_ = Py_TYPE(descr_.ptr())->tp_descr_get;
    method_ = PyVectorcall_Function(descr_.ptr()) != nullptr;
    if (!method_ && !getter_) throw py::type_error("torch.Tensor attribute without a getter");
  }
  py::object operator()(PyObject* v, bool exact) const {
    if (!exact) return steal(method_ ? PyObject_CallMethodNoArgs(v, name_) : PyObject_GetAttr(v, name_));
    if (method_) {
      PyObject* args[1] = {v};
      return steal(PyObject_Vectorcall(descr_.ptr(), args, 1, nullptr));
    }
    return steal(getter_(descr_.ptr(), v, reinterpret_cast<PyObject*>(Py_TYPE(v))));
  }

 private:
  PyObject* name_;  // interned, held by Names
  py::object descr_;
  descrgetfunc getter_ = nullptr;
  bool method_ = false;
};

class Walker {
 public:
  Walker(const WalkTypes& types, py::object other, py::object leaf, py::object check, bool check_all, int max_depth)
      : ty_(types), other_(std::move(other)), leaf_(std::move(leaf)), check_(std::move(check)),
        check_all_(check_all), max_depth_(max_depth), used_(steal(PySet_New(nullptr))),
        root_(steal(PyUnicode_InternFromString("<root>"))), dot_(steal(PyUnicode_InternFromString("."))),
        default_key_(steal(PyUnicode_InternFromString("tensor"))),
        requires_grad_(types.tensor, n_.requires_grad.ptr()), dtype_(types.tensor, n_.dtype.ptr()),
        shape_(types.tensor, n_.shape.ptr()), data_ptr_(types.tensor, n_.data_ptr.ptr()),
        storage_offset_(types.tensor, n_.storage_offset.ptr()), is_cpu_(types.tensor, n_.is_cpu.ptr()),
        is_contiguous_(types.tensor, n_.is_contiguous.ptr()), is_neg_(types.tensor, n_.is_neg.ptr()),
        is_conj_(types.tensor, n_.is_conj.ptr()) {}

  WalkResult run(PyObject* state) {
    WalkResult r;
    r.tree = walk(state, nullptr, 0);
    r.tensors = std::move(tensors_), r.keys = std::move(keys_), r.nodes = std::move(nodes_);
    r.dtypes = std::move(dtypes_), r.shapes = std::move(shapes_);
    r.ptrs = std::move(ptrs_), r.bases = std::move(bases_), r.nbytes = std::move(nbytes_), r.flags = std::move(flags_);
    r.used = used_;
    return r;
  }

 private:
  const WalkTypes& ty_;
  py::object other_, leaf_, check_;
  bool check_all_;
  int max_depth_;
  Names n_;
  py::object used_, root_, dot_, default_key_;
  Getter requires_grad_, dtype_, shape_, data_ptr_, storage_offset_, is_cpu_, is_contiguous_, is_neg_, is_conj_;
  py::list tensors_, keys_, nodes_, dtypes_, shapes_;
  py::list ptrs_, bases_, nbytes_, flags_;
  std::unordered_map<PyObject*, DtypeInfo> dtype_info_;  // dtypes are singletons, held by torch

  PyObject* where(PyObject* prefix) const { return prefix ? prefix : root_.ptr(); }

  // The tree's lists, untracked by the cyclic garbage collector. A tree has no cycles,
  // and its other objects (node dicts of strs and numbers, keys) are untracked by
  // CPython already; tracked lists made the first collection after a save of
  // 100,000 tensors walk them all (measured: 20-35 ms at 20,000 tensors, inside
  // the stall). A tracked object they hold (a leaf node with a list) stays alive:
  // an untracked referrer counts as a reference from outside.
  static py::object tree_list(Py_ssize_t n) {
    py::object l = steal(PyList_New(n));
    PyObject_GC_UnTrack(l.ptr());
    return l;
  }

  static py::object node2(PyObject* tk, PyObject* vk, PyObject* tag, PyObject* val) {
    py::object d = steal(PyDict_New());
    if (PyDict_SetItem(d.ptr(), tk, tag) < 0 || PyDict_SetItem(d.ptr(), vk, val) < 0) throw py::error_already_set();
    return d;
  }

  py::object unique_key(PyObject* prefix) {
    py::object key = py::reinterpret_borrow<py::object>(prefix ? prefix : default_key_.ptr());
    int has = PySet_Contains(used_.ptr(), key.ptr());
    if (has < 0) throw py::error_already_set();
    if (has) {
      for (long n = 1;; ++n) {
        py::object cand = steal(PyUnicode_FromFormat("%U#%ld", key.ptr(), n));
        has = PySet_Contains(used_.ptr(), cand.ptr());
        if (has < 0) throw py::error_already_set();
        if (!has) {
          key = cand;
          break;
        }
      }
    }
    if (PySet_Add(used_.ptr(), key.ptr()) < 0) throw py::error_already_set();
    return key;
  }

  const DtypeInfo& dtype_info(PyObject* dt) {
    auto it = dtype_info_.find(dt);
    if (it != dtype_info_.end()) return it->second;
    py::object size = steal(PyObject_GetAttr(dt, n_.itemsize.ptr()));
    py::object cx = steal(PyObject_GetAttr(dt, n_.is_complex.ptr()));
    return dtype_info_.emplace(dt, DtypeInfo{as_ll(size.ptr()), truth(cx.ptr())}).first->second;
  }

  // "4096,1024" (as the header spells it): a str, where a torch.Size kept per tensor
  // would be one more object for the garbage collector to walk after the save.
  static py::object shape_text(PyObject* size, long long& numel) {
    if (!PyTuple_Check(size)) throw py::type_error("tensor.shape is not a tuple");
    std::string text;
    numel = 1;
    for (Py_ssize_t d = 0; d < PyTuple_GET_SIZE(size); ++d) {
      if (d) text += ',';
      const long long n = as_ll(PyTuple_GET_ITEM(size, d));
      numel *= n;
      text += std::to_string(n);
    }
    return steal(PyUnicode_FromStringAndSize(text.data(), static_cast<Py_ssize_t>(text.size())));
  }

  py::object attr(PyObject* o, PyObject* name) { return steal(PyObject_GetAttr(o, name)); }

  py::object tensor_node(PyObject* v, PyObject* prefix) {
    PyTypeObject* tv = Py_TYPE(v);
    bool plain_type = tv == ty_.tensor || tv == ty_.parameter;
    if (!plain_type || check_all_) steal(PyObject_CallFunctionObjArgs(check_.ptr(), v, where(prefix), nullptr));
    py::object node = steal(PyDict_New());
    if (PyDict_SetItem(node.ptr(), n_.t.ptr(), n_.tensor_.ptr()) < 0) throw py::error_already_set();
    long long flags = 0;
    if (tv == ty_.parameter) {
      flags |= kParam;
      if (PyDict_SetItem(node.ptr(), n_.param.ptr(), Py_True) < 0) throw py::error_already_set();
    }
    if (truth(requires_grad_(v, plain_type).ptr())) {
      flags |= kRequiresGrad;
      if (PyDict_SetItem(node.ptr(), n_.rg.ptr(), Py_True) < 0) throw py::error_already_set();
    }
    py::object key = unique_key(prefix);
    if (PyDict_SetItem(node.ptr(), n_.k.ptr(), key.ptr()) < 0) throw py::error_already_set();

    py::object dt = dtype_(v, plain_type);
    const DtypeInfo& info = dtype_info(dt.ptr());
    long long numel = 1;
    py::object shape = shape_text(shape_(v, plain_type).ptr(), numel);
    const long long nbytes = numel * info.itemsize;  // what tensor.nbytes says, without asking
    long long ptr = 0, base = 0;
    if (nbytes) {
      ptr = as_ll(data_ptr_(v, plain_type).ptr());
      long long off = as_ll(storage_offset_(v, plain_type).ptr());
      base = ptr - off * info.itemsize;
    }
    if (truth(is_cpu_(v, plain_type).ptr())) flags |= kCpu;
    if (truth(is_contiguous_(v, plain_type).ptr()) && !truth(is_neg_(v, plain_type).ptr()) &&
        !(info.complex && truth(is_conj_(v, plain_type).ptr())))
      flags |= kDense;
    tensors_.append(py::reinterpret_borrow<py::object>(v));
    keys_.append(key);
    nodes_.append(node);
    dtypes_.append(dt);
    shapes_.append(shape);
    ptrs_.append(py::int_(ptr));
    bases_.append(py::int_(base));
    nbytes_.append(py::int_(nbytes));
    flags_.append(py::int_(flags));
    return node;
  }

  // A child's key: str(k) at the root, else f"{prefix}.{k}" (as flatten.py spells it).
  py::object child_prefix(PyObject* dotted, PyObject* k) {
    if (!dotted) return PyUnicode_CheckExact(k) ? py::reinterpret_borrow<py::object>(k) : steal(PyObject_Str(k));
    if (PyUnicode_CheckExact(k)) return steal(PyUnicode_Concat(dotted, k));
    py::object empty = steal(PyUnicode_FromString(""));
    py::object text = steal(PyObject_Format(k, empty.ptr()));
    return steal(PyUnicode_Concat(dotted, text.ptr()));
  }

  py::object key_node(PyObject* k, PyObject* w) {
    if (PyUnicode_CheckExact(k)) return node2(n_.t.ptr(), n_.v.ptr(), n_.str_.ptr(), k);
    if (PyTuple_CheckExact(k)) {
      Py_ssize_t n = PyTuple_GET_SIZE(k);
      py::object items = tree_list(n);
      for (Py_ssize_t i = 0; i < n; ++i)
        PyList_SET_ITEM(items.ptr(), i, key_node(PyTuple_GET_ITEM(k, i), w).release().ptr());
      return node2(n_.t.ptr(), n_.items.ptr(), n_.tuple_.ptr(), items.ptr());
    }
    return steal(PyObject_CallFunctionObjArgs(leaf_.ptr(), k, w, nullptr));
  }

  py::object walk(PyObject* v, PyObject* prefix, int depth) {
    PyTypeObject* tv = Py_TYPE(v);
    if (tv == ty_.tensor || tv == ty_.parameter || PyObject_TypeCheck(v, ty_.tensor)) return tensor_node(v, prefix);
    if (depth > max_depth_) {
      PyErr_Format(PyExc_ValueError, "%U: state is nested deeper than %d levels", where(prefix), max_depth_);
      throw py::error_already_set();
    }
    bool is_dict = tv == &PyDict_Type, is_odict = tv == ty_.odict;
    if (is_dict || is_odict) {
      PyObject* w = where(prefix);
      py::object dotted = prefix ? steal(PyUnicode_Concat(prefix, dot_.ptr())) : py::object();
      py::object items = tree_list(0);
      // A snapshot of the items: a user's __hash__ or leaf callback cannot change what is walked.
      py::object pairs = steal(PyDict_Items(v));
      Py_ssize_t n = PyList_GET_SIZE(pairs.ptr());
      for (Py_ssize_t i = 0; i < n; ++i) {
        PyObject* kv = PyList_GET_ITEM(pairs.ptr(), i);
        PyObject* k = PyTuple_GET_ITEM(kv, 0);
        if (PyObject_TypeCheck(k, ty_.tensor) || PyDict_Check(k) || PyList_Check(k)) {
          py::object name = attr(reinterpret_cast<PyObject*>(Py_TYPE(k)), n_.qualname.ptr());
          PyErr_Format(PyExc_TypeError, "%U: unsupported key type %U", w, name.ptr());
          throw py::error_already_set();
        }
        py::object kn = key_node(k, w);
        py::object cp = child_prefix(dotted ? dotted.ptr() : nullptr, k);
        py::object vn = walk(PyTuple_GET_ITEM(kv, 1), cp.ptr(), depth + 1);
        py::object pair = tree_list(2);
        PyList_SET_ITEM(pair.ptr(), 0, kn.release().ptr());
        PyList_SET_ITEM(pair.ptr(), 1, vn.release().ptr());
        if (PyList_Append(items.ptr(), pair.ptr()) < 0) throw py::error_already_set();
      }
      return node2(n_.t.ptr(), n_.items.ptr(), is_odict ? n_.odict_.ptr() : n_.dict_.ptr(), items.ptr());
    }
    if (tv == &PyList_Type || tv == &PyTuple_Type) {
      py::object seq = steal(PySequence_List(v));  // a snapshot, as for dicts
      Py_ssize_t n = PyList_GET_SIZE(seq.ptr());
      py::object dotted = prefix ? steal(PyUnicode_Concat(prefix, dot_.ptr())) : py::object();
      py::object items = tree_list(n);
      for (Py_ssize_t i = 0; i < n; ++i) {
        py::object idx = steal(PyUnicode_FromFormat("%zd", i));
        py::object cp = dotted ? steal(PyUnicode_Concat(dotted.ptr(), idx.ptr())) : idx;
        PyList_SET_ITEM(items.ptr(), i, walk(PyList_GET_ITEM(seq.ptr(), i), cp.ptr(), depth + 1).release().ptr());
      }
      return node2(n_.t.ptr(), n_.items.ptr(), tv == &PyList_Type ? n_.list_.ptr() : n_.tuple_.ptr(), items.ptr());
    }
    // Leaves, numpy values, torch.Size: flatten.py's; a tensor back means an ndarray stored as tensor data.
    py::object out = steal(PyObject_CallFunctionObjArgs(other_.ptr(), v, prefix ? prefix : Py_None, nullptr));
    if (PyObject_TypeCheck(out.ptr(), ty_.tensor)) {
      py::object tn = tensor_node(out.ptr(), prefix);
      return node2(n_.t.ptr(), n_.v.ptr(), n_.ndarray.ptr(), tn.ptr());
    }
    return out;
  }
};

}  // namespace

WalkResult walk_state(PyObject* state, const WalkTypes& types, py::object other, py::object leaf, py::object check,
                      bool check_all, int max_depth) {
  Walker w(types, std::move(other), std::move(leaf), std::move(check), check_all, max_depth);
  return w.run(state);
}

}  // namespace fw
