"""A shaped network link to an NFS server on another "host" (issue 38).

``ShapedLink`` makes a network namespace of its own (``unshare --net --mount``, with a
private tmpfs on /run so the rpcbind inside does not meet the machine's), joins it to
this host by a veth pair with link-local addresses (169.254.x.y/30, never routed
anywhere), and shapes both directions with ``tc qdisc ... tbf`` (this kernel has no
netem): the host side's egress carries saves, the namespace side's carries loads.
``LinkedNfsServer`` is tests/nfs_server.py's ``NfsServer`` (rpcbind + ganesha,
``Graceless``) started inside that namespace, so the server's address is on the far
side of the link, not 127.0.0.1.

Teardown: ``stop()`` ends the servers and the namespace's holder by pid and deletes
the veth pair; both are context managers and register an ``atexit`` stop. If this
process is killed outright, nothing outlives it for long: when the holder's stdin (a
pipe from this process) closes, it SIGKILLs every process left in its network namespace
and exits (ganesha also gets SIGKILL when its parent dies, ``setpriv --pdeathsig``;
rpcbind changes its uid, which clears that), and the namespace, its veth end and so the
host's end with it are gone once its last process is.

    with ShapedLink(rate_mbit=1000) as link, LinkedNfsServer(link) as srv:
        fw.save(state, srv.url_ports("ck"))

Needs root, ``unshare``/``nsenter``/``setpriv`` (util-linux) and ``ip``/``tc`` (iproute2).
"""

from __future__ import annotations

import atexit
import itertools
import os
import shutil
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass

from nfs_server import NfsServer, NfsServerUnavailable

_seq = itertools.count()
TOOLS = ("unshare", "nsenter", "setpriv", "ip", "tc")


def _run(argv: list[str]) -> None:
    r = subprocess.run(argv, capture_output=True, text=True, timeout=20)
    if r.returncode != 0:
        raise NfsServerUnavailable(f"{' '.join(argv)}: exit {r.returncode}: {r.stderr.strip()}")


@dataclass
class ShapedLink:
    """A network namespace joined to this host by a veth pair shaped with tbf both ways."""

    rate_mbit: int = 1000
    burst_kib: int = 0            # 0: about 4 ms of the rate, at least 512 KiB (GSO packets are 64 KiB)
    holder_pid: int | None = None
    host_ip: str = ""
    ns_ip: str = ""
    host_dev: str = ""
    ns_dev: str = ""
    _holder: subprocess.Popen | None = None

    def start(self) -> ShapedLink:
        missing = [t for t in TOOLS if shutil.which(t) is None]
        if missing:
            raise NfsServerUnavailable(f"{', '.join(missing)} not installed (apt-get install iproute2 util-linux)")
        if os.geteuid() != 0:
            raise NfsServerUnavailable("network namespaces and tc need root")
        n = next(_seq)
        # Unique per process and link: a /30 in 169.254.0.0/16 (x in 1..254, y a multiple of 4).
        k = (os.getpid() * 7 + n) % (254 * 64)
        net = f"169.254.{1 + k // 64}.{(k % 64) * 4}"
        base = net.rsplit(".", 1)[0]
        last = int(net.rsplit(".", 1)[1])
        self.host_ip, self.ns_ip = f"{base}.{last + 1}", f"{base}.{last + 2}"
        tag = f"fw{os.getpid() % 100000}{n % 100}"
        self.host_dev, self.ns_dev = f"{tag}h", f"{tag}n"
        atexit.register(self.stop)
        try:
            self._start_holder()
            _run(["ip", "link", "add", self.host_dev, "type", "veth", "peer", "name", self.ns_dev])
            _run(["ip", "link", "set", self.ns_dev, "netns", str(self.holder_pid)])
            _run(["ip", "addr", "add", f"{self.host_ip}/30", "dev", self.host_dev])
            _run(["ip", "link", "set", self.host_dev, "up"])
            for argv in (["ip", "addr", "add", f"{self.ns_ip}/30", "dev", self.ns_dev],
                         ["ip", "link", "set", self.ns_dev, "up"], ["ip", "link", "set", "lo", "up"]):
                _run(self.ns_cmd(argv))
            self.set_rate(self.rate_mbit)
            self._wait_reachable()
        except BaseException:
            self.stop()
            raise
        return self

    def _start_holder(self) -> None:
        # The holder owns the namespaces. When its stdin (our pipe) closes, also because this
        # process died, it SIGKILLs whatever still runs in its network namespace (rpcbind
        # changes its uid, which clears the parent-death signal) and exits.
        script = ("mount -t tmpfs fw-run /run && mkdir -p /run/rpcbind && echo ready && cat >/dev/null; "
                  "me=$(readlink /proc/$$/ns/net); for p in /proc/[0-9]*; do q=${p#/proc/}; "
                  "[ \"$q\" != $$ ] && [ \"$(readlink $p/ns/net 2>/dev/null)\" = \"$me\" ] && kill -9 $q; done; exit 0")
        self._holder = subprocess.Popen(["unshare", "--net", "--mount", "--propagation", "private", "--",
                                         "sh", "-c", script], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                        stderr=subprocess.PIPE)
        line = self._holder.stdout.readline()
        if line.strip() != b"ready":
            err = self._holder.stderr.read().decode(errors="replace") if self._holder.poll() is not None else ""
            raise NfsServerUnavailable(f"unshare --net --mount failed: {err.strip() or line!r}")
        self.holder_pid = self._holder.pid

    def _wait_reachable(self, timeout_s: float = 10.0) -> None:
        deadline = time.monotonic() + timeout_s
        while True:  # a TCP connect to a closed port is refused once the path works
            try:
                with socket.create_connection((self.ns_ip, 9), timeout=0.5):
                    return
            except ConnectionRefusedError:
                return
            except OSError:
                if time.monotonic() > deadline:
                    raise NfsServerUnavailable(f"{self.ns_ip} not reachable over {self.host_dev}") from None
                time.sleep(0.1)

    def ns_cmd(self, argv: list[str]) -> list[str]:
        """``argv`` run inside the namespace (network and mount), as the same pid (no fork)."""
        return ["nsenter", "-t", str(self.holder_pid), "-n", "-m", "--"] + argv

    def set_rate(self, rate_mbit: int) -> None:
        """Shape both directions to ``rate_mbit`` Mbit/s (tbf on each side's egress)."""
        self.rate_mbit = rate_mbit
        burst = self.burst_kib or max(512, rate_mbit * 1000 // 8 * 4 // 1024)
        args = ["root", "tbf", "rate", f"{rate_mbit}mbit", "burst", f"{burst}kb", "latency", "50ms"]
        _run(["tc", "qdisc", "replace", "dev", self.host_dev] + args)
        _run(self.ns_cmd(["tc", "qdisc", "replace", "dev", self.ns_dev] + args))

    def stop(self) -> None:
        atexit.unregister(self.stop)
        if self.host_dev:
            subprocess.run(["ip", "link", "del", self.host_dev], capture_output=True, timeout=20)
        h, self._holder = self._holder, None
        if h is not None:
            h.stdin.close()
            try:
                h.wait(timeout=5)
            except subprocess.TimeoutExpired:
                h.kill()
                h.wait()
            h.stdout.close()
            h.stderr.close()
        self.holder_pid = None

    def __enter__(self) -> ShapedLink:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


@dataclass
class LinkedNfsServer(NfsServer):
    """``NfsServer`` run inside ``link``'s namespace, at ``link.ns_ip``."""

    link: ShapedLink | None = None
    start_timeout_s: float = 30.0

    def start(self) -> LinkedNfsServer:
        if self.link is None or self.link.holder_pid is None:
            raise NfsServerUnavailable("LinkedNfsServer needs a started ShapedLink")
        self.host = self.link.ns_ip
        # Killed with their parent (this process) if it dies before stop().
        self.prefix = self.link.ns_cmd(["setpriv", "--pdeathsig", "KILL", "--"])
        atexit.register(self.stop)
        super().start()
        return self

    def stop(self) -> None:
        atexit.unregister(self.stop)
        super().stop()

    def __enter__(self) -> LinkedNfsServer:
        return self.start()


# ------------------------------------------------------------ raw TCP ceiling

def tcp_ceiling(link: ShapedLink, nbytes: int, direction: str = "save", streams: int = 1) -> float:
    """Bytes/s of ``streams`` raw TCP streams through ``link`` moving ``nbytes`` in all:
    host -> namespace for "save", namespace -> host for "load". The far end is a Python
    process inside the namespace; the time runs from the first connect to the last byte."""
    port = 5201
    role = "sink" if direction == "save" else "source"
    child = subprocess.Popen(link.ns_cmd([sys.executable, "-c", _FAR_END, role, str(port), str(nbytes), str(streams)]),
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        if child.stdout.readline().strip() != "listening":
            raise RuntimeError(f"tcp_ceiling: far end did not start: {child.stderr.read()}")
        per = nbytes // streams
        t0 = time.perf_counter()
        threads = [threading.Thread(target=_near_end, args=(link.ns_ip, port, per, role)) for _ in range(streams)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        elapsed = time.perf_counter() - t0
        child.wait(timeout=30)
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
        child.stdout.close()
        child.stderr.close()
    return per * streams / elapsed


def _near_end(host: str, port: int, n: int, role: str) -> None:
    with socket.create_connection((host, port), timeout=30) as s:
        if role == "sink":  # we send
            buf = memoryview(bytearray(1 << 20))
            left = n
            while left:
                left -= s.send(buf[:min(left, len(buf))])
            s.shutdown(socket.SHUT_WR)
            s.recv(1)  # the far end's close: every byte arrived
        else:
            buf = bytearray(1 << 20)
            got = 0
            while got < n:
                k = s.recv_into(buf)
                if not k:
                    raise RuntimeError(f"tcp_ceiling: stream ended after {got} of {n} bytes")
                got += k


_FAR_END = r"""
import socket, sys, threading
role, port, n, streams = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
per = n // streams
ls = socket.socket(); ls.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
ls.bind(("0.0.0.0", port)); ls.listen(streams); print("listening", flush=True)
def serve(c):
    buf = bytearray(1 << 20)
    if role == "sink":
        while c.recv_into(buf):
            pass
    else:
        mv, left = memoryview(buf), per
        while left:
            left -= c.send(mv[:min(left, len(mv))])
        c.shutdown(socket.SHUT_WR); c.recv(1)
    c.close()
ts = []
for _ in range(streams):
    c, _a = ls.accept(); t = threading.Thread(target=serve, args=(c,)); t.start(); ts.append(t)
for t in ts:
    t.join()
"""
