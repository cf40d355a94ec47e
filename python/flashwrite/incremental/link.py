"""Incremental saves: stripes whose bytes did not change are hard-linked, not written.

A save with ``incremental=True`` into a directory whose siblings hold a committed
checkpoint (the *base*: the newest by its manifest's time) plans in three parts:

- **linked**: a stripe of the base whose every tensor is still in the state, with the
  same dtype and shape and the same content, is hard-linked into the new checkpoint
  under a new name. Its bytes, header and checksums are the base's, so it is
  byte-identical to what a write would produce at those offsets, and the load checks
  it against the manifest like any other stripe.
- **stable**: tensors whose content matched the base at the last save but that share a
  stripe with a changed tensor: planned into stripes of their own (so the next save
  can link them whole), written.
- **hot**: changed, new, and tensors of stripes marked hot in the base (not compared
  again, except every ``RECHECK_HOT_EVERY`` saves, so a tensor that stops changing
  moves to the stable stripes): planned apart, written, marked hot.

Content is compared before ``save_async`` returns, straight from the source tensors
(``compare``: XXH3 per checksummed piece, unless the kernel saw no write to it since a
save hashed it): for a linked stripe that pass replaces the copy into the staging pool,
so the stall does not grow. The links are made right there too, before anything is staged: a link that the
file system refuses (EXDEV across file systems, EPERM, ENOTSUP, a base deleted
meanwhile) turns its stripe back into bytes to write, counted in ``SaveStats``.

Every checkpoint directory stays whole on its own: a hard link is a second name of the
same inode, so deleting the base (by hand or by a manager's retention) leaves this
checkpoint's files in place. The links sit in the temporary directory and are made
durable by the directory fsync that precedes the manifest (``commit.finalize``); the
linked inodes' bytes were durable since the base committed.

On nfs:// the links are NFS LINK calls made in the temporary directory on the server
(stable before the server replies), and the base is the last checkpoint this Writer
committed in that directory (a directory listing with a manifest read per entry would
cost round trips at every save); a new process's first save there writes everything.

In a multi-rank save (``process_group=``) each rank compares its own state with its own
part of the base (the base's ``ranks`` span for that rank, ``rank_part``) and links into
the shared temporary directory before it reports itself durable; rank 0's directory fsync
before the manifest makes every rank's links durable (an NFS LINK is stable when it
returns), and the merged manifest keeps each rank's section (``merge_sections``). No
collective is added: on nfs:// every rank notes the commit that rank 0's broadcast of the
outcome reports (its next base), and ranks may even pick different bases. A DCP save does
the same per rank, its DCP base seen as a multi-rank one (``flashwrite.dcp``).

GPU tensors are not compared before staging: a base stripe holding some is planned as a
*held* file that mirrors it, staged like any other, and linked by the native job if its
checksums come out equal, else written (``held``; local targets only, on nfs:// GPU
stripes are written).

With local snapshots (the memory tier) every stripe must be staged, since the snapshot is
the staging pool's copy of the whole state: every candidate stripe is then a held file,
staged and linked on storage by the job (``plan(hold_all=True)``). The snapshot itself is
copied whole at each save; keeping the previous snapshot's unchanged pages would need the
pool to hand the same slots to the same bytes from one save to the next.

Not covered (the save then writes everything and ``SaveStats.incremental`` says why):
DCP saves to nfs:// and ``hf_model=``.
"""

from __future__ import annotations

import dataclasses
import errno
import logging
import os
import threading
from dataclasses import dataclass, field
from typing import Any, Callable

from . import compare, held
from ..layout.names import parse_temp_name
from ..errors import CorruptCheckpointError, FlashwriteError
from ..state.flatten import Columns
from ..format import MANIFEST_NAME, MAX_MANIFEST_BYTES, Manifest, parse_manifest, read_manifest, safetensors_header
from ..layout.plan import PlannedFile, plan_files, stripe_name
from ..targets.target import LOCAL, Target

log = logging.getLogger("flashwrite")

SECTION = "incremental"        # the manifest's top-level section
RECHECK_HOT_EVERY = 8          # compare hot stripes again every this many incremental saves
HEADER_META = {"format": "pt", "writer": "flashwrite"}  # what linkable stripes carry: no per-save metadata

# Errors of os.link that mean "this file system cannot link here": write the bytes instead.
LINK_REFUSED = {errno.EXDEV, errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EMLINK, errno.EACCES,
                errno.ENOSYS}


@dataclass
class Base:
    """The committed checkpoint a save compares with."""
    path: str
    manifest: Manifest


@dataclass
class Plan:
    """What an incremental save writes and what it links."""
    files: list[PlannedFile]                       # every stripe of the new checkpoint, in manifest order
    linked: set[int] = field(default_factory=set)  # indices into files made by a link
    hot: set[int] = field(default_factory=set)     # indices into files planned from changed tensors
    checksums: dict[str, list[int]] = field(default_factory=dict)  # of the linked stripes' tensors
    base: str | None = None                        # name of the base checkpoint
    seq: int = 0                                   # incremental saves in a row, this one included
    fallbacks: int = 0                             # stripes written because their link was refused
    fallback_reason: str = ""
    compared_bytes: int = 0                        # bytes hashed from the source to compare
    watched_bytes: int = 0                         # bytes not hashed: no write reached them (write_watch)
    rechecked_bytes: int = 0                       # bytes the watch vouched for, hashed again all the same
    watch_misses: int = 0                          # tensors whose re-hash found a write the watch missed
    held: dict[int, held.HeldFile] = field(default_factory=dict)  # held files (held.py)
    settled: set[int] = field(default_factory=set)  # held files the job linked (held.settle)
    held_settled: bool = False

    @property
    def staged(self) -> list[PlannedFile]:
        """The files the save job stages (held ones included), in its order."""
        return [f for i, f in enumerate(self.files) if i not in self.linked]

    @property
    def written(self) -> list[PlannedFile]:
        return [f for i, f in enumerate(self.files) if i not in self.linked and i not in self.settled]

    @property
    def linked_bytes(self) -> int:
        return sum(self.files[i].size for i in self.linked | self.settled)


# ------------------------------------------------------------------ the base


def find_base(final: str) -> str | None:
    """The newest committed checkpoint beside ``final`` (``final`` itself included, for
    overwrite=True), by the time its manifest was written; None if there is none."""
    parent = os.path.dirname(os.path.abspath(final))
    best: tuple[int, str] | None = None
    try:
        entries = list(os.scandir(parent))
    except OSError:
        return None
    for e in entries:
        if parse_temp_name(e.name) is not None:
            continue
        try:
            if not e.is_dir(follow_symlinks=False):
                continue
            st = os.stat(os.path.join(e.path, MANIFEST_NAME))
        except OSError:
            continue
        if best is None or st.st_mtime_ns > best[0]:
            best = (st.st_mtime_ns, e.path)
    return best[1] if best else None


class BaseCache:
    """The last base read, kept while its manifest file is the same (one per Writer):
    a manifest of 100,000 tensors is not parsed again at every save. Also where the
    Writer notes the last checkpoint it committed in each directory (the base on targets
    that cannot be scanned cheaply: nfs://)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._key: tuple | None = None
        self._base: Base | None = None
        self._last: dict[str, str] = {}

    def committed(self, final: str) -> None:
        with self._lock:
            self._last[os.path.dirname(final)] = final

    def last_committed(self, final: str) -> str | None:
        with self._lock:
            return self._last.get(os.path.dirname(final))

    def get(self, path: str, target: Target = LOCAL) -> Base:
        if not target.scannable:  # read afresh: a remote file's identity is not cheap to check
            mpath = os.path.join(path, MANIFEST_NAME)
            size = target.file_size(mpath)
            if size is None:
                raise FileNotFoundError(errno.ENOENT, "no manifest", target.show(mpath))
            if size > MAX_MANIFEST_BYTES:
                raise ValueError(f"{target.show(mpath)} is larger than {MAX_MANIFEST_BYTES} bytes")
            return Base(path, parse_manifest(target.read_at(mpath, 0, size), sealed=True))
        st = os.stat(os.path.join(path, MANIFEST_NAME))
        key = (path, st.st_ino, st.st_mtime_ns, st.st_size)
        with self._lock:
            if self._key == key and self._base is not None:
                return self._base
        base = Base(path, read_manifest(path))
        with self._lock:
            self._key, self._base = key, base
        return base


def unusable(m: Manifest, block: int, rank: tuple[int, int] | None = None) -> str | None:
    """Why the checkpoint of manifest ``m`` cannot be a base for a save with checksum
    blocks of ``block`` bytes (by rank ``rank`` = (rank, world size) of a multi-rank
    save, or by one process), or None."""
    if m.block_bytes != block:
        return f"its checksum block ({m.block_bytes}) is not this writer's chunk size ({block})"
    for section in ("dcp", "hf"):
        if m.raw.get(section):
            return f"it is a {section} checkpoint"
    ranks = m.raw.get("ranks")
    if rank is None:
        return "it is a ranks checkpoint" if ranks else None
    if not isinstance(ranks, dict):
        return "it was saved by one process"
    spans = ranks.get("files")
    if ranks.get("world_size") != rank[1] or not isinstance(spans, list) or len(spans) != rank[1]:
        return f"it was saved by {ranks.get('world_size')} ranks, this save by {rank[1]}"
    span = spans[rank[0]]
    if (not isinstance(span, list) or len(span) != 2 or not all(isinstance(x, int) for x in span)
            or span[0] < 0 or span[1] < 0 or span[0] + span[1] > len(m.files)):
        return f"its ranks section has no valid file span for rank {rank[0]}"
    return None


def rank_part(m: Manifest, rank: int) -> Manifest:
    """Rank ``rank``'s part of the multi-rank manifest ``m`` (checked by ``unusable``): its
    stripes, the tensors in them (file indices rebased) and its incremental section, as a
    manifest of their own, which ``plan`` compares with like a single-process base."""
    first, count = m.raw["ranks"]["files"][rank]
    tensors = {k: te._replace(file=te.file - first) for k, te in m.tensors.items() if first <= te.file < first + count}
    raw_files = m.raw.get("files") if isinstance(m.raw.get("files"), list) else []
    section = m.raw.get(SECTION) if isinstance(m.raw.get(SECTION), dict) else {}
    per_rank = section.get("ranks") if isinstance(section.get("ranks"), list) else []
    mine = per_rank[rank] if rank < len(per_rank) and isinstance(per_rank[rank], dict) else None
    raw = {"files": raw_files[first:first + count]}
    if mine is not None:
        raw[SECTION] = mine
    return dataclasses.replace(m, files=m.files[first:first + count], tensors=tensors, raw=raw)


def merge_sections(merged: dict, parts: list[dict]) -> dict:
    """The incremental section of a multi-rank manifest ``merged`` from its per-rank
    manifests ``parts`` (as ``annotate`` marked them): each rank's own section under
    ``ranks`` (None for a rank that wrote everything without comparing), and the totals.
    Nothing is added when no rank saved incrementally."""
    sections = [p.get(SECTION) if isinstance(p.get(SECTION), dict) else None for p in parts]
    if not any(sections):
        return merged
    given = [s for s in sections if s is not None]
    bases = {s.get("base") for s in given}
    merged[SECTION] = {"base": bases.pop() if len(bases) == 1 and len(given) == len(sections) else None,
                       "linked_bytes": sum(s.get("linked_bytes", 0) for s in given),
                       "written_bytes": byte_counts(merged)[0],
                       "link_fallbacks": sum(s.get("link_fallbacks", 0) for s in given),
                       "ranks": sections}
    return merged


# ------------------------------------------------------------------ planning


def _subset(c: Columns, idx: list[int]) -> Columns:
    return Columns([c.keys[j] for j in idx], [c.sources[j] for j in idx], [c.dtypes[j] for j in idx],
                   [c.shapes[j] for j in idx], [c.nbytes[j] for j in idx], [c.ptrs[j] for j in idx],
                   [c.devices[j] for j in idx])


def _read_header(target: Target, path: str, nbytes: int, size: int) -> bytes | None:
    """The first ``nbytes`` of stripe ``path`` if it is a regular file of ``size`` bytes, else None."""
    try:
        if target.file_size(path) != size:
            return None
        data = target.read_at(path, 0, nbytes)
    except OSError:
        return None
    return data if len(data) == nbytes else None


def _header_meta(header: bytes, size: int, name: str) -> dict[str, str] | None:
    """The metadata of a stripe's header (the first bytes of a ``size``-byte file), parsed by
    the one safetensors parser; None where it is not a valid header."""
    try:
        return safetensors_header.parse(header, size, name).metadata
    except CorruptCheckpointError:
        return None


def _mirrorable(base: Base, files: list[int], target: Target) -> list[tuple[int, str, bytes]]:
    """(file, path, header bytes) of the base stripes ``files`` that a new stripe can
    mirror byte for byte: whole, and carrying no save's metadata (the others are planned
    as stable instead)."""
    out = []
    for fi in files:
        fe = base.manifest.files[fi]
        src = os.path.join(base.path, fe.name)
        header = _read_header(target, src, fe.header_bytes, fe.size)
        if header is not None and _header_meta(header, fe.size, fe.name) == HEADER_META:
            out.append((fi, src, header))
    return out


def _mirror(out: Plan, columns: Columns, base: Base, by_file: list[list[Any]], where: dict[str, int], fi: int,
            name: str, header: bytes) -> list[Any]:
    """Plan base stripe ``fi`` again as ``name`` (its header, its tensors at the same
    offsets); its entries, by offset."""
    entries = sorted(by_file[fi], key=lambda te: te.offset)
    out.files.append(PlannedFile(name, header, base.manifest.files[fi].size, columns, [where[te.key] for te in entries],
                                 [te.offset for te in entries]))
    return entries


def _link(out: Plan, columns: Columns, base: Base, by_file: list[list[Any]], where: dict[str, int],
          unchanged_files: list[int], tmp: str, prefix: str, target: Target) -> set[int]:
    """Hard-link the unchanged stripes into ``tmp`` under their final names
    (<prefix>-linked-K-of-N: a link is never renamed); the columns they cover. After the
    first link that fails, the rest are written (counted in ``out.fallbacks``)."""
    claimed: set[int] = set()
    linkable = _mirrorable(base, unchanged_files, target)
    for k, (fi, src, header) in enumerate(linkable):
        name = stripe_name(f"{prefix}-linked", k, len(linkable))
        if out.fallback_reason:
            out.fallbacks += 1
            continue
        try:
            target.link(src, os.path.join(tmp, name))
        except OSError as e:
            out.fallbacks += 1
            out.fallback_reason = f"{errno.errorcode.get(e.errno, e.errno)}: {e.strerror} (linking {src})"
            log.info("flashwrite: incremental save writes the stripes it could not link: %s", out.fallback_reason)
            continue
        entries = _mirror(out, columns, base, by_file, where, fi, name, header)
        out.linked.add(len(out.files) - 1)
        for te in entries:
            out.checksums[te.key] = [int(h, 16) for h in te.checksums]
        claimed.update(where[te.key] for te in entries)
    return claimed


def _hold(out: Plan, columns: Columns, base: Base, by_file: list[list[Any]], where: dict[str, int],
          files: list[int], prefix: str, target: Target) -> set[int]:
    """Plan the base stripes ``files`` (tensors not compared: on a GPU) as held files
    mirroring them (``held``); the columns they cover."""
    claimed: set[int] = set()
    mirrors = _mirrorable(base, files, target)
    for k, (fi, src, header) in enumerate(mirrors):
        entries = _mirror(out, columns, base, by_file, where, fi, stripe_name(f"{prefix}-held", k, len(mirrors)), header)
        out.held[len(out.files) - 1] = held.held_file(src, entries, base.manifest.block_bytes)
        claimed.update(where[te.key] for te in entries)
    return claimed


def _plan_rest(out: Plan, columns: Columns, left: list[int], stable: list[int], *, stripes: int, prefix: str,
               metadata: dict[str, str] | None) -> None:
    """Plan what is to be written: the tensors unchanged at this save in stripes of their
    own (the next save links them whole), the changed ("hot") ones in others."""
    sset = set(stable)
    hot = [j for j in left if j not in sset]
    nbytes = columns.nbytes
    hb = sum(nbytes[j] for j in hot)
    # A load reads the stripes side by side, so the largest one sets its time: the stable
    # tensors get the writer's stripe count (fewer could put two large tensors in one),
    # the hot ones stripes no larger than a full save's (total / stripes).
    per = max(1, -(-sum(nbytes) // stripes))  # of the whole state, linked stripes included
    n_stable = stripes if stable else 0
    n_hot = max(1, -(-hb // per)) if hot else 0
    for idx, n, kind, meta in ((stable, n_stable, "stable", None), (hot, n_hot, "hot", metadata)):
        if not idx:
            continue
        for f in plan_files(None, n, prefix=f"{prefix}-{kind}", metadata=meta, columns=_subset(columns, idx)):
            if kind == "hot":
                out.hot.add(len(out.files))
            out.files.append(f)


def plan(columns: Columns, base: Base, tmp: str, *, stripes: int, prefix: str, metadata: dict[str, str] | None,
         threads: int, target: Target = LOCAL, hold_all: bool = False) -> Plan:
    """Compare the state of ``columns`` with ``base``, link the stripes that did not change
    into ``tmp`` (the save's temporary directory on ``target``), and plan the rest.
    hold_all: every candidate stripe is a held file (a save whose local snapshot needs
    every byte staged), none is compared before staging."""
    m = base.manifest
    section = m.raw.get(SECTION) if isinstance(m.raw.get(SECTION), dict) else {}
    prev_seq = section.get("seq", 0) if isinstance(section.get("seq"), int) else 0
    seq = prev_seq + 1
    where = {k: j for j, k in enumerate(columns.keys)}
    by_file: list[list[Any]] = [[] for _ in m.files]
    for te in m.tensors.values():
        by_file[te.file].append(te)
    cands, holds = compare.candidates(columns, m, by_file, where, recheck=seq % RECHECK_HOT_EVERY == 0)
    if not target.os_paths:
        holds = []  # held files are local stripes: on nfs:// GPU stripes are written
    if (held.HOLD_HOST or hold_all) and target.os_paths:
        cands, holds = [], holds + cands
    found = compare.changed(columns, m, by_file, where, cands, threads)
    changed, unchanged_files = found.changed, found.unchanged
    # "Unchanged at the last save": tensors of candidate stripes that passed.
    # (and of held candidates: those that cannot be mirrored, carrying a save's metadata, go stable)
    looked = {te.key for fi in cands + holds for te in by_file[fi]}
    out = Plan([], base=os.path.basename(base.path), seq=seq, compared_bytes=found.compared,
               watched_bytes=found.watched, rechecked_bytes=found.rechecked, watch_misses=len(found.misses))
    claimed = _link(out, columns, base, by_file, where, unchanged_files, tmp, prefix, target)
    claimed |= _hold(out, columns, base, by_file, where, holds, prefix, target)
    left = [j for j in range(len(columns.keys)) if j not in claimed]
    hints = held.stable_hints(m)  # unchanged beside a changed tensor of a held file, at the last save
    stable = [j for j in left if (columns.keys[j] in looked and columns.keys[j] not in changed)
              or columns.keys[j] in hints]
    _plan_rest(out, columns, left, stable, stripes=stripes, prefix=prefix, metadata=metadata)
    return out


def annotate(manifest: dict, p: Plan) -> dict:
    """Mark the linked and hot stripes in ``manifest`` and add its incremental section."""
    for i, fe in enumerate(manifest["files"]):
        if i in p.linked or i in p.settled:
            fe["linked"] = True
        elif i in p.hot:
            fe["hot"] = True
            if i in p.held and p.held[i].changed is not None:
                fe["changed"] = p.held[i].changed
    manifest[SECTION] = {"base": p.base, "seq": p.seq, "linked_bytes": p.linked_bytes,
                         "written_bytes": sum(f.size for f in p.written), "link_fallbacks": p.fallbacks}
    return manifest


def byte_counts(raw: dict) -> tuple[int, int]:
    """(bytes written, bytes linked) of the checkpoint whose manifest is ``raw``: a
    checkpoint without an incremental section wrote all of its stripes."""
    files = raw.get("files") if isinstance(raw.get("files"), list) else []
    total = linked = 0
    for f in files:
        if isinstance(f, dict) and isinstance(f.get("size"), int):
            total += f["size"]
            if f.get("linked") is True:
                linked += f["size"]
    return total - linked, linked


# ------------------------------------------------------------------ the hook a save calls


class Planner:
    """One save's incremental planning, called by ``write.start`` with the flattened state
    (the hook between a save and this module). ``note`` says what happened, for SaveStats:
    "on", "on: no earlier checkpoint", or "off: <why>"."""

    def __init__(self, final: str, tmp: str, cache: BaseCache, threads: int, target: Target = LOCAL,
                 rank: tuple[int, int] | None = None, view: Callable[[Manifest], Manifest | str] | None = None):
        self.final, self.tmp, self.cache, self.threads, self.target = final, tmp, cache, threads, target
        self.rank = rank  # (rank, world size) of a multi-rank save: compares with its own part of the base
        self.view = view  # the base's manifest as this save compares with it, or why it cannot (DCP saves)
        self.note = "on"

    def base_path(self) -> str | None:
        """The newest committed checkpoint beside the target (local: found by a scan, so a
        restarted run links from its predecessor's); elsewhere the last one this Writer
        committed in that directory, if it is still there."""
        if self.target.scannable:
            return find_base(self.final)
        last = self.cache.last_committed(self.final)
        if last is not None and self.target.file_size(os.path.join(last, MANIFEST_NAME)) is not None:
            return last
        return None

    def __call__(self, columns: Columns, *, stripes: int, prefix: str, metadata: dict[str, str] | None,
                 block: int, stage_all: bool = False) -> Plan | None:
        """stage_all: the save keeps every staged byte (a local snapshot): candidate stripes
        are held files, staged and then linked by the job, not linked before staging."""
        on_gpu = sum(d != "cpu" for d in columns.devices) if not self.target.os_paths else 0
        if on_gpu and on_gpu == len(columns.devices):
            self.note = "off: GPU tensors are not compared on nfs:// (the save writes every stripe)"
            return None
        path = self.base_path()
        if path is None:
            self.note = "on: no earlier checkpoint to link from" + ("" if self.target.scannable else
                         " (nfs://: only one this Writer committed there counts; the save writes every stripe)")
            return None
        if on_gpu:
            self.note = f"on: host tensors only ({on_gpu} GPU tensors are written on nfs://, not compared)"
        try:
            base = self.cache.get(path, self.target)
        except (OSError, ValueError, FlashwriteError) as e:  # a damaged base is not linked from; the save writes everything
            self.note = f"off: the earlier checkpoint {os.path.basename(path)} cannot be read: {e}"[:300]
            return None
        m = self.view(base.manifest) if self.view is not None else base.manifest
        why = m if isinstance(m, str) else unusable(m, block, self.rank)
        if why or isinstance(m, str):
            self.note = f"off: the earlier checkpoint {os.path.basename(path)} cannot be linked from: {why}"
            return None
        base = Base(base.path, rank_part(m, self.rank[0]) if self.rank is not None else m)
        return plan(columns, base, self.tmp, stripes=stripes, prefix=prefix, metadata=metadata, threads=self.threads,
                    target=self.target, hold_all=stage_all)
