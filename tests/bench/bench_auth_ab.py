"""Where client keys' latency goes (issue 17): the gate alone, then whole agents, A/B/A/B.

usage: .venv/bin/python tests/bench/bench_auth_ab.py [-n 300] [--rounds 10]

1. A minimal aiohttp app (``--serve``, a subprocess each) answering a fixed chat completion:
   without the gate, with the gate's middleware only, with middleware and ``admit``, and the
   whole gate (middleware, ``admit``, the ``on_response_prepare`` hook); a second keys-off app
   is the A/A control. What the gate's mechanics add to one request at c=1.
2. Four agents of this tree (bench_overhead.py's config, each with its own instant engine):
   keys off, keys on, keys off, keys on. Every request carries an ``Authorization`` header of
   the same length (the keys-off agents ignore it), and the order of the agents rotates each
   round, so neither the header's size nor a position in the round favours one mode.

c=1, blocking raw-socket client (bench_overhead.RawClient), pooled samples; p10, p25 and p50
of the total time. Prints a Markdown table.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))  # tests/ for support.*

import bench_overhead as bo  # noqa: E402

from support.procs import free_port, stop_process  # noqa: E402

APP_MODES = ("off", "middleware", "middleware+admit", "whole gate", "off")
ANSWER = json.dumps({"id": "x", "object": "chat.completion", "usage": {"total_tokens": 3},
                     "choices": [{"index": 0, "message": {"role": "assistant", "content": "hi"}}]}).encode()


def serve(port: int, mode: str, pub: str) -> None:
    """The minimal app of ``mode`` (one of APP_MODES) on 127.0.0.1:``port``."""
    from aiohttp import web

    from viiwork.agent.auth.gate import AuthGate
    from viiwork.agent.auth.keyset import KeySet
    from viiwork.agent.auth.verifier import Verifier

    gate = None if mode == "off" else AuthGate(Verifier(KeySet.from_path(Path(pub)), issuer="viiwork-issuer",
                                                        audiences=["a"]))

    async def handler(request: web.Request) -> web.StreamResponse:
        payload = json.loads(await request.read())
        if gate is not None and mode != "middleware":
            refusal = gate.admit(request, payload["model"], payload)
            if refusal is not None:
                return refusal
        return web.Response(body=ANSWER, content_type="application/json")

    app = web.Application(middlewares=[gate.middleware] if gate is not None else [])
    if gate is not None and mode == "whole gate":
        app.on_response_prepare.append(gate.on_response_prepare)
    app.router.add_post(bo.PATH, handler)
    web.run_app(app, host="127.0.0.1", port=port, print=None, access_log=None)


def measure(systems: list[tuple[str, int, dict[str, str]]], n: int, rounds: int) -> dict[str, bo.C1]:
    """c=1 series of every system, interleaved; the order rotates each round."""
    c1 = {name: bo.C1() for name, _, _ in systems}
    for _name, port, headers in systems:
        bo.run_c1(port, 0, False, bo.C1(), 50, headers)
    for r in range(rounds):
        k = r % len(systems)
        for name, port, headers in systems[k:] + systems[:k]:
            bo.run_c1(port, n, False, c1[name], 5, headers)
    return c1


def table(title: str, c1: dict[str, bo.C1]) -> list[str]:
    lines = ["", f"#### {title}", "", "| system | p10 (ms) | p25 (ms) | p50 (ms) | requests | errors |",
             "|---|---|---|---|---|---|"]
    for name, c in c1.items():
        lines.append(f"| {name} | {bo.f_ms(bo.pct(c.total, .1))} | {bo.f_ms(bo.pct(c.total, .25))} | "
                     f"{bo.f_ms(bo.pct(c.total, .5))} | {len(c.total)} | {c.errors} |")
    return lines


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("-n", type=int, default=300, help="requests per system per round")
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--serve", nargs=3, metavar=("PORT", "MODE", "PUB"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.serve:
        serve(int(args.serve[0]), args.serve[1], args.serve[2])
        return 0
    lines = ["### Client keys: the gate alone, then whole agents (issue 17)", "",
             f"Command: `.venv/bin/python tests/bench/bench_auth_ab.py -n {args.n} --rounds {args.rounds}`."]
    with tempfile.TemporaryDirectory(prefix="vw-auth-ab-") as tmp:
        work = Path(tmp)
        token, pub = bo.keys_issuer(work / "apps", "a")
        headers = {"Authorization": f"Bearer {token}"}
        procs: list[subprocess.Popen] = []
        try:
            apps = []
            for i, mode in enumerate(APP_MODES):
                port = free_port()
                procs.append(subprocess.Popen([sys.executable, __file__, "--serve", str(port), mode, str(pub)]))
                bo.wait_post(port, 30, procs[-1], headers)
                apps.append((f"{mode} ({i + 1})", port, headers))
            lines += table("A minimal aiohttp app, with and without the gate", measure(apps, args.n, args.rounds))
        finally:
            for p in procs:
                stop_process(p, 5)
        engine = work / "instant-engine"
        engine.write_text(f"#!/bin/sh\nexec {sys.executable} {HERE / 'instant_upstream.py'} \"$@\"\n")
        engine.chmod(0o755)
        procs = []
        try:
            agents = []
            for i, keyed in enumerate((False, True, False, True)):
                name = f"agent{i + 1}"
                token, pub = bo.keys_issuer(work / name, name)
                port = free_port()
                proc, _ = bo.start_agent(bo.agent_config(work, name, port, engine, True, engine_port=free_port(),
                                                         issuer_pub=pub if keyed else None),
                                         port, work / f"{name}.log")
                procs.append(proc)
                agents.append((f"{name}, keys {'on' if keyed else 'off'}", port,
                               {"Authorization": f"Bearer {token}"}))
                bo.wait_post(port, 30, proc, agents[-1][2])
            lines += table("Four agents, keys off / on / off / on, same header size, rotating order",
                           measure(agents, args.n, args.rounds))
        finally:
            for p in procs:
                stop_process(p, 10)
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
