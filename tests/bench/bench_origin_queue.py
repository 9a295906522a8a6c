"""Cost of the origin queue's serving order (agent/serving/waitqueue.py over agent/serving/turns.py).

A queue of N waiters for one model, kept at N: each step one request enters (and is asked
``ahead`` first, as the pipeline does) and the first in serving order leaves (served), with
the head announced on each change (``head_want``, as the mesh link does). Two mixes at each N:
keys off (every waiter ``normal``, one tenant: plain FIFO) and keys on (three priorities,
eight tenants, drawn at random). Prints microseconds per step (enter + leave), the best of 5
runs of 2,000 steps. No I/O; one process.

    .venv/bin/python tests/bench/bench_origin_queue.py
"""

from __future__ import annotations

import asyncio
import random
import time

from viiwork.agent.serving.waitqueue import WaitQueue
from viiwork.mesh.extensions import Priority

SIZES = (64, 1024, 8192)
STEPS = 2000
RUNS = 5


def one_run(size: int, keyed: bool, rng: random.Random) -> float:
    heads: list[object] = []
    q = WaitQueue("m", {}, size + 10, 60.0)
    q.on_head_change = lambda: heads.append(q.head_want())
    mix = [(p, f"tenant-{t}") for p in Priority for t in range(8)] if keyed else [(Priority.NORMAL, "")]

    def enter() -> None:
        priority, tenant = rng.choice(mix)
        q.ahead(None, True, priority=priority, tenant=tenant)
        q.enter(priority=priority, tenant=tenant)

    for _ in range(size):
        enter()
    started = time.perf_counter()
    for _ in range(STEPS):
        enter()
        q.leave(next(iter(q._waiters)))  # the first in serving order (served); read, not changed
    return (time.perf_counter() - started) / STEPS * 1e6


async def main() -> None:
    rng = random.Random(7)
    print(f"{'waiters':>8} {'keys off (us/step)':>19} {'keys on (us/step)':>18}")
    for size in SIZES:
        off = min(one_run(size, False, rng) for _ in range(RUNS))
        on = min(one_run(size, True, rng) for _ in range(RUNS))
        print(f"{size:>8} {off:>19.1f} {on:>18.1f}")


if __name__ == "__main__":
    asyncio.run(main())
