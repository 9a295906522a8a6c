"""Protocol 4 as nodes speak it: extensions published, gossiped, read and counted; a rolling
upgrade from 99079c7's protocol 2 (docs/mesh.md, "Versions", "Extensions"). The protocol core
with real keys and an injected clock, exchanged over the byte codec as the transport does."""

from __future__ import annotations

import pytest

from support.mesh_crypto import ManualClock, TestCA, chat_model, core, exchange
from viiwork.mesh.extensions import REVOCATIONS, SPEEDS, Extensions, ExtensionSpec, ModelSpeed, Revocations, Speeds
from viiwork.mesh.membership import GossipSettings, Liveness
from viiwork.mesh.summary import PROTOCOL_VERSION, PublishedState

SETTINGS = GossipSettings(scale_with_size=False)


@pytest.fixture
def ca() -> TestCA:
    return TestCA()


@pytest.fixture
def clock() -> ManualClock:
    return ManualClock()


def test_nodes_speak_4_and_accept_the_two_versions_before_it(ca, clock):
    m, _ = core(ca.node("a"), ca, clock, settings=SETTINGS, protocol=PROTOCOL_VERSION)
    assert PROTOCOL_VERSION == 4
    assert m.accepted == (2, 3, 4)


def test_extensions_reach_a_peer_and_read_back_typed(ca, clock):
    a, b = ca.node("a"), ca.node("b")
    ma, pa = core(a, ca, clock, settings=SETTINGS, protocol=4)
    mb, _ = core(b, ca, clock, settings=SETTINGS, protocol=4, seed=1)
    pa.set_extensions(Extensions.of({REVOCATIONS: Revocations(7)}))
    assert pa.maybe_publish() is not None  # a change of extensions alone is published
    exchange(ma, mb, "b:8087")
    view = next(p for p in mb.peers() if p.node_id == a.node_id)
    assert view.protocol == 4
    assert view.extensions.get(REVOCATIONS) == Revocations(7)
    assert mb.counters.transport["extensions_ignored"] == 0
    pa.set_extensions(Extensions.of({REVOCATIONS: Revocations(7)}))  # the same: nothing new
    assert pa.maybe_publish() is None


def test_an_extension_a_peer_does_not_know_is_counted_and_relayed_unchanged(ca, clock):
    a, b, c = ca.node("a"), ca.node("b"), ca.node("c")
    ma, pa = core(a, ca, clock, settings=SETTINGS, protocol=4)
    mb, _ = core(b, ca, clock, settings=SETTINGS, protocol=4, seed=1)
    mc, _ = core(c, ca, clock, settings=SETTINGS, protocol=4, seed=2)
    # "later" is a name nobody registered here: a node of a later release publishes it.
    unknown = Extensions.of({ExtensionSpec("later", 1, 64, lambda v: v, lambda v: v): {"x": 1}})
    pa.set_extensions(unknown)
    pa.maybe_publish()
    exchange(ma, mb, "b:8087")
    assert mb.counters.transport["extensions_ignored"] == 1
    held = mb.records[a.node_id].summary.payload.extensions
    assert held.ignored == (("later", "unknown_name"),)
    exchange(mb, mc, "c:8087")  # relayed by b: the signature still verifies at c
    assert mc.records[a.node_id].summary.payload.extensions.raw("later") == (1, {"x": 1})
    assert mc.counters.drops.get("bad_signature", 0) == 0


def test_a_rolling_upgrade_from_protocol_2(ca, clock):
    """A node of 4 beside one of 2 (99079c7) publishes in 2 without extensions, each reads the
    other; once the old node is gone it publishes in 4 with them."""
    new, old = ca.node("new"), ca.node("old")
    mn, pn = core(new, ca, clock, settings=SETTINGS, protocol=4)
    mo, po = core(old, ca, clock, settings=SETTINGS, protocol=2, seed=1)
    assert mo.accepted == (1, 2)
    pn.set_extensions(Extensions.of({SPEEDS: Speeds((ModelSpeed("llama", 40, 900),))}))
    exchange(mo, mn, "new:8087")  # the old node dials: the new one learns it speaks 2
    assert mn.records[old.node_id].summary.payload.speaks == 2
    summary = pn.maybe_publish()
    assert summary is not None and summary.payload.protocol == 2 and not summary.payload.extensions
    exchange(mn, mo, "old:8087")
    assert mo.records[new.node_id].summary.payload.protocol == 2
    assert mo.counters.drops.get("unsupported_protocol", 0) == 0
    assert mo.counters.drops.get("malformed", 0) == 0
    # A restart on the new node is ``leaving`` in 2 (no ``restarting`` there).
    pn.set_local([chat_model()], PublishedState.RESTARTING)
    assert pn.maybe_publish().payload.state is PublishedState.LEAVING
    pn.set_local([chat_model()], PublishedState.SERVING)
    pn.maybe_publish()
    # The old node is gone: dead after dead_after_ms of silence; the next summary is in 4.
    for _ in range(11):
        clock.advance(1000)
        mn.tick()
    assert mn.liveness(old.node_id) is Liveness.DEAD
    summary = pn.maybe_publish(force=True)
    assert summary.payload.protocol == 4
    assert summary.payload.extensions.get(SPEEDS) == Speeds((ModelSpeed("llama", 40, 900),))
