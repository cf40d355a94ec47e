"""Pickles that ``convert`` reads without running code: torch's weights_only unpickler,
allowed besides the numpy classes that rebuild arrays and scalars of numeric dtypes
(what ``np.random.get_state()`` holds). Numpy arrays are data: the same classes
``flashwrite.load`` rebuilds them with, no pickle. Anything else stays refused unless
the caller passes ``--allow-pickle``.

``dcp_arrays`` recovers the numpy arrays of a flashwrite tree from a DCP checkpoint:
``dcp.save`` pickles a numpy array (and a tuple that holds one) whole, as a bytes item,
where a flashwrite checkpoint stores the array's data as a tensor.
"""

from __future__ import annotations

import contextlib
import io
import os
import re
from typing import Any, Iterator

import torch

from ..errors import CorruptCheckpointError, UnsafeCheckpointError
from .tree import walk

_NUMERIC = "?bBhHiIlLqQefdgFDG"  # numpy type codes of the dtypes flashwrite stores arrays of


def numpy_globals() -> list[Any]:
    """What torch's weights_only unpickler must be allowed to rebuild numeric numpy values,
    under both module names (numpy 2 pickles say numpy._core, numpy 1 numpy.core)."""
    import numpy as np
    try:
        from numpy._core import multiarray
    except ImportError:  # numpy 1
        from numpy.core import multiarray  # type: ignore[no-redef]
    out: list[Any] = [np.ndarray, np.dtype]
    for name in ("_reconstruct", "scalar"):
        fn = getattr(multiarray, name)
        out += [(fn, f"numpy.core.multiarray.{name}"), (fn, f"numpy._core.multiarray.{name}")]
    for code in _NUMERIC:
        cls = type(np.dtype(code))
        out.append(cls)
        if cls.__module__ == "numpy.dtypes":
            out.append((cls, f"numpy.dtypes.{cls.__name__}"))
    return out


@contextlib.contextmanager
def numpy_allowed() -> Iterator[None]:
    with torch.serialization.safe_globals(numpy_globals()):
        yield


def load_weights_only(f: Any, **kw: Any) -> Any:
    """torch.load(f, weights_only=True), numeric numpy values allowed."""
    with numpy_allowed():
        return torch.load(f, weights_only=True, **kw)


def refused_global(e: Exception) -> str:
    """What the weights_only unpickler refused, without torch's advice to allow it (which
    would run the file's code here: ``--allow-pickle`` is the one way to opt in)."""
    m = re.search(r"Unsupported global: GLOBAL ([\w.]+)", str(e))
    if m:
        return f"it needs {m.group(1)}, which is not a tensor, a container or a numeric numpy value"
    first = str(e).strip().splitlines()
    return first[0][:200] if first else type(e).__name__


def _at(obj: Any, parts: list[str]) -> Any:
    """The value at the '.'-joined path below obj (dict keys as text, sequence indices)."""
    for p in parts:
        if isinstance(obj, dict):
            obj = next((v for k, v in obj.items() if str(k) == p), None)
        elif isinstance(obj, (list, tuple)) and p.isdigit() and int(p) < len(obj):
            obj = obj[int(p)]
        else:
            return None
    return obj


def _read_item(path: str, info: Any) -> bytes:
    if getattr(info, "transform_descriptors", None):
        raise CorruptCheckpointError(f"{path}: a DCP item written with transforms {info.transform_descriptors!r}; "
                                     "convert reads plain items only")
    name = os.path.basename(str(info.relative_path))
    with open(os.path.join(path, name), "rb") as fh:
        fh.seek(int(info.offset))
        data = fh.read(int(info.length))
    if len(data) != int(info.length):
        raise CorruptCheckpointError(f"{path}/{name}: shorter than its DCP metadata says", file=name)
    return data


def dcp_arrays(path: str, md: Any, tree: Any, missing: set[str], allow_pickle: bool) -> dict[str, torch.Tensor]:
    """{key: tensor} for the tree's ndarray nodes over the tensor keys ``missing``, each
    unpickled from the DCP bytes item that holds it (weights_only, numpy allowed; any
    pickle with --allow-pickle). Raises when one cannot be had, naming it and what to do."""
    import numpy as np
    fqns = {getattr(k, "fqn", None): v for k, v in md.storage_data.items()}
    loaded: dict[str, Any] = {}
    out: dict[str, torch.Tensor] = {}
    for where, n in walk(tree):
        v = n.get("v")
        if n.get("t") != "ndarray" or not isinstance(v, dict) or v.get("k") not in missing:
            continue
        fqn = next((f for f in sorted(fqns, key=lambda f: -len(str(f)))
                    if isinstance(f, str) and (where == f or where.startswith(f + "."))), None)
        if fqn is None:
            raise CorruptCheckpointError(f"{path}: the numpy array at {where!r} (tensor {v['k']!r} of the flashwrite "
                                         "record) is not in this DCP checkpoint")
        if fqn not in loaded:
            data = io.BytesIO(_read_item(path, fqns[fqn]))
            try:
                loaded[fqn] = load_weights_only(data) if not allow_pickle else torch.load(data, weights_only=False)
            except Exception as e:  # noqa: BLE001 - a hostile pickle raises anything
                raise UnsafeCheckpointError(f"{path}: DCP item {fqn!r} (holding the numpy array at {where!r}) was not "
                                            f"unpickled: {refused_global(e)}; pass --allow-pickle only for files "
                                            "you trust") from None
        arr = _at(loaded[fqn], where[len(fqn) + 1:].split(".") if where != fqn else [])
        if not isinstance(arr, np.ndarray):
            raise CorruptCheckpointError(f"{path}: DCP item {fqn!r} holds no numpy array at {where!r}")
        out[v["k"]] = torch.from_numpy(np.ascontiguousarray(arr.astype(arr.dtype.newbyteorder("="))))
    return out
