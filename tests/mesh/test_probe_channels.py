"""Probe mode's channels (mesh/probe_transport.py): one WebSocket per peer on the mutual-TLS
listener, bounded in number, in queued frames and in idle time.

In-process ``MeshNode``s on 127.0.0.1 (open trust); the peers that never answer are TCP
listeners that accept and never speak TLS (a remote party that froze or is not a node).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import pytest

from support.mesh_nodes import loopback_settings, outsider_tls, probe_pair, probe_wire, wait_for
from viiwork.mesh.messages import Ping
from viiwork.mesh.node import MeshNode
from viiwork.mesh.probe_codec import encode_probe_message
from viiwork.mesh.probe_transport import CHANNEL_QUEUE, PROBE_PATH
from viiwork.mesh.summary import PROTOCOL_VERSION

MESH = "lab"


def ping(i: int) -> Ping:
    return Ping(PROTOCOL_VERSION, MESH, i, ())


class Holes(list[str]):
    """Addresses that accept TCP and never answer; ``hung_up`` holds those whose caller closed."""

    connected: set[str]
    hung_up: set[str]


@pytest.fixture
async def pair(tmp_path: Path) -> AsyncIterator[tuple[MeshNode, MeshNode]]:
    async with probe_pair(tmp_path, MESH) as nodes:
        yield nodes


@pytest.fixture
async def holes() -> AsyncIterator[Holes]:
    """Three addresses that accept TCP and never answer."""
    held: list[asyncio.StreamWriter] = []
    found = Holes()
    found.connected, found.hung_up = set(), set()

    async def swallow(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        held.append(writer)
        host, port = writer.get_extra_info("sockname")[:2]
        found.connected.add(f"{host}:{port}")
        while await reader.read(65536):  # what the caller sends (a TLS hello) is never answered
            pass
        found.hung_up.add(f"{host}:{port}")

    servers = [await asyncio.start_server(swallow, "127.0.0.1", 0) for _ in range(3)]
    found.extend(f"127.0.0.1:{s.sockets[0].getsockname()[1]}" for s in servers)
    try:
        yield found
    finally:
        for w in held:
            w.close()
        for s in servers:
            s.close()
            await s.wait_closed()


async def test_a_peers_messages_share_one_channel_and_an_idle_channel_is_closed(pair, tmp_path):
    a, b = pair
    counters = a.membership.counters.transport  # type: ignore[union-attr]
    before = counters["probe_ok"]
    # a's pings to b (2 a second) and b's acks, read on the channel a opened
    await wait_for(lambda: counters["probe_ok"] >= before + 3, 10, "a few of b's answers on a's channel")
    assert probe_wire(a).channels == [f"127.0.0.1:{b.listen_port}"]
    assert counters["channels_opened"] == 1, dict(counters)  # every frame on the one channel
    assert counters["probe_sent"] >= 3
    # A node this one sends one message and nothing after: its channel closes once idle.
    c = MeshNode(loopback_settings(tmp_path / "c", "c", trust="open", mesh_id=MESH))
    await c.start()
    try:
        probe_wire(a).idle_s = 0.5
        c_address = f"127.0.0.1:{c.listen_port}"
        probe_wire(a).send([(c_address, ping(10_001))])
        await wait_for(lambda: counters["channels_opened"] == 2, 5, "a channel to c")
        await wait_for(lambda: c_address not in probe_wire(a).channels, 5, "the idle channel to c to close")
        assert counters["channels_closed"] >= 1
    finally:
        await c.stop(leave=False)


async def test_frames_for_a_peer_that_never_answers_are_bounded_and_dropped(pair, holes):
    a, _ = pair
    counters = a.membership.counters.transport  # type: ignore[union-attr]
    hole = holes[0]
    probe_wire(a).send([(hole, ping(i)) for i in range(CHANNEL_QUEUE + 6)])
    assert counters["probe_skipped_busy"] == 6  # the queue holds CHANNEL_QUEUE while the channel opens
    assert hole in probe_wire(a).channels
    # The handshake never ends: after the open's deadline (1 s) the channel and its frames are gone.
    await wait_for(lambda: hole not in probe_wire(a).channels, 5, "the channel that never opened to go")
    assert counters["probe_timeout"] + counters["probe_failed"] >= 1
    assert counters["channels_opened"] == 1  # only b's


async def test_channels_are_capped_and_the_least_recently_used_goes_first(tmp_path, holes):
    a = MeshNode(loopback_settings(tmp_path / "a", "a", trust="open", mesh_id=MESH))  # no peers: its own
    await a.start()                                                                    # probes open nothing
    try:
        transport = probe_wire(a)
        transport.max_channels = 2
        transport.send([(holes[0], ping(1))])
        transport.send([(holes[1], ping(2))])
        assert transport.channels == [holes[0], holes[1]]
        await wait_for(lambda: holes.connected == {holes[0], holes[1]}, 5, "both channels to connect")
        transport.send([(holes[0], ping(3))])  # holes[0] is now the most recently used
        transport.send([(holes[2], ping(4))])
        assert transport.channels == [holes[0], holes[2]]
        # The channel recycled is closed, its frame dropped and counted; the others stay open.
        await wait_for(lambda: holes[1] in holes.hung_up, 5, "the recycled channel's connection to close")
        assert holes.hung_up == {holes[1]}
        assert a.membership.counters.transport["probe_dropped"] >= 1  # type: ignore[union-attr]
    finally:
        await a.stop(leave=False)



async def test_a_channel_never_negotiates_compression(pair, tmp_path):
    """permessage-deflate (aiohttp's default on both ends) would hold a zlib compressor and
    decompressor per channel: measured ~107 KiB more per channel on a real node (120 forged
    channels: +45.7 MiB RSS against +33.2 MiB), beyond the listener's per-connection bound
    (docs/security.md), and CPU for frames of a few hundred bytes."""
    a, b = pair
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(ssl=outsider_tls(tmp_path / "forger", MESH))) as s:
        async with s.ws_connect(f"https://127.0.0.1:{a.listen_port}{PROBE_PATH}", compress=15) as ws:
            assert ws.compress == 0  # the node answered the offer without the extension
            await ws.send_bytes(encode_probe_message(ping(5)))
            answer = await ws.receive(timeout=5)
            assert answer.type == aiohttp.WSMsgType.BINARY  # the channel works, uncompressed
    # The nodes' own channels do not ask for it either: the one a opened to b, as b serves it.
    await wait_for(lambda: len(probe_wire(b)._served) >= 1, 5, "a's channel to b")
    assert [ws.compress for ws in probe_wire(b)._served] == [0]


async def test_an_unanswered_ping_keeps_a_channel_that_brought_something_lately(tmp_path: Path) -> None:
    """The core reports a ping unanswered in its timeout (``on_unanswered``); the channel it
    went on is dropped only when it brought nothing for ``timeout_s`` (a connection that
    lived through a partition: tests/mesh/test_partition_heal.py). One that brought an ack
    just now belongs to a slow peer, not a cut-off one: it is kept, as no new handshake
    would make the next answer come sooner."""
    async with probe_pair(tmp_path, "reset-mesh") as (a, b):
        wire = probe_wire(a)
        address = f"127.0.0.1:{b.listen_port}"
        await wait_for(lambda: address in wire.channels and time.monotonic() - wire._channels[address].read_at < 0.2,
                       10, "an answer on a's channel to b just now")
        wire.reset(address)
        assert address in wire.channels and wire.counters.get("channels_reset", 0) == 0
