"""Seed addresses that never answer a gossip exchange, for the dead-seed test and benchmark.

Three kinds, as a node meets them in the field (only loopback and TEST-NET addresses):

- **refused**: a 127.0.0.x port where nothing listens (the kernel answers RST at once);
- **silent**: a 127.0.0.x port that accepts TCP connections and never sends a byte (a
  frozen process, a proxy that swallows connections): the TLS handshake never ends;
- **black-holed**: 192.0.2.200-254 (TEST-NET-1, RFC 5737), which nobody routes: SYNs go
  unanswered (or, on a host whose own link is 192.0.2.0/24, ARP fails after ~3 s).

    with DeadSeeds(200) as dead:
        seeds = dead.addresses + ["127.0.0.1:PORT"]

The silent listeners run on a daemon thread that accepts and holds every connection until
:meth:`DeadSeeds.close`.
"""

from __future__ import annotations

import selectors
import socket
import threading
from types import TracebackType


def _unused_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class DeadSeeds:
    """``n`` dead seed addresses (``host:port`` strings in :attr:`addresses`): about 40%
    refused, 30% silent, 30% black-holed, interleaved so that no kind comes in one block."""

    def __init__(self, n: int) -> None:
        self.refused: list[str] = []
        self.silent: list[str] = []
        self.blackholed: list[str] = []
        self._listeners: list[socket.socket] = []
        self._held: list[socket.socket] = []
        self._stop = threading.Event()
        self.addresses: list[str] = []
        port = _unused_port()
        kinds = ("refused", "silent", "blackholed", "refused", "silent", "blackholed", "refused", "silent",
                 "blackholed", "refused")
        for i in range(n):
            kind = kinds[i % len(kinds)]
            if kind == "refused":
                self.refused.append(f"127.0.{len(self.refused) // 250}.{2 + len(self.refused) % 250}:{port}")
            elif kind == "silent":
                s = socket.socket()
                s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                s.bind(("127.0.0.1", 0))
                s.listen(256)
                s.setblocking(False)
                self._listeners.append(s)
                self.silent.append(f"127.0.0.1:{s.getsockname()[1]}")
            else:
                k = len(self.blackholed)
                self.blackholed.append(f"192.0.2.{200 + k % 55}:{8087 + k // 55}")
            self.addresses.append(getattr(self, kind)[-1])
        self._thread: threading.Thread | None = None
        if self._listeners:
            self._thread = threading.Thread(target=self._accept, name="dead-seeds", daemon=True)
            self._thread.start()

    def _accept(self) -> None:
        sel = selectors.DefaultSelector()
        for s in self._listeners:
            sel.register(s, selectors.EVENT_READ)
        while not self._stop.is_set():
            for key, _ in sel.select(0.1):
                try:
                    conn, _ = key.fileobj.accept()  # type: ignore[union-attr]
                except OSError:
                    continue
                self._held.append(conn)  # held open, never read, never answered
        sel.close()

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(5)
        for s in self._held + self._listeners:
            s.close()
        self._held.clear()
        self._listeners.clear()

    def __enter__(self) -> DeadSeeds:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()
