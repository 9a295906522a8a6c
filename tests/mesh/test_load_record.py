"""The signed load record (viiwork.mesh.load_record) and its announce-and-pull path in probe mode.

Pure tests of the record's codec, then small probe-mode meshes in virtual time
(viiwork.mesh.sim, counting fake crypto) driven message by message where a rule needs it:
a record is kept only when newer than what is held of its node, verified once per version,
refused when forged or when it does not fit the summary it amends, and an announcement
newer than what is held is pulled (docs/mesh.md, "Load records").
"""

from __future__ import annotations

import json

import pytest

from viiwork.mesh.load_record import (
    LoadRecord,
    ModelLoad,
    decode_load_record,
    load_record_obj,
    load_signing_input,
    sign_load,
)
from viiwork.mesh.messages import Claim, Gossip, Loads, News, Pull, Push
from viiwork.mesh.probe_codec import decode_probe_message, encode_probe_message
from viiwork.mesh.probing import MAX_UNKNOWN_PULLS_PER_MESSAGE, VERIFY_BURST_PER_SENDER
from viiwork.mesh.sim import SIM_MESH_ID, SimNode, Simulator, sim_node_id
from viiwork.mesh.summary import PROTOCOL_VERSION, MalformedSummary, ModelCapacity, OversizedSummary

ACCEPTED = (PROTOCOL_VERSION - 2, PROTOCOL_VERSION - 1, PROTOCOL_VERSION)


def model(busy: int, waiting: int | None = 0) -> tuple[ModelCapacity, ...]:
    return (ModelCapacity("model-x", "llamacpp", "chat", 8, busy, waiting, 4096, 1, 1, "fp-x"),)


def record_obj(**change: object) -> list[object]:
    rec = LoadRecord("aaaaaaaaaaaaaaaa", 1, 7, 5, (ModelLoad(3, 1), ModelLoad(0, None)), b"\1" * 64)  # type: ignore[arg-type]
    obj = load_record_obj(rec)
    for i, key in enumerate(("node_id", "generation", "seq", "base_seq", "loads", "signature")):
        if key in change:
            obj[i] = change[key]
    return obj


# --- the codec ------------------------------------------------------------------------------


def test_a_record_round_trips_and_is_small():
    rec = decode_load_record(record_obj())
    assert rec.order == (1, 7) and rec.base == (1, 5)
    assert rec.loads == (ModelLoad(3, 1), ModelLoad(0, None))
    assert decode_load_record(json.loads(json.dumps(load_record_obj(rec)))) == rec
    one = LoadRecord("aaaaaaaaaaaaaaaa", 1, 12345, 12340, (ModelLoad(3, 1),), b"\1" * 64)  # type: ignore[arg-type]
    size = len(json.dumps(load_record_obj(one), separators=(",", ":")))
    assert size <= 140 and abs(size - one.wire_size()) <= 15  # docs/mesh.md: ~135 B with one model


@pytest.mark.parametrize("change", [
    {"node_id": "not-a-node-id"}, {"generation": -1}, {"seq": True}, {"seq": 1.5},
    {"base_seq": 7}, {"base_seq": 0}, {"loads": [[1]]}, {"loads": [[1, 2]]}, {"loads": [[1, False]]},
    {"loads": [[-1, 0]]}, {"loads": [[2**60, 0]]}, {"loads": "3,1"}, {"loads": [[0, 0]] * 65},
    {"signature": "c2hvcnQ="}, {"signature": "!!"}, {"signature": None},
])
def test_a_malformed_record_is_refused_naming_the_field(change):
    with pytest.raises(MalformedSummary):
        decode_load_record(record_obj(**change))
    with pytest.raises(MalformedSummary):
        decode_load_record(record_obj()[:5])


def test_a_loads_message_keeps_its_good_records_and_lists_the_bad_ones():
    msg = {"type": "loads", "protocol": PROTOCOL_VERSION, "mesh_id": SIM_MESH_ID,
           "records": [record_obj(), record_obj(base_seq=9), record_obj(loads=[[1, 5]])]}
    decoded = decode_probe_message(json.dumps(msg).encode(), ACCEPTED)
    assert isinstance(decoded, Loads)
    assert len(decoded.records) == 1 and decoded.rejected == ("malformed", "malformed")
    assert decode_probe_message(encode_probe_message(decoded), ACCEPTED) == Loads(
        decoded.protocol, SIM_MESH_ID, decoded.records)
    with pytest.raises(MalformedSummary):  # an unknown key: the shape is strict
        decode_probe_message(json.dumps({**msg, "extra": 1}).encode(), ACCEPTED)
    with pytest.raises(OversizedSummary):
        decode_probe_message(json.dumps({**msg, "records": [record_obj()] * 1025}).encode(), ACCEPTED)


# --- in a mesh ------------------------------------------------------------------------------


def mesh(n: int = 5, seed: int = 21) -> Simulator:
    sim = Simulator(n, seed=seed, mode="probe", models=lambda i: model(0))
    assert sim.run_until_true(sim.converged, 20_000, 100)
    sim.run_for(1000)
    return sim


def record_of(sim: Simulator, node: SimNode, busy: int) -> LoadRecord:
    """A load change at ``node``, published as a record (the rate limit's interval passed)."""
    sim.run_for(1000)
    sim.set_load(node.index, model(busy))
    sim.run_for(1)
    rec = node.publisher.last_load
    assert rec is not None and rec.loads[0].busy == busy, "the load change did not go out as a record"
    return rec


def seen_busy(observer: SimNode, origin: SimNode) -> int:
    view = next(p for p in observer.membership.peers() if p.node_id == origin.node_id)
    return view.models[0].busy


def test_a_load_change_goes_out_as_a_record_and_every_peer_routes_by_it():
    sim = mesh(10)
    origin = sim.nodes[3]
    summary = origin.publisher.last
    signed = origin.signer.signatures
    rec = record_of(sim, origin, 7)  # 1 free: published exactly
    assert origin.publisher.last is summary and origin.signer.signatures == signed + 1  # no new summary
    assert rec.base == summary.payload.order and rec.order > summary.payload.order
    assert sim.run_until_true(lambda: all(o.probe.version_of(origin.node_id) == rec.order
                                          for o in sim.up_nodes() if o is not origin), 2000, 20)
    for o in sim.up_nodes():
        if o is not origin:
            view = next(p for p in o.membership.peers() if p.node_id == origin.node_id)
            assert view.models[0].busy == rec.loads[0].busy and view.seq == rec.seq  # the newer of the two
            assert o.membership.records[origin.node_id].order == summary.payload.order
    # A summary published after the record is newer: it holds the load again.
    order = sim.set_models(3, model(1))
    assert sim.run_until_true(lambda: all(sim.knows(o, origin, order) for o in sim.up_nodes() if o is not origin),
                              2000, 20)
    busy = origin.publisher.last.payload.models[0].busy
    assert busy != rec.loads[0].busy
    assert all(seen_busy(o, origin) == busy and origin.node_id not in o.membership.loads
               for o in sim.up_nodes() if o is not origin)


def test_an_older_record_is_dropped_before_its_signature_is_checked():
    sim = mesh()
    origin, observer, sender = sim.nodes[1], sim.nodes[0], sim.nodes[2]
    old = record_of(sim, origin, 4)
    new = record_of(sim, origin, 8)
    assert sim.run_until_true(lambda: observer.membership.loads.get(origin.node_id) == new, 2000, 20)
    verified = observer.policy.signature_verifications
    for rec in (old, new, new):
        observer.probe.receive(sender.node_id, sender.address, Loads(PROTOCOL_VERSION, SIM_MESH_ID, (rec,)))
    assert observer.policy.signature_verifications == verified  # neither verified again
    assert observer.membership.loads[origin.node_id] == new and seen_busy(observer, origin) == 8
    assert observer.probe.counters["loads_old"] == 3


def test_a_forged_or_unfitting_record_is_dropped_and_counted():
    sim = mesh()
    origin, observer, sender = sim.nodes[1], sim.nodes[0], sim.nodes[2]
    base = origin.publisher.last.payload
    busy_before = seen_busy(observer, origin)

    def deliver(rec: LoadRecord) -> None:
        observer.probe.receive(sender.node_id, sender.address, Loads(PROTOCOL_VERSION, SIM_MESH_ID, (rec,)))

    forged = LoadRecord(origin.node_id, base.generation, base.seq + 50, base.seq, (ModelLoad(8, 1),), b"\0" * 64)
    deliver(forged)
    assert observer.probe.counters["loads_forged"] == 1
    assert observer.membership.counters.drops["bad_signature"] == 1
    # Signed by another member's key: forged too.
    by_other = sign_load(SIM_MESH_ID, origin.node_id, base.generation, base.seq + 51, base.seq, model(8),
                         sender.signer.sign)
    deliver(by_other)
    assert observer.probe.counters["loads_forged"] == 2
    # Genuine signatures over what does not fit the summary held: more busy than slots, two loads for one model.
    for loads in ((ModelLoad(9, 0),), (ModelLoad(1, 0), ModelLoad(1, 0))):
        sig = origin.signer.sign(load_signing_input(SIM_MESH_ID, origin.node_id, base.generation, base.seq + 60,
                                                    base.seq, loads))
        deliver(LoadRecord(origin.node_id, base.generation, base.seq + 60, base.seq, loads, sig))
    assert observer.probe.counters["loads_unfit"] == 2
    assert origin.node_id not in observer.membership.loads and seen_busy(observer, origin) == busy_before


def test_a_record_is_verified_once_however_often_it_comes():
    sim = mesh()
    origin, observer, sender = sim.nodes[1], sim.nodes[0], sim.nodes[2]
    sim.freeze(observer.index)  # it hears the record only from this test
    rec = record_of(sim, origin, 8)
    sim.thaw(observer.index)
    verified = observer.policy.signature_verifications
    for _ in range(3):
        observer.probe.receive(sender.node_id, sender.address, Loads(PROTOCOL_VERSION, SIM_MESH_ID, (rec,)))
    assert observer.policy.signature_verifications == verified + 1
    assert observer.membership.loads[origin.node_id] == rec


def test_an_announcement_newer_than_what_is_held_is_pulled_and_an_old_one_is_not():
    sim = mesh()
    origin, observer, announcer = sim.nodes[1], sim.nodes[0], sim.nodes[2]
    sim.freeze(observer.index)
    rec = record_of(sim, origin, 8)
    assert sim.run_until_true(lambda: announcer.probe.version_of(origin.node_id) == rec.order, 2000, 20)
    sim.thaw(observer.index)
    held = observer.membership.records[origin.node_id].order
    out = observer.probe.receive(announcer.node_id, announcer.address,
                                 Gossip(PROTOCOL_VERSION, SIM_MESH_ID, (News(origin.node_id, rec.order),)))
    pulls = [(addr, m) for addr, m in out if isinstance(m, Pull)]
    assert pulls == [(announcer.address, Pull(PROTOCOL_VERSION, SIM_MESH_ID, {origin.node_id: held}))]
    # The announcer answers with the record alone (the asker holds the summary it amends).
    answer = announcer.probe.receive(observer.node_id, observer.address, pulls[0][1])
    assert [type(m) for _, m in answer] == [Loads] and answer[0][1].records == (rec,)
    observer.probe.receive(announcer.node_id, announcer.address, answer[0][1])
    assert observer.probe.version_of(origin.node_id) == rec.order and seen_busy(observer, origin) == 8
    # The same announcement again, or an older one: nothing to pull.
    for order in (rec.order, held):
        out = observer.probe.receive(announcer.node_id, announcer.address,
                                     Gossip(PROTOCOL_VERSION, SIM_MESH_ID, (News(origin.node_id, order),)))
        assert not [m for _, m in out if isinstance(m, Pull)]


def test_a_record_that_comes_before_its_summary_waits_for_it():
    sim = mesh()
    origin, observer, sender = sim.nodes[1], sim.nodes[0], sim.nodes[2]
    sim.freeze(observer.index)
    sim.set_models(origin.index, model(1, None))  # a new summary (structural: waiting unknown)...
    rec = record_of(sim, origin, 8)  # ...and a record amending it
    assert sim.run_until_true(lambda: sender.probe.version_of(origin.node_id) == rec.order, 2000, 20)
    sim.thaw(observer.index)
    observer.probe.receive(sender.node_id, sender.address, Loads(PROTOCOL_VERSION, SIM_MESH_ID, (rec,)))
    assert observer.probe.counters["loads_parked"] == 1 and origin.node_id not in observer.membership.loads
    push = Push(PROTOCOL_VERSION, SIM_MESH_ID, sender.membership.relay({origin.node_id: (1, 1)}, PROTOCOL_VERSION))
    observer.probe.receive(sender.node_id, sender.address, push)
    assert observer.membership.loads[origin.node_id] == rec and seen_busy(observer, origin) == 8


def test_a_record_every_announcement_missed_is_repaired_by_the_version_pull():
    sim = mesh()
    origin, observer = sim.nodes[1], sim.nodes[0]
    sim.freeze(observer.index)  # misses every copy of the news, and the pulls' answers
    rec = record_of(sim, origin, 8)
    sim.run_for(3000)  # the news retired everywhere (4 transmissions per node at 5 nodes)
    assert not any(len(n.probe.queue) for n in sim.up_nodes())
    sim.thaw(observer.index)
    assert observer.probe.version_of(origin.node_id) < rec.order
    pulls = observer.probe.counters["version_pulls"]
    # Anti-entropy every ~5 s (x 0.75..1.25); three rounds in four are version pulls.
    assert sim.run_until_true(lambda: observer.probe.version_of(origin.node_id) == rec.order, 20_000, 100), \
        "the missed record was not repaired"
    assert seen_busy(observer, origin) == 8 and observer.probe.counters["version_pulls"] > pulls


def test_one_sender_of_forged_records_and_claims_gets_a_bounded_number_of_signature_checks():
    """A peer that sends load records (or claims) with fresh orders and junk signatures makes
    this node check each one: at most VERIFY_BURST_PER_SENDER at once, then
    VERIFY_PER_SENDER_PER_S a second; another sender's genuine record still gets through."""
    sim = mesh()
    origin, observer, attacker, honest = sim.nodes[1], sim.nodes[0], sim.nodes[2], sim.nodes[3]
    base = origin.publisher.last.payload
    forged = tuple(LoadRecord(origin.node_id, base.generation, base.seq + 10 + i, base.seq, (ModelLoad(i % 8, 0),),
                              b"\0" * 64) for i in range(3 * int(VERIFY_BURST_PER_SENDER)))
    verified = observer.probe.counters["loads_verified"]
    observer.probe.receive(attacker.node_id, attacker.address, Loads(PROTOCOL_VERSION, SIM_MESH_ID, forged))
    checks = observer.probe.counters["loads_verified"] - verified
    assert VERIFY_BURST_PER_SENDER <= checks <= VERIFY_BURST_PER_SENDER + 1
    assert observer.probe.counters["verify_budget_exceeded"] == len(forged) - checks
    assert observer.membership.counters.drops["rate_limited"] >= len(forged) - checks
    claims = tuple(Claim(origin.node_id, (base.generation, base.seq), honest.node_id, bytes([i % 256]) * 64) for i in range(300))
    observer.probe.receive(attacker.node_id, attacker.address, Gossip(PROTOCOL_VERSION, SIM_MESH_ID, claims))
    assert observer.probe.counters["claims_verified"] <= 1  # the attacker's budget is spent
    seq = base.seq + 10 + len(forged)
    sig = origin.signer.sign(load_signing_input(SIM_MESH_ID, origin.node_id, base.generation, seq, base.seq,
                                                (ModelLoad(5, 0),)))
    genuine = LoadRecord(origin.node_id, base.generation, seq, base.seq, (ModelLoad(5, 0),), sig)
    observer.probe.receive(honest.node_id, honest.address, Loads(PROTOCOL_VERSION, SIM_MESH_ID, (genuine,)))
    assert observer.membership.loads[origin.node_id] == genuine and seen_busy(observer, origin) == 5


def test_news_about_many_unknown_nodes_opens_a_bounded_number_of_pulls():
    """A message naming 1,024 made-up node ids opened 1,024 pulls; now at most
    MAX_UNKNOWN_PULLS_PER_MESSAGE (a join is found by the digest exchange), and news about
    known nodes in the same message are pulled as before."""
    sim = mesh()
    observer, sender, origin = sim.nodes[0], sim.nodes[2], sim.nodes[1]
    base = origin.publisher.last.payload
    made_up = tuple(News(sim_node_id(10_000 + i), (1, 5)) for i in range(1000))
    out = observer.probe.receive(sender.node_id, sender.address, Gossip(
        PROTOCOL_VERSION, SIM_MESH_ID, (*made_up, News(origin.node_id, (base.generation, base.seq + 3)))))
    pulls = [msg for _, msg in out if isinstance(msg, Pull)]
    assert len(pulls) == 1
    assert len(pulls[0].wants) == MAX_UNKNOWN_PULLS_PER_MESSAGE + 1 and origin.node_id in pulls[0].wants
    assert observer.probe.counters["news_unknown_skipped"] == len(made_up) - MAX_UNKNOWN_PULLS_PER_MESSAGE
