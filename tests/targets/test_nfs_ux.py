"""nfs:// as a newcomer meets it (issue 34, item 7), against the real nfs-ganesha of
tests/nfs_server.py: URLs with the ports tools/nfs_server.py prints, a second server
sharing the host's portmapper, and what ``ls`` and ``convert`` do with such URLs."""

from __future__ import annotations

import os

import pytest
import torch

import flashwrite as fw
from conftest import assert_same
from nfs_fixtures import serving
from ops_helpers import run, save, state

pytestmark = [pytest.mark.nfs, pytest.mark.usefixtures("nfs_staging")]


def test_ls_shows_urls_that_keep_the_mount_port(capsys, nfs_server):
    fw.save(state(), nfs_server.url_ports("ck"), stripes=1)
    rc, out, _ = run(capsys, "ls", nfs_server.url_ports())
    assert rc == 0, out
    shown = out.split()[-1]
    assert shown.startswith("nfs://") and f"mountport={nfs_server.mount_port}" in shown, out
    assert_same(fw.load(shown), state())  # what ls shows reaches the same server again


def test_overwrite_through_ports_of_a_checkpoint_that_exists(nfs_server):
    """With mountport= the export was the longest prefix the server mounts: the existing
    checkpoint itself, whose root an overwrite cannot rename (NFS3ERR_INVAL)."""
    fw.save({"w": torch.zeros(4)}, os.path.join(nfs_server.export, "ck"))  # there before any URL names it
    fw.save({"w": torch.ones(4)}, nfs_server.url_ports("ck"), overwrite=True)
    assert torch.equal(fw.load(os.path.join(nfs_server.export, "ck"))["w"], torch.ones(4))


def test_convert_refuses_foreign_formats_to_urls_with_ports(capsys, nfs_server, tmp_path):
    torch.save(state(), tmp_path / "t.pt")
    for src in (save(str(tmp_path / "l")), str(tmp_path / "t.pt")):
        for name in ("x.safetensors", "x.pt"):
            rc, _, err = run(capsys, "convert", src, nfs_server.url_ports(name), "-q")
            assert rc == 2 and "nfs://" in err and "local" in err, (src, name, err)
    assert os.listdir(nfs_server.export) == []  # no flashwrite directory named x.safetensors


def test_a_second_server_on_the_portmapper_is_told_apart_by_its_ports(capsys, nfs_server, tmp_path):
    with serving(str(tmp_path / "second")) as other:  # registered last: the portmapper now names it
        url = nfs_server.url("ck")
        with pytest.raises(FileNotFoundError) as ei:
            fw.save(state(), url)
        msg = str(ei.value)
        assert nfs_server.export in msg and other.export in msg and "mountport=" in msg, msg
        rc, _, err = run(capsys, "ls", nfs_server.url())
        assert rc == 2 and "mountport=" in err and "Traceback" not in err, err
        fw.save(state(), nfs_server.url_ports("ck"))  # its ports: this server, whatever the portmapper says
        fw.save(state(), other.url("ck"))  # the registered one, without ports
        assert os.listdir(nfs_server.export) == ["ck"] and os.listdir(other.export) == ["ck"]
        assert_same(fw.load(nfs_server.url_ports("ck")), state())


def test_backend_info_of_an_nfs_url_gives_the_targets_facts(nfs_server):
    """Issue 44 item 5: ``fw.backend_info("nfs://...")`` probed the URL as a local directory
    and failed with FileNotFoundError (create probe file). It now reaches the server and
    says where the path is and how saves and loads there go; the machine's facts stay."""
    url = nfs_server.url_ports("run/ck") + "&depth=8"
    info = fw.backend_info(url)
    t = info["target"]
    assert t["server"] == "127.0.0.1" and t["export"] == nfs_server.export and t["path"] == "/run/ck", t
    assert t["exists"] is False and t["depth"] == 8 and t["connections"] >= 1, t
    assert (t["nfs_port"], t["mount_port"]) == (nfs_server.nfs_port, nfs_server.mount_port), t
    assert "direct_io" not in info and "directory" not in info and info["backend"] in ("io_uring", "threads")
    fw.save(state(), url)
    assert fw.backend_info(url)["target"]["exists"] is True
    with pytest.raises(fw.UnsupportedTargetError, match="s3://"):
        fw.backend_info("s3://bucket/ck")


def test_flashwrite_info_of_an_nfs_url_prints_the_targets_facts(nfs_server):
    """``flashwrite info nfs://...`` used to refuse ("info probes a local directory"):
    it now prints what ``backend_info`` says of the URL, with the server asked."""
    import json
    import subprocess
    import sys

    url = nfs_server.url_ports("run/ck")
    r = subprocess.run([sys.executable, "-m", "flashwrite", "info", "--json", url], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stderr
    t = json.loads(r.stdout)["target"]
    assert t["export"] == nfs_server.export and t["path"] == "/run/ck" and t["exists"] is False, t
    r = subprocess.run([sys.executable, "-m", "flashwrite", "info", url], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and "target" in r.stdout and nfs_server.export in r.stdout, (r.stdout, r.stderr)
