"""Connection floods for the flood tests and benchmark (tests/unit/test_connection_floods.py,
tests/bench/bench_floods.py): many idle TCP connections from chosen loopback addresses, and a
process's memory figures."""

from __future__ import annotations

import asyncio
import re
import socket
from pathlib import Path


def proc_status_kb(pid: int, field: str) -> int:
    """``field`` (``VmRSS``, ``VmHWM``) of /proc/``pid``/status, in kB."""
    match = re.search(rf"^{field}:\s+(\d+) kB", Path(f"/proc/{pid}/status").read_text(), re.M)
    assert match, f"no {field} in /proc/{pid}/status"
    return int(match.group(1))


async def connect_many(port: int, sources: list[str], per_source: int, first: bytes = b"",
                       batch: int = 100) -> list[socket.socket]:
    """``per_source`` TCP connections from each source address to 127.0.0.1:``port``, each
    sending ``first`` (if any) and then nothing, ``batch`` at a time (under the listen backlog:
    no SYN retransmits). Returns the sockets, refused ones included (their RST can land before
    the send); the caller closes them."""
    loop = asyncio.get_running_loop()

    async def one(src: str) -> socket.socket:
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setblocking(False)
        try:
            sock.bind((src, 0))
            await asyncio.wait_for(loop.sock_connect(sock, ("127.0.0.1", port)), 10)
            if first:
                await loop.sock_sendall(sock, first)
        except OSError:
            pass
        return sock

    plan = [src for src in sources for _ in range(per_source)]
    out: list[socket.socket] = []
    for i in range(0, len(plan), batch):
        out += await asyncio.gather(*(one(src) for src in plan[i:i + batch]))
    return out
