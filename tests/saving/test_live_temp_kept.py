"""A live save's temporary directory is never swept as a dead one's (issue 44 item 2).

``temp_owner_alive`` tells the owner from a recycled pid by the process's start time
against the directory's last change, with 2 s of grace for the boot time's 1 s
resolution. A process that makes its directory at once after it starts sits at that
edge: with the grace's sign turned, a short script's (or a rank's right after a restart)
save was swept by another save into the same parent. The child here is a plain
interpreter that does not load flashwrite, so only the time rule can keep its
directories (a flashwrite process is kept also where the clock says otherwise).
"""

import contextlib
import os
import subprocess
import sys
import textwrap
import time

from flashwrite.saving import commit
from flashwrite.layout.names import HOST_TAG

_CHILD = textwrap.dedent("""
    import os, sys, time, uuid
    root, tag = sys.argv[1], sys.argv[2]
    t0 = time.monotonic()
    for i, at in enumerate((0.0, 0.1, 1.0, 3.0)):
        time.sleep(max(0.0, at - (time.monotonic() - t0)))
        os.mkdir(os.path.join(root, f".ck{i}.flashwrite-tmp-{os.getpid()}-{uuid.uuid4().hex[:12]}-h{tag}"))
    print("made", flush=True)
    sys.stdin.read()  # alive until the parent has swept
""")


def test_a_live_saves_temporary_directories_are_kept(tmp_path):
    p = subprocess.Popen([sys.executable, "-S", "-c", _CHILD, str(tmp_path), HOST_TAG], stdin=subprocess.PIPE,
                         stdout=subprocess.PIPE, text=True)
    try:
        assert p.stdout.readline().strip() == "made"
        made = sorted(os.listdir(tmp_path))
        assert len(made) == 4 and all(f"-tmp-{p.pid}-" in n for n in made), made
        for name in made:
            assert commit.temp_owner_alive(name, str(tmp_path / name)), name
        assert commit.clean_dead_saves(str(tmp_path)) == []
        assert sorted(os.listdir(tmp_path)) == made
    finally:
        p.stdin.close()
        p.wait(timeout=30)
        p.stdout.close()
    # Once the owner has exited, the same directories are a dead save's: swept.
    time.sleep(0.05)
    assert sorted(commit.clean_dead_saves(str(tmp_path))) == made
    assert os.listdir(tmp_path) == []


@contextlib.contextmanager
def _temp_dir_of_a_child(tmp_path, imports: str, age_s: float, *flags: str):
    """A live child (``python *flags``) that imports ``imports``, prints "up" and waits,
    and a temp directory named for its pid, last changed ``age_s`` seconds ago."""
    p = subprocess.Popen([sys.executable, *flags, "-c", f"import {imports}; print('up', flush=True); sys.stdin.read()"],
                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert p.stdout.readline().strip() == "up"
        d = tmp_path / f".ck.flashwrite-tmp-{p.pid}-0123456789ab-h{HOST_TAG}"
        d.mkdir()
        old = time.time() - age_s
        os.utime(d, (old, old))
        yield d
    finally:
        p.stdin.close()
        p.wait(timeout=30)
        p.stdout.close()


def test_a_recycled_pid_that_is_no_flashwrite_process_is_not_the_owner(tmp_path):
    """The other side of the rule: a live pid whose process started well after the
    directory last changed, and that does not run flashwrite, did not make it."""
    with _temp_dir_of_a_child(tmp_path, "sys", 60, "-S") as d:
        assert not commit.temp_owner_alive(d.name, str(d))
        assert commit.clean_dead_saves(str(tmp_path)) == [d.name]


def test_a_flashwrite_process_the_clock_calls_younger_is_kept(tmp_path):
    """A wall clock stepped forward after the directory last changed (NTP's first sync
    after a restart, a resumed VM) makes its owner look younger than it: a process that
    runs flashwrite is kept all the same (never delete what might be live)."""
    with _temp_dir_of_a_child(tmp_path, "sys, flashwrite", 3600) as d:
        assert commit.temp_owner_alive(d.name, str(d))
        assert commit.clean_dead_saves(str(tmp_path)) == []
