"""Durability order of an incremental multi-rank save, observed in the system calls of
both ranks (the LD_PRELOAD recorder of test_durability_order.py, one log for both):
every rank's hard links into the shared temporary directory are made before rank 0's
fsync of that directory that precedes the manifest's rename, and every written stripe
is fsync'd before the manifest is created."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

from shim_util import build_shim, preload_env

from flashwrite.saving import commit
from flashwrite.format import MANIFEST_NAME

_RANK = textwrap.dedent("""
    import datetime, os, sys, torch, torch.distributed as dist, flashwrite as fw
    rank, world, init, root = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method="file://" + init, rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=60))
    g = torch.Generator().manual_seed(rank)
    frozen = {f"base.{i}": torch.randn(1 << 19, generator=g) for i in range(3)}
    w = fw.Writer(stripes=2, chunk_bytes=1 << 20, incremental=True)
    for step in (1, 2, 3):  # the third save links the frozen tensors' stripes
        sd = {"model": dict(frozen, lora=torch.randn(4096, generator=g)), "step": step}
        st = w.save(sd, os.path.join(root, f"step-{step}"), process_group=dist.group.WORLD, timeout=60)
        print(step, st.incremental, st.stripes_linked, flush=True)
    w.close()
    dist.destroy_process_group()
""")


def run_ranks_logged(tmp_path, script: str) -> str:
    """Run ``script`` as 2 ranks under the system-call recorder, saving into tmp_path/ck;
    the recorded log. Each rank prints "step incremental ... stripes_linked" per save."""
    shim_dir = tmp_path / "shim"
    shim_dir.mkdir()
    lib = build_shim("shim_syscall_log", shim_dir)
    root = tmp_path / "ck"
    root.mkdir()
    log = tmp_path / "syscalls.log"
    env = preload_env(lib, FW_SYSCALL_LOG=str(log), FW_SYSCALL_SLOW_SUFFIX=".safetensors", FW_SYSCALL_SLOW_MS="50")
    init = str(tmp_path / "init")
    procs = [subprocess.Popen([sys.executable, "-c", script, str(r), "2", init, str(root)], env=env, text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE) for r in range(2)]
    outs = [p.communicate(timeout=180) for p in procs]
    for p, (out, err) in zip(procs, outs):
        assert p.returncode == 0, f"rank failed ({p.returncode}):\n{out[-2000:]}\n{err[-3000:]}"
        last = out.splitlines()[-1].split()
        assert last[0] == "3" and last[1] == "on" and int(last[-1]) > 0, out
    return log.read_text()


def assert_links_durable_before_commit(log: str, root) -> None:
    """In the recorded ``log``: every rank's links into the temporary directory of
    root/step-3 precede the directory fsync before its rename, and every written stripe
    is fsync'd before the manifest is created."""
    events = [line.split("\t") for line in log.splitlines()]
    renames = [i for i, (what, _, a, _) in enumerate(events) if what == "rename" and commit.TMP_MARK in a
               and events[i][3] == str(root / "step-3")]
    assert len(renames) == 1, [e for e in events if e[0] == "rename"]
    r = renames[0]
    tmp = events[r][2]
    links = [i for i, (what, _, _, b) in enumerate(events) if what == "link" and os.path.dirname(b) == tmp]
    for rank in (0, 1):
        assert any(os.path.basename(events[i][3]).startswith(f"model-rank{rank:05d}-linked-") for i in links), rank
    m_open = min(i for i, (what, flags, a, _) in enumerate(events)
                 if what == "open" and int(flags) & os.O_CREAT and a == os.path.join(tmp, MANIFEST_NAME))
    dir_syncs = [i for i, (what, _, a, _) in enumerate(events) if what == "fsync" and a == tmp and m_open < i < r]
    assert dir_syncs and max(links) < min(dir_syncs), "a link was made after the directory fsync before the commit"
    written = {a for what, flags, a, _ in events if what == "open" and int(flags) & os.O_CREAT
               and os.path.dirname(a) == tmp and a.endswith(".safetensors")}
    assert written, "nothing was written into the temporary directory"
    for s in written:
        assert any(what == "fsync" and a == s and i < m_open for i, (what, _, a, _) in enumerate(events)), s


def test_every_ranks_links_are_durable_before_rank_0_commits(tmp_path):
    assert_links_durable_before_commit(run_ranks_logged(tmp_path, _RANK), tmp_path / "ck")
