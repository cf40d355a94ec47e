"""A real NFS server for tests: nfs-ganesha (VFS backend, NFSv3 over TCP) on 127.0.0.1.

``NfsServer`` starts ``rpcbind`` (unless one already answers) and ``ganesha.nfsd`` with
a fresh configuration exporting directories of this machine, waits until the server
is registered with rpcbind and listening, and can kill it with SIGKILL and start it
again mid-test. ``stop()`` ends both processes it started, by pid, and removes what
it made. Used by the ``nfs_server`` fixture (tests/conftest.py) and by
tools/nfs_server.py for manual use.

Two things a default configuration gets wrong:
- after each start the server refuses creates with NFS3ERR_JUKEBOX for about 90 s (its
  grace period) unless ``NFSV4 { Graceless = true; }``;
- NFSv3 clients name an export by its real ``Path`` (not its ``Pseudo`` path), so the
  URL of the export at /tmp/x is nfs://127.0.0.1/tmp/x.
Ports are chosen free at start (and kept across restarts), so nothing else on the
machine is disturbed; ``libnfs_url`` adds them to a URL for libnfs's tools.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from dataclasses import dataclass, field

GANESHA = "ganesha.nfsd"
RPCBIND = "rpcbind"
NFS_PROGRAM, MOUNT_PROGRAM = 100003, 100005


class NfsServerUnavailable(RuntimeError):
    """The server cannot start here (a package missing, not root, rpcbind not startable)."""


def _free_ports(n: int) -> list[int]:
    """n distinct free ports: the sockets stay bound until all are chosen (one closed
    before the next bind may be handed out again, and ganesha with NFS_Port equal to
    MNT_Port fails every MOUNT: 'mount_cb: (null)', as one CI run saw)."""
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def _server_env() -> dict[str, str]:
    """The environment the servers run in: this one without a preloaded sanitizer runtime
    (the sanitizer job preloads libasan for flashwrite's core; ganesha is not under test,
    and its dlopen with RTLD_DEEPBIND refuses to run beside it)."""
    env = dict(os.environ)
    env.pop("LD_PRELOAD", None)
    return env


def _listening(port: int, host: str = "127.0.0.1") -> bool:
    try:
        with socket.create_connection((host, port), timeout=0.5):
            return True
    except OSError:
        return False


def _registered(port: int, host: str = "127.0.0.1") -> bool:
    """Whether the rpcbind at ``host`` lists NFSv3 over TCP at ``port``."""
    try:
        out = subprocess.run(["rpcinfo", "-p", host], capture_output=True, text=True, timeout=5).stdout
    except (OSError, subprocess.TimeoutExpired):
        return False
    return any(line.split()[:4] == [str(NFS_PROGRAM), "3", "tcp", str(port)] for line in out.splitlines())


@dataclass
class Export:
    path: str            # the directory exported (and the export's name for NFSv3 clients)
    read_only: bool = False


@dataclass
class NfsServer:
    """ganesha.nfsd on 127.0.0.1 exporting ``exports`` (a fresh directory by default)."""

    exports: list[Export] = field(default_factory=list)
    workdir: str = ""
    host: str = "127.0.0.1"
    nfs_port: int = 0
    mount_port: int = 0
    start_timeout_s: float = 20.0
    # Put before the rpcbind and ganesha command lines, e.g. to run them in another
    # network namespace (tests/nfs_netns.py); it must exec, so the pids stay theirs.
    prefix: list[str] = field(default_factory=list)
    _ganesha: subprocess.Popen | None = None
    _rpcbind: subprocess.Popen | None = None
    _own_workdir: bool = False

    # ------------------------------------------------------------ life cycle

    def start(self) -> NfsServer:
        missing = [t for t in (GANESHA, RPCBIND, "rpcinfo") if shutil.which(t) is None]
        if missing:
            raise NfsServerUnavailable(f"{', '.join(missing)} not installed (apt-get install nfs-ganesha "
                                       "nfs-ganesha-vfs rpcbind)")
        if os.geteuid() != 0:
            raise NfsServerUnavailable("ganesha.nfsd's VFS backend needs root (open_by_handle_at)")
        if not self.workdir:
            self.workdir = tempfile.mkdtemp(prefix="fw-nfs-")
            self._own_workdir = True
        os.makedirs(self.workdir, exist_ok=True)
        if not self.exports:
            path = os.path.join(self.workdir, "export")
            os.makedirs(path, exist_ok=True)
            self.exports.append(Export(path))
        picked = [p for p in _free_ports(3) if p not in (self.nfs_port, self.mount_port)]
        self.nfs_port = self.nfs_port or picked.pop(0)
        self.mount_port = self.mount_port or picked.pop(0)
        try:
            self._ensure_rpcbind()
            self._write_config()
            self._start_ganesha()
        except BaseException:
            self.stop()  # nothing it started outlives a failed start
            raise
        return self

    def _ensure_rpcbind(self) -> None:
        if _listening(111, self.host):
            return  # one already runs (ours from an earlier start, or the machine's)
        # -f: stay in the foreground, so the pid is ours to stop.
        self._rpcbind = subprocess.Popen(self.prefix + [RPCBIND, "-f"], stdin=subprocess.DEVNULL,
                                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=_server_env())
        deadline = time.monotonic() + 5
        while not _listening(111, self.host):
            if self._rpcbind.poll() is not None or time.monotonic() > deadline:
                self._rpcbind = None
                raise NfsServerUnavailable("rpcbind did not start (is port 111 taken?)")
            time.sleep(0.05)

    def _write_config(self) -> None:
        blocks = [f"""NFS_CORE_PARAM {{
  Protocols = 3;
  NFS_Port = {self.nfs_port};
  MNT_Port = {self.mount_port};
  Bind_addr = {self.host};
  Enable_NLM = false;
  Enable_RQUOTA = false;
}}
NFSV4 {{ Graceless = true; }}
NFS_KRB5 {{ Active_krb5 = false; }}
"""]
        for i, e in enumerate(self.exports, 1):
            blocks.append(f"""EXPORT {{
  Export_Id = {i};
  Path = "{e.path}";
  Pseudo = "{e.path}";
  Access_Type = {"RO" if e.read_only else "RW"};
  Squash = No_Root_Squash;
  Protocols = 3;
  Transports = TCP;
  SecType = sys;
  FSAL {{ Name = VFS; }}
}}
""")
        with open(self.config_path, "w") as fh:
            fh.write("\n".join(blocks))

    @property
    def config_path(self) -> str:
        return os.path.join(self.workdir, "ganesha.conf")

    @property
    def log_path(self) -> str:
        return os.path.join(self.workdir, "ganesha.log")

    def _start_ganesha(self) -> None:
        self._ganesha = subprocess.Popen(
            self.prefix + [GANESHA, "-F", "-f", self.config_path, "-L", self.log_path, "-p", os.path.join(self.workdir, "pid"),
             "-N", "NIV_EVENT"], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            env=_server_env())
        deadline = time.monotonic() + self.start_timeout_s
        while not (_listening(self.nfs_port, self.host) and _registered(self.nfs_port, self.host)):
            if self._ganesha.poll() is not None:
                rc, self._ganesha = self._ganesha.returncode, None
                raise NfsServerUnavailable(f"ganesha.nfsd exited ({rc}) at start: {self.log_tail()}")
            if time.monotonic() > deadline:
                self._stop_ganesha(signal.SIGKILL)
                raise NfsServerUnavailable(f"ganesha.nfsd not registered within {self.start_timeout_s} s: "
                                           f"{self.log_tail()}")
            time.sleep(0.1)

    def log_tail(self, n: int = 5) -> str:
        try:
            with open(self.log_path, errors="replace") as fh:
                return " | ".join(line.strip() for line in fh.readlines()[-n:])
        except OSError:
            return "(no log)"

    @property
    def pid(self) -> int | None:
        return self._ganesha.pid if self._ganesha is not None else None

    def kill(self) -> None:
        """SIGKILL the server (as a crash would); the exports stay."""
        self._stop_ganesha(signal.SIGKILL)

    def restart(self, *, kill: bool = True) -> None:
        """Kill (SIGKILL; kill=False: SIGTERM) and start again on the same ports and exports."""
        self._stop_ganesha(signal.SIGKILL if kill else signal.SIGTERM)
        self._ensure_rpcbind()  # a server another process started may have stopped the rpcbind it started
        self._start_ganesha()

    def _stop_ganesha(self, sig: int) -> None:
        p, self._ganesha = self._ganesha, None
        if p is None or p.poll() is not None:
            return
        p.send_signal(sig)
        try:
            p.wait(timeout=10)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()

    def stop(self) -> None:
        """Stop what start() started (by pid) and remove what it made."""
        self._stop_ganesha(signal.SIGTERM)
        rb, self._rpcbind = self._rpcbind, None
        if rb is not None and rb.poll() is None:
            rb.terminate()
            try:
                rb.wait(timeout=5)
            except subprocess.TimeoutExpired:
                rb.kill()
                rb.wait()
        if self._own_workdir:
            shutil.rmtree(self.workdir, ignore_errors=True)

    def __enter__(self) -> NfsServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # ------------------------------------------------------------ names

    @property
    def export(self) -> str:
        """The local path of the first export."""
        return self.exports[0].path

    def url(self, rel: str = "", export: str | None = None) -> str:
        """nfs://HOST/EXPORT[/rel] (an NFSv3 export is named by its real path)."""
        base = f"nfs://{self.host}{export or self.export}"
        return f"{base}/{rel.lstrip('/')}" if rel else base

    def url_ports(self, rel: str = "", export: str | None = None) -> str:
        """The URL with this server's ports, for flashwrite: no portmapper is asked, so a
        second server on the machine (rpcbind is shared) cannot be confused with this one."""
        return f"{self.url(rel, export)}?nfsport={self.nfs_port}&mountport={self.mount_port}"

    def libnfs_url(self, rel: str = "", export: str | None = None) -> str:
        """The URL with the ports spelled out, for libnfs's tools (nfs-cp, nfs-ls)."""
        return f"{self.url(rel, export)}?version=3&nfsport={self.nfs_port}&mountport={self.mount_port}"
