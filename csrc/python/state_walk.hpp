// The tree walk of a save, natively (see state_walk.cpp). Needs the GIL.
#pragma once

#include <pybind11/pybind11.h>

namespace fw {

// Per-tensor flags in WalkResult::flags.
enum WalkFlags : long long {
  kCpu = 1,           // host memory
  kParam = 2,         // an nn.Parameter
  kRequiresGrad = 4,  // requires_grad
  kDense = 8,         // its bytes as stored: contiguous, not a negative or conjugate view
};

struct WalkTypes {
  PyTypeObject* tensor;     // torch.Tensor (subclasses are tensors too, and are checked)
  PyTypeObject* parameter;  // torch.nn.Parameter
  PyTypeObject* odict;      // collections.OrderedDict
};

// One entry per tensor met, in walk order (aliases included: flatten.py resolves them).
struct WalkResult {
  pybind11::object tree;
  pybind11::list tensors, keys, nodes, dtypes;
  pybind11::list shapes;  // as text: "4096,1024", "" for a scalar
  pybind11::list ptrs;    // data_ptr(), 0 for an empty tensor
  pybind11::list bases;   // address of storage element 0 as this tensor's dtype counts it, 0 if empty
  pybind11::list nbytes;  // bytes the tensor shows
  pybind11::list flags;   // WalkFlags
  pybind11::object used;  // every key handed out (a set), for keys made later
};

// other(v, prefix or None) -> node | tensor: anything not a plain container or a tensor;
// a tensor back is an ndarray's data. leaf(k, where) -> node: a dict key other than a
// str or a tuple. check(t, where): raises for a tensor that cannot be stored; called
// for tensor subclasses, and for every tensor when check_all.
WalkResult walk_state(PyObject* state, const WalkTypes& types, pybind11::object other, pybind11::object leaf,
                      pybind11::object check, bool check_all, int max_depth);

}  // namespace fw
