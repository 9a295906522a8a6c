"""Prefix-aware routing against the field's cache-aware router, on real llama-servers (issue 18).

usage: .venv/bin/python tests/bench/bench_prefix_routing.py [--tenants 40] [--active 8] [--requests 60]
       [--system-tokens 1000-2000] [--cache-ram 0] [--sglang-python PATH] [--no-prefix-workload | --only-no-prefix]
       [--only-agents] [--load 0.7] [--max-tokens 16] [--systems abcd] [--rates PREFIX,NO_PREFIX]

Four llama-server backends (SmolLM2-135M Q4_1 of the demo package, CPU, one thread each,
``--parallel 2``, ``--cache-ram`` as given), served by:

(a) two viiwork agents, two backends each, in one mesh (open trust, loopback), prefix routing on;
(b) the same with ``routing.prefix_routing = false``;
(c) sglang-router (``python -m sglang_router.launch_router --policy cache_aware``) in front of
    four llama-servers started here with the same flags (``--sglang-python``: an interpreter
    that has ``sglang_router``; left out when not given);
(d) round robin over those four llama-servers, done by the client.

Every system is checked to serve before it is measured. Workload ("prefix"): ``--tenants``
tenants, each a system prompt of its own, ``--system-tokens`` long (a length drawn per tenant in ``LOW-HIGH``), and
conversations of 3-6 turns, ``--active`` of them going on at once (the next tenant in turn
starts one when one ends), each turn sent with the whole history (the assistant turns are
generated text of the harness, the same for every system); a conversation's next turn is sent
only after its previous one answered. Arrivals are Poisson at ``--load`` times (b)'s saturation
throughput, measured first in the same run (a closed loop of 8 clients, one per slot); for
(a) and (b) each request goes to one of the two agents at random. The "no prefix" workload
(unless ``--no-prefix-workload``) gives every request a system prompt of its own.

Figures per system: TTFT p50/p99 (first content chunk of a streamed answer), completion
tokens/s, the cached share of prompt tokens from the engines' own counts (llama-server's
``timings.cache_n`` / ``prompt_n`` in the last event), and the spread of requests over the
backends (agents: ``X-Viiwork-Node``/``X-Viiwork-Backend``; round robin: by construction;
sglang-router: not seen, left blank). Prints a table per workload.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import random
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Iterator
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))  # tests/ for support.*

from support.agent import Agent, run_agent  # noqa: E402
from support.procs import free_port, stop_process  # noqa: E402
from viiwork.agent.config.demo import find_demo_model  # noqa: E402

MODEL = "smol"
WORDS = ("route request cache prefix token engine slot backend mesh node latency prompt system answer "
         "question policy tenant budget digest block score guard speed queue peer offer").split()


# --- the workload ----------------------------------------------------------------------------


def system_prompt(rng: random.Random, tokens: tuple[int, int]) -> str:
    """A system prompt of ``tokens`` (low, high) tokens, its length drawn from ``rng``."""
    # ~1 token a word for these common English words (SmolLM2's tokenizer)
    return "You are a helpful assistant. " + " ".join(rng.choice(WORDS) for _ in range(rng.randint(*tokens)))


def token_range(text: str) -> tuple[int, int]:
    """``--system-tokens``: ``N`` or ``LOW-HIGH`` (each tenant's length drawn in it)."""
    low, _, high = text.partition("-")
    bounds = (int(low), int(high or low))
    if not 0 < bounds[0] <= bounds[1]:
        raise argparse.ArgumentTypeError(f"{text!r}: expected N or LOW-HIGH, 0 < LOW <= HIGH")
    return bounds


@dataclass
class Conversation:
    system: str
    turns: int
    sent: int = 0
    messages: list[dict[str, str]] = field(default_factory=list)

    def next_body(self, rng: random.Random, max_tokens: int) -> dict[str, Any]:
        if self.messages:
            self.messages.append({"role": "assistant", "content": f"Answer {self.sent}: " +
                                  " ".join(rng.choice(WORDS) for _ in range(30))})
        self.messages.append({"role": "user", "content": f"Question {self.sent + 1}: " +
                              " ".join(rng.choice(WORDS) for _ in range(40)) + "?"})
        self.sent += 1
        return {"model": MODEL, "stream": True, "stream_options": {"include_usage": True},
                "max_tokens": max_tokens, "temperature": 0,
                "messages": [{"role": "system", "content": self.system}, *self.messages]}


class Workload:
    """Tenants' conversations: at most ``active`` at once (a tenant's turns come while its
    conversation lasts, 3-6 turns, then the next tenant in turn starts one); ``take()`` gives
    the next turn of a conversation with none in flight."""

    def __init__(self, tenants: int, system_tokens: tuple[int, int], shared_prefix: bool, seed: int, max_tokens: int,
                 active: int = 8) -> None:
        self.rng = random.Random(seed)
        self.max_tokens = max_tokens
        self.shared = shared_prefix
        self.system_tokens = system_tokens
        self.active = active
        self.systems = [system_prompt(random.Random(seed * 1000 + t), system_tokens) for t in range(tenants)]
        self.conversations: dict[int, Conversation] = {}  # the active ones, by tenant
        self.busy: set[int] = set()
        self._next_tenant = 0

    def take(self) -> tuple[int, dict[str, Any]] | None:
        for t, conv in list(self.conversations.items()):
            if conv.sent >= conv.turns and t not in self.busy:
                del self.conversations[t]
        while len(self.conversations) < self.active:
            t = self._next_tenant % len(self.systems)
            self._next_tenant += 1
            if t in self.conversations:
                break
            system = self.systems[t] if self.shared else system_prompt(self.rng, self.system_tokens)
            self.conversations[t] = Conversation(system, self.rng.randint(3, 6))
        idle = [t for t, conv in self.conversations.items() if t not in self.busy and conv.sent < conv.turns]
        if not idle:
            return None
        t = self.rng.choice(idle)
        conv = self.conversations[t]
        if not self.shared and conv.sent:  # no shared prefix: every request starts afresh
            conv = self.conversations[t] = Conversation(system_prompt(self.rng, self.system_tokens), conv.turns,
                                                        conv.sent)
        self.busy.add(t)
        return t, conv.next_body(self.rng, self.max_tokens)

    def done(self, tenant: int) -> None:
        self.busy.discard(tenant)


# --- one request -----------------------------------------------------------------------------


@dataclass
class Result:
    ok: bool
    ttft_s: float
    total_s: float
    completion_tokens: int
    cache_n: int
    prompt_n: int
    where: str


def session() -> aiohttp.ClientSession:
    """A client session that opens a connection per request: llama-server closes a connection
    after a streamed answer, and a reused one then fails the next request ("Server
    disconnected"); the same for every system measured."""
    return aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True),
                                 timeout=aiohttp.ClientTimeout(total=900))


async def send(http: aiohttp.ClientSession, url: str, body: dict[str, Any]) -> Result:
    t0 = time.perf_counter()
    ttft = None
    completion = cache_n = prompt_n = 0
    try:
        async with http.post(url, json=body) as r:
            where = f"{r.headers.get('X-Viiwork-Node', '')}/{r.headers.get('X-Viiwork-Backend', '')}"
            if r.status != 200:
                await r.read()
                return Result(False, 0.0, time.perf_counter() - t0, 0, 0, 0, where)
            async for raw in r.content:
                line = raw.decode("utf-8", "replace").strip()
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line[6:])
                for choice in event.get("choices") or []:
                    if ttft is None and (choice.get("delta") or {}).get("content"):
                        ttft = time.perf_counter() - t0
                timings = event.get("timings")
                if isinstance(timings, dict):
                    cache_n = int(timings.get("cache_n") or 0)
                    prompt_n = int(timings.get("prompt_n") or 0)
                    completion = int(timings.get("predicted_n") or completion)
                usage = event.get("usage")
                if isinstance(usage, dict) and usage.get("completion_tokens"):
                    completion = int(usage["completion_tokens"])
                    details = usage.get("prompt_tokens_details")
                    if not isinstance(timings, dict) and isinstance(details, dict):  # no timings: usage's counts
                        cache_n = int(details.get("cached_tokens") or 0)
                        prompt_n = int(usage.get("prompt_tokens") or 0) - cache_n
    except (aiohttp.ClientError, TimeoutError):
        return Result(False, 0.0, time.perf_counter() - t0, 0, 0, 0, "")
    total = time.perf_counter() - t0
    return Result(True, ttft if ttft is not None else total, total, completion, cache_n, prompt_n, where)


# --- the systems -----------------------------------------------------------------------------


@dataclass
class System:
    name: str
    urls: list[str]  # chat completions URLs; "rr": in turn, else at random
    round_robin: bool = False
    _next: int = 0

    def url(self, rng: random.Random) -> str:
        if self.round_robin:
            self._next = (self._next + 1) % len(self.urls)
            return self.urls[self._next]
        return rng.choice(self.urls)


def llama_args(cache_ram: int) -> list[str]:
    return ["--cache-ram", str(cache_ram)]


@contextlib.contextmanager
def agents(work: Path, binary: str, model_path: str, prefix: bool, cache_ram: int) -> Iterator[list[Agent]]:
    out: list[Agent] = []
    seeds: list[str] = []
    tag = "on" if prefix else "off"
    (work / tag).mkdir(parents=True, exist_ok=True)
    with ExitStack() as stack:
        for name in ("a", "b"):
            mesh = {"trust": "open", "mesh_id": f"bench-prefix-{tag}", "listen": "127.0.0.1:0",
                    "advertise": "127.0.0.1", "discovery": ["seeds"], "seeds": seeds, "gossip_interval_ms": 200}
            models = [{"name": MODEL, "engine": "llamacpp", "path": model_path, "parallel": 2, "backends": 2,
                       "ctx_per_slot": 4096, "args": llama_args(cache_ram),
                       "llamacpp": {"binary": binary, "threads": 1}}]
            agent = stack.enter_context(run_agent(work / tag, models, name=f"node-{name}", extra={
                "mesh": mesh, "routing": {"prefix_routing": prefix, "queue_timeout_s": 600, "queue_max": 1024}}))
            if not seeds:
                seeds = [agent.wait_for(lambda d: bool(d["mesh"]["self"]["mesh"]), 60, "mesh")["mesh"]["self"]["mesh"]]
            out.append(agent)
        for agent in out:
            agent.wait_for(lambda d: all(b["state"] == "healthy" for m in d["models"] for b in m["backends"]),
                           180, "backends healthy")
            agent.wait_for(lambda d: d.get("mesh", {}).get("peers", {}).get("alive", 0) == 1, 60, "peer alive")
        yield out


@contextlib.contextmanager
def llama_servers(binary: str, model_path: str, cache_ram: int, log_dir: Path) -> Iterator[list[str]]:
    log_dir.mkdir(parents=True, exist_ok=True)
    procs = []
    urls = []
    try:
        for i in range(4):
            port = free_port()
            log = open(log_dir / f"llama-{i}.log", "wb")
            procs.append(subprocess.Popen([binary, "-m", model_path, "--host", "127.0.0.1", "--port", str(port),
                                           "-t", "1", "--parallel", "2", "-c", "8192", "--metrics",
                                           *llama_args(cache_ram)], stdout=log, stderr=subprocess.STDOUT))
            urls.append(f"http://127.0.0.1:{port}")
        yield urls
    finally:
        for p in procs:
            stop_process(p, 30)


@contextlib.contextmanager
def sglang_router(python: str, workers: list[str], log_dir: Path) -> Iterator[str]:
    port = free_port()
    log = open(log_dir / "sglang-router.log", "wb")
    proc = subprocess.Popen([python, "-m", "sglang_router.launch_router", "--host", "127.0.0.1", "--port", str(port),
                             "--policy", "cache_aware", "--worker-urls", *workers], stdout=log, stderr=subprocess.STDOUT)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        stop_process(proc, 30)


async def serves(url: str, timeout_s: float = 180.0) -> None:
    """Wait until ``url`` (a chat completions URL) answers a small request with 200."""
    deadline = time.monotonic() + timeout_s
    async with aiohttp.ClientSession() as http:
        while time.monotonic() < deadline:
            with contextlib.suppress(aiohttp.ClientError, OSError):
                async with http.post(url, json={"model": MODEL, "max_tokens": 2, "messages": [
                        {"role": "user", "content": "hi"}]}) as r:
                    await r.read()
                    if r.status == 200:
                        return
            await asyncio.sleep(1.0)
    raise SystemExit(f"{url} does not serve after {timeout_s:.0f} s")


# --- runs ------------------------------------------------------------------------------------


async def saturation(system: System, workload: Workload, requests: int) -> float:
    """Completed requests/s of a closed loop of 8 clients (one per slot)."""
    rng = random.Random(7)
    done = 0

    async def client(http: aiohttp.ClientSession) -> None:
        nonlocal done
        while done < requests:
            got = workload.take()
            if got is None:
                await asyncio.sleep(0.05)
                continue
            tenant, body = got
            result = await send(http, system.url(rng), body)
            workload.done(tenant)
            done += result.ok
    async with session() as http:
        t0 = time.perf_counter()
        await asyncio.gather(*(client(http) for _ in range(8)))
        return done / (time.perf_counter() - t0)


async def open_loop(system: System, workload: Workload, rate: float, requests: int, seed: int) -> list[Result]:
    rng = random.Random(seed)
    results: list[Result] = []
    tasks = []

    async def one(http: aiohttp.ClientSession, tenant: int, body: dict[str, Any]) -> None:
        results.append(await send(http, system.url(rng), body))
        workload.done(tenant)

    async with session() as http:
        for _ in range(requests):
            await asyncio.sleep(rng.expovariate(rate))
            got = workload.take()
            while got is None:  # every tenant has a turn in flight: the next arrival waits for one
                await asyncio.sleep(0.05)
                got = workload.take()
            tasks.append(asyncio.create_task(one(http, *got)))
        await asyncio.gather(*tasks)
    return results


def row(name: str, results: list[Result], wall_s: float) -> dict[str, Any]:
    ok = [r for r in results if r.ok]
    ttfts = sorted(r.ttft_s for r in ok)
    cache = sum(r.cache_n for r in ok)
    prompt = sum(r.prompt_n for r in ok)
    spread = Counter(r.where for r in ok if r.where.strip("/"))
    return {"system": name, "ok": len(ok), "failed": len(results) - len(ok),
            "ttft_p50_s": statistics.median(ttfts) if ttfts else None,
            "ttft_p99_s": ttfts[min(len(ttfts) - 1, int(len(ttfts) * 0.99))] if ttfts else None,
            "completion_tps": sum(r.completion_tokens for r in ok) / wall_s if wall_s > 0 else None,
            "cached_share": cache / (cache + prompt) if cache + prompt else None,
            "spread": dict(sorted(spread.items()))}


def show(title: str, rows: list[dict[str, Any]]) -> None:
    print(f"\n## {title}\n")
    print("| system | ok | failed | TTFT p50 s | TTFT p99 s | completion tok/s | cached share | requests per backend |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        def f(v: Any, fmt: str) -> str:
            return "-" if v is None else format(v, fmt)
        spread = " ".join(f"{k}:{v}" for k, v in r["spread"].items()) or "-"
        print(f"| {r['system']} | {r['ok']} | {r['failed']} | {f(r['ttft_p50_s'], '.2f')} | {f(r['ttft_p99_s'], '.2f')} "
              f"| {f(r['completion_tps'], '.1f')} | {f(r['cached_share'], '.2f')} | {spread} |")
    sys.stdout.flush()


async def measure(system: System, args: argparse.Namespace, shared: bool, rate: float, seed: int) -> dict[str, Any]:
    workload = Workload(args.tenants, args.system_tokens, shared, seed, args.max_tokens, args.active)
    t0 = time.perf_counter()
    results = await open_loop(system, workload, rate, args.requests, seed)
    return row(system.name, results, time.perf_counter() - t0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tenants", type=int, default=40)
    ap.add_argument("--active", type=int, default=8, help="conversations going on at once")
    ap.add_argument("--requests", type=int, default=60, help="requests per system and workload")
    ap.add_argument("--saturation-requests", type=int, default=24)
    ap.add_argument("--system-tokens", type=token_range, default=(1000, 2000),
                    help="each tenant's system prompt: N or LOW-HIGH tokens (default 1000-2000)")
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--cache-ram", type=int, default=0, help="llama-server --cache-ram MiB (0: off; its default 8192)")
    ap.add_argument("--load", type=float, default=0.7)
    ap.add_argument("--sglang-python", help="an interpreter with sglang_router (PyPI sglang-router 0.3.2)")
    ap.add_argument("--binary", default=str(Path(sys.executable).parent / "llama-server"))
    ap.add_argument("--no-prefix-workload", action="store_true", help="skip the workload without shared prefixes")
    ap.add_argument("--only-no-prefix", action="store_true", help="run only the workload without shared prefixes")
    ap.add_argument("--only-agents", action="store_true", help="run (a) and (b) only")
    ap.add_argument("--systems", default="abcd", help="the systems to run, e.g. 'c' (default abcd)")
    ap.add_argument("--rates", help="PREFIX,NO_PREFIX arrival rates (req/s) instead of measuring (b)'s "
                    "saturation: to run one system again at a rate an earlier run measured")
    args = ap.parse_args()
    model_path = find_demo_model()
    workloads = ([] if args.only_no_prefix else [("prefix", True)]) + \
        ([] if args.no_prefix_workload else [("no prefix", False)])
    print(f"llama-server {args.binary}, {model_path}, --cache-ram {args.cache_ram}; {args.tenants} tenants, "
          f"{args.system_tokens[0]}-{args.system_tokens[1]}-token system prompts, {args.requests} requests a system and workload")
    rows: dict[str, list[dict[str, Any]]] = {name: [] for name, _ in workloads}
    rates: dict[str, float] = {}
    if args.rates:
        given = [float(r) for r in args.rates.split(",")]
        rates = {"prefix": given[0], "no prefix": given[-1]}
    with tempfile.TemporaryDirectory(prefix="bench-prefix-") as tmp:
        work = Path(tmp)
        for prefix in [p for p, letter in ((False, "b"), (True, "a")) if letter in args.systems]:
            # (b) first: its saturation sets the rate of every run
            with agents(work, args.binary, model_path, prefix, args.cache_ram) as pair:
                system = System("(a) viiwork, prefix on" if prefix else "(b) viiwork, prefix off",
                                [f"{a.url}/v1/chat/completions" for a in pair])
                for url in system.urls:
                    asyncio.run(serves(url))
                for name, shared in workloads:
                    if name not in rates:
                        sat = asyncio.run(saturation(system, Workload(args.tenants, args.system_tokens, shared, 99,
                                                                      args.max_tokens, args.active), args.saturation_requests))
                        rates[name] = args.load * sat
                        print(f"{name}: (b) saturation {sat:.3f} req/s -> arrivals {rates[name]:.3f} req/s")
                    rows[name].append(asyncio.run(measure(system, args, shared, rates[name], 1)))
                    show(name, rows[name])
        log_dir = work / "servers"
        log_dir.mkdir()
        others = [] if args.only_agents else (["(c)"] if args.sglang_python else []) + ["(d)"]
        others = [o for o in others if o[1] in args.systems]
        if others and not rates:
            raise SystemExit("(c) and (d) run at (b)'s rates: run (b) too, or give --rates")
        for which in others:  # each on llama-servers of its own, started cold like the agents' backends
            with llama_servers(args.binary, model_path, args.cache_ram, log_dir / which) as workers:
                for w in workers:
                    asyncio.run(serves(f"{w}/v1/chat/completions"))
                if which == "(c)":
                    assert args.sglang_python
                    with sglang_router(args.sglang_python, workers, log_dir) as router:
                        asyncio.run(serves(f"{router}/v1/chat/completions"))
                        for name, shared in workloads:
                            rows[name].append(asyncio.run(measure(
                                System("(c) sglang-router cache_aware", [f"{router}/v1/chat/completions"]),
                                args, shared, rates[name], 1)))
                            show(name, rows[name])
                    continue
                for name, shared in workloads:
                    rr = System("(d) round robin", [f"{w}/v1/chat/completions" for w in workers], round_robin=True)
                    rows[name].append(asyncio.run(measure(rr, args, shared, rates[name], 1)))
                    show(name, rows[name])
    for name, _ in workloads:
        show(f"{name} (final)", rows[name])


if __name__ == "__main__":
    main()
