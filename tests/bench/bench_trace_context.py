"""What trace context costs one request (issue 19, item 4): the steps alone, in one process.

usage: .venv/bin/python tests/bench/bench_trace_context.py [-n 20000] [--rounds 5]

Each request runs the steps the agent runs for it (agent/serving/tracing.py): ``Tracing.begin``
(read and check ``traceparent`` and ``tracestate``, start the request span), one
``RequestTrace.dispatch`` (the headers sent on, the DEBUG line, the dispatch span) and its
``end``, and ``finish``, on a real ``aiohttp.web.Request`` (aiohttp's ``make_mocked_request``)
inside a running event loop; logging at INFO, as an agent runs by default. Modes, interleaved
in rounds (median of the rounds' per-request means, µs):

- without ``[tracing]``: no header, a valid ``traceparent`` with a ``tracestate``, an invalid one;
- with ``[tracing]``: ``sample_ratio = 0`` (the SDK's span started and dropped) and ``1`` (four
  spans recorded per request, exported in batches by the SDK's thread to an OTLP/HTTP receiver
  in this process: support/otlp_receiver.py, so its decoding competes for the GIL as well).

Also: the import of the OpenTelemetry SDK and exporter (agent/serving/otel.py) in a fresh
interpreter, which an agent without ``[tracing]`` never pays. Prints a Markdown table.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))  # tests/ for support.*

from aiohttp import web  # noqa: E402
from aiohttp.test_utils import make_mocked_request  # noqa: E402

from support.otlp_receiver import OtlpReceiver  # noqa: E402
from viiwork.agent.config.schema import TracingConfig  # noqa: E402
from viiwork.agent.serving.tracing import Tracing  # noqa: E402

VALID = {"traceparent": "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01", "tracestate": "congo=t61rcWkgMzE"}
INVALID = {"traceparent": "00-00000000000000000000000000000000-00f067aa0ba902b7-01"}


async def per_request_us(tracing: Tracing, headers: dict[str, str], n: int) -> float:
    request = make_mocked_request("POST", "/v1/chat/completions", headers=headers)
    response = web.Response(status=200, headers={"X-Request-Id": "r"})
    start = time.perf_counter_ns()
    for _ in range(n):
        trace = tracing.begin(request)
        dispatch = trace.dispatch("m-0", to_engine=True, request_id="r", queued_ms="0.1")
        dispatch.end(200, None)
        trace.finish(response)
    return (time.perf_counter_ns() - start) / n / 1000


def import_ms() -> float:
    """The import of agent/serving/otel.py (the SDK and exporter), after tracing.py's, in a fresh interpreter."""
    code = ("import time, viiwork.agent.serving.tracing; t = time.perf_counter(); "
            "import viiwork.agent.serving.otel; print((time.perf_counter() - t) * 1000)")
    runs = [float(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout)
            for _ in range(3)]
    return statistics.median(runs)


async def main_async(n: int, rounds: int) -> str:
    logging.basicConfig(level=logging.INFO)
    with OtlpReceiver.running() as receiver:
        off = Tracing(node_name="bench")
        ratio0 = Tracing(TracingConfig(endpoint=receiver.url, sample_ratio=0.0), node_name="bench")
        ratio1 = Tracing(TracingConfig(endpoint=receiver.url, sample_ratio=1.0), node_name="bench")
        ratio0.start()
        ratio1.start()
        modes = [("no [tracing], no traceparent", off, {}), ("no [tracing], valid traceparent + tracestate", off, VALID),
                 ("no [tracing], invalid traceparent (counted)", off, INVALID),
                 ("[tracing], sample_ratio = 0", ratio0, VALID), ("[tracing], sample_ratio = 1 (4 spans)", ratio1, VALID)]
        samples: dict[str, list[float]] = {name: [] for name, _, _ in modes}
        for _name, tracing, headers in modes:  # warm-up
            await per_request_us(tracing, headers, n // 10)
        for r in range(rounds):
            for name, tracing, headers in modes[r % len(modes):] + modes[:r % len(modes)]:
                samples[name].append(await per_request_us(tracing, headers, n))
        await ratio0.stop()
        await ratio1.stop()
        spans = len(receiver.spans)
    lines = [
        "### Trace context per request (issue 19, item 4)", "",
        f"Machine: {platform.machine()}, Python {platform.python_version()}; `bench_trace_context.py -n {n} "
        f"--rounds {rounds}` (one process; median of {rounds} rounds' means).", "",
        "| mode | µs per request | min | max |", "|---|---|---|---|",
    ]
    for name, _, _ in modes:
        values = samples[name]
        lines.append(f"| {name} | {statistics.median(values):.1f} | {min(values):.1f} | {max(values):.1f} |")
    lines += ["", f"Spans received by the in-process OTLP/HTTP receiver: {spans}.",
              f"Import of the OpenTelemetry SDK and OTLP/HTTP exporter (agent/serving/otel.py), fresh interpreter, "
              f"median of 3: {import_ms():.0f} ms (paid only with `[tracing]`, at start).", ""]
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("-n", type=int, default=20000, help="requests per mode and round")
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    print(asyncio.run(main_async(args.n, args.rounds)))


if __name__ == "__main__":
    main()
