"""Router unit tables (issue 5): local first, most free peer, freshness, reservations,
affinity, host selection, exclusion, the mesh-wide models list."""

from __future__ import annotations

import datetime as dt
import random
from collections import Counter

import pytest

from viiwork.agent.config.schema import ModelConfig
from viiwork.agent.serving.router import (
    LocalBackend,
    LocalModel,
    PeerSnapshot,
    Queue,
    Refuse,
    Reservations,
    Router,
    RunLocal,
    RunOnPeer,
    mesh_models,
)
from viiwork.agent.supervision.backends import Backend, BackendId, BackendState, ModelRuntime
from viiwork.engines.registry import get_engine
from viiwork.mesh.identity import NodeId
from viiwork.mesh.membership import Liveness, PeerView
from viiwork.mesh.summary import ModelCapacity, PublishedState

SELF = NodeId("selfselfselfself")
M = "qwen"


class Clock:
    def __init__(self) -> None:
        self.ms = 1000.0

    def __call__(self) -> float:
        return self.ms


def nid(name: str) -> NodeId:
    return NodeId((name * 16)[:16])


def cap(model: str = M, slots: int = 4, busy: int = 0, total: int = 1, ctx: int = 4096, kind: str = "chat",
        healthy: int | None = None) -> ModelCapacity:
    return ModelCapacity(name=model, engine="llamacpp", kind=kind, slots=slots, busy=busy, waiting=None,
                         ctx_per_slot=ctx, healthy=total if healthy is None else healthy, total=total)


def peer(name: str, *models: ModelCapacity, liveness: Liveness = Liveness.ALIVE, age_ms: float = 50.0,
         seq: int = 1, rtt_ms: float | None = 1.0, state: PublishedState = PublishedState.SERVING,
         node_id: NodeId | None = None) -> PeerSnapshot:
    return PeerSnapshot(node_id=node_id or nid(name), name=name, liveness=liveness, state=state, age_ms=age_ms,
                        order=(1, seq), models=models or (cap(),), rtt_ms=rtt_ms)


def local(*frees: int, model: str = M, can_serve: bool = True, ctx: int = 4096, slots: int | None = None,
          kind: str = "chat") -> dict[str, LocalModel]:
    backends = tuple(LocalBackend(f"{model}-{i}", f) for i, f in enumerate(frees))
    return {model: LocalModel(name=model, kind=kind, backends=backends,
                              slots=len(frees) * 4 if slots is None else slots, can_serve=can_serve,
                              ctx_per_slot=ctx, engine="llamacpp")}


def router(seed: int = 1, stale_after_ms: float = 3000, probe: bool = True) -> Router:
    return Router(SELF, "self", stale_after_ms=stale_after_ms, reservations=Reservations(Clock()),
                  rng=random.Random(seed), probe=probe)


# --- local first, then the most free peer -------------------------------------------------


def test_local_backend_with_a_free_slot_comes_first_even_when_peers_have_more():
    r = router()
    d = r.route(M, local(0, 1, 0), [peer("a", cap(busy=0)), peer("b", cap(busy=0))])
    assert d == RunLocal(f"{M}-1")


def test_local_picks_the_backend_with_most_free_slots():
    assert router().route(M, local(1, 3, 2), []) == RunLocal(f"{M}-1")


@pytest.mark.parametrize("busy, expected", [
    pytest.param((3, 1, 3), "b", id="one-clear-winner"),
    pytest.param((4, 4, 0), "c", id="others-full"),
    pytest.param((2, 4, 0), "c", id="four-free-beats-two-and-none"),
])
def test_local_full_goes_to_the_peer_with_most_free_slots(busy, expected):
    peers = [peer(n, cap(busy=b)) for n, b in zip("abc", busy, strict=True)]
    for seed in range(20):
        d = router(seed).route(M, local(0), peers)
        assert isinstance(d, RunOnPeer) and d.name == expected


def test_model_not_served_here_goes_to_a_peer():
    d = router().route(M, local(2, model="other"), [peer("a", cap(busy=1))])
    assert isinstance(d, RunOnPeer) and d.name == "a" and d.free == 3


def test_near_equal_peers_are_chosen_at_random_so_origins_do_not_herd():
    peers = [peer(n, cap(busy=1)) for n in "abcd"]
    picks = Counter(router(seed).route(M, local(0), peers).name for seed in range(400))
    assert set(picks) == set("abcd")
    assert min(picks.values()) > 60  # roughly 100 each


def test_among_equally_free_peers_a_much_lower_rtt_wins():
    peers = [peer("near", rtt_ms=0.8), peer("far", rtt_ms=40.0)]
    picks = {router(seed).route(M, local(0), peers).name for seed in range(50)}
    assert picks == {"near"}


def test_unmeasured_rtt_is_neither_preferred_nor_excluded():
    peers = [peer("near", rtt_ms=0.8), peer("new", rtt_ms=None)]
    picks = {router(seed).route(M, local(0), peers).name for seed in range(100)}
    assert picks == {"near", "new"}


# --- freshness ----------------------------------------------------------------------------


@pytest.mark.parametrize("bad, queued", [
    pytest.param(dict(age_ms=3000.0), True, id="stale-summary"),
    pytest.param(dict(age_ms=60_000.0), True, id="very-stale-summary"),
    pytest.param(dict(liveness=Liveness.SUSPECT), True, id="suspect"),
    pytest.param(dict(liveness=Liveness.DEAD), False, id="dead"),
    pytest.param(dict(liveness=Liveness.LEFT), False, id="left"),
    pytest.param(dict(state=PublishedState.DRAINING), False, id="draining"),
    pytest.param(dict(state=PublishedState.LEAVING), False, id="leaving"),
    pytest.param(dict(state=PublishedState.RESTARTING), True, id="restarting"),
    pytest.param(dict(state=PublishedState.RESTARTING, liveness=Liveness.SUSPECT), True, id="restarting-silent"),
    pytest.param(dict(liveness=Liveness.CONFLICT), False, id="identity-conflict"),
])
def test_stale_suspect_dead_left_and_draining_peers_are_not_routed_to(bad, queued):
    good = peer("good", cap(busy=3))
    other = peer("other", cap(busy=0), **bad)
    for seed in range(10):
        d = router(seed).route(M, local(0, can_serve=False), [other, good])
        assert isinstance(d, RunOnPeer) and d.name == "good"
    # Alone, a peer that may come back (stale, suspect) queues the request; a gone one is 503.
    d = router().route(M, {}, [other])
    if queued:
        assert isinstance(d, Queue)
    else:
        assert isinstance(d, Refuse) and d.status == 503 and d.retry_after_s
        assert "other" in d.message


def test_stale_after_ms_is_the_freshness_bound():
    p = peer("a", age_ms=999.0)
    assert isinstance(router(stale_after_ms=1000).route(M, {}, [p]), RunOnPeer)
    assert isinstance(router(stale_after_ms=999).route(M, {}, [p]), Queue)


# --- reservations -------------------------------------------------------------------------


def test_reservations_spread_a_burst_of_20_over_4_peers_with_5_free_each():
    r = router()
    peers = [peer(n, cap(slots=8, busy=3)) for n in "abcd"]
    where = Counter()
    for _ in range(20):
        d = r.route(M, local(0), peers)
        assert isinstance(d, RunOnPeer)
        r.reservations.reserve(d.node_id, M)
        where[d.name] += 1
    assert where == {"a": 5, "b": 5, "c": 5, "d": 5}
    assert isinstance(r.route(M, local(0), peers), Queue)


def test_without_reservations_the_same_burst_overcommits_peers():
    # The counterfactual that the reservations prevent: every request sees 5 free everywhere.
    r = router()
    peers = [peer(n, cap(slots=8, busy=3)) for n in "abcd"]
    where = Counter(r.route(M, local(0), peers).name for _ in range(20))
    assert max(where.values()) > 5


def test_a_newer_summary_clears_reservations_and_the_peer_figures_count_again():
    r = router()
    p1 = peer("a", cap(busy=2), seq=1)
    for _ in range(2):
        r.reservations.reserve(r.route(M, {}, [p1]).node_id, M)
    assert isinstance(r.route(M, {}, [p1]), Queue)  # 4 - 2 busy - 2 reserved
    p2 = peer("a", cap(busy=3), seq=2)  # the peer now counts one of ours; the other ended
    d = r.route(M, {}, [p2])
    assert isinstance(d, RunOnPeer) and d.free == 1


def test_release_in_the_same_summary_gives_the_slot_back():
    r = router()
    p = peer("a", cap(busy=3))
    token = r.reservations.reserve(nid("a"), M)
    assert isinstance(r.route(M, {}, [p]), Queue)
    r.reservations.release(token)
    assert r.route(M, {}, [p]) == RunOnPeer(nid("a"), "a", 1)


def test_a_request_counted_busy_by_the_summary_that_ends_frees_a_slot_until_the_next_summary():
    r = router()
    r.route(M, {}, [peer("a", cap(busy=0), seq=1)])
    token = r.reservations.reserve(nid("a"), M)
    full = peer("a", cap(busy=4), seq=2)  # includes our request
    assert isinstance(r.route(M, {}, [full]), Queue)
    r.reservations.release(token)  # it ended: that slot is free now
    assert r.route(M, {}, [full]) == RunOnPeer(nid("a"), "a", 1)
    assert isinstance(r.route(M, {}, [peer("a", cap(busy=4), seq=3)]), Queue)


def test_a_refusing_peer_counts_as_full_until_its_next_summary():
    r = router()
    peers = [peer("a", cap(busy=0)), peer("b", cap(busy=3))]
    r.reservations.mark_full(nid("a"), M)
    for _ in range(5):
        assert r.route(M, {}, peers).name == "b"
    peers[0] = peer("a", cap(busy=0), seq=2)
    assert r.route(M, {}, peers).name == "a"


def test_reservations_are_per_model():
    r = router()
    p = peer("a", cap(M, busy=3), cap("other", busy=3))
    r.reservations.reserve(nid("a"), M)
    assert isinstance(r.route(M, {}, [p]), Queue)
    assert isinstance(r.route("other", {}, [p]), RunOnPeer)


def test_a_reservation_never_released_expires():
    clock = Clock()
    res = Reservations(clock, max_age_ms=10_000)
    r = Router(SELF, "self", stale_after_ms=3000, reservations=res, rng=random.Random(1))
    p = peer("a", cap(busy=3))
    res.reserve(nid("a"), M)
    assert isinstance(r.route(M, {}, [p]), Queue)
    clock.ms += 10_001
    assert isinstance(r.route(M, {}, [p]), RunOnPeer)


# --- exclusion (retry before the first byte) ----------------------------------------------


def test_excluded_peers_are_skipped_and_all_excluded_queues():
    peers = [peer("a", cap(busy=0)), peer("b", cap(busy=3))]
    r = router()
    assert r.route(M, local(0), peers, exclude={nid("a")}).name == "b"
    assert isinstance(r.route(M, local(0), peers, exclude={nid("a"), nid("b")}), Queue)


def test_exclusion_does_not_apply_to_local_backends():
    assert router().route(M, local(1), [peer("a")], exclude={SELF, nid("a")}) == RunLocal(f"{M}-0")


# --- queue or refuse ----------------------------------------------------------------------


def test_unknown_model_is_404_listing_the_models_of_the_mesh():
    d = router().route("nope", local(1), [peer("a", cap("emb", kind="embedding"))])
    assert isinstance(d, Refuse) and d.status == 404 and d.code == "model_not_found" and d.param == "model"
    assert "'nope'" in d.message and f"emb, {M}" in d.message


def test_local_backends_still_starting_queue_the_request():
    d = router().route(M, local(0, can_serve=True), [])
    assert isinstance(d, Queue)


def test_nothing_can_ever_serve_is_503():
    d = router().route(M, local(0, can_serve=False), [peer("a", liveness=Liveness.DEAD)])
    assert isinstance(d, Refuse) and d.status == 503 and d.retry_after_s == 5
    assert "no healthy or starting backend" in d.message and "a (dead" in d.message


def test_a_peer_listing_the_model_without_backends_cannot_serve_it():
    d = router().route(M, {}, [peer("a", cap(slots=0, total=0))])
    assert isinstance(d, Refuse) and d.status == 503


def test_a_peer_whose_backends_are_down_but_present_may_serve_later():
    d = router().route(M, {}, [peer("a", cap(slots=0, total=2, healthy=0))])
    assert isinstance(d, Queue)


# --- affinity -----------------------------------------------------------------------------


def _home(r: Router, key: str, locals_: dict, peers: list[PeerSnapshot]) -> str:
    d = r.route(M, locals_, peers, affinity=key)
    return "self" if isinstance(d, RunLocal) else d.name


def test_affinity_keeps_a_session_on_one_node_while_it_has_room():
    peers = [peer(n, cap(busy=1)) for n in "abcd"]
    homes = {}
    for key in (f"session-{i}" for i in range(40)):
        seen = {_home(router(seed), key, local(2), peers) for seed in range(8)}
        assert len(seen) == 1, key  # every request of the session, whatever the randomness
        homes[key] = seen.pop()
    # Sessions are spread over the nodes (this node included), not all on the local one.
    assert len(set(homes.values())) == 5


def test_affinity_moves_a_session_only_when_its_node_is_full_or_gone():
    peers = [peer(n, cap(busy=0)) for n in "abcdef"]
    keys = [f"conversation-{i}" for i in range(200)]
    before = {k: _home(router(), k, {}, peers) for k in keys}
    # Node c is full: only its sessions move, each to one next node (the same every time).
    full = [p if p.name != "c" else peer("c", cap(busy=4)) for p in peers]
    after_full = {k: _home(router(), k, {}, full) for k in keys}
    moved = {k for k in keys if after_full[k] != before[k]}
    assert moved == {k for k in keys if before[k] == "c"} and moved
    assert all(after_full[k] == _home(router(7), k, {}, full) for k in moved)
    # c has room again: its sessions come back.
    assert {k: _home(router(), k, {}, peers) for k in keys} == before
    # Node c is gone (dead): the same sessions move, and no other.
    gone = [p if p.name != "c" else peer("c", liveness=Liveness.DEAD) for p in peers]
    after_gone = {k: _home(router(), k, {}, gone) for k in keys}
    assert {k for k in keys if after_gone[k] != before[k]} == moved


def test_affinity_share_follows_slots():
    peers = [peer("big", cap(slots=12, busy=0)), peer("small", cap(slots=4, busy=0))]
    homes = Counter(_home(router(), f"k{i}", {}, peers) for i in range(2000))
    assert 0.68 < homes["big"] / 2000 < 0.82  # 12 / 16 = 0.75


def test_affinity_with_every_node_full_queues():
    peers = [peer(n, cap(busy=4)) for n in "ab"]
    assert isinstance(router().route(M, local(0), peers, affinity="s"), Queue)


# --- host selection -----------------------------------------------------------------------


def test_host_by_node_id_or_unique_name_runs_there():
    peers = [peer("a", cap(busy=3)), peer("b", cap(busy=0))]
    for host in (nid("a"), "a"):
        d = router().route(M, local(2), peers, host=host)
        assert d == RunOnPeer(nid("a"), "a", 1)


def test_host_naming_this_node_runs_locally():
    for host in (SELF, "self"):
        assert router().route(M, local(0, 1), [peer("a")], host=host) == RunLocal(f"{M}-1")


def test_host_unknown_is_404_naming_the_known_nodes():
    d = router().route(M, local(1), [peer("a"), peer("b")], host="zeta")
    assert isinstance(d, Refuse) and d.status == 404 and d.param == "host" and d.code == "host_not_found"
    assert "'zeta'" in d.message and "a, b, self" in d.message


def test_host_in_identity_conflict_is_503_naming_the_copied_state_dir():
    d = router().route(M, local(0), [peer("a", cap(), liveness=Liveness.CONFLICT)], host="a")
    assert isinstance(d, Refuse) and d.status == 503 and "two agents" in d.message and d.retry_after_s


def test_host_ambiguous_name_is_404_listing_the_ids():
    peers = [peer("gpu", node_id=nid("x")), peer("gpu", node_id=nid("y"))]
    d = router().route(M, {}, peers, host="gpu")
    assert isinstance(d, Refuse) and d.status == 404 and d.code == "host_ambiguous"
    assert nid("x") in d.message and nid("y") in d.message
    assert router().route(M, {}, peers, host=nid("y")) == RunOnPeer(nid("y"), "gpu", 4)


def test_host_name_shared_with_this_node_is_ambiguous():
    d = router().route(M, local(1), [peer("self")], host="self")
    assert isinstance(d, Refuse) and d.status == 404 and d.code == "host_ambiguous"


def test_host_that_does_not_serve_the_model_is_400_naming_what_it_serves():
    d = router().route(M, local(1), [peer("a", cap("emb"))], host="a")
    assert isinstance(d, Refuse) and d.status == 400 and d.code == "model_not_on_host"
    assert "'a'" in d.message and f"'{M}'" in d.message and "emb" in d.message
    d = router().route(M, local(1, model="emb"), [peer("a")], host="self")
    assert isinstance(d, Refuse) and d.status == 400


def test_host_full_or_stale_queues_and_never_falls_back_to_another_node():
    peers = [peer("a", cap(busy=4)), peer("b", cap(busy=0))]
    assert isinstance(router().route(M, local(3), peers, host="a"), Queue)
    peers = [peer("a", age_ms=5000.0), peer("b")]
    assert isinstance(router().route(M, local(3), peers, host="a"), Queue)
    assert isinstance(router().route(M, local(0), peers, host="self"), Queue)


def test_host_dead_or_left_is_503():
    for liveness in (Liveness.DEAD, Liveness.LEFT):
        d = router().route(M, local(3), [peer("a", liveness=liveness)], host="a")
        assert isinstance(d, Refuse) and d.status == 503 and liveness.value in d.message


def test_host_wins_over_affinity():
    peers = [peer(n) for n in "abcdef"]
    for i in range(30):
        assert router().route(M, {}, peers, affinity=f"s{i}", host="e").name == "e"


# --- probing (off by default) -------------------------------------------------------------


def test_probe_asks_the_peer_known_full_longest_ago_and_not_one_just_refused():
    clock = Clock()
    r = Router(SELF, "self", stale_after_ms=3000, reservations=Reservations(clock), rng=random.Random(1),
               probe=True)
    peers = [peer("young", cap(busy=4), age_ms=150.0), peer("old", cap(busy=4), age_ms=900.0),
             peer("fresh", cap(busy=4), age_ms=20.0)]
    d = r.route(M, local(0), peers)
    assert isinstance(d, RunOnPeer) and d.name == "old"
    r.reservations.mark_full(nid("old"), M)  # a refusal is news: "old" is known full now
    assert r.route(M, local(0), peers).name == "young"
    r.reservations.mark_full(nid("young"), M)
    # Everything is known full within the last PROBE_MIN_MS: wait in the queue.
    assert isinstance(r.route(M, local(0), peers), Queue)
    clock.ms += 300  # the refusals are old news again (the summaries are as old as they were)
    assert r.route(M, local(0), peers).name in {"old", "young"}
    assert r.route(M, local(0), peers, exclude={nid("old"), nid("young")}) == Queue(
        f"no free slot for {M!r} on this node or a fresh peer")


def test_without_probe_a_peer_that_appears_full_is_never_asked():
    peers = [peer("a", cap(busy=4), age_ms=900.0)]
    assert isinstance(router(probe=False).route(M, local(0), peers), Queue)
    assert isinstance(router().route(M, local(0), peers), RunOnPeer)
    # Off by default (slot offers bring freed slots to waiters instead).
    default = Router(SELF, "self", stale_after_ms=3000, reservations=Reservations(Clock()), rng=random.Random(1))
    assert isinstance(default.route(M, local(0), peers), Queue)


def test_probe_never_asks_a_stale_suspect_or_excluded_peer():
    peers = [peer("stale", cap(busy=4), age_ms=5000.0), peer("suspect", cap(busy=4), age_ms=900.0,
             liveness=Liveness.SUSPECT), peer("tried", cap(busy=4), age_ms=900.0)]
    assert isinstance(router().route(M, local(0), peers, exclude={nid("tried")}), Queue)


# --- mesh-wide models -----------------------------------------------------------------------


def test_mesh_models_lists_every_model_once_with_the_smallest_ctx_per_slot():
    peers = [
        peer("a", cap(M, ctx=8192), cap("emb", kind="embedding", ctx=512)),
        peer("b", cap(M, ctx=2048), cap("only-on-b", ctx=1024)),
        peer("c", cap("ghost", ctx=100), liveness=Liveness.DEAD),
        peer("d", cap("going", ctx=100), state=PublishedState.LEAVING),
        peer("e", cap("suspected", ctx=300), liveness=Liveness.SUSPECT),
    ]
    models = mesh_models(local(1, ctx=4096), peers)
    assert [m["id"] for m in models] == ["emb", "only-on-b", M, "suspected"]
    by = {m["id"]: m for m in models}
    assert by[M]["max_model_len"] == by[M]["context_length"] == 2048 and by[M]["nodes"] == 3
    assert by["emb"]["kind"] == "embedding" and by["emb"]["object"] == "model"
    assert router().models(local(1), []) == mesh_models(local(1), [])


def test_mesh_models_ignores_unknown_context_zero():
    models = mesh_models(local(1, ctx=0), [peer("a", cap(ctx=2048))])
    assert models[0]["max_model_len"] == 2048


def test_peer_snapshot_from_the_mesh_view():
    view = PeerView(node_id=nid("a"), name="a", api="10.0.0.1:8086", mesh="10.0.0.1:8087",
                    liveness=Liveness.ALIVE, state=PublishedState.SERVING, age_ms=420, protocol=2, version="0.1",
                    generation=3, boot="b", seq=17, models=(cap(busy=1),), rtt_ms=0.7,
                    certificate_not_after=dt.datetime(2030, 1, 1, tzinfo=dt.UTC))
    snap = PeerSnapshot.from_view(view)
    assert snap.order == (3, 17) and snap.age_ms == 420.0 and snap.rtt_ms == 0.7
    assert router().route(M, {}, [snap]) == RunOnPeer(nid("a"), "a", 3)


def test_local_model_from_the_supervisor_runtime():
    cfg = ModelConfig.model_validate({"name": M, "engine": "llamacpp", "path": "/m.gguf", "ctx_per_slot": 2048})
    rt = ModelRuntime(config=cfg, engine=get_engine("llamacpp"))
    rt.backends += [
        Backend(id=BackendId(f"{M}#0"), model=M, index=0, state=BackendState.HEALTHY, port=40000, parallel=2,
                in_flight=2),
        Backend(id=BackendId(f"{M}#1"), model=M, index=1, state=BackendState.HEALTHY, port=40001, parallel=4,
                in_flight=1),
        Backend(id=BackendId(f"{M}#2"), model=M, index=2, state=BackendState.STARTING, parallel=4),
    ]
    snap = LocalModel.from_runtime(rt)
    assert snap.slots == 6 and snap.can_serve and snap.ctx_per_slot == 2048 and snap.kind == "chat"
    assert [b.free for b in snap.backends] == [0, 3, 0]
    assert router().route(M, {M: snap}, []) == RunLocal(f"{M}#1")
    for b in rt.backends:
        b.state = BackendState.DEAD
    assert isinstance(router().route(M, {M: LocalModel.from_runtime(rt)}, []), Refuse)
