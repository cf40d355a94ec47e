"""The reference lines a save is measured against, in the same run (``flashwrite tune``,
``flashwrite demo``, and the harness in the repository's ``benchmarks/``):

- the device limit: a sequential O_DIRECT write (then fsync) and read of the same
  number of bytes, with fio when installed (io_uring, 8 MiB blocks, depth 16; the
  best of one file and of four files in parallel), else with an in-tree probe
  (pwrite/pread threads on an O_DIRECT file);
- a multi-threaded memcpy of the state into a warm buffer: the floor for a
  snapshot of CPU state, and the yardstick of the stall target (≤ 1.5×).
"""

from __future__ import annotations

import json
import mmap
import os
import shutil
import subprocess
import threading
import time

import torch

BLOCK = 8 << 20
DEPTH = 16


def drop_caches() -> str | None:
    """Write back and drop the page cache. None when done, else why not."""
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return None
    except OSError as e:
        return f"cannot drop the page cache ({e.strerror}); loads may be served from memory"


def _fsync_path(path: str) -> float:
    t0 = time.perf_counter()
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    return time.perf_counter() - t0


def _fio(args: list[str]) -> dict:
    out = subprocess.run(["fio", "--output-format=json", *args], check=True, capture_output=True, text=True).stdout
    # fio may print notes before the JSON document.
    return json.loads(out[out.index("{"):])["jobs"][0]


def fio_write_read(directory: str, nbytes: int, block: int = BLOCK, depth: int = DEPTH,
                   files: tuple[int, ...] = (1, 4)) -> dict:
    """Seconds to write nbytes with O_DIRECT and make them durable, then to read them
    back (cold): the best of one file and of several files written in parallel
    (flashwrite stripes, so its device limit must allow for parallel streams)."""
    best: dict = {}
    for n in files:
        per_job = -(-nbytes // (n * block)) * block  # whole blocks: fio writes no partial block
        pattern = os.path.join(directory, "fio-device-limit.$jobnum")
        paths = [os.path.join(directory, f"fio-device-limit.{i}") for i in range(n)]
        common = [f"--filename_format={pattern}", f"--bs={block}", f"--iodepth={depth}", "--ioengine=io_uring",
                  "--direct=1", f"--size={per_job}", f"--numjobs={n}", "--group_reporting", "--fallocate=none"]
        try:
            drop_caches()
            w = _fio(["--name=write", "--rw=write", *common])
            # fio's clock covers the I/O (the slowest job, with group_reporting); the
            # fsync that makes the new extents durable is timed apart. Scaled to nbytes.
            t0 = time.perf_counter()
            for p in paths:
                _fsync_path(p)
            write_s = (w["write"]["runtime"] / 1e3 + time.perf_counter() - t0) * nbytes / w["write"]["io_bytes"]
            drop_caches()
            r = _fio(["--name=read", "--rw=read", *common])
            read_s = r["read"]["runtime"] / 1e3 * nbytes / r["read"]["io_bytes"]
        finally:
            for p in paths:
                if os.path.exists(p):
                    os.unlink(p)
        best.setdefault("configs", []).append({"files": n, "write_s": write_s, "read_s": read_s})
        if write_s < best.get("write_s", float("inf")):
            best.update(write_s=write_s, write_files=n)
        if read_s < best.get("read_s", float("inf")):
            best.update(read_s=read_s, read_files=n)
    best["tool"] = (f"fio {_fio_version()}, io_uring, O_DIRECT, {block >> 20} MiB blocks, depth {depth} per file, "
                    f"best of {' and '.join(str(n) for n in files)} file(s) in parallel (write: "
                    f"{best['write_files']}, read: {best['read_files']})")
    return best


def _fio_version() -> str:
    try:
        return subprocess.run(["fio", "--version"], capture_output=True, text=True).stdout.strip().removeprefix("fio-")
    except OSError:
        return "?"


def probe_write_read(directory: str, nbytes: int, block: int = BLOCK, depth: int = DEPTH) -> dict:
    """The fallback without fio: `depth` threads pwrite/pread 4 KiB-aligned blocks
    of one O_DIRECT file (os.pwrite releases the GIL), then fsync."""
    path = os.path.join(directory, "probe-device-limit.dat")
    nbytes = (nbytes + 4095) // 4096 * 4096
    nblocks = (nbytes + block - 1) // block
    bufs = [mmap.mmap(-1, block) for _ in range(depth)]  # page-aligned, as O_DIRECT wants
    for b in bufs:
        b.write(os.urandom(4096) * (block // 4096))
    direct = getattr(os, "O_DIRECT", 0)

    def run(fd: int, write: bool) -> None:
        next_block = [0]
        lock = threading.Lock()
        errors: list[BaseException] = []

        def worker(buf: mmap.mmap) -> None:
            try:
                while True:
                    with lock:
                        i = next_block[0]
                        next_block[0] += 1
                    if i >= nblocks:
                        return
                    n = min(block, nbytes - i * block)
                    view = memoryview(buf)[:n]
                    done = 0
                    while done < n:
                        k = (os.pwrite(fd, view[done:], i * block + done) if write
                             else os.preadv(fd, [view[done:]], i * block + done))
                        if k <= 0:
                            raise OSError(f"short {'write' if write else 'read'} at {i * block + done}")
                        done += k
            except BaseException as e:  # noqa: BLE001 - re-raised by the caller
                errors.append(e)

        threads = [threading.Thread(target=worker, args=(b,)) for b in bufs]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if errors:
            raise errors[0]

    try:
        drop_caches()
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | direct, 0o644)
        t0 = time.perf_counter()
        try:
            run(fd, True)
            os.fsync(fd)
        finally:
            os.close(fd)
        write_s = time.perf_counter() - t0
        drop_caches()
        fd = os.open(path, os.O_RDONLY | direct)
        t0 = time.perf_counter()
        try:
            run(fd, False)
        finally:
            os.close(fd)
        read_s = time.perf_counter() - t0
    finally:
        for b in bufs:
            b.close()
        if os.path.exists(path):
            os.unlink(path)
    kind = "O_DIRECT" if direct else "buffered"
    return {"tool": f"in-tree probe (fio not found), pwrite/pread threads, {kind}, {block >> 20} MiB blocks, "
                    f"depth {depth}", "write_s": write_s, "read_s": read_s}


def check_space(directory: str, nbytes: int) -> None:
    """Refuse to start writing what the file system cannot hold (with 10% + 1 GiB to spare
    for everyone else on a shared disk)."""
    st = os.statvfs(directory)
    free = st.f_bavail * st.f_frsize
    if nbytes * 1.1 + (1 << 30) > free:
        raise OSError(28, f"not enough free space in {directory} for {nbytes} bytes of benchmark data "
                          f"({free} bytes free)")


def device_limit(directory: str, nbytes: int, tool: str = "auto") -> dict:
    """{"tool", "write_s", "read_s"} for nbytes in directory. tool: auto, fio or probe."""
    check_space(directory, nbytes)
    if tool == "fio" or (tool == "auto" and shutil.which("fio")):
        try:
            return fio_write_read(directory, nbytes)
        except (subprocess.CalledProcessError, ValueError, KeyError) as e:
            if tool == "fio":
                raise
            res = probe_write_read(directory, nbytes)
            res["note"] = f"fio failed ({e}); used the in-tree probe"
            return res
    return probe_write_read(directory, nbytes)


def memcpy_seconds(tensors: list[torch.Tensor], threads: int | None = None, repeats: int = 3) -> dict:
    """Best-of-`repeats` seconds to copy every tensor into one warm (already faulted)
    buffer with `threads` threads: what a snapshot of CPU state cannot beat."""
    threads = threads or len(os.sched_getaffinity(0))  # the CPUs this process may use (never 0)
    total = sum(t.numel() * t.element_size() for t in tensors)
    dst = torch.empty(total, dtype=torch.uint8)
    dst.fill_(1)  # fault the pages in: a reused staging pool is warm
    srcs = [t.detach().reshape(-1).view(torch.uint8) for t in tensors if t.numel()]
    # Split the bytes, not the tensors, evenly over the threads; torch's copy_
    # releases the GIL, so plain Python threads copy in parallel.
    offsets, off = [], 0
    for s in srcs:
        offsets.append(off)
        off += s.numel()
    share = (total + threads - 1) // threads
    plans: list[list[tuple[torch.Tensor, int]]] = [[] for _ in range(threads)]
    for s, o in zip(srcs, offsets):
        pos = 0
        while pos < s.numel():
            k = min((o + pos) // share, threads - 1)
            end = min(s.numel(), (k + 1) * share - o) if k < threads - 1 else s.numel()
            plans[k].append((s[pos:end], o + pos))
            pos = end
    prev = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        best = float("inf")
        for _ in range(repeats):
            def work(plan):
                for piece, at in plan:
                    dst[at:at + piece.numel()].copy_(piece)
            ts = [threading.Thread(target=work, args=(p,)) for p in plans]
            t0 = time.perf_counter()
            for t in ts:
                t.start()
            for t in ts:
                t.join()
            best = min(best, time.perf_counter() - t0)
    finally:
        torch.set_num_threads(prev)
    return {"seconds": best, "threads": threads, "bytes": total}
