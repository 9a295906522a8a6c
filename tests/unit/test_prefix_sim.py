"""The prefix model of the routing simulation (tests/bench/bench_prefix_sim.py) where its
figures depend on it: what an engine's cache holds and serves, the tokens a request prefills,
its time to first token, and when a peer's published digests are seen. Pure, well under 5 s."""

from __future__ import annotations

import pytest
from bench.bench_prefix_sim import (
    BACKENDS,
    TOKENS_PER_BLOCK,
    BlockCache,
    Params,
    Req,
    Simulation,
    TurnSpec,
    workload,
)

from viiwork.agent.serving.prefixes import prefix_key

SYSTEM = "s" * 6000  # 5 whole blocks of 1 KiB with its role and length
MODEL = "m"


def key(*messages: tuple[str, str], tenant: str = "t1"):
    k = prefix_key({"messages": [{"role": r, "content": c} for r, c in messages]}, MODEL, tenant)
    assert k is not None
    return k


def turn(k, prompt_tokens: int, reply_tokens: int = 60, origin: int = 0) -> TurnSpec:
    return TurnSpec(0, 0, k, k.digests, prompt_tokens, reply_tokens, 0.0, origin)


def test_a_shared_system_prompt_hits_and_another_order_does_not() -> None:
    cache = BlockCache(64)
    first = key(("system", SYSTEM), ("user", "a" * 3000))
    cache.insert(first.digests)
    later = key(("system", SYSTEM), ("user", "b" * 3000))  # another conversation, same tenant
    assert 5 <= cache.cached(later.digests) < len(later.digests)
    swapped = key(("user", "a" * 3000), ("system", SYSTEM))  # the same messages in another order
    assert cache.cached(swapped.digests) == 0
    other_tenant = key(("system", SYSTEM), ("user", "a" * 3000), tenant="t2")  # salted per tenant
    assert cache.cached(other_tenant.digests) == 0


def test_the_cache_evicts_least_recently_used_tails_first() -> None:
    cache = BlockCache(8)
    a = key(("system", SYSTEM), ("user", "a" * 2000))  # 7 blocks
    b = key(("system", "x" * 6000), ("user", "b" * 2000))
    cache.insert(a.digests)
    assert cache.cached(a.digests) == len(a.digests) == 7
    cache.insert(b.digests)
    assert len(cache.blocks) == 8
    assert cache.cached(b.digests) == 7
    # a's head survives longest: its block 0 is the most recently used of a's blocks.
    assert cache.cached(a.digests) == 1
    assert a.digests[0] in cache.blocks and a.digests[-1] not in cache.blocks


def test_uncached_tokens_set_the_prefill_and_the_time_to_first_token() -> None:
    p = Params(nodes=3, prefill_tps=1000.0, decode_tps=20.0)  # node 2 runs at 2x
    sim = Simulation("round-robin", p, [])
    k = key(("system", SYSTEM), ("user", "q" * 1200))
    prompt_tokens = k.prompt_bytes // 4
    g = 2 * BACKENDS  # the first backend of node 2
    sim.caches[g].insert(k.digests[:4])  # 4 leading blocks cached
    sim.now = 1000.0
    r = Req(turn(k, prompt_tokens), arrival=400.0)
    sim.start(r, g)
    assert r.cached_tokens == 4 * TOKENS_PER_BLOCK
    prefill_ms = (prompt_tokens - 4 * TOKENS_PER_BLOCK) / 2000.0 * 1000.0
    assert r.ttft_ms == pytest.approx(600.0 + prefill_ms)
    assert r.service_ms == pytest.approx(prefill_ms + 60 / 40.0 * 1000.0)
    again = Req(turn(k, prompt_tokens), arrival=1000.0)  # the whole prompt is cached now
    sim.start(again, g)
    assert again.cached_tokens == len(k.digests) * TOKENS_PER_BLOCK
    assert again.ttft_ms == pytest.approx((prompt_tokens - again.cached_tokens) / 2000.0 * 1000.0)
    on_another = Req(turn(k, prompt_tokens), arrival=1000.0)  # another backend of the node: cold
    sim.start(on_another, g + 1)
    assert on_another.cached_tokens == 0


def test_a_peers_digests_are_seen_only_after_its_publication_reaches_the_observer() -> None:
    p = Params(nodes=3)
    sim = Simulation("viiwork-prefix", p, [])
    k = key(("system", SYSTEM), ("user", "q" * 1200))
    sim.now = 5000.0
    sim.start(Req(turn(k, k.prompt_bytes // 4, origin=1), arrival=5000.0), 1 * BACKENDS)
    published = sim.pubs[1][-1]
    assert published.prefixes is not None and set(published.prefixes.of(MODEL)) <= set(k.digests)
    seen_at = published.at + sim.delay_ms(0, 1, published.order)
    sim.now = seen_at - 1.0
    assert all(s.order[1] < published.order for s in sim.peers_of(0) if s.node_id == sim.ids[1])
    sim.now = seen_at
    peer = next(s for s in sim.peers_of(0) if s.node_id == sim.ids[1])
    assert peer.prefixes is published.prefixes


def test_the_offered_load_is_the_share_of_the_cold_capacity() -> None:
    p = Params(nodes=8, load=0.5, warm_s=0.0, measure_s=400.0)
    convs, rate = workload(p)
    turns = [t for _, ts in convs for t in ts]
    cold_s = sum(t.prompt_tokens / (p.prefill_tps) + t.reply_tokens / p.decode_tps for t in turns)
    capacity = sum(4 * p.speed(n) for n in range(8))  # slot-seconds per second at 1x
    # Cold work offered per second over the window, against the capacity: about the load.
    assert cold_s / 400.0 / capacity == pytest.approx(0.5, rel=0.15)
    assert all(3 <= len(ts) <= 6 for _, ts in convs) and rate > 0
