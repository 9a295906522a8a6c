"""Revocation spread time on real agents: how long after one node is handed a revocation list
every node of a 3-node mesh refuses the revoked key (issue 17 item 2; docs/security.md,
"Revocation across the mesh").

Not a test. Setup (as tests/mesh/test_agents_revocations.py does it): a mesh CA and three
``viiwork-agent`` processes on loopback in CA mode with ``[auth] mode = "keys"``, no models,
seeds (the first agent's mesh address), mesh gossip and failure-detection settings at their
defaults. An issuer (``viiworkctl keys``, run in this process).

Per round (``--rounds``, 20): issue a key, check all three nodes take it, write the next
list with that key revoked (``keys revoke``), then hand it to node A through its admin
socket (the request ``viiworkctl keys push-revocations`` sends, from this process: the time
of the CLI's own Python start is left out) and poll every node's ``GET /v1/models`` with the
key, each every ``--poll-ms`` (2 ms) from the moment the request leaves, until it answers
401. Per node: the time from sending the list to the first 401. Spread time of a round: the
slowest node's. Also: the admin call's own time (A takes the list, pushes it to both peers and
answers once they did).

Then once, the catch-up path: node C is stopped, ``--rounds-offline`` (3) lists are pushed at
A, C is started again, and the time from C's API answering to C refusing the last key is
measured, and from C's process start (C fetches the list from a peer publishing a higher version: its first summaries
arrive within a gossip interval).

Prints a Markdown section. About 40 s on a 2-core VM.

Usage: .venv/bin/python tests/bench/bench_revocations.py [--rounds 20] [--poll-ms 2]
"""

from __future__ import annotations

import argparse
import asyncio
import io
import shutil
import statistics
import sys
import tempfile
import time
from contextlib import ExitStack, redirect_stderr, redirect_stdout
from pathlib import Path

import aiohttp

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))  # tests/ for support.*

from support.agent import Agent, run_agent  # noqa: E402
from support.client_keys import jti_of  # noqa: E402
from viiwork.agent.cli import main as viiworkctl  # noqa: E402
from viiwork.agent.cli.control import call  # noqa: E402
from viiwork.agent.control import BY_NAME  # noqa: E402

AUDIENCE = "bench-revocations"
NAMES = ("node-a", "node-b", "node-c")


def ctl(*args: str) -> str:
    out, err = io.StringIO(), io.StringIO()
    with redirect_stdout(out), redirect_stderr(err):
        code = viiworkctl(list(args))
    if code != 0:
        raise RuntimeError(f"viiworkctl {' '.join(args)}: {err.getvalue()}")
    return out.getvalue()


def mesh_section(tmp: Path, seeds: list[str]) -> dict:
    return {"trust": "ca", "ca_certificate": str(tmp / "ca" / "ca.crt"), "listen": "127.0.0.1:0",
            "advertise": "127.0.0.1", "discovery": ["seeds"], "seeds": seeds}


async def first_refusal_s(http: aiohttp.ClientSession, agent: Agent, token: str, began: float, poll_s: float,
                          limit_s: float = 30.0) -> float:
    """Seconds from ``began`` to the first 401 of ``agent`` for ``token``."""
    while time.perf_counter() - began < limit_s:
        async with http.get(f"{agent.url}/v1/models", headers={"Authorization": f"Bearer {token}"}) as resp:
            await resp.read()
            if resp.status == 401:
                return time.perf_counter() - began
            if resp.status != 200:
                raise RuntimeError(f"{agent.url}: {resp.status}")
        await asyncio.sleep(poll_s)
    raise RuntimeError(f"{agent.url} still takes the key after {limit_s} s")


async def one_round(http: aiohttp.ClientSession, agents: dict[str, Agent], key: Path, tmp: Path, n: int,
                    poll_s: float) -> tuple[dict[str, float], float]:
    token = ctl("keys", "issue", "--issuer-key", str(key), "--tenant", "t", "--audience", AUDIENCE).strip()
    out = tmp / f"list-{n}.jwt"
    ctl("keys", "revoke", "--issuer-key", str(key), "--id", jti_of(token), "--out", str(out))
    body = out.read_bytes().strip()
    began = time.perf_counter()
    pushed = asyncio.create_task(asyncio.to_thread(
        call, agents["node-a"].state_dir / "admin.sock", BY_NAME["push-revocations"], None, 30.0, body=body))
    times = await asyncio.gather(*(first_refusal_s(http, a, token, began, poll_s) for a in agents.values()))
    status, doc = await pushed
    admin_s = time.perf_counter() - began
    if status != 200 or set(doc["peers"].values()) != {"taken"}:
        raise RuntimeError(f"push: {status} {doc}")
    return dict(zip(agents, times, strict=True)), admin_s


def ms(values: list[float]) -> str:
    return f"{statistics.median(values) * 1000:.1f} / {max(values) * 1000:.1f}"


async def main_async(args: argparse.Namespace) -> None:
    tmp = Path(tempfile.mkdtemp(prefix="viiwork-bench-revocations-", dir="/tmp"))
    try:
        ctl("mesh", "ca", "init", "--out", str(tmp / "ca"))
        for name in NAMES:
            (tmp / name).mkdir(mode=0o700)
            ctl("mesh", "enroll", "--ca", str(tmp / "ca"), "--state-dir", str(tmp / name), "--name", name)
        ctl("keys", "issuer", "init", "--out", str(tmp / "issuer"))
        key = tmp / "issuer" / "issuer.key"
        read_key = ctl("keys", "issue", "--issuer-key", str(key), "--tenant", "ops", "--audience", AUDIENCE,
                       "--scope", "inference,read").strip()
        auth = {"mode": "keys", "issuer_keys": str(tmp / "issuer" / "issuer.pub"), "audience": AUDIENCE}
        with ExitStack() as stack:
            agents: dict[str, Agent] = {}
            seeds: list[str] = []
            node_stacks: dict[str, ExitStack] = {}

            def start(name: str) -> Agent:
                node = ExitStack()
                agents[name] = node.enter_context(run_agent(tmp, [], name=name, api_key=read_key, extra={
                    "mesh": mesh_section(tmp, seeds), "auth": auth}))
                node_stacks[name] = node
                stack.callback(node.close)
                return agents[name]

            seeds.append(start("node-a").wait_for(lambda d: bool(d["mesh"]["self"]["mesh"]), 30, "mesh")
                         ["mesh"]["self"]["mesh"])
            start("node-b")
            start("node-c")
            for agent in agents.values():
                agent.wait_for(lambda d: d["mesh"]["peers"].get("alive", 0) == 2, 60, "two peers alive")
            per_node: dict[str, list[float]] = {n: [] for n in NAMES}
            spread: list[float] = []
            admin: list[float] = []
            async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as http:
                for n in range(1, args.rounds + 1):
                    times, admin_s = await one_round(http, agents, key, tmp, n, args.poll_ms / 1000)
                    for name, t in times.items():
                        per_node[name].append(t)
                    spread.append(max(times.values()))
                    admin.append(admin_s)
                # The catch-up path: C offline while lists are pushed, then started again.
                node_stacks.pop("node-c").close()
                del agents["node-c"]
                agents["node-a"].wait_for(lambda d: d["mesh"]["peers"].get("alive", 0) == 1, 60, "C gone")
                last = ""
                for n in range(args.rounds + 1, args.rounds + 1 + args.rounds_offline):
                    last = ctl("keys", "issue", "--issuer-key", str(key), "--tenant", "t", "--audience",
                               AUDIENCE).strip()
                    out = tmp / f"list-{n}.jwt"
                    ctl("keys", "revoke", "--issuer-key", str(key), "--id", jti_of(last), "--out", str(out))
                    status, doc = await asyncio.to_thread(call, agents["node-a"].state_dir / "admin.sock",
                                                          BY_NAME["push-revocations"], None, 30.0,
                                                          body=out.read_bytes().strip())
                    if status != 200:
                        raise RuntimeError(f"push: {status} {doc}")
                spawned = time.perf_counter()
                c = await asyncio.to_thread(start, "node-c")  # returns once C's API answers
                began = time.perf_counter()
                catch_up = await first_refusal_s(http, c, last, began, args.poll_ms / 1000)
                from_spawn = time.perf_counter() - spawned
        print("### Revocation spread time (3 nodes, loopback)\n")
        print(f"{args.rounds} lists pushed at node A through its admin socket; each node polled every "
              f"{args.poll_ms:g} ms with the revoked key. Milliseconds, median / max.\n")
        print("| measured | median / max (ms) |")
        print("|---|---|")
        for name in NAMES:
            print(f"| {name} refuses the key | {ms(per_node[name])} |")
        print(f"| **spread time: all three refuse** | **{ms(spread)}** |")
        print(f"| admin call (A takes the list, pushes to B and C, answers) | {ms(admin)} |")
        print(f"| catch-up: C started after {args.rounds_offline} pushes it missed, from its API answering to "
              f"refusing | {catch_up * 1000:.0f} (one run) |")
        print(f"| the same from C's process start (its own start included) | {from_spawn * 1000:.0f} (one run) |")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--rounds-offline", type=int, default=3)
    parser.add_argument("--poll-ms", type=float, default=2.0)
    asyncio.run(main_async(parser.parse_args()))


if __name__ == "__main__":
    main()
