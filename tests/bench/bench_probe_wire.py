"""Probe mode's wire (issue 16): one ping's round trip over the mutual-TLS mesh listener.

Two real ``MeshNode``s in probe mode (``detector = "probe"``, open trust, seeds on
127.0.0.1) in this process; once both hold each other alive, node A's client sends
``--pings`` pings to B's ``POST /mesh/v1/probe`` one after the other (80 a second, under
the listener's per-peer rate limit), on a kept-alive connection (a pooled session like the
transport's), and B answers each with its ack in the response. Measured:

- round trip p50 / p99 / max (ms): from the request to the ack read, client side (what the
  detector's ``probe_timeout_ms``, 200 ms, must cover);
- bytes on the wire per round trip, both directions (TCP payload: TLS records, HTTP heads,
  the JSON): through a counting TCP relay in front of B, over a second run of the same
  pings, against the JSON alone (the message sizes the simulator counts);
- the first ping on a new connection (TCP + TLS handshake, mutual certificates), which
  a node pays once per peer per keep-alive period (30 s).

Both nodes run their own probing meanwhile (a ping each way every 500 ms): the figures
include that background, as a live mesh would.

Usage: .venv/bin/python tests/bench/bench_probe_wire.py [--pings 1000]
"""

from __future__ import annotations

import argparse
import asyncio
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


async def pings(session: aiohttp.ClientSession, url: str, node_id: str, n: int) -> tuple[list[float], int, int]:
    """Round trips (ms), request JSON bytes and answer JSON bytes of ``n`` pings."""
    times, sent, got = [], 0, 0
    for i in range(n):
        body = encode_any(Ping(PROTOCOL_VERSION, MESH_ID, i + 1, ()))
        started = time.perf_counter()
        async with session.post(url, data=body, headers=expect_node(node_id)) as resp:
            answer = await resp.read()
        times.append((time.perf_counter() - started) * 1000.0)
        await asyncio.sleep(PACE_S)  # under the listener's per-peer rate (PROBE_RATE_PER_S)
        assert resp.status == 200 and b'"type":"ack"' in answer, (resp.status, answer[:200])
        sent, got = sent + len(body), got + len(answer)
    return times, sent, got


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
            async with aiohttp.ClientSession(**peer_session_parts(ctx, limit=4, keepalive_timeout=30)) as session:
                url = f"https://127.0.0.1:{b.listen_port}{PROBE_PATH}"
                started = time.perf_counter()
                await pings(session, url, b.node_id, 1)
                first_ms = (time.perf_counter() - started) * 1000.0
                times, sent, got = await pings(session, url, b.node_id, n)
            relay_port = await relay.start()
            async with aiohttp.ClientSession(**peer_session_parts(ctx, limit=4, keepalive_timeout=30)) as session:
                url = f"https://127.0.0.1:{relay_port}{PROBE_PATH}"
                await pings(session, url, b.node_id, 1)
                up0, down0 = relay.up, relay.down
                _, _, _ = await pings(session, url, b.node_id, n)
                up, down = relay.up - up0, relay.down - down0
        finally:
            await relay.stop()
            await a.stop()
            await b.stop()
    print(f"ping round trip over mutual TLS on 127.0.0.1, {n} pings, kept-alive connection:")
    print("| figure | value |")
    print("|---|---|")
    print(f"| round trip p50 / p99 / max | {pct(times, 0.5):.2f} / {pct(times, 0.99):.2f} / {max(times):.2f} ms |")
    print(f"| first ping on a new connection (TCP + mutual TLS handshake) | {first_ms:.1f} ms |")
    print(f"| bytes on the wire per round trip (request / answer) | {up / n:.0f} / {down / n:.0f} |")
    print(f"| of which JSON (ping / ack, no news) | {sent / n:.0f} / {got / n:.0f} |")
    return 0


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--pings", type=int, default=1000)
    sys.exit(asyncio.run(main(ap.parse_args().pings)))
