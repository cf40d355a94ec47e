"""The saving side of the kill -9 tests.

``python fault_child.py zygote`` imports torch and flashwrite once, then for each
JSON request on stdin forks a fresh process that saves checkpoints through a
CheckpointManager until the test kills it (SIGKILL) or it finishes. The zygote
reaps it and reports ``exit <pid> <code>``. Forking keeps 25+ trials cheap; each
victim is still a real, separate process killed at a real moment.

The victim prints one line per phase it enters (``phase <name> <n>``, n counting
that phase's occurrences), so the test knows where each kill landed. With
``pause`` set it stops for good at the n-th entry of that phase (after printing
``paused``): the kill then lands exactly there. The probes only observe: they
call the real functions unchanged.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
import traceback


def emit(*parts) -> None:
    # One write per line: atomic on a pipe, whichever process or thread writes.
    os.write(1, (" ".join(str(p) for p in parts) + "\n").encode())


_counts: dict[str, int] = {}
_counts_lock = threading.Lock()


def _hit(phase: str, pause: tuple[str, int] | None) -> None:
    with _counts_lock:
        n = _counts[phase] = _counts.get(phase, 0) + 1
    emit("phase", phase, n)
    if pause is not None and pause == (phase, n):
        emit("paused", phase, n)
        while True:
            time.sleep(3600)


def install_probes(pause: tuple[str, int] | None) -> None:
    import flashwrite._core as core
    from flashwrite.saving import commit
    from flashwrite.targets import target
    from flashwrite.format import MANIFEST_NAME

    save = sys.modules["flashwrite.saving.save"]  # the module (flashwrite.save is the function)

    def wrap(owner, name, classify, after=None):
        real = getattr(owner, name)

        def probe(*args, **kwargs):
            phase = classify(*args, **kwargs)
            if phase:
                _hit(phase, pause)
            out = real(*args, **kwargs)
            if after:
                _hit(after, pause)
            return out

        setattr(owner, name, probe)

    wrap(save.SaveFuture, "wait_staged", lambda *a, **k: "staging")
    wrap(save.StripeWrite, "wait_durable", lambda *a, **k: "writing", after="durable")
    wrap(target.LocalTarget, "write_durable",
         lambda _target, path, data: "write-manifest" if path.endswith(MANIFEST_NAME) else "write-index")
    wrap(os, "fsync", lambda fd: "fsync-file")
    wrap(core, "fsync_dir", lambda path: "fsync-tmpdir" if commit.TMP_MARK in path else "fsync-parent")
    wrap(core, "rename_exchange", lambda a, b: "exchange", after="exchanged")
    wrap(os, "rename", lambda a, b, **k: "retention-rename" if commit.OLD_MARK in os.fspath(b) else
         "rename" if commit.TMP_MARK in os.fspath(a) else "rename-other")
    wrap(os, "unlink", lambda p, **k: "retention-unlink-manifest" if os.fspath(p).endswith(MANIFEST_NAME)
         and "dir_fd" not in k else "rmtree-unlink")


def victim(req: dict) -> None:
    import flashwrite as fw
    from fault_util import make_state

    pause = tuple(req["pause"]) if req.get("pause") else None
    install_probes(pause)
    n = req["n"]
    writer = fw.Writer(stripes=3, chunk_bytes=1 << 20)
    mgr = fw.CheckpointManager(req["root"], every_n_steps=1, keep_last=2, writer=writer)
    start = (mgr.latest_step() or 0) + 1
    emit("ready", start)
    for step in range(start, start + req["saves"]):
        label = step
        if req.get("overwrite") and step > start:
            # Replace the newest checkpoint with another version of itself.
            label = mgr.latest_step()
            state = make_state(label + req["overwrite"], n)
            emit("stage", label, "overwrite")
            fut = mgr.save(label, state, overwrite=True)
        else:
            state = make_state(step, n)
            emit("stage", step)
            fut = mgr.maybe_save(step, state)
            del state
        emit("staged", label)
        fut.add_done_callback(lambda f, s=label: emit("committed", s) if f.exception() is None else
                              emit("failed", s, repr(f.exception())))
    mgr.close()
    writer.close()  # every done-callback (and its "committed" line) has run
    emit("finished")


def zygote() -> None:
    import warnings

    warnings.simplefilter("ignore")
    import torch  # noqa: F401  (preloaded for every victim)

    import flashwrite  # noqa: F401

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import fault_util  # noqa: F401

    for line in sys.stdin:
        req = json.loads(line)
        pid = os.fork()
        if pid == 0:
            code = 0
            try:
                victim(req)
            except BaseException:
                traceback.print_exc()
                code = 1
            finally:
                sys.stderr.flush()
                os._exit(code)
        emit("forked", pid)
        _, status = os.waitpid(pid, 0)
        emit("exit", pid, os.waitstatus_to_exitcode(status))


if __name__ == "__main__":
    if sys.argv[1:] != ["zygote"]:
        sys.exit("usage: fault_child.py zygote")
    zygote()
