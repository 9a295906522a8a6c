"""``restarting`` (protocol 3): a node whose agent comes back soon is kept, not tombstoned, for
the restart grace; a peer of protocol 2 reads it as ``leaving``. The protocol core with real
keys and an injected clock (docs/mesh.md, "Failure detection and timings", "Versions")."""

from __future__ import annotations

import json

import pytest

from support.mesh_crypto import ManualClock, TestCA, chat_model, core, exchange
from viiwork.mesh.boot import Boot
from viiwork.mesh.membership import GossipSettings, Liveness
from viiwork.mesh.publisher import LocalPublisher
from viiwork.mesh.summary import (
    PROTOCOL_VERSION,
    MalformedSummary,
    PublishedState,
    decode_payload,
    encode_payload,
)

SETTINGS = GossipSettings(scale_with_size=False)  # suspect 2 s, dead 10 s, restart grace 30 s


@pytest.fixture
def ca() -> TestCA:
    return TestCA()


@pytest.fixture
def clock() -> ManualClock:
    return ManualClock()


def test_a_restarting_peer_stays_suspect_for_the_grace_then_dies_and_a_new_run_is_alive(ca, clock):
    r, viewer = ca.node("r"), ca.node("v")
    mr, pr = core(r, ca, clock, settings=SETTINGS, protocol=PROTOCOL_VERSION)
    mv, _ = core(viewer, ca, clock, settings=SETTINGS, protocol=PROTOCOL_VERSION, seed=1)
    pr.set_local([chat_model()], PublishedState.RESTARTING)
    pr.maybe_publish()
    exchange(mr, mv, "v:8087")
    assert mv.records[r.node_id].summary.payload.state is PublishedState.RESTARTING
    seen = []
    mv.on_liveness.append(lambda nid, old, new: seen.append(new))
    for _ in range(29):  # silent for 29 s: past dead_after (10 s), within the grace (30 s)
        clock.advance(1000)
        mv.tick()
    assert mv.liveness(r.node_id) is Liveness.SUSPECT and seen == [Liveness.SUSPECT]
    assert r.node_id in mv.records and mv._evict_tombstone() is False  # not a tombstone
    clock.advance(1001)
    mv.tick()
    assert mv.liveness(r.node_id) is Liveness.DEAD and seen == [Liveness.SUSPECT, Liveness.DEAD]
    # The agent is back (next generation): alive at once.
    back = LocalPublisher(mr, r.signer, "r", api="r:8086", mesh="r:8087", version="test",
                          boot=Boot(2, "0000000000000002"), heartbeat_ms=500)
    back.set_local([chat_model()])
    back.maybe_publish()
    exchange(mr, mv, "v:8087")
    assert mv.liveness(r.node_id) is Liveness.ALIVE
    assert mv.records[r.node_id].summary.payload.state is PublishedState.SERVING


def test_a_leaving_peer_is_left_at_once_and_a_silent_serving_one_dead_after_dead_after(ca, clock):
    gone, quiet, viewer = ca.node("gone"), ca.node("quiet"), ca.node("v")
    mg, pg = core(gone, ca, clock, settings=SETTINGS, protocol=PROTOCOL_VERSION)
    mq, _ = core(quiet, ca, clock, settings=SETTINGS, protocol=PROTOCOL_VERSION, seed=2)
    mv, _ = core(viewer, ca, clock, settings=SETTINGS, protocol=PROTOCOL_VERSION, seed=1)
    pg.set_local([chat_model()], PublishedState.LEAVING)
    pg.maybe_publish()
    exchange(mg, mv, "v:8087")
    exchange(mq, mv, "v:8087")
    assert mv.liveness(gone.node_id) is Liveness.LEFT
    clock.advance(10_001)
    mv.tick()
    assert mv.liveness(quiet.node_id) is Liveness.DEAD


@pytest.mark.parametrize("state", [PublishedState.LEAVING, PublishedState.RESTARTING,
                                   PublishedState.DRAINING, PublishedState.SERVING])
def test_a_peer_heard_from_is_not_silent_and_one_quiet_for_suspect_after_is_whatever_it_publishes(
        ca, clock, state):
    """Silence (what ends forwards in flight, docs/routing.md) is apart from liveness: while
    the peer keeps heartbeating it is not silent, even ``left``; once nothing newer came for
    ``suspect_after_ms`` it is silent, ``on_silent`` fires once, and a newer summary ends the
    silence. For ``leaving`` the liveness stays ``left``, for ``restarting`` the grace keeps it
    ``suspect`` (not dead): neither hides the silence."""
    peer, viewer = ca.node("p"), ca.node("v")
    mp, pp = core(peer, ca, clock, settings=SETTINGS, protocol=PROTOCOL_VERSION)
    mv, _ = core(viewer, ca, clock, settings=SETTINGS, protocol=PROTOCOL_VERSION, seed=1)
    pp.set_local([chat_model()], state)
    silent: list = []
    mv.on_silent.append(silent.append)
    for _ in range(10):  # heartbeats every 500 ms for 5 s: never silent
        pp.maybe_publish()
        exchange(mp, mv, "v:8087")
        clock.advance(500)
        mv.tick()
        assert not mv.silent(peer.node_id)
    assert silent == [] and mv.liveness(peer.node_id) is (Liveness.LEFT if state is PublishedState.LEAVING
                                                          else Liveness.ALIVE)
    clock.advance(SETTINGS.suspect_after_ms - 500 - 1)  # 1 ms short of suspect_after since the last summary
    mv.tick()
    assert not mv.silent(peer.node_id) and silent == []
    clock.advance(1)
    assert mv.silent(peer.node_id)
    mv.tick()
    assert silent == [peer.node_id]
    for _ in range(3):
        clock.advance(1000)
        mv.tick()
    assert silent == [peer.node_id]  # once per silence
    expected = {PublishedState.LEAVING: Liveness.LEFT, PublishedState.RESTARTING: Liveness.SUSPECT}
    assert mv.liveness(peer.node_id) is expected.get(state, Liveness.SUSPECT)
    pp.maybe_publish()  # heard again: the silence ends, and the next one fires again
    exchange(mp, mv, "v:8087")
    mv.tick()
    assert not mv.silent(peer.node_id)
    clock.advance(SETTINGS.suspect_after_ms)
    mv.tick()
    assert silent == [peer.node_id, peer.node_id]
    assert mv.silent(ca.node("unknown").node_id)  # not known: nothing to wait for


def test_restarting_travels_as_leaving_to_a_protocol_2_peer(ca, clock):
    new, old = ca.node("new"), ca.node("old")
    m_new, p_new = core(new, ca, clock, settings=SETTINGS, protocol=3)
    m_old, _ = core(old, ca, clock, settings=SETTINGS, protocol=2, seed=1)
    exchange(m_new, m_old, "old:8087")  # first contact in 3: refused, the new node learns 2
    exchange(m_new, m_old, "old:8087")
    assert old.node_id in m_new.records and m_new.emit_protocol() == 2
    p_new.set_local([chat_model()], PublishedState.RESTARTING)
    p_new.maybe_publish()
    assert p_new.last.payload.protocol == 2 and p_new.last.payload.state is PublishedState.LEAVING
    exchange(m_new, m_old, "old:8087")
    assert m_old.liveness(new.node_id) is Liveness.LEFT
    assert not {k: v for k, v in m_old.counters.drops.items() if v and k != "unsupported_protocol"}


def test_the_state_value_is_checked_against_the_payloads_protocol(ca, clock):
    node = ca.node("n")
    _, pub = core(node, ca, clock, settings=SETTINGS, protocol=3)
    pub.set_local([chat_model()], PublishedState.RESTARTING)
    pub.maybe_publish()
    obj = json.loads(encode_payload(pub.last.payload))
    assert decode_payload(obj, (2, 3)).state is PublishedState.RESTARTING
    obj["protocol"] = 2
    with pytest.raises(MalformedSummary, match="payload.state"):
        decode_payload(obj, (2, 3))
    obj["protocol"], obj["state"] = 3, "rebooting"
    with pytest.raises(MalformedSummary, match="payload.state"):
        decode_payload(obj, (2, 3))
