"""What prefix-aware routing adds per request (issue 18, item 6): hashing a prompt and scoring it.

usage: .venv/bin/python tests/bench/bench_prefix_hashing.py [-n 20000]

One chat request of about 4,000 tokens (16 KB: a 12 KB system prompt and a 4 KB question),
timed n times each, in one process, after a warm-up:

- ``hash``: ``PrefixRouting.key`` (render the messages as canonical JSON, cut 1 KiB blocks,
  chain their BLAKE2b digests): what the API adds to every chat request;
- ``score``: ``PrefixRouting.query`` (the index lookup, the digests in wire form) and
  ``Router.route`` with the query, over 4 local backends (one holding the prompt) and 8 peers
  publishing 64 digests each (one holding it): the whole routing decision;
- ``route (no prefix)``: the same ``Router.route`` without a query, the cost before issue 18.

Goal: hash + (score - route without prefix) at most 0.1 ms p50. Prints a table.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from collections.abc import Callable
from typing import Any

from viiwork.agent.serving.prefix_routing import PrefixRouting, PrefixSettings
from viiwork.agent.serving.prefixes import published_positions
from viiwork.agent.serving.router import LocalBackend, LocalModel, PeerSnapshot, Reservations, Router
from viiwork.mesh.extensions import ModelPrefixes, ModelSpeed, Prefixes, Speeds
from viiwork.mesh.identity import NodeId
from viiwork.mesh.membership import Liveness
from viiwork.mesh.summary import ModelCapacity, PublishedState

M = "qwen"


def body() -> dict[str, Any]:
    system = "".join(f"Rule {i}: answer in plain words and cite the source of every figure. " for i in range(170))
    question = "".join(f"Question part {i}: how does the router weigh prefill against waiting? " for i in range(57))
    return {"model": M, "stream": True, "messages": [{"role": "system", "content": system},
                                                    {"role": "user", "content": question}]}


def timed(n: int, fn: Callable[[], object]) -> list[float]:
    out = []
    clock = time.perf_counter_ns
    for _ in range(n):
        t0 = clock()
        fn()
        out.append((clock() - t0) / 1000.0)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-n", type=int, default=20000)
    args = ap.parse_args()
    payload = body()
    routing = PrefixRouting(PrefixSettings(), {})
    key = routing.key(payload, M, "tenant-a")
    assert key is not None
    size = len(key.digests)
    routing.served(M, f"{M}-2", key)
    rng = random.Random(1)
    for i in range(2000):  # an index with other prompts in it
        other = routing.key({"prompt": f"{i:05d}" * 1000}, M, "tenant-a")
        routing.served(M, f"{M}-{i % 4}", other)  # type: ignore[arg-type]
    hexes = key.digests
    peers = []
    for p in range(8):
        digests = [f"{rng.getrandbits(64):016x}" for _ in range(64)]
        if p == 5:
            digests[-len(published_positions(size)):] = [hexes[i] for i in published_positions(size)]
        peers.append(PeerSnapshot(
            node_id=NodeId(f"peer{p:012d}"), name=f"peer-{p}", liveness=Liveness.ALIVE, state=PublishedState.SERVING,
            age_ms=100.0, order=(1, 1), rtt_ms=0.5,
            models=(ModelCapacity(name=M, engine="llamacpp", kind="chat", slots=4, busy=1, waiting=0,
                                  ctx_per_slot=8192, healthy=1, total=1),),
            prefixes=Prefixes((ModelPrefixes(M, tuple(digests)),)), speeds=Speeds((ModelSpeed(M, 900, 40),))))
    local = {M: LocalModel(name=M, kind="chat", backends=tuple(LocalBackend(f"{M}-{i}", 1, 2, 800.0) for i in range(4)),
                           slots=8, can_serve=True)}
    router = Router(NodeId("self000000000000"), "self", stale_after_ms=3000,
                    reservations=Reservations(lambda: 0.0), rng=random.Random(2))

    def hash_() -> object:
        return routing.key(payload, M, "tenant-a")

    def score() -> object:
        return router.route(M, local, peers, prefix=routing.query(M, key))

    def plain() -> object:
        return router.route(M, local, peers)

    decision = score()
    for fn in (hash_, score, plain):
        timed(2000, fn)  # warm-up
    rows = [("hash", timed(args.n, hash_)), ("score", timed(args.n, score)), ("route (no prefix)", timed(args.n, plain))]
    print(f"prompt: {key.prompt_bytes} bytes, {size} blocks; index: {len(routing.index(M))} digests; "
          f"8 peers x 64 digests; decision: {decision}")
    print(f"{'step':<20}{'p50 us':>10}{'p99 us':>10}")
    p50 = {}
    for name, samples in rows:
        samples.sort()
        p50[name] = statistics.median(samples)
        print(f"{name:<20}{p50[name]:>10.1f}{samples[int(len(samples) * 0.99)]:>10.1f}")
    added = p50["hash"] + p50["score"] - p50["route (no prefix)"]
    print(f"added by prefix routing, p50: {added:.1f} us (goal: at most 100 us) -> "
          f"{'met' if added <= 100.0 else 'MISSED'}")


if __name__ == "__main__":
    main()
