"""A backend that fails fast, before and after outlier ejection (issue 22, items 1-3).

Not a test. Three ``viiwork-agent`` processes on loopback (``support.agent.run_agent``), open
trust, found by seeds (``gossip_interval_ms`` 100), model ``shared`` on one fake llama-server
each (``parallel`` 2, 4 tokens 20 ms apart: ~0.1 s an answer). Node a's engine answers 503 to
every completion at once (``FAKE_COMPLETION_STATUS``) while its ``/health`` and ``/slots``
stay fine: the failure issue 22 was opened for.

Scenarios (a fresh mesh for each, so nothing is ejected at its start):

- **enter at a**: 60 requests one after the other to a;
- **enter at b**: 60 requests to b, 3 at a time (b has 2 slots: its overflow goes to a or c).

Configurations:

- **before**: ``[routing.outliers] enabled = false`` and ``routing.forward_retry = 0`` on every
  node: nothing is ejected and a failure is not retried (what the agent did before issue 22,
  as far as configuration can bring it back: ``forward_retry = 0`` also stops the retry of a
  peer's refusal, which these runs rarely see);
- **retry only**: ``enabled = false``, ``forward_retry = 1``: failures before the first byte
  are retried elsewhere, nothing is ejected;
- **after**: the defaults (ejection on: 5 failures in a row, 5 s doubling; ``forward_retry`` 1).

Figures per run: requests that reached a's engine (the fast-failing backend) as a share of
the 60 sent, requests that ran on c, and answers other than 200 the clients saw.
``-n`` runs of each (min / median / max when more than one). About 30 s with ``-n 1``, 100 s with ``-n 3``.

Usage: .venv/bin/python tests/bench/bench_outliers.py [-n 1] [--out FILE]
"""

from __future__ import annotations

import argparse
import asyncio
import platform
import statistics
import sys
import tempfile
import time
from collections import Counter
from contextlib import ExitStack
from pathlib import Path

import aiohttp

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))  # tests/ for support.*

from support.agent import Agent, run_agent  # noqa: E402
from support.engines import fake_engine_binary  # noqa: E402

GOOD = {"FAKE_LOAD_S": "0.1", "FAKE_TOKENS": "4", "FAKE_TOKEN_DELAY_S": "0.02"}
REQUESTS = 60
CONFIGS = {
    "before": ({"enabled": False}, 0),
    "retry only": ({"enabled": False}, 1),
    "after": ({}, 1),
}
BODY = {"model": "shared", "messages": [{"role": "user", "content": "hi"}]}


def start_mesh(work: Path, stack: ExitStack, outliers: dict, retry: int) -> dict[str, Agent]:
    binary = fake_engine_binary(work / "bin")
    agents: dict[str, Agent] = {}
    seeds: list[str] = []
    for name in "abc":
        env = {**GOOD, "FAKE_COMPLETION_STATUS": "503"} if name == "a" else GOOD
        mesh = {"trust": "open", "mesh_id": "bench-outliers", "listen": "127.0.0.1:0", "advertise": "127.0.0.1",
                "discovery": ["seeds"], "seeds": seeds, "gossip_interval_ms": 100, "suspect_after_ms": 1000,
                "dead_after_ms": 3000}
        models = [{"name": "shared", "engine": "llamacpp", "path": "/dev/null", "parallel": 2, "backends": 1,
                   "llamacpp": {"binary": str(binary)}, "env": env}]
        extra: dict[str, dict] = {"mesh": mesh, "routing": {"forward_retry": retry, "queue_timeout_s": 10}}
        if outliers:
            extra["routing.outliers"] = outliers
        agents[name] = stack.enter_context(run_agent(work, models, name=f"node-{name}", extra=extra))
        if not seeds:
            seeds = [agents[name].wait_for(lambda d: bool(d["mesh"]["self"]["mesh"]), 30,
                                           "mesh address")["mesh"]["self"]["mesh"]]
    for agent in agents.values():
        agent.wait_healthy("shared", timeout_s=30)
        agent.wait_for(lambda d: d["mesh"]["peers"].get("alive", 0) == 2, 30, "two alive peers")
    return agents


async def drive(entry: Agent, concurrency: int) -> tuple[Counter[str], int]:
    """REQUESTS requests to ``entry``, ``concurrency`` at a time: (nodes they ran on, non-200s)."""
    left = REQUESTS
    nodes: Counter[str] = Counter()
    failures = 0
    async with aiohttp.ClientSession() as http:
        async def worker() -> None:
            nonlocal left, failures
            while left > 0:
                left -= 1
                async with http.post(f"{entry.url}/v1/chat/completions", json=BODY) as r:
                    await r.read()
                    nodes[r.headers.get("X-Viiwork-Node", "?")] += 1
                    failures += r.status != 200
        await asyncio.gather(*(worker() for _ in range(concurrency)))
    return nodes, failures


def one_run(config: str, scenario: str) -> tuple[float, float, int]:
    """(share of requests that reached a's engine, share that ran on c, client failures)."""
    outliers, retry = CONFIGS[config]
    with tempfile.TemporaryDirectory(prefix="bench-outliers-") as tmp, ExitStack() as stack:
        agents = start_mesh(Path(tmp), stack, outliers, retry)
        entry, concurrency = (agents["a"], 1) if scenario == "enter at a" else (agents["b"], 3)
        nodes, failures = asyncio.run(drive(entry, concurrency))
        reached = int(agents["a"].engine_stats("shared")["requests"])
        return reached / REQUESTS, nodes["node-c"] / REQUESTS, failures


def cell(values: list[float], pct: bool) -> str:
    fmt = (lambda v: f"{v * 100:.0f}%") if pct else (lambda v: f"{v:g}")
    if len(values) == 1:
        return fmt(values[0])
    return " / ".join(fmt(v) for v in (min(values), statistics.median(values), max(values)))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-n", type=int, default=1, help="runs of each configuration and scenario (default 1)")
    ap.add_argument("--out", type=Path, help="also write the Markdown table here")
    args = ap.parse_args()
    started = time.monotonic()
    lines = [f"Python {platform.python_version()}, {platform.machine()}, {REQUESTS} requests per run, "
             f"{args.n} run(s) each (min / median / max when more)", "",
             "| entering at | configuration | reached a's failing engine | ran on c | client failures |",
             "|---|---|---|---|---|"]
    for scenario in ("enter at a", "enter at b"):
        for config in CONFIGS:
            runs = [one_run(config, scenario) for _ in range(args.n)]
            lines.append(f"| {scenario.removeprefix('enter at ')} | {config} | {cell([r[0] for r in runs], True)} | "
                         f"{cell([r[1] for r in runs], True)} | {cell([float(r[2]) for r in runs], False)} |")
            print(lines[-1], flush=True)
    lines += ["", f"({time.monotonic() - started:.0f} s)"]
    text = "\n".join(lines)
    print("\n" + text)
    if args.out:
        args.out.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
