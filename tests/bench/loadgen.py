"""A small asyncio load generator shared by the benchmarks: latency and streamed-chunk rates.

One client for every system measured, so its own cost cancels out in the comparisons.
"""

from __future__ import annotations

import asyncio
import json
import statistics
import time
from dataclasses import dataclass, field

import aiohttp


@dataclass
class Sample:
    ttfb_s: float
    total_s: float
    chunks: int


@dataclass
class Series:
    name: str
    samples: list[Sample] = field(default_factory=list)
    errors: int = 0
    wall_s: float = 0.0

    def pct(self, attr: str, q: float) -> float:
        values = sorted(getattr(s, attr) for s in self.samples)
        if not values:
            return float("nan")
        index = min(len(values) - 1, max(0, round(q * (len(values) - 1))))
        return values[index]

    def median(self, attr: str) -> float:
        return statistics.median(getattr(s, attr) for s in self.samples)

    @property
    def per_chunk_s(self) -> float:
        """Median of (total - ttfb) / chunks over streamed samples."""
        return statistics.median((s.total_s - s.ttfb_s) / max(1, s.chunks - 1) for s in self.samples)

    @property
    def rps(self) -> float:
        return len(self.samples) / self.wall_s if self.wall_s else float("nan")


def chat_body(model: str, stream: bool, max_tokens: int) -> bytes:
    return json.dumps({"model": model, "stream": stream, "max_tokens": max_tokens,
                       "messages": [{"role": "user", "content": "Say something."}]}).encode()


async def run_series(name: str, url: str, body: bytes, n: int, concurrency: int = 1,
                     warmup: int = 20, fresh_connections: bool = False,
                     unix_socket: str | None = None, extra_headers: dict[str, str] | None = None) -> Series:
    """Send ``n`` requests (after ``warmup``) at ``concurrency``; time headers and body.

    ``unix_socket`` and ``extra_headers``: to reach an engine itself, which answers only the
    agent (its socket and ``Authorization`` key: support.agent.Agent.engine_socket/_headers).

    ``fresh_connections``: one TCP connection per request, for streams: llama-server (and
    the fake engine) close the connection after a stream while answering keep-alive, so a
    pooled client would fail every other direct request.
    """
    series = Series(name)
    connector: aiohttp.BaseConnector = (
        aiohttp.UnixConnector(path=unix_socket, limit=0, force_close=fresh_connections) if unix_socket
        else aiohttp.TCPConnector(limit=0, force_close=fresh_connections))
    headers = {"Content-Type": "application/json", **(extra_headers or {})}
    async with aiohttp.ClientSession(connector=connector, auto_decompress=False) as http:

        async def one(record: bool) -> None:
            t0 = time.perf_counter()
            try:
                async with http.post(url, data=body, headers=headers) as resp:
                    first = await resp.content.readany()
                    t1 = time.perf_counter()
                    # SSE events, not socket reads (reads coalesce events that arrive together)
                    chunks = first.count(b"data: ") or (1 if first else 0)
                    while True:
                        chunk = await resp.content.readany()
                        if not chunk:
                            break
                        chunks += chunk.count(b"data: ")
                    t2 = time.perf_counter()
                    ok = resp.status == 200
            except aiohttp.ClientError:
                ok = False
            if not record:
                return
            if not ok:
                series.errors += 1
                return
            series.samples.append(Sample(t1 - t0, t2 - t0, chunks))

        for _ in range(warmup):
            await one(False)
        queue = iter(range(n))

        async def worker() -> None:
            for _ in queue:
                await one(True)

        start = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        series.wall_s = time.perf_counter() - start
    return series


def ms(value: float) -> str:
    return f"{value * 1000:.3f}"
