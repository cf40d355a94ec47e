"""fork() while a copy or write thread holds the staging pool's lock (issue 37, item 4):
DataLoader workers fork during saves. Without pthread_atfork handlers the child inherits the
lock taken, with no thread left to give it back, and its first save hangs."""

import json
import os
import subprocess
import sys
import textwrap

_SCRIPT = """
    import json, os, sys, time, torch
    from flashwrite import _core
    d = sys.argv[1]
    MiB = 1 << 20

    def start(eng, path, t):
        n = t.numel() * t.element_size()
        return eng.start_save([(path, b"", n)], [(t.data_ptr(), n, 0, 0, -1)], [[t]], streams=[])

    eng = _core.Engine(MiB)
    big = torch.randint(0, 255, (160 * MiB,), dtype=torch.uint8)
    small = torch.arange(MiB, dtype=torch.uint8)
    job = start(eng, os.path.join(d, "big"), big)  # 160 slot releases, each holding the lock 20 ms
    hung = ok = 0
    for i in range(10):
        time.sleep(0.05)
        pid = os.fork()
        if pid == 0:
            j = start(eng, os.path.join(d, f"child{i}"), small)
            j.wait()
            j.rethrow()
            os._exit(0 if open(os.path.join(d, f"child{i}"), "rb").read() == bytes(small.numpy()) else 3)
        deadline = time.monotonic() + 10
        while True:
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                ok += os.waitstatus_to_exitcode(status) == 0
                break
            if time.monotonic() > deadline:
                os.kill(pid, 9)
                os.waitpid(pid, 0)
                hung += 1
                break
            time.sleep(0.02)
    job.wait()
    job.rethrow()
    print(json.dumps({"hung": hung, "ok": ok}))
"""


def test_a_child_forked_while_the_pool_lock_is_held_can_save(tmp_path):
    env = {**os.environ, "FLASHWRITE_TEST_POOL_LOCK_HOLD_US": "20000"}
    env.pop("FLASHWRITE_CUDA_RUNTIME", None)
    r = subprocess.run([sys.executable, "-c", textwrap.dedent(_SCRIPT), str(tmp_path)], env=env,
                       capture_output=True, text=True, timeout=240)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out == {"hung": 0, "ok": 10}, out
