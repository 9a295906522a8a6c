"""A relay in front of a D-Bus socket that can hold the bus's answers: it stands for a slow
systemd (a busy PID 1 answers D-Bus calls late), which a test needs to widen a window that
is otherwise milliseconds wide.

The relay listens on a Unix socket of its own (:attr:`DbusRelay.address`, a D-Bus address
for an agent's ``bus_address``) and passes bytes both ways to the real bus. Once a message
from a client contains every one of ``hold_on`` (D-Bus names a call's method and carries its
string arguments in plain bytes), the bus's answers to that client are held for ``hold_s``
seconds, once; :attr:`DbusRelay.held_at` then says when (``time.monotonic()``). Each byte
still arrives, in order. Plain threads: the relay runs beside a test's blocking calls.
"""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from pathlib import Path
from types import TracebackType

CHUNK = 65536
#: How much of a client's stream is kept to match ``hold_on`` across reads.
TAIL = 4096


class DbusRelay:
    def __init__(self, bus: Path, path: Path, hold_on: tuple[bytes, ...], hold_s: float) -> None:
        self.bus, self.path, self.hold_on, self.hold_s = bus, path, hold_on, hold_s
        self.held_at: float | None = None
        self._hold_until = 0.0
        self._lock = threading.Lock()
        self._sockets: list[socket.socket] = []
        self._threads: list[threading.Thread] = []
        self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)

    @property
    def address(self) -> str:
        return f"unix:path={self.path}"

    def __enter__(self) -> DbusRelay:
        self._listener.bind(str(self.path))
        self._listener.listen(16)
        self._spawn(self._accept)
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self._listener.close()
        with self._lock:
            sockets = list(self._sockets)
        for sock in sockets:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
            sock.close()
        for thread in self._threads:
            thread.join(5)
        self.path.unlink(missing_ok=True)

    def _spawn(self, target: object, *args: object) -> None:
        thread = threading.Thread(target=target, args=args, daemon=True)  # type: ignore[arg-type]
        self._threads.append(thread)
        thread.start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return  # closed
            upstream = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            upstream.connect(str(self.bus))
            with self._lock:
                self._sockets += [client, upstream]
            self._spawn(self._from_client, client, upstream)
            self._spawn(self._from_bus, upstream, client)

    def _from_client(self, src: socket.socket, dst: socket.socket) -> None:
        tail = b""
        while data := _read(src):
            tail = (tail + data)[-TAIL:]
            if self.held_at is None and all(word in tail for word in self.hold_on):
                self.held_at = time.monotonic()
                self._hold_until = self.held_at + self.hold_s
            if not _write(dst, data):
                break
        _close(dst)

    def _from_bus(self, src: socket.socket, dst: socket.socket) -> None:
        while data := _read(src):
            time.sleep(max(0.0, self._hold_until - time.monotonic()))
            if not _write(dst, data):
                break
        _close(dst)


def _read(sock: socket.socket) -> bytes:
    try:
        return sock.recv(CHUNK)
    except OSError:
        return b""


def _write(sock: socket.socket, data: bytes) -> bool:
    try:
        sock.sendall(data)
    except OSError:
        return False
    return True


def _close(sock: socket.socket) -> None:
    with contextlib.suppress(OSError):
        sock.shutdown(socket.SHUT_WR)
