"""Unauthenticated connection floods against a real agent stay bounded (issue 14, part 3).

One real ``viiwork-agent`` process with an open-trust mesh listener on 127.0.0.1 and no
models. The floods come from this process over loopback, from source addresses in
127.0.0.0/8 (Linux routes the whole block to ``lo``), so per-address caps can be told from
overall ones and a "normal" client on 127.0.0.1 is another party. Memory is the agent's own
figure: ``VmRSS`` at idle and ``VmHWM`` (the peak) from /proc/PID/status
(docs/security.md, "Connection floods"; figures in docs/reliability.md).
"""

from __future__ import annotations

import asyncio
import json
import re
import resource
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from support.agent import Agent, run_agent
from support.floods import connect_many, proc_status_kb

MESH = {"trust": "open", "mesh_id": "flood-mesh", "listen": "127.0.0.1:0", "advertise": "127.0.0.1",
        "discovery": ["seeds"], "seeds": []}


@pytest.fixture(autouse=True)
def many_descriptors() -> Iterator[None]:
    """13,000+ sockets here and as many in the agent (which inherits this limit and raises its
    own soft limit to the hard one: agent/serving/api_listener.py)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < 16_000:
        pytest.skip(f"RLIMIT_NOFILE hard limit {hard} < 16,000: cannot hold the floods' sockets")
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    yield
    resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def mesh_port(agent: Agent) -> int:
    doc = agent.wait_for(lambda d: bool(d["mesh"]["self"]["mesh"]), 30, "the mesh address")
    return int(doc["mesh"]["self"]["mesh"].rpartition(":")[2])


def api_port(agent: Agent) -> int:
    return int(agent.url.rpartition(":")[2])


async def read_some(sock: socket.socket, timeout_s: float) -> bytes:
    """What the server sent on ``sock`` until it closed (b"" on a reset), at most ``timeout_s``."""
    loop = asyncio.get_running_loop()
    data = b""
    try:
        async with asyncio.timeout(timeout_s):
            while True:
                chunk = await loop.sock_recv(sock, 65536)
                if not chunk:
                    return data
                data += chunk
    except (ConnectionError, OSError):
        return data


async def http_get(port: int, path: str, source: str = "127.0.0.1") -> tuple[int, dict[str, str], bytes]:
    """One HTTP/1.1 GET with ``Connection: close``: (status, headers, body)."""
    reader, writer = await asyncio.wait_for(asyncio.open_connection("127.0.0.1", port, local_addr=(source, 0)), 5)
    writer.write(f"GET {path} HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n".encode())
    raw = await asyncio.wait_for(reader.read(), 10)
    writer.close()
    head, _, body = raw.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = {k.strip().lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:])}
    return int(lines[0].split()[1]), headers, body


def close_all(socks: list[socket.socket]) -> None:
    for s in socks:
        s.close()


async def test_floods_keep_memory_bounded_and_other_clients_answered(tmp_path: Path) -> None:
    """8,000 silent connections to the mesh port (from 80 addresses) and 5,000 slowloris
    connections to the API (from one address): the agent's peak RSS stays within +50 MB of its
    idle figure, a client on another address is answered meanwhile, and the excess of each
    flood is refused and counted."""
    with run_agent(tmp_path, [], name="flood", extra={
            "mesh": MESH, "api": {"max_connections_per_address": 1000}}) as agent:
        mport, aport = mesh_port(agent), api_port(agent)
        for _ in range(20):  # warm the paths the flood and the checks use
            assert (await http_get(aport, "/v1/status"))[0] == 200
            assert (await http_get(aport, "/metrics"))[0] == 200
        idle_kb = proc_status_kb(agent.proc.pid, "VmRSS")
        held: list[socket.socket] = []
        try:
            held += await connect_many(mport, [f"127.0.1.{i}" for i in range(1, 81)], 100)
            assert len(held) == 8000
            slow = await connect_many(aport, ["127.0.0.2"], 5000, first=b"GET /health HTTP/1.1\r\nHost: localhost\r\n")
            held += slow
            status, _, body = await http_get(aport, "/v1/status")
            assert status == 200
            peak_kb = proc_status_kb(agent.proc.pid, "VmHWM")
            print(f"agent RSS idle {idle_kb} kB, peak {peak_kb} kB during the floods")
            assert peak_kb - idle_kb < 50 * 1024, f"RSS idle {idle_kb} kB, peak {peak_kb} kB"
            doc = json.loads(body)
            transport = doc["mesh"]["counters"]["transport"]
            # At most 64 pending at once; those that timed out (5 s) made room for more.
            assert transport.get("handshake_refused", 0) >= 7000, transport
            assert doc["api"]["refused_per_address"] >= 4000 - 50, doc["api"]
            # The refused ones were told why: a whole 503 with Retry-After.
            answers = await asyncio.gather(*(read_some(s, 5) for s in slow[-20:]))
            assert all(a.startswith(b"HTTP/1.1 503") and b"Retry-After: 1" in a and b"too_many_connections" in a
                       for a in answers), answers[:3]
            status, _, metrics = await http_get(aport, "/metrics")
            assert status == 200
            assert re.search(rb'^viiwork_api_connections_refused_total\{cap="max_connections_per_address"\} '
                             rb'(\d{4,})\.0$', metrics, re.M), metrics[-800:]
        finally:
            close_all(held)


async def test_slow_heads_are_closed_and_the_connection_cap_refuses(tmp_path: Path) -> None:
    """Silent and slowly dribbling request heads are closed (408) after api.head_timeout_s;
    beyond api.max_connections a new connection gets 503 + Retry-After; a stalled body gets
    408 after api.body_read_timeout_s; malformed requests are logged once per address per
    minute at WARNING (no traceback) and counted on /metrics."""
    with run_agent(tmp_path, [], name="heads", extra={
            "api": {"head_timeout_s": 3.0, "body_read_timeout_s": 1.0, "max_connections": 40}}) as agent:
        port = api_port(agent)
        loop = asyncio.get_running_loop()
        silent = await connect_many(port, ["127.0.0.2"], 30)
        dribblers = await connect_many(port, ["127.0.0.3"], 5, first=b"GET /health HTTP/1.1\r\n")
        started = time.monotonic()

        async def dribble(sock: socket.socket) -> None:
            # One header line every 0.3 s: never a whole head, never idle (until closed).
            with_errors = (ConnectionError, OSError)
            try:
                while time.monotonic() - started < 10:
                    await loop.sock_sendall(sock, b"X-Slow: 1\r\n")
                    await asyncio.sleep(0.3)
            except with_errors:
                return

        dribbling = [asyncio.create_task(dribble(s)) for s in dribblers]
        try:
            # 35 open: the last 5 (an eighth of 40) are kept for addresses holding fewer than
            # 4, so 4 more from a new address fit, the next ones are refused.
            more = await connect_many(port, ["127.0.0.4"], 8)
            answers = await asyncio.gather(*(read_some(s, 1.0) for s in more))
            refused = [a for a in answers if a.startswith(b"HTTP/1.1 503")]
            assert len(refused) == 4, answers
            assert b"Retry-After: 1" in refused[0] and b'"code": "too_many_connections"' in refused[0]
            assert b"api.max_connections = 40" in refused[0]
            # 39 open: one more from a fresh address takes the last place; then the total cap
            # itself refuses even an address that holds nothing.
            last = await connect_many(port, ["127.0.0.6"], 1)
            last += await connect_many(port, ["127.0.0.7"], 1)
            tail = await asyncio.gather(*(read_some(s, 0.5) for s in last))
            assert not tail[0] and tail[1].startswith(b"HTTP/1.1 503"), tail
            assert b"40 connections are open" in tail[1], tail[1]
            more += last
            # Every held connection is closed after the head deadline, dribblers included.
            closed = await asyncio.gather(*(read_some(s, 5.0) for s in silent + dribblers))
            assert all(a.startswith(b"HTTP/1.1 408") for a in closed), [a for a in closed if not a][:3]
            close_all(more)
            # Room again for others.
            await asyncio.sleep(0.2)
            status, _, body = await http_get(port, "/metrics")
            assert status == 200
            assert re.search(rb"^viiwork_api_head_timeouts_total (\d+)\.0$", body, re.M).group(1) >= b"35"
            # A body that stalls: 408 body_read_timeout.
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
                         b"Content-Length: 100\r\n\r\n{\"model\":")
            raw = await asyncio.wait_for(reader.read(4096), 5)
            writer.close()
            assert raw.startswith(b"HTTP/1.1 408") and b"body_read_timeout" in raw, raw
            # Malformed requests: counted; one WARNING for the address, no traceback.
            for _ in range(3):
                r, w = await asyncio.open_connection("127.0.0.1", port, local_addr=("127.0.0.5", 0))
                w.write(b"GET / HTTP/1.1\r\nHost: localhost\r\nContent-Length: -1\r\n\r\n")
                assert (await asyncio.wait_for(r.read(), 5)).split(b" ")[1] == b"400"
                w.close()
            status, _, body = await http_get(port, "/metrics")
            assert re.search(rb"^viiwork_http_malformed_requests_total 3\.0$", body, re.M), body[-600:]
            log = agent.log_text()
            warnings = [line for line in log.splitlines() if "WARNING aiohttp.server" in line and "127.0.0.5" in line]
            assert len(warnings) == 1, warnings
            assert "Traceback" not in log
        finally:
            for task in dribbling:
                task.cancel()
            await asyncio.gather(*dribbling, return_exceptions=True)
            close_all(silent + dribblers)


async def test_dribbled_bodies_from_a_few_addresses_leave_room_and_time_out(tmp_path: Path) -> None:
    """Request bodies sent a byte at a time, each byte just within api.body_read_timeout_s,
    from 10 addresses x 30 connections (300 > api.max_connections = 200): the flood fills at
    most the unreserved 7/8 plus 4 per address of the reserve, so a client on 127.0.0.1 is
    answered throughout, and each dribbled body gets 408 once api.body_timeout_s has passed."""
    with run_agent(tmp_path, [], name="bodies", extra={"api": {
            "body_read_timeout_s": 1.0, "body_timeout_s": 2.5, "max_connections": 200,
            "max_connections_per_address": 30}}) as agent:
        port = api_port(agent)
        loop = asyncio.get_running_loop()
        head = (b"POST /v1/chat/completions HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
                b"Content-Length: 1000000\r\n\r\n{")
        held = await connect_many(port, [f"127.0.1.{i}" for i in range(1, 11)], 30, first=head)
        started = time.monotonic()

        async def dribble(sock: socket.socket) -> bytes:
            answer = b""
            try:
                while time.monotonic() - started < 8 and not answer:
                    await loop.sock_sendall(sock, b" ")
                    try:
                        answer = await asyncio.wait_for(loop.sock_recv(sock, 4096), 0.5)
                    except TimeoutError:
                        continue
                    if not answer:
                        return b"closed"
            except OSError:
                return b"error"
            return answer

        dribbling = [asyncio.create_task(dribble(s)) for s in held]
        try:
            for _ in range(4):  # a client on another address is answered while the flood lasts
                status, _, _ = await http_get(port, "/v1/status")
                assert status == 200
                await asyncio.sleep(0.3)
            answers = await asyncio.gather(*dribbling)
            admitted = [a for a in answers if not a.startswith(b"HTTP/1.1 503")]
            # 175 unreserved (5 addresses x 30, 25 from the 6th), then 4 each from the last 4.
            assert len(admitted) == 175 + 4 * 4, len(admitted)
            assert all(a.startswith(b"HTTP/1.1 408") and b"api.body_timeout_s" in a for a in admitted), \
                [a[:120] for a in admitted if not a.startswith(b"HTTP/1.1 408")][:3]
            assert time.monotonic() - started < 8
        finally:
            for task in dribbling:
                task.cancel()
            await asyncio.gather(*dribbling, return_exceptions=True)
            close_all(held)
