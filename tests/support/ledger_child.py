"""A process that writes a usage ledger, for the tests that kill it or fill its disk.

``python ledger_child.py flood PATH``: 8 tasks record rows as fast as they can; each row's
request id is printed (and flushed) only after ``record`` returned COMMITTED, until killed.

``python ledger_child.py full PATH``: 5 rows committed; then RLIMIT_FSIZE is lowered to
one page (writes past it fail with EFBIG, as on a full disk), 50 rows are recorded into a
backlog of at most 30; then the limit is raised ("space returns") and the backlog is
written. Prints one JSON object: each phase's outcomes and stats.
"""

from __future__ import annotations

import asyncio
import json
import resource
import signal
import sys
import time
from pathlib import Path

from viiwork.agent.usage.ledger import Ledger, Recorded
from viiwork.agent.usage.store import UsageRow


def row(request_id: str) -> UsageRow:
    return UsageRow(finished_at_ms=int(time.time() * 1000), request_id=request_id, tenant="acme", jti="k1",
                    model="m", origin_node="", serving_node="n1", prompt_tokens=10, completion_tokens=5,
                    cached_tokens=None, status=200, queued_ms=0.5, ttft_ms=3.0, duration_ms=9.0)


async def flood(path: Path) -> None:
    ledger = Ledger(path)
    ledger.start()

    async def writer(task: int) -> None:
        i = 0
        while True:
            rid = f"{task}-{i}"
            if await ledger.record(row(rid)) is Recorded.COMMITTED:
                sys.stdout.write(rid + "\n")
                sys.stdout.flush()
            i += 1

    await asyncio.gather(*(writer(t) for t in range(8)))


async def full(path: Path) -> None:
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # EFBIG instead of death
    ledger = Ledger(path, backlog_max=30, retry_interval_s=0.05)
    ledger.start()
    before = [(await ledger.record(row(f"a{i}"))).value for i in range(5)]
    _, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (4096, hard))
    during = []
    for i in range(50):
        during.append((await asyncio.wait_for(ledger.record(row(f"b{i}")), 5.0)).value)
    stats_full = ledger.stats().as_dict()
    resource.setrlimit(resource.RLIMIT_FSIZE, (hard, hard))
    deadline = time.monotonic() + 20
    while ledger.stats().backlog and time.monotonic() < deadline:
        await asyncio.sleep(0.02)
    after = (await ledger.record(row("c0"))).value
    stats_after = ledger.stats().as_dict()
    await ledger.close()
    print(json.dumps({"before": before, "during": during, "stats_full": stats_full, "after": after,
                      "stats_after": stats_after}))


if __name__ == "__main__":
    mode, target = sys.argv[1], Path(sys.argv[2])
    asyncio.run(flood(target) if mode == "flood" else full(target))
