"""The protocol core with real Ed25519 keys and certificates and an injected clock."""

from __future__ import annotations

import dataclasses
import datetime as dt
import json

import pytest
from freezegun import freeze_time

from support.mesh_crypto import T0, ManualClock, TestCA, chat_model, core, exchange
from viiwork.mesh.membership import GossipSettings, Liveness
from viiwork.mesh.messages import Digest, Push, RelayedSummary, encode_message
from viiwork.mesh.summary import PublishedState, SignedSummary, sign_payload
from viiwork.mesh.trust import utcnow


@pytest.fixture
def ca():
    return TestCA()


@pytest.fixture
def clock():
    return ManualClock()


def drops(m):
    return {k: v for k, v in m.counters.drops.items() if v}


def push_of(m_from, pub_from, *, age_ms=0, with_cert=True, summary=None):
    """A push message carrying ``summary`` (default: the publisher's latest)."""
    s = summary or pub_from.last
    if not with_cert:
        s = s.without_certificate()
    return Push(2, m_from.mesh_id, (RelayedSummary(s, age_ms),))


def test_one_exchange_teaches_both_sides_and_certificates_travel_once(ca, clock):
    a, b = ca.node("a"), ca.node("b")
    ma, pa = core(a, ca, clock)
    mb, pb = core(b, ca, clock, seed=1)
    first = exchange(ma, mb)
    assert set(ma.records) == {b.node_id} and set(mb.records) == {a.node_id}
    pa.maybe_publish(force=True)
    pb.maybe_publish(force=True)
    second = exchange(ma, mb)
    assert ma.records[b.node_id].order == pb.last.payload.order
    assert mb.records[a.node_id].order == pa.last.payload.order
    # The first reply/push carried certificates (~300 bytes DER, base64), the second did not.
    assert second["reply"] < first["reply"] - 300 and second["push"] < first["push"] - 300
    assert not drops(ma) and not drops(mb)


def test_nothing_new_means_only_a_digest_and_an_empty_reply(ca, clock):
    ma, _ = core(ca.node("a"), ca, clock)
    mb, _ = core(ca.node("b"), ca, clock)
    exchange(ma, mb)
    sizes = exchange(ma, mb)
    assert sizes["push"] == 0
    assert json.loads(mb.on_digest_bytes(ma.node_id, ma.digest_bytes()))["summaries"] == []


def test_newer_accepted_replay_and_older_dropped_and_counted(ca, clock):
    a = ca.node("a")
    ma, pa = core(a, ca, clock)
    mb, _ = core(ca.node("b"), ca, clock)
    old = pa.last
    pa.set_local([chat_model(busy=3)])
    new = pa.maybe_publish()
    mb.handle_push(a.node_id, push_of(ma, pa, summary=new))
    assert mb.records[a.node_id].summary.payload.models[0].busy == 3
    mb.handle_push(a.node_id, push_of(ma, pa, summary=new))
    mb.handle_push(a.node_id, push_of(ma, pa, summary=old))
    assert drops(mb) == {"replay": 1, "old_seq": 1}
    assert mb.records[a.node_id].summary.payload.models[0].busy == 3


def test_restarted_node_with_new_generation_is_accepted_at_once(ca, clock):
    a = ca.node("a")
    ma, pa = core(a, ca, clock)
    mb, _ = core(ca.node("b"), ca, clock)
    for _ in range(50):
        pa.maybe_publish(force=True)
    mb.handle_push(a.node_id, push_of(ma, pa))
    assert mb.records[a.node_id].order == (1, 51)
    ma2, pa2 = core(a, ca, clock, generation=2)  # seq starts again at 1
    mb.handle_push(a.node_id, push_of(ma2, pa2))
    assert mb.records[a.node_id].order == (2, 1)
    assert mb.liveness(a.node_id) is Liveness.ALIVE


def test_tampered_summary_is_bad_signature(ca, clock):
    a = ca.node("a")
    ma, pa = core(a, ca, clock)
    mb, _ = core(ca.node("b"), ca, clock)
    s = pa.last
    forged_payload = dataclasses.replace(s.payload, models=(chat_model(busy=0, slots=64),))
    forged = sign_payload(forged_payload, lambda data: s.signature, s.certificate)  # old signature, new content
    mb.handle_push(a.node_id, push_of(ma, pa, summary=forged))
    assert drops(mb) == {"bad_signature": 1} and a.node_id not in mb.records


def test_certificate_of_another_ca_is_wrong_ca(ca, clock):
    other = TestCA("other")
    intruder = other.node("intruder")
    mi, pi = core(intruder, other, clock)
    mb, _ = core(ca.node("b"), ca, clock)
    mi.mesh_id = mb.mesh_id  # the intruder claims our mesh id; its certificate gives it away
    pi.set_local([chat_model(busy=1)])
    mb.handle_push(intruder.node_id, push_of(mi, pi, summary=pi.maybe_publish()))
    assert drops(mb) == {"wrong_ca": 1} and not mb.records


def test_expired_certificate_is_dropped_by_the_local_wall_clock(ca):
    clock = ManualClock()
    a = ca.node("a", not_after=T0 + dt.timedelta(days=2))
    ma, pa = core(a, ca, clock)
    mb, _ = core(ca.node("b"), ca, clock)
    mb.wall_clock = utcnow  # the real wall clock, driven by freezegun
    with freeze_time(T0 + dt.timedelta(days=1)):
        mb.handle_push(a.node_id, push_of(ma, pa))
        assert a.node_id in mb.records
    pa.maybe_publish(force=True)
    with freeze_time(T0 + dt.timedelta(days=3)):
        mb.handle_push(a.node_id, push_of(ma, pa, with_cert=False))
    assert drops(mb) == {"expired_certificate": 1}
    # The record now asks for a certificate in its digests ((0, 0)), so a renewed one can come.
    assert mb.make_digest().entries[a.node_id] == (0, 0)


def test_renewed_certificate_is_fetched_after_the_cached_one_expired(ca):
    clock = ManualClock()
    key_node = ca.node("a", not_after=T0 + dt.timedelta(days=2))
    ma, pa = core(key_node, ca, clock)
    mb, _ = core(ca.node("b"), ca, clock)
    exchange(mb, ma)
    clock.advance(3 * 86_400_000)  # both wall clocks move 3 days: a's certificate expired
    renewed = ca.node("a", key=key_node.identity.private_key, not_after=T0 + dt.timedelta(days=30))
    pa.signer = renewed.signer
    ma.certificate_der = renewed.signer.certificate_der
    pa.maybe_publish(force=True)
    exchange(mb, ma)  # b's cached certificate is expired: dropped, and b now asks for it
    assert drops(mb) == {"expired_certificate": 1}
    exchange(mb, ma)  # a sends the summary with its renewed certificate
    assert mb.records[key_node.node_id].order == pa.last.payload.order
    assert mb.records[key_node.node_id].cert.der == renewed.signer.certificate_der


def test_summary_without_certificate_from_an_unknown_node_is_unknown_signer(ca, clock):
    a = ca.node("a")
    ma, pa = core(a, ca, clock)
    mb, _ = core(ca.node("b"), ca, clock)
    mb.handle_push(a.node_id, push_of(ma, pa, with_cert=False))
    assert drops(mb) == {"unknown_signer": 1}


def test_summary_claiming_another_node_id_is_identity_mismatch(ca, clock):
    a, c = ca.node("a"), ca.node("c")
    ma, pa = core(a, ca, clock)
    mb, _ = core(ca.node("b"), ca, clock)
    # c signs a summary that claims to be a's, and attaches its own certificate.
    claim = dataclasses.replace(pa.last.payload, seq=99)
    forged = sign_payload(claim, c.signer.sign, c.signer.certificate_der)
    mb.handle_push(c.node_id, push_of(ma, pa, summary=forged))
    assert drops(mb) == {"identity_mismatch": 1}


@pytest.mark.parametrize("data,reason", [
    (b"\x00\x01garbage", "malformed"),
    (b'{"type": "digest"}', "malformed"),
    (b"[" * 50_000, "malformed"),
    (b'{"type":"digest","protocol":2,"mesh_id":"x","entries":[["zz",1,1]]}', "malformed"),
], ids=["binary", "incomplete", "deep", "bad-entry"])
def test_garbage_digest_is_dropped_and_counted(ca, clock, data, reason):
    mb, _ = core(ca.node("b"), ca, clock)
    assert mb.on_digest_bytes("abcdefghijklmnop", data) is None
    assert drops(mb) == {reason: 1}


def test_oversized_message_is_dropped_before_decoding(ca, clock):
    settings = GossipSettings(max_message_bytes=8192, scale_with_size=False)
    mb, _ = core(ca.node("b"), ca, clock, settings=settings)
    assert mb.on_push_bytes("abcdefghijklmnop", b"{" + b" " * 9000 + b"}") is False
    assert drops(mb) == {"oversized": 1}


def test_wrong_mesh_is_dropped(ca, clock):
    ma, _ = core(ca.node("a"), ca, clock)
    mb, _ = core(ca.node("b"), ca, clock)
    digest = dataclasses.replace(ma.make_digest(), mesh_id="someone-else")
    assert mb.handle_digest(ma.node_id, digest) is None
    assert drops(mb) == {"wrong_mesh": 1}


def test_unsupported_protocol_gets_an_empty_reply_that_teaches_the_sender(ca, clock):
    old = ca.node("old")
    m_old, _ = core(old, ca, clock, protocol=1)
    m_new, _ = core(ca.node("new"), ca, clock)
    # The new node does not know the old one's version yet and speaks 2.
    reply = m_old.on_digest_bytes(m_new.node_id, m_new.digest_bytes())
    assert drops(m_old) == {"unsupported_protocol": 1}
    assert json.loads(reply)["protocol"] == 1 and json.loads(reply)["summaries"] == []
    from viiwork.mesh.membership import GossipTarget

    target = GossipTarget("old:8087", None, 2)
    m_new.on_reply_bytes(old.node_id, reply, target)
    assert m_new.peer_protocols["old:8087"][0] == 1
    assert m_new._target_protocol("old:8087", None) == 1


def test_previous_protocol_interoperates_and_new_nodes_speak_down(ca, clock):
    old, new = ca.node("old"), ca.node("new")
    m_old, p_old = core(old, ca, clock, protocol=1)
    m_new, p_new = core(new, ca, clock, seed=2)
    assert p_new.last.payload.protocol == 2
    exchange(m_new, m_old, "old:8087")  # first contact in 2: refused, learns 1
    exchange(m_new, m_old, "old:8087")
    assert old.node_id in m_new.records
    assert m_new.emit_protocol() == 1
    p_new.maybe_publish()
    assert p_new.last.payload.protocol == 1
    assert p_new.last.payload.models[0].fingerprint is None
    exchange(m_old, m_new, "new:8087")
    assert m_old.records[new.node_id].order == p_new.last.payload.order
    exchange(m_new, m_old, "old:8087")
    assert m_new.records[old.node_id].summary.payload.protocol == 1


def test_liveness_follows_the_receivers_clock(ca, clock):
    a = ca.node("a")
    ma, pa = core(a, ca, clock)
    mb, _ = core(ca.node("b"), ca, clock)
    mb.handle_push(a.node_id, push_of(ma, pa, age_ms=300))
    seen = []
    mb.on_liveness.append(lambda nid, old, new: seen.append(new))
    clock.advance(1699)
    mb.tick()
    assert mb.liveness(a.node_id) is Liveness.ALIVE
    clock.advance(1)  # 300 ms old on arrival + 1700 = 2000 = suspect_after
    mb.tick()
    assert mb.liveness(a.node_id) is Liveness.SUSPECT
    clock.advance(8000)
    mb.tick()
    assert mb.liveness(a.node_id) is Liveness.DEAD
    assert seen == [Liveness.SUSPECT, Liveness.DEAD]
    pa.maybe_publish(force=True)
    mb.handle_push(a.node_id, push_of(ma, pa, with_cert=False))
    assert mb.liveness(a.node_id) is Liveness.ALIVE and seen[-1] is Liveness.ALIVE


def test_leaving_is_left_at_once(ca, clock):
    a = ca.node("a")
    ma, pa = core(a, ca, clock)
    mb, _ = core(ca.node("b"), ca, clock)
    exchange(mb, ma)
    pa.set_local([chat_model()], PublishedState.LEAVING)
    pa.maybe_publish()
    exchange(mb, ma)
    assert mb.liveness(a.node_id) is Liveness.LEFT
    assert mb.peers()[0].state is PublishedState.LEAVING


def test_stale_relay_does_not_resurrect_dead_peer(ca, clock):
    x = ca.node("x")
    mx, px = core(x, ca, clock)
    observer, _ = core(ca.node("observer"), ca, clock)
    stale_relay, _ = core(ca.node("relay"), ca, clock)
    stale_relay.handle_push(x.node_id, push_of(mx, px))  # the relay holds x's seq 1 ...
    for _ in range(3):
        px.maybe_publish(force=True)
    observer.handle_push(x.node_id, push_of(mx, px))  # ... the observer holds seq 4
    clock.advance(11_000)  # x died; the observer declares it dead
    observer.tick()
    assert observer.liveness(x.node_id) is Liveness.DEAD
    # The stale relay gossips with the observer, both ways: nothing changes on either side
    # (the observer never spreads a dead node's last summary) ...
    exchange(stale_relay, observer)
    exchange(observer, stale_relay)
    assert observer.liveness(x.node_id) is Liveness.DEAD
    assert stale_relay.records[x.node_id].order == (1, 1)
    # ... and when the relay pushes its older copy anyway, it is dropped as old.
    observer.handle_push(stale_relay.node_id, Push(2, observer.mesh_id, (RelayedSummary(
        stale_relay.records[x.node_id].with_cert, 0),)))
    assert observer.counters.drops["old_seq"] == 1
    assert observer.liveness(x.node_id) is Liveness.DEAD and observer.records[x.node_id].order == (1, 4)
    # A newer summary that a relay has held for longer than dead_after keeps x dead too.
    px.maybe_publish(force=True)
    observer.handle_push(x.node_id, push_of(mx, px, age_ms=10_500, with_cert=False))
    assert observer.records[x.node_id].order == (1, 5)
    assert observer.liveness(x.node_id) is Liveness.DEAD


def test_first_summary_of_an_unknown_node_already_older_than_dead_is_stale(ca, clock):
    a = ca.node("a")
    ma, pa = core(a, ca, clock)
    mb, _ = core(ca.node("b"), ca, clock)
    mb.handle_push(a.node_id, push_of(ma, pa, age_ms=10_001))
    assert drops(mb) == {"stale": 1} and not mb.records


def test_node_that_lost_its_generation_outranks_its_previous_run(ca, clock):
    a = ca.node("a")
    ma, pa = core(a, ca, clock)
    mb, _ = core(ca.node("b"), ca, clock)
    for _ in range(40):
        pa.maybe_publish(force=True)
    exchange(ma, mb)
    # a restarts with its boot file lost: generation 1 again, seq 1.
    ma2, pa2 = core(a, ca, clock, generation=1)
    exchange(ma2, mb)  # b replies with a's previous run (1, 41); a sees itself outranked
    assert ma2.required_generation == 2
    pa2.maybe_publish()
    assert pa2.last.payload.order == (2, 1)
    exchange(ma2, mb)
    assert mb.records[a.node_id].order == (2, 1)


def test_clock_skew_of_an_hour_changes_nothing(ca):
    slow, fast = ManualClock(start_ms=1_000.0, wall_start=T0 - dt.timedelta(hours=1)), \
        ManualClock(start_ms=7_201_000.0, wall_start=T0 + dt.timedelta(hours=1))
    ma, pa = core(ca.node("a"), ca, slow)
    mb, pb = core(ca.node("b"), ca, fast)
    exchange(ma, mb)
    for clock in (slow, fast):
        clock.advance(500)
    pa.maybe_publish()
    pb.maybe_publish()
    exchange(mb, ma)
    assert ma.liveness(mb.node_id) is Liveness.ALIVE and mb.liveness(ma.node_id) is Liveness.ALIVE
    assert ma.peers()[0].age_ms < 1000 and mb.peers()[0].age_ms < 1000
    assert not drops(ma) and not drops(mb)


def test_per_peer_rate_limit(ca, clock):
    settings = GossipSettings(peer_rate_per_s=2, peer_burst=3, scale_with_size=False)
    ma, _ = core(ca.node("a"), ca, clock)
    mb, _ = core(ca.node("b"), ca, clock, settings=settings)
    answered = [mb.handle_digest(ma.node_id, ma.make_digest()) is not None for _ in range(5)]
    assert answered == [True, True, True, False, False]
    clock.advance(500)  # one token back
    assert mb.handle_digest(ma.node_id, ma.make_digest()) is not None
    assert drops(mb) == {"rate_limited": 2}


def test_peer_table_is_bounded_and_tombstones_make_room(ca, clock):
    settings = GossipSettings(max_peers=2, scale_with_size=False)
    mb, _ = core(ca.node("b"), ca, clock, settings=settings)
    others = [core(ca.node(f"n{i}"), ca, clock) for i in range(3)]
    for m, p in others[:2]:
        mb.handle_push(m.node_id, push_of(m, p))
    mb.handle_push(others[2][0].node_id, push_of(*others[2]))
    assert drops(mb) == {"too_many_peers": 1} and len(mb.records) == 2
    clock.advance(11_000)  # both known nodes die and become tombstones
    others[2][1].maybe_publish(force=True)
    mb.handle_push(others[2][0].node_id, push_of(*others[2]))
    assert others[2][0].node_id in mb.records and len(mb.records) == 2


def test_digest_from_a_peer_with_a_huge_table_does_not_overfill_ours(ca, clock):
    settings = GossipSettings(max_peers=3, scale_with_size=False)
    mb, _ = core(ca.node("b"), ca, clock, settings=settings)
    entries = {f"{chr(97 + i)}bcdefghijklmnop": (1, 1) for i in range(10)}
    reply = mb.handle_digest("abcdefghijklmnop", Digest(2, mb.mesh_id, entries))
    assert len(reply.wants) == 3


def test_model_conflicts_are_flagged(ca, clock):
    a, b = ca.node("a"), ca.node("b")
    ma, pa = core(a, ca, clock)
    mb, pb = core(b, ca, clock)
    pb.set_local([chat_model(fingerprint="fp-b"), chat_model("other", fingerprint=None)])
    pb.maybe_publish()
    exchange(ma, mb)
    assert ma.model_conflicts() == {"llama": {a.node_id: "fp-a", b.node_id: "fp-b"}}


def test_peer_views_give_what_routing_needs(ca, clock):
    a = ca.node("a")
    ma, pa = core(a, ca, clock)
    mb, _ = core(ca.node("b"), ca, clock)
    exchange(mb, ma)
    mb.note_rtt(a.node_id, 4.0)
    (view,) = mb.peers()
    assert (view.node_id, view.name, view.api, view.mesh) == (a.node_id, "a", "a:8086", "a:8087")
    assert view.liveness is Liveness.ALIVE and view.state is PublishedState.SERVING
    assert view.models[0].free == 4 and view.rtt_ms == 4.0 and view.age_ms < 100


def test_select_targets_uses_fanout_live_peers_and_probes_the_dead(ca, clock):
    settings = GossipSettings(fanout=2, probe_dead_per_round=1.0, scale_with_size=False)
    mb, _ = core(ca.node("b"), ca, clock, settings=settings)
    peers = [core(ca.node(f"p{i}"), ca, clock) for i in range(4)]
    for m, p in peers:
        mb.handle_push(m.node_id, push_of(m, p))
    mb.add_candidate("seed.example:8087")
    targets = mb.select_targets()
    assert len(targets) == 2 and all(t.node_id in {m.node_id for m, _ in peers} for t in targets)
    clock.advance(11_000)  # all dead: candidates fill in, one dead node is probed
    targets = mb.select_targets()
    addresses = [t.address for t in targets]
    assert "seed.example:8087" in addresses
    assert any(t.node_id in {m.node_id for m, _ in peers} for t in targets)


def test_relayed_copies_carry_their_age(ca, clock):
    x = ca.node("x")
    mx, px = core(x, ca, clock)
    relay, _ = core(ca.node("relay"), ca, clock)
    late, _ = core(ca.node("late"), ca, clock)
    relay.handle_push(x.node_id, push_of(mx, px, age_ms=100))
    clock.advance(1500)
    exchange(late, relay)
    assert 1550 <= late.clock() - late.records[x.node_id].heard_at <= 1650
    assert late.peers()[0].age_ms >= 1500


def test_forged_summary_of_ourselves_is_counted(ca, clock):
    a, c = ca.node("a"), ca.node("c")
    ma, pa = core(a, ca, clock)
    claim = dataclasses.replace(pa.last.payload, seq=500)
    forged = SignedSummary(claim, pa.last.payload_bytes, c.signer.sign(b"x"), None)
    ma.handle_push(c.node_id, Push(2, ma.mesh_id, (RelayedSummary(forged, 0),)))
    assert drops(ma) == {"bad_signature": 1} and ma.required_generation == 0


def test_every_drop_reason_is_listed_in_counters(ca, clock):
    from viiwork.mesh.counters import DropReason

    mb, _ = core(ca.node("b"), ca, clock)
    assert set(mb.counters.as_dict()["drops"]) == {r.value for r in DropReason}
    assert encode_message(mb.make_digest())  # digest of a fresh node encodes
