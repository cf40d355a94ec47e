"""The plan of one read job of ``CheckpointDir.read``: the stripes to open, the pieces to
verify, where each byte is placed (device and host targets, owned tensors, whole-stripe
buffers), and, once read, the stripe headers checked and the buffers tensors view."""

from __future__ import annotations

import functools
import os
import stat

import torch
from typing import Any

from ..system import cuda as _cuda
from .. import _core, defaults
from ..format import dtypes
from ..errors import ChecksumMismatchError, CorruptCheckpointError, UnsafeCheckpointError
from ..format import Manifest, TensorEntry, check_stripe_header, piece_ranges

stored_dtype = functools.lru_cache(maxsize=None)(dtypes.dtype_from_name)  # per tensor of 100,000: no lookup twice
_TYPED_EMPTY = frozenset(dt for dt in (torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.int64,
                                       torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool, torch.complex64,
                                       torch.complex128))


DIRECT = -2  # _core.Placement's device of memory the load reads straight into


def host_empty(e: TensorEntry) -> torch.Tensor:
    """A new CPU tensor owning exactly the bytes of stored entry ``e`` (offset 0)."""
    dt = stored_dtype(e.dtype)
    if dt in _TYPED_EMPTY:
        return torch.empty(e.shape, dtype=dt)
    return torch.empty(e.nbytes, dtype=torch.uint8).view(dt).view(e.shape)



def stripe_specs(m: Manifest, file_ids: list[int], base: str, path: str, target: Any = None) -> list[tuple[str, int]]:
    """(path, size) of each stripe to read, each checked to be a regular file of its recorded size
    (in the directory ``base`` of this machine, or of ``target`` where one is given)."""
    specs = []
    for fi in file_ids:
        fe = m.files[fi]
        full = os.path.join(base, fe.name)
        check_stripe_size(target, full, fe.name, path, fe.size)
        specs.append((full, fe.size))
    return specs


def check_stripe_size(target: Any, full: str, name: str, path: str, recorded: int) -> None:
    """The stripe ``full`` (``name`` in the checkpoint ``path``, as messages show it) must be
    a regular file of its ``recorded`` size: the one check, and the one text, of load,
    verify, convert and ls. ``target``: None for this machine's files."""
    if target is not None:
        size = target.file_size(full)
        if size is None and not target.exists(full):
            raise CorruptCheckpointError(f"stripe {name} is missing from {path}", file=name)
        if size is None:
            raise UnsafeCheckpointError(f"stripe {name} in {path} is not a regular file", file=name)
    else:
        try:
            st = os.lstat(full)
        except FileNotFoundError:
            raise CorruptCheckpointError(f"stripe {name} is missing from {path}", file=name) from None
        if not stat.S_ISREG(st.st_mode):  # a symlink may lead out of the checkpoint; a directory is no stripe
            raise UnsafeCheckpointError(f"stripe {name} in {path} is not a regular file", file=name)
        size = st.st_size
    if size != recorded:
        what = "truncated" if size < recorded else "longer than recorded"
        raise CorruptCheckpointError(f"stripe {name} is {size} bytes, the manifest says {recorded} ({what})",
                                     file=name)


def checksum_pieces(m: Manifest, wanted: set[str], slot: dict[int, int]
                     ) -> tuple[list[tuple[int, int, int, int]], list[str]]:
    """The checksummed pieces to verify (slot, offset, nbytes, hash), and the key of each."""
    pieces: list[tuple[int, int, int, int]] = []
    owners: list[str] = []
    for k in wanted:
        e = m.tensors[k]
        if len(e.checksums) == 1:  # most tensors: one piece, the whole tensor
            pieces.append((slot[e.file], e.offset, e.nbytes, int(e.checksums[0], 16)))
            owners.append(k)
            continue
        for (off, n), h in zip(piece_ranges(e.offset, e.nbytes, m.block_bytes), e.checksums):
            pieces.append((slot[e.file], off, n, int(h, 16)))
            owners.append(k)
    return pieces, owners


def target_placements(m: Manifest, slot: dict[int, int], targets: dict[str, torch.Tensor],
                       hosted: dict[str, torch.Tensor]) -> tuple[_cuda.Scatter, list[tuple[int, int, int, int, int]]]:
    """The scatter of the device targets and the placements of device and host targets, each checked."""
    # _core.Placement: (file, offset, nbytes, device, address); device -1 is host memory.
    placements: list[tuple[int, int, int, int, int]] = []
    on_gpu: list[_cuda.Item] = []
    for k, t in targets.items():
        e = m.tensors[k]
        if t.device.type != "cuda" or not t.is_contiguous() or t.numel() * t.element_size() != e.nbytes:
            raise ValueError(f"device target for {k!r} must be a contiguous CUDA tensor of {e.nbytes} bytes")
        if e.nbytes:
            on_gpu.append((t, e.nbytes, slot[e.file], e.offset, t.device.index))
    # Small targets side by side in a stripe land in one device buffer each run
    # (one copy per chunk), scattered into them once the load is verified.
    if on_gpu:
        _cuda.refuse_capture("a load to GPU tensors", {it[4] for it in on_gpu})
    scatter = _cuda.Scatter(on_gpu, defaults.GATHER_TENSOR_BYTES, defaults.GATHER_RUN_BYTES)
    placements.extend(scatter.placements)
    for k, t in hosted.items():
        e = m.tensors[k]
        if (t.device.type != "cpu" or not t.is_contiguous() or t.dtype != stored_dtype(e.dtype)
                or t.numel() * t.element_size() != e.nbytes):
            raise ValueError(f"host target for {k!r} must be a contiguous CPU tensor of {e.nbytes} bytes")
        if e.nbytes:
            placements.append((slot[e.file], e.offset, e.nbytes, -1, t.data_ptr()))
    return scatter, placements


def place_stripes(m: Manifest, file_ids: list[int], slot: dict[int, int], placements: list,
                   stripes: dict[int, torch.Tensor]) -> None:
    """zero_copy: whole-stripe buffers (into ``stripes``), filled like owned tensors: each
    byte not placed elsewhere is placed at its own offset in its stripe's buffer. The reads
    go to the job's huge-page bounce slots, so they reach the disk as large requests; read
    straight into 4 KiB pages they are cut at the device's segment limit (254 pages on
    virtio-blk: ~1 MiB requests), which cost zero_copy more than the copy out of the slots
    costs owned loads."""
    taken: dict[int, list[tuple[int, int]]] = {}
    for p in placements:
        taken.setdefault(p[0], []).append((p[1], p[1] + p[2]))
    for fi in file_ids:
        size = m.files[fi].size
        buf = stripes[fi] = torch.empty(size, dtype=torch.uint8)
        pos = 0
        for a, b in sorted(taken.get(slot[fi], [])) + [(size, size)]:
            if a > pos:
                placements.append((slot[fi], pos, a - pos, -1, buf.data_ptr() + pos))
            pos = max(pos, b)


def direct_empty(e: TensorEntry) -> torch.Tensor:
    """A new CPU tensor owning exactly the bytes of stored entry ``e``, in memory the load
    reads them into with O_DIRECT (``_core.owned_tensor``: freed with the tensor)."""
    raw = torch.from_dlpack(_core.owned_tensor(e.offset, e.nbytes))
    return raw.view(stored_dtype(e.dtype)).view(e.shape)


def reads_direct(e: TensorEntry) -> bool:
    """Whether a load reads stored entry ``e`` straight into the memory of the tensor it
    returns (O_DIRECT, no bounce slot): DIRECT_TENSOR_BYTES and more, at an offset its
    dtype's alignment allows."""
    return e.nbytes >= defaults.DIRECT_TENSOR_BYTES and e.offset % max(1, dtypes.itemsize(stored_dtype(e.dtype))) == 0


def place_owned(m: Manifest, wanted: set[str], file_ids: list[int], slot: dict[int, int], targets: dict,
                 hosted: dict, placements: list, owned: dict[str, torch.Tensor],
                 headers: dict[int, torch.Tensor], direct: bool = False,
                 owned_into: dict[str, torch.Tensor] | None = None) -> None:
    """Owned CPU tensors (into ``owned``) for the keys no target takes, and each stripe's header (into ``headers``).
    direct: tensors that ``reads_direct`` are read straight into their memory, the rest
    copied out of bounce slots. owned_into: for such keys, the tensor to read into and
    return instead of a new one (its address agrees with the entry's file offset modulo
    4096, and whole pages around it are its own: ``shm_exchange.Board``)."""
    for k in wanted:
        if k not in targets and k not in hosted:
            e = m.tensors[k]
            if direct and reads_direct(e):
                t = owned[k] = owned_into[k] if owned_into and k in owned_into else direct_empty(e)
                placements.append((slot[e.file], e.offset, e.nbytes, DIRECT, t.data_ptr()))
                continue
            t = owned[k] = host_empty(e)
            if e.nbytes:
                placements.append((slot[e.file], e.offset, e.nbytes, -1, t.data_ptr()))
    for fi in file_ids:
        headers[fi] = torch.empty(m.files[fi].header_bytes, dtype=torch.uint8)
        placements.append((slot[fi], 0, m.files[fi].header_bytes, -1, headers[fi].data_ptr()))


def mismatch(m: Manifest, file_ids: list[int], pieces: list[tuple[int, int, int, int]], owners: list[str],
              bad: list[tuple[int, int]]) -> ChecksumMismatchError:
    """The error for the first damaged piece of a load."""
    pi, actual = bad[0]
    fi, off, n, expected = pieces[pi]
    key = owners[pi]
    fe = m.files[file_ids[fi]]
    e = m.tensors[key]
    more = f" ({len(bad) - 1} more damaged pieces)" if len(bad) > 1 else ""
    return ChecksumMismatchError(
        f"checksum mismatch in {fe.name}, tensor {key!r}, bytes {off - e.offset}..{off - e.offset + n} of "
        f"the tensor (file offset {off}): expected {expected:016x}, got {actual:016x}{more}",
        file=fe.name, tensor=key, offset=off, expected=f"{expected:016x}", actual=f"{actual:016x}")


def checked_bases(m: Manifest, file_ids: list[int], buffers: list, headers: dict[int, torch.Tensor],
                   stripes: dict[int, torch.Tensor]) -> dict[int, torch.Tensor]:
    """Each stripe's header checked against the manifest; the buffer each stripe's tensors
    view, by file id (none for a stripe wholly placed)."""
    bases = {}
    by_file: dict[int, list[TensorEntry]] = {fi: [] for fi in file_ids}
    for e in m.tensors.values():
        if e.file in by_file:
            by_file[e.file].append(e)
    for i, fi in enumerate(file_ids):
        fe = m.files[fi]
        held = headers.get(fi, stripes.get(fi))
        header = memoryview(held.numpy()) if held is not None else memoryview(buffers[i])
        check_stripe_header(header[: fe.header_bytes], fe, by_file[fi])
        if fi in stripes:
            bases[fi] = stripes[fi]
        elif buffers[i] is not None:
            bases[fi] = torch.frombuffer(buffers[i], dtype=torch.uint8)
    return bases
