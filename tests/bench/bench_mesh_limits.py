"""Mesh-wide key limits measured on real agents: how close to its ``rpm`` a key gets when its
requests arrive at 1, 3 or 10 origins (issue 17 item 6; docs/security.md, "Limits across the
mesh").

Not a test. Setup (as tests/mesh/test_mesh_limits.py does it):

- ``--nodes`` ``viiwork-agent`` processes (10) on loopback, one mesh in CA trust (a CA made by
  ``viiworkctl mesh ca init``, each node enrolled), found by seeds (the first agent's mesh
  address), gossip every 200 ms; client keys on (``[auth] mode = "keys"``);
- the first agent serves model ``m`` on one fake llama-server (``parallel = 8``, answers at
  once); the others serve nothing and forward to it. Each agent admits the requests its
  clients send it (it is their origin) and reports its own counts to its peers.

Workload, per trial: a fresh key with ``rpm = --limit`` (60) sends ``2 x limit`` non-streamed
requests, spread round-robin over the first ``n`` agents (the origins), in one of three ways:

- ``sequential``: one client, one request at a time, as fast as answers come;
- ``per origin``: ``n`` clients at once, each sending its share to its own origin one at a
  time (requests in flight at several origins at every moment);
- ``burst``: all ``2 x limit`` requests sent at once (the worst case for any scheme that
  decides on reports: every origin admits before any report can arrive).

A trial starts only when the current wall-clock minute (the window) has at least 12 s left,
so all its requests fall in one window. Measured: admitted (200) / limit; every refusal must
be 429 with ``Retry-After`` and ``x-ratelimit-*`` headers (counted otherwise). ``--trials``
(3) per row. About 90 s with the defaults on a 2-core VM.

Usage: .venv/bin/python tests/bench/bench_mesh_limits.py [--nodes 10] [--origins 1,3,10]
       [--limit 60] [--trials 3] [--modes sequential,per-origin,burst] [--out FILE]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime
import io
import os
import signal
import statistics
import sys
import tempfile
import time
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path

import aiohttp

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))  # tests/ for support.*

from support.agent import Agent, run_agent  # noqa: E402
from support.engines import fake_engine_binary  # noqa: E402
from viiwork.agent.cli import main as viiworkctl  # noqa: E402

AUDIENCE = "bench-limits"
CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
WINDOW_LEFT_S = 25.0
HEADERS = ("retry-after", "x-ratelimit-limit-requests", "x-ratelimit-remaining-requests",
           "x-ratelimit-reset-requests")


def ctl(*args: str) -> str:
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()):
        if viiworkctl(list(args)) != 0:
            raise SystemExit(f"viiworkctl {' '.join(args[:3])} failed")
    return out.getvalue().strip()


def mesh_section(ca: Path, seeds: list[str]) -> dict:
    return {"trust": "ca", "ca_certificate": str(ca / "ca.crt"), "listen": "127.0.0.1:0", "advertise": "127.0.0.1",
            "discovery": ["seeds"], "seeds": seeds, "gossip_interval_ms": 200, "suspect_after_ms": 2000,
            "dead_after_ms": 6000}


@dataclass
class Trial:
    origins: int
    mode: str
    admitted: int
    refused_ok: int  # 429 with every header
    other: int  # anything else
    seconds: float
    paced: int = 0  # requests held for their origin's share (usage_reports.paced, every agent)
    pace_timeouts: int = 0  # of those, let through when PACE_MAX_WAIT_S ran out


async def send(http: aiohttp.ClientSession, url: str, token: str) -> str:
    try:
        async with http.post(f"{url}/v1/chat/completions", json=CHAT,
                             headers={"Authorization": f"Bearer {token}"}) as r:
            await r.read()
            if r.status == 200:
                return "admitted"
            if r.status == 429 and all(h in r.headers for h in HEADERS):
                return "refused"
            return "other"
    except (aiohttp.ClientError, TimeoutError):  # a host too loaded to answer in 30 s
        return "other"


async def trial(agents: list[Agent], issuer_key: Path, origins: int, mode: str, limit: int) -> Trial | None:
    token = ctl("keys", "issue", "--issuer-key", str(issuer_key), "--tenant", "bench", "--audience", AUDIENCE,
                "--rpm", str(limit))
    left = 60 - time.time() % 60
    if left < WINDOW_LEFT_S:
        await asyncio.sleep(left + 0.05)
    urls = [a.url for a in agents[:origins]]
    total = 2 * limit
    outcomes: list[str] = []
    started = time.monotonic()
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0),
                                     timeout=aiohttp.ClientTimeout(total=30)) as http:
        if mode == "sequential":
            for i in range(total):
                outcomes.append(await send(http, urls[i % origins], token))
        elif mode == "per-origin":
            async def client(o: int) -> list[str]:
                return [await send(http, urls[o], token) for _ in range(o, total, origins)]
            outcomes = [x for part in await asyncio.gather(*(client(o) for o in range(origins))) for x in part]
        else:  # burst
            outcomes = list(await asyncio.gather(*(send(http, urls[i % origins], token) for i in range(total))))
    seconds = time.monotonic() - started
    if int((time.time() - seconds) // 60) != int(time.time() // 60):
        return None  # it crossed a window boundary: the caller runs it again
    return Trial(origins, mode, outcomes.count("admitted"), outcomes.count("refused"), outcomes.count("other"),
                 seconds)


def report_counters(agents: list[Agent]) -> dict[str, int]:
    sums: dict[str, int] = {}
    for agent in agents:
        for name, value in agent.status()["usage_reports"].items():
            if isinstance(value, int):
                sums[name] = sums.get(name, 0) + value
    return sums


async def run(args: argparse.Namespace, agents: list[Agent], issuer_key: Path) -> list[Trial]:
    trials = []
    for origins in args.origins:
        for mode in args.modes:
            if origins == 1 and mode == "per-origin":
                continue  # the same as sequential with one origin
            for _ in range(args.trials):
                before = report_counters(agents)
                t = await trial(agents, issuer_key, origins, mode, args.limit)
                if t is None:
                    print("  a trial crossed a window boundary: run again", file=sys.stderr)
                    t = await trial(agents, issuer_key, origins, mode, args.limit)
                    if t is None:
                        raise SystemExit("a trial crossed a window boundary twice: raise WINDOW_LEFT_S")
                after = report_counters(agents)
                t.paced = after.get("paced", 0) - before.get("paced", 0)
                t.pace_timeouts = after.get("pace_timeouts", 0) - before.get("pace_timeouts", 0)
                print(f"  {origins:>2} origins {mode:<10} admitted {t.admitted:>3} / {args.limit}"
                      f"  ({t.seconds:.1f} s, paced {t.paced}, pace timeouts {t.pace_timeouts})",
                      file=sys.stderr, flush=True)
                trials.append(t)
    return trials


def markdown(args: argparse.Namespace, trials: list[Trial], counters: dict[str, int], setup_s: float,
             total_s: float) -> str:
    load = os.getloadavg()[0]
    command = ("`.venv/bin/python tests/bench/bench_mesh_limits.py --nodes {} --origins {} --limit {} --trials {} "
               "--modes {}`").format(args.nodes, ",".join(map(str, args.origins)), args.limit, args.trials,
                                     ",".join(args.modes))
    lines = [
        "### Mesh-wide limit accuracy (issue 17 item 6)", "",
        f"Command: {command} ({total_s:.0f} s in all, agents up in {setup_s:.0f} s; "
        f"{datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC, load average {load:.1f} at the end).", "",
        f"- {args.nodes} `viiwork-agent` processes on loopback, CA trust, keys on; the first serves `m` on a fake "
        "llama-server, the others forward to it. A fresh key with "
        f"`rpm = {args.limit}` per trial sends {2 * args.limit} requests spread round-robin over the first n agents "
        "(its origins); each origin admits against its own count plus what its peers reported "
        "(agent/peering/usage_share.py).",
        "- `sequential`: one client, one request at a time; `per origin`: one client per origin, all at once, "
        "each one request at a time; `burst`: every request sent at once.",
        "- allowed / limit: requests answered 200 over the key's rpm (1.00 is exact; without sharing each origin "
        f"would admit up to the limit alone, so {2 * args.limit} requests over n >= 2 origins would give 2.00). "
        "`bad refusals`: answers that were neither 200 nor a 429 with Retry-After and the x-ratelimit-* headers "
        "(or none within 30 s).",
        "",
        "| origins | how sent | trials | allowed / limit mean | min | max | bad refusals | seconds per trial |",
        "|---:|---|---:|---:|---:|---:|---:|---:|",
    ]
    groups: dict[tuple[int, str], list[Trial]] = {}
    for t in trials:
        groups.setdefault((t.origins, t.mode), []).append(t)
    for (origins, mode), group in groups.items():
        ratios = [t.admitted / args.limit for t in group]
        lines.append(f"| {origins} | {mode} | {len(group)} | {statistics.mean(ratios):.2f} | {min(ratios):.2f} | "
                     f"{max(ratios):.2f} | {sum(t.other for t in group)} | "
                     f"{statistics.mean(t.seconds for t in group):.1f} |")
    wanted = ("reports_out", "reports_in", "push_failed", "ignored_stale", "ignored_window", "paced", "pace_timeouts")
    lines += ["", "Usage reports over the run, summed over the agents (`/v1/status` `usage_reports`): "
              + ", ".join(f"{name} {counters.get(name, 0)}" for name in wanted) + ".", ""]
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nodes", type=int, default=10)
    parser.add_argument("--origins", type=lambda s: [int(x) for x in s.split(",")], default=[1, 3, 10])
    parser.add_argument("--limit", type=int, default=30)
    parser.add_argument("--trials", type=int, default=3)
    parser.add_argument("--modes", type=lambda s: s.split(","), default=["sequential", "per-origin", "burst"])
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    if max(args.origins) > args.nodes:
        parser.error("--origins may not name more origins than --nodes")
    # A SIGTERM (run_all's budget, a timeout) stops the agents on the way out, as Ctrl-C does.
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    begun = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="viiwork-bench-limits-") as name, ExitStack() as stack:
        tmp = Path(name)
        ctl("keys", "issuer", "init", "--out", str(tmp / "issuer"))
        issuer_key, pub = tmp / "issuer" / "issuer.key", tmp / "issuer" / "issuer.pub"
        reader = ctl("keys", "issue", "--issuer-key", str(issuer_key), "--tenant", "bench", "--audience", AUDIENCE,
                     "--scope", "inference,read")
        ca = tmp / "ca"
        ctl("mesh", "ca", "init", "--out", str(ca))
        binary = fake_engine_binary(tmp / "bin")
        auth = {"mode": "keys", "issuer_keys": str(pub), "audience": AUDIENCE}
        agents: list[Agent] = []
        seed: list[str] = []
        for i in range(args.nodes):
            node = f"node-{i:02d}"
            (tmp / node).mkdir(mode=0o700)
            ctl("mesh", "enroll", "--ca", str(ca), "--state-dir", str(tmp / node), "--name", node)
            models = [{"name": "m", "engine": "llamacpp", "path": "/dev/null", "parallel": 8, "backends": 1,
                       "llamacpp": {"binary": str(binary)}}] if i == 0 else []
            agent = stack.enter_context(run_agent(tmp, models, name=node, api_key=reader,
                                                  extra={"mesh": mesh_section(ca, seed), "auth": auth}))
            if i == 0:
                seed = [agent.wait_for(lambda d: bool(d["mesh"]["self"]["mesh"]), 30, "mesh address")
                        ["mesh"]["self"]["mesh"]]
            agents.append(agent)
        agents[0].wait_healthy("m")
        for agent in agents:
            agent.wait_for(lambda d: d["mesh"]["peers"].get("alive", 0) == args.nodes - 1, 60, "every peer alive")
        setup_s = time.monotonic() - begun
        trials = asyncio.run(run(args, agents, issuer_key))
        text = markdown(args, trials, report_counters(agents), setup_s, time.monotonic() - begun)
    if args.out:
        args.out.write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
