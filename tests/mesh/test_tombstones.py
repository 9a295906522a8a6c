"""Tombstones are reaped after ``tombstone_ttl_ms`` (mesh/membership.py, module doc), in
virtual time: the pure protocol core with real keys and an injected clock."""

from __future__ import annotations

import pytest

from support.mesh_crypto import ManualClock, TestCA, chat_model, core, exchange
from viiwork.mesh.membership import GossipSettings, Liveness
from viiwork.mesh.summary import PublishedState

TTL_MS = 3_600_000  # the default, one hour
SETTINGS = GossipSettings(scale_with_size=False, tombstone_ttl_ms=TTL_MS)


@pytest.fixture
def ca() -> TestCA:
    return TestCA()


@pytest.fixture
def clock() -> ManualClock:
    return ManualClock()


def tick_to(m, clock: ManualClock, at_ms: float) -> None:
    """Advance ``clock`` to ``at_ms`` in gossip-round steps, ticking ``m`` on the way as the
    transport's round loop does (one tick per round would be 7,200 ticks an hour; a tick per
    minute shows the same transitions)."""
    while clock.ms < at_ms:
        clock.advance(min(60_000.0, at_ms - clock.ms))
        m.tick()


def test_dead_node_is_a_tombstone_until_its_ttl_then_reaped(ca, clock) -> None:
    a = ca.node("a")
    ma, _ = core(a, ca, clock, settings=SETTINGS)
    mb, _ = core(ca.node("b"), ca, clock, settings=SETTINGS)
    exchange(ma, mb)
    heard = clock.ms
    assert mb.liveness(a.node_id) is Liveness.ALIVE
    # Dead after dead_after_ms, but remembered (a tombstone, still in digests) ...
    tick_to(mb, clock, heard + SETTINGS.dead_after_ms + 1)
    assert mb.liveness(a.node_id) is Liveness.DEAD
    tick_to(mb, clock, heard + TTL_MS)
    assert mb.liveness(a.node_id) is Liveness.DEAD
    assert a.node_id in mb.make_digest().entries
    # ... until its silence exceeds the TTL: then it is gone from the table and the digests.
    tick_to(mb, clock, heard + TTL_MS + 60_000)
    assert a.node_id not in mb.records and mb.liveness(a.node_id) is None
    assert a.node_id not in mb.make_digest().entries
    assert [p.node_id for p in mb.peers()] == []


def test_left_node_is_reaped_after_its_ttl(ca, clock) -> None:
    a = ca.node("a")
    ma, pa = core(a, ca, clock, settings=SETTINGS)
    mb, _ = core(ca.node("b"), ca, clock, settings=SETTINGS)
    pa.set_local([chat_model()], PublishedState.LEAVING)
    pa.maybe_publish()
    exchange(ma, mb)
    heard = clock.ms
    assert mb.liveness(a.node_id) is Liveness.LEFT
    tick_to(mb, clock, heard + TTL_MS - 60_000)
    assert mb.liveness(a.node_id) is Liveness.LEFT
    tick_to(mb, clock, heard + TTL_MS + 60_000)
    assert a.node_id not in mb.records


def test_a_live_node_is_never_reaped(ca, clock) -> None:
    a = ca.node("a")
    ma, pa = core(a, ca, clock, settings=SETTINGS)
    mb, _ = core(ca.node("b"), ca, clock, settings=SETTINGS)
    start = clock.ms
    while clock.ms < start + TTL_MS + 60_000:  # for over an hour, a fresh summary before each tick
        clock.advance(60_000)
        pa.maybe_publish(force=True)
        exchange(ma, mb)
        mb.tick()
        assert mb.liveness(a.node_id) is Liveness.ALIVE
