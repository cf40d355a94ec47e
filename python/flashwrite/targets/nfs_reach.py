"""Why an NFS server could not be reached, asked only once libnfs failed to reach it.

libnfs reports most ways of not reaching a server as one "Connection refused": a host
name that does not resolve, no portmapper on the host, and a server that has not (yet)
registered its services with the portmapper all read alike. Each sends the user a
different way, so ``why_unreachable`` tells them apart: the name through the resolver,
the rest by asking the host's portmapper (rpcbind, port 111) itself with a GETPORT call
(RFC 1833, version 2 over TCP), for the services the URL gave no port for.
"""

from __future__ import annotations

import os
import socket
import struct

__all__ = ["why_unreachable", "getport"]

PMAP_PORT, PMAP_PROGRAM, PMAP_VERSION, PMAPPROC_GETPORT = 111, 100000, 2, 3
NFS_PROGRAM, MOUNT_PROGRAM, IPPROTO_TCP = 100003, 100005, 6


def _bracketed(host: str) -> str:
    return f"[{host}]" if ":" in host else host


def _hint(host: str) -> str:
    return f"nfs://{_bracketed(host)}:NFSPORT/PATH?mountport=MOUNTPORT (nfsport= and mountport= skip the portmapper)"


def getport(host: str, program: int, version: int, timeout_s: float) -> int:
    """The TCP port the portmapper at ``host`` names for ``program``/``version``: 0 when the
    program is not registered. OSError when no portmapper answers."""
    xid = int.from_bytes(os.urandom(4), "big")
    call = struct.pack(">14I", xid, 0, 2, PMAP_PROGRAM, PMAP_VERSION, PMAPPROC_GETPORT, 0, 0, 0, 0,
                       program, version, IPPROTO_TCP, 0)
    with socket.create_connection((host, PMAP_PORT), timeout=timeout_s) as s:
        s.sendall(struct.pack(">I", 0x80000000 | len(call)) + call)
        n = struct.unpack(">I", _recv(s, 4))[0] & 0x7FFFFFFF
        reply = _recv(s, min(n, 4096))
    # xid, REPLY, MSG_ACCEPTED, verifier (flavor, length, body), SUCCESS, port
    rxid, mtype, stat, _, vlen = struct.unpack_from(">5I", reply)
    at = 20 + (vlen + 3) // 4 * 4
    if rxid != xid or mtype != 1 or stat != 0 or len(reply) < at + 8:
        raise ConnectionError(f"the portmapper at {host}:{PMAP_PORT} gave a malformed reply")
    accept, port = struct.unpack_from(">2I", reply, at)
    if accept != 0:
        raise ConnectionError(f"the portmapper at {host}:{PMAP_PORT} refused GETPORT (status {accept})")
    return port


def _recv(s: socket.socket, n: int) -> bytes:
    buf = b""
    while len(buf) < n:
        part = s.recv(n - len(buf))
        if not part:
            raise ConnectionError("the portmapper closed the connection mid-reply")
        buf += part
    return buf


def why_unreachable(host: str, nfs_port: int, mount_port: int, timeout_s: float) -> OSError | None:
    """The error that says why ``host``'s NFS server was not reached, or None when none of
    the causes this can tell holds (then the error libnfs gave stands)."""
    try:
        socket.getaddrinfo(host, None)
    except socket.gaierror as e:
        return socket.gaierror(e.errno, f"the host name {host!r} does not resolve ({e.strerror})", f"nfs://{host}")
    asked = [(name, program) for name, program, port in (("MOUNT", MOUNT_PROGRAM, mount_port),
                                                         ("NFS", NFS_PROGRAM, nfs_port)) if not port]
    if not asked:
        return None  # the URL gave both ports: no portmapper was asked
    wait = min(timeout_s, 3.0)
    try:
        ports = {name: getport(host, program, 3, wait) for name, program in asked}
    except OSError as e:
        return ConnectionRefusedError(
            111, f"no portmapper (rpcbind) answers at {_bracketed(host)}:{PMAP_PORT} ({e.strerror or e}): the server is "
            f"down or not reachable, or it runs without a portmapper; then give its ports: {_hint(host)}",
            f"nfs://{_bracketed(host)}")
    missing = [name for name, port in ports.items() if port == 0]
    if missing:
        return ConnectionRefusedError(
            111, f"the NFS server at {host} has not registered {' and '.join(missing)} version 3 with the portmapper "
            f"(rpcbind): it may still be starting (try again shortly), or it does not register; then give its "
            f"ports: {_hint(host)}", f"nfs://{_bracketed(host)}")
    return None
