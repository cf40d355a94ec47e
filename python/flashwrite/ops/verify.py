"""``flashwrite verify`` with progress: the checkpoint is checked one stripe at a
time (every checksum, header and size, as ``flashwrite.verify`` does), so the
bar moves and memory holds one stripe, not the whole checkpoint."""

from __future__ import annotations

import os
import time
from typing import Any

from ..format import read_manifest
from ..load import read_tensors
from ..locate import local_view


def verify(path: str, progress: Any = None) -> dict:
    with local_view(path, "verify") as local:  # nfs://: the stripes are read from the server
        return _verify(local, path, progress)


def _verify(path: str, shown: str, progress: Any) -> dict:
    t0 = time.perf_counter()
    m = read_manifest(path)
    by_file: dict[int, set[str]] = {}
    for k, e in m.tensors.items():
        by_file.setdefault(e.file, set()).add(k)
    if progress is not None:
        progress.start(sum(f.size for f in m.files), f"verify {os.path.basename(os.path.normpath(shown))}")
    try:
        for fi, fe in enumerate(m.files):
            keys = by_file.get(fi)
            if keys:
                read_tensors(path, verify=True, keys=keys)  # raises on any mismatch; buffers freed at once
            if progress is not None:
                progress.advance(fe.size)
    finally:
        if progress is not None:
            progress.finish()
    return {"path": os.fspath(shown), "files": len(m.files), "tensors": len(m.tensors),
            "bytes": sum(f.size for f in m.files), "writer_version": m.writer_version,
            "seconds": time.perf_counter() - t0}
