"""``flashwrite convert SRC DST``: between flashwrite checkpoints and torch.save files,
safetensors files, Hugging Face sharded directories and DCP directories.

Readers live in ``sources``. Writers here stream: flashwrite, safetensors and
Hugging Face outputs are written tensor piece by piece (checksummed as they go
for flashwrite), so a conversion from safetensors or DCP holds one piece or one
batch in memory. torch.save and DCP outputs are built by torch itself and need
the state in memory. Tensor bytes are copied exactly; the nested structure and
non-tensor leaves of a flashwrite or torch.save source travel in a small
record (a safetensors ``__metadata__`` entry, or ``flashwrite-tree.json`` in a
directory) so converting back restores them.
"""

from __future__ import annotations

import json
import os
import urllib.parse
import warnings
from typing import Any

import torch

from .. import _core, defaults
from ..saving import commit
from ..format import dtypes
from ..errors import CorruptCheckpointError
from ..state.flatten import FlatTensor, referenced_keys, unflatten
from ..format import build_index, build_manifest, piece_ranges
from ..layout.plan import PlannedFile, plan_files
from ..targets.locate import kind_of, resolve
from ..targets.target import LOCAL, Target, check_path, shown
from .common import UsageError
from .sources import FORMATS, META_KEY, SIDECAR, Item, Source, detect, flat_tree, open_source

HF_SHARD_BYTES = 5 << 30  # what transformers' save_pretrained uses by default
_EXT = {".safetensors": "safetensors", ".pt": "torch", ".pth": "torch", ".bin": "torch", ".ckpt": "torch"}


def target_format(src_kind: str, dst: str, to: str | None) -> str:
    if to:
        if to not in FORMATS:
            raise UsageError(f"unknown --to {to!r}; choose from {', '.join(FORMATS)}")
        return to
    # A URL's extension is its path's: nfs://h/x.safetensors?mountport=P names a .safetensors
    name = dst if kind_of(dst, "convert").os_paths else urllib.parse.urlsplit(dst).path
    ext = os.path.splitext(name)[1].lower()
    if ext in _EXT:
        return _EXT[ext]
    if src_kind != "flashwrite":
        return "flashwrite"
    raise UsageError(f"cannot tell which format to write to {dst!r}: name it *.safetensors or *.pt, or pass "
                     "--to hf|dcp|torch|safetensors")


def _record(src: Source) -> dict:
    """What a foreign format cannot hold itself: tree, ties, true dtypes, metadata."""
    return {"tree": src.tree if src.tree is not None else flat_tree([i.key for i in src.items]),
            "aliases": src.aliases, "metadata": src.metadata,
            "dtypes": {**{i.key: dtypes.dtype_name(i.dtype) for i in src.items},
                       **{f"{i.key}#shape": list(i.shape) for i in src.items if not dtypes.safetensors_code(i.dtype)}}}


def _plan(src: Source, stripes: int, metadata: dict | None = None) -> list[PlannedFile]:
    flat = [FlatTensor(i.key, torch.empty(i.shape, dtype=i.dtype, device="meta")) for i in src.items]
    files = plan_files(flat, stripes, metadata=metadata)
    for f in files:
        for p in f.tensors:
            p.device = "cpu"
    return files


class _OutFile:
    """One output file, created new. Locally its bytes are written as they come and fsync'd
    at the end; on another target (nfs://, whose client sends a file in one call) they are
    gathered, one file at a time, and written durable at the end."""

    def __init__(self, target: Target, path: str):
        self.target, self.path = target, path
        self.fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644) \
            if target.os_paths else None
        self.buf = bytearray()

    def write(self, data: Any) -> None:
        if self.fd is None:
            self.buf += data
            return
        view = memoryview(data)
        while view:
            view = view[os.write(self.fd, view):]

    def close(self, ok: bool) -> None:
        if self.fd is None:
            if ok:
                self.target.write_durable(self.path, self.buf)
            return
        try:
            if ok:
                os.fsync(self.fd)
        finally:
            os.close(self.fd)


def _write_files(directory: str, files: list[PlannedFile], src: Source, progress: Any,
                 block: int | None, target: Target = LOCAL) -> dict[str, list[int]]:
    """Write planned files from the source into ``directory`` on ``target``, sequentially
    per file, durable. With a block, returns every tensor's per-piece checksums (the
    flashwrite manifest's)."""
    items = {i.key: i for i in src.items}
    sums: dict[str, list[int]] = {}
    for f in files:
        out, ok = _OutFile(target, os.path.join(directory, f.name)), False
        try:
            out.write(f.header)
            for p in sorted(f.tensors, key=lambda p: p.offset):
                pieces = piece_ranges(p.offset, p.nbytes, block) if block else []
                hashes, pending, got = [], bytearray(), 0
                for chunk in src.chunks(items[p.key]):
                    got += len(chunk)
                    if got > p.nbytes:
                        break
                    out.write(chunk)
                    if block:
                        pending += chunk
                        while len(hashes) < len(pieces) and len(pending) >= pieces[len(hashes)][1]:
                            n = pieces[len(hashes)][1]
                            hashes.append(_core.checksum(bytes(pending[:n])))
                            del pending[:n]
                    progress.advance(len(chunk))
                if got != p.nbytes:
                    raise OSError(5, f"source gave {got} bytes for tensor {p.key!r}, expected {p.nbytes}", src.path)
                if block:
                    sums[p.key] = hashes
            ok = True
        finally:
            out.close(ok)
    return sums


def to_flashwrite(src: Source, dst: str, progress: Any, *, stripes: int, overwrite: bool) -> None:
    """``dst`` may be an nfs:// URL: the checkpoint is committed there as a save commits it."""
    block = defaults.CHUNK_BYTES
    files = _plan(src, stripes)
    target, final = resolve(dst, "convert")
    if target.exists(final) and not overwrite:
        raise FileExistsError(17, "already exists (pass --overwrite to replace a flashwrite checkpoint)",
                              target.show(final))
    tmp = commit.prepare(final, overwrite, target)
    try:
        sums = _write_files(tmp, files, src, progress, block, target)
        tree = src.tree if src.tree is not None else flat_tree([i.key for i in src.items])
        manifest = build_manifest(files, sums, src.aliases, tree, block, _core.__version__,
                                  {**src.metadata, "converted_from": src.kind})
        commit.finalize(tmp, final, manifest, build_index(manifest), overwrite, target=target)
    except BaseException:
        commit.discard(tmp, target)
        raise


def _publish_file(tmp: str, dst: str, overwrite: bool) -> None:
    if os.path.lexists(dst) and not overwrite:
        os.unlink(tmp)
        raise FileExistsError(17, "already exists (pass --overwrite to replace it)", dst)
    os.replace(tmp, dst)
    _core.fsync_dir(os.path.dirname(os.path.abspath(dst)))


def _tmp_file(dst: str) -> str:
    d, n = os.path.split(os.path.abspath(dst))
    os.makedirs(d, exist_ok=True)
    return os.path.join(d, f".{n}{commit.TMP_MARK}{os.getpid()}")


def to_safetensors(src: Source, dst: str, progress: Any, *, overwrite: bool) -> None:
    if os.path.lexists(dst) and not overwrite:
        raise FileExistsError(17, "already exists (pass --overwrite to replace it)", dst)
    files = _plan(src, 1, {META_KEY: json.dumps(_record(src), separators=(",", ":"))})
    tmp = _tmp_file(dst)
    files[0].name = os.path.basename(tmp)
    try:
        _write_files(os.path.dirname(tmp), files, src, progress, None)
        _publish_file(tmp, dst, overwrite)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def _publish_dir(tmp: str, dst: str) -> None:
    _core.fsync_dir(tmp)
    if os.path.lexists(dst):
        raise FileExistsError(17, "already exists", dst)
    os.rename(tmp, dst)
    _core.fsync_dir(os.path.dirname(os.path.abspath(dst)))


def _sidecar(tmp: str, src: Source) -> None:
    with open(os.path.join(tmp, SIDECAR), "w") as fh:
        json.dump(_record(src), fh, separators=(",", ":"))
        fh.flush()
        os.fsync(fh.fileno())


def to_hf(src: Source, dst: str, progress: Any, *, shards: int | None) -> None:
    n = shards or max(1, -(-src.nbytes // HF_SHARD_BYTES))
    files = _plan(src, n)
    if os.path.lexists(dst):
        raise FileExistsError(17, "already exists", dst)
    tmp = commit.temp_dir_for(dst)
    os.makedirs(tmp)
    try:
        _write_files(tmp, files, src, progress, None)
        index = {"metadata": {"total_size": src.nbytes},
                 "weight_map": {p.key: f.name for f in files for p in f.tensors}}
        with open(os.path.join(tmp, "model.safetensors.index.json"), "w") as fh:
            json.dump(index, fh, indent=1)
        _sidecar(tmp, src)
        _copy_hf_files(src, tmp)
        _publish_dir(tmp, dst)
    except BaseException:
        commit.discard(tmp)
        raise


HF_FILES = ("config.json", "generation_config.json")  # what from_pretrained needs besides the weights


def _copy_hf_files(src: Source, tmp: str) -> None:
    """The model's config (``hf_config=`` of a flashwrite save, or a Hugging Face source's
    own) goes along: without it from_pretrained cannot build the model."""
    if not os.path.isdir(src.path):
        return
    for name in HF_FILES:
        path = os.path.join(src.path, name)
        if os.path.isfile(path) and not os.path.islink(path):
            with open(path, "rb") as fh, open(os.path.join(tmp, name), "wb") as out:
                out.write(fh.read(64 << 20))
                out.flush()
                os.fsync(out.fileno())


def _materialize(src: Source, progress: Any) -> dict[str, torch.Tensor]:
    out = {}
    for it in src.items:
        t = torch.empty(it.shape, dtype=it.dtype)
        buf = t.reshape(-1).view(torch.uint8).numpy() if t.numel() else None
        pos = 0
        for chunk in src.chunks(it):
            if pos + len(chunk) > it.nbytes:
                raise OSError(5, f"source gave too many bytes for tensor {it.key!r}", src.path)
            buf[pos:pos + len(chunk)] = memoryview(chunk).cast("B")
            pos += len(chunk)
            progress.advance(len(chunk))
        if pos != it.nbytes:
            raise OSError(5, f"source gave {pos} bytes for tensor {it.key!r}, expected {it.nbytes}", src.path)
        out[it.key] = t
    return out


def to_torch(src: Source, dst: str, progress: Any, *, overwrite: bool, allow_pickle: bool) -> None:
    if os.path.lexists(dst) and not overwrite:
        raise FileExistsError(17, "already exists (pass --overwrite to replace it)", dst)
    tensors = _materialize(src, progress)
    state = unflatten(src.tree, tensors.__getitem__, allow_pickle=allow_pickle) if src.tree is not None \
        else tensors
    tmp = _tmp_file(dst)
    try:
        with open(tmp, "wb") as fh:
            torch.save(state, fh)
            fh.flush()
            os.fsync(fh.fileno())
        _publish_file(tmp, dst, overwrite)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def to_dcp(src: Source, dst: str, progress: Any, *, allow_pickle: bool) -> None:
    """DCP of the state as it was saved: with a tree (flashwrite, torch.save sources) the
    nested state itself goes to ``dcp.save``, so non-tensor leaves (as DCP's pickled bytes
    items) and tied tensors (under every name) are there and ``dcp.load`` with the
    original state as its template works wherever it works on torch's own ``dcp.save``."""
    import torch.distributed.checkpoint as dcp
    if os.path.lexists(dst):
        raise FileExistsError(17, "already exists", dst)
    tensors = _materialize(src, progress)
    state = unflatten(src.tree, tensors.__getitem__, allow_pickle=allow_pickle) if src.tree is not None \
        else tensors
    if not isinstance(state, dict):
        raise UsageError(f"DCP stores a dict at the top; this {src.kind} checkpoint holds a "
                         f"{type(state).__name__}")
    tmp = commit.temp_dir_for(dst)
    os.makedirs(tmp)
    try:
        with warnings.catch_warnings():  # "assuming ... a single process": that is the intent
            warnings.simplefilter("ignore", UserWarning)
            dcp.save(state, storage_writer=dcp.FileSystemWriter(tmp, sync_files=True), no_dist=True)
        _sidecar(tmp, src)
        _publish_dir(tmp, dst)
    except BaseException:
        commit.discard(tmp)
        raise


def _check_remote(src: str, kind: str, dst: str, out_kind: str) -> None:
    """nfs:// on either side: flashwrite checkpoints only (read piece by piece from the
    server, or committed there as a save is); the other formats go through local paths."""
    if not kind_of(src, "convert").os_paths and kind != "flashwrite":
        raise UsageError(f"{src}: from nfs:// convert reads flashwrite checkpoints, not {kind}; copy the {kind} "
                         "input to a local (or mounted) path first")
    if not kind_of(dst, "convert").os_paths and out_kind != "flashwrite":
        raise UsageError(f"{dst}: to nfs:// convert writes flashwrite checkpoints (--to flashwrite), not "
                         f"{out_kind}; write {out_kind} to a local (or mounted) path")


def _check_complete(src: Source) -> None:
    """Refuse, before writing, a source whose tree names tensors it cannot give: the
    output would be a checkpoint that load refuses."""
    if src.tree is None:
        return
    lost = referenced_keys(src.tree) - {i.key for i in src.items}
    if lost:
        raise CorruptCheckpointError(f"{shown(src.path)}: its flashwrite record names {len(lost)} tensor(s) this "
                                     f"{src.kind} input does not hold, e.g. {sorted(lost)[0]!r}; converting would "
                                     "lose them, so nothing was written")


def convert(src_path: str, dst: str, *, src_format: str | None = None, dst_format: str | None = None,
            allow_pickle: bool = False, stripes: int | None = None, shards: int | None = None,
            overwrite: bool = False, progress: Any) -> dict:
    src_path, dst = check_path(src_path, "convert"), check_path(dst, "convert")
    if src_format and src_format not in FORMATS:
        raise UsageError(f"unknown --from {src_format!r}; choose from {', '.join(FORMATS)}")
    kind = src_format or (detect(src_path) if kind_of(src_path, "convert").os_paths else "flashwrite")
    out_kind = target_format(kind, dst, dst_format)
    _check_remote(src_path, kind, dst, out_kind)
    if shown(src_path) == shown(dst):
        raise UsageError(f"{shown(dst)}: source and destination are the same path; name another destination")
    src = open_source(src_path, kind, allow_pickle)
    try:
        _check_complete(src)
        for n in src.notes:
            progress.note(f"note: {n}")
        progress.start(src.nbytes, f"convert {kind} -> {out_kind}")
        if out_kind == "flashwrite":
            to_flashwrite(src, dst, progress, stripes=stripes or defaults.STRIPES, overwrite=overwrite)
        elif out_kind == "safetensors":
            to_safetensors(src, dst, progress, overwrite=overwrite)
        elif out_kind == "hf":
            to_hf(src, dst, progress, shards=shards)
        elif out_kind == "torch":
            to_torch(src, dst, progress, overwrite=overwrite, allow_pickle=allow_pickle)
        else:
            to_dcp(src, dst, progress, allow_pickle=allow_pickle)
        progress.finish()
    finally:
        src.close()
    return {"source": shown(src_path), "from": kind, "destination": shown(dst), "to": out_kind,
            "tensors": len(src.items), "bytes": src.nbytes, "notes": src.notes}


__all__ = ["convert", "target_format", "Item"]
