"""Prefix-aware routing in simulation: the production router at 8, 64 and 512 nodes (issue 18).

Not a test. One module over 400 lines: one discrete-event model (the workload, the engines'
caches, the mesh's publications and the five policies share its state and its event loop),
read top to bottom like bench_routing_sim.py, whose model it extends (docs/benchmarks-routing.md,
"Prefix-aware routing in simulation", has the figures and the assumptions).

Virtual time, fixed seeds, one model. Every policy replays the same conversations (common
random numbers: the same tenants, prompts, turn counts, reply lengths, think times and
origins); only when a next turn is sent depends on the policy, since it follows its previous
turn's answer.

- ``--nodes`` nodes, each 2 backends x 2 slots; node speeds cycle 1x, 1.5x, 2x
  (bench_routing_sim.SPEEDS). A slot runs one request: service = uncached prompt tokens /
  (``--prefill-tps`` x speed) + reply tokens / (``--decode-tps`` x speed).
- Workload: ``--tenants-per-node`` tenants a node, each with a system prompt of its own of
  1,000-2,000 tokens; conversations of 3-6 turns (tenant uniform), each turn a user message
  of 30-200 tokens sent with the whole history, answered with 40-200 tokens; the next turn is
  sent an exponential think time (mean ``--think-s``) after the answer, to a random origin
  node (clients spread over the nodes). Conversations start as a Poisson process at
  ``--load`` x the fleet's *cold* capacity (every prompt token prefilled): the rate a
  router that never hits would run at that utilisation.
- The prompt is the production rendering (agent/serving/prefixes.py ``prefix_key``: synthetic
  message texts of 4 characters a token, salted per tenant), so the digests are the real ones.
  Each backend's KV cache is an LRU of 1 KiB prompt blocks (``--cache-blocks``, 64 = 16,384
  tokens by default), the block 0 of a prompt used last: a request finds cached the leading
  blocks its backend still holds; its prompt's blocks enter the cache when it starts, and
  those of the prompt and its reply (the next turn's prefix) when it ends. Cached tokens
  count in whole blocks of 256 tokens (the engines cache per token: this understates every
  policy's hits alike).
- TTFT = arrival to start (queueing, forward round trips) + the prefill of the uncached part.

Policies:

- ``viiwork-prefix``: per node the production ``Router`` with ``Reservations`` and slot
  offers (``WantBook``), and prefix routing on: the node's own ``PrefixRouting`` (its index of
  what its backends were given, forwards included; its service-time EWMA) and its
  ``PrefixPublisher``. What a node knows of a peer is what the peer published: its load through
  ``LoadQuantiser`` and ``PublishLimiter`` at this mesh size (as bench_routing_sim's
  ``viiwork-published``), its ``prefixes`` digests (at most 64, at most every 3 s on change; a
  new summary, which carries the current load too) and its prefill speed (``speeds``), each
  publication seen by each node after a delay drawn from ``--seen-ms`` (per publication and
  observer). A forward runs on the peer's backend holding most of its prompt, when free.
- ``viiwork-no-prefix``: the same with ``routing.prefix_routing = false`` (least-loaded and offers).
- ``cache-aware``: a central router in the style of sglang-router 0.3.2 ``cache_aware``: an
  approximate tree per worker (backend) of the prompts it was sent (here: the prompt's chained
  block digests), at most 2**26 characters in all, least recently used first out; when the
  in-flight counts are imbalanced (max - min > 64 and max > 1.5 x min) the least loaded
  worker, else the worker with the longest match when it covers more than 0.3 of the prompt,
  else the worker with the smallest tree. Its counts are exact (it is central); each worker
  queues what it cannot run (FIFO).
- ``round-robin``: central, cyclic over the backends, each queueing FIFO.
- ``central-ttft``: an idealised central router: the production score (agent/serving/scoring.py
  ``choose`` with its guard) over every backend with its *true* cache and load, one global FIFO
  queue; not something viiwork can be, a reference for what stale and partial knowledge costs.

No oracle: with caches the best placement depends on the future, so no simple dispatcher is
the best possible one; ``central-ttft`` is the reference instead.

Usage: .venv/bin/python tests/bench/bench_prefix_sim.py [--nodes 8,64,512] [--loads 0.7]
       [--seeds 1] [--requests 8000] [--policies ...]
"""

from __future__ import annotations

import argparse
import dataclasses
import heapq
import math
import random
import sys
import time
from collections import OrderedDict, deque
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/, for bench.*

from bench.bench_routing_sim import FORWARD_RETRY, MODEL, SPEEDS, pct  # noqa: E402
from viiwork.agent.peering.offers import WANT_FANOUT, Want, WantBook  # noqa: E402
from viiwork.agent.peering.prefix_ext import PUBLISH_MIN_S, PrefixPublisher  # noqa: E402
from viiwork.agent.serving.prefix_routing import PrefixRouting, PrefixSettings  # noqa: E402
from viiwork.agent.serving.prefixes import BLOCK_BYTES, BYTES_PER_TOKEN, PrefixKey, prefix_key  # noqa: E402
from viiwork.agent.serving.router import (  # noqa: E402
    LocalBackend,
    LocalModel,
    PeerSnapshot,
    Queue,
    Refuse,
    Reservation,
    Reservations,
    Router,
    RunLocal,
    RunOnPeer,
)
from viiwork.agent.serving.scoring import Candidate, Guard, ServiceTime, choose  # noqa: E402
from viiwork.mesh.extensions import ModelSpeed, Prefixes, Speeds  # noqa: E402
from viiwork.mesh.identity import NodeId  # noqa: E402
from viiwork.mesh.membership import Liveness  # noqa: E402
from viiwork.mesh.quantise import LoadQuantiser, PublishLimiter  # noqa: E402
from viiwork.mesh.summary import ModelCapacity, PublishedState  # noqa: E402

BACKENDS = 2  # per node
SLOTS = 2  # per backend
NODE_SLOTS = BACKENDS * SLOTS
BACKEND_IDS = tuple(f"b{j}" for j in range(BACKENDS))
TOKENS_PER_BLOCK = BLOCK_BYTES // BYTES_PER_TOKEN
POLICIES = ("viiwork-prefix", "viiwork-no-prefix", "cache-aware", "round-robin", "central-ttft")
# Diagnostics (--diagnostics): the score without its wait term (``PrefixQuery.service_s`` = 0),
# to show what the wait term costs where a free slot runs at once.
DIAGNOSTICS = ("viiwork-prefix-no-wait", "central-ttft-no-wait")
# sglang-router 0.3.2's defaults (sglang_router/router_args.py)
SGL_CACHE_THRESHOLD, SGL_ABS, SGL_REL, SGL_TREE_CHARS = 0.3, 64, 1.5, 2 ** 26

ARRIVAL, DONE, WANT, OFFER, REPLY, RECHECK, PREFIX_TICK, WAKE = range(8)


# -- the workload ------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class TurnSpec:
    """One turn as the client sends it: its prompt's ``key`` (production digests), the digests
    of prompt + reply (``after``: what the engine holds once it answered), token counts, the
    think time before the next turn (ms) and the origin node it is sent to."""

    conv: int
    turn: int
    key: PrefixKey
    after: tuple[str, ...]
    prompt_tokens: int
    reply_tokens: int
    think_ms: float
    origin: int


@dataclass(frozen=True, slots=True)
class Shape:
    tenant: int
    users: tuple[int, ...]
    replies: tuple[int, ...]


def _shape(rng: random.Random, tenants: int) -> Shape:
    turns = rng.randint(3, 6)
    return Shape(rng.randrange(tenants), tuple(rng.randint(30, 200) for _ in range(turns)),
                 tuple(rng.randint(40, 200) for _ in range(turns)))


def _text(rng: random.Random, tokens: int) -> str:
    return rng.randbytes(2 * tokens).hex()  # 4 characters a token


@dataclass
class Params:
    nodes: int = 8
    load: float = 0.7
    seed: int = 1
    tenants_per_node: int = 5
    prefill_tps: float = 1500.0  # tokens/s of one slot at 1x
    decode_tps: float = 30.0
    think_s: float = 2.0
    cache_blocks: int = 64
    warm_s: float = 40.0
    measure_s: float = 40.0
    seen_ms: tuple[float, float] = (100.0, 600.0)
    guard: Guard = Guard()

    def speed(self, node: int) -> float:
        return SPEEDS[node % 3]

    def cold_service_s(self, shape: Shape, system: int, turn: int) -> float:
        prompt = system + sum(shape.users[:turn + 1]) + sum(shape.replies[:turn])
        return prompt / self.prefill_tps + shape.replies[turn] / self.decode_tps


def workload(p: Params) -> tuple[list[tuple[float, list[TurnSpec]]], float]:
    """The conversations (start ms, turns) and the conversation start rate (per s) that
    makes ``p.load`` of the fleet's cold capacity."""
    rng = random.Random(p.seed * 7919 + 1)
    tenants = p.tenants_per_node * p.nodes
    system_tokens = [rng.randint(1000, 2000) for _ in range(tenants)]
    calib = [_shape(random.Random(p.seed * 31 + i), tenants) for i in range(2000)]
    cold = [p.cold_service_s(s, system_tokens[s.tenant], t) for s in calib for t in range(len(s.users))]
    capacity_rps = sum(NODE_SLOTS * p.speed(n) for n in range(p.nodes)) / (sum(cold) / len(cold))
    conv_rate = p.load * capacity_rps / (len(cold) / len(calib))
    systems: dict[int, str] = {}
    out = []
    t, end = 0.0, (p.warm_s + p.measure_s) * 1000.0
    i = 0
    while True:
        t += rng.expovariate(conv_rate / 1000.0)
        if t >= end:
            break
        shape = _shape(rng, tenants)
        if shape.tenant not in systems:
            systems[shape.tenant] = _text(random.Random(p.seed * 1_000_003 + shape.tenant), system_tokens[shape.tenant])
        messages: list[dict[str, str]] = [{"role": "system", "content": systems[shape.tenant]}]
        turns = []
        for k, (u, a) in enumerate(zip(shape.users, shape.replies, strict=True)):
            messages.append({"role": "user", "content": _text(rng, u)})
            key = prefix_key({"messages": messages}, MODEL, f"t{shape.tenant}")
            assert key is not None
            messages.append({"role": "assistant", "content": _text(rng, a)})
            after = prefix_key({"messages": messages}, MODEL, f"t{shape.tenant}")
            assert after is not None
            turns.append(TurnSpec(i, k, key, after.digests, key.prompt_bytes // BYTES_PER_TOKEN, a,
                                  rng.expovariate(1.0 / (p.think_s * 1000.0)), rng.randrange(p.nodes)))
        out.append((t, turns))
        i += 1
    return out, conv_rate


@dataclass(slots=True)
class Req:
    spec: TurnSpec
    arrival: float
    start: float = -1.0
    ttft_ms: float = 0.0
    cached_tokens: int = 0
    service_ms: float = 0.0
    extra_ms: float = 0.0
    refused: int = 0
    backend: int = -1
    forwarded: bool = False
    token: Reservation | None = None


# -- an engine's cache -------------------------------------------------------------------------


class BlockCache:
    """One backend's KV cache: an LRU of prompt blocks (chained digests), ``capacity`` blocks.
    ``on_change(digest, added)`` is told of every block that enters or leaves (central-ttft's
    index of the true caches)."""

    def __init__(self, capacity: int, on_change=None) -> None:
        self.capacity = capacity
        self.blocks: OrderedDict[str, None] = OrderedDict()
        self.on_change = on_change

    def cached(self, digests: tuple[str, ...]) -> int:
        """Leading blocks of ``digests`` held (the engine reuses a prefix, not a hole in it)."""
        n = 0
        for d in digests:
            if d not in self.blocks:
                break
            n += 1
        return n

    def insert(self, digests: tuple[str, ...]) -> None:
        """Hold ``digests``, block 0 used last (evicted last), then evict down to capacity."""
        blocks = self.blocks
        for d in reversed(digests):
            if d in blocks:
                blocks.move_to_end(d)
            else:
                blocks[d] = None
                if self.on_change is not None:
                    self.on_change(d, True)
        while len(blocks) > self.capacity:
            d, _ = blocks.popitem(last=False)
            if self.on_change is not None:
                self.on_change(d, False)


class ApproxTree:
    """sglang-router's approximate tree, by blocks: which worker was sent which prompt
    prefix, at most ``max_entries`` (worker, block) entries in all, least recently used out."""

    def __init__(self, workers: int, max_entries: int) -> None:
        self.max_entries = max_entries
        self.holders: dict[str, set[int]] = {}
        self.lru: OrderedDict[tuple[str, int], None] = OrderedDict()
        self.size = [0] * workers

    def insert(self, g: int, digests: tuple[str, ...]) -> None:
        for d in reversed(digests):
            key = (d, g)
            if key in self.lru:
                self.lru.move_to_end(key)
                continue
            self.lru[key] = None
            self.holders.setdefault(d, set()).add(g)
            self.size[g] += 1
        while len(self.lru) > self.max_entries:
            (d, w), _ = self.lru.popitem(last=False)
            held = self.holders[d]
            held.discard(w)
            if not held:
                del self.holders[d]
            self.size[w] -= 1

    def match(self, digests: tuple[str, ...]) -> tuple[int, set[int]]:
        """The longest matched prefix (blocks) and the workers that have it."""
        for i in range(len(digests) - 1, -1, -1):
            held = self.holders.get(digests[i])
            if held:
                return i + 1, held
        return 0, set()


def _mix(x: int) -> float:
    """A uniform [0, 1) from an integer (splitmix-style), for per-(observer, publication) delays."""
    x = (x + 0x9E3779B97F4A7C15) & 0xFFFFFFFFFFFFFFFF
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
    return ((x ^ (x >> 31)) >> 11) / float(1 << 53)


@dataclass(slots=True)
class Publication:
    at: float
    order: int
    cap: ModelCapacity
    prefixes: Prefixes | None


# -- the simulation ----------------------------------------------------------------------------


class Simulation:
    def __init__(self, policy: str, p: Params, convs: list[tuple[float, list[TurnSpec]]]) -> None:
        if policy not in POLICIES + DIAGNOSTICS:
            raise ValueError(f"unknown policy {policy!r}; known: {', '.join(POLICIES + DIAGNOSTICS)}")
        self.policy, self.p, self.convs = policy, p, convs
        n = self.n = p.nodes
        self.mesh = policy.startswith("viiwork")
        self.prefix_on = policy.startswith("viiwork-prefix")
        self.central = policy.startswith("central-ttft")
        self.no_wait = policy.endswith("-no-wait")
        self.now = 0.0
        self.end_ms = (p.warm_s + p.measure_s) * 1000.0
        self.events: list[tuple[float, int, int, object]] = []
        self.seq = 0
        self.rng = random.Random(p.seed * 104729 + 3)
        self.speed = [p.speed(i) for i in range(n)]
        workers = n * BACKENDS
        self.bbusy = [0] * workers
        self.bheld = [0] * workers
        self.engine_holders: dict[str, set[int]] | None = {} if self.central else None
        self.caches = [BlockCache(p.cache_blocks, self._holder_change(g) if self.engine_holders is not None else None)
                       for g in range(workers)]
        self.done: list[Req] = []
        self.service = ServiceTime()
        self.routes: dict[str, int] = {}
        if self.mesh:
            self._init_mesh()
        elif self.central:
            self.gqueue: deque[Req] = deque()
        else:
            self.bqueue: list[deque[Req]] = [deque() for _ in range(workers)]
            self.inflight = [0] * workers
            self.rr = 0
            self.tree = ApproxTree(workers, SGL_TREE_CHARS // BLOCK_BYTES)
        for t, turns in convs:
            self.push(t, ARRIVAL, Req(turns[0], t))

    def _holder_change(self, g: int):
        def change(d: str, added: bool) -> None:
            assert self.engine_holders is not None
            if added:
                self.engine_holders.setdefault(d, set()).add(g)
            else:
                held = self.engine_holders[d]
                held.discard(g)
                if not held:
                    del self.engine_holders[d]
        return change

    def _init_mesh(self) -> None:
        n, p = self.n, self.p
        setup = random.Random(p.seed * 7919 + 17)
        self.rtt = [[0.0] * n for _ in range(n)]
        for a in range(n):
            row = self.rtt[a]
            for b in range(a + 1, n):
                row[b] = self.rtt[b][a] = setup.uniform(0.3, 2.0)
        self.ids = [NodeId(f"node{i:04d}aaaaaaaaaa") for i in range(n)]
        self.index_of = {nid: i for i, nid in enumerate(self.ids)}
        self.names = [f"node{i}" for i in range(n)]
        settings = PrefixSettings(enabled=self.prefix_on, guard=p.guard)
        self.prefixes = [PrefixRouting(settings, {}) for _ in range(n)]
        self.publishers = [PrefixPublisher(self.prefixes[i], lambda: self.now / 1000.0) for i in range(n)]
        self.prefix_due = [False] * n
        self.pub_prefixes: list[Prefixes | None] = [None] * n
        self.speeds_ext = [Speeds((ModelSpeed(MODEL, int(p.prefill_tps * s), int(p.decode_tps * s)),))
                           for s in self.speed]
        self.quantisers = [LoadQuantiser() for _ in range(n)]
        self.limiters = [PublishLimiter() for _ in range(n)]
        self.pub_load: list[tuple[int, int] | None] = [None] * n
        self.order = [0] * n
        self.pubs: list[list[Publication]] = [[] for _ in range(n)]
        self.snaps: list[list[tuple[int, PeerSnapshot] | None]] = [[None] * n for _ in range(n)]
        self.recheck = [False] * n
        self.queues: list[deque[Req]] = [deque() for _ in range(n)]
        self.wants = [WantBook(clock=lambda: self.now, ttl_ms=600_000.0) for _ in range(n)]
        self.announced: list[float | None] = [None] * n
        # The peers an origin tells of its waiters: WANT_FANOUT of them (mesh_link._announce: those
        # with most slots, all equal here, in the order of its table: a fixed order per origin here).
        self.want_targets = []
        for o in range(n):
            order = [q for q in range(n) if q != o]
            setup.shuffle(order)
            self.want_targets.append(order[:WANT_FANOUT])
        self.routers = []
        self.reservations = []
        for o in range(n):
            res = Reservations(clock=lambda: self.now)
            self.reservations.append(res)
            self.routers.append(Router(self.ids[o], self.names[o], stale_after_ms=3000, reservations=res,
                                       rng=random.Random(p.seed * 1000 + o)))
        for o in range(n):  # every node publishes on start
            self.publish(o)

    def push(self, t: float, kind: int, data: object) -> None:
        self.seq += 1
        heapq.heappush(self.events, (t, self.seq, kind, data))

    # -- engines -----------------------------------------------------------------------------

    def start(self, r: Req, g: int) -> None:
        """``r`` takes a slot of backend ``g`` now (it starts after its forward's trip)."""
        node = g // BACKENDS
        self.bbusy[g] += 1
        spec = r.spec
        cache = self.caches[g]
        r.cached_tokens = min(spec.prompt_tokens, cache.cached(spec.key.digests) * TOKENS_PER_BLOCK)
        cache.insert(spec.key.digests)
        speed = self.speed[node]
        prefill_ms = (spec.prompt_tokens - r.cached_tokens) / (self.p.prefill_tps * speed) * 1000.0
        r.service_ms = prefill_ms + spec.reply_tokens / (self.p.decode_tps * speed) * 1000.0
        r.start = self.now + r.extra_ms
        r.ttft_ms = r.start - r.arrival + prefill_ms
        r.backend = g
        self.push(r.start + r.service_ms, DONE, r)
        if self.mesh:
            r.forwarded = node != spec.origin
            if self.prefix_on:
                self.prefixes[node].served(MODEL, BACKEND_IDS[g % BACKENDS], spec.key)
                self.prefix_changed(node)
            self.load_changed(node)

    def finish(self, r: Req) -> None:
        g = r.backend
        node = g // BACKENDS
        self.bbusy[g] -= 1
        self.caches[g].insert(r.spec.after)
        self.service.add(r.service_ms / 1000.0)
        self.done.append(r)
        if self.mesh:
            self.prefixes[node].ended(MODEL, r.service_ms / 1000.0)
            o = r.spec.origin
            if r.token is not None:
                self.reservations[o].release(r.token)
                r.token = None
            self.load_changed(node)
            self.slot_freed(node, g)
            if o != node:
                self.wake(o)
        elif self.central:
            if self.gqueue:
                self.central_ttft(self.gqueue.popleft())
        else:
            self.inflight[g] -= 1
            if self.bqueue[g]:
                self.start(self.bqueue[g].popleft(), g)
        turns = self.convs[r.spec.conv][1]
        if r.spec.turn + 1 < len(turns):
            t = self.now + r.spec.think_ms
            if t < self.end_ms:
                self.push(t, ARRIVAL, Req(turns[r.spec.turn + 1], t))

    def free(self, g: int) -> int:
        return SLOTS - self.bbusy[g] - self.bheld[g]

    # -- central policies --------------------------------------------------------------------

    def dispatch(self, r: Req, g: int) -> None:
        self.inflight[g] += 1
        if self.bbusy[g] < SLOTS:
            self.start(r, g)
        else:
            self.bqueue[g].append(r)

    def cache_aware(self, r: Req) -> int:
        loads = self.inflight
        most, least = max(loads), min(loads)
        if most - least > SGL_ABS and most > least * SGL_REL:
            g = loads.index(least)
            self.count("balance")
        else:
            digests = r.spec.key.digests
            blocks, held = self.tree.match(digests)
            if held and blocks * BLOCK_BYTES / r.spec.key.prompt_bytes > SGL_CACHE_THRESHOLD:
                g = min(held, key=lambda w: (loads[w], w))
                self.count("match")
            else:
                size = self.tree.size
                g = min(range(len(size)), key=lambda w: (size[w], loads[w]))
                self.count("smallest-tree")
        self.tree.insert(g, r.spec.key.digests)
        return g

    def central_ttft(self, r: Req) -> None:
        """The production score over every backend's true state; None: least busy, fastest."""
        free = [g for g in range(len(self.bbusy)) if self.bbusy[g] < SLOTS]
        if not free:
            self.gqueue.append(r)
            return
        digests = r.spec.key.digests
        assert self.engine_holders is not None
        hit = self.engine_holders.get(digests[0], set()) if digests else set()
        cands, seen = [], set()
        for g in free:
            node = g // BACKENDS
            blocks = self.caches[g].cached(digests) if g in hit else 0
            cls = (self.bbusy[g], self.speed[node])
            if blocks == 0:
                if cls in seen:  # an equal miss: scored the same as the one already in
                    continue
                seen.add(cls)
            cands.append(Candidate(str(g), str(g), SLOTS - self.bbusy[g], SLOTS, 0.0,
                                   self.p.prefill_tps * self.speed[node], blocks))
        service_s = 0.0 if self.no_wait else self.service.value_s
        scored = choose(cands, r.spec.key.prompt_bytes, service_s, self.p.guard)
        if scored is not None:
            self.count("prefix-hit" if scored.candidate.blocks else "predicted-ttft")
            self.start(r, int(scored.candidate.node))
            return
        self.count("least-loaded")
        self.start(r, min(free, key=lambda g: (self.bbusy[g], -self.speed[g // BACKENDS], g)))

    def count(self, route: str) -> None:
        self.routes[route] = self.routes.get(route, 0) + 1

    # -- the mesh: what a node publishes and when its peers see it ---------------------------------

    def delay_ms(self, o: int, p: int, order: int) -> float:
        lo, hi = self.p.seen_ms
        return lo + (hi - lo) * _mix((self.p.seed * 1_000_003 + o) * 1_000_033 + p * 65_537 + order)

    def quantised(self, p: int) -> tuple[ModelCapacity, tuple[int, int]]:
        busy = sum(self.bbusy[p * BACKENDS:(p + 1) * BACKENDS]) + sum(self.bheld[p * BACKENDS:(p + 1) * BACKENDS])
        cap = ModelCapacity(MODEL, "llamacpp", "chat", NODE_SLOTS, min(NODE_SLOTS, busy),
                            1 if self.queues[p] else 0, 4096, BACKENDS, BACKENDS)
        q = self.quantisers[p].quantise([cap])[0]
        return q, (q.busy, q.waiting if q.waiting is not None else 0)

    def publish(self, p: int) -> None:
        """A new summary of ``p``: its quantised load now and its published prefixes."""
        cap, load = self.quantised(p)
        self.limiters[p].published(self.now)
        self.pub_load[p] = load
        self.order[p] += 1
        pubs = self.pubs[p]
        pubs.append(Publication(self.now, self.order[p], cap, self.pub_prefixes[p]))
        hi = self.p.seen_ms[1]
        while len(pubs) > 1 and pubs[1].at + hi <= self.now:  # seen everywhere: older ones are moot
            pubs.pop(0)
        for o in range(self.n):  # a fresher picture wakes an origin with waiters
            if o != p and self.queues[o]:
                self.push(self.now + self.delay_ms(o, p, self.order[p]), WAKE, o)

    def load_changed(self, p: int) -> None:
        """As bench_routing_sim's ``viiwork-published``: publish the quantised load when the
        limiter lets it go out, else re-check when its interval ends."""
        _, load = self.quantised(p)
        limiter = self.limiters[p]
        changed = load != self.pub_load[p]
        if not limiter.due(self.now, self.n, False, changed):
            if limiter.held_back and not self.recheck[p]:
                assert limiter.last_published_ms is not None
                self.recheck[p] = True
                self.push(limiter.last_published_ms + limiter.interval_ms(self.n) + 0.001, RECHECK, p)
            return
        if changed:
            self.publish(p)
        else:
            limiter.published(self.now)

    def prefix_changed(self, p: int) -> None:
        """The production PrefixPublisher decides; a new value is a new summary at once."""
        value = self.publishers[p].update()
        if value is not None:
            self.pub_prefixes[p] = value if value.models else None
            self.publish(p)
        elif self.publishers[p].prefixes.version() != self.publishers[p]._version and not self.prefix_due[p]:
            at = self.publishers[p]._at
            assert at is not None
            self.prefix_due[p] = True
            self.push((at + PUBLISH_MIN_S) * 1000.0 + 0.001, PREFIX_TICK, p)

    def peers_of(self, o: int) -> list[PeerSnapshot]:
        """``o``'s picture: each peer's newest publication ``o`` has seen by now."""
        out = []
        now, hi = self.now, self.p.seen_ms[1]
        snaps = self.snaps[o]
        rtt = self.rtt[o]
        for p in range(self.n):
            if p == o:
                continue
            pubs = self.pubs[p]
            pub = None
            for k in range(len(pubs) - 1, -1, -1):
                c = pubs[k]
                if now >= c.at + hi or now >= c.at + self.delay_ms(o, p, c.order):
                    pub = c
                    break
            if pub is None:
                continue
            held = snaps[p]
            if held is None or held[0] != pub.order:
                held = snaps[p] = (pub.order, PeerSnapshot(
                    self.ids[p], self.names[p], Liveness.ALIVE, PublishedState.SERVING, 0.0, (1, pub.order),
                    (pub.cap,), rtt[p], None, pub.prefixes, self.speeds_ext[p]))
            out.append(held[1])
        return out

    # -- the mesh: routing, forwarding, queueing, offers ---------------------------------------

    def route(self, o: int, r: Req, tried: set[int]) -> RunLocal | RunOnPeer | None:
        backends = tuple(LocalBackend(BACKEND_IDS[j], max(0, self.free(o * BACKENDS + j)), SLOTS,
                                      self.p.prefill_tps * self.speed[o]) for j in range(BACKENDS))
        local = {MODEL: LocalModel(MODEL, "chat", backends, NODE_SLOTS, True, 4096)}
        prefix = self.prefixes[o].query(MODEL, r.spec.key) if self.prefix_on else None
        if prefix is not None and self.no_wait:
            prefix = dataclasses.replace(prefix, service_s=0.0)
        d = self.routers[o].route(MODEL, local, self.peers_of(o), exclude={self.ids[p] for p in tried},
                                  prefix=prefix)
        if isinstance(d, Refuse):
            raise AssertionError(f"router refused: {d.message}")
        if isinstance(d, Queue):
            return None
        self.count(d.route.split(" ")[0])
        return d

    def admit(self, r: Req, p: int) -> int | None:
        """The backend of ``p`` a forward runs on (run_forwarded: the free one holding most of
        its prompt, else the one with most free slots), None: no free slot (refused)."""
        free = [p * BACKENDS + j for j in range(BACKENDS) if self.free(p * BACKENDS + j) > 0]
        if not free:
            return None
        hit = self.prefixes[p].local_hit(MODEL, r.spec.key if self.prefix_on else None,
                                         ((BACKEND_IDS[g % BACKENDS], SLOTS - self.free(g)) for g in free))
        if hit is not None:
            return p * BACKENDS + BACKEND_IDS.index(hit[0])
        return max(free, key=lambda g: (self.free(g), -g))

    def try_place(self, r: Req) -> bool:
        o = r.spec.origin
        tried: set[int] = set()
        for _ in range(1 + FORWARD_RETRY):
            d = self.route(o, r, tried)
            if d is None:
                return False
            if isinstance(d, RunLocal):
                self.start(r, o * BACKENDS + BACKEND_IDS.index(d.backend_id))
                return True
            p = self.index_of[d.node_id]
            token = self.reservations[o].reserve(d.node_id, MODEL)
            g = self.admit(r, p)
            if g is not None:
                r.extra_ms += self.rtt[o][p] / 2.0
                r.token = token
                self.start(r, g)
                return True
            r.extra_ms += self.rtt[o][p]
            r.refused += 1
            self.reservations[o].release(token)
            self.reservations[o].mark_full(d.node_id, MODEL)
            tried.add(p)
        return False

    def arrive(self, r: Req) -> None:
        if self.mesh:
            o = r.spec.origin
            if self.queues[o] or not self.try_place(r):
                self.queues[o].append(r)
                self.load_changed(o)
                self.announce(o)
        elif self.central:
            if self.gqueue:
                self.gqueue.append(r)
            else:
                self.central_ttft(r)
        elif self.policy == "round-robin":
            self.rr = (self.rr + 1) % len(self.bbusy)
            self.dispatch(r, self.rr)
        else:
            self.dispatch(r, self.cache_aware(r))

    def wake(self, o: int) -> None:
        q = self.queues[o]
        while q and self.try_place(q[0]):
            q.popleft()
        self.load_changed(o)
        self.announce(o)

    def announce(self, o: int) -> None:
        """A want to ``o``'s WANT_FANOUT peers when its oldest waiter changed (bench_routing_sim's
        model, with the production fan-out)."""
        q = self.queues[o]
        oldest = q[0].arrival if q else None
        if oldest == self.announced[o]:
            return
        self.announced[o] = oldest
        want = Want(MODEL, len(q), self.now - oldest if oldest is not None else 0.0)
        for p in self.want_targets[o]:
            self.push(self.now + self.rtt[o][p] / 2.0, WANT, (p, o, want))

    def slot_freed(self, p: int, g: int) -> None:
        """A slot of ``g`` (on ``p``) freed: to the oldest waiter ``p`` knows of."""
        q = self.queues[p]
        peer = self.wants[p].pick(MODEL, self.now - q[0].arrival if q else None)
        if peer is None:
            self.wake(p)
            return
        o = self.index_of[peer]
        self.wants[p].offered(peer, MODEL)
        self.bheld[g] += 1
        self.load_changed(p)
        self.push(self.now + self.rtt[p][o] / 2.0, OFFER, (o, p, g))

    # -- the loop ------------------------------------------------------------------------------

    def run(self) -> None:
        while self.events:
            t, _, kind, data = heapq.heappop(self.events)
            self.now = t
            if kind == ARRIVAL:
                self.arrive(data)  # type: ignore[arg-type]
            elif kind == DONE:
                self.finish(data)  # type: ignore[arg-type]
            elif kind == WANT:
                p, o, want = data  # type: ignore[misc]
                self.wants[p].note(self.ids[o], want)
                if want.waiting:
                    free = [g for g in range(p * BACKENDS, (p + 1) * BACKENDS) if self.free(g) > 0]
                    if free:
                        self.slot_freed(p, free[0])
            elif kind == OFFER:  # o is offered a slot of g (on p): it sends its oldest waiter, or declines
                o, p, g = data  # type: ignore[misc]
                r = self.queues[o].popleft() if self.queues[o] else None
                self.load_changed(o)
                self.push(self.now + self.rtt[o][p] / 2.0, REPLY, (p, g, r))
                self.announce(o)
            elif kind == REPLY:
                p, g, r = data  # type: ignore[misc]
                self.bheld[g] -= 1
                if r is None:
                    self.load_changed(p)
                    self.slot_freed(p, g)
                else:
                    self.count("offer")
                    self.start(r, g)
            elif kind == RECHECK:
                self.recheck[data] = False  # type: ignore[index]
                self.load_changed(data)  # type: ignore[arg-type]
            elif kind == PREFIX_TICK:
                self.prefix_due[data] = False  # type: ignore[index]
                self.prefix_changed(data)  # type: ignore[arg-type]
            elif kind == WAKE:
                if self.queues[data]:  # type: ignore[index]
                    self.wake(data)  # type: ignore[arg-type]


# -- measuring ---------------------------------------------------------------------------------


def measure(sim: Simulation) -> dict[str, float]:
    p = sim.p
    lo, hi = p.warm_s * 1000.0, sim.end_ms
    rows = [r for r in sim.done if lo <= r.arrival < hi]
    ttft = [r.ttft_ms / 1000.0 for r in rows]
    busy = [0.0] * p.nodes
    for r in sim.done:  # slot time inside the window, per node
        a, b = max(lo, r.start), min(hi, r.start + r.service_ms)
        if b > a:
            busy[r.backend // BACKENDS] += b - a
    util = [b / (NODE_SLOTS * (hi - lo)) for b in busy]
    mean_util = sum(util) / len(util)
    sd = math.sqrt(sum((u - mean_util) ** 2 for u in util) / len(util))
    prompt = sum(r.spec.prompt_tokens for r in rows)
    routed = sum(sim.routes.values()) or 1
    hits = sum(v for k, v in sim.routes.items() if k in ("prefix-hit", "match"))
    return {"requests": len(rows), "p50": pct(ttft, 0.5), "p99": pct(ttft, 0.99),
            "cached": sum(r.cached_tokens for r in rows) / prompt if prompt else 0.0,
            "util": mean_util, "util_max": max(util), "util_cv": sd / mean_util if mean_util else 0.0,
            "forwarded": sum(r.forwarded for r in rows) / len(rows), "hit_routes": hits / routed}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--nodes", default="8,64,512", help="mesh sizes (default 8,64,512)")
    ap.add_argument("--loads", default="0.7", help="offered loads, of the cold capacity (default 0.7)")
    ap.add_argument("--seeds", default="1", help="comma-separated seeds, pooled (default 1)")
    ap.add_argument("--policies", default=",".join(POLICIES))
    ap.add_argument("--diagnostics", action="store_true", help="add " + ", ".join(DIAGNOSTICS))
    ap.add_argument("--requests", type=int, default=8000,
                    help="about this many measured requests per run: the window grows to fit (default 8000)")
    ap.add_argument("--warm-s", type=float, default=40.0, help="warm-up, not measured (default 40 s)")
    ap.add_argument("--min-measure-s", type=float, default=40.0, help="shortest measured window (default 40 s)")
    ap.add_argument("--cache-blocks", type=int, default=64, help="KV cache per backend, 1 KiB blocks (default 64)")
    ap.add_argument("--tenants-per-node", type=int, default=5)
    ap.add_argument("--prefill-tps", type=float, default=1500.0, help="prefill tokens/s of a slot at 1x")
    ap.add_argument("--decode-tps", type=float, default=30.0, help="decode tokens/s of a slot at 1x")
    ap.add_argument("--think-s", type=float, default=2.0, help="mean think time between turns (s)")
    ap.add_argument("--guard-slots", type=int, default=Guard().guard_slots, help="routing.prefix_guard_slots")
    args = ap.parse_args(argv)
    began = time.perf_counter()
    print(f"nodes x {BACKENDS} backends x {SLOTS} slots, speeds 1x/1.5x/2x, prefill {args.prefill_tps:g} tok/s, "
          f"decode {args.decode_tps:g} tok/s a slot at 1x; KV cache {args.cache_blocks} blocks "
          f"({args.cache_blocks * TOKENS_PER_BLOCK} tokens) a backend; {args.tenants_per_node} tenants a node; "
          f"think {args.think_s:g} s; seeds {args.seeds}\n")
    print("| nodes | load | policy | requests | TTFT p50 s | TTFT p99 s | cached share | util mean | util max "
          "| util CV | forwarded | hit routes | sim s |")
    print("|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for nodes in (int(x) for x in args.nodes.split(",")):
        for load in (float(x) for x in args.loads.split(",")):
            base = Params(nodes=nodes, load=load, tenants_per_node=args.tenants_per_node,
                          prefill_tps=args.prefill_tps, decode_tps=args.decode_tps, think_s=args.think_s,
                          cache_blocks=args.cache_blocks, warm_s=args.warm_s,
                          guard=Guard(guard_slots=args.guard_slots))
            for policy in args.policies.split(",") + (list(DIAGNOSTICS) if args.diagnostics else []):
                merged: dict[str, list[float]] = {}
                took = time.perf_counter()
                for seed in (int(s) for s in args.seeds.split(",")):
                    p = Params(**{**base.__dict__, "seed": seed})
                    _, rate = workload(Params(**{**p.__dict__, "warm_s": 0.0, "measure_s": 0.0}))
                    p.measure_s = max(args.min_measure_s, args.requests / (rate * 4.5))
                    convs, _ = workload(p)
                    sim = Simulation(policy, p, convs)
                    sim.run()
                    for k, v in measure(sim).items():
                        merged.setdefault(k, []).append(v)
                m = {k: (sum(v) if k == "requests" else sum(v) / len(v)) for k, v in merged.items()}
                print(f"| {nodes} | {load:.0%} | {policy} | {m['requests']:.0f} | {m['p50']:.2f} | {m['p99']:.2f} | "
                      f"{m['cached']:.2f} | {m['util']:.0%} | {m['util_max']:.0%} | {m['util_cv']:.2f} | "
                      f"{m['forwarded']:.0%} | {m['hit_routes']:.0%} | {time.perf_counter() - took:.0f} |", flush=True)
    print(f"\n(simulation took {time.perf_counter() - began:.1f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
