"""What the native engine will do on this machine, for users and bug reports."""

from __future__ import annotations

import errno as _errno
import os
from typing import Any

from .. import _core
from ..targets import tuning as _tuning
from ..targets.locate import kind_of, resolve


def backend_info(path: str | os.PathLike | None = None, *, initialize_cuda: bool | None = None) -> dict[str, Any]:
    """Which I/O backend ``backend="auto"`` uses, whether io_uring works at run time and
    which liburing the build links (``"liburing"``: its source, ``"system"`` or
    ``"vendored"``, and version), whether O_DIRECT works in ``path`` (a directory;
    default: the current one), whether ``nfs://`` targets work here (``"nfs"``: built in,
    usable, and the reason when not, e.g. libnfs not installed), and whether a CUDA
    runtime was found.

    For an ``nfs://`` URL there is no local directory to probe: ``"target"`` gives instead
    the server, the export holding the path, the path inside it, whether it exists, and the
    connections, depth and timeout saves and loads there use (the server is asked, so an
    unreachable one raises the error a load would). Other URL schemes raise
    ``UnsupportedTargetError``.

    CUDA is not initialised here unless it already is (by PyTorch, or a save of GPU
    tensors) or ``initialize_cuda=True``: a process that initialised CUDA and then
    forks (DataLoader workers) has children that cannot use CUDA. Uninitialised,
    ``info["cuda"]`` names the runtime found, with ``"available": None`` and
    ``"device_count": None`` (unknown) and ``"initialized": False``."""
    if path is not None and not kind_of(path, "backend_info").os_paths:
        target, inner = resolve(path, "backend_info")  # before the probes: a bad URL fails at once
        return {**_machine(), "checksum": _core.CHECKSUM_ALGORITHM, "cuda": _cuda(initialize_cuda),
                "target": target.facts(inner)}
    directory = os.fspath(path) if path is not None else os.getcwd()
    if os.path.isfile(directory):
        directory = os.path.dirname(os.path.abspath(directory))
    return {
        **_machine(),
        "directory": os.path.abspath(directory),
        "direct_io": _core.probe_direct(directory),
        "checksum": _core.CHECKSUM_ALGORITHM,
        "cuda": _cuda(initialize_cuda),
        # What Writer() would use here: a tuning saved for this file system, else the defaults.
        "settings": _tuning.resolve(directory, {}),
    }


def _machine() -> dict[str, Any]:
    """The facts of this machine and build, wherever the checkpoints go (CUDA's aside)."""
    ring_err = _core.io_uring_probe() if _core.io_uring_compiled() else _errno.ENOSYS
    return {
        "version": _core.__version__,
        "backend": "io_uring" if _core.io_uring_compiled() and ring_err == 0 else "threads",
        "io_uring_compiled": _core.io_uring_compiled(),
        "io_uring_runtime": ring_err == 0,
        "io_uring_error": None if ring_err == 0 else f"{_errno.errorcode.get(ring_err, ring_err)}: {os.strerror(ring_err)}",
        "liburing": _core.io_uring_library(),
        "nfs": _core.nfs_support(),
        "zstd": _core.zstd_support(),  # Writer(compress=): libzstd, loaded at run time
    }


def _cuda(initialize_cuda: bool | None) -> dict[str, Any]:
    return _no_driver(_core.cuda_info(initialize=_cuda_initialized() if initialize_cuda is None else initialize_cuda))


def _cuda_initialized() -> bool:
    """Whether PyTorch has initialised CUDA in this process (then asking costs nothing)."""
    import torch
    return bool(torch.cuda.is_initialized())


def _no_driver(cuda: dict[str, Any]) -> dict[str, Any]:
    """Uninitialised, a runtime that reports driver version 0 (cudaDriverGetVersion's "no
    driver installed", asked without initialising CUDA) is known to have no GPU to use:
    say so, rather than "found but not initialised" as if there might be one."""
    if cuda.get("initialized") or cuda.get("driver_version") != 0 or not cuda.get("library") \
            or cuda.get("available") is False:  # already refused, with its own reason (not a runtime at all)
        return cuda
    return {**cuda, "available": False, "device_count": 0,
            "reason": f"a CUDA runtime ({cuda['library']}) was found but no CUDA driver (driver version 0): "
                      "no GPU can be used here"}
