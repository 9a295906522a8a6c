"""A model split over two agents by llama.cpp RPC against one host (issue 21): speed, gang start and restart.

usage: .venv/bin/python tests/bench/bench_gang.py [--requests 8] [--max-tokens 64] [--restarts 3] [--netns]

Real binaries on the CPU (llama-server and rpc-server of `make venv`, or $VIIWORK_LLAMA_SERVER /
$VIIWORK_RPC_SERVER), SmolLM2-135M Q4_1 of the demo package, one thread per engine process.

- one host: one agent serving the model itself (``parallel = 1``);
- split: two agents in one mesh (open trust): ``gw`` runs the gang's rpc-server when its head
  asks, ``gh`` serves the model with ``llama-server --rpc`` through the gang tunnel (mutual
  TLS), every layer on the worker's RPC device. On loopback, or with ``--netns`` (root,
  iproute2) on two hosts: network namespaces on a bridge (tests/support/netns.py), ``gh`` at
  10.99.0.1 and ``gw`` at 10.99.0.2, the mesh and the tunnel across the bridge's veth pairs.

Figures: TTFT p50 and decode tokens/s (streamed ``/v1/completions``, ``--requests`` requests of
``--max-tokens`` tokens one after the other, a different prompt each), the gang's start time
(the head agent's start until the model is healthy, the worker already in the mesh) and its
restart time after kill -9 of the worker's rpc-server (until healthy again, ``--restarts``
times), then a graceful stop of the worker's agent (SIGTERM until the head's model is
unhealthy) and its return (the worker's agent started again until healthy). Both agents and
every engine run on this machine: the split pays the tunnel and the RPC round trips (and with
``--netns`` the kernel's veth and bridge path), not a physical network. Each gang restart
spends one of the head's respawns (docs/mesh.md, "Gangs"), so the gang's agents run with
``health.max_respawns = 100``: the figures are times, not the budget.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import sys
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import requests

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))  # tests/ for support.*

from conftest import find_llama_server, find_rpc_server  # noqa: E402

from support.agent import Agent, node_ids, run_agent  # noqa: E402
from support.netns import Host, LoopbackHost, bridged_hosts, netns_available  # noqa: E402
from support.procs import free_port, stop_process  # noqa: E402
from viiwork.agent.config.demo import find_demo_model  # noqa: E402

BUDGET = {"health": {"max_respawns": 100}}


def healthy(doc: dict[str, Any]) -> bool:
    models = [m for m in doc["models"] if m["name"] == "smol"]
    return bool(models) and all(b["state"] == "healthy" for b in models[0]["backends"])


def mesh_section(host: Host, listen: str, seeds: list[str]) -> dict[str, Any]:
    return {"trust": "open", "mesh_id": "bench-gang", "listen": listen, "advertise": host.address,
            "discovery": ["seeds"], "seeds": seeds}


def measure(agent: Agent, n: int, max_tokens: int) -> tuple[float, float]:
    """(TTFT p50 s, decode tokens/s mean) over ``n`` streamed completions."""
    ttfts, rates = [], []
    for i in range(n):
        body = {"model": "smol", "prompt": f"Story {i}: a lighthouse keeper finds a message in a bottle.",
                "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "stream": True}
        t0 = time.perf_counter()
        first = None
        tokens = 0
        with requests.post(f"{agent.url}/v1/completions", json=body, stream=True, timeout=300) as r:
            assert r.status_code == 200, r.text
            for raw in r.iter_lines():
                line = raw.decode()
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line[6:])
                if any(c.get("text") for c in event.get("choices") or []):
                    tokens += 1
                    if first is None:
                        first = time.perf_counter()
        end = time.perf_counter()
        assert first is not None
        ttfts.append(first - t0)
        rates.append((tokens - 1) / (end - first) if end > first and tokens > 1 else 0.0)
    return statistics.median(ttfts), statistics.mean(rates)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--restarts", type=int, default=3)
    ap.add_argument("--netns", action="store_true", help="the two agents on two network-namespace hosts")
    args = ap.parse_args()
    if args.netns and not (ok := netns_available())[0]:
        raise SystemExit(f"--netns: {ok[1]}")
    llama, rpc = find_llama_server(), find_rpc_server()
    if llama is None or rpc is None:
        raise SystemExit("llama-server and rpc-server are needed (make venv builds both)")
    model = str(find_demo_model())
    engine = {"binary": str(llama), "threads": 1}
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench-gang-") as tmp:
        work = Path(tmp)
        one = {"name": "smol", "engine": "llamacpp", "path": model, "parallel": 1, "ctx_per_slot": 1024,
               "llamacpp": engine}
        (work / "one").mkdir()
        with run_agent(work / "one", [one], name="one") as agent:
            agent.wait_for(healthy, 180, "one host healthy")
            ttft, tps = measure(agent, args.requests, args.max_tokens)
            rows.append(("one host", ttft, tps))
        (work / "gang").mkdir()
        gang = {**one, "hosts": node_ids(work / "gang", "gh", "gw"), "gang_port": free_port(), "startup_timeout_s": 180,
                "llamacpp": {**engine, "rpc_binary": str(rpc)}}
        with ExitStack() as stack:
            if args.netns:
                bridged = stack.enter_context(bridged_hosts(f"vwb{os.getpid() % 10000}", 2))
                head_host, worker_host = bridged.host(1), bridged.host(2)
            else:
                head_host, worker_host = LoopbackHost(), LoopbackHost()
            head_mesh, worker_mesh = f"{head_host.address}:{free_port()}", f"{worker_host.address}:{free_port()}"

            def start_worker() -> Agent:
                return stack.enter_context(run_agent(work / "gang", [gang], name="gw", host=worker_host,
                                                     extra={"mesh": mesh_section(worker_host, worker_mesh, []), **BUDGET}))
            worker = start_worker()
            t0 = time.monotonic()
            head = stack.enter_context(run_agent(work / "gang", [gang], name="gh", host=head_host,
                                                 extra={"mesh": mesh_section(head_host, head_mesh, [worker_mesh]), **BUDGET}))
            head.wait_for(healthy, 300, "the gang healthy")
            start_s = time.monotonic() - t0
            ttft, tps = head.call(lambda: measure(head, args.requests, args.max_tokens), 3600)
            rows.append((f"split over two agents (RPC through the tunnel{', two netns hosts' if args.netns else ''})",
                         ttft, tps))
            restarts = []
            for _ in range(args.restarts):
                (part,) = worker.status()["gangs"]["parts"]
                killed = time.monotonic()
                os.kill(part["parts"][0]["pid"], signal.SIGKILL)
                head.wait_for(lambda d: not healthy(d), 30, "unhealthy")
                head.wait_for(healthy, 300, "healthy again")
                restarts.append(time.monotonic() - killed)
            stopped = time.monotonic()
            stop_process(worker.proc, 30)  # SIGTERM: the worker's agent leaves
            head.wait_for(lambda d: not healthy(d), 30, "unhealthy once the worker left")
            down_s = time.monotonic() - stopped
            back = time.monotonic()
            worker = start_worker()
            head.wait_for(healthy, 300, "healthy with the worker back")
            back_s = time.monotonic() - back
    print(f"llama-server {llama}, rpc-server {rpc}; {args.requests} requests of {args.max_tokens} tokens\n")
    print("| serving | TTFT p50 s | decode tokens/s |\n|---|---|---|")
    for name, ttft, tps in rows:
        print(f"| {name} | {ttft:.3f} | {tps:.1f} |")
    print(f"\ngang start (head agent started, worker in the mesh, until healthy): {start_s:.1f} s")
    print(f"gang restart after kill -9 of the worker's rpc-server, until healthy: "
          f"{', '.join(f'{r:.1f}' for r in restarts)} s (median {statistics.median(restarts):.1f} s)")
    print(f"worker's agent stopped (SIGTERM) until the head's model is unhealthy: {down_s:.1f} s; "
          f"its agent started again until healthy: {back_s:.1f} s")


if __name__ == "__main__":
    main()
