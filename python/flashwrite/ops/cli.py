"""The operator subcommands of ``flashwrite``: ls, inspect, diff, convert, tune.

``register`` adds them to the main parser; each ``cmd_*`` calls its module and
renders the result as a table, or as JSON with ``--json``. Exit codes: 0 ok,
1 a problem (damaged input, differences for ``diff``), 2 usage (a bad option, a path
that is not there or not what the command takes: ``common.BAD_PATH``), 3 for ``diff``
only: undetermined (nothing differs by the stored checksums, but some tensors are laid
out differently and only ``--deep`` can compare them).
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any

from ..system.sizes import fmt_bytes
from ..targets.tuning import save_tuning, store_path
from .common import OK, PROBLEM, UNDETERMINED, Problem, guarded, print_json, print_table
from .convert import convert
from .diff import diff
from .inspect import inspect, summarised_leaves
from ..format.codec import LABEL as COMPRESSED_LABEL
from .ls import list_checkpoints, list_local, to_json
from .progress import Progress
from .sources import FORMATS
from .tune import tune
from .tune_nfs import save_nfs_tuning, tune_nfs
from ..targets.locate import kind_of


def _when(t: float | None) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(t)) if t else "-"


def _progress(a: argparse.Namespace) -> Any:
    return Progress(quiet=getattr(a, "quiet", False) or getattr(a, "json", False), force_plain=getattr(a, "plain", False))


@guarded
def cmd_ls(a: argparse.Namespace) -> int:
    entries = list_checkpoints(a.root, recursive=a.recursive)
    snaps = [] if a.no_local else list_local(a.root, a.local_dir)
    if a.json:
        print_json(to_json(entries + snaps))
    elif not entries and not snaps:
        print(f"no checkpoints in {a.root}")
    else:
        def owner(e: Any) -> str:
            return "-" if e.owner_pid is None else f"{e.owner_pid} {'alive' if e.owner_alive else 'dead'}"
        def linked(e: Any) -> str:
            return fmt_bytes(e.linked_bytes) if e.linked_bytes else "-"
        print_table(["step", "tier", "status", "size", "linked", "tensors", "created", "verified", "owner", "path"],
                    [[e.step, e.tier, e.status, fmt_bytes(e.bytes), linked(e), e.tensors, _when(e.created_unix),
                      e.verified if e.tier == "storage" else "-", owner(e), e.path]
                     for e in sorted(entries + snaps, key=lambda e: (e.step is None, e.step or 0, e.tier))],
                    right=(0, 3, 4, 5))
        for e in snaps:
            if e.problem:
                print(f"  {e.path}: {e.problem}", file=sys.stderr)
        for e in entries:
            if e.problem:
                print(f"  {e.name}: {e.status}: {e.problem}", file=sys.stderr)
            elif e.compressed:
                print(f"  {e.name}: {COMPRESSED_LABEL} (flashwrite convert writes plain files)")
    return PROBLEM if any(e.status == "damaged" for e in entries) else OK


@guarded
def cmd_inspect(a: argparse.Namespace) -> int:
    r = inspect(a.ckpt, a.tensors)
    if a.json:
        print_json(r)
        return OK
    t = r["totals"]
    s = r["settings"]
    print(f"{r['path']}\n  format version {r['format_version']}, written by flashwrite {r['writer_version']} "
          f"on {_when(r['created_unix'])}\n  {t['tensors']} tensors, {fmt_bytes(t['bytes'])} of tensor data in "
          f"{s['stripes']} stripe(s) ({fmt_bytes(t['file_bytes'])} on disk), chunk {fmt_bytes(s['chunk_bytes'])}, "
          f"{r['checksum']['algorithm']} checksums" + (f", {s['world_size']} ranks" if s["world_size"] != 1 else ""))
    if r["compression"]:
        c = r["compression"]
        disk = f" ({fmt_bytes(c['disk_bytes'])} on disk)" if c.get("disk_bytes") is not None else ""
        print(f"  {c['label']}: {fmt_bytes(c['stored_bytes'])} stored{disk}, {c['ratio']:.2f}x "
              "(flashwrite convert writes plain safetensors)")
    for g in (r["replicas"] or {}).get("groups", []):
        if not isinstance(g, dict):
            continue
        local = f", rank-local: {', '.join(g.get('rank_local') or [])}" if g.get("rank_local") else ""
        print(f"  replica group of ranks {g.get('ranks')}: replicated bytes written once{local}")
        for d in (g.get("diverged") or [])[:20]:
            who = "; ".join(f"ranks {rs}: {h}" for h, rs in d.get("digests", {}).items())
            print(f"    DIVERGED {d.get('tensor')} bytes [{d['piece'][0]}, {d['piece'][1]}): {who}; committed "
                  f"{d.get('majority') or 'the most common bytes (no majority)'}")
    if t["linked_bytes"]:
        print(f"  incremental: {fmt_bytes(t['written_bytes'])} written, {fmt_bytes(t['linked_bytes'])} hard-linked "
              f"from {t['base'] or 'an earlier checkpoint'}")
    if r["metadata"]:
        print("  metadata: " + ", ".join(f"{k}={v}" for k, v in r["metadata"].items()))
    print()
    print_table(["key", "dtype", "shape", "bytes", "stripe"],
                [[x["key"], x["dtype"], "x".join(map(str, x["shape"])) or "()", fmt_bytes(x["bytes"]), x["file"]]
                 for x in r["tensors"]], right=(3,))
    for alias, canon in r["aliases"].items():
        print(f"{alias} -> {canon} (same storage)")
    print()
    print_table(["top-level key", "tensors", "bytes"],
                [[k, v["tensors"], fmt_bytes(v["bytes"])] for k, v in r["by_top_level"].items()], right=(1, 2))
    print()
    print_table(["dtype", "tensors", "bytes"],
                [[k, v["tensors"], fmt_bytes(v["bytes"])] for k, v in r["by_dtype"].items()], right=(1, 2))
    if r["leaves"]:
        print()
        rows = [[k, repr(v)[:80]] for k, v in r["leaves"].items()] if a.all_leaves else \
            summarised_leaves(r["leaves"])
        print_table(["leaf", "value"], rows)
    if a.tensors and not r["tensors"] and not r["leaves"]:
        print(f"nothing matches {a.tensors!r}", file=sys.stderr)
        return PROBLEM
    return OK


@guarded
def cmd_diff(a: argparse.Namespace) -> int:
    r = diff(a.a, a.b, deep=a.deep, pattern=a.tensors, progress=None if a.json else _progress(a))
    if a.json:
        print_json(r)
        return _diff_status(r)
    rows = [[k, "added", ""] for k in r["added"]] + [[k, "removed", ""] for k in r["removed"]]
    rows += [[c["key"], "dtype/shape", f"{c['a']['dtype']} {c['a']['shape']} -> {c['b']['dtype']} {c['b']['shape']}"]
             for c in r["changed_meta"]]
    rows += [[k, "content", "bytes differ" if a.deep else "checksums differ"] for k in r["changed_content"]]
    rows += [[k, "unknown", "laid out differently; --deep compares the bytes"] for k in r["unknown"]]
    rows += [[x["path"], f"leaf {x['change']}", f"{x['a']!r} -> {x['b']!r}"[:100]] for x in r["leaves"]]
    if rows:
        print_table(["key", "change", "detail"], rows)
    how = "bytes compared" if a.deep else "compared by stored checksums, no data read"
    verdict = "identical" if r["identical"] else \
        f"undetermined: {len(r['unknown'])} laid out differently (use --deep)" if r["undetermined"] else "different"
    print(f"{verdict}: {r['same']} tensors the same, "
          f"{len(r['changed_content'])} changed in content, {len(r['changed_meta'])} in dtype/shape, "
          f"{len(r['added'])} added, {len(r['removed'])} removed, {len(r['leaves'])} leaves differ ({how})")
    return _diff_status(r)


def _diff_status(r: dict) -> int:
    return OK if r["identical"] else UNDETERMINED if r["undetermined"] else PROBLEM


@guarded
def cmd_convert(a: argparse.Namespace) -> int:
    r = convert(a.src, a.dst, src_format=a.src_format, dst_format=a.dst_format, allow_pickle=a.allow_pickle,
                stripes=a.stripes, shards=a.shards, overwrite=a.overwrite, progress=_progress(a))
    if a.json:
        print_json(r)
    else:
        print(f"{r['source']} ({r['from']}) -> {r['destination']} ({r['to']}): {r['tensors']} tensors, "
              f"{fmt_bytes(r['bytes'])}")
    return OK


def _print_tune(r: dict) -> None:
    fs = r["filesystem"]
    lim = r["device_limit"]
    print(f"{r['directory']} on {fs['source']} ({fs['fstype']}, mounted at {fs['mount_point']}), "
          f"{fmt_bytes(r['bytes_per_trial'])} per trial, {r['elapsed_s']:.0f} s of a {r['budget_s']:.0f} s budget")
    if lim.get("write_gbps"):
        rd = f", read {lim['read_gbps']:.2f} GB/s" if lim.get("read_gbps") else ""
        print(f"device limit: write {lim['write_gbps']:.2f} GB/s{rd} ({lim['tool']})")
    else:
        print(f"device limit: {lim.get('tool')}")
    print()
    best = r.get("recommended") or {}
    print_table(["stripes", "queue depth", "chunk", "GB/s", "of limit", "durable s", ""],
                [[x["stripes"], x["queue_depth"], fmt_bytes(x["chunk_bytes"]),
                  f"{x['gbps']:.2f}" if x["gbps"] else "-",
                  f"{x['of_limit']:.2f}" if x.get("of_limit") else "-", f"{x['seconds']:.2f}",
                  "<- recommended" if {k: x[k] for k in ("stripes", "queue_depth", "chunk_bytes")} == best else ""]
                 for x in r["trials"]], right=(0, 1, 2, 3, 4, 5))
    if lim.get("write_gbps"):
        print("of limit: GB/s over the device limit's (above 1.00: faster than that one configuration, which is "
              "a reference, not the device's ceiling)")
    if r["skipped"]:
        print(f"\nskipped (budget): {', '.join(r['skipped'])}")
    if best:
        print(f"\nrecommended: stripes={best['stripes']} queue_depth={best['queue_depth']} "
              f"chunk_bytes={best['chunk_bytes']} ({r['recommended_gbps']:.2f} GB/s)")


@guarded
def cmd_tune(a: argparse.Namespace) -> int:
    if not kind_of(a.dir, "tune").tunes_writer:  # a remote target: its connections are what is tuned
        return _tune_nfs(a)
    r = tune(a.dir, a.budget_s, _progress(a), device_tool=a.device_tool, size=a.size)
    if not r.get("recommended"):
        raise Problem("no trial finished within the budget; give a larger --budget-s")
    if a.save:
        r["saved"] = save_tuning(a.dir, r["recommended"], {"gbps": r["recommended_gbps"]})
        r["saved_to"] = store_path()
    if a.json:
        print_json(r)
    else:
        _print_tune(r)
        if a.save:
            print(f"saved for {r['saved']['source']} at {r['saved']['mount_point']} in {r['saved_to']}: "
                  "Writer() and flashwrite.save use it there unless given explicit settings")
    return OK


def _tune_nfs(a: argparse.Namespace) -> int:
    r = tune_nfs(a.dir, a.budget_s, _progress(a), size=a.size)
    if a.save:
        r["saved"], r["saved_to"] = save_nfs_tuning(r)
    if a.json:
        print_json(r)
        return OK
    print(f"{r['url']}: export {r['export']} of {r['server']}, {fmt_bytes(r['bytes_per_trial'])} per trial, "
          f"{r['elapsed_s']:.0f} s of a {r['budget_s']:.0f} s budget\n")
    best = r["connections"]
    print_table(["connections", "durable s", "save GB/s", "load s", "load GB/s", ""],
                [[x["connections"], f"{x['save_s']:.2f}", f"{x['save_gbps']:.2f}", f"{x['load_s']:.2f}",
                  f"{x['load_gbps']:.2f}", "<- recommended" if x["connections"] == best else ""]
                 for x in r["trials"]], right=(0, 1, 2, 3, 4))
    if r["skipped"]:
        print(f"\nskipped (budget): {', '.join(r['skipped'])}")
    print(f"\nrecommended: connections={best} ({r['recommended_gbps']:.2f} GB/s to durable)")
    if a.save:
        print(f"saved for {r['saved']['key']} in {r['saved_to']}: nfs:// URLs there without connections= use it")
    return OK


def register(sub: Any, size_type: Any) -> None:
    p = sub.add_parser("ls", help="list the checkpoints under a directory (manifests only, no data read)")
    p.add_argument("root", help="a CheckpointManager root, any directory, or one checkpoint")
    p.add_argument("-r", "--recursive", action="store_true", help="also look in subdirectories")
    p.add_argument("--local-dir", help="where local snapshots of ROOT's checkpoints are looked for "
                   "(default: /dev/shm, as CheckpointManager(local_snapshots=True))")
    p.add_argument("--no-local", action="store_true", help="list only checkpoints in ROOT, no local snapshots")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_ls)

    p = sub.add_parser("inspect", help="keys, dtypes, shapes, totals, stripes and writer of a checkpoint")
    p.add_argument("ckpt")
    p.add_argument("--tensors", metavar="PATTERN", help="only keys matching: a glob (*.weight), a substring or "
                                                        "prefix (model.layers.0), or re:REGEX")
    p.add_argument("--all-leaves", action="store_true", help="one line per non-tensor leaf, even in long runs of "
                   "numbers such as Python's RNG state (by default summarised in one line)")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_inspect)

    p = sub.add_parser("diff", help="tensors and leaves that differ between two checkpoints (by stored checksums)")
    p.add_argument("a")
    p.add_argument("b")
    p.add_argument("--deep", action="store_true", help="compare the bytes themselves (reads both checkpoints)")
    p.add_argument("--tensors", metavar="PATTERN", help="only keys matching (as for inspect)")
    p.add_argument("--json", action="store_true")
    p.add_argument("--quiet", "-q", action="store_true", help="no progress")
    p.set_defaults(func=cmd_diff)

    p = sub.add_parser("convert", help="between flashwrite, torch.save, safetensors, Hugging Face and DCP")
    p.add_argument("src")
    p.add_argument("dst")
    p.add_argument("--from", dest="src_format", choices=FORMATS, help="source format (default: detected)")
    p.add_argument("--to", dest="dst_format", choices=FORMATS,
                   help="target format (default: from DST's extension, else flashwrite)")
    p.add_argument("--allow-pickle", action="store_true",
                   help="unpickle arbitrary objects (torch.save files, DCP non-tensor items): runs code, only for "
                        "files you trust")
    p.add_argument("--stripes", type=int, help="stripes of a flashwrite target")
    p.add_argument("--shards", type=int, help="shards of a Hugging Face target (default: one per 5 GiB)")
    p.add_argument("--overwrite", action="store_true", help="replace an existing target file or checkpoint")
    p.add_argument("--json", action="store_true")
    p.add_argument("--quiet", "-q", action="store_true", help="no progress")
    p.set_defaults(func=cmd_convert)

    p = sub.add_parser("tune", help="measure the storage behind DIR and recommend stripes, queue depth, chunk "
                       "(for an nfs:// DIR: the number of connections)")
    p.add_argument("dir")
    p.add_argument("--budget-s", type=float, default=120.0, help="time to spend (default 120)")
    p.add_argument("--size", type=size_type, help="bytes per trial (default: sized to the budget)")
    p.add_argument("--device-tool", choices=["auto", "fio", "probe"], default="auto")
    p.add_argument("--save", action="store_true", help="store the recommendation for this file system")
    p.add_argument("--json", action="store_true")
    p.add_argument("--plain", action="store_true", help="plain progress lines even on a terminal")
    p.add_argument("--quiet", "-q", action="store_true", help="no progress")
    p.set_defaults(func=cmd_tune)
