"""A TCP proxy in front of an NFS server that cuts the replies to flashwrite's own
connections (csrc/io/nfs_wire.cpp) into many RPC record fragments, sends them in
small pieces, and answers every reply twice.

A server may send a reply record as several fragments (RFC 5531 record marking), a
TCP stream may hand over any number of bytes per recv, and a reply may come again
after its call was answered (sent twice across a reconnect). ganesha on loopback
does none of that, so the wire connection's receiver would only ever see whole
single-fragment records; through this proxy it sees all three: a fragment boundary
inside a READ reply's header and inside its payload, recvs of a few bytes, and a
second copy of each reply (whose xid is no longer waited for: dropped, payload and
all). Connections from libnfs (which has no use for fragments) pass unchanged: a
connection is flashwrite's own when its first call's AUTH_SYS machine name is
"flashwrite".
"""

from __future__ import annotations

import socket
import struct
import threading

# Fragment lengths, in turn: cuts inside the RPC header, the READ result's
# attributes, its count and length words, and the payload (then what is left).
CUTS = (1, 3, 9, 17, 30, 53, 71, 200, 4093, 65536, 262144)


def _shut(*socks: socket.socket) -> None:
    for s in socks:
        try:
            s.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass


class Refragmenter:
    """Listens on 127.0.0.1:port and forwards to (host, target_port)."""

    def __init__(self, host: str, target_port: int):
        self.target = (host, target_port)
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.wire_conns = 0
        self.replies = 0
        self._stop = False
        self._threads: list[threading.Thread] = []
        self._socks: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def close(self) -> None:
        self._stop = True
        self.sock.close()
        for s in self._socks:
            _shut(s)
            s.close()

    def __enter__(self) -> "Refragmenter":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _accept(self) -> None:
        while not self._stop:
            try:
                client, _ = self.sock.accept()
            except OSError:
                return
            server = socket.create_connection(self.target)
            client.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # small sends stay small
            self._socks += [client, server]
            first = client.recv(65536)
            wire = b"flashwrite" in first
            self.wire_conns += wire
            server.sendall(first)
            threading.Thread(target=self._pipe, args=(client, server), daemon=True).start()
            target = self._refragment if wire else self._pipe
            threading.Thread(target=target, args=(server, client), daemon=True).start()

    @staticmethod
    def _pipe(src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(1 << 20):
                dst.sendall(data)
        except OSError:
            pass
        finally:
            _shut(src, dst)

    def _refragment(self, src: socket.socket, dst: socket.socket) -> None:
        buf = b""
        record = b""
        try:
            while True:
                data = src.recv(1 << 20)
                if not data:
                    break
                buf += data
                while len(buf) >= 4:
                    (mark,) = struct.unpack(">I", buf[:4])
                    n = mark & 0x7FFFFFFF
                    if len(buf) < 4 + n:
                        break
                    record += buf[4:4 + n]
                    buf = buf[4 + n:]
                    if mark & 0x80000000:
                        self.replies += 1
                        for _ in range(2):  # the reply, then the same again: its xid no longer waited for
                            self._send_fragmented(dst, record)
                        record = b""
        except OSError:
            pass
        finally:
            _shut(src, dst)

    @staticmethod
    def _send_fragmented(dst: socket.socket, record: bytes) -> None:
        at, i = 0, 0
        while at < len(record) or at == 0:
            n = min(CUTS[i % len(CUTS)], len(record) - at)
            last = at + n >= len(record)
            frag = struct.pack(">I", (0x80000000 if last else 0) | n) + record[at:at + n]
            # The first fragments byte by byte in pieces of 2: recvs of a few bytes.
            if i < 3:
                for j in range(0, len(frag), 2):
                    dst.sendall(frag[j:j + 2])
            else:
                dst.sendall(frag)
            at += n
            i += 1
            if last:
                break
