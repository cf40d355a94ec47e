"""Cold loads of a plain safetensors model (one file, and four shards with an HF index):
flashwrite.load against safetensors.torch.load_file, torch.load of the same tensors, and
the device's read limit (fio, O_DIRECT), side by side in one run, page cache dropped
before every load; medians over rounds, each load in a fresh process.

    python benchmarks/load_models.py --size 2GiB --rounds 3 --dir /tmp/lm [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

import torch

from flashwrite.ops.devicelimit import device_limit, drop_caches
from flashwrite.system.sizes import fmt_bytes, parse_size

# (import, timed statement): the import is not timed; every loader returns {name: tensor}.
LOADERS = {
    "flashwrite.load": ("import flashwrite as fw", "t = fw.load(P)"),
    "safetensors load_file": ("import glob; from safetensors.torch import load_file",
                              "t = load_file(P) if P.endswith('.safetensors') else "
                              "{k: v for f in sorted(glob.glob(P + '/*.safetensors')) for k, v in load_file(f).items()}"),
    "torch.load": ("", "t = torch.load(P, weights_only=True)"),
}


def make_model(directory: str, nbytes: int) -> dict[str, str]:
    """The same tensors (bf16, 32 MiB each, like a transformer's weights) as one
    safetensors file, four shards with an index, and one torch.save file."""
    from safetensors.torch import save_file
    n = max(1, nbytes // (32 << 20))
    g = torch.Generator().manual_seed(0)
    tensors = {f"model.layers.{i}.weight": torch.randn(4096, 4096, generator=g).to(torch.bfloat16) for i in range(n)}
    paths = {"1 file": os.path.join(directory, "one.safetensors"), "4 shards": os.path.join(directory, "shards"),
             "torch": os.path.join(directory, "model.pt")}
    save_file(tensors, paths["1 file"], metadata={"format": "pt"})
    os.makedirs(paths["4 shards"], exist_ok=True)
    names = list(tensors)
    weight_map = {}
    for s in range(4):
        part = names[s::4]
        fname = f"model-{s + 1:05d}-of-00004.safetensors"
        save_file({k: tensors[k] for k in part}, os.path.join(paths["4 shards"], fname), metadata={"format": "pt"})
        weight_map.update((k, fname) for k in part)
    with open(os.path.join(paths["4 shards"], "model.safetensors.index.json"), "w") as fh:
        json.dump({"metadata": {"total_size": n * (32 << 20)}, "weight_map": weight_map}, fh)
    torch.save(tensors, paths["torch"])
    os.sync()
    return paths


def timed_load(loader: tuple[str, str], path: str) -> float:
    """Seconds to load ``path`` in a fresh process (the import is not timed)."""
    setup, stmt = loader
    script = (f"import time, torch\n{setup}\nP = {path!r}\nt0 = time.perf_counter()\n{stmt}\n"
              # touch one byte per page: a loader that maps the file lazily pays for its reads here, as training would
              "assert sum(int(v.reshape(-1).view(torch.uint8)[::4096].sum()) for v in t.values()) >= 0\n"
              "print(time.perf_counter() - t0)")
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=900)
    if r.returncode:
        raise RuntimeError(r.stderr[-2000:])
    return float(r.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", default="2GiB")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--dir", default="/tmp/fw-load-models")
    ap.add_argument("--json")
    a = ap.parse_args()
    os.makedirs(a.dir, exist_ok=True)
    nbytes = parse_size(a.size)
    paths = make_model(a.dir, nbytes)
    times: dict[str, list[float]] = {}
    for rnd in range(a.rounds):
        lim = device_limit(a.dir, nbytes)
        times.setdefault("device read limit", []).append(lim["read_s"])
        for layout in ("1 file", "4 shards"):
            for name in ("flashwrite.load", "safetensors load_file"):
                why = drop_caches()
                times.setdefault(f"{name} ({layout})", []).append(timed_load(LOADERS[name], paths[layout]))
        why = drop_caches()
        times.setdefault("torch.load (1 file)", []).append(timed_load(LOADERS["torch.load"], paths["torch"]))
        print(f"round {rnd + 1}/{a.rounds} done", file=sys.stderr, flush=True)
    limit = statistics.median(times["device read limit"])
    print(f"{fmt_bytes(nbytes)} bf16 model, cold cache ({why or 'page cache dropped before every load'}), "
          f"{a.rounds} rounds, medians; device read limit: {lim['tool']}")
    print(f"{'loader':<40} {'s':>7} {'GB/s':>6} {'x limit':>8}")
    rows = []
    for name, ts in times.items():
        s = statistics.median(ts)
        rows.append({"loader": name, "seconds": s, "gbps": nbytes / s / 1e9, "x_limit": limit / s})
        print(f"{name:<40} {s:7.2f} {nbytes / s / 1e9:6.2f} {limit / s:8.2f}")
    if a.json:
        with open(a.json, "w") as fh:
            json.dump({"bytes": nbytes, "rounds": a.rounds, "rows": rows, "raw": times, "when": time.time()}, fh,
                      indent=1)


if __name__ == "__main__":
    main()
