"""Issue 16's goals table in the simulator: heartbeat mode (today) against probe mode.

Both modes run the real protocol code (viiwork.mesh.membership; probe mode adds
viiwork.mesh.probing over the detector, broadcast queue and quantiser) for N nodes in virtual
time with the counting fake signer (viiwork.mesh.sim), 1 ms one-way latency, under a realistic
load: every node serves one model with 8 slots, and requests start and end at random
(a Poisson process of 2 changes per second per node, each +1 or -1 busy slot), so every
node's free-slot count changes about twice a second. One table row per (mode, N, loss):

- join: from a cold start (each node knows two random seeds plus node 0) until every node
  holds every other as alive;
- bytes/node/s by what they carry, over the steady window: probe (ping, ack, ping-req,
  nack), news (gossip, pull and the pushes that answer pulls: in probe mode a push answers
  a pull or a digest's reply; both are counted under ``dissem``), anti-entropy (digest,
  reply, push of the exchange); heartbeat mode has only the exchange;
- verif/node/s: signature verifications per node per second (steady window);
- pub/node/s: summaries each node signed per second;
- seen p50/p99: from each publication in the steady window until each other node holds it
  (or a newer version), all (observer, publication) pairs pooled: bench_mesh_sim.py's
  "change" figure, issue 16's "seen by all"; all p50/p99: per publication, until the last
  observer holds it (stricter: one observer in a hundred that waits for anti-entropy sets it);
  seen_n: publications measured, unseen: those some observer still lacked at the end;
- not alive p50/p99 and dead p99: from the crash of three nodes (``--crashes``) at once until each observer stops
  considering a victim alive (stops routing to it) / declares it dead;
- false susp. / false deaths per node-hour: live nodes seen as suspect / dead by anyone.

Sizes are estimates (``estimate_size``; about 10% above the encoded size in probe mode)
unless ``--wire`` encodes every message (exact, slower).

Wants and offers (point-to-point, docs/routing.md) are not simulated here: their bytes are
in bench_offers_agents.py and the routing simulation in bench_routing_sim.py.

Usage: .venv/bin/python tests/bench/bench_swim_sim.py [--sizes 10,100] [--loss 0,0.05]
       [--modes heartbeat,probe] [--steady-s 20] [--seed 1] [--big]   (--big adds N = 1000)
"""

from __future__ import annotations

import argparse
import sys
import time
from collections import defaultdict
from typing import Any

from viiwork.mesh.identity import NodeId
from viiwork.mesh.membership import Liveness
from viiwork.mesh.sim import SimNode, Simulator
from viiwork.mesh.summary import ModelCapacity

SLOTS = 8
CHANGES_PER_S = 2.0
_KINDS = {"ping": "probe", "ack": "probe", "pingreq": "probe", "nack": "probe", "gossip": "dissem",
          "pull": "dissem", "push": "dissem", "loads": "dissem", "digest": "sync", "reply": "sync"}


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    values = sorted(values)
    return values[min(len(values) - 1, max(0, int(round(q * (len(values) - 1)))))]


def model(i: int, busy: int) -> tuple[ModelCapacity, ...]:
    return (ModelCapacity(name=f"model-{i % 5}", engine="llamacpp", kind="chat", slots=SLOTS, busy=busy,
                          waiting=0, ctx_per_slot=4096, healthy=1, total=1, fingerprint=f"fp-{i % 5}"),)


class Load:
    """Requests starting and ending at every node: ``CHANGES_PER_S`` changes per node per s."""

    def __init__(self, sim: Simulator) -> None:
        self.sim = sim
        self.busy = [sim.rng.randrange(SLOTS + 1) for _ in sim.nodes]
        for node in sim.nodes:
            sim.set_load(node.index, model(node.index, self.busy[node.index]))
            self._next(node)

    def _next(self, node: SimNode) -> None:
        self.sim.at(self.sim.now + self.sim.rng.expovariate(CHANGES_PER_S) * 1000, lambda: self._change(node))

    def _change(self, node: SimNode) -> None:
        if node.up:
            b = self.busy[node.index]
            b = b + 1 if (b == 0 or (b < SLOTS and self.sim.rng.random() < 0.5)) else b - 1
            self.busy[node.index] = b
            self.sim.set_load(node.index, model(node.index, b))
        self._next(node)


class Seen:
    """Publication -> seen by every other up node, per publication."""

    def __init__(self, sim: Simulator) -> None:
        self.sim = sim
        self.active = False
        self.pending: dict[NodeId, list[list[Any]]] = defaultdict(list)  # origin -> [order, t, count]
        self.last: dict[tuple[int, NodeId], tuple[int, int]] = {}
        self.latencies: list[float] = []  # per publication, until the last observer has it
        self.each: list[float] = []  # per (observer, publication): today's "change" figure
        self.unfinished = 0
        for node in sim.nodes:
            self._wrap(node)
        sim.watchers.append(self._on_update)

    def _wrap(self, node: SimNode) -> None:
        m = node.membership
        publish = m.publish

        def publish_and_note(summary: Any) -> None:
            publish(summary)
            if self.active:
                self.pending[node.node_id].append([summary.payload.order, self.sim.now, 0])

        m.publish = publish_and_note  # type: ignore[method-assign]
        if node.probe is not None:  # probe mode: a load change goes out as a load record
            def record_and_note(origin: NodeId, record: Any) -> None:
                if self.active and origin == node.node_id:
                    self.pending[origin].append([record.order, self.sim.now, 0])

            node.probe.on_load.append(record_and_note)

    def _on_update(self, observer: SimNode, origin: NodeId) -> None:
        order = self.sim.version_of(observer, origin)  # the newer of summary and load record
        if origin == observer.node_id or order is None:
            return
        key = (observer.index, origin)
        before = self.last.get(key, (0, 0))
        self.last[key] = max(before, order)
        pubs = self.pending.get(origin)
        if not pubs:
            return
        need = len(self.sim.up_nodes()) - 1
        for pub in list(pubs):
            if before < pub[0] <= order:
                pub[2] += 1
                self.each.append(self.sim.now - pub[1])
                if pub[2] >= need:
                    self.latencies.append(self.sim.now - pub[1])
                    pubs.remove(pub)

    def close(self) -> None:
        self.active = False
        self.unfinished = sum(len(p) for p in self.pending.values())


def run(mode: str, n: int, loss: float, seed: int, steady_s: float, crashes: int = 3,
        wire: bool = False) -> dict[str, Any]:
    started = time.perf_counter()
    sim = Simulator(n, seed=seed, loss=loss, mode=mode, models=lambda i: model(i, 0), wire=wire)
    seen = Seen(sim)
    Load(sim)
    ok = sim.run_until_true(sim.converged, 120_000, 100)
    join_ms = sim.now if ok else float("nan")
    sim.run_for(3000)  # settle

    down: set[NodeId] = set()
    false_susp: list[tuple[int, str]] = []
    false_dead: list[tuple[int, str]] = []
    not_alive_at: dict[tuple[int, NodeId], float] = {}
    dead_at: dict[tuple[int, NodeId], float] = {}

    def on_liveness(node: SimNode, origin: NodeId, old: Liveness, new: Liveness) -> None:
        if origin in down:
            if new in (Liveness.SUSPECT, Liveness.DEAD):
                not_alive_at.setdefault((node.index, origin), sim.now)
            if new is Liveness.DEAD:
                dead_at.setdefault((node.index, origin), sim.now)
        elif new is Liveness.SUSPECT:
            false_susp.append((node.index, origin))
        elif new is Liveness.DEAD:
            false_dead.append((node.index, origin))

    sim.liveness_watchers.append(on_liveness)
    before = sim.totals()
    kinds_before = _kinds(sim)
    seen.active = True
    t_steady = sim.now
    steady_ms = steady_s * 1000
    sim.run_for(steady_ms)
    seen.close()
    sim.run_for(2000)  # let the window's last publications land
    after = sim.totals()
    kinds_after = _kinds(sim)
    per_node_s = n * (sim.now - t_steady) / 1000
    cost = {k: (after[k] - before[k]) / per_node_s for k in after}
    kinds = {k: (kinds_after.get(k, 0) - kinds_before.get(k, 0)) / per_node_s for k in kinds_after}

    victims = list(dict.fromkeys([2 % n, (n // 2 + 1) % n, (n - 2) % n]))[:crashes]
    t_kill = sim.now
    for v in victims:
        down.add(sim.nodes[v].node_id)
        sim.kill(v)
    observers = sim.up_nodes()
    if mode == "heartbeat":
        suspect_ms = max(o.membership.suspect_ms for o in observers)
        sim.run_for(suspect_ms + 2500)
        not_alive, dead = [], []
        for o in observers:  # liveness is a function of heard_at: exact, as bench_mesh_sim.py
            for v in victims:
                heard = sim.heard_at_global(o, sim.nodes[v])
                assert heard is not None
                not_alive.append(heard + o.membership.suspect_ms - t_kill)
                dead.append(heard + o.membership.dead_ms - t_kill)
    else:
        pairs = [(o.index, sim.nodes[v].node_id) for o in observers for v in victims]
        sim.run_until_true(lambda: all(p in dead_at for p in pairs), 120_000, 100)
        not_alive = [not_alive_at[p] - t_kill for p in pairs if p in not_alive_at]
        dead = [dead_at[p] - t_kill for p in pairs if p in dead_at]
        dead += [float("inf")] * (len(pairs) - len(dead))
    hours = n * (t_kill - t_steady + 3000) / 3_600_000  # node-hours watched before the crashes
    return {
        "mode": mode, "n": n, "loss": f"{loss:.0%}", "join_ms": join_ms,
        "bytes_node_s": cost["bytes"], "probe_B": sum(v for k, v in kinds.items() if _KINDS.get(k) == "probe"),
        "dissem_B": sum(v for k, v in kinds.items() if _KINDS.get(k) == "dissem"),
        "sync_B": sum(v for k, v in kinds.items() if _KINDS.get(k) == "sync"),
        "msgs_node_s": cost["messages"], "verif_node_s": cost["signature_verifications"],
        "pub_node_s": cost["signatures"], "seen_p50": pct(seen.each, 0.5), "seen_p99": pct(seen.each, 0.99),
        "all_p50": pct(seen.latencies, 0.5), "all_p99": pct(seen.latencies, 0.99),
        "seen_n": len(seen.latencies), "unseen": seen.unfinished,
        "not_alive_p50": pct(not_alive, 0.5), "not_alive_p99": pct(not_alive, 0.99), "dead_p99": pct(dead, 0.99),
        "false_susp_node_h": len(false_susp) / hours, "false_dead_node_h": len(false_dead) / hours,
        "cpu_s": time.perf_counter() - started,
    }


def _kinds(sim: Simulator) -> dict[str, int]:
    out: dict[str, int] = defaultdict(int)
    for node in sim.nodes:
        for k, v in node.bytes_by_kind.items():
            out[k] += v
    return out


COLS = ["mode", "n", "loss", "join_ms", "bytes_node_s", "probe_B", "dissem_B", "sync_B", "msgs_node_s",
        "verif_node_s", "pub_node_s", "seen_p50", "seen_p99", "all_p50", "all_p99", "seen_n", "unseen",
        "not_alive_p50", "not_alive_p99", "dead_p99", "false_susp_node_h", "false_dead_node_h", "cpu_s"]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--sizes", default="10,100")
    ap.add_argument("--big", action="store_true", help="add N = 1000 (long)")
    ap.add_argument("--loss", default="0,0.05")
    ap.add_argument("--modes", default="heartbeat,probe")
    ap.add_argument("--steady-s", type=float, default=20.0)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--crashes", type=int, default=3, help="nodes that crash at once (1-3)")
    ap.add_argument("--wire", action="store_true", help="encode every message: exact sizes (slower)")
    args = ap.parse_args(argv)
    sizes = [int(x) for x in args.sizes.split(",") if x] + ([1000] if args.big else [])
    print("| " + " | ".join(COLS) + " |")
    print("|" + "---|" * len(COLS))
    for n in sizes:
        for loss in (float(x) for x in args.loss.split(",")):
            for mode in args.modes.split(","):
                row = run(mode, n, loss, args.seed, args.steady_s, args.crashes, args.wire)
                print("| " + " | ".join(_fmt(row[c]) for c in COLS) + " |", flush=True)
    return 0


def _fmt(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.0f}" if abs(v) >= 100 or v == 0 else f"{v:.2f}"
    return str(v)


if __name__ == "__main__":
    sys.exit(main())
