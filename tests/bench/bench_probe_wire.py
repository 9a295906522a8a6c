"""Probe mode's wire (issue 16): one ping's round trip over the mutual-TLS mesh listener.

Two real ``MeshNode``s in probe mode (``detector = "probe"``, open trust, seeds on
127.0.0.1) in this process; once both hold each other alive, node A's certificate opens a
channel to B (``GET /mesh/v1/probe`` upgraded to a WebSocket, as the transport does) and
sends ``--pings`` pings as frames one after the other (80 a second, under the channel's
per-peer rate limit); B answers each with its ack on the channel. Measured:

- round trip p50 / p99 / max (ms): from the frame written to the ack read, client side
  (what the detector's ``probe_timeout_ms``, 200 ms, must cover);
- bytes on the wire per round trip, both directions (TCP payload: TLS records, WebSocket
  framing, the JSON): through a counting TCP relay in front of B, over a second run of the
  same pings, against the JSON alone (the message sizes the simulator counts);
- opening a channel (TCP + mutual TLS handshake + the upgrade), which a node pays once per
  peer while it keeps talking to it (an idle channel closes after 30 s).

Both nodes run their own probing meanwhile (a ping each way every 500 ms): the figures
include that background, as a live mesh would.

Usage: .venv/bin/python tests/bench/bench_probe_wire.py [--pings 1000]
"""

from __future__ import annotations

import argparse
import asyncio
import ssl
import sys
import tempfile
import time
from pathlib import Path

import aiohttp

from viiwork.mesh.dialing import expect_node, peer_session_parts
from viiwork.mesh.messages import Ping
from viiwork.mesh.node import MeshNode, MeshSettings
from viiwork.mesh.probe_codec import encode_any
from viiwork.mesh.probe_transport import PROBE_PATH
from viiwork.mesh.summary import PROTOCOL_VERSION, ModelCapacity, PublishedState

MESH_ID = "bench-probe-wire"
PACE_S = 0.0125  # 80 pings/s


def pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, max(0, int(round(q * (len(values) - 1)))))]


class CountingRelay:
    """A TCP relay on 127.0.0.1 that counts the bytes it carries each way."""

    def __init__(self, target_port: int) -> None:
        self.target_port = target_port
        self.up = 0
        self.down = 0
        self.server: asyncio.Server | None = None

    async def start(self) -> int:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        return int(self.server.sockets[0].getsockname()[1])

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.target_port)

        async def pipe(src: asyncio.StreamReader, dst: asyncio.StreamWriter, up: bool) -> None:
            try:
                while data := await src.read(65536):
                    if up:
                        self.up += len(data)
                    else:
                        self.down += len(data)
                    dst.write(data)
                    await dst.drain()
            except (ConnectionError, OSError):
                pass
            finally:
                dst.close()

        await asyncio.gather(pipe(reader, up_writer, True), pipe(up_reader, writer, False))

    async def stop(self) -> None:
        if self.server is not None:
            self.server.close()
            await self.server.wait_closed()


def node(tmp: Path, name: str, seeds: tuple[str, ...]) -> MeshNode:
    settings = MeshSettings(state_dir=tmp / name, name=name, trust="open", mesh_id=MESH_ID, listen="127.0.0.1:0",
                            advertise="127.0.0.1", api_listen="127.0.0.1:1", discovery=("seeds",), seeds=seeds,
                            version="bench", detector="probe")
    model = ModelCapacity(f"m-{name}", "llamacpp", "chat", 4, 0, None, 4096, 1, 1, None)
    return MeshNode(settings, provider=lambda: ([model], PublishedState.SERVING))


async def pings(ws: aiohttp.ClientWebSocketResponse, n: int, first_id: int) -> tuple[list[float], int, int]:
    """Round trips (ms), ping JSON bytes and ack JSON bytes of ``n`` pings on channel ``ws``."""
    times, sent, got = [], 0, 0
    for i in range(n):
        body = encode_any(Ping(PROTOCOL_VERSION, MESH_ID, first_id + i, ()))
        started = time.perf_counter()
        await ws.send_bytes(body)
        while True:  # the ack to this ping (an answer to an earlier one may come first)
            msg = await ws.receive(timeout=5)
            assert msg.type == aiohttp.WSMsgType.BINARY, msg
            if b'"type":"ack"' in msg.data and f'"id":{first_id + i},'.encode() in msg.data:
                break
        times.append((time.perf_counter() - started) * 1000.0)
        await asyncio.sleep(PACE_S)  # under the channel's per-peer rate (PROBE_RATE_PER_S)
        sent, got = sent + len(body), got + len(msg.data)
    return times, sent, got


async def channel_pings(ctx: ssl.SSLContext, port: int, node_id: str, n: int,
                        relay: CountingRelay | None = None) -> tuple[float, list[float], int, int, int, int]:
    """Open a channel to 127.0.0.1:``port`` (B, or the relay in front of it), ping once, then
    ``n`` times: (open + first ping ms, round trips, JSON out, JSON in, wire out, wire in)."""
    async with aiohttp.ClientSession(**peer_session_parts(ctx)) as session:
        started = time.perf_counter()
        async with session.ws_connect(f"https://127.0.0.1:{port}{PROBE_PATH}", headers=expect_node(node_id)) as ws:
            await pings(ws, 1, 1)
            first_ms = (time.perf_counter() - started) * 1000.0
            up0, down0 = (relay.up, relay.down) if relay is not None else (0, 0)
            times, sent, got = await pings(ws, n, 2)
            up, down = (relay.up - up0, relay.down - down0) if relay is not None else (0, 0)
    return first_ms, times, sent, got, up, down


async def main(n: int) -> int:
    with tempfile.TemporaryDirectory() as tmpdir:
        tmp = Path(tmpdir)
        b = node(tmp, "b", ())
        await b.start()
        a = node(tmp, "a", (f"127.0.0.1:{b.listen_port}",))
        await a.start()
        relay = CountingRelay(int(b.listen_port or 0))
        try:
            deadline = time.monotonic() + 20
            while not (any(p.node_id == b.node_id and p.liveness.value == "alive" for p in a.peers())
                       and any(p.node_id == a.node_id and p.liveness.value == "alive" for p in b.peers())):
                if time.monotonic() > deadline:
                    print("the two nodes did not meet within 20 s", file=sys.stderr)
                    return 1
                await asyncio.sleep(0.1)
            assert a.client_ssl_context is not None
            ctx = a.client_ssl_context
            first_ms, times, sent, got, _, _ = await channel_pings(ctx, int(b.listen_port or 0), b.node_id, n)
            relay_port = await relay.start()
            _, _, _, _, up, down = await channel_pings(ctx, relay_port, b.node_id, n, relay)
        finally:
            await relay.stop()
            await a.stop()
            await b.stop()
    print(f"ping round trip over mutual TLS on 127.0.0.1, {n} pings on one channel (WebSocket):")
    print("| figure | value |")
    print("|---|---|")
    print(f"| round trip p50 / p99 / max | {pct(times, 0.5):.2f} / {pct(times, 0.99):.2f} / {max(times):.2f} ms |")
    print(f"| first ping on a new channel (TCP + mutual TLS handshake + upgrade) | {first_ms:.1f} ms |")
    print(f"| bytes on the wire per round trip (request / answer) | {up / n:.0f} / {down / n:.0f} |")
    print(f"| of which JSON (ping / ack, no news) | {sent / n:.0f} / {got / n:.0f} |")
    return 0


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--pings", type=int, default=1000)
    sys.exit(asyncio.run(main(ap.parse_args().pings)))
