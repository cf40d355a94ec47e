#!/usr/bin/env python3
"""Start a real NFS server on 127.0.0.1 for manual use: nfs-ganesha (VFS, NFSv3/TCP).

    sudo python3 tools/nfs_server.py                 # exports a fresh directory
    sudo python3 tools/nfs_server.py --export /data/ck --read-only /data/ro

Prints each export's URL (nfs://127.0.0.1/PATH: NFSv3 names an export by its real
path), the same with its ports for flashwrite (``?nfsport=P&mountport=Q``: needed when
other NFS servers share the host's portmapper), and the URL with the ports spelled out
for libnfs's tools, e.g.

    nfs-cp big.bin 'nfs://127.0.0.1/tmp/fw-nfs-XXXX/export/big.bin?version=3&nfsport=P&mountport=Q'

then serves until Ctrl-C or SIGTERM, stops ganesha (and rpcbind, if it started it) by pid
and removes its working directory (not directories given with --export). Run in the
background (``&``), Ctrl-C does not reach it (a non-interactive shell's background job even
ignores SIGINT): stop it with ``kill PID`` (SIGTERM), which cleans up the same way.
The server itself is tests/nfs_server.py, which the tests' nfs_server fixture uses.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
from nfs_server import Export, NfsServer, NfsServerUnavailable  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--export", action="append", default=[], help="a directory to export read-write (repeatable)")
    ap.add_argument("--read-only", action="append", default=[], help="a directory to export read-only (repeatable)")
    a = ap.parse_args()
    exports = [Export(os.path.abspath(p)) for p in a.export] + [Export(os.path.abspath(p), True) for p in a.read_only]
    for e in exports:
        os.makedirs(e.path, exist_ok=True)
    server = NfsServer(exports=exports)
    try:
        server.start()
    except NfsServerUnavailable as e:
        print(f"cannot start the NFS server: {e}", file=sys.stderr)
        server.stop()
        return 1
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    try:
        print(f"ganesha.nfsd pid {server.pid}, nfs port {server.nfs_port}, mount port {server.mount_port}, "
              f"log {server.log_path}")
        for e in server.exports:
            print(f"{'ro' if e.read_only else 'rw'} {e.path}\n   {server.url(export=e.path)}\n   "
                  f"{server.url_ports(export=e.path)}   (flashwrite, ports given: when other NFS servers share "
                  f"this host's portmapper)\n   {server.libnfs_url(export=e.path)}   (libnfs's tools)")
        print(f"serving; Ctrl-C stops it, or SIGTERM (kill {os.getpid()}) where it runs in the background", flush=True)
        signal.pause()
    except KeyboardInterrupt:
        pass
    finally:
        server.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
