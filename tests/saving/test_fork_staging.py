"""fork() and the staging pool (issue 27, item 1). Private staging slabs are
MADV_DONTFORK: a child made by fork() (DataLoader workers) neither copies nor
shares them, and a child that saves through an inherited Writer stages into a pool
of its own. The shared pool in /dev/shm is not marked (it is shared on purpose)."""

import json
import os
import subprocess
import sys
import textwrap

from flashwrite import _core


def _vmas():
    """[(start, end, path, flags)] of this process's mappings, from /proc/self/smaps."""
    out, cur = [], None
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()
            if "-" in head[0] and not head[0].endswith(":"):
                lo, hi = (int(x, 16) for x in head[0].split("-"))
                cur = [lo, hi, head[5] if len(head) > 5 else "", set()]
                out.append(cur)
            elif head[0] == "VmFlags:":
                cur[3] = set(head[1:])
    return out


def _dont_fork_bytes() -> int:
    return sum(hi - lo for lo, hi, _, flags in _vmas() if "dc" in flags)


def test_private_staging_slabs_are_not_inherited_by_fork():
    before = _dont_fork_bytes()
    eng = _core.Engine(1 << 20)
    eng.reserve(48 << 20)
    assert eng.pool_bytes == 48 << 20
    assert _dont_fork_bytes() - before >= 48 << 20
    eng.trim()
    assert _dont_fork_bytes() - before < 48 << 20


def test_shared_staging_file_is_inherited(tmp_path):
    path = str(tmp_path / "pool")
    eng = _core.Engine(1 << 20)
    eng.set_backing_file(path)
    eng.reserve(8 << 20)
    assert eng.file_backed
    mapped = [flags for _, _, p, flags in _vmas() if p == path]
    assert mapped and all("dc" not in flags for flags in mapped)


_FORK = """
    import json, os, sys, torch, flashwrite as fw
    d = sys.argv[1]
    sd = {"w": torch.randn(2_000_000), "b": torch.arange(50_000, dtype=torch.int64)}
    w = fw.Writer(chunk_bytes=1 << 20)
    w.save(sd, d + "/parent-1")
    pool = w.pool_bytes

    def dc_bytes():
        total, size = 0, 0
        for line in open("/proc/self/smaps"):
            head = line.split()
            if "-" in head[0] and not head[0].endswith(":"):
                lo, hi = (int(x, 16) for x in head[0].split("-"))
                size = hi - lo
            elif head[0] == "VmFlags:" and "dc" in head[1:]:
                total += size
        return total

    def same(path, ref):  # numpy, not torch: PyTorch's OpenMP pool hangs in a forked child once used
        back = fw.load(path)
        return all(back[k].numpy().tobytes() == v.numpy().tobytes() for k, v in ref.items())

    child_sd = {k: v + 1 for k, v in sd.items()}
    r, wfd = os.pipe()
    pid = os.fork()
    if pid == 0:
        import faulthandler
        faulthandler.dump_traceback_later(120, exit=True)  # a hung child never outlives the test
        res = {"inherited_dc": dc_bytes()}  # the parent's slabs are not here
        try:
            w.save(child_sd, d + "/child-inherited")  # the parent's Writer: a pool of its own
            fw.save(child_sd, d + "/child-new")
            res["ok"] = same(d + "/child-inherited", child_sd) and same(d + "/child-new", child_sd)
            res["child_pool"] = w.pool_bytes
        except BaseException as e:
            res["error"] = repr(e)
        os.write(wfd, json.dumps(res).encode())
        os._exit(0)
    os.close(wfd)
    child = json.loads(os.read(r, 1 << 16).decode())
    os.waitpid(pid, 0)
    w.save(sd, d + "/parent-2")  # the parent's pool is whole and still its own
    print(json.dumps({"child": child, "parent_ok": same(d + "/parent-1", sd) and same(d + "/parent-2", sd),
                      "pool": pool, "pool_after": w.pool_bytes, "parent_dc": dc_bytes()}))
"""


def test_forked_child_saves_through_an_inherited_writer(tmp_path):
    r = subprocess.run([sys.executable, "-c", textwrap.dedent(_FORK), str(tmp_path)], capture_output=True, text=True,
                       timeout=180)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout.strip().splitlines()[-1])
    child = out["child"]
    assert "error" not in child, child
    assert child["ok"] is True and child["child_pool"] > 0
    assert child["inherited_dc"] < out["pool"]  # not inherited (dc bytes of the child are only its own)
    assert out["parent_ok"] is True and out["pool_after"] == out["pool"]
    assert out["parent_dc"] >= out["pool"]
