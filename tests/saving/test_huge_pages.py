"""The staging pool and the load's bounce slots keep 2 MiB pages only where they fault in
fast (HugePageWatch): FLASHWRITE_HUGE_PAGES=auto watches, on keeps them, off never asks
for them, and a bad value is a clear error. Checked in fresh processes against what the
kernel reports in /proc/self/smaps_rollup, and by byte-exact loads through either."""

import json
import os
import re
import subprocess
import sys

import pytest
import torch

import flashwrite as fw

POOL = 64 << 20

CHILD = r"""
import json, sys
import flashwrite as fw

def anon_huge_kib():
    for line in open("/proc/self/smaps_rollup"):
        if line.startswith("AnonHugePages:"):
            return int(line.split()[1])
    return 0

before = anon_huge_kib()
w = fw.Writer()
w.reserve(int(sys.argv[1]), block=True)
print(json.dumps({"pages": w.pool_pages, "huge_kib": anon_huge_kib() - before, "pool": w.pool_bytes}))
"""


def _thp_mode():
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            return f.read().split("[")[1].split("]")[0]
    except (OSError, IndexError):
        return "never"


def _reserve_in_child(mode):
    env = {**os.environ, "FLASHWRITE_HUGE_PAGES": mode}
    out = subprocess.run([sys.executable, "-c", CHILD, str(POOL)], env=env, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_off_never_asks_for_huge_pages():
    got = _reserve_in_child("off")
    assert got["pool"] >= POOL
    assert got["pages"] == "4 KiB pages (FLASHWRITE_HUGE_PAGES=off)"
    # THP in "always" mode would give them anyway without MADV_NOHUGEPAGE.
    assert got["huge_kib"] < 4096, got


@pytest.mark.skipif(_thp_mode() == "never", reason="transparent huge pages are off on this kernel")
def test_on_keeps_huge_pages():
    got = _reserve_in_child("on")
    assert got["pages"] == "2 MiB pages (FLASHWRITE_HUGE_PAGES=on)"
    # Most of the pool is in huge pages (the kernel may fall back for a few).
    assert got["huge_kib"] >= (POOL >> 10) // 2, got


@pytest.mark.skipif(_thp_mode() == "never", reason="transparent huge pages are off on this kernel")
def test_auto_says_what_it_chose_and_the_kernel_agrees():
    got = _reserve_in_child("auto")
    pages = got["pages"]
    assert pages.startswith(("2 MiB pages: ", "4 KiB pages: ")), pages
    assert "2 MiB of 4 KiB pages" in pages and " ms" in pages, pages  # the figures it decided on
    huge_ms, small_ms = (float(x) for x in re.findall(r"([0-9.]+) ms", pages))
    if pages.startswith("2 MiB"):
        assert huge_ms <= 3 * small_ms, pages  # the rule: no step's huge pages cost over 3x
        assert got["huge_kib"] >= (POOL >> 10) // 2, got
    else:
        assert huge_ms > 3 * small_ms, pages
        # The steps faulted in before the dear one may be huge; the 4 KiB probe never is.
        assert got["huge_kib"] <= (POOL >> 10) - 4096, got


def test_bad_setting_is_a_clear_error(monkeypatch):
    monkeypatch.setenv("FLASHWRITE_HUGE_PAGES", "sometimes")
    with pytest.raises(ValueError, match="FLASHWRITE_HUGE_PAGES=sometimes: expected auto, on or off"):
        fw.Writer()


@pytest.mark.parametrize("mode", ["off", "on", "auto"])
def test_saves_and_loads_are_byte_exact_with_either_page_size(tmp_path, monkeypatch, mode):
    # The pool (save) and the bounce slots (owned load, several slots of 1 MiB chunks) use
    # the setting in this process: both are made after it is set.
    monkeypatch.setenv("FLASHWRITE_HUGE_PAGES", mode)
    g = torch.Generator().manual_seed(7)
    state = {"a": torch.randn(3, 1 << 20, generator=g), "b": torch.randint(0, 255, (5 << 20,), dtype=torch.uint8,
                                                                            generator=g), "step": 9}
    with fw.Writer() as w:
        w.save(state, tmp_path / "ck")
        assert w.pool_pages is not None
    back = fw.load(tmp_path / "ck")
    assert back["step"] == 9
    assert torch.equal(back["a"], state["a"]) and torch.equal(back["b"], state["b"])
