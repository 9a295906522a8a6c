"""Within one backend: does choosing llama-server's slot (``id_slot``) add cache hits? (issue 18)

usage: .venv/bin/python tests/bench/bench_id_slot.py [--tenants 6] [--active 4] [--requests 60]
       [--system-tokens 600] [--parallel 2] [--cache-ram 0] [--max-tokens 16]

One llama-server (SmolLM2-135M Q4_1 of the demo package, CPU, one thread, ``--parallel``
slots, ``--cache-ram`` as given), one client that keeps every slot busy (``--parallel``
requests in flight, a closed loop), the prefix workload of ``bench_prefix_routing.py``
(tenants with long system prompts of their own, conversations of 3-6 turns sent with their
whole history, ``--active`` conversations at once). The same workload (same seed) is sent
three ways, one after the other on a freshly started llama-server each:

- ``engine``: no ``id_slot``: llama-server picks the slot itself (the idle slot whose cached
  prompt shares the longest prefix with the request, above ``--slot-prompt-similarity``,
  else the least recently used);
- ``id_slot``: the client picks, as the agent would with its prefix index
  (``viiwork.agent.serving.prefixes.PrefixIndex``, one entry per slot): the idle slot
  remembered for the most leading blocks of the prompt, else the idle slot used longest
  ago, sent as ``id_slot``;
- ``id_slot-strict``: as ``id_slot``, but a prompt whose best slot is busy still goes
  there (llama-server queues it for that slot).

Figures per way: the cached share of prompt tokens from the engine's own counts
(``timings.cache_n`` / (``cache_n`` + ``prompt_n``)), TTFT p50/p99 and the wall time.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))  # tests/ for support.*
sys.path.insert(0, str(HERE))

from bench_prefix_routing import MODEL, Result, Workload, send, serves, session, token_range  # noqa: E402

from support.procs import free_port, stop_process  # noqa: E402
from viiwork.agent.config.demo import find_demo_model  # noqa: E402
from viiwork.agent.serving.prefixes import PrefixIndex, prefix_key  # noqa: E402

WAYS = ("engine", "id_slot", "id_slot-strict")


class SlotPicker:
    """The client's picture of the slots: which prefixes each was given, which are busy, and
    which was used longest ago."""

    def __init__(self, slots: int) -> None:
        self.index = PrefixIndex()
        self.busy: set[int] = set()
        self.used: list[int] = list(range(slots))  # least recently used first

    def pick(self, key: Any, strict: bool) -> int:
        hits = self.index.hits(key) if key is not None else {}
        for _blocks, slot in sorted(((b, int(s)) for s, b in hits.items()), reverse=True):
            if strict or slot not in self.busy:
                return slot
        idle = [s for s in self.used if s not in self.busy]
        return (idle or self.used)[0]

    def start(self, slot: int) -> None:
        self.busy.add(slot)
        self.used.remove(slot)
        self.used.append(slot)


async def run_way(way: str, url: str, args: argparse.Namespace) -> tuple[list[Result], float]:
    workload = Workload(args.tenants, args.system_tokens, True, seed=11, max_tokens=args.max_tokens,
                        active=args.active)
    picker = SlotPicker(args.parallel)
    results: list[Result] = []
    sent = 0

    async def client(http: aiohttp.ClientSession) -> None:
        nonlocal sent
        while sent < args.requests:
            got = workload.take()
            if got is None:
                await asyncio.sleep(0.02)
                continue
            sent += 1
            tenant, body = got
            if way == "engine":
                results.append(await send(http, url, body))
                workload.done(tenant)
                continue
            key = prefix_key(body, MODEL, "t")
            slot = picker.pick(key, strict=way == "id_slot-strict")
            body["id_slot"] = slot
            picker.start(slot)
            try:
                results.append(await send(http, url, body))
            finally:
                picker.busy.discard(slot)
                workload.done(tenant)
            if key is not None:
                picker.index.served(str(slot), key)

    async with session() as http:
        t0 = time.perf_counter()
        await asyncio.gather(*(client(http) for _ in range(args.parallel)))
        return results, time.perf_counter() - t0


def pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))] if values else float("nan")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tenants", type=int, default=6)
    ap.add_argument("--active", type=int, default=4)
    ap.add_argument("--requests", type=int, default=60)
    ap.add_argument("--system-tokens", type=token_range, default=(600, 600), help="N or LOW-HIGH tokens")
    ap.add_argument("--parallel", type=int, default=2)
    ap.add_argument("--cache-ram", type=int, default=0)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--binary", default=str(Path(sys.executable).parent / "llama-server"))
    args = ap.parse_args()
    model_path = str(find_demo_model())
    print(f"llama-server {args.binary}, --parallel {args.parallel}, --cache-ram {args.cache_ram}; "
          f"{args.tenants} tenants, {args.active} active, {args.system_tokens[0]}-{args.system_tokens[1]}-token system prompts, "
          f"{args.requests} requests")
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for way in WAYS:
            port = free_port()
            log = open(Path(tmp) / f"{way}.log", "wb")
            proc = subprocess.Popen(
                [args.binary, "-m", model_path, "--host", "127.0.0.1", "--port", str(port), "-t", "1",
                 "--parallel", str(args.parallel), "-c", str(4096 * args.parallel), "--cache-ram",
                 str(args.cache_ram), "--slots"], stdout=log, stderr=subprocess.STDOUT)
            try:
                url = f"http://127.0.0.1:{port}/v1/chat/completions"
                asyncio.run(serves(url))
                results, wall = asyncio.run(run_way(way, url, args))
            finally:
                stop_process(proc, 30)
                log.close()
            ok = [r for r in results if r.ok]
            cached = sum(r.cache_n for r in ok)
            total = cached + sum(r.prompt_n for r in ok)
            rows.append((way, len(ok), len(results), cached / total if total else 0.0,
                         statistics.median([r.ttft_s for r in ok]) if ok else float("nan"),
                         pct([r.ttft_s for r in ok], 0.99), wall))
            print(f"  {way}: done in {wall:.1f} s", flush=True)
    print("\n| way | ok | cached share | TTFT p50 (s) | TTFT p99 (s) | wall (s) |\n|---|---|---|---|---|---|")
    for way, ok_n, n, share, p50, p99, wall in rows:
        print(f"| {way} | {ok_n}/{n} | {share:.2f} | {p50:.2f} | {p99:.2f} | {wall:.1f} |")


if __name__ == "__main__":
    main()
