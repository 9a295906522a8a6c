"""Slot offers measured on real agents: three ``viiwork-agent`` processes on loopback forming
a mesh, the same open-loop workload run with ``routing.slot_offers`` on and then off.

Not a test. Setup (as tests/mesh/test_slot_offers.py and test_agents_routing.py do it):

- three agents (``support.agent.run_agent``), open trust, found by seeds (the first agent's
  mesh address), mesh gossip every 500 ms (the default), other mesh settings default;
- each serves model ``shared`` with ``backends = 1``, ``parallel = 2`` (6 slots in all) on a
  fake llama-server (``support.engines``) whose answer takes ``max_tokens`` x
  ``FAKE_TOKEN_DELAY_S`` (``--token-s``, 20 ms);
- ``routing.queue_max = 256``, ``routing.queue_timeout_s = 60``, other routing defaults;
  ``routing.slot_offers`` true on all three agents for one run, false for the other (fresh
  agents for each run).

Workload (one seed: the same arrival times, origins and service times in both runs):
Poisson arrivals at ``--load`` of capacity (6 slots / ``--mean-s``) for ``--seconds``,
origins uniform over the three agents' client APIs, service times lognormal (sigma 0.8 of
the underlying normal) with mean ``--mean-s``, scaled by one factor so that the draw's work
is exactly ``--load`` of capacity, rounded to whole tokens. Non-streamed requests from one
aiohttp session, one task per request; how late each was sent is measured (the generator's
lag) and reported. Per request: status, ``X-Viiwork-Queued-Ms`` (arrival at the origin
until it was dispatched to a slot, local or on a peer), ``X-Viiwork-Node``,
``X-Viiwork-Origin``. The first 10% (by arrival) are warm-up. Also reported: forwards
refused, the offer counters of ``/v1/status`` summed over the agents, and the slot-seconds
a slot stood free while some request waited (from the client's timings). The ``ideal`` row
is computed, not measured: one global FIFO queue over the 6 slots with the nominal service
times (the oracle of bench_routing_sim.py).

About 130 s with the defaults on a 2-core VM (2 x 60 s of arrivals, 280 requests per run).
Prints a Markdown section. ``--keep DIR`` keeps the agents' configs and logs and writes
each run's requests to DIR/on.json and DIR/off.json, for diagnosis.

Usage: .venv/bin/python tests/bench/bench_offers_agents.py [--seconds 60] [--load 0.8]
       [--seed 1] [--mean-s 1.0] [--token-s 0.02] [--runs on,off] [--keep DIR]
"""

from __future__ import annotations

import argparse
import asyncio
import heapq
import json
import math
import random
import statistics
import sys
import tempfile
import time
import urllib.request
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))  # tests/ for support.*

from support.agent import Agent, run_agent  # noqa: E402
from support.engines import fake_engine_binary  # noqa: E402

NODES = ("node-a", "node-b", "node-c")
PARALLEL = 2
SLOTS = PARALLEL * len(NODES)
SIGMA = 0.8
GOSSIP_MS = 500  # the default, stated
WARMUP = 0.10
OFFER_KEYS = ("offers_out", "offers_taken", "offers_declined", "claims", "holds_expired", "wants_out")


@dataclass(frozen=True)
class Job:
    at: float  # seconds after the start of the arrivals
    origin: int  # index into NODES
    tokens: int


@dataclass
class Result:
    index: int
    status: int
    queued_ms: float | None
    node: str
    origin: str
    latency_ms: float
    lag_ms: float  # when it was sent, after when it was due


@dataclass
class Run:
    name: str
    results: list[Result] = field(default_factory=list)
    counters: dict[str, int] = field(default_factory=dict)
    refused_out: int = 0
    wall_s: float = 0.0
    setup_s: float = 0.0


def workload(seconds: float, load: float, mean_s: float, token_s: float, seed: int) -> list[Job]:
    """Arrivals, origins and service times from three streams of one seed.

    A few hundred lognormal draws miss their mean by several percent (and the arrival count
    its expectation), so the service times are scaled by one factor that makes this draw's
    work exactly ``load`` x the 6 slots x ``seconds``: the offered load is what it says."""
    arrivals, origins, services = (random.Random(f"{seed}-{what}") for what in ("arrivals", "origins", "services"))
    rate = load * SLOTS / mean_s
    mu = math.log(mean_s) - SIGMA ** 2 / 2  # lognormal mean = exp(mu + sigma^2 / 2)
    drawn: list[tuple[float, int, float]] = []
    t = arrivals.expovariate(rate)
    while t < seconds:
        drawn.append((t, origins.randrange(len(NODES)), services.lognormvariate(mu, SIGMA)))
        t += arrivals.expovariate(rate)
    scale = load * SLOTS * seconds / sum(service for _, _, service in drawn)
    return [Job(at, origin, max(1, round(service * scale / token_s))) for at, origin, service in drawn]


def ideal_waits_ms(jobs: list[Job], token_s: float) -> list[float]:
    """Queueing delay of each job under one global FIFO queue over SLOTS slots (no delays)."""
    free_at = [0.0] * SLOTS
    waits = []
    for job in jobs:
        earliest = heapq.heappop(free_at)
        start = max(job.at, earliest)
        waits.append((start - job.at) * 1000.0)
        heapq.heappush(free_at, start + job.tokens * token_s)
    return waits


def pct(values: list[float], q: float) -> float:
    values = sorted(values)
    if not values:
        return float("nan")
    return values[min(len(values) - 1, max(0, round(q * (len(values) - 1))))]


# --- agents -----------------------------------------------------------------------------------------


def shared_model(binary: Path, token_s: float) -> dict:
    env = {"FAKE_LOAD_S": "0.1", "FAKE_TOKENS": "1000000", "FAKE_TOKEN_DELAY_S": str(token_s)}
    return {"name": "shared", "engine": "llamacpp", "path": "/dev/null", "parallel": PARALLEL, "backends": 1,
            "llamacpp": {"binary": str(binary)}, "env": env}


def mesh_section(seeds: list[str]) -> dict:
    return {"trust": "open", "mesh_id": "bench-offers", "listen": "127.0.0.1:0", "advertise": "127.0.0.1",
            "discovery": ["seeds"], "seeds": seeds, "gossip_interval_ms": GOSSIP_MS}


def mesh_view(agent: Agent) -> dict:
    with urllib.request.urlopen(f"{agent.url}/v1/mesh", timeout=5) as r:
        return json.load(r)


def peers_ready(agent: Agent) -> bool:
    """Both peers alive in this agent's picture, each with its 2 slots of ``shared`` free."""
    ready = 0
    for n in mesh_view(agent)["nodes"]:
        model = next((m for m in n["models"] if m["name"] == "shared"), None)
        if n["liveness"] == "alive" and model and model["slots"] == PARALLEL and model["busy"] == 0:
            ready += 1
    return ready == len(NODES) - 1


def start_mesh(stack: ExitStack, workdir: Path, binary: Path, token_s: float, offers: bool) -> list[Agent]:
    agents: list[Agent] = []
    seeds: list[str] = []
    for name in NODES:
        agent = stack.enter_context(run_agent(
            workdir, [shared_model(binary, token_s)], name=name,
            extra={"mesh": mesh_section(seeds),
                   "routing": {"queue_max": 256, "queue_timeout_s": 60, "slot_offers": offers}}))
        agents.append(agent)
        if not seeds:
            seeds = [agent.wait_for(lambda d: bool(d["mesh"]["self"]["mesh"]), 30,
                                    "mesh address")["mesh"]["self"]["mesh"]]
    for agent in agents:
        agent.wait_healthy("shared", timeout_s=60)
    for agent in agents:
        agent.wait_for(lambda d, a=agent: peers_ready(a), 60, "both peers alive with free slots")
    return agents


def counters(agents: list[Agent]) -> tuple[dict[str, int], int]:
    total: dict[str, int] = {key: 0 for key in OFFER_KEYS}
    refused = 0
    for agent in agents:
        doc = agent.status()["mesh"]
        for key in OFFER_KEYS:
            total[key] += int(doc["offers"].get(key, 0))
        refused += int(doc["forwards"].get("refused_out", 0))
    return total, refused


# --- load ---------------------------------------------------------------------------------------------


async def drive(urls: list[str], jobs: list[Job]) -> list[Result]:
    """Send every job at its arrival time (open loop) from one session; wait for all answers."""
    bodies = [json.dumps({"model": "shared", "stream": False, "max_tokens": job.tokens,
                          "messages": [{"role": "user", "content": "hi"}]}).encode() for job in jobs]
    headers = {"Content-Type": "application/json"}
    connector = aiohttp.TCPConnector(limit=0)
    timeout = aiohttp.ClientTimeout(total=180)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as http:
        loop = asyncio.get_running_loop()
        t0 = loop.time() + 0.2

        async def one(i: int, job: Job) -> Result:
            sent = loop.time()
            lag_ms = (sent - (t0 + job.at)) * 1000.0
            try:
                async with http.post(urls[job.origin] + "/v1/chat/completions", data=bodies[i],
                                     headers=headers) as r:
                    await r.read()
                    queued = r.headers.get("X-Viiwork-Queued-Ms")
                    return Result(i, r.status, float(queued) if queued else None, r.headers.get("X-Viiwork-Node", ""),
                                  r.headers.get("X-Viiwork-Origin", ""), (loop.time() - sent) * 1000.0, lag_ms)
            except (aiohttp.ClientError, OSError, TimeoutError) as exc:
                print(f"request {i}: {type(exc).__name__}: {exc}", file=sys.stderr)
                return Result(i, 0, None, "", "", (loop.time() - sent) * 1000.0, lag_ms)

        tasks = []
        for i, job in enumerate(jobs):
            delay = t0 + job.at - loop.time()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(one(i, job)))
        return list(await asyncio.gather(*tasks))


def run_once(name: str, offers: bool, jobs: list[Job], token_s: float, workdir: Path, binary: Path) -> Run:
    run = Run(name)
    started = time.monotonic()
    with ExitStack() as stack:
        agents = start_mesh(stack, workdir, binary, token_s, offers)
        before, refused_before = counters(agents)
        run.setup_s = time.monotonic() - started
        t = time.monotonic()
        run.results = asyncio.run(drive([a.url for a in agents], jobs))
        run.wall_s = time.monotonic() - t
        after, refused_after = counters(agents)
        run.counters = {k: after[k] - before[k] for k in OFFER_KEYS}
        run.refused_out = refused_after - refused_before
        for agent in agents:
            if agent.proc.poll() is not None:
                raise RuntimeError(f"{agent.url} exited during the run; log:\n{agent.log_text()[-3000:]}")
    return run


# --- report -----------------------------------------------------------------------------------------


def idle_slot_s(results: list[Result], jobs: list[Job]) -> float:
    """Slot-seconds a slot stood free while some request waited, from the client's view:
    a request waits from when it was sent until it was dispatched (``X-Viiwork-Queued-Ms``)
    and then holds a slot of its node until its answer arrived (a few ms late)."""
    events: list[tuple[float, str, int]] = []  # (time, node or "", +1/-1)
    for r in results:
        if r.status != 200 or r.queued_ms is None or r.node not in NODES:
            continue
        sent = jobs[r.index].at + r.lag_ms / 1000.0
        start, end = sent + r.queued_ms / 1000.0, sent + r.latency_ms / 1000.0
        events += [(sent, "", 1), (start, "", -1), (start, r.node, 1), (end, r.node, -1)]
    events.sort()
    busy = dict.fromkeys(NODES, 0)
    waiting = 0
    idle = 0.0
    last = events[0][0] if events else 0.0
    for t, node, delta in events:
        free = sum(max(0, PARALLEL - b) for b in busy.values())
        idle += (t - last) * min(free, waiting)
        last = t
        if node:
            busy[node] += delta
        else:
            waiting += delta
    return idle


def row(name: str, measured: list[Result], run: Run, offers: bool, jobs: list[Job]) -> tuple[str, float]:
    ok = [r for r in measured if r.status == 200 and r.queued_ms is not None]
    waits = [r.queued_ms for r in ok]
    errors = len(measured) - len(ok)
    on_peer = sum(1 for r in ok if r.node != r.origin)
    p99 = pct(waits, 0.99)
    cells = [name, str(len(measured)), str(errors), f"{statistics.fmean(waits):.0f}", f"{pct(waits, 0.5):.0f}",
             f"{pct(waits, 0.95):.0f}", f"{p99:.0f}", f"{100 * on_peer / max(1, len(ok)):.0f}%",
             f"{100 * run.refused_out / len(run.results):.1f}", f"{idle_slot_s(run.results, jobs):.1f}"]
    cells += [str(run.counters[k]) if offers else "-" for k in OFFER_KEYS]
    return "| " + " | ".join(cells) + " |", p99


def report(args: argparse.Namespace, jobs: list[Job], runs: dict[str, Run], total_s: float) -> str:
    skip = int(len(jobs) * WARMUP)
    measured_jobs = jobs[skip:]
    nominal_mean = statistics.fmean(j.tokens * args.token_s for j in jobs)
    rate = args.load * SLOTS / args.mean_s
    drawn_load = len(jobs) * nominal_mean / (args.seconds * SLOTS)  # of this draw, nominal service times
    command = (f".venv/bin/python tests/bench/bench_offers_agents.py --seconds {args.seconds:g} "
               f"--load {args.load:g} --seed {args.seed} --mean-s {args.mean_s:g}"
               + (f" --token-s {args.token_s:g}" if args.token_s != 0.02 else "")
               + (f" --runs {args.runs}" if args.runs != "on,off" else ""))
    out = ["## Slot offers with real agents", "", f"Command: `{command}` ({total_s:.0f} s in all).", ""]
    out += [
        f"- 3 `viiwork-agent` processes on loopback, one open-trust mesh over mutual TLS found by seeds, "
        f"gossip every {GOSSIP_MS} ms (default); each serves `shared` with 1 fake llama-server backend, "
        f"`parallel = {PARALLEL}`: {SLOTS} slots in all, equal speed. `routing.queue_max = 256`, "
        "`queue_timeout_s = 60`, other settings default; `routing.slot_offers` on all three agents "
        "true in one run, false in the other (fresh agents for each run).",
        f"- Workload (seed {args.seed}, identical in both runs): {len(jobs)} requests, Poisson arrivals at "
        f"{rate:.2f}/s for {args.seconds:g} s, origins uniform over the 3 agents; service times lognormal "
        f"(sigma {SIGMA}, mean {args.mean_s:g} s), scaled by one factor so that this draw's work is exactly "
        f"{args.load:.0%} of the {SLOTS} slots' capacity (nominal mean {nominal_mean:.3f} s; load "
        f"{drawn_load:.0%}), sent as `max_tokens` x {args.token_s * 1000:g} ms; non-streamed, one aiohttp "
        f"session. The first {skip} requests (10%) are warm-up: {len(measured_jobs)} measured per run.",
        "- Queued ms: the origin's `X-Viiwork-Queued-Ms` (arrival at the origin until dispatched to a slot, "
        "here or on a peer). `on a peer`: `X-Viiwork-Node` differs from `X-Viiwork-Origin`. `refused/100`: "
        "forwards refused by the peer (`mesh.forwards.refused_out`, all agents) per 100 requests. Offer "
        "counters: `/v1/status` `mesh.offers`, summed over the agents, for the whole run (warm-up included). "
        "`idle slot-s`: slot-seconds during which a slot stood free while a request waited, whole run, "
        "reconstructed from the client's timings (each request holds a slot of its node from its dispatch until "
        "its answer arrives; the ideal dispatcher has 0).",
        "- `ideal`: computed, not measured: one global FIFO queue over the 6 slots with the nominal service "
        "times and no delays (the simulation's oracle).",
        "",
        "| run | requests | errors | mean ms | p50 ms | p95 ms | p99 ms | on a peer | refused/100 | idle slot-s | "
        + " | ".join(OFFER_KEYS) + " |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|" + "---:|" * len(OFFER_KEYS),
    ]
    p99s: dict[str, float] = {}
    for name, run in runs.items():
        line, p99s[name] = row(name, run.results[skip:], run, name == "offers on", jobs)
        out.append(line)
    ideal = ideal_waits_ms(jobs, args.token_s)[skip:]
    out.append(f"| ideal | {len(ideal)} | - | {statistics.fmean(ideal):.0f} | {pct(ideal, 0.5):.0f} | "
               f"{pct(ideal, 0.95):.0f} | {pct(ideal, 0.99):.0f} | - | - | 0 |" + " - |" * len(OFFER_KEYS))
    out.append("")
    if "offers on" in p99s and "offers off" in p99s:
        on, off = p99s["offers on"], p99s["offers off"]
        out.append(f"p99 with offers / p99 without: **{on / off:.2f}** ({on:.0f} ms / {off:.0f} ms; ideal "
                   f"{pct(ideal, 0.99):.0f} ms).")
        out.append("")
    notes = []
    for name, run in runs.items():
        ok = [r for r in run.results[skip:] if r.status == 200 and r.queued_ms is not None]
        service = statistics.fmean((r.latency_ms - r.queued_ms) / 1000.0 for r in ok) if ok else float("nan")
        lags = [r.lag_ms for r in run.results]
        nominal = statistics.fmean(j.tokens * args.token_s for j in measured_jobs)
        notes.append(f"{name}: client latency minus queued {service:.3f} s on average against "
                     f"{nominal:.3f} s nominal (so the load realised was ~{drawn_load * service / nominal:.0%}); "
                     f"generator lag p99 {pct(lags, 0.99):.1f} ms, max {max(lags):.1f} ms; load phase "
                     f"{run.wall_s:.0f} s, agents start {run.setup_s:.0f} s")
    out.append("Per run: " + "; ".join(notes) + ".")
    errors = [r for run in runs.values() for r in run.results if r.status != 200]
    if errors:
        by_status: dict[int, int] = {}
        for r in errors:
            by_status[r.status] = by_status.get(r.status, 0) + 1
        out.append("")
        out.append("Errors by status (0: no HTTP answer), warm-up included: "
                   + ", ".join(f"{s}: {n}" for s, n in sorted(by_status.items())) + ".")
    return "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=60.0, help="seconds of arrivals per run")
    ap.add_argument("--load", type=float, default=0.8, help="offered load, a fraction of the 6 slots")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--mean-s", type=float, default=1.0, help="mean service time")
    ap.add_argument("--token-s", type=float, default=0.02, help="FAKE_TOKEN_DELAY_S of the fake engines")
    ap.add_argument("--runs", default="on,off", help="which runs, in order: on, off or both")
    ap.add_argument("--keep", type=Path, help="keep the agents' configs and logs in this (new) directory, "
                    "and each run's requests as DIR/RUN.json")
    args = ap.parse_args(argv)
    started = time.monotonic()
    jobs = workload(args.seconds, args.load, args.mean_s, args.token_s, args.seed)
    runs: dict[str, Run] = {}
    with tempfile.TemporaryDirectory(prefix="vw-bench-offers-") as tmp:
        if args.keep:
            args.keep.mkdir(parents=True)
            tmp = str(args.keep)
        binary = fake_engine_binary(Path(tmp) / "bin")
        for which in args.runs.split(","):
            offers = {"on": True, "off": False}[which.strip()]
            name = f"offers {which.strip()}"
            workdir = Path(tmp) / which.strip()
            workdir.mkdir()
            runs[name] = run_once(name, offers, jobs, args.token_s, workdir, binary)
            if args.keep:
                (args.keep / f"{which.strip()}.json").write_text(json.dumps(
                    [{**vars(r), "at": jobs[r.index].at, "tokens": jobs[r.index].tokens} for r in runs[name].results]))
    print(report(args, jobs, runs, time.monotonic() - started), end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
