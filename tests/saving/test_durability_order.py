"""Durability order of a commit, observed in the system calls a save makes.

An LD_PRELOAD recorder (tests/shim_syscall_log.c) logs every open, fsync/fdatasync and
rename with the synced fd's path. For each published checkpoint the log must show:
every stripe fsync'd before the manifest is created; the manifest and the temporary
directory fsync'd before the rename; the parent directory fsync'd after the rename
and before save() returns. Plain fw.save is checked on its own: the manager's own
fsync of its root must not be what makes a checkpoint durable.
"""

from __future__ import annotations

import os
import textwrap

import pytest
from shim_util import build_shim, preload_env, run_child

from flashwrite.saving import commit
from flashwrite.format import MANIFEST_NAME

O_CREAT = os.O_CREAT


@pytest.fixture(scope="module")
def recorder(tmp_path_factory):
    return build_shim("shim_syscall_log", tmp_path_factory.mktemp("shim"))


_CHILD = textwrap.dedent("""
    import os, sys, torch, flashwrite as fw
    top, backend, scenarios = sys.argv[1], sys.argv[2], sys.argv[3:]
    g = torch.Generator().manual_seed(0)
    # Big enough (~24 MiB) that writes are still in flight when staging ends.
    sd = {"a": torch.randn(4 << 20, generator=g), "b": torch.randn(2 << 20, generator=g), "n": torch.arange(9)}
    w = fw.Writer(stripes=3, chunk_bytes=1 << 20, backend=backend)
    for how in scenarios:
        root = os.path.join(top, how)
        os.mkdir(root)
        def returned(i):  # a marker in the log: save() has returned
            os.close(os.open(os.path.join(root, f"returned-{i}"), os.O_CREAT | os.O_WRONLY, 0o644))
        if how == "save":
            w.save(sd, os.path.join(root, "ck")); returned(0)
        elif how == "overwrite":
            w.save(sd, os.path.join(root, "ck")); returned(0)
            w.save(sd, os.path.join(root, "ck"), overwrite=True); returned(1)
        elif how == "overwrite_rename":  # no RENAME_EXCHANGE: the old one is moved aside, then replaced
            from flashwrite.targets.target import LocalTarget
            exchange = LocalTarget.exchange
            LocalTarget.exchange = lambda self, a, b: False
            w.save(sd, os.path.join(root, "ck")); returned(0)
            w.save(sd, os.path.join(root, "ck"), overwrite=True); returned(1)
            LocalTarget.exchange = exchange
        elif how == "save_async":
            w.save_async(sd, os.path.join(root, "ck")).result(); returned(0)
        elif how == "fw.save":
            fw.save(sd, os.path.join(root, "ck"), backend=backend); returned(0)
        elif how == "extra_files":
            w.save(sd, os.path.join(root, "ck"), extra_files={"trainer_state.json": b"{}", "tokenizer.json": b"[]"})
            returned(0)
        elif how == "incremental":  # the second save links the stripes of a and b, writes n's
            wi = fw.Writer(stripes=3, chunk_bytes=1 << 20, backend=backend, incremental=True)
            wi.save(sd, os.path.join(root, "ck1")); returned(0)
            wi.save(dict(sd, n=torch.arange(9) + 1), os.path.join(root, "ck2")); returned(1)
            wi.close()
        elif how == "manager":
            with fw.CheckpointManager(os.path.join(root, "m"), every_n_steps=1, writer=w) as mgr:
                mgr.maybe_save(1, sd); mgr.wait(); returned(0)
    w.close()
""")

SCENARIOS = ["save", "overwrite", "overwrite_rename", "save_async", "fw.save", "manager", "extra_files", "incremental"]


@pytest.fixture(scope="module", params=["threads", "auto"])
def traces(request, recorder, tmp_path_factory):
    """One child per backend runs every scenario, each in its own directory; the log is
    split by directory (the parent's own fsync included)."""
    top = tmp_path_factory.mktemp(f"order-{request.param}")
    log = top / "syscalls.log"
    # Stripe fsyncs made slow: a commit that does not wait for them shows, every time.
    env = preload_env(recorder, FW_SYSCALL_LOG=str(log), FW_SYSCALL_SLOW_SUFFIX=".safetensors", FW_SYSCALL_SLOW_MS="150")
    run_child(_CHILD, env, str(top), request.param, *SCENARIOS)
    lines = [line.split("\t") for line in log.read_text().splitlines()]
    out = {}
    for how in SCENARIOS:
        root = os.path.join(str(top), how)
        out[how] = [(w, int(n), a, b) for w, n, a, b in lines if a == root or a.startswith(root + "/")]
    return out


def _check_commit_order(events, expected_commits):
    renames = [i for i, (what, _, a, _) in enumerate(events) if what == "rename" and commit.TMP_MARK in a]
    assert len(renames) == expected_commits, events
    returns = [i for i, (what, _, a, _) in enumerate(events) if what == "open" and "/returned-" in a]
    for k, r in enumerate(renames):
        _, _, tmp, final = events[r]
        parent = os.path.dirname(final)
        opens = {i: a for i, (what, flags, a, _) in enumerate(events) if what == "open" and flags & O_CREAT}
        stripes = sorted({a for i, a in opens.items() if os.path.dirname(a) == tmp and a.endswith(".safetensors")})
        assert stripes, f"no stripe files created in {tmp}"
        m_open = min(i for i, a in opens.items() if a == os.path.join(tmp, MANIFEST_NAME))
        synced = lambda path, lo, hi: [i for i, (what, _, a, _) in enumerate(events)  # noqa: E731
                                       if what == "fsync" and a == path and lo < i < hi]
        for s in stripes:
            assert synced(s, -1, m_open), f"stripe {os.path.basename(s)} not fsync'd before the manifest was created"
        assert synced(os.path.join(tmp, MANIFEST_NAME), m_open, r), "manifest not fsync'd before the rename"
        assert synced(tmp, m_open, r), "temporary directory not fsync'd (after the manifest) before the rename"
        ret = next(i for i in returns if i > r)
        assert synced(parent, r, ret), "parent directory not fsync'd after the rename, before save() returned"
        assert ret == returns[k]


@pytest.mark.parametrize("how", ["save", "overwrite", "overwrite_rename", "save_async", "fw.save", "extra_files"])
def test_commit_is_durable_in_order(traces, how):
    _check_commit_order(traces[how], 2 if how.startswith("overwrite") else 1)


RENAME_EXCHANGE = 2


@pytest.mark.parametrize("how", ["overwrite", "overwrite_rename"])
def test_replaced_checkpoint_is_removed_only_after_the_swap_is_durable(traces, how):
    """overwrite=True: the checkpoint replaced (swapped to the temporary name by
    RENAME_EXCHANGE, or moved aside first where the file system cannot exchange) loses
    its files only after the parent directory's fsync has made the swap durable: a crash
    before it may bring the old name back, which must then still hold the old checkpoint."""
    events = traces[how]
    r = [i for i, (what, _, a, _) in enumerate(events) if what == "rename" and commit.TMP_MARK in a][1]
    _, flags, tmp, final = events[r]
    parent = os.path.dirname(final)
    if flags & RENAME_EXCHANGE:
        old, since = tmp, r  # the old checkpoint is at the temporary name from the exchange on
    else:
        assert how == "overwrite_rename" or flags == 0, events[r]
        since, old = next((i, b) for i, (what, _, a, b) in enumerate(events[:r]) if what == "rename" and a == final)
        assert commit.OLD_MARK in old
    if how == "overwrite_rename":
        assert not flags & RENAME_EXCHANGE, "the exchange was not turned off"
    gone = [i for i, (what, _, a, _) in enumerate(events)
            if i > since and what in ("unlink", "rmdir") and (a == old or a.startswith(old + "/"))]
    removed = {events[i][2] for i in gone}
    assert os.path.join(old, MANIFEST_NAME) in removed and old in removed, f"the old checkpoint was not removed: {events}"
    assert any(a.endswith(".safetensors") for a in removed), removed
    synced = [i for i, (what, _, a, _) in enumerate(events) if what == "fsync" and a == parent and i > r]
    assert synced and synced[0] < gone[0], (
        f"{events[gone[0]][2]} removed before the parent's fsync made the swap durable")


def test_manager_commit_is_durable_in_order(traces):
    """(The manager also fsyncs its root; plain saves above show the commit does not rely on it.)"""
    _check_commit_order(traces["manager"], 1)


def test_extra_files_are_durable_before_the_manifest(traces):
    """Files given with extra_files= are made and fsync'd inside the temporary directory
    before the manifest exists: the checkpoint never appears without them."""
    events = traces["extra_files"]
    r = next(i for i, (what, _, a, _) in enumerate(events) if what == "rename" and commit.TMP_MARK in a)
    tmp = events[r][2]
    m_open = min(i for i, (what, flags, a, _) in enumerate(events)
                 if what == "open" and flags & O_CREAT and a == os.path.join(tmp, MANIFEST_NAME))
    for name in ("trainer_state.json", "tokenizer.json"):
        path = os.path.join(tmp, name)
        assert any(what == "fsync" and a == path and i < m_open for i, (what, _, a, _) in enumerate(events)), name


def test_incremental_links_are_durable_before_the_commit(traces):
    """An incremental save's hard links are made in the temporary directory before the
    fsync of that directory that precedes the rename: the committed checkpoint never
    lacks a linked stripe after a crash."""
    events = traces["incremental"]
    _check_commit_order(events, 2)
    renames = [i for i, (what, _, a, _) in enumerate(events) if what == "rename" and commit.TMP_MARK in a]
    r = renames[1]
    tmp = events[r][2]
    links = [i for i, (what, _, _, b) in enumerate(events) if what == "link" and os.path.dirname(b) == tmp]
    assert links, f"the second save linked nothing: {events}"
    dir_syncs = [i for i, (what, _, a, _) in enumerate(events) if what == "fsync" and a == tmp and i < r]
    assert dir_syncs and max(links) < max(dir_syncs)
