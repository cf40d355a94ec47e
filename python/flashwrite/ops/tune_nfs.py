"""``flashwrite tune nfs://HOST/EXPORT/DIR``: sweep ``connections`` for an NFS server.

An nfs:// save sends its stripes over ``connections`` TCP connections (see ``nfs.py``).
How many pay depends on the server and the network, so this measures it: one save
and one load of a synthetic state per setting (1, 2, 4, 8, 16), each Writer warmed
by one untimed save first (its staging pool is allocated then), within the budget.
The recommendation is the setting with the shortest time to durable (ties: fewer
connections). ``--save`` stores it for that server and export; an nfs:// URL without
``connections=`` then uses it (``nfs.tuned_connections``).
"""

from __future__ import annotations

import os
import time
import urllib.parse
import uuid
from typing import Any

import torch

from ..loading.load import load
from ..saving.save import Writer
from ..targets.locate import resolve
from .common import UsageError

CONNECTIONS = (1, 2, 4, 8, 16)
DEFAULT_SIZE = 256 << 20


def _state(nbytes: int, pieces: int = 16) -> dict[str, torch.Tensor]:
    n = max(1, nbytes // pieces // 4)
    g = torch.Generator().manual_seed(0)
    return {f"t{i}": torch.rand(n, generator=g) for i in range(pieces)}


def _with_connections(url: str, c: int, sub: str) -> str:
    u = urllib.parse.urlsplit(url)
    q = [(k, v) for k, v in urllib.parse.parse_qsl(u.query, keep_blank_values=True) if k != "connections"]
    q.append(("connections", str(c)))
    return urllib.parse.urlunsplit((u.scheme, u.netloc, u.path.rstrip("/") + "/" + sub, urllib.parse.urlencode(q), ""))


def tune_nfs(url: str, budget_s: float, progress: Any, size: int | None = None) -> dict:
    """Sweep ``connections`` for the server of ``url`` (an existing directory there)."""
    if budget_s <= 0:
        raise UsageError("--budget-s must be positive")
    target, inner = resolve(url, "tune")
    if not target.is_dir(inner):
        raise FileNotFoundError(2, "no such directory", url)
    nbytes = size or DEFAULT_SIZE
    state = _state(nbytes)
    work = f".flashwrite-tune-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    t0 = time.monotonic()
    deadline = t0 + budget_s
    rows: list[dict] = []
    skipped: list[str] = []
    progress.start(nbytes * 2 * len(CONNECTIONS), f"tune {url}")
    writer = Writer()
    est = 0.0
    try:
        target.make_dir(f"{inner.rstrip('/')}/{work}")
        for c in CONNECTIONS:
            if rows and time.monotonic() + 3 * est > deadline:  # the first trial always runs
                skipped.append(f"connections={c}")
                continue
            name = f"{work}/trial-{c}"
            trial = _with_connections(url, c, name)
            ts = time.monotonic()
            writer.save(state, trial)  # warm-up: this setting's connections, the pool
            target.remove_tree(f"{inner.rstrip('/')}/{name}")
            st = writer.save(state, trial)
            tl = time.perf_counter()
            load(trial)
            load_s = time.perf_counter() - tl
            target.remove_tree(f"{inner.rstrip('/')}/{name}")
            est = max(est * 0.5, time.monotonic() - ts)
            save_s = st.total_s or 0.0
            rows.append({"connections": c, "save_s": save_s, "load_s": load_s,
                         "save_gbps": nbytes / save_s / 1e9 if save_s else None, "load_gbps": nbytes / load_s / 1e9})
            progress.advance(2 * nbytes)
    finally:
        writer.close()
        target.remove_tree(f"{inner.rstrip('/')}/{work}")
        progress.finish()
    best = min(rows, key=lambda r: (r["save_s"], r["connections"]))
    return {"url": url, "server": target.url.server, "export": target.export, "budget_s": budget_s,
            "elapsed_s": time.monotonic() - t0, "bytes_per_trial": nbytes, "trials": rows, "skipped": skipped,
            "recommended": {"connections": best["connections"]}, "connections": best["connections"],
            "recommended_gbps": best["save_gbps"], "default_connections": target.default_connections}


def save_nfs_tuning(result: dict) -> tuple[dict, str]:
    """Store the recommended connections for the result's server and export: (the record
    stored, with its key; the file it is in)."""
    target, _ = resolve(result["url"], "tune")
    return target.save_tuning(result["connections"], result["recommended_gbps"]), target.tuning_store()
