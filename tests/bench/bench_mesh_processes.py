"""Mesh benchmark with real processes: N MeshNodes on 127.0.0.1, real mutual TLS, real Ed25519.

Each node is tests/support/mesh_runner.py (open trust, seeds only: node 0 is everyone's
seed) with the default settings (probe mode; heartbeat mode: 500 ms rounds, fanout 3,
suspect 2 s, dead 10 s) unless overridden. Every node serves one model of ``--slots`` (8)
slots whose load moves one slot up or down ``--churn-per-s`` (2) times a second at random
(issue 16's realistic load; 0: a quiet mesh). Prints:

- join: time until every node sees every other as alive (after the last process is up);
- change p50/p99: a node (its churn stopped) changes its published load to ``slots - 1`` or
  ``slots`` busy (1 or 0 free: published exactly by the quantiser); time from its publication
  (the publication limit may hold a load change back first: the longest hold is ``held_max``)
  until each other node shows it, noted by each node on its own loop every 5 ms (the
  runner's ``/v1/watch``; times on the host's shared monotonic clock), pooled over 5 changes;
- per node, steady state over ``--steady-s``: CPU (user+sys of the whole process: Python,
  TLS, WebSocket framing, JSON and crypto), bytes sent (the JSON the mesh counts, not TLS and
  framing), frames sent (probe mode's frames written on channels either end opened; messages
  by kind on stderr),
  signature verifications per second, and the share of CPU those verifications cost
  (Ed25519 verify timed here); false suspicions (claims made, per node-hour) and false deaths
  in the window (nobody crashes in it);
- not-alive / dead: from SIGKILL of one node until each other node shows it not alive / dead.

Usage: .venv/bin/python tests/bench/bench_mesh_processes.py [--nodes 10] [--steady-s 20]
       [--detector probe|heartbeat] [--slots 8] [--churn-per-s 2]
"""

from __future__ import annotations

import argparse
import json
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections import Counter
from pathlib import Path

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

RUNNER = Path(__file__).resolve().parent.parent / "support" / "mesh_runner.py"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def get(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=5) as resp:
        return json.load(resp)


def post(url: str, body: dict) -> dict:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=5) as resp:
        return json.load(resp)


def pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(round(q * (len(values) - 1))))] if values else float("nan")


def ed25519_verify_us(n: int = 5000) -> float:
    key = Ed25519PrivateKey.generate()
    pub, data = key.public_key(), b"x" * 600
    sig = key.sign(data)
    started = time.process_time()  # CPU time: a loaded machine inflates wall time, not this
    for _ in range(n):
        pub.verify(sig, data)
    return (time.process_time() - started) / n * 1e6


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nodes", type=int, default=10)
    ap.add_argument("--steady-s", type=float, default=20.0)
    ap.add_argument("--interval-ms", type=int, default=500)
    ap.add_argument("--suspect-ms", type=int, default=2000)
    ap.add_argument("--dead-ms", type=int, default=10000)
    ap.add_argument("--detector", choices=["heartbeat", "probe"], default="probe")
    ap.add_argument("--slots", type=int, default=8)
    ap.add_argument("--churn-per-s", type=float, default=2.0)
    args = ap.parse_args(argv)
    tmp = Path(tempfile.mkdtemp(prefix="mesh-bench-"))
    seed_port = free_port()
    procs, infos = [], []
    try:
        for i in range(args.nodes):
            argv_i = [sys.executable, str(RUNNER), "--state", str(tmp / f"n{i}"), "--name", f"n{i}", "--trust", "open",
                      "--mesh-id", "bench", "--discovery", "seeds", "--model", f"m{i}",
                      "--interval-ms", str(args.interval_ms), "--suspect-ms", str(args.suspect_ms),
                      "--dead-ms", str(args.dead_ms), "--detector", args.detector, "--slots", str(args.slots),
                      "--churn-per-s", str(args.churn_per_s)]
            if i == 0:
                argv_i += ["--mesh-port", str(seed_port)]
            else:
                argv_i += ["--seeds", f"127.0.0.1:{seed_port}"]
            with open(tmp / f"n{i}.log", "wb") as log:
                procs.append(subprocess.Popen(argv_i, stdout=subprocess.PIPE, stderr=log))
        for i, proc in enumerate(procs):  # started together: their imports overlap
            line = proc.stdout.readline()
            if not line:
                raise SystemExit(f"node {i} exited: {(tmp / f'n{i}.log').read_text()[-2000:]}")
            infos.append(json.loads(line))
        urls = [f"http://127.0.0.1:{info['api_port']}" for info in infos]
        up_at = time.monotonic()
        sweeps: list[float] = []

        def briefs(which: list[int], node_id: str | None = None) -> dict[int, dict[str, list]]:
            started = time.monotonic()
            query = "" if node_id is None else f"?id={node_id}"  # one peer: cheap for the node polled
            out = {i: get(urls[i] + "/v1/brief" + query) for i in which}
            sweeps.append(time.monotonic() - started)
            return out

        everyone = list(range(args.nodes))
        said = up_at
        while True:
            seen = briefs(everyone)
            alive = sorted(sum(1 for v in b.values() if v[0] == "alive") for b in seen.values())
            if alive[0] >= args.nodes - 1:
                break
            if time.monotonic() - said > 10:  # progress, on a slow machine
                said = time.monotonic()
                states = Counter(v[0] for b in seen.values() for v in b.values() if v[0] != "alive")
                states["unknown"] = sum(args.nodes - 1 - len(b) for b in seen.values())
                print(f"join: {time.monotonic() - up_at:.0f} s, peers alive per node min {alive[0]} median "
                      f"{alive[len(alive) // 2]} of {args.nodes - 1}; pairs not alive: {dict(states)}", file=sys.stderr)
            if time.monotonic() - up_at > 300:
                raise SystemExit("did not converge in 300 s")
            time.sleep(0.05)
        join_s = time.monotonic() - up_at

        # Capacity changes.
        change_ms: list[float] = []
        held_ms: list[float] = []  # from the local change to its publication (the publication limit)
        slowest: list[tuple[float, int, int]] = []  # (ms, origin, observer)
        for k, origin in enumerate([1, args.nodes // 2, args.nodes - 1, 2, 3]):
            origin %= args.nodes
            node_id = infos[origin]["node_id"]
            seen_busy = get(urls[(origin + 1) % args.nodes] + "/v1/brief")[node_id][1]
            busy = args.slots - 1 if seen_busy == args.slots else args.slots  # 1 or 0 free: exact, and a change
            observers = [i for i in range(args.nodes) if i != origin]
            for i in observers:  # each notes on its own loop when it shows the change
                post(urls[i] + "/v1/watch", {"id": node_id, "busy": busy})
            t_local = time.monotonic()
            answer = post(urls[origin] + "/v1/busy", {"busy": busy})  # answers once published
            t0 = answer["published_at"] if answer.get("published_at") is not None else t_local
            held_ms.append((t0 - t_local) * 1000)
            pending = set(observers)
            while pending and time.monotonic() - t0 < 25:
                for i in sorted(pending):
                    seen_at = get(urls[i] + "/v1/watch")["seen_at"]
                    if seen_at is not None:
                        change_ms.append((seen_at - t0) * 1000)
                        slowest.append((change_ms[-1], origin, i))
                        pending.discard(i)
                time.sleep(0.05)
            if pending:
                print(f"change {k}: {len(pending)} node(s) did not see it within 20 s", file=sys.stderr)

        print("slowest to see a change (ms, origin, observer): "
              + ", ".join(f"({ms:.0f}, n{o}, n{i})" for ms, o, i in sorted(slowest, reverse=True)[:6]), file=sys.stderr)
        if args.churn_per_s > 0:  # the origins churn again for the steady window
            for origin in {o % args.nodes for o in (1, args.nodes // 2, args.nodes - 1, 2, 3)}:
                post(urls[origin] + "/v1/busy", {"busy": args.slots // 2, "churn": True})

        # Steady state cost.
        before = [get(u + "/v1/counters") for u in urls]
        time.sleep(args.steady_s)
        after = [get(u + "/v1/counters") for u in urls]
        cpu = [(a["cpu_s"] - b["cpu_s"]) / args.steady_s for a, b in zip(after, before, strict=True)]
        sent = [(a["bytes_out"] - b["bytes_out"]) / args.steady_s for a, b in zip(after, before, strict=True)]
        verif = [(a["verifications"]["signature"] - b["verifications"]["signature"]) / args.steady_s
                 for a, b in zip(after, before, strict=True)]
        verify_us = ed25519_verify_us()
        frames = [(a["transport"].get("probe_sent", 0) - b["transport"].get("probe_sent", 0)) / args.steady_s
                  for a, b in zip(after, before, strict=True)]  # probe-mode frames written, both channel ends
        def probe_count(c: dict, name: str) -> int:
            return c.get("probe", {}).get(name, 0)

        # Nobody crashed in the window: every suspicion raised and every death declared is false.
        pairs = list(zip(after, before, strict=True))
        suspicions = sum(probe_count(a, "claims_made") - probe_count(b, "claims_made") for a, b in pairs)
        deaths = sum(probe_count(a, "detector_deaths") - probe_count(b, "detector_deaths") for a, b in pairs)
        kinds = sorted({k for a in after for k in a["messages_out"]})
        by_kind = {k: round(statistics.mean((a["messages_out"].get(k, 0) - b["messages_out"].get(k, 0)) / args.steady_s
                                            for a, b in zip(after, before, strict=True)), 2) for k in kinds}
        opened = statistics.mean(a["transport"].get("channels_opened", 0) - b["transport"].get("channels_opened", 0)
                                 for a, b in pairs)
        abandoned = sum(probe_count(a, "pulls_abandoned") - probe_count(b, "pulls_abandoned") for a, b in pairs)
        pulled = sum(probe_count(a, "pulls_sent") - probe_count(b, "pulls_sent") for a, b in pairs)
        print(f"messages sent per node per second, by kind: {by_kind}; channels opened per node in the window: "
              f"{opened:.1f}; pulls abandoned after every attempt: {abandoned} of {pulled}", file=sys.stderr)

        # Crash detection.
        victim = args.nodes - 1
        victim_id = infos[victim]["node_id"]
        procs[victim].send_signal(signal.SIGKILL)
        procs[victim].wait(10)
        t_kill = time.monotonic()
        not_alive: dict[int, float] = {}
        dead: dict[int, float] = {}
        while len(dead) < args.nodes - 1 and time.monotonic() - t_kill < max(args.dead_ms / 1000, 15) + 30:
            for i in range(args.nodes - 1):
                liveness = get(urls[i] + f"/v1/brief?id={victim_id}")[victim_id][0]
                now_ms = (time.monotonic() - t_kill) * 1000
                if liveness != "alive":
                    not_alive.setdefault(i, now_ms)
                if liveness == "dead":
                    dead.setdefault(i, now_ms)
            time.sleep(0.02)

        rows = {
            "detector": args.detector, "nodes": args.nodes, "churn_per_s": args.churn_per_s,
            "join_s": round(join_s, 2), "sweep_ms": round(1000 * statistics.median(sweeps)),
            "held_max_ms": round(max(held_ms)),
            "change_p50_ms": round(pct(change_ms, 0.5)), "change_p99_ms": round(pct(change_ms, 0.99)),
            "cpu_per_node_%": round(100 * statistics.mean(cpu), 2),
            "bytes_sent_per_node_s": round(statistics.mean(sent)),
            "frames_sent_per_node_s": round(statistics.mean(frames), 1),
            "sig_verif_per_node_s": round(statistics.mean(verif), 1),
            "false_susp_per_node_h": round(suspicions / args.nodes / (args.steady_s / 3600), 1),
            "false_deaths": deaths,
            "ed25519_verify_us": round(verify_us, 1),
            "verify_cpu_%": round(100 * statistics.mean(verif) * verify_us / 1e6, 3),
            "not_alive_p50_ms": round(pct(list(not_alive.values()), 0.5)),
            "not_alive_p99_ms": round(pct(list(not_alive.values()), 0.99)),
            "dead_p50_ms": round(pct(list(dead.values()), 0.5)), "dead_p99_ms": round(pct(list(dead.values()), 0.99)),
        }
        print("| " + " | ".join(rows) + " |")
        print("|" + "---|" * len(rows))
        print("| " + " | ".join(str(v) for v in rows.values()) + " |")
    except BaseException:
        print(f"the nodes' state directories and logs are kept in {tmp}", file=sys.stderr)
        raise
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in procs:
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(5)
    shutil.rmtree(tmp, ignore_errors=True)  # keys and logs of a run that went through
    return 0


if __name__ == "__main__":
    sys.exit(main())
