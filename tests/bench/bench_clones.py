"""One node per identity: how soon a copied state dir is noticed, with the default timings.

usage: .venv/bin/python tests/bench/bench_clones.py [--seeds 10]

The protocol core (real keys and certificates, an injected clock; tests/mesh/test_clones.py's
helpers) with the default GossipSettings (500 ms rounds, suspect_after 2 s, dead_after 10 s):
a node runs with one peer; a copy of it (same key, another boot and address) starts; every
round both exchange with the peer. Prints, per seed and as medians, the time from the copy's
start until the peer marks the id ``conflict``, the boot that stays reports it, and the boot
that leaves gives up, and the generation the race had reached by then (docs/mesh.md).
"""

from __future__ import annotations

import argparse
import logging
import statistics
import sys
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parents[1]), str(Path(__file__).resolve().parents[1] / "mesh")]

import test_clones as t  # noqa: E402

from support.mesh_crypto import ManualClock, TestCA, exchange  # noqa: E402
from viiwork.mesh.membership import GossipSettings, Liveness  # noqa: E402


def one_run(seed: int) -> dict[str, float]:
    t.SETTINGS = GossipSettings()
    ca, clock = TestCA(), ManualClock()
    a, c = ca.node("a"), ca.node("c")
    low = t.boot_core(a, ca, clock, t.LOW, mesh="10.0.0.1:8087", seed=seed)
    mc, pc = t.boot_core(c, ca, clock, "c" * 16, seed=seed + 1)
    for _ in range(6):
        clock.advance(500)
        low[1].maybe_publish()
        pc.maybe_publish()
        exchange(low[0], mc)
    high = t.boot_core(a, ca, clock, t.HIGH, mesh="10.0.0.2:8087", seed=seed + 2)
    start, out = clock.ms, {}
    for _ in range(80):
        clock.advance(500 + (seed * 37) % 50)
        for m, pub in (low, high, (mc, pc)):
            pub.maybe_publish()
            m.tick()
        exchange(low[0], mc)
        exchange(high[0], mc)
        if "peer_ms" not in out and any(p.liveness is Liveness.CONFLICT for p in mc.peers()):
            out["peer_ms"] = clock.ms - start
        if "stayer_ms" not in out and low[0].identity_conflict is not None:
            out["stayer_ms"] = clock.ms - start
        if high[0].identity_conflict is not None:
            out["leaver_ms"] = clock.ms - start
            out["generation"] = high[1].generation
            break
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=10)
    args = parser.parse_args()
    logging.disable(logging.CRITICAL)
    runs = [one_run(s) for s in range(args.seeds)]
    print("| seed | peer marks conflict (s) | staying boot reports (s) | leaving boot exits (s) | generation |")
    print("|---|---|---|---|---|")
    for s, r in enumerate(runs):
        print(f"| {s} | {r['peer_ms'] / 1000:.1f} | {r['stayer_ms'] / 1000:.1f} | {r['leaver_ms'] / 1000:.1f} | "
              f"{r['generation']} |")
    med = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
    print(f"| median | {med['peer_ms'] / 1000:.1f} | {med['stayer_ms'] / 1000:.1f} | {med['leaver_ms'] / 1000:.1f} | "
          f"{med['generation']:.0f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
