"""Commit: make a checkpoint visible only when it is whole and durable.

Stripes are written into a temporary sibling directory; once they are fsync'd
the index and then the manifest are written and fsync'd, the directory is
fsync'd, renamed into place, and the parent fsync'd. A crash at any point leaves
either the previous state or the complete new checkpoint; a leftover temporary
directory is recognisable by its name and never mistaken for a checkpoint.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
from typing import Any, Callable

from .. import _core
from ..errors import CheckpointExistsError
from ..format import INDEX_NAME, MANIFEST_NAME, encode_manifest
from ..system.owner import may_run_flashwrite, owner_alive, process_stat
from ..layout.names import (HOST_TAG, OLD_MARK, TMP_MARK, TempName, is_temp_name, old_dir_for,  # noqa: F401
                            parse_temp_name, shared_temp_dir_for, temp_dir_for)
from ..targets.target import LOCAL, Target

log = logging.getLogger("flashwrite")

def target_problem(final: str, overwrite: bool, target: Target = LOCAL) -> str | None:
    """Why a save may not go to ``final``, or None. overwrite=True replaces a flashwrite
    checkpoint or an empty directory, never anything else (a run directory holding
    logs, a file): that would delete data that is not ours."""
    if not target.exists(final):
        return None
    if not target.is_dir(final):
        return NOT_OURS
    if target.is_file(os.path.join(final, MANIFEST_NAME)):
        return None if overwrite else "checkpoint already exists (pass overwrite=True to replace it)"
    if target.list(final):
        return NOT_OURS  # said whatever overwrite is: advising overwrite=True would only meet this refusal
    return None if overwrite else "an empty directory is there (pass overwrite=True to replace it)"


NOT_OURS = "exists and is not a flashwrite checkpoint; refusing to replace it (overwrite=True replaces only checkpoints)"


def check_target(final: str, overwrite: bool, target: Target = LOCAL) -> None:
    problem = target_problem(final, overwrite, target)
    if problem:
        raise CheckpointExistsError(17, problem, target.show(final))


def prepare(final: str, overwrite: bool, target: Target = LOCAL, named: Callable[[str], None] | None = None) -> str:
    """Create the temp dir (and missing parents). Raises now for a bad target, not later.
    ``named(tmp)`` is told the temp dir's name before it is made: a Ctrl-C landing after
    the mkdir, before this returns, still leaves its owner a name to remove."""
    final = os.path.abspath(final)
    check_target(final, overwrite, target)
    parent = os.path.dirname(final)
    if target.exists(parent) and not target.is_dir(parent):
        raise NotADirectoryError(20, "parent of the checkpoint path is not a directory", parent)
    if target.sweeps_dead_saves:
        clean_dead_saves(parent)
    tmp = temp_dir_for(final)
    if named is not None:
        named(tmp)
    try:
        target.make_dirs(parent)
        target.make_dir(tmp)
    except PermissionError as e:
        # Name what the user asked for, not our temporary sibling.
        raise PermissionError(e.errno, f"cannot create checkpoint {target.show(final)}: {e.strerror}",
                              e.filename) from None
    return tmp


# Names a checkpoint's own files take: the manifest, the index and the stripes
# (``plan.stripe_name``: "<prefix>-00001-of-00008.safetensors", "...-rank00003-...").
_STRIPE_RE = re.compile(r".*-\d{5}-of-\d{5}\.safetensors")


def extra_files(files: Any, reserved: tuple[str, ...] = ()) -> dict[str, bytes]:
    """The small files to commit with a checkpoint, ``{name: bytes}``, from a mapping of
    plain file names to bytes or to the path of a file to copy (read now, so the caller
    may change or remove it once the save returns). Refused: names with a directory part,
    hidden names (ours for temporary directories), and the checkpoint's own file names
    (the manifest, the index, stripes, and ``reserved``, e.g. config.json from hf_config)."""
    if not hasattr(files, "items"):
        raise TypeError(f"extra_files must be a mapping of file names to bytes or paths, not {type(files).__qualname__}")
    out: dict[str, bytes] = {}
    for name, data in files.items():
        if not isinstance(name, str) or not name or "/" in name or "\\" in name or "\0" in name \
                or name.startswith("."):
            raise ValueError(f"extra_files: {name!r} is not a plain file name (no directory part, not hidden)")
        if name in (MANIFEST_NAME, INDEX_NAME, *reserved) or _STRIPE_RE.fullmatch(name):
            raise ValueError(f"extra_files: {name!r} is a name the checkpoint itself uses")
        if isinstance(data, (bytes, bytearray, memoryview)):
            out[name] = bytes(data)
        elif isinstance(data, (str, os.PathLike)):
            with open(data, "rb") as fh:
                out[name] = fh.read()
        else:
            raise TypeError(f"extra_files[{name!r}] must be bytes or a path, not {type(data).__qualname__}")
    return out


def encode_files(manifest: dict, index: dict | None) -> dict[str, bytes]:
    """The bytes of the index (if any) and of the manifest, in the order they are written."""
    out = {INDEX_NAME: json.dumps(index, indent=1).encode()} if index is not None else {}
    out[MANIFEST_NAME] = encode_manifest(manifest)
    return out


def finalize(tmp: str, final: str, manifest: dict, index: dict | None, overwrite: bool,
             extra: dict[str, bytes] | None = None, encoded: dict[str, bytes] | None = None,
             target: Target = LOCAL) -> None:
    """Commit: ``extra`` files (config.json, ``extra_files``), the index and the manifest, each
    fsync'd, the manifest last; fsync the directory; rename it into place; fsync the parent.
    encoded: ``encode_files(manifest, index)`` made earlier (manifest and index then unused)."""
    final = os.path.abspath(final)
    parent = os.path.dirname(final)
    for name, data in (extra or {}).items():
        target.write_durable(os.path.join(tmp, name), data)
    for name, data in (encoded or encode_files(manifest, index)).items():  # the manifest last
        target.write_durable(os.path.join(tmp, name), data)
    target.fsync_dir(tmp)
    if target.exists(final):
        check_target(final, overwrite, target)  # it may have appeared or changed while we wrote
        # Atomic swap where the file system supports it; the old checkpoint is
        # then at `tmp` and is removed only after the parent is durable.
        if target.exchange(tmp, final):
            target.fsync_dir(parent)
            target.remove_tree(tmp)
            return
        old = old_dir_for(final)
        target.rename(final, old)
        try:
            target.rename(tmp, final)
        except BaseException:
            target.rename(old, final)  # put the previous checkpoint back where it was
            raise
        target.fsync_dir(parent)
        target.remove_tree(old)
        return
    target.rename(tmp, final)
    target.fsync_dir(parent)


def discard(tmp: str, target: Target = LOCAL) -> None:
    """Remove a save's temporary directory (``tmp`` as ``prepare`` returned it)."""
    target.remove_tree(tmp)


# ------------------------------------------------------------ leftovers of crashes


def temp_owner_alive(name: str, path: str) -> bool:
    """Whether the process that created temp dir ``name`` may still be writing it.

    The pid is in the name; a live process with that pid that started after the
    directory was last modified (with 2 s of grace: the boot time has 1 s resolution) is
    a recycled pid, not the owner. The rule is never to delete what might be live, and the
    wall clock can lie (stepped forward since the directory changed: NTP's first sync
    after a restart, a resumed VM), so a process judged younger still counts as the owner
    while it may be running flashwrite (``may_run_flashwrite``), unless it is this process.
    """
    parsed = parse_temp_name(name)
    if parsed is None or parsed.pid is None:
        return False
    if parsed.host is not None and parsed.host != HOST_TAG:
        return True  # another host's (or an earlier boot's) save: not ours to judge here
    try:
        mtime = os.lstat(path).st_mtime
    except OSError:
        return False
    if owner_alive({"pid": parsed.pid}, started_by=mtime + 2.0):
        return True
    return parsed.pid != os.getpid() and process_stat(parsed.pid) is not None and may_run_flashwrite(parsed.pid)


def clean_dead_saves(root: str) -> list[str]:
    """Remove the temporary directories in ``root`` of saves whose process died (kill -9,
    a crash): only those whose name says they were made on this host, since its last
    boot, by a process that no longer runs. Every save calls this for its parent, so a
    plain ``save_async`` cleans up after a killed one as the manager does. Multi-rank
    temporaries, checkpoints moved aside and older names are left to ``clean_stale``.
    Returns the names removed; a failure to remove one is logged, never raised."""
    removed = []
    try:
        entries = [e for e in os.scandir(root) if TMP_MARK in e.name]
    except OSError:
        return removed  # a parent that does not exist yet holds nothing to clean
    for e in entries:
        temp = parse_temp_name(e.name)
        if temp is None or temp.kind != "tmp" or temp.pid is None or temp.host != HOST_TAG:
            continue
        if temp.pid == os.getpid() or temp_owner_alive(e.name, e.path):
            continue
        try:
            if e.is_dir(follow_symlinks=False):
                shutil.rmtree(e.path)
                removed.append(e.name)
                log.warning("removed %s: the save that made it (pid %d) died before it committed", e.path, temp.pid)
        except OSError as err:
            log.warning("cannot remove the dead save's temporary %s: %s", e.path, err)
    return removed


def clean_stale(root: str) -> list[str]:
    """Remove the temporary directories that crashed saves and deletions left in ``root``
    (and put back a checkpoint whose replacement never appeared); a save's directory
    whose process is still alive on this host is left alone. Returns the names it
    removed or restored. Nothing without one of our marks is touched."""
    touched = []
    try:
        entries = list(os.scandir(root))
    except OSError as e:
        log.warning("cannot list %s to clean up stale temporary directories: %s", root, e)
        return touched
    for e in entries:
        temp = parse_temp_name(e.name)
        if temp is None:
            continue
        try:
            if not e.is_dir(follow_symlinks=False):
                os.unlink(e.path)
            elif temp.kind == "tmp":
                if temp_owner_alive(e.name, e.path):
                    log.debug("leaving %s: its process is still alive", e.path)
                    continue
                shutil.rmtree(e.path)
            else:
                original = os.path.join(root, temp.original)
                if not os.path.lexists(original) and os.path.isfile(os.path.join(e.path, MANIFEST_NAME)):
                    os.rename(e.path, original)
                    log.warning("restored %s: it was being replaced when its process died", original)
                    touched.append(e.name)
                    continue
                shutil.rmtree(e.path)
            log.info("removed stale temporary %s", e.path)
            touched.append(e.name)
        except OSError as err:
            log.warning("cannot remove stale temporary %s: %s", e.path, err)
    if touched:
        try:
            _core.fsync_dir(root)
        except OSError as err:
            log.warning("fsync of %s failed: %s", root, err)
    return touched
