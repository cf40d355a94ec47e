import json
import os

import pytest
import torch

import flashwrite as fw
from flashwrite import tuning
from ops_helpers import run


@pytest.fixture(autouse=True)
def config_dir(tmp_path, monkeypatch):
    d = tmp_path / "config"
    monkeypatch.setenv("FLASHWRITE_CONFIG_DIR", str(d))
    return d


def test_tune_json_within_a_tiny_budget(capsys, tmp_path):
    work = tmp_path / "work"
    work.mkdir()
    rc, out, _ = run(capsys, "tune", work, "--budget-s", "4", "--size", "16MiB", "--device-tool", "probe", "--json")
    assert rc == 0
    r = json.loads(out)
    for k in ("stripes", "queue_depth", "chunk_bytes"):
        assert isinstance(r[k], int) and r[k] == r["recommended"][k]
    assert r["trials"] and all(t["gbps"] > 0 for t in r["trials"])
    assert r["filesystem"]["mount_point"] and os.listdir(work) == []  # trials cleaned up


def test_tune_save_is_picked_up_by_writer_and_reported(capsys, tmp_path, config_dir):
    work = tmp_path / "work"
    work.mkdir()
    rc, out, _ = run(capsys, "tune", work, "--budget-s", "3", "--size", "16MiB", "--device-tool", "probe", "--save")
    assert rc == 0 and "recommended:" in out and "saved for" in out
    store = json.loads((config_dir / "tunings.json").read_text())
    (key, rec), = store["filesystems"].items()
    assert key == tuning.mount_of(work)["key"]
    # Pretend the tune found something distinctive, so its use is visible.
    rec.update(stripes=3, queue_depth=5, chunk_bytes=2 << 20)
    (config_dir / "tunings.json").write_text(json.dumps(store))
    sd = {f"t{i}": torch.randn(1000) for i in range(6)}
    st = fw.save(sd, work / "a")
    assert (st.settings["stripes"], st.settings["queue_depth"], st.settings["chunk_bytes"]) == (3, 5, 2 << 20)
    assert st.settings["source"] == {"stripes": "tuned", "queue_depth": "tuned", "chunk_bytes": "tuned"}
    assert st.stripes == 3 and len(fw.verify(work / "a") and os.listdir(work / "a")) >= 3
    with fw.Writer(stripes=2) as w:  # an explicit setting wins; the rest still come from the tuning
        st = w.save(sd, work / "b")
    assert st.settings["stripes"] == 2 and st.settings["source"]["stripes"] == "explicit"
    assert st.settings["source"]["queue_depth"] == "tuned"
    info = fw.backend_info(str(work))["settings"]
    assert info["stripes"] == 3 and info["tuning"]["key"] == key
    assert fw.load(work / "b")["t0"].equal(sd["t0"])


def test_without_a_tuning_defaults_are_used_and_said(tmp_path):
    st = fw.save({"x": torch.ones(3)}, tmp_path / "a")
    assert set(st.settings["source"].values()) == {"default"} and st.settings["tuning"] is None


def test_damaged_store_is_ignored(tmp_path, config_dir):
    config_dir.mkdir()
    (config_dir / "tunings.json").write_text("{broken")
    assert fw.backend_info(str(tmp_path))["settings"]["tuning"] is None
    key = tuning.mount_of(tmp_path)["key"]
    (config_dir / "tunings.json").write_text(json.dumps({"filesystems": {key: {"stripes": -1, "queue_depth": 4,
                                                                                "chunk_bytes": 12345}}}))
    assert fw.backend_info(str(tmp_path))["settings"]["tuning"] is None


def test_mount_of_picks_the_longest_mount_point(tmp_path):
    m = tuning.mount_of(tmp_path / "not" / "yet" / "there")
    assert str(tmp_path).startswith(m["mount_point"]) and m["key"].endswith("@" + m["mount_point"])


def test_tune_bad_arguments(capsys, tmp_path):
    assert run(capsys, "tune", tmp_path / "missing", "--budget-s", "1")[0] == 2
    assert run(capsys, "tune", tmp_path, "--budget-s", "0")[0] == 2  # a bad option: usage
    assert run(capsys, "tune", tmp_path, "--budget-s", "abc")[0] == 2
    assert run(capsys, "tune")[0] == 2


def test_progress_is_plain_lines_off_a_terminal(capsys, tmp_path):
    work = tmp_path / "work"
    work.mkdir()
    rc, _, err = run(capsys, "tune", work, "--budget-s", "2", "--size", "16MiB", "--device-tool", "probe")
    assert rc == 0 and "tune " in err and "MB/s" in err and "\x1b[" not in err


def test_progress_bar_on_a_terminal():
    import io
    from flashwrite.ops.progress import Progress

    class Tty(io.StringIO):
        def isatty(self):
            return True

    out = Tty()
    p = Progress(stream=out)
    assert p.rich
    p.start(10 << 20, "convert")
    p.advance(5 << 20)
    p.finish()
    assert "convert" in out.getvalue() and "MiB" in out.getvalue()


def test_a_url_takes_no_local_tuning(tmp_path, config_dir, monkeypatch):
    """nfs:// names no local file system: a tuning saved for the current directory's (where
    a URL read as a path would lead) is not applied to it, by a save or by Writer.prepare."""
    monkeypatch.chdir(tmp_path)
    key = tuning.mount_of(tmp_path)["key"]
    config_dir.mkdir()
    (config_dir / "tunings.json").write_text(json.dumps({"version": 1, "filesystems": {
        key: {"stripes": 3, "queue_depth": 5, "chunk_bytes": 2 << 20}}}))
    assert tuning.resolve(str(tmp_path), {})["source"]["stripes"] == "tuned"  # the local path does take it
    url = "nfs://127.0.0.1/export/ckpt/step-1"
    r = tuning.resolve(url, {})
    assert set(r["source"].values()) == {"default"} and r["tuning"] is None
    with fw.Writer() as w:
        chunk = w.chunk_bytes
        w.prepare({"x": torch.ones(1 << 20)}, "nfs://127.0.0.1/export/ckpt")
        assert w.chunk_bytes == chunk  # not the tuning's 2 MiB
