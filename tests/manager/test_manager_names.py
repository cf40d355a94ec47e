"""CheckpointManager(name=...): directory names other than step-%08d (e.g. the Trainer's
checkpoint-{step}), with listing, retention, restore and the local tier; save options
passed through and the on_commit hook."""

import json
import logging
import os

import pytest
from conftest import assert_same
from fault_util import make_state, temp_entries

import flashwrite as fw

N = 1 << 12


def state(step):
    return make_state(step, N)


def test_checkpoint_names_with_retention_and_restore(tmp_path):
    (tmp_path / "checkpoint-007").mkdir()  # not this pattern's exact name for step 7
    (tmp_path / "checkpoint-8").mkdir()    # no manifest: not a checkpoint
    (tmp_path / "step-00000009").mkdir()
    with fw.CheckpointManager(tmp_path, every_n_steps=10, keep_last=2, name="checkpoint-{step}") as mgr:
        for s in range(1, 51):
            mgr.maybe_save(s, state(s))
        mgr.wait()
        assert mgr.all_steps() == [40, 50]
        assert mgr.path_for(50) == str(tmp_path / "checkpoint-50")
        step, got = mgr.restore()
    assert step == 50
    assert_same(got, state(50))
    assert sorted(os.listdir(tmp_path)) == ["checkpoint-007", "checkpoint-40", "checkpoint-50", "checkpoint-8",
                                            "step-00000009"]
    assert temp_entries(tmp_path) == []


def test_formatted_names_and_the_default(tmp_path):
    with fw.CheckpointManager(tmp_path / "a", name="ckpt_{step:06d}.fw") as mgr:
        mgr.save(3, state(3))
        mgr.wait()
        assert os.listdir(tmp_path / "a") == ["ckpt_000003.fw"] and mgr.all_steps() == [3]
    with fw.CheckpointManager(tmp_path / "b") as mgr:
        mgr.save(3, state(3))
        mgr.wait()
        assert os.listdir(tmp_path / "b") == ["step-00000003"]


@pytest.mark.parametrize("name", ["checkpoint", "checkpoint-{step}-{step}", "{epoch}-{step}", "sub/{step}",
                                  ".hidden-{step}", "c-{step!r}", "c-{step:q}"])
def test_bad_names_are_refused(tmp_path, name):
    with pytest.raises(ValueError, match="name"):
        fw.CheckpointManager(tmp_path, name=name)


def test_local_tier_goes_by_the_name(tmp_path, shmdir, caplog):
    root = tmp_path / "run"
    with fw.CheckpointManager(root, name="checkpoint-{step}", local_snapshots=True, local_dir=shmdir,
                              keep_local=True) as m:
        m.save(4, state(4))
    with fw.CheckpointManager(root, name="checkpoint-{step}", local_snapshots=True, local_dir=shmdir) as m2:
        assert list(m2.find_local_snapshots()) == [4]
        with caplog.at_level(logging.INFO, logger="flashwrite"):
            step, got = m2.restore()
        assert step == 4 and "from local memory" in caplog.text
        assert_same(got, state(4))
    # A manager with another pattern on the same root sees neither the checkpoint nor the snapshot.
    with fw.CheckpointManager(root, local_snapshots=True, local_dir=shmdir) as m3:
        assert m3.all_steps() == [] and m3.find_local_snapshots() == {} and m3.restore() is None


def test_save_options_and_on_commit(tmp_path):
    seen = []

    def on_commit(step, path):  # runs after the commit, before wait() returns
        seen.append((step, path, sorted(os.listdir(path))))

    st = {"model": {"w": state(1)["model"]["w"]}, "step": 1}
    with fw.CheckpointManager(tmp_path, name="checkpoint-{step}", on_commit=on_commit) as mgr:
        mgr.save(1, st, hf_model="model", hf_config={"model_type": "none"},
                 extra_files={"trainer_state.json": b'{"global_step": 1}'})
        mgr.wait()
        assert [s for s, _, _ in seen] == [1]
        with pytest.raises(TypeError, match="unknown save options"):
            mgr.save(2, st, overwrite_everything=True)
    _, path, names = seen[0]
    assert path == str(tmp_path / "checkpoint-1")
    assert {"config.json", "trainer_state.json", "model.safetensors.index.json", "flashwrite.json"} <= set(names)
    assert json.loads((tmp_path / "checkpoint-1" / "trainer_state.json").read_text()) == {"global_step": 1}


def test_manager_save_options_follow_the_writers_signature():
    # Derived from Writer.save_async, less what the manager sets itself: a save option
    # added there reaches CheckpointManager.save without a second list to keep.
    import inspect
    from flashwrite.manager.setup import SAVE_OPTIONS
    kw = {k for k, p in inspect.signature(fw.Writer.save_async).parameters.items()
          if p.kind is inspect.Parameter.KEYWORD_ONLY}
    assert set(SAVE_OPTIONS) == {"hf_model", "hf_config", "extra_files"} and set(SAVE_OPTIONS) <= kw
