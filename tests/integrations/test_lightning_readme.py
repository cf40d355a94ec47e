"""The README's Lightning snippet, as written, on the installed Lightning: it configures
(ModelCheckpoint(save_top_k=2) needs a monitor), saves top 2 + last, and resumes from
"last"; loading a module from a flashwrite checkpoint works through the helper."""

import json
import os
import subprocess
import sys

import pytest

# This file lives one folder below tests/: its paths are reckoned from there.
_TESTS_FILE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "conftest.py")


pytest.importorskip("lightning.pytorch", reason="Lightning is not installed (pip install 'flashwrite[lightning]')")

HERE = os.path.dirname(_TESTS_FILE)
README = os.path.join(HERE, os.pardir, "README.md")


def _run(root, epochs):
    env = dict(os.environ, PYTHONWARNINGS="ignore")
    r = subprocess.run([sys.executable, os.path.join(HERE, "lightning_readme_child.py"), README, str(root),
                        str(epochs)], capture_output=True, text=True, timeout=600, env=env)
    assert r.returncode == 0, r.stderr[-4000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


@pytest.mark.slow  # README suite budget (issue 36): the slow job in CI runs it
def test_readme_lightning_snippet_runs_and_resumes(tmp_path):
    first = _run(tmp_path, 3)
    assert first["monitor"] == "val_loss"
    assert first["start_step"] == 0 and first["global_step"] == 12  # 3 epochs of 4 batches
    assert len(first["best_k"]) == 2 and set(first["best_k"]) < set(first["files"])
    assert "last.ckpt" in first["files"] and len(first["files"]) == 3
    for name in first["files"]:
        assert os.path.isfile(tmp_path / "checkpoints" / name / "flashwrite.json")
    # Lightning's own load_from_checkpoint cannot read a directory; the helper can, with its arguments.
    assert first["lightning_load"] == "IsADirectoryError"
    assert first["helper_same_weights"] and first["helper_hparams"] == {"hidden": 16, "lr": 0.5}
    assert isinstance(first["validate_val_loss"], float)

    second = _run(tmp_path, 4)  # the same snippet again: ckpt_path="last" resumes at step 12
    assert second["start_step"] == 12 and second["global_step"] == 16
    assert len(second["best_k"]) == 2 and len(second["files"]) == 3
