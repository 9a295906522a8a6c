"""Attacks on probe mode's channels (mesh/probe_transport.py) by a member of an open mesh
that is no node of the table: a channel opened and never read, from either end.

In-process ``MeshNode``s on 127.0.0.1 (open trust); the attacker is a raw TLS socket that
upgrades to a WebSocket by hand (or answers this node's upgrade), so it can stop reading
(aiohttp's client reads on its own).
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import os
import socket
import ssl
import struct
import threading
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import pytest
from aiohttp import web

from support.mesh_nodes import loopback_settings, outsider_tls, probe_pair, probe_wire, wait_for
from viiwork.mesh.identity import load_or_create_identity
from viiwork.mesh.messages import Ping, Pull
from viiwork.mesh.node import MeshNode
from viiwork.mesh.probe_codec import encode_probe_message
from viiwork.mesh.probe_transport import CHANNEL_QUEUE, PROBE_PATH
from viiwork.mesh.ratelimit import PeerRateLimiter
from viiwork.mesh.summary import PROTOCOL_VERSION
from viiwork.mesh.tls import peer_node_id

MESH = "lab"
pytestmark = pytest.mark.timeout(60)


def frame(payload: bytes) -> bytes:
    """One masked binary WebSocket frame (RFC 6455 5.2)."""
    mask = os.urandom(4)
    n = len(payload)
    head = bytes([0x82]) + (bytes([0x80 | n]) if n < 126 else bytes([0x80 | 126]) + struct.pack("!H", n))
    return head + mask + bytes(b ^ mask[i % 4] for i, b in enumerate(payload))


def open_raw_channel(ctx: ssl.SSLContext, port: int) -> ssl.SSLSocket:
    """A probe channel to 127.0.0.1:``port`` upgraded by hand; the caller then never reads."""
    raw = socket.socket()
    raw.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # before connect: a small window
    raw.settimeout(5)
    raw.connect(("127.0.0.1", port))
    sock = ctx.wrap_socket(raw, server_hostname="127.0.0.1")
    key = base64.b64encode(os.urandom(16)).decode()
    sock.sendall((f"GET {PROBE_PATH} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nUpgrade: websocket\r\n"
                  f"Connection: Upgrade\r\nSec-WebSocket-Key: {key}\r\nSec-WebSocket-Version: 13\r\n\r\n").encode())
    head = b""
    while b"\r\n\r\n" not in head:
        head += sock.recv(1)
    assert head.startswith(b"HTTP/1.1 101"), head
    return sock


def served_peers(node: MeshNode) -> list[str | None]:
    """The nodes whose channels ``node`` serves (by their TLS certificates)."""
    return [None if t is None else peer_node_id(t.get_extra_info("ssl_object")) for t in probe_wire(node)._served.values()]


@pytest.fixture
async def pair(tmp_path: Path) -> AsyncIterator[tuple[MeshNode, MeshNode]]:
    async with probe_pair(tmp_path, MESH) as nodes:
        yield nodes


async def flood_unread(a: MeshNode, b: MeshNode, tmp_path: Path, until: Callable[[], bool]) -> ssl.SSLSocket:
    """A forger's channel to ``a``: pulls for both summaries, whose answers (a push of two
    summaries each) it never reads, until ``until()`` (at most 30 s). At the rate limit (100
    frames a second) the socket buffers fill in about 20 s: ``a`` takes 2,000 a second here."""
    probe_wire(a)._limiter = PeerRateLimiter(2000.0, 4000.0, max_buckets=16)
    pull = encode_probe_message(Pull(PROTOCOL_VERSION, MESH, {a.membership.node_id: (0, 0),  # type: ignore[union-attr]
                                                              b.membership.node_id: (0, 0)}))  # type: ignore[union-attr]
    sock = await asyncio.to_thread(open_raw_channel, outsider_tls(tmp_path / "forger", MESH), a.listen_port)
    sock.settimeout(1.0)
    deadline = time.monotonic() + 30
    try:
        while time.monotonic() < deadline and not until():
            await asyncio.to_thread(sock.sendall, frame(pull) * 100)
            await asyncio.sleep(0.1)
    except (TimeoutError, OSError):  # a stopped reading (its handler waits on its answers), or closed it
        pass
    return sock


async def test_a_channel_whose_answers_are_never_read_is_closed(pair, tmp_path):
    """Before: the handler waited forever to write its answers (the listener's idle timeout
    is on reading), so it held the connection with no traffic at all."""
    a, b = pair
    counters = a.membership.counters.transport  # type: ignore[union-attr]
    forger = load_or_create_identity(tmp_path / "forger").node_id
    sock = await flood_unread(a, b, tmp_path, lambda: counters["channel_stalled"] >= 1)
    try:
        await wait_for(lambda: counters["channel_stalled"] >= 1, 10, "the stalled channel to be counted")
        await wait_for(lambda: forger not in served_peers(a), 10, "the stalled channel to close")
    finally:
        sock.close()


async def test_a_channel_that_is_never_read_does_not_hold_the_node_at_stop(pair, tmp_path):
    """Before: stop() waited forever for its closing frame to go (a graceful stop of the
    agent then hung until systemd killed it)."""
    a, b = pair
    probe_wire(a).timeout_s = 60.0  # the handler is still waiting on its answers when stop comes
    pushes: list[int] = []  # the pushes a answered with, every 0.1 s: the same for 1 s once its writes wait

    def writes_wait() -> bool:
        pushes.append(a.membership.counters.messages_out["push"])  # type: ignore[union-attr]
        return len(pushes) > 10 and pushes[-11] == pushes[-1] > 0

    sock = await flood_unread(a, b, tmp_path, writes_wait)
    try:
        assert load_or_create_identity(tmp_path / "forger").node_id in served_peers(a)
        probe_wire(a).timeout_s = 1.0
        await asyncio.wait_for(a.stop(leave=False), 20)
    finally:
        sock.close()


async def test_a_channel_this_node_opened_to_a_peer_that_never_reads_does_not_hold_its_stop(pair, tmp_path):
    """The client side: a member this node opened a channel to (it probes it, gossips to it)
    sends pulls on it and never reads the pushes this node answers with; this node's writes
    then wait for room, and stop() waited forever for the channel's closing frame."""
    a, b = pair
    probe_wire(a)._limiter = PeerRateLimiter(2000.0, 4000.0, max_buckets=16)
    pull = encode_probe_message(Pull(PROTOCOL_VERSION, MESH, {a.membership.node_id: (0, 0),  # type: ignore[union-attr]
                                                              b.membership.node_id: (0, 0)}))  # type: ignore[union-attr]
    ctx = outsider_tls(tmp_path / "forger", MESH, server=True)
    listener = socket.socket()
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # inherited by the accepted socket: a small window
    listener.bind(("127.0.0.1", 0))
    listener.listen(1)
    stop_flood = threading.Event()

    def serve() -> None:
        conn, _ = listener.accept()
        sock = ctx.wrap_socket(conn, server_side=True)
        head = b""
        while b"\r\n\r\n" not in head:
            head += sock.recv(1)
        key = next(line.split(b":", 1)[1].strip() for line in head.split(b"\r\n")
                   if line.lower().startswith(b"sec-websocket-key"))
        accept = base64.b64encode(hashlib.sha1(key + b"258EAFA5-E914-47DA-95CA-C5AB0DC85B11").digest())
        sock.sendall(b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
                     b"Sec-WebSocket-Accept: " + accept + b"\r\n\r\n")
        unmasked = bytes([0x82, 126]) + struct.pack("!H", len(pull)) + pull if len(pull) >= 126 \
            else bytes([0x82, len(pull)]) + pull
        sock.settimeout(1.0)
        try:
            while not stop_flood.is_set():
                sock.sendall(unmasked * 100)
                time.sleep(0.05)
        except OSError:
            pass
        stop_flood.wait(60)
        sock.close()

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        address = f"127.0.0.1:{listener.getsockname()[1]}"
        probe_wire(a).send([(address, Ping(PROTOCOL_VERSION, MESH, 1, ()))])  # this node opens the channel
        full: list[bool] = []  # the channel's queue full, every 0.1 s: full for 1 s once its writes wait

        def writes_wait() -> bool:
            channel = probe_wire(a)._channels.get(address)
            full.append(channel is not None and len(channel.queue) >= CHANNEL_QUEUE)
            return len(full) > 10 and all(full[-10:])

        await wait_for(writes_wait, 30, "this node's writes to wait for room", poll_s=0.1)
        assert address in probe_wire(a).channels
        await asyncio.wait_for(a.stop(leave=False), 20)
    finally:
        stop_flood.set()
        listener.close()
        await asyncio.to_thread(thread.join, 10)


async def test_a_member_that_never_answers_costs_one_new_channel_per_timeout(tmp_path: Path) -> None:
    """A member that takes the channel and never answers a ping on it (a mute peer: TLS and
    the upgrade done, nothing written back, its closing frame never sent either): every ping
    to it goes unanswered and the core reports each (``on_unanswered``, here every 0.1 s, at
    the rate of a relay's pings a member can ask for). A channel that brought nothing for
    ``timeout_s`` is dropped (docs/mesh.md, "Partitions heal"), but a new one counts as having
    brought something when it opened, so such a peer costs one new connection per
    ``timeout_s``, not one per unanswered ping, and the dropped ones are closed."""
    served: list[web.WebSocketResponse] = []

    async def mute(request: web.Request) -> web.WebSocketResponse:
        ws = web.WebSocketResponse(autoclose=False, autoping=False)
        await ws.prepare(request)
        served.append(ws)
        await asyncio.sleep(60)  # reads nothing, answers nothing
        return ws

    app = web.Application()
    app.router.add_get(PROBE_PATH, mute)
    runner = web.AppRunner(app, handler_cancellation=True)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0, ssl_context=outsider_tls(tmp_path / "forger", MESH, server=True))
    await site.start()
    a = MeshNode(loopback_settings(tmp_path / "a", "a", trust="open", mesh_id=MESH))  # no peers: its own probes open nothing
    await a.start()
    try:
        wire = probe_wire(a)
        address = f"127.0.0.1:{runner.addresses[0][1]}"
        started = time.monotonic()
        for i in range(25):  # 2.5 s of unanswered pings
            wire.send([(address, Ping(PROTOCOL_VERSION, MESH, 100 + i, ()))])
            await asyncio.sleep(0.1)
            wire.reset(address)
        elapsed = time.monotonic() - started
        counters = wire.counters
        assert 1 <= counters["channels_reset"] <= elapsed / wire.timeout_s + 1, dict(counters)
        assert counters["channels_opened"] <= counters["channels_reset"] + 1, dict(counters)
        # The dropped channels go once read for timeout_s: only the last one or two are open.
        await wait_for(lambda: counters["channels_closed"] >= counters["channels_reset"] - 1, 5,
                       "the dropped channels to close")
    finally:
        await a.stop(leave=False)
        await runner.cleanup()
