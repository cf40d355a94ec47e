"""What a user on a training node does first with an installed flashwrite: run by
tools/build_wheels.sh inside a fresh virtualenv (from the wheel, then from the sdist).

    python wheel_smoke.py SOURCE_TREE WORKDIR

Fails (exit 1, with the reason) unless flashwrite and its native core come from this
environment's site-packages, not SOURCE_TREE, and save, save_async, load, verify and the
``flashwrite`` command (info, ls, --version, ``python -m flashwrite``) work there.
"""

from __future__ import annotations

import os
import subprocess
import sys
import sysconfig


def check(cond: bool, what: str) -> None:
    if not cond:
        sys.exit(f"smoke: FAILED: {what}")


def run(*cmd: str) -> str:
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    check(p.returncode == 0, f"{' '.join(cmd)} exited {p.returncode}:\n{p.stdout}\n{p.stderr}")
    return p.stdout


def main(source_tree: str, work: str) -> None:
    import torch

    import flashwrite as fw
    import flashwrite._core as core
    from importlib.metadata import version

    site = os.path.realpath(sysconfig.get_paths()["purelib"])
    source_tree = os.path.realpath(source_tree)
    for mod in (fw, core):
        where = os.path.realpath(mod.__file__)
        check(where.startswith(site + os.sep), f"{mod.__name__} comes from {where}, not {site}")
        check(not where.startswith(source_tree + os.sep), f"{mod.__name__} comes from the source tree: {where}")
    check(os.path.realpath(sys.prefix) != os.path.realpath(sys.base_prefix), "not run inside a virtualenv")
    check(fw.__version__ == version("flashwrite") == core.__version__,
          f"versions differ: {fw.__version__} / {version('flashwrite')} / {core.__version__}")

    g = torch.Generator().manual_seed(0)
    state = {"model": {"w": torch.randn(256, 1024, generator=g), "b": torch.arange(1000, dtype=torch.int64)},
             "step": 7, "lr": 1e-3, "tag": "smoke"}
    state["model"]["tied"] = state["model"]["w"]
    a, b = os.path.join(work, "ckpt", "step-00000001"), os.path.join(work, "ckpt", "step-00000002")
    stats = fw.save(state, a)
    fut = fw.save_async(state, b)
    stats_b = fut.result()
    for path in (a, b):
        back = fw.load(path)
        check(torch.equal(back["model"]["w"], state["model"]["w"]), f"{path}: w differs")
        check(torch.equal(back["model"]["b"], state["model"]["b"]), f"{path}: b differs")
        check(back["model"]["tied"].data_ptr() == back["model"]["w"].data_ptr(), f"{path}: the tie is lost")
        check((back["step"], back["lr"], back["tag"]) == (7, 1e-3, "smoke"), f"{path}: non-tensor leaves differ")
        fw.verify(path)
    exe = os.path.join(os.path.dirname(sys.executable), "flashwrite")
    info = run(exe, "info", work)
    ls = run(exe, "ls", os.path.join(work, "ckpt"))
    check("step-00000001" in ls and "step-00000002" in ls, f"flashwrite ls misses a checkpoint:\n{ls}")
    check(run(exe, "--version").strip() == f"flashwrite {fw.__version__}", "flashwrite --version")
    check(run(sys.executable, "-m", "flashwrite", "--version").strip() == f"flashwrite {fw.__version__}",
          "python -m flashwrite --version")
    run(exe, "verify", "-q", a)
    print(f"smoke: ok: flashwrite {fw.__version__} from {os.path.dirname(fw.__file__)}, _core "
          f"{os.path.basename(core.__file__)}, backend {stats.backend} (async {stats_b.backend}), "
          f"direct={stats.direct}")
    print(info.rstrip())


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    main(sys.argv[1], sys.argv[2])
