"""Mesh simulation benchmark: convergence, failure detection and cost at N simulated nodes.

Runs the real protocol core (viiwork.mesh.membership) for N nodes in virtual time with the
counting fake signer (viiwork.mesh.sim), default settings (docs/configuration.md: 500 ms rounds,
fanout 3, suspect 2 s / dead 10 s as floors), and prints one table row per (N, loss):

- join: virtual time until every node holds every other as alive, from a cold start where
  each node knows two random seeds plus node 0;
- change p50/p99/max: time from a capacity change at one node until each other node holds
  it (all observers of three changes pooled);
- not-alive p50/p99 and dead p50/p99: time from a node's death until each other node stops
  considering it alive (suspect) / declares it dead (three deaths pooled; exact from each
  observer's heard_at, the same value its router reads); still_alive: observers that
  still consider a victim alive at the end (should be 0);
- bytes/node/s, msgs/node/s, sig-verif/node/s, sign/node/s: steady state over 3 s;
- false suspicions: live nodes seen as suspect by anyone, per node per hour;
- cpu s: wall time of the simulation itself.

Usage: .venv/bin/python tests/bench/bench_mesh_sim.py [--sizes 10,100,1000] [--loss 0,0.05]
       [--no-scale] [--seed 1]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

from viiwork.mesh.membership import GossipSettings, Liveness
from viiwork.mesh.sim import Simulator
from viiwork.mesh.summary import ModelCapacity


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    values = sorted(values)
    return values[min(len(values) - 1, max(0, int(round(q * (len(values) - 1)))))]


def run(n: int, loss: float, seed: int, scale: bool) -> dict[str, float]:
    started = time.perf_counter()
    settings = GossipSettings(scale_with_size=scale)
    sim = Simulator(n, settings=settings, seed=seed, loss=loss)
    ok = sim.run_until_true(sim.converged, 120_000, 100)
    join_ms = sim.now if ok else float("nan")
    sim.run_for(1000)  # settle (tables full, timeouts scaled)

    false_suspicions: list[tuple[int, str]] = []
    down: set[str] = set()

    def on_liveness(node, origin, old, new):
        if new is Liveness.SUSPECT and origin not in down:
            false_suspicions.append((node.index, origin))

    sim.liveness_watchers.append(on_liveness)
    before = sim.totals()
    steady_ms = 3000
    sim.run_for(steady_ms)
    after = sim.totals()
    per_node_s = n * steady_ms / 1000
    cost = {k: (after[k] - before[k]) / per_node_s for k in after}

    # Capacity changes at three nodes at once.
    origins = [1, n // 2, n - 1]
    targets = {}
    arrivals: dict[tuple[int, int], float] = {}
    t0 = sim.now
    for i in origins:
        models = (ModelCapacity("changed", "llamacpp", "chat", 8, 3, None, 4096, 2, 2, "fp"),)
        targets[sim.nodes[i].node_id] = (i, sim.set_models(i, models))

    def on_update(node, origin):
        if origin in targets:
            i, order = targets[origin]
            key = (node.index, i)
            if key not in arrivals and node.membership.records[origin].order >= order:
                arrivals[key] = sim.now - t0

    sim.watchers.append(on_update)
    sim.run_until_true(lambda: len(arrivals) >= len(origins) * (n - 1), 30_000, 100)
    change = list(arrivals.values())
    missed_changes = len(origins) * (n - 1) - len(arrivals)

    # Three nodes die at once.
    victims = [2 % n, (n // 2 + 1) % n, (n - 2) % n]
    victims = list(dict.fromkeys(victims))
    t_kill = sim.now
    for v in victims:
        down.add(sim.nodes[v].node_id)
        sim.kill(v)
    observers = sim.up_nodes()
    # Liveness is a pure function of heard_at (the newest publication an observer knows
    # of), which stops changing once the victims' last summaries have spread: run until
    # every observer has stopped considering them alive, then read the dead times off
    # heard_at + dead_ms instead of simulating the remaining seconds.
    suspect_ms = max(o.membership.suspect_ms for o in observers)
    sim.run_for(suspect_ms + 2500)
    not_alive, dead = [], []
    for o in observers:
        for v in victims:
            heard = sim.heard_at_global(o, sim.nodes[v])
            not_alive.append(heard + o.membership.suspect_ms - t_kill)
            dead.append(heard + o.membership.dead_ms - t_kill)
    still_alive = sum(1 for o in observers for v in victims if sim.view_of(o.index, v) is Liveness.ALIVE)
    hours = (sim.now - t0 + steady_ms) / 3_600_000
    return {
        "n": n, "loss": loss, "join_ms": join_ms,
        "change_p50": pct(change, 0.5), "change_p99": pct(change, 0.99), "change_max": max(change, default=float("nan")),
        "missed_changes": missed_changes,
        "not_alive_p50": pct(not_alive, 0.5), "not_alive_p99": pct(not_alive, 0.99),
        "dead_p50": pct(dead, 0.5), "dead_p99": pct(dead, 0.99), "still_alive": still_alive,
        "suspect_ms": statistics.mean(o.membership.suspect_ms for o in observers),
        "bytes_node_s": cost["bytes"], "msgs_node_s": cost["messages"],
        "verif_node_s": cost["signature_verifications"], "sign_node_s": cost["signatures"],
        "false_susp_node_h": len(false_suspicions) / n / hours,
        "cpu_s": time.perf_counter() - started,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="10,100,1000")
    ap.add_argument("--loss", default="0,0.05")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--no-scale", action="store_true", help="fixed suspect/dead thresholds (no log(N) floor)")
    args = ap.parse_args(argv)
    cols = ["n", "loss", "join_ms", "change_p50", "change_p99", "change_max", "missed_changes", "suspect_ms",
            "not_alive_p50", "not_alive_p99", "dead_p50", "dead_p99", "still_alive", "bytes_node_s",
            "msgs_node_s", "verif_node_s", "sign_node_s", "false_susp_node_h", "cpu_s"]
    print("| " + " | ".join(cols) + " |")
    print("|" + "---|" * len(cols))
    for n in (int(x) for x in args.sizes.split(",")):
        for loss in (float(x) for x in args.loss.split(",")):
            row = run(n, loss, args.seed, not args.no_scale)
            print("| " + " | ".join(_fmt(row[c]) for c in cols) + " |", flush=True)
    return 0


def _fmt(v: float) -> str:
    if isinstance(v, float):
        return f"{v:.0f}" if abs(v) >= 100 or v == 0 else f"{v:.2f}"
    return str(v)


if __name__ == "__main__":
    sys.exit(main())
