"""The usage ledger's cost per row: what committing before a request's end is reported costs.

usage: .venv/bin/python tests/bench/bench_usage.py [-n 2000] [--out FILE]

Measured in the same run, on files in a temporary directory (the disk of the state dir):

1. the floor: one INSERT + COMMIT per row on the calling thread (WAL, synchronous=NORMAL);
2. ``await Ledger.record(row)`` with 1, 8 and 64 requests in flight: each call's latency (the
   time a request's end waits) and the rows per second; with more in flight, rows that arrive
   during a commit share the next one (group commit);
3. the event loop's longest stall while recording (a 1 ms ticker): SQLite never runs on it.

Prints a Markdown section (and writes it to --out when given).
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time
from pathlib import Path

from viiwork.agent.usage.ledger import Ledger
from viiwork.agent.usage.store import UsageRow, insert_rows, open_for_writing


def row(i: int) -> UsageRow:
    return UsageRow(finished_at_ms=int(time.time() * 1000), request_id=f"{i:032x}", tenant="acme",
                    jti="0123456789abcdef", model="llama-3.1-8b", origin_node="", serving_node="n" * 16,
                    prompt_tokens=512, completion_tokens=128, cached_tokens=None, status=200, queued_ms=0.3,
                    ttft_ms=40.0, duration_ms=900.0)


def floor_us(path: Path, n: int) -> float:
    conn = open_for_writing(path)
    try:
        began = time.perf_counter()
        for i in range(n):
            insert_rows(conn, [row(i)])
        return (time.perf_counter() - began) / n * 1e6
    finally:
        conn.close()


async def ledger_run(path: Path, n: int, in_flight: int) -> tuple[list[float], float, float]:
    """(latencies us, rows/s, the loop's longest stall ms)."""
    ledger = Ledger(path)
    ledger.start()
    latencies: list[float] = []
    stall = [0.0]
    done = asyncio.Event()

    async def ticker() -> None:
        last = time.perf_counter()
        while not done.is_set():
            await asyncio.sleep(0.001)
            now = time.perf_counter()
            stall[0] = max(stall[0], now - last - 0.001)
            last = now

    counter = iter(range(n))

    async def worker() -> None:
        for i in counter:
            began = time.perf_counter()
            await ledger.record(row(i))
            latencies.append((time.perf_counter() - began) * 1e6)

    tick = asyncio.create_task(ticker())
    began = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(in_flight)))
    elapsed = time.perf_counter() - began
    done.set()
    await tick
    await ledger.close()
    assert ledger.stats().rows_written == n
    return latencies, n / elapsed, stall[0] * 1000


async def idle_stall_ms(seconds: float) -> float:
    """The 1 ms ticker's longest stall with nothing else running: the host's own noise."""
    stall, last, end = 0.0, time.perf_counter(), time.perf_counter() + seconds
    while time.perf_counter() < end:
        await asyncio.sleep(0.001)
        now = time.perf_counter()
        stall, last = max(stall, now - last - 0.001), now
    return stall * 1000


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-n", type=int, default=2000, help="rows per measurement (default 2000)")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-usage-") as tmp:
        base = Path(tmp)
        floor = floor_us(base / "floor.sqlite3", args.n)
        idle = asyncio.run(idle_stall_ms(1.0))
        rows = []
        for in_flight in (1, 8, 64):
            lat, rate, stall = asyncio.run(ledger_run(base / f"l{in_flight}.sqlite3", args.n, in_flight))
            rows.append((in_flight, statistics.median(lat), pct(lat, 0.99), rate, stall))
    lines = [
        "### Usage ledger: the cost of committing each row before the request's end is reported",
        "",
        f"{args.n} rows per line, WAL, synchronous=NORMAL, a temporary directory on the test disk "
        "(tests/bench/bench_usage.py).",
        "",
        f"Floor, one INSERT + COMMIT per row on the calling thread: {floor:.0f} us per row. The 1 ms ticker's "
        f"longest stall with nothing running (the host's noise): {idle:.1f} ms.",
        "",
        "| requests in flight | record() p50 us | record() p99 us | rows/s | longest event-loop stall ms |",
        "|---|---|---|---|---|",
    ]
    lines += [f"| {c} | {p50:.0f} | {p99:.0f} | {rate:,.0f} | {stall:.1f} |" for c, p50, p99, rate, stall in rows]
    single = rows[0]
    lines += ["", f"One request alone waits {single[1]:.0f} us for its row ({single[1] / floor:.1f}x the floor: "
              "the hand-off to the writer thread and back); with more in flight, rows share commits, so "
              f"rows/s grows {rows[-1][3] / single[3]:.1f}x from 1 to 64 in flight."]
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        args.out.write_text(text, encoding="utf-8")


if __name__ == "__main__":
    main()
