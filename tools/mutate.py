#!/usr/bin/env python3
"""Mutation check (issue 13): apply each deliberate bug to a scratch copy of the repo,
rebuild, run the tests that should catch it, and print the table. Every row must be
caught. Not run in CI: it rebuilds the extension many times.

    python tools/mutate.py                      # every row
    python tools/mutate.py --skip-strict-cuda   # without the rows that need the strict stand-in
    python tools/mutate.py --rows 1,4 --keep    # some rows, keep the scratch tree

How: the working tree (tracked files and untracked, not ignored ones) is copied to
--work/src; the extension is built once with CMake + Ninja in --work/build, which is
reused, so a C++ mutation recompiles only the file it touches (and, on the next
build, the file it restores). Tests run with the interpreter running this script,
through a throwaway venv that sees its site-packages (torch, pytest, hypothesis) but
not an editable flashwrite install, with PYTHONPATH=--work/src/python.

Exit status: 0 when every row that ran was caught and the unmutated baseline passed.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import time
from dataclasses import dataclass, field

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@dataclass
class Mutation:
    name: str
    edits: list[tuple[str, str, str]]  # (file, exact old text, new text); old must occur once
    tests: list[str]                   # pytest arguments
    note: str = ""
    strict_cuda: bool = False          # relies on the strict stand-in CUDA runtime (native branch)
    native: bool = field(init=False)

    def __post_init__(self):
        self.native = any(f.startswith("csrc/") for f, _, _ in self.edits)


STRICT = "relies on the strict stand-in CUDA runtime (tests/fake_cudart.cpp)"

MUTATIONS = [
    Mutation("no fsync of the parent directory after the publishing rename",
             [("python/flashwrite/saving/commit.py", "    target.rename(tmp, final)\n    target.fsync_dir(parent)\n",
               "    target.rename(tmp, final)\n")],
             ["tests/saving/test_durability_order.py"]),
    Mutation("no fsync of the stripes",
             [("csrc/io/local_files.cpp", "    fsync_fd(fd, path);\n", "")],
             ["tests/saving/test_durability_order.py"]),
    Mutation("commit once staged, before the writes are durable",
             [("python/flashwrite/saving/write.py", "        job.wait()\n        job.rethrow()\n        native = job.stats()",
               "        job.wait_staged(None)\n        job.rethrow()\n        native = job.stats()"),
              ("python/flashwrite/saving/session.py", "        sw.job.wait()\n        gate()",
               "        sw.job.wait_staged(None)\n        gate()")],
             ["tests/saving/test_durability_order.py"]),
    Mutation("a short write treated as complete (both backends)",
             [("csrc/io/thread_backend.cpp", "      r->done += static_cast<uint64_t>(n);",
               "      r->done = r->write ? r->len : r->done + static_cast<uint64_t>(n);"),
              ("csrc/io/uring_backend.cpp", "      r->done += static_cast<uint64_t>(res);",
               "      r->done = r->write ? r->len : r->done + static_cast<uint64_t>(res);")],
             ["tests/saving/test_io_shims.py", "-k", "short"],
             note="caught through the threads backend; no shim reaches io_uring"),
    Mutation("a 1-D strided view written without a contiguous copy",
             [("python/flashwrite/state/flatten.py", "    if t.is_contiguous():\n        return t\n    with warnings",
               "    if True:\n        return t\n    with warnings")],
             ["tests/state/test_strided_views.py"]),
    Mutation("last chunk dropped when size % chunk == 1",
             [("csrc/write/chunk_plan.cpp", "  const uint64_t nchunks = (size + chunk_bytes - 1) / chunk_bytes;",
               "  const uint64_t nchunks = size / chunk_bytes + (size % chunk_bytes > 1);")],
             ["tests/saving/test_io_shims.py", "-k", "last_chunk"]),
    Mutation("open-time O_DIRECT EINVAL fallback removed",
             [("csrc/io/files.cpp", "    if (errno != EINVAL) throw_errno(errno, op, path);",
               "    throw_errno(errno, op, path);")],
             ["tests/saving/test_io_shims.py", "-k", "odirect"]),
    Mutation("D2H and H2D copy kinds swapped",
             [("csrc/stage/device_copy.cpp",
               "kind_(dir == CopyDirection::DeviceToHost ? cudaMemcpyDeviceToHost : cudaMemcpyHostToDevice)",
               "kind_(dir == CopyDirection::DeviceToHost ? cudaMemcpyHostToDevice : cudaMemcpyDeviceToHost)")],
             ["tests/system/test_cuda.py"], note=STRICT, strict_cuda=True),
    Mutation("load bounce pool never pinned",
             [("csrc/engine/engine.cpp", "  p->set_pin_hooks(cuda_pin_hooks(device));\n", "")],
             ["tests/system/test_cuda.py"], note=STRICT, strict_cuda=True),
    Mutation("host memcpy straight from a device pointer",
             [("csrc/write/save_staging.cpp", "          if (sg.device < 0)  // a header or a CPU tensor sharing the chunk",
               "          if (true)  // a header or a CPU tensor sharing the chunk")],
             ["tests/system/test_cuda.py"], note=STRICT, strict_cuda=True),
    Mutation("manifest checksum not verified on load",
             [("python/flashwrite/format/validate.py", "    if sealed:\n        check_manifest_seal(raw)",
               "    if False:\n        check_manifest_seal(raw)")],
             ["tests/format/test_manifest_integrity.py"]),
    Mutation("stripe header not cross-checked against the manifest",
             [("python/flashwrite/loading/read_plan.py",
               "        check_stripe_header(header[: fe.header_bytes], fe, by_file[fi])\n",
               "        (lambda *a: None)(header[: fe.header_bytes], fe, by_file[fi])\n")],
             ["tests/format/test_manifest_integrity.py"]),
    # Issue 28, section 3: bugs that survived the suite before its tests were added.
    Mutation("a neighbour's copy restored without checking its checksums",
             [("python/flashwrite/tier/restore.py",
               "                    res = self._read_local(s, snap, options, on_storage=s in committed)",
               "                    res = self._read_local(s, snap, {**options, \"verify\": False}, "
               "on_storage=s in committed)")],
             ["tests/tier/test_local.py", "--slow", "-k", "fails_its_checksums"]),
    Mutation("the packed table inflated without a size bound (the exact-size check kept)",
             [("python/flashwrite/format/encoding.py", "js = d.decompress(z, n + 1)", "js = d.decompress(z)")],
             ["tests/format/test_manifest_integrity.py", "-k", "bomb"]),
    Mutation("diff without --deep calls two saves identical when only bytes differ",
             [("python/flashwrite/ops/diff.py", "or out[\"changed_meta\"] or out[\"changed_content\"]",
               "or out[\"changed_meta\"] or (deep and out[\"changed_content\"])")],
             ["tests/ops/test_ops_diff.py"]),
    Mutation("the cyclic GC left disabled after a save or load that raised",
             [("python/flashwrite/system/gcpause.py", "    try:\n        yield\n    finally:\n",
               "    yield\n    if True:\n")],
             ["tests/tier/test_gc_restored.py"]),
    Mutation("the committing rank ignores another rank's failure vote",
             [("python/flashwrite/saving/distributed.py",
               "                collective(dist.all_reduce, status, group=group)\n",
               "                collective(dist.all_reduce, status, group=group)\n"
               "                if self.coord.rank == 0:\n                    status[0] = int(failed)\n")],
             ["tests/saving/test_distributed.py", "-k", "failure_vote"]),
    # issue 33: nfs/overwrite/slots (net-nfs)
    Mutation("nfs:// save: a COMMIT's write verifier not compared with the chunk's WRITEs",
             [("csrc/io/nfs_job_replies.cpp",
               "} else if (!q->mixed && q->have_verf && std::memcmp(q->verf, verf, NFS3_WRITEVERFSIZE) == 0) {",
               "} else if (true) {")],
             ["tests/targets/test_nfs.py", "-k", "verifier"]),
    Mutation("nfs:// save: a chunk whose WRITEs came back under different verifiers taken as committed",
             [("csrc/io/nfs_job_replies.cpp", "} else if (!q->mixed && q->have_verf && std::memcmp(",
               "} else if (q->have_verf && std::memcmp(")],
             ["tests/targets/test_nfs.py", "-k", "mixed_verifiers"]),
    Mutation("nested exports: the first listed export containing the path taken, not the longest",
             [("python/flashwrite/targets/nfs.py", "and len(e) > len(best):", "and not best:")],
             ["tests/targets/test_nfs.py", "-k", "longest_listed"]),
    Mutation("nested exports: the first listed export taken (the resolution function alone)",
             [("python/flashwrite/targets/nfs.py", "and len(e) > len(best):", "and not best:")],
             ["tests/targets/test_urls.py", "-k", "export_resolution"]),
    Mutation("export resolution: a name that only starts like an export taken for inside it",
             [("python/flashwrite/targets/nfs.py", "if (path == e or path.startswith(e.rstrip(\"/\") + \"/\")) and len(e)",
               "if path.startswith(e) and len(e)")],
             ["tests/targets/test_urls.py", "-k", "export_resolution"]),
    Mutation("overwrite (RENAME_EXCHANGE): the old checkpoint removed before the parent's fsync",
             [("python/flashwrite/saving/commit.py",
               "            target.fsync_dir(parent)\n            target.remove_tree(tmp)\n",
               "            target.remove_tree(tmp)\n            target.fsync_dir(parent)\n")],
             ["tests/saving/test_durability_order.py", "-k", "replaced"]),
    Mutation("overwrite (moved aside): the old checkpoint removed before the parent's fsync",
             [("python/flashwrite/saving/commit.py",
               "        target.fsync_dir(parent)\n        target.remove_tree(old)\n",
               "        target.remove_tree(old)\n        target.fsync_dir(parent)\n")],
             ["tests/saving/test_durability_order.py", "-k", "replaced"]),
    Mutation("a deferred-checksum chunk's slot given back when its write ends, before its checksum",
             [("csrc/write/save_job.cpp",
               "  if (slot_refs_[r->tag].load())\n    slot_done(r->tag);  // the checksum may still be reading it",
               "  if (false)\n    slot_done(r->tag);  // the checksum may still be reading it")],
             ["tests/saving/test_engine.py", "-k", "deferred_checksum"]),
    # issue 33: watch/compare/incremental (net-incr)
    Mutation("write watch: the scan stops after its first PAGEMAP_SCAN batch (512 written runs)",
             [("csrc/core/write_watch.cpp", "      at = a.walk_end;", "      at = span.hi;")],
             ["tests/incremental/test_write_watch.py", "-k", "512th or 600_written"]),
    Mutation("write watch: a write to a shared first or last page trusted without comparing the piece's bytes",
             [("python/flashwrite/incremental/write_watch.py", "(f & (HEAD | TAIL) and _edges(r) != rec[1])", "False")],
             ["tests/incremental/test_write_watch.py", "-k", "shared_edge"]),
    Mutation("compare: pass 2 skipped (each tensor's smallest piece only)",
             [("python/flashwrite/incremental/compare.py", "                group = [pk for fi in cands",
               "                group = [] and [pk for fi in cands")],
             ["tests/incremental/test_incremental_pieces.py", "-k", "middle_or_last"]),
    Mutation("compare: a tensor's last piece left out of pass 2",
             [("python/flashwrite/incremental/compare.py", "for i, p in enumerate(unknown) if i != k)",
               "for i, p in enumerate(unknown) if i != k and i < len(unknown) - 1)")],
             ["tests/incremental/test_incremental_pieces.py", "-k", "middle_or_last"]),
    Mutation("compare: a tensor now of another dtype with the same bytes taken as unchanged",
             [("python/flashwrite/incremental/compare.py", "or dtypes.dtype_name(columns.dtypes[j]) != te.dtype", "or False")],
             ["tests/incremental/test_incremental_pieces.py", "-k", "another_dtype"]),
    Mutation("base settings: a base with another checksum block (chunk_bytes) linked from",
             [("python/flashwrite/incremental/link.py", "    if m.block_bytes != block:", "    if False:")],
             ["tests/incremental/test_incremental_pieces.py", "-k", "checksum_block"]),
    Mutation("retry after a failed save: the compare records the base's checksum, not the one it hashed",
             [("python/flashwrite/incremental/compare.py", "watch.record((a, n), bad.get(i, e))", "watch.record((a, n), e)")],
             ["tests/incremental/test_incremental_pieces.py", "-k", "retry"], note="needs root (a tmpfs)"),
    Mutation("held files: the native job links a held file without comparing its checksums",
             [("csrc/write/save_held.cpp", " || it->checksum != hashes_[p.hash_index])", ")")],
             ["tests/incremental/test_incremental_pieces.py", "-k", "held"]),
    Mutation("held files: only the first chunk of a held file compared",
             [("csrc/write/save_held.cpp", "      ++seen;\n    }\n  }\n", "      ++seen;\n    }\n    break;\n  }\n"),
              ("csrc/write/save_held.cpp", "  return seen == h.expected.size();", "  return seen > 0;")],
             ["tests/incremental/test_incremental_pieces.py", "-k", "held"]),
    Mutation("incremental planning: every candidate stripe linked, changed or not",
             [("python/flashwrite/incremental/link.py", "where, unchanged_files, tmp, prefix, target)",
               "where, cands, tmp, prefix, target)")],
             ["tests/incremental/test_incremental_pieces.py", "-k", "middle_or_last and compared"]),
    Mutation("incremental planning: stripes marked hot never compared again",
             [("python/flashwrite/incremental/link.py", "recheck=seq % RECHECK_HOT_EVERY == 0", "recheck=False")],
             ["tests/incremental/test_incremental.py", "-k", "stops_changing"]),
    Mutation("load(into=): a destination of a same-size dtype filled in place with the stored bits",
             [("python/flashwrite/loading/read.py", "if (not e.nbytes or d.dtype != stored_dtype(e.dtype) or",
               "if (not e.nbytes or d.element_size() != stored_dtype(e.dtype).itemsize or")],
             ["tests/loading/test_load_into_and_first_save.py", "-k", "same_size"]),
    Mutation("load(into=): the copy of a same-size dtype takes the stored bits",
             [("python/flashwrite/loading/read.py", "            d.copy_(s)",
               "            d.copy_(s.view(d.dtype) if s.element_size() == d.element_size() else s)")],
             ["tests/loading/test_load_into_and_first_save.py", "-k", "same_size"]),
    Mutation("periodic re-hash: never due (the watch vouches for ever)",
             [("python/flashwrite/incremental/write_watch.py", "if rec is None or rec[2] + 1 >= self._every:", "if rec is None:")],
             ["tests/incremental/test_write_watch.py", "-k", "rehash or hashed_again"]),
    Mutation("periodic re-hash: a record's count of passes that trusted it never grows",
             [("python/flashwrite/incremental/write_watch.py", "self._watch.records[rng] = (rec[0], rec[1], rec[2] + 1)",
               "self._watch.records[rng] = rec")],
             ["tests/incremental/test_write_watch.py", "-k", "rehash or hashed_again"]),
    Mutation("periodic re-hash: a write the watch missed found but not reported",
             [("python/flashwrite/incremental/write_watch.py", "        return vouched != checksum", "        return False")],
             ["tests/incremental/test_write_watch.py", "-k", "rehash or hashed_again"]),
    Mutation("a dead save's temp dir judged by the boot-time grace turned the other way (issue 44 item 2)",
             [("python/flashwrite/saving/commit.py", "started_by=mtime + 2.0)", "started_by=mtime - 2.0)")],
             ["tests/saving/test_live_temp_kept.py"]),
    Mutation("compress='auto': a compressed save's rate remembered as the link's (issue 44 item 7)",
             [("python/flashwrite/saving/compress.py",
               "        if not compressed:  # a compressed save's seconds include compressing: not the link's\n",
               "        if True:\n")],
             ["tests/codec/test_compressed_saves.py", "-k", "auto"]),
    Mutation("load_async resolves a relative path on the load's thread (issue 44 item 8)",
             [("python/flashwrite/loading/load.py", "    path = shown(path)  # a relative", "    pass  # a relative")],
             ["tests/saving/test_future_family.py", "-k", "relative"]),
    Mutation("a deferred-checksum chunk's slot released by both its write and its checksum: listed twice in the "
             "pool's free list, two chunks then staged into one slot (issue 44 item 8a)",
             [("csrc/write/save_job.cpp", "  if (slot_refs_[ci].fetch_sub(1) == 1) return_slot(slot_of(ci), true);",
               "  slot_refs_[ci].fetch_sub(1);\n  return_slot(slot_of(ci), true);")],
             ["tests/saving/test_pool_slots.py"], note="no CUDA: the pool's slot check (StagingPool::check) fails the save"),
    Mutation("an interrupted load(into=) raises before its copies into the destinations are over (issue 44 item 8b)",
             [("csrc/python/load_bindings.cpp", "               l.job->cancel();\n               l.job->wait_quiet(-1);\n",
               "               l.job->cancel();\n")],
             ["tests/saving/test_interrupts.py", "-k", "stops_writing"],
             note="FLASHWRITE_TEST_LOAD_PLACE_DELAY_MS keeps copies under way at every Ctrl-C"),
]


def sh(cmd, **kw) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True, **kw)


def copy_tree(src: str, dst: str) -> None:
    """Tracked files and untracked ones git does not ignore, as they are in the working tree."""
    out = sh(["git", "-C", src, "ls-files", "-z", "--cached", "--others", "--exclude-standard"], check=True).stdout
    for rel in filter(None, out.split("\0")):
        s = os.path.join(src, rel)
        if not os.path.isfile(s):
            continue  # deleted in the working tree, or a submodule
        d = os.path.join(dst, rel)
        os.makedirs(os.path.dirname(d), exist_ok=True)
        shutil.copy2(s, d)


def project_version(src: str) -> str:
    m = re.search(r'^version\s*=\s*"([^"]+)"', open(os.path.join(src, "pyproject.toml")).read(), re.M)
    return m.group(1) if m else "0"


def configure(src: str, build: str) -> None:
    if os.path.exists(os.path.join(build, "build.ninja")):
        return
    pybind11_dir = sh([sys.executable, "-m", "pybind11", "--cmakedir"], check=True).stdout.strip()
    r = sh(["cmake", "-S", src, "-B", build, "-G", "Ninja", "-DCMAKE_BUILD_TYPE=Release",
            f"-DPython_EXECUTABLE={sys.executable}", f"-Dpybind11_DIR={pybind11_dir}",
            f"-DSKBUILD_PROJECT_VERSION={project_version(src)}"])
    if r.returncode:
        sys.exit(f"cmake configure failed:\n{r.stdout}\n{r.stderr}")


def build_ext(src: str, build: str) -> float:
    t0 = time.perf_counter()
    r = sh(["cmake", "--build", build, "--target", "_core", "-j", str(max(1, min(2, os.cpu_count() or 1)))])
    if r.returncode:
        raise RuntimeError(f"build failed:\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}")
    so = next(f for f in os.listdir(build) if f.startswith("_core") and f.endswith(".so"))
    link = os.path.join(src, "python", "flashwrite", so)
    if not os.path.islink(link):
        if os.path.lexists(link):
            os.unlink(link)
        os.symlink(os.path.join(build, so), link)
    return time.perf_counter() - t0


def make_venv(work: str) -> str:
    """A venv without pip whose only extra path is this interpreter's site-packages (a plain
    path line in a .pth: that directory's own .pth files, such as an editable flashwrite's
    import hook, are not run)."""
    venv = os.path.join(work, "venv")
    py = os.path.join(venv, "bin", "python")
    if not os.path.exists(py):
        sh([sys.executable, "-m", "venv", "--without-pip", venv], check=True)
    site = sh([py, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], check=True).stdout.strip()
    paths = {sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]}
    with open(os.path.join(site, "mutate-deps.pth"), "w") as fh:
        fh.write("\n".join(sorted(paths)) + "\n")
    return py


def run_tests(py: str, src: str, args: list[str], timeout: float) -> tuple[str, str, float]:
    env = dict(os.environ, PYTHONPATH=os.path.join(src, "python"), PYTHONDONTWRITEBYTECODE="1")
    env.pop("FLASHWRITE_REQUIRE_ROOT_TESTS", None)
    t0 = time.perf_counter()
    try:
        r = subprocess.run([py, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", *args], cwd=src, env=env,
                           capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return "timeout", "", time.perf_counter() - t0
    dt = time.perf_counter() - t0
    lines = (r.stdout + r.stderr).strip().splitlines()
    tail = lines[-1] if lines else ""
    if r.returncode == 0:
        return "passed", tail, dt
    if r.returncode == 1 or r.returncode < 0:  # failures, or the run crashed (a signal): loud either way
        first = next((ln.split(" - ")[0].removeprefix("FAILED ") for ln in lines if ln.startswith("FAILED ")),
                     f"crashed (signal {-r.returncode})" if r.returncode < 0 else tail)
        return "failed", first, dt
    return f"error (pytest exit {r.returncode})", (r.stdout + r.stderr)[-2000:], dt


def apply(src: str, m: Mutation, pristine: dict[str, str]) -> str | None:
    texts: dict[str, str] = {}
    for f, old, new in m.edits:
        text = texts.get(f, pristine[f])
        if text.count(old) != 1:
            return f"mutation does not apply: {f} has the text {text.count(old)} times"
        texts[f] = text.replace(old, new)
    for f, text in texts.items():
        with open(os.path.join(src, f), "w") as fh:
            fh.write(text)
    return None


def restore(src: str, m: Mutation, pristine: dict[str, str]) -> None:
    for f, _, _ in m.edits:
        with open(os.path.join(src, f), "w") as fh:  # a new mtime: the next build recompiles it
            fh.write(pristine[f])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--work", default="/tmp/flashwrite-mutate", help="scratch directory (reused: keeps the build)")
    ap.add_argument("--rows", help="comma-separated row numbers (1-based) to run")
    ap.add_argument("--skip-strict-cuda", action="store_true",
                    help="skip the rows that rely on the strict stand-in CUDA runtime")
    ap.add_argument("--timeout", type=float, default=1200, help="seconds per pytest run")
    ap.add_argument("--keep", action="store_true", help="keep the scratch source copy afterwards")
    opts = ap.parse_args()

    rows = list(enumerate(MUTATIONS, 1))
    if opts.rows:
        wanted = {int(x) for x in opts.rows.split(",")}
        rows = [(i, m) for i, m in rows if i in wanted]
    src, build = os.path.join(opts.work, "src"), os.path.join(opts.work, "build")
    shutil.rmtree(src, ignore_errors=True)
    os.makedirs(opts.work, exist_ok=True)
    copy_tree(ROOT, src)
    dirty = os.path.join(opts.work, "mutated-files")
    if os.path.exists(dirty):  # an interrupted run may have left mutated objects in the build
        for f in open(dirty).read().split():
            if os.path.exists(os.path.join(src, f)):
                os.utime(os.path.join(src, f))
        os.unlink(dirty)
    pristine = {f: open(os.path.join(src, f)).read() for _, m in rows for f, _, _ in m.edits}
    configure(src, build)
    print(f"baseline build: {build_ext(src, build):.0f} s", flush=True)
    py = make_venv(opts.work)
    where = sh([py, "-c", "import flashwrite; print(flashwrite.__file__)"],
               env=dict(os.environ, PYTHONPATH=os.path.join(src, "python"))).stdout.strip()
    if not where.startswith(src):
        sys.exit(f"the scratch interpreter imports flashwrite from {where!r}, not from {src}")

    # The tests must pass on the unmutated copy, or "caught" means nothing.
    suites = sorted({tuple(m.tests) for i, m in rows if not (m.strict_cuda and opts.skip_strict_cuda)})
    baseline_ok = True
    for args in suites:
        outcome, tail, dt = run_tests(py, src, list(args), opts.timeout)
        print(f"baseline {' '.join(args)}: {outcome} ({dt:.0f} s) {tail}", flush=True)
        baseline_ok &= outcome == "passed"

    table = []
    for i, m in rows:
        if m.strict_cuda and opts.skip_strict_cuda:
            table.append((i, m, "not run", "", 0.0))
            continue
        problem = apply(src, m, pristine)
        if problem:
            table.append((i, m, "NOT APPLIED", problem, 0.0))
            continue
        with open(dirty, "a") as fh:
            fh.write("".join(f + "\n" for f, _, _ in m.edits))
        try:
            if m.native:
                build_ext(src, build)
            outcome, tail, dt = run_tests(py, src, m.tests, opts.timeout)
        except RuntimeError as e:
            outcome, tail, dt = "build failed", str(e)[-300:], 0.0
        finally:
            restore(src, m, pristine)
        caught = {"failed": "yes", "passed": "NO"}.get(outcome, f"? ({outcome})")
        table.append((i, m, caught, tail, dt))
        print(f"[{i}] {m.name}: caught {caught} ({dt:.0f} s) {tail}", flush=True)
    if any(m.native for _, m in rows):
        build_ext(src, build)  # leave the build matching the pristine sources
    if os.path.exists(dirty):
        os.unlink(dirty)

    print()
    print("| # | deliberate bug | tests run | caught? | note |")
    print("|---|---|---|---|---|")
    for i, m, caught, tail, dt in table:
        note = "; ".join(filter(None, [m.note, f"first failure: {tail}" if caught == "yes" else tail]))
        print(f"| {i} | {m.name} | `{' '.join(m.tests)}` | {caught} | {note} |")
    print(f"\nbaseline (unmutated) tests: {'passed' if baseline_ok else 'FAILED'}")
    if not opts.keep:
        shutil.rmtree(src, ignore_errors=True)
    ran = [c for _, _, c, _, _ in table if c != "not run"]
    return 0 if baseline_ok and all(c == "yes" for c in ran) else 1


if __name__ == "__main__":
    sys.exit(main())
