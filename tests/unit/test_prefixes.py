"""Prefix-aware routing (issue 18): block chaining, tenant salting, the index's budget, the
published digests and their bounds, the scoring tables and the router's prefix rule."""

from __future__ import annotations

import random
from typing import Any

import pytest

from viiwork.agent.peering.prefix_ext import PUBLISH_MIN_S, PrefixPublisher, per_model_limit
from viiwork.agent.serving.prefix_routing import PrefixRouting, PrefixSettings
from viiwork.agent.serving.prefixes import (
    BLOCK_BYTES,
    MAX_BLOCKS,
    PrefixIndex,
    PrefixKey,
    peer_hit,
    prefix_key,
    published_positions,
    render_prompt,
)
from viiwork.agent.serving.route_header import MAX_ROUTE_CHARS, route_entry, route_from_origin
from viiwork.agent.serving.router import (
    LocalBackend,
    LocalModel,
    PeerSnapshot,
    Reservations,
    Router,
    RunLocal,
    RunOnPeer,
    local_by_prefix,
)
from viiwork.agent.serving.scoring import Candidate, Guard, PrefixQuery, choose
from viiwork.mesh.extensions import (
    PREFIXES,
    Extensions,
    ModelPrefixes,
    ModelSpeed,
    Prefixes,
    Speeds,
    decode_extensions,
)
from viiwork.mesh.identity import NodeId
from viiwork.mesh.membership import Liveness
from viiwork.mesh.summary import ModelCapacity, PublishedState

M = "qwen"
SYSTEM = "You are a careful assistant. " * 200  # ~5.8 KB: five whole blocks and some


def chat(*turns: str, system: str = SYSTEM, tools: Any = None) -> dict[str, Any]:
    messages = [{"role": "system", "content": system}]
    for i, t in enumerate(turns):
        messages.append({"role": "user" if i % 2 == 0 else "assistant", "content": t})
    body: dict[str, Any] = {"model": M, "messages": messages}
    if tools is not None:
        body["tools"] = tools
    return body


def key(body: dict[str, Any], tenant: str = "", sharing: Any = "tenant") -> PrefixKey:
    k = prefix_key(body, M, tenant, sharing)
    assert k is not None
    return k


def shared(a: PrefixKey, b: PrefixKey) -> int:
    n = 0
    for x, y in zip(a.digests, b.digests, strict=False):
        if x != y:
            break
        n += 1
    return n


# --- blocks and chaining ------------------------------------------------------------------


def test_a_shared_system_prompt_with_different_last_turns_shares_its_leading_blocks() -> None:
    one = key(chat("what is the capital of France? " * 40))
    two = key(chat("how tall is the Eiffel tower? " * 40))
    system_blocks = len(SYSTEM) // BLOCK_BYTES
    assert len(one.digests) > system_blocks and len(two.digests) > system_blocks
    assert shared(one, two) == system_blocks  # the blocks of the system prompt alone, not one more


def test_a_later_turn_contains_every_block_of_the_earlier_one() -> None:
    first = key(chat("question one " * 100))
    later = key(chat("question one " * 100, "an answer " * 50, "question two " * 100))
    assert later.digests[:len(first.digests)] == first.digests
    assert len(later.digests) > len(first.digests)


def test_the_same_content_in_another_order_does_not_share() -> None:
    a = key(chat("x" * 3000, "y" * 3000, system="s" * 3000))
    b = key(chat("y" * 3000, "x" * 3000, system="s" * 3000))
    assert shared(a, b) == 2  # the system prompt's two whole blocks; nothing after the first difference
    # chained: a block after a difference differs even when its own bytes are the same
    one, two = key({"prompt": "A" * BLOCK_BYTES + "z" * 3072}), key({"prompt": "B" * BLOCK_BYTES + "z" * 3072})
    assert len(one.digests) == 4 and not set(one.digests) & set(two.digests)
    # the order of the messages, not their concatenation: roles and boundaries count
    c = key({"messages": [{"role": "user", "content": "s" * 3000 + "x" * 3000}]})
    assert c.digests[0] != a.digests[0]


def test_tools_come_first_and_other_fields_do_not_count() -> None:
    plain = chat("q" * 2000)
    tooled = chat("q" * 2000, tools=[{"type": "function", "function": {"name": "f" * 2000}}])
    assert key(plain).digests[0] != key(tooled).digests[0]
    assert key({**plain, "temperature": 0.3, "max_tokens": 9}) == key(plain)
    # Anthropic's top-level system prompt counts like OpenAI's system message
    anthropic = {"system": SYSTEM, "messages": [{"role": "user", "content": "q" * 2000}]}
    assert key(anthropic) == key(plain)
    # canonical JSON: the key order inside a content part does not matter
    parts_a = {"messages": [{"role": "user", "content": [{"type": "text", "text": "z" * 2000}]}]}
    parts_b = {"messages": [{"content": [{"text": "z" * 2000, "type": "text"}], "role": "user"}]}
    assert key(parts_a) == key(parts_b)


@pytest.mark.parametrize("body, has_prompt", [
    ({"prompt": "p" * 3000}, True),
    ({"prompt": ["p" * 3000]}, True),
    ({"input": "an embedding"}, False),
    ({"messages": "not a list"}, False),
], ids=["completion", "completion-list", "embedding", "malformed-messages"])
def test_completion_prompts_hash_and_embeddings_have_no_prefix(body: dict[str, Any], has_prompt: bool) -> None:
    assert (render_prompt(body) is not None) is has_prompt
    k = prefix_key(body, M, "")
    assert (k is not None and len(k.digests) == 2) is has_prompt


def test_only_whole_blocks_are_hashed() -> None:
    assert key({"prompt": "a" * (BLOCK_BYTES - 1)}).digests == ()
    assert len(key({"prompt": "a" * (3 * BLOCK_BYTES + 5)}).digests) == 3
    assert key({"prompt": "a" * (3 * BLOCK_BYTES + 5)}).prompt_bytes == 3 * BLOCK_BYTES + 5


# --- salting ---------------------------------------------------------------------------------


def test_tenants_salt_their_digests_and_model_sharing_does_not() -> None:
    body = chat("hello " * 300)
    a, b = key(body, "tenant-a"), key(body, "tenant-b")
    assert not set(a.digests) & set(b.digests)
    assert key(body, "tenant-a", "model") == key(body, "tenant-b", "model")
    assert key(body, "tenant-a") == key(body, "tenant-a")
    other_model = prefix_key(body, "other", "tenant-a")
    assert other_model is not None and not set(other_model.digests) & set(a.digests)


def test_another_tenant_finds_no_hit_in_the_index() -> None:
    idx = PrefixIndex()
    idx.served("b0", key(chat("q " * 500), "tenant-a"))
    assert idx.hits(key(chat("q " * 500), "tenant-a")) == {"b0": len(key(chat("q " * 500)).digests)}
    assert idx.hits(key(chat("q " * 500), "tenant-b")) == {}


# --- the index -------------------------------------------------------------------------------


def test_hits_are_the_longest_leading_run_per_backend() -> None:
    idx = PrefixIndex()
    first = key(chat("one " * 300))
    later = key(chat("one " * 300, "answer " * 100, "two " * 300))
    other = key(chat("three " * 300))
    idx.served("b0", first)
    idx.served("b1", other)
    hits = idx.hits(later)
    assert hits == {"b0": len(first.digests), "b1": len(SYSTEM) // BLOCK_BYTES}
    idx.served("b1", later)
    assert idx.hits(later) == {"b0": len(first.digests), "b1": len(later.digests)}


def test_the_budget_evicts_least_recently_used_tails_first() -> None:
    idx = PrefixIndex(max_entries=16)
    keys = [key({"prompt": f"{i:04d}" * 1024}) for i in range(6)]  # 4 blocks each, no sharing
    for k in keys:
        idx.served("b0", k)
    assert len(idx) == 16 and idx.evicted == 8
    assert idx.hits(keys[0]) == {} and idx.hits(keys[1]) == {}
    assert idx.hits(keys[5]) == {"b0": 4}
    idx.served("b0", keys[2])  # used again: now the most recent
    idx.served("b0", keys[0])  # evicts keys[3]'s tail first, then more of it
    assert idx.hits(keys[2]) == {"b0": 4} and idx.hits(keys[0]) == {"b0": 4}
    assert idx.hits(keys[3]) == {}  # the oldest went entirely
    # a prefix's head outlives its tail: what is left of a partly evicted prompt is a prefix
    idx2 = PrefixIndex(max_entries=3)
    idx2.served("b0", keys[0])
    assert idx2.hits(keys[0]) == {"b0": 3}


def test_forget_drops_a_backend() -> None:
    idx = PrefixIndex()
    k = key(chat("q " * 500))
    idx.served("b0", k)
    idx.served("b1", k)
    idx.forget(["b0"])
    assert idx.hits(k) == {"b1": len(k.digests)}


# --- published digests ---------------------------------------------------------------------


@pytest.mark.parametrize("blocks, positions", [
    (0, []), (1, [0]), (2, [0, 1]), (3, [0, 1, 2]), (4, [0, 1, 3]), (16, [0, 1, 3, 7, 15]), (20, [0, 1, 3, 7, 15, 19]),
])
def test_published_positions_are_powers_of_two_and_the_last(blocks: int, positions: list[int]) -> None:
    assert published_positions(blocks) == positions


def test_a_peer_hit_is_the_last_published_position_found() -> None:
    k = key({"prompt": "x" * (20 * BLOCK_BYTES)}).digests
    assert peer_hit(k, frozenset({k[0], k[7]})) == 8
    assert peer_hit(k, frozenset()) == 0
    assert peer_hit(k, frozenset({k[19]})) == 20


class Clock:
    def __init__(self) -> None:
        self.s = 100.0

    def __call__(self) -> float:
        return self.s


def test_publication_on_change_at_most_every_few_seconds_and_within_the_cap() -> None:
    routing = PrefixRouting(PrefixSettings(), {})
    clock = Clock()
    pub = PrefixPublisher(routing, clock)
    assert pub.update() is None  # nothing served: nothing to publish
    routing.served(M, "b0", key(chat("q " * 500)))
    first = pub.update()
    assert first is not None and len(first.of(M)) == len(published_positions(len(key(chat("q " * 500)).digests)))
    routing.served(M, "b0", key(chat("r " * 500)))
    assert pub.update() is None  # changed, but too soon
    clock.s += PUBLISH_MIN_S
    second = pub.update()
    assert second is not None and set(first.of(M)) < set(second.of(M))
    clock.s += PUBLISH_MIN_S
    routing.served(M, "b0", key(chat("r " * 500)))  # the same again: nothing new
    assert pub.update() is None
    # many prompts on many models: each model within 64, all within the extension's cap
    for m in range(5):
        for i in range(40):
            routing.served(f"model-{m:02d}", "b0", key({"prompt": f"{m}-{i:03d}" * 2000}))
    clock.s += PUBLISH_MIN_S
    value = pub.update()
    assert value is not None and len(value.models) == 6
    assert all(len(p.digests) == per_model_limit(6) for p in value.models if p.model != M)
    ext = Extensions.of({PREFIXES: value})  # raises when over the cap
    assert ext.get(PREFIXES) == value


def test_long_model_names_publish_fewer_digests_within_the_cap() -> None:
    # Names up to 200 characters: 3 models of 150 took 4,114 bytes of a 4,096-byte cap once.
    routing = PrefixRouting(PrefixSettings(), {})
    clock = Clock()
    pub = PrefixPublisher(routing, clock)
    names = [f"{'n' * 146}{m:04d}" for m in range(3)]
    for name in names:
        for i in range(80):
            routing.served(name, "b0", key({"prompt": f"{name}-{i:03d}" * 600}))
    value = pub.update()
    assert value is not None and [p.model for p in value.models] == names
    assert 0 < len(value.of(names[0])) < per_model_limit(3)
    assert Extensions.of({PREFIXES: value}).get(PREFIXES) == value  # raises when over the cap


@pytest.mark.parametrize("models, limit", [(1, 64), (3, 64), (4, 50), (10, 17), (40, 1), (64, 0)])
def test_per_model_limit_fits_the_cap(models: int, limit: int) -> None:
    assert per_model_limit(models) == limit
    # the longest model names (64 characters): still within the extension's cap
    if limit:  # (no digest: the publisher leaves the models out)
        value = Prefixes(tuple(ModelPrefixes(f"{'m' * 60}{i:04d}", tuple(f"{j:016x}" for j in range(limit)))
                               for i in range(models)))
        Extensions.of({PREFIXES: value})


@pytest.mark.parametrize("raw", [
    {M: ["0123456789ABCDEF"]},  # upper case
    {M: ["0123456789abcde"]},  # 15 characters
    {M: ["0123456789abcdef"] * 65},  # over 64 a model
    {M: "0123456789abcdef"},  # not a list
    ["0123456789abcdef"],  # not per model
], ids=["upper", "short", "too-many", "not-a-list", "not-per-model"])
def test_a_malformed_digest_is_dropped_counted_and_the_peer_is_unknown(raw: Any) -> None:
    ext = decode_extensions({"prefixes": [1, raw]})
    assert ext.ignored == (("prefixes", "bad_value"),)  # Membership counts it: extensions_ignored
    assert ext.get(PREFIXES) is None
    snap = PeerSnapshot(node_id=NodeId("pppppppppppppppp"), name="p", liveness=Liveness.ALIVE,
                        state=PublishedState.SERVING, age_ms=10.0, order=(1, 1), models=(cap(),),
                        prefixes=ext.get(PREFIXES))
    assert snap.prefixes is None  # no digests: scored on load only


# --- scoring tables --------------------------------------------------------------------------


def cand(node: str, free: int, slots: int, blocks: int | None, *, local: bool = True, tps: float | None = 1000.0,
         rtt_ms: float | None = 1.0) -> Candidate:
    return Candidate(node, node if local else None, free, slots, 0.0 if local else rtt_ms, tps, blocks)


PROMPT = 16 * BLOCK_BYTES  # ~4,000 tokens


@pytest.mark.parametrize("cands, guard, want", [
    # a hit on an idle backend beats an idle miss
    ([cand("hit", 2, 2, 16), cand("miss", 2, 2, 0)], Guard(), "hit"),
    # a hit on a backend 2 busier than the least busy: still within the default guard
    ([cand("hit", 1, 3, 16), cand("miss", 3, 3, 0)], Guard(guard_slots=2), "hit"),
    # ... not within a guard of 1: the least-loaded rule decides (None)
    ([cand("hit", 1, 3, 16), cand("miss", 3, 3, 0)], Guard(guard_slots=1), None),
    # a full backend is never chosen, hit or not
    ([cand("hit", 0, 2, 16), cand("miss", 2, 2, 0)], Guard(), None),
    # the longer hit wins between two
    ([cand("short", 2, 2, 4), cand("long", 2, 2, 12)], Guard(), "long"),
    # a one-block hit below min_blocks counts as a miss everywhere
    ([cand("hit", 2, 2, 1), cand("miss", 2, 2, 0)], Guard(min_blocks=2), None),
    # unknown peer digests are not a hit: a miss everywhere else falls back
    ([cand("unknown", 2, 2, None, local=False), cand("miss", 2, 2, 0)], Guard(), None),
    # a hit elsewhere: the unknown peer is scored with no cached block and loses to the hit
    ([cand("unknown", 2, 2, None, local=False), cand("hit", 2, 2, 8)], Guard(), "hit"),
    # a hit on a peer beats a local miss when prefill costs more than the round trip
    ([cand("peer", 2, 2, 16, local=False, rtt_ms=2.0), cand("local", 2, 2, 0)], Guard(), "peer"),
    # speeds: a hit of 4 blocks on a GPU 10x slower loses to a miss on a fast one
    ([cand("slow-hit", 2, 2, 4, tps=100.0), cand("fast-miss", 2, 2, 0, tps=1000.0)], Guard(), "fast-miss"),
    # ... a hit of 15 blocks of 16 on it wins (1 block at 100 tok/s beats 16 at 1000)
    ([cand("slow-hit", 2, 2, 15, tps=100.0), cand("fast-miss", 2, 2, 0, tps=1000.0)], Guard(), "slow-hit"),
    # an unknown speed takes the median of the known ones
    ([cand("hit", 2, 2, 8, tps=None), cand("miss", 2, 2, 0, tps=500.0)], Guard(), "hit"),
], ids=["hit-beats-miss", "hit-within-guard", "hit-over-guard", "full-never", "longer-hit", "below-min-blocks",
        "unknown-is-not-a-hit", "unknown-loses-to-hit", "peer-hit-beats-local-miss", "slow-short-hit-loses",
        "slow-long-hit-wins", "unknown-speed-median"])
def test_scoring_table(cands: list[Candidate], guard: Guard, want: str | None) -> None:
    got = choose(cands, PROMPT, 1.0, guard)
    assert (None if got is None else got.candidate.node) == want


def test_busier_hit_pays_its_wait() -> None:
    # both hit the same blocks: the one with fewer busy slots is predicted faster
    got = choose([cand("busy", 1, 3, 8), cand("idle", 3, 3, 8)], PROMPT, 2.0, Guard())
    assert got is not None and got.candidate.node == "idle"


# --- the router's prefix rule ----------------------------------------------------------------

SELF = NodeId("selfselfselfself")


def cap(slots: int = 2, busy: int = 0) -> ModelCapacity:
    return ModelCapacity(name=M, engine="llamacpp", kind="chat", slots=slots, busy=busy, waiting=None,
                         ctx_per_slot=4096, healthy=1, total=1)


def peer(name: str, digests: tuple[str, ...] | None, busy: int = 0, prefill_tps: int | None = None) -> PeerSnapshot:
    prefixes = None if digests is None else Prefixes((ModelPrefixes(M, digests),))
    speeds = None if prefill_tps is None else Speeds((ModelSpeed(M, prefill_tps, 10),))
    return PeerSnapshot(node_id=NodeId((name * 16)[:16]), name=name, liveness=Liveness.ALIVE,
                        state=PublishedState.SERVING, age_ms=10.0, order=(1, 1), models=(cap(busy=busy),),
                        rtt_ms=1.0, prefixes=prefixes, speeds=speeds)


def here(*frees: int, slots: int = 2) -> dict[str, LocalModel]:
    backends = tuple(LocalBackend(f"{M}-{i}", f, slots, 1000.0) for i, f in enumerate(frees))
    return {M: LocalModel(name=M, kind="chat", backends=backends, slots=slots * len(frees), can_serve=True)}


def router() -> Router:
    return Router(SELF, "self", stale_after_ms=3000, reservations=Reservations(lambda: 0.0), rng=random.Random(1))


BODY = chat("a question " * 400)
KEY = key(BODY)


def query(local_hits: dict[str, int] | None = None) -> PrefixQuery:
    return PrefixQuery(KEY.digests, KEY.prompt_bytes, local_hits or {}, 1.0, Guard())


def published(k: PrefixKey) -> tuple[str, ...]:
    hexes = k.digests
    return tuple(hexes[i] for i in published_positions(len(hexes)))


def test_a_peer_holding_the_prefix_takes_it_over_a_free_local_backend() -> None:
    d = router().route(M, here(2), [peer("b", published(KEY)), peer("c", ())], prefix=query())
    assert isinstance(d, RunOnPeer) and d.name == "b"
    assert d.route == f"prefix-hit blocks={len(KEY.digests)}"


def test_without_a_query_or_a_hit_the_least_loaded_rule_decides() -> None:
    peers = [peer("b", ()), peer("c", None)]
    assert router().route(M, here(2), peers) == RunLocal(f"{M}-0")
    d = router().route(M, here(2), peers, prefix=query())
    assert d == RunLocal(f"{M}-0") and d.route == "least-loaded"


def test_the_local_backend_holding_the_prefix_is_chosen_among_local_ones() -> None:
    d = router().route(M, here(2, 2), [], prefix=query({f"{M}-1": len(KEY.digests)}))
    assert d == RunLocal(f"{M}-1") and d.route.startswith("prefix-hit")
    standalone, guarded = local_by_prefix(here(2, 2)[M], query({f"{M}-1": 3}))
    assert standalone == RunLocal(f"{M}-1") and standalone.route == "prefix-hit blocks=3" and guarded == 0


def test_a_hit_on_a_busy_peer_moves_to_the_least_busy() -> None:
    busy = peer("b", published(KEY), busy=1)  # 1 of 2 busy; local: 4 free of 4
    d = router().route(M, here(4, slots=4), [busy], prefix=query())
    assert isinstance(d, RunOnPeer)  # within the guard (2)
    guarded = PrefixQuery(KEY.digests, KEY.prompt_bytes, {}, 1.0, Guard(guard_slots=0))
    d = router().route(M, here(4, slots=4), [busy], prefix=guarded)
    # the declined hit is in the route: "a miss everywhere" would read the same otherwise
    assert d == RunLocal(f"{M}-0") and d.route == f"least-loaded guarded={peer_hit(KEY.digests, frozenset(published(KEY)))}"


def test_affinity_and_pinning_keep_their_meaning() -> None:
    peers = [peer("b", published(KEY))]
    pinned = router().route(M, here(2), peers, host="self", prefix=query())
    assert pinned == RunLocal(f"{M}-0") and pinned.route == "pinned"
    # a session key whose rendezvous ranking puts this node first stays here despite the peer's hit
    key_here = next(k for k in (f"s{i}" for i in range(100))
                    if router().route(M, here(2), [peer("b", ())], affinity=k) == RunLocal(f"{M}-0"))
    d = router().route(M, here(2), peers, affinity=key_here, prefix=query())
    assert d == RunLocal(f"{M}-0") and d.route == "affinity"


def test_a_slower_peer_with_a_short_hit_loses_to_a_fast_local_miss() -> None:
    short = tuple(KEY.digests[:1])  # one block of 4
    d = router().route(M, here(2), [peer("b", short, prefill_tps=50)], prefix=query())
    assert d == RunLocal(f"{M}-0") and d.route == "predicted-ttft"


# --- the route header ------------------------------------------------------------------------


def test_route_header_hops_and_what_a_peer_may_send() -> None:
    own = route_entry("b", "prefix-hit blocks=4")
    assert route_from_origin(None, own) == "b:prefix-hit blocks=4"
    assert route_from_origin("a:prefix-hit blocks=4", own) == "a:prefix-hit blocks=4, b:prefix-hit blocks=4"
    assert route_from_origin("a:x\x7f", own) == own  # not printable: dropped
    assert route_from_origin("a" * MAX_ROUTE_CHARS, own) == own  # too long: dropped


def test_routed_counts_rules_and_hit_blocks() -> None:
    routing = PrefixRouting(PrefixSettings(), {})
    routing.routed(M, "prefix-hit blocks=4")
    routing.routed(M, "prefix-hit blocks=2")
    routing.routed(M, "least-loaded")
    assert routing.routes[(M, "prefix-hit")] == 2 and routing.hit_blocks[M] == 6
    families = {f.name: f for f in routing.metric_families()}
    assert {s.value for s in families["viiwork_prefix_hit_tokens"].samples if s.name.endswith("_total")} == {6 * 256}


def test_prefix_routing_off_gives_no_key() -> None:
    assert PrefixRouting(PrefixSettings(enabled=False), {}).key(BODY, M, "") is None
    assert PrefixRouting(PrefixSettings(), {}).key(BODY, M, "") == KEY


def test_a_forwarded_request_takes_the_holding_backend_only_within_the_guard() -> None:
    routing = PrefixRouting(PrefixSettings(), {})
    k = key(chat("system prompt " * 300))
    routing.served(M, "b0", k)
    blocks = len(k.digests)
    assert routing.local_hit(M, k, [("b0", 2), ("b1", 0)]) == ("b0", blocks)  # 2 busier: within the guard
    assert routing.local_hit(M, k, [("b0", 3), ("b1", 0)]) is None  # 3 busier: the least-loaded rule decides
    assert routing.local_hit(M, k, [("b1", 0)]) is None  # the holder has no free slot
    assert routing.local_hit(M, k, []) is None


def test_a_huge_prompt_is_hashed_only_in_its_leading_blocks_and_cannot_wipe_the_index() -> None:
    index = PrefixIndex()
    small = key(chat("system prompt " * 300))
    index.served("b0", small)
    huge = key({"prompt": "x" * (17 << 20)})  # 17 MiB, within api.max_body_bytes
    assert len(huge.digests) == MAX_BLOCKS and huge.prompt_bytes >= 17 << 20
    index.served("b1", huge)
    assert index.hits(small) == {"b0": len(small.digests)}  # still remembered


def test_a_declined_hit_is_counted_apart_from_a_miss() -> None:
    routing = PrefixRouting(PrefixSettings(), {})
    routing.routed(M, "least-loaded guarded=3")
    routing.routed(M, "least-loaded")
    routing.routed(M, "prefix-hit blocks=4")
    families = {f.name: f for f in routing.metric_families()}
    assert [s.value for s in families["viiwork_prefix_guard_declines"].samples if s.name.endswith("_total")] == [1]
    assert routing.routes[(M, "least-loaded")] == 2 and routing.hit_blocks[M] == 4
