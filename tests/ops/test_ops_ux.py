"""What a newcomer meets in the command line and the errors (issue 34, items 3-6 and 8):
round trips that keep what the README's resume recipe saves, a truthful ``ls``,
errors that point the right way, output that survives ``| head``."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys

import numpy as np
import pytest
import torch

import flashwrite as fw
from flashwrite import format as fmt
from flashwrite.errors import CorruptCheckpointError
from flashwrite.format import decode_manifest_json
from ops_helpers import run, save, state


def recipe_state() -> dict:
    """The README's resume recipe: model, optimizer, step and every RNG state."""
    torch.manual_seed(0)
    np.random.seed(1)
    random.seed(2)
    m = torch.nn.Linear(8, 4)
    opt = torch.optim.Adam(m.parameters())
    m(torch.randn(2, 8)).sum().backward()
    opt.step()
    return {"model": m.state_dict(), "optim": opt.state_dict(), "step": 3,
            "rng": {"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate()}}


def assert_rng_same(a: dict, b: dict) -> None:
    na, nb = a["rng"]["numpy"], b["rng"]["numpy"]
    assert isinstance(nb[1], np.ndarray) and nb[1].dtype == na[1].dtype
    assert nb[0] == na[0] and np.array_equal(na[1], nb[1]) and tuple(nb[2:]) == tuple(na[2:])
    assert b["rng"]["python"] == a["rng"]["python"] and torch.equal(a["rng"]["torch"], b["rng"]["torch"])
    np.random.set_state(nb)  # what the recipe does with it
    assert b["step"] == 3 and torch.equal(a["model"]["weight"], b["model"]["weight"])


# ------------------------------------------------------------------ item 3, 6e

def test_readme_recipe_round_trips_through_dcp(capsys, tmp_path):
    st = recipe_state()
    fw.save(st, tmp_path / "ck")
    assert run(capsys, "convert", tmp_path / "ck", tmp_path / "d", "--to", "dcp", "-q")[0] == 0
    rc, _, err = run(capsys, "convert", tmp_path / "d", tmp_path / "back", "-q")
    assert rc == 0, err
    assert_rng_same(st, fw.load(tmp_path / "back"))  # fw.load refused it: unknown tensor 'rng.numpy.1'
    assert run(capsys, "verify", tmp_path / "back", "-q")[0] == 0


def test_readme_recipe_round_trips_through_torch_save_without_allow_pickle(capsys, tmp_path):
    st = recipe_state()
    fw.save(st, tmp_path / "ck")
    assert run(capsys, "convert", tmp_path / "ck", tmp_path / "x.pt", "-q")[0] == 0
    rc, _, err = run(capsys, "convert", tmp_path / "x.pt", tmp_path / "back", "-q")  # numpy arrays are data
    assert rc == 0, err
    assert_rng_same(st, fw.load(tmp_path / "back"))


class Custom:  # a class torch's weights_only loader refuses
    pass


def test_pickle_refusal_names_the_class_and_not_torchs_advice(capsys, tmp_path):
    torch.save({"w": torch.ones(2), "obj": Custom()}, tmp_path / "c.pt")
    rc, _, err = run(capsys, "convert", tmp_path / "c.pt", tmp_path / "out", "-q")
    assert rc == 1 and "Custom" in err and "--allow-pickle" in err and str(tmp_path / "c.pt") in err
    assert "add_safe_globals" not in err and "safe_globals" not in err
    assert not os.path.exists(tmp_path / "out")


def _name_a_lost_array(ck) -> None:
    """A sealed manifest whose tree names an array whose tensor is not in the table:
    what the old DCP round trip wrote for np.random.get_state()."""
    p = ck / fmt.MANIFEST_NAME
    m = decode_manifest_json(p.read_bytes())
    m["tree"]["items"].append([{"t": "str", "v": "np"}, {"t": "ndarray", "v": {"t": "tensor", "k": "np.lost"}}])
    p.write_bytes(fmt.encode_manifest(m))


def test_verify_refuses_a_checkpoint_load_refuses(capsys, tmp_path):
    ck = tmp_path / "ck"
    fw.save({"a": torch.ones(3), "b": torch.zeros(2)}, ck, stripes=1)
    _name_a_lost_array(ck)
    with pytest.raises(CorruptCheckpointError, match="unknown tensor"):
        fw.load(ck)
    with pytest.raises(CorruptCheckpointError, match="unknown tensor"):
        fw.verify(ck)
    rc, out, err = run(capsys, "verify", ck, "-q")
    assert rc == 1 and "FAILED" in err and "'np.lost'" in err and "OK" not in out


# ------------------------------------------------------------------ item 4

def test_ls_does_not_say_verified_after_a_failed_verify(capsys, tmp_path):
    root = tmp_path / "root"
    ck = save(str(root / "step-00000010"))
    assert run(capsys, "verify", ck, "-q")[0] == 0
    assert json.loads(run(capsys, "ls", root, "--json")[1])[0]["verified"] == "yes"
    stripe = sorted(n for n in os.listdir(ck) if n.endswith(".safetensors"))[0]
    with open(os.path.join(ck, stripe), "r+b") as fh:  # flip the last byte: tensor data, not the header
        fh.seek(-1, os.SEEK_END)
        b = fh.read(1)
        fh.seek(-1, os.SEEK_END)
        fh.write(bytes([b[0] ^ 0xFF]))
    rc, _, err = run(capsys, "verify", ck, "-q")
    assert rc == 1 and "FAILED" in err
    row = json.loads(run(capsys, "ls", root, "--json")[1])[0]
    assert row["verified"] == "failed"
    _, out, _ = run(capsys, "ls", root)
    assert " yes " not in out and "failed" in out


# ------------------------------------------------------------------ item 5

def test_verify_interrupted_says_stopped_then_interrupted(capsys, tmp_path, monkeypatch):
    ck = save(str(tmp_path / "ck"))
    from flashwrite.loading import read

    def interrupted(self, *a, **kw):
        raise KeyboardInterrupt

    monkeypatch.setattr(read.CheckpointDir, "read", interrupted)
    rc, _, err = run(capsys, "verify", ck)
    assert rc == 130
    lines = err.strip().splitlines()
    assert lines[-1] == "interrupted" and lines[-2].endswith(" stopped"), lines
    assert not any(ln.endswith(" done") for ln in lines), lines


def test_diff_into_a_closed_pipe_is_quiet(tmp_path):
    n = 1500  # ~100 KB of table: more than a pipe holds
    fw.save({f"layer.{i}.weight": torch.full((2,), float(i)) for i in range(n)}, tmp_path / "a")
    fw.save({f"layer.{i}.weight": torch.full((2,), float(-i - 1)) for i in range(n)}, tmp_path / "b")
    p = subprocess.Popen([sys.executable, "-m", "flashwrite", "diff", str(tmp_path / "a"), str(tmp_path / "b"), "-q"],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert p.stdout.readline()  # what `| head -1` reads, then it goes away
    p.stdout.close()
    with p.stderr:
        err = p.stderr.read().decode()
    rc = p.wait(timeout=120)
    assert "Broken pipe" not in err and "Errno 32" not in err and "Traceback" not in err, err
    assert rc == 141  # 128 + SIGPIPE, as a tool the signal ended


# ------------------------------------------------------------------ item 6

@pytest.fixture
def wrong(tmp_path):
    """The inputs a user gets wrong: a torch.save file, a manager root, a plain file."""
    torch.save(state(), tmp_path / "t.pt")
    mgr = fw.CheckpointManager(str(tmp_path / "mgr"))
    for step in (5, 10):
        mgr.save(step, {"w": torch.ones(2) * step})
    mgr.wait()
    (tmp_path / "notes").write_text("some text that is long enough to be read\n")
    return tmp_path


def test_load_of_a_torch_save_file_points_to_torch_load_and_convert(wrong):
    for call in (fw.load, fw.verify):
        with pytest.raises((ValueError, OSError)) as ei:
            call(str(wrong / "t.pt"))
        msg = str(ei.value)
        assert "torch.save file" in msg and "torch.load" in msg and "flashwrite convert" in msg, msg


def test_load_of_a_manager_root_says_how_to_pick_a_step(wrong):
    root = str(wrong / "mgr")
    for call in (fw.load, fw.verify):
        with pytest.raises(FileNotFoundError) as ei:
            call(root)
        msg = str(ei.value)
        assert "CheckpointManager root" in msg and ".restore()" in msg, msg
        assert os.path.join(root, "step-00000010") in msg  # the newest step, by name
        assert not isinstance(ei.value, CorruptCheckpointError)


def test_a_plain_file_is_not_a_missing_directory(wrong):
    for call in (fw.load, fw.verify):
        with pytest.raises((ValueError, OSError)) as ei:
            call(str(wrong / "notes"))
        msg = str(ei.value)
        assert "not found" not in msg and "is a file" in msg or "not a safetensors file" in msg, msg
    with pytest.raises(NotADirectoryError, match="is a file, not a checkpoint directory"):
        fw.verify(str(wrong / "notes"))


def test_missing_destinations_are_counted_with_a_strict_hint(tmp_path):
    ck = tmp_path / "ck"
    fw.save({f"k{i:02d}": torch.full((1,), float(i)) for i in range(13)}, ck)
    with pytest.raises(KeyError) as ei:
        fw.load(ck, into={"k00": torch.zeros(1)})
    msg = str(ei.value)
    assert "12 tensor(s)" in msg and "and 2 more" in msg and "strict=False" in msg, msg
    out = fw.load(ck, into={"k00": torch.zeros(1)}, strict=False)
    assert float(out["k00"]) == 0.0 or float(out["k00"]) == 0


def test_convert_refuses_an_input_that_lost_tensors_its_record_names(capsys, tmp_path):
    fw.save(recipe_state(), tmp_path / "ck")
    assert run(capsys, "convert", tmp_path / "ck", tmp_path / "hf", "--to", "hf", "-q")[0] == 0
    side = tmp_path / "hf" / "flashwrite-tree.json"
    rec = json.loads(side.read_text())
    rec["tree"]["items"].append([{"t": "str", "v": "np"}, {"t": "ndarray", "v": {"t": "tensor", "k": "np.lost"}}])
    side.write_text(json.dumps(rec))
    rc, _, err = run(capsys, "convert", tmp_path / "hf", tmp_path / "back", "-q")
    assert rc == 1 and "np.lost" in err and "nothing was written" in err, err
    assert not os.path.exists(tmp_path / "back")


# ------------------------------------------------------------------ item 8

def _demo_result() -> dict:
    row = lambda name, stall: {"name": name, "label": name, "status": "ok", "stall_s": stall, "durable_s": 2.01,  # noqa: E731
                               "gbps": 0.27, "vs_device": 0.26, "cpu_s_per_gib": 3.1, "rss_growth": 1 << 28,
                               "load_s": 1.1, "load_vs_device": 0.28}
    return {"bytes": 512 << 20, "device": {"tool": "fio, O_DIRECT", "write_s": 0.52, "write_gbps": 1.03, "read_s": 0.31},
            "meta": {"filesystem": "ext4 on /dev/vda1", "cpus": 2, "cold_cache": "cold cache"},
            "memcpy": {"name": "memcpy, 2 threads", "label": "memcpy", "stall_s": 0.061},
            "rows": [row("torch.save + fsync", 2.013), row("flashwrite", 0.113)]}


def test_demo_table_fits_80_columns_without_cutting_words(monkeypatch):
    pytest.importorskip("rich")
    import io
    from flashwrite.ops import demo

    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    monkeypatch.setenv("COLUMNS", "80")
    out = Terminal()
    res = _demo_result()
    demo.render_table(demo.COLUMNS, demo.table_rows(res), demo.title(res), demo.notes(res), file=out)
    text = __import__("re").sub(r"\x1b\[[0-9;]*m", "", out.getvalue())
    table = text.split("stall: seconds")[0]
    assert max(len(ln.rstrip()) for ln in table.splitlines()) <= 80, table
    for whole in ("contender", "device limit (fio)", "memcpy, 2 threads", "torch.save + fsync", "flashwrite",
                  "durable", "0.113", "2.013", "0.28"):
        assert whole in table, (whole, table)  # was "conten"/"der", "flashw"/"rite"


def test_inspect_summarises_long_runs_of_ints(capsys, tmp_path):
    fw.save(recipe_state(), tmp_path / "ck")
    rc, out, _ = run(capsys, "inspect", tmp_path / "ck")
    assert rc == 0 and len(out.splitlines()) < 100, len(out.splitlines())
    assert "rng.python.1.0 .. rng.python.1.624" in out and "625 int values" in out and "--all-leaves" in out
    assert "rng.numpy.2" in out and "MT19937" in out  # short runs stay one line a leaf
    rc, full, _ = run(capsys, "inspect", tmp_path / "ck", "--all-leaves")
    assert rc == 0 and "rng.python.1.624" in full and len(full.splitlines()) > 625
    rc, js, _ = run(capsys, "inspect", tmp_path / "ck", "--json")
    assert len([k for k in json.loads(js)["leaves"] if k.startswith("rng.python.1.")]) == 625  # JSON: all


def test_info_with_a_cuda_runtime_but_no_driver_says_no_gpu():
    from flashwrite import _core
    from flashwrite.system.info import _no_driver
    seen = {**_core.cuda_info(initialize=False), "initialized": False, "library": "libcudart.so.13",
            "available": None, "device_count": None, "driver_version": 0}
    got = _no_driver(seen)
    assert got["available"] is False and got["device_count"] == 0
    assert "no CUDA driver" in got["reason"] and "libcudart.so.13" in got["reason"]
    with_driver = {**seen, "driver_version": 12040}
    assert _no_driver(with_driver) == with_driver  # a driver: unknown until initialised, as before
    info = fw.backend_info()["cuda"]
    # This machine is such a one (asked before CUDA was initialised in this process: an
    # earlier test that initialised it gets the runtime's own reason instead).
    if info.get("library") and info.get("driver_version") == 0 and not info.get("initialized"):
        assert info["available"] is False and "no CUDA driver" in info["reason"]
