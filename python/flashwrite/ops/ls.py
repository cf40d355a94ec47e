"""``flashwrite ls ROOT``: every checkpoint under ROOT, from manifests only.

Cost on NFS (a mount, or an nfs:// ROOT read through its ``Target``): one directory
listing of ROOT and one open of each candidate's manifest (plus its small
verification record when there is one), and one stat of each stripe: a manifest
says what was committed, not what is there now (a ``cp -r`` or rsync cut short, a
stripe lost in place), so a checkpoint whose manifest fails its own checksum, or a
stripe missing or not at its recorded size, is ``damaged`` with the reason, and a
recorded verification counts (``yes``) only while those facts hold. No stripe is
read, except the header of one stripe of a directory with stripes and no
manifest (``incomplete`` when flashwrite wrote it).

Local snapshots (``CheckpointManager(local_snapshots=True)``) of checkpoints in
ROOT are listed too, as rows of tier "memory": one listing of the local
directory (``/dev/shm`` unless told) and a read of each snapshot header there,
never of the pool's bytes.
"""

from __future__ import annotations

import json
import os
import re
import time
from dataclasses import asdict, dataclass
from typing import Any

from .. import _core
from ..saving import commit
from ..tier import snapshot as local
from ..errors import FlashwriteError
from ..format import MANIFEST_NAME, MAX_MANIFEST_BYTES, PACKED_FIELD, check_manifest_seal, check_member_name
from ..format import safetensors_header
from ..format.codec import STRIPE_SUFFIX
from ..loading.read_plan import check_stripe_size
from ..targets.locate import kind_of, resolve
from ..targets.target import LOCAL, Target, local_path
from ..incremental.link import byte_counts

VERIFIED_NAME = ".flashwrite-verified.json"
_STEP_RE = re.compile(r"^step-(\d+)$")
_STRIPE_RE = re.compile(r"^.+-\d{5}-of-\d{5}(\.safetensors|" + re.escape(STRIPE_SUFFIX) + r")$")


@dataclass
class Entry:
    path: str
    name: str
    status: str            # complete | incomplete | temporary | in-progress | damaged
    step: int | None = None
    bytes: int | None = None
    tensors: int | None = None
    created_unix: float | None = None
    verified: str = "no"    # yes | no | stale (the manifest changed after the check) | failed
    verified_unix: float | None = None
    writer_version: str | None = None
    problem: str | None = None
    tier: str = "storage"   # storage | memory (a local snapshot: status is its state, staged | committed)
    owner_pid: int | None = None     # memory: the process that staged it
    owner_alive: bool | None = None
    pool_bytes: int | None = None    # memory: size of the shared-memory pool file it lies in
    # storage: of bytes, what its save wrote and what it hard-linked from an earlier
    # checkpoint (incremental saves; a checkpoint without links wrote all of it)
    written_bytes: int | None = None
    linked_bytes: int | None = None
    compressed: bool = False  # storage: its stripes are compressed (format/codec.py): not plain safetensors
    diverged: int = 0  # storage: pieces its replicas disagreed on (replica_group=, on_divergence="warn")


def read_json_small(path: str, limit: int = MAX_MANIFEST_BYTES, target: Target = LOCAL) -> Any:
    """A JSON file read as hostile (``Target.read_small``: regular file only, bounded size,
    no hang on a FIFO). Returns (parsed, raw bytes); raises FileNotFoundError / OSError /
    ValueError."""
    data = target.read_small(path, limit)
    try:
        return json.loads(data), data
    except (ValueError, RecursionError) as e:
        raise ValueError(f"{os.path.basename(path)} is not valid JSON: {e}"[:200]) from None


def manifest_digest(data: bytes) -> str:
    return f"{_core.checksum(data):016x}"


def record_verified(ckpt: str, failed: str | None = None) -> bool:
    """Note in the checkpoint what ``verify`` found (for ``ls``): that it passed, or with
    ``failed`` (the error) that it did not. Best effort: a read-only checkpoint simply
    keeps what it had. True when recorded."""
    try:
        target, path = resolve(ckpt, "verify")
        _, data = read_json_small(os.path.join(path, MANIFEST_NAME), target=target)
        rec: dict[str, Any] = {"verified_unix": time.time(), "manifest_xxh3": manifest_digest(data)}
        if failed is not None:
            rec.update(result="failed", error=failed[:500])
        tmp = os.path.join(path, f"{VERIFIED_NAME}.{os.getpid()}")
        target.write_durable(tmp, json.dumps(rec).encode())
        target.rename(tmp, os.path.join(path, VERIFIED_NAME))
        return True
    except (OSError, ValueError):
        return False


def _verified(target: Target, path: str, manifest_bytes: bytes) -> tuple[str, float | None]:
    """yes | no | stale (the manifest changed after the check) | failed (the last check failed)."""
    try:
        rec, _ = read_json_small(os.path.join(path, VERIFIED_NAME), 1 << 16, target)
    except (OSError, ValueError):
        return "no", None
    if not isinstance(rec, dict):
        return "no", None
    when = rec.get("verified_unix")
    when = float(when) if isinstance(when, (int, float)) and not isinstance(when, bool) else None
    if rec.get("result", "passed") != "passed":
        return "failed", when  # whatever the manifest is now: a failed check is never "yes"
    return ("yes" if rec.get("manifest_xxh3") == manifest_digest(manifest_bytes) else "stale"), when


def _num(v: Any) -> float | None:
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else None


def describe(path: str, name: str | None = None, target: Target = LOCAL) -> Entry | None:
    """The entry for the directory ``path`` on ``target``, or None when it is not a
    checkpoint at all. The entry's path is as ``target`` shows it (a URL for nfs://)."""
    name = name or os.path.basename(os.path.normpath(path))
    m = _STEP_RE.match(name)
    step = int(m.group(1)) if m else None
    if commit.is_temp_name(name):
        if not target.sweeps_dead_saves:  # its owner's pid is another host's, maybe: alive or dead cannot be told
            return Entry(target.show(path), name, "temporary", step,
                         problem="a save in progress, or left by a crashed save or deletion")
        alive = commit.TMP_MARK in name and commit.temp_owner_alive(name, path)
        return Entry(path, name, "in-progress" if alive else "temporary", step,
                     problem=None if alive else "left by a crashed save or deletion; CheckpointManager removes it")
    shown = target.show(path)
    try:
        raw, data = read_json_small(os.path.join(path, MANIFEST_NAME), target=target)
    except FileNotFoundError:
        if step is not None or _holds_our_stripes(target, path):
            return Entry(shown, name, "incomplete", step, problem=f"no {MANIFEST_NAME}: not a whole checkpoint")
        return None
    except (OSError, ValueError) as e:
        return Entry(shown, name, "damaged", step, problem=str(e.strerror if isinstance(e, OSError) and e.strerror
                                                              else e))
    if not isinstance(raw, dict) or raw.get("format") != "flashwrite":
        return Entry(shown, name, "damaged", step, problem="manifest is not a flashwrite manifest")
    e = Entry(shown, name, "complete", step)
    files, tensors = raw.get("files"), raw.get("tensors")
    try:
        e.bytes = sum(int(f["size"]) for f in files) if isinstance(files, list) else None
    except (TypeError, KeyError, ValueError):
        e.status, e.problem = "damaged", "manifest: bad file sizes"
    else:
        e.written_bytes, e.linked_bytes = byte_counts(raw) if e.bytes is not None else (None, None)
    packed = raw.get(PACKED_FIELD)
    if isinstance(packed, dict):  # format 4: the table is packed, its size recorded beside it
        count = packed.get("count")
        e.tensors = count if isinstance(count, int) and not isinstance(count, bool) and count >= 0 else None
    else:
        e.tensors = len(tensors) if isinstance(tensors, dict) else None
    if e.tensors is None:
        e.status, e.problem = "damaged", "manifest: tensors must be an object"
    e.created_unix = _num(raw.get("created_unix"))
    e.compressed = isinstance(files, list) and any(isinstance(f, dict) and f.get("codec") for f in files)
    wv = raw.get("writer_version")
    e.writer_version = wv[:40] if isinstance(wv, str) else None
    meta = raw.get("metadata")
    if e.step is None and isinstance(meta, dict) and isinstance(meta.get("step"), str) and meta["step"].isdigit():
        e.step = int(meta["step"])
    e.diverged = diverged_pieces(raw)
    if e.diverged and e.problem is None:
        e.problem = (f"its replicas disagreed on {e.diverged} piece(s) (silent data corruption or nondeterminism on "
                     "a rank); the majority's bytes were committed: flashwrite inspect names them")
    e.verified, e.verified_unix = _verified(target, path, data)
    if e.status == "complete":
        problem = _damage(target, path, shown, raw, files)
        if problem is not None:
            e.status, e.problem = "damaged", problem
            e.verified = "stale" if e.verified == "yes" else e.verified  # it held for what is no longer there
    return e


def diverged_pieces(raw: dict) -> int:
    """How many pieces the replica groups of a checkpoint disagreed on (``replicas`` section)."""
    sec = raw.get("replicas")
    groups = sec.get("groups") if isinstance(sec, dict) else None
    if not isinstance(groups, list):
        return 0
    return sum(len(g["diverged"]) for g in groups if isinstance(g, dict) and isinstance(g.get("diverged"), list))


def _damage(target: Target, path: str, shown: str, raw: dict, files: Any) -> str | None:
    """What cheaply shows a committed checkpoint is no longer whole: its manifest fails its
    own checksum, or a stripe is missing or not at its recorded size (the check and the
    words ``load`` and ``verify`` use). None when nothing does."""
    try:
        check_manifest_seal(raw)
        for f in files:
            name = check_member_name(f.get("name") if isinstance(f, dict) else None)
            check_stripe_size(target, os.path.join(path, name), name, shown, int(f["size"]))
    except FlashwriteError as err:
        return str(err)
    return None


def _holds_our_stripes(target: Target, path: str) -> bool:
    """Whether a directory with no manifest holds stripes flashwrite wrote (a compressed
    stripe's name, or a safetensors stripe whose header says so): a checkpoint cut short."""
    try:
        names = sorted(n for n in target.list(path) if _STRIPE_RE.match(n))
        if not names:
            return False
        if names[0].endswith(STRIPE_SUFFIX):
            return True
        full = os.path.join(path, names[0])
        size = target.file_size(full) or 0
        n = safetensors_header.header_length(target.read_at(full, 0, 8), size, names[0])
        _, meta = safetensors_header.parse_object(target.read_at(full, 8, n), names[0])
        return meta.get("writer") == "flashwrite"
    except (OSError, ValueError, FlashwriteError):
        return False


def list_checkpoints(root: str, recursive: bool = False) -> list[Entry]:
    """Checkpoints in ``root`` (ROOT itself when it is one, else its children;
    with ``recursive``, every directory below that is not inside a checkpoint).
    ROOT may be an nfs:// URL: the listings and manifests are then read from the server."""
    target, top = resolve(root, "ls")
    if not target.exists(top):
        raise FileNotFoundError(2, "no such directory", target.show(top))
    if not target.is_dir(top):
        raise NotADirectoryError(20, "not a directory", target.show(top))
    here = describe(top, None, target)
    if here is not None and here.status != "incomplete":
        return [here]
    out: list[Entry] = []
    todo = [top]
    while todo:
        d = todo.pop()
        for name in sorted(target.list_dirs(d)):
            e = describe(os.path.join(d, name), name, target)
            if e is not None:
                out.append(e)
            elif recursive:
                todo.append(os.path.join(d, name))
    out.sort(key=lambda e: (e.step is None, e.step if e.step is not None else 0, e.path))
    return out


def list_local(root: str, local_dir: str | None = None) -> list[Entry]:
    """Local snapshots in ``local_dir`` (default /dev/shm) of ROOT or of its children:
    step, state, size, owner (alive or dead) and where (the header's path). None for an
    nfs:// ROOT (local snapshots are taken of local roots only)."""
    if not kind_of(root, "ls").holds_local_snapshots:
        return []
    root = os.path.abspath(local_path(root, "ls"))
    out = []
    for snap in local.scan(local_dir or local.default_dir()):
        if snap.path != root and os.path.dirname(snap.path) != root:
            continue
        name = os.path.basename(snap.path)
        m = _STEP_RE.match(name)
        man = snap.body.get("manifest")
        e = Entry(snap.header, name, snap.state, int(m.group(1)) if m else None, tier="memory",
                  created_unix=_num(snap.created))
        if isinstance(man, dict):
            files, tensors = man.get("files"), man.get("tensors")
            try:
                e.bytes = sum(int(f["size"]) for f in files) if isinstance(files, list) else None
            except (TypeError, KeyError, ValueError):
                e.problem = "header: bad file sizes"
            e.tensors = len(tensors) if isinstance(tensors, dict) else None
            wv = man.get("writer_version")
            e.writer_version = wv[:40] if isinstance(wv, str) else None
        if "rank" in snap.body:
            copy = "copy of " if snap.body.get("replica") else ""
            e.name = f"{name} ({copy}rank {snap.body.get('rank')} of {snap.body.get('world_size')})"
        pid = snap.owner.get("pid")
        e.owner_pid = pid if isinstance(pid, int) else None
        e.owner_alive = snap.alive
        try:
            e.pool_bytes = os.stat(snap.pool).st_size
        except OSError:
            e.problem = f"its pool file {snap.pool} is gone"
        out.append(e)
    out.sort(key=lambda e: (e.step is None, e.step if e.step is not None else 0, e.path))
    return out


def to_json(entries: list[Entry]) -> list[dict]:
    return [asdict(e) for e in entries]
