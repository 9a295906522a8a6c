"""Probe mode (viiwork.mesh.probing) in the simulator: SWIM probes, change-only dissemination.

Small meshes in virtual time (viiwork.mesh.sim, mode="probe"); the bounds come from the
detector's timings (mesh/detector.py: 500 ms probe interval, 2 x 200 ms direct pings, 600 ms
for the relays, suspicion 2 s .. 12 s at 10 nodes) and issue 16's goals.
"""

from __future__ import annotations

import dataclasses

from viiwork.mesh.detector import DetectorSettings, suspicion_timeout_ms
from viiwork.mesh.extensions import (
    ENDPOINTS,
    GANGS,
    MAX_EXTENSION_BYTES,
    MAX_MODEL_NAME_CHARS,
    PREFIXES,
    REFUTED,
    SPEEDS,
    Endpoints,
    Extensions,
    GangMember,
    Gangs,
    ModelEndpoints,
    ModelPrefixes,
    ModelSpeed,
    Prefixes,
    Speeds,
    canonical_bytes,
)
from viiwork.mesh.identity import NodeId
from viiwork.mesh.membership import Liveness
from viiwork.mesh.messages import (
    NEWS_BYTES,
    Ack,
    Claim,
    Gossip,
    News,
    Ping,
    PingReq,
    Pull,
    Push,
    claim_signing_input,
    item_size,
)
from viiwork.mesh.probe_codec import MAX_PROBE_MESSAGE_BYTES, decode_any, encode_probe_message
from viiwork.mesh.probing import ProbeSettings
from viiwork.mesh.quantise import LoadQuantiser
from viiwork.mesh.sim import SIM_MESH_ID, Simulator, sim_node_id
from viiwork.mesh.summary import MAX_SUMMARY_BYTES, ModelCapacity, encode_payload

BUSY = (ModelCapacity("model-x", "llamacpp", "chat", 8, 7, 3, 4096, 2, 2, "fp-x"),)
D = DetectorSettings()
# Until some live node probes a crashed one: at worst one full pass over the others; then
# the probe's own budget (both pings, the relays' window).
PROBE_BOUND_MS = lambda n: (n - 1) * D.probe_interval_ms + D.direct_attempts * D.probe_timeout_ms + D.indirect_timeout_ms  # noqa: E731


def probe_mesh(n: int, seed: int, loss: float = 0.0) -> Simulator:
    sim = Simulator(n, seed=seed, loss=loss, mode="probe")
    assert sim.run_until_true(sim.converged, 20_000, 100), "the probe-mode mesh did not converge"
    return sim


def watch(sim: Simulator) -> list[tuple[int, str, Liveness, float]]:
    seen: list[tuple[int, str, Liveness, float]] = []
    sim.liveness_watchers.append(lambda node, origin, old, new: seen.append((node.index, origin, new, sim.now)))
    return seen


def test_crashed_node_is_suspected_then_declared_dead_by_every_node_within_the_bound():
    sim = probe_mesh(10, seed=11, loss=0.05)
    sim.kill(4)
    start = sim.now
    gone = lambda: all(sim.view_of(o.index, 4) is not Liveness.ALIVE for o in sim.up_nodes())  # noqa: E731
    # Probed within one pass, then the claim spreads by gossip (a second: 5 gossip rounds).
    assert sim.run_until_true(gone, PROBE_BOUND_MS(10) + 1000, 50), "some node still routes to the crashed one"
    not_alive_ms = sim.now - start
    dead_bound = PROBE_BOUND_MS(10) + suspicion_timeout_ms(10, 0, D) + 1000
    assert sim.run_until_true(lambda: all(sim.view_of(o.index, 4) is Liveness.DEAD for o in sim.up_nodes()),
                              dead_bound - not_alive_ms, 100), "not declared dead by all within the bound"
    assert all(sim.knows(a, b) for a in sim.up_nodes() for b in sim.up_nodes() if a is not b)


def test_frozen_node_is_suspected_then_refutes_with_a_newer_incarnation():
    sim = probe_mesh(10, seed=12)
    seen = watch(sim)
    frozen = sim.nodes[6]
    before = frozen.publisher.last.payload.order
    sim.freeze(6)
    suspected = lambda: any(sim.view_of(o.index, 6) is Liveness.SUSPECT for o in sim.up_nodes())  # noqa: E731
    assert sim.run_until_true(suspected, PROBE_BOUND_MS(10) + 500, 20), "nobody suspected the frozen node"
    sim.thaw(6)  # SIGCONT: before any suspicion can time out (2 s at least)
    assert sim.run_until_true(
        lambda: all(sim.view_of(o.index, 6) is Liveness.ALIVE for o in sim.up_nodes() if o is not frozen),
        2000, 20), "the suspicion was not refuted"
    assert frozen.probe.counters["refutations"] >= 1
    assert frozen.publisher.last.payload.order > before
    assert not [s for s in seen if s[1] == frozen.node_id and s[2] is Liveness.DEAD]
    assert [s for s in seen if s[1] == frozen.node_id and s[2] is Liveness.SUSPECT]


def test_capacity_change_reaches_every_node_quantised():
    sim = probe_mesh(10, seed=13, loss=0.05)
    origin = sim.nodes[3]
    order = sim.set_models(3, BUSY)
    start = sim.now
    assert sim.run_until_true(
        lambda: all(sim.knows(o, origin, order) for o in sim.up_nodes() if o is not origin), 2000, 20), \
        "the change did not reach every node within 2 s (anti-entropy alone takes 5 s)"
    assert sim.now - start <= 2000
    published = LoadQuantiser().quantise(BUSY)  # 1 free is exact; 3 waiting is published as 1
    assert published[0].busy == 7 and published[0].waiting == 1
    for o in sim.up_nodes():
        if o is not origin:
            assert o.membership.records[origin.node_id].summary.payload.models == published


def test_no_false_death_over_a_simulated_hour_at_5_percent_loss():
    sim = probe_mesh(20, seed=14, loss=0.05)
    seen = watch(sim)
    sim.run_for(3_600_000)
    assert not [s for s in seen if s[2] is Liveness.DEAD], "a live node was declared dead"
    # Issue 16: <= 0.01 false suspicions per node-hour (20 node-hours here: 0.2 expected).
    assert len([s for s in seen if s[2] is Liveness.SUSPECT]) <= 2
    probes = sum(n.probe.detector.counters["probes"] for n in sim.nodes)
    assert probes >= 20 * 3600 * 1.5, "the nodes stopped probing"  # ~2 per node per second


def test_forged_claim_is_dropped_and_counted_and_each_claim_is_verified_once():
    sim = probe_mesh(5, seed=15)
    observer, target, claimer, sender = sim.nodes[0], sim.nodes[1], sim.nodes[2], sim.nodes[3]
    order = observer.membership.records[target.node_id].order
    forged = Claim(target.node_id, order, claimer.node_id, b"\0" * 64)
    gossip = Gossip(observer.membership.protocol, SIM_MESH_ID, (forged,))
    verified = observer.policy.signature_verifications
    observer.probe.receive(sender.node_id, sender.address, gossip)
    assert observer.probe.counters["claims_forged"] == 1
    assert observer.membership.counters.drops["bad_signature"] == 1
    assert observer.probe.detector.state(target.node_id) == "alive"
    assert observer.policy.signature_verifications == verified + 1
    # The same claim, signed by the claimer's key: accepted, verified once however often it comes.
    data = claim_signing_input(SIM_MESH_ID, target.node_id, order, claimer.node_id)
    genuine = Claim(target.node_id, order, claimer.node_id, claimer.signer.sign(data))
    for _ in range(3):
        observer.probe.receive(sender.node_id, sender.address,
                               Gossip(observer.membership.protocol, SIM_MESH_ID, (genuine,)))
    assert observer.probe.detector.state(target.node_id) == "suspect"
    assert observer.policy.signature_verifications == verified + 2
    assert observer.probe.counters["claims_seen"] == 2


def test_each_new_summary_version_is_verified_once():
    sim = probe_mesh(10, seed=16, loss=0.05)
    for step in range(20):
        sim.set_load(step % 10, (ModelCapacity("model-x", "llamacpp", "chat", 8, step % 9, 0, 4096, 1, 1, "fp"),))
        sim.run_for(300)
    sim.run_for(3000)
    for node in sim.nodes:
        m = node.membership
        c = node.probe.counters
        assert node.policy.signature_verifications == (m.counters.summaries_accepted + c["claims_verified"]
                                                       + c["loads_verified"]), node.name
        assert c["loads_verified"] == c["loads_accepted"], node.name  # each record version once
    assert sum(n.probe.counters["loads_published"] for n in sim.nodes) > 0, "no load change went out as a record"
    # A copy of a version already held (a late push, a second pull's answer) is not verified again.
    observer, holder, about = sim.nodes[0], sim.nodes[1], sim.nodes[2]
    copies = holder.membership.relay({about.node_id: (0, 0)}, holder.membership.protocol)
    assert copies and copies[0].summary.payload.order == observer.membership.records[about.node_id].order
    verified, replays = observer.policy.signature_verifications, observer.membership.counters.drops["replay"]
    observer.probe.receive(holder.node_id, holder.address, Push(holder.membership.protocol, SIM_MESH_ID, copies))
    assert observer.policy.signature_verifications == verified
    assert observer.membership.counters.drops["replay"] == replays + 1


def test_graceful_leave_is_seen_as_left_and_a_restarted_node_comes_back_alive():
    sim = probe_mesh(10, seed=17)
    sim.leave(2)
    assert sim.run_until_true(
        lambda: all(sim.view_of(o.index, 2) is Liveness.LEFT for o in sim.up_nodes()), 1500, 20), \
        "the leaving summary did not reach every node"
    sim.kill(5)
    assert sim.run_until_true(
        lambda: all(sim.view_of(o.index, 5) is Liveness.DEAD for o in sim.up_nodes()), 20_000, 100)
    sim.restart(5)
    generation = sim.nodes[5].generation
    assert sim.run_until_true(
        lambda: all(sim.view_of(o.index, 5) is Liveness.ALIVE for o in sim.up_nodes() if o.index != 5), 3000, 50), \
        "the restarted node was not taken back"
    assert all(o.membership.records[sim.nodes[5].node_id].order[0] == generation
               for o in sim.up_nodes() if o.index != 5)


def test_a_ping_req_pings_the_targets_own_address_never_the_one_it_names():
    """A relay pings the target at the address of its signed summary: a member cannot make a
    node connect to a host and port of its choosing (an attacker pass found 127.0.0.1:PORT,
    169.254.169.254:80 and a DNS name all dialled); an unknown target is dropped and counted."""
    sim = probe_mesh(4, seed=17)
    relay, requester, target = sim.nodes[0], sim.nodes[1], sim.nodes[2]
    protocol = relay.membership.protocol
    out = relay.probe.receive(requester.node_id, requester.address,
                              PingReq(protocol, SIM_MESH_ID, 7, target.node_id, "169.254.169.254:80"))
    pings = [to for to, msg in out if isinstance(msg, Ping)]
    assert pings == [relay.membership.records[target.node_id].summary.payload.mesh]
    assert "169.254.169.254:80" not in [to for to, _ in out]
    unknown = NodeId("a" * 16)  # the shape of a node id, no member's
    assert unknown not in relay.membership.records
    for who in (unknown, relay.node_id, requester.node_id):
        out = relay.probe.receive(requester.node_id, requester.address,
                                  PingReq(protocol, SIM_MESH_ID, 8, who, "127.0.0.1:9"))
        assert not [to for to, msg in out if isinstance(msg, Ping)], who
    assert relay.probe.counters["ping_req_unknown_target"] == 3


def test_gossip_messages_carry_up_to_gossip_bytes_of_news_while_probes_carry_piggyback_bytes():
    """At 1,000 nodes each node must send ~125 news a second 8 times each: the room of a
    gossip message (4 kB) is what keeps the queue short (docs/benchmarks-mesh.md)."""
    sim = probe_mesh(10, seed=3)
    probe = sim.nodes[0].probe
    settings = probe.settings
    assert settings.gossip_bytes > settings.piggyback_bytes
    for i in range(3 * settings.gossip_bytes // NEWS_BYTES):
        nid = sim_node_id(1000 + i)
        probe.queue.put(nid, News(nid, (1, 1)), NEWS_BYTES, (1, 1))
    probe._next_gossip = 0.0
    gossip = [msg for _, msg in probe.poll() if isinstance(msg, Gossip)]
    assert len(gossip) == settings.gossip_nodes
    for msg in gossip:
        assert settings.gossip_bytes - NEWS_BYTES < sum(item_size(i) for i in msg.news) <= settings.gossip_bytes
    piggyback = probe._items(sim.nodes[1].node_id)
    assert settings.piggyback_bytes - NEWS_BYTES < sum(item_size(i) for i in piggyback) <= settings.piggyback_bytes


def test_a_partition_heals_within_seconds_not_at_the_next_republication():
    """Each side declares the other dead; once healed, a ping of a member held dead carries the
    claim about it, the member refutes, and its news rides the ack (ProbeSettings.dead_probe_ms).
    Without that, nothing newer is published until ``republish_ms`` (60 s)."""
    sim = probe_mesh(6, seed=21)
    left, right = [0, 1, 2], [3, 4, 5]

    def across(want: Liveness) -> bool:
        return all(sim.view_of(a, b) is want and sim.view_of(b, a) is want for a in left for b in right)

    sim.partition([left, right])
    assert sim.run_until_true(lambda: across(Liveness.DEAD), 30_000, 100), "the halves did not declare each other dead"
    dead_probes = sum(n.probe.counters["dead_probes"] for n in sim.nodes)
    sim.heal()
    healed = sim.now
    assert sim.run_until_true(lambda: across(Liveness.ALIVE), 15_000, 100), "the halves did not find each other again"
    assert sim.now - healed < 15_000 < ProbeSettings().republish_ms
    assert sum(n.probe.counters["dead_probes"] for n in sim.nodes) > dead_probes
    assert sum(n.probe.counters["refutations"] for n in sim.nodes) >= 1


def test_a_claim_older_than_the_refutation_is_ignored_and_a_newer_one_is_refuted():
    """A claim made before its target refuted (a partitioned prober's, delivered after the
    heal; or a copy that travels on) reaches an observer after the refutation did. Taken at
    the newest version held, it made the observer suspect the target anew (the 50-process
    run: held dead for a minute; CI's partition test: a request refused 20 ms after the peer
    was alive again). The refutation says which seq it refuted (the ``refuted`` extension):
    a claim at or below it stays at its own, older version and is ignored, by observers and
    by the target alike. A claim about the refuted-to version is a new suspicion: taken, and
    refuted again (one publication per probe interval)."""
    sim = probe_mesh(5, seed=21)
    observer, member, claimer = sim.nodes[0], sim.nodes[1], sim.nodes[2]

    def claim_about(order) -> Claim:
        data = claim_signing_input(SIM_MESH_ID, member.node_id, order, claimer.node_id)
        return Claim(member.node_id, order, claimer.node_id, claimer.signer.sign(data))

    def carry(to, frm, claim) -> None:
        to.probe.receive(frm.node_id, frm.address, Gossip(to.membership.protocol, SIM_MESH_ID, (claim,)))

    order = member.publisher.last.payload.order
    old = claim_about(order)
    carry(member, claimer, old)
    assert member.probe.counters["refutations"] == 1
    refuted = member.publisher.last.payload
    assert refuted.order > order and refuted.extensions.get(REFUTED) >= order[1]
    assert sim.run_until_true(lambda: observer.membership.records[member.node_id].order == refuted.order, 2000, 20)
    ignored = observer.probe.detector.counters["claims_ignored"]
    carry(observer, claimer, old)  # the old claim reaches the observer after the refutation did
    assert observer.probe.detector.state(member.node_id) == "alive"
    assert observer.probe.detector.counters["claims_ignored"] == ignored + 1
    # A copy comes back to the member, long after its refutation's news stopped travelling,
    # on a ping from a member that held it dead ("Partitions heal") and may lack the
    # refutation: no new summary, but the answer carries the news of the current version.
    sim.run_for(5000)
    answers = member.probe.receive(observer.node_id, observer.address,
                                   Ping(member.membership.protocol, SIM_MESH_ID, 99, (old,)))
    assert member.probe.counters["refutations"] == 1 and member.probe.counters["refutations_resent"] == 1
    acks = [msg for _, msg in answers if isinstance(msg, Ack)]
    assert len(acks) == 1 and any(isinstance(item, News) and item.node_id == member.node_id
                                  and item.order >= refuted.order for item in acks[0].news), acks
    carry(member, observer, old)  # within the probe interval: nothing more
    assert member.probe.counters["refutations_resent"] == 1

    new = claim_about(refuted.order)  # a probe of the refuted-to version missed
    carry(observer, claimer, new)
    assert observer.probe.detector.state(member.node_id) == "suspect"
    carry(member, observer, new)
    carry(member, observer, new)  # twice at once: one publication
    assert member.probe.counters["refutations"] == 2
    assert member.publisher.last.payload.extensions.get(REFUTED) >= refuted.order[1]
    assert sim.run_until_true(lambda: observer.probe.detector.state(member.node_id) == "alive", 2000, 20), \
        "the observer still holds the member suspect"


def test_copies_of_a_forged_claim_about_a_node_never_make_it_refute():
    """A claim about this node that did not verify (a forged signature, an unknown signer)
    is remembered so that its copies are not verified again; those copies must not take the
    "refuted again" path either: only a verified claim makes a node publish (attack review
    of the probe channels: any member could make every node republish once per probe
    interval with a claim it never signed)."""
    sim = probe_mesh(5, seed=23)
    member, claimer = sim.nodes[1], sim.nodes[2]
    order = member.publisher.last.payload.order
    forged = Claim(member.node_id, order, claimer.node_id, b"\0" * 64)
    stranger = Claim(member.node_id, order, sim_node_id(99), b"\1" * 64)
    for _ in range(3):
        member.probe.receive(claimer.node_id, claimer.address,
                             Gossip(member.membership.protocol, SIM_MESH_ID, (forged, stranger)))
        sim.run_until(sim.now + D.probe_interval_ms + 1)
    assert member.probe.counters["claims_forged"] == 1  # verified once, its copies remembered
    assert member.probe.counters["claims_unknown_signer"] == 1
    assert member.probe.counters["refutations"] == 0


def test_a_pull_for_every_node_is_answered_within_one_channel_frame():
    """A pull's answers go back as frames of a channel, which a peer closes beyond
    MAX_PROBE_MESSAGE_BYTES (64 KiB, oversized); the push used to be filled up to
    max_message_bytes (4 MiB): at 120 nodes a 2 KB pull naming them all (any member may
    send one, 100 a second) was answered with a 77 KB push that no peer takes."""
    sim = probe_mesh(120, seed=5)
    asker, node = sim.nodes[0], sim.nodes[1]
    wants = {o.node_id: (0, 0) for o in sim.nodes}
    pull = encode_probe_message(Pull(node.membership.protocol, SIM_MESH_ID, wants))
    answers = node.probe.receive_bytes(asker.node_id, asker.address, pull)
    assert answers and all(to == asker.address for to, _ in answers)
    assert max(len(data) for _, data in answers) <= MAX_PROBE_MESSAGE_BYTES
    push = decode_any(answers[0][1], asker.membership.accepted, asker.membership.settings.max_message_bytes)
    assert isinstance(push, Push) and len(push.summaries) >= 60  # as many as fit: the rest on a later pull


def test_a_claim_about_a_version_the_node_never_published_is_refuted():
    """A member (anyone with the mesh id, in open trust) signed one claim about another node
    at a version far ahead of its own, (generation, seq + 10**6), and gossiped it: every
    observer took it at that version, the node's refutations (seq + 1 each) never reached it,
    and all held the node dead for good while it refuted forever. A claim is taken at most
    at the newest version held of its node: one newer than any it published is refuted too."""
    sim = probe_mesh(5, seed=21)
    member, claimer = sim.nodes[1], sim.nodes[2]
    g, seq = member.publisher.last.payload.order
    claims = []
    for order in ((g, seq + 10**6), (g + 1, 0)):  # ahead in seq, and a boot that never was
        data = claim_signing_input(SIM_MESH_ID, member.node_id, order, claimer.node_id)
        claims.append(Claim(member.node_id, order, claimer.node_id, claimer.signer.sign(data)))
    observers = [o for o in sim.nodes if o is not member and o is not claimer]
    for o in [*observers, member]:
        o.probe.receive(claimer.node_id, claimer.address, Gossip(o.membership.protocol, SIM_MESH_ID, tuple(claims)))
    assert all(o.probe.detector.state(member.node_id) == "suspect" for o in observers)
    assert member.probe.counters["refutations"] >= 1
    assert sim.run_until_true(lambda: all(o.probe.detector.state(member.node_id) == "alive" for o in observers),
                              5000, 50), "the node's refutation did not clear the claim"
    sim.run_until(sim.now + 20_000)
    assert all(sim.view_of(o.index, member.index) is Liveness.ALIVE for o in observers)


def test_a_burst_of_fresh_claims_about_a_node_is_refuted_by_one_summary_per_probe_interval():
    """A member may sign as many claims about another node as it likes (each at another
    version: a claim stands for the newest version held, so an old one is as good as a new
    one). Each verified one used to make the node publish a new summary at once, which every
    node then verifies: 100 claims in a burst, 100 summaries. Refutations within a probe
    interval of the last are coalesced into one at the interval's end."""
    sim = probe_mesh(5, seed=21)
    member, claimer = sim.nodes[1], sim.nodes[2]
    g, _ = member.publisher.last.payload.order
    claims = []
    for seq in range(100):
        data = claim_signing_input(SIM_MESH_ID, member.node_id, (g, seq), claimer.node_id)
        claims.append(Claim(member.node_id, (g, seq), claimer.node_id, claimer.signer.sign(data)))
    for claim in claims:
        member.probe.receive(claimer.node_id, claimer.address, Gossip(member.membership.protocol, SIM_MESH_ID, (claim,)))
    assert member.probe.counters["claims_verified"] == 100
    assert member.probe.counters["refutations"] == 1
    sim.run_until(sim.now + D.probe_interval_ms + 100)
    assert member.probe.counters["refutations"] == 2  # the rest, at once, one interval later
    refuted = member.publisher.last.payload.order
    assert sim.run_until_true(lambda: all(o.probe.detector.state(member.node_id) == "alive"
                                          for o in sim.nodes if o is not member), 5000, 50)
    assert member.probe.counters["refutations"] == 2 and member.publisher.last.payload.order == refuted


def test_a_structural_change_spreads_as_news_not_by_anti_entropy():
    """A new summary (a model added: structural, not a load record) goes out as news at once.
    After the start window (two anti-entropy intervals, when anti-entropy runs every probe
    interval: ProbeNode._racing) anti-entropy alone runs every ~5 s per node, so every node
    holding the change within 1.5 s was the news'."""
    sim = probe_mesh(10, seed=22)
    sim.run_for(2 * ProbeSettings().sync_interval_ms + 1000)
    origin = sim.nodes[5]
    added = (*BUSY, ModelCapacity("model-y", "llamacpp", "chat", 4, 0, 0, 4096, 1, 1, "fp-y"))
    order = sim.set_models(5, added)
    assert sim.run_until_true(
        lambda: all(sim.knows(o, origin, order) for o in sim.up_nodes() if o is not origin), 1500, 20), \
        "the new summary did not reach every node within 1.5 s"


def test_each_node_sends_each_item_at_least_six_times_below_a_hundred_nodes():
    """A node hears each item about as often as each holder sends it and misses every copy
    with a chance of about e ** -transmits: 4 transmissions (2 x ceil(log10(n + 1)) from 10 to
    99 nodes) let 2-4 of 245 observers of the 50-process run wait seconds for anti-entropy."""
    sim = probe_mesh(10, seed=23)
    assert sim.nodes[0].probe.queue.limit(10) == 6
    assert sim.nodes[0].probe.queue.limit(1000) == 8  # the product above the floor


def test_a_peer_alive_again_after_a_heal_is_not_suspected_again_by_what_the_partition_left():
    """B is cut off from A and C for 1.8 s (suspected, not yet dead), then plugged back; once
    B is alive again in A's view, A must not suspect it anew. Two things left by the
    partition did (CI: tests/mesh/test_partition.py, a request refused 20 ms after B was
    alive again): a probe of B started during the partition whose miss was reported after
    B's refutation arrived suspected the refuted-to version (seed 72 here), and C's claim
    made before the refutation, delivered after it, was taken at the newest version
    (seeds 10, 89, 103). 200 seeds, each heal at a random phase of the probe rounds."""
    again, outdated, back = [], 0, 0
    for seed in range(200):
        seen, healed, sim = _cut_and_heal(seed)
        alive_at = next((t for state, t in seen if state is Liveness.ALIVE and t >= healed), None)
        assert alive_at is not None or not any(state is Liveness.SUSPECT for state, _ in seen), seed
        back += alive_at is not None
        if alive_at is not None and any(state is Liveness.SUSPECT and t > alive_at for state, t in seen):
            again.append(seed)
        outdated += sum(n.probe.detector.counters["probes_outdated"] for n in sim.nodes)
    assert again == [], f"suspected again after the heal in seeds {again}"
    assert back >= 190 and outdated > 0  # the partition did suspect B, and an outdated probe was seen


def _cut_and_heal(seed: int) -> tuple[list[tuple[Liveness, float]], float, Simulator]:
    """Node 1 cut off from 0 and 2 for 1.8 s, healed, 6 s more: node 0's view of node 1 as
    (liveness, time) changes, the time of the heal, the simulator."""
    sim = Simulator(3, seed=seed, mode="probe")
    assert sim.run_until_true(sim.converged, 20_000, 100)
    sim.run_for(sim.rng.uniform(0, 1000))
    a, b = sim.nodes[0], sim.nodes[1]
    seen: list[tuple[Liveness, float]] = []
    sim.liveness_watchers.append(
        lambda node, origin, old, new: node is a and origin == b.node_id and seen.append((new, sim.now)))
    sim.partition([[0, 2], [1]])
    sim.run_for(1800)
    sim.heal()
    healed = sim.now
    sim.run_for(6000)
    return seen, healed, sim


def test_a_refuted_value_at_or_past_the_summary_seq_does_not_shield_its_publisher():
    """``refuted`` is the publisher's own word: a member that publishes one at or past its own
    seq would make every claim about it stale, and a crash of it would never be confirmed
    by others' claims. Only seqs below the summary's own count: a claim about the version
    held is always taken."""
    sim = probe_mesh(4, seed=31)
    observer, member, claimer = sim.nodes[0], sim.nodes[1], sim.nodes[2]
    member.publisher.refuted = 10**9
    member.probe.publish(force=True)
    held = member.publisher.last.payload
    assert held.extensions.get(REFUTED) == 10**9
    assert sim.run_until_true(lambda: observer.membership.records[member.node_id].order == held.order, 2000, 20)
    data = claim_signing_input(SIM_MESH_ID, member.node_id, held.order, claimer.node_id)
    claim = Claim(member.node_id, held.order, claimer.node_id, claimer.signer.sign(data))
    observer.probe.receive(claimer.node_id, claimer.address, Gossip(observer.membership.protocol, SIM_MESH_ID, (claim,)))
    assert observer.probe.detector.state(member.node_id) == "suspect"


def test_a_new_generation_publishes_no_refuted_value_of_the_old_one():
    """``refuted`` counts seqs within one generation; a new generation starts at seq 0, so the
    old value would make claims about its first summaries stale."""
    sim = probe_mesh(3, seed=33)
    member = sim.nodes[1]
    member.publisher.refute()
    member.probe.publish(force=True)
    before = member.publisher.last.payload
    assert before.extensions.get(REFUTED) is not None
    member.membership.required_generation = before.generation + 1
    member.probe.publish(force=True)
    after = member.publisher.last.payload
    assert after.generation == before.generation + 1 and after.extensions.get(REFUTED) is None
    member.publisher.refute()
    member.probe.publish(force=True)
    assert member.publisher.last.payload.extensions.get(REFUTED) == after.seq


def _extensions_at_the_limit() -> Extensions:
    """Extensions an agent publishes (prefixes, speeds, gangs, endpoints) within one byte of
    MAX_EXTENSION_BYTES, which Extensions.of (and MeshLink.publish_extension) accept: the
    caps of the published ones sum to more than the limit."""
    prefixes = Prefixes(tuple(ModelPrefixes(f"model-{m}", tuple(f"{m:02x}{d:014x}" for d in range(52)))
                              for m in range(4)))
    speeds = Speeds(tuple(ModelSpeed(f"model-{m:02d}", 1000, 100) for m in range(40)))
    gangs = Gangs(tuple(GangMember(f"model-{m:02d}-" + "g" * 40, "g", 0, 2, sim_node_id(0)) for m in range(16)))
    last = None
    for pad in range(1, MAX_MODEL_NAME_CHARS + 1):
        endpoints = Endpoints(tuple(ModelEndpoints(name, frozenset({"chat"})) for name in ("e" * pad, "f" * 100)))
        try:
            last = Extensions.of({PREFIXES: prefixes, SPEEDS: speeds, GANGS: gangs, ENDPOINTS: endpoints})
        except ValueError:
            break
    assert last is not None and len(canonical_bytes(last.encode())) > MAX_EXTENSION_BYTES - 2
    return last


def test_a_refutation_by_a_node_whose_extensions_fill_the_limit_is_published():
    """Found by the attacker pass: ``refuted`` is added to the extensions the agent publishes,
    which may already fill MAX_EXTENSION_BYTES (the caps of those it publishes sum to more):
    the refutation raised OversizedExtensions out of the probe core, and every later summary
    of the generation too (the node published nothing more and was declared dead). The
    summary is published without ``refuted`` (counted ``refuted_left_out``): a newer
    version still refutes, as before the extension."""
    sim = probe_mesh(3, seed=35)
    observer, member, claimer = sim.nodes[0], sim.nodes[1], sim.nodes[2]
    full = _extensions_at_the_limit()
    member.probe.pub.set_extensions(full)
    member.probe.publish(force=True)
    order = member.publisher.last.payload.order
    data = claim_signing_input(SIM_MESH_ID, member.node_id, order, claimer.node_id)
    claim = Claim(member.node_id, order, claimer.node_id, claimer.signer.sign(data))
    member.probe.receive(claimer.node_id, claimer.address, Gossip(member.membership.protocol, SIM_MESH_ID, (claim,)))
    assert member.probe.counters["refutations"] == 1
    refuting = member.publisher.last.payload
    assert refuting.order > order and refuting.extensions == full
    assert member.membership.counters.transport["refuted_left_out"] >= 1
    sim.run_for(3000)  # later summaries too
    assert sim.run_until_true(lambda: observer.membership.records[member.node_id].order >= refuting.order, 2000, 20)
    assert observer.probe.detector.state(member.node_id) == "alive"


def test_a_node_cut_off_alone_holds_no_live_member_suspect_long_after_the_heal():
    """Found by the attacker pass (also at 7338f91): a node cut off alone for 2.5 s suspects
    the members it probes meanwhile, and its claims' transmissions are all lost in the cut.
    After the heal no suspect hears of them, so none refuted: the node held them suspect
    until the suspicion's full timeout (19 s at 40 nodes, no confirmations), then dead, then
    pinged them as dead ("Partitions heal"): the mesh agreed again 12.5 s after the heal
    (median of 20 seeds; 20 s at worst), while its next probe of each comes round only every
    ~20 s (one member per probe interval). The dead probe pings a member held suspect with
    its claim too: 1.4 s (2.9 s at worst)."""
    slow = []
    for seed in range(5):  # 3 of the 5 before
        sim = Simulator(40, seed=seed, mode="probe")
        assert sim.run_until_true(sim.converged, 60_000, 100), seed
        sim.run_for(sim.rng.uniform(0, 1000))
        sim.partition([[seed], [i for i in range(40) if i != seed]])
        sim.run_for(2500)
        assert any(sim.view_of(seed, i) is Liveness.SUSPECT for i in range(40) if i != seed), seed
        sim.heal()
        if not sim.run_until_true(sim.converged, 8000, 100):
            slow.append(seed)
    assert slow == [], f"a live member held suspect or dead 8 s after the heal in seeds {slow}"


def test_a_refutation_that_would_tip_the_summary_over_its_limit_is_published_without_refuted():
    """Found by the attacker pass: the config's check bounds a summary's models, not the
    extensions beside them, so a summary may sit a few bytes under MAX_SUMMARY_BYTES; the
    ``refuted`` value tipped it over, the refutation was not published (counted
    ``summary_oversized``), and neither was any later summary of the generation, which all
    carry it: the node fell silent and was declared dead. The summary goes without
    ``refuted`` when only that does not fit (counted ``refuted_left_out``)."""
    sim = probe_mesh(3, seed=37)
    observer, member, claimer = sim.nodes[0], sim.nodes[1], sim.nodes[2]
    member.probe.pub.set_extensions(Extensions.of({PREFIXES: Prefixes((ModelPrefixes(
        "model-1", tuple(f"{d:016x}" for d in range(64))),))}))  # 1.2 kB, far under its limit
    member.probe.publish(force=True)
    last = member.publisher.last.payload
    assert not last.gpus
    room = MAX_SUMMARY_BYTES - len(encode_payload(last)) - 5  # 5 bytes short: refuted takes ~20
    models, n = list(last.models), 0
    while room > 0:
        n += 1
        grown = [*models, dataclasses.replace(last.models[0], name=f"pad-{n}-")]
        size = len(encode_payload(dataclasses.replace(last, models=tuple(grown))))
        extra = min(MAX_MODEL_NAME_CHARS - len(f"pad-{n}-"), MAX_SUMMARY_BYTES - 5 - size)
        models = [*models, dataclasses.replace(last.models[0], name=f"pad-{n}-" + "x" * max(0, extra))]
        room = MAX_SUMMARY_BYTES - 5 - len(encode_payload(dataclasses.replace(last, models=tuple(models))))
    sim.set_models(1, tuple(models))
    order = member.publisher.last.payload.order
    assert len(member.publisher.last.payload_bytes) >= MAX_SUMMARY_BYTES - 6
    data = claim_signing_input(SIM_MESH_ID, member.node_id, order, claimer.node_id)
    claim = Claim(member.node_id, order, claimer.node_id, claimer.signer.sign(data))
    member.probe.receive(claimer.node_id, claimer.address, Gossip(member.membership.protocol, SIM_MESH_ID, (claim,)))
    assert member.probe.counters["refutations"] == 1
    assert member.publisher.last.payload.order > order, "the refutation was not published"
    assert member.membership.counters.transport["refuted_left_out"] >= 1
    published = member.publisher.last.payload.order
    member.probe.publish(force=True)  # and later summaries of the generation
    assert member.publisher.last.payload.order > published
    assert sim.run_until_true(lambda: observer.membership.records[member.node_id].order > published, 2000, 20)
    assert observer.probe.detector.state(member.node_id) == "alive"


def test_an_unanswered_ping_is_reported_before_the_next_attempt_direct_and_relayed():
    """The shell drops its connection to an address whose ping went unanswered (a connection
    that lived through a partition sits in TCP's backoff after the heal: every ping on it
    missed; tests/mesh/test_partition_heal.py is the real case). The core says so
    (``on_unanswered``) for a probe's direct attempt, before the second is sent (else the
    second would be dropped with the old connection), and for a relay's ping."""
    sim = probe_mesh(3, seed=41)
    prober, relay, frozen = sim.nodes
    calls: list[tuple[str, float, int]] = []  # (address, ms since the probe's last ping, its pings)

    def seen(address: str) -> None:
        run = prober.probe._run
        if run is not None:
            calls.append((address, sim.now - run.pinged_at, len(run.ping_ids)))

    prober.probe.on_unanswered.append(seen)
    sim.freeze(2)
    # The prober is a relay for the other node too (its relay pings are reported as well):
    # its own attempts are reported at their deadline, before the next ping is written.
    def direct() -> list[tuple[str, int]]:
        return [(a, pings) for a, since, pings in calls if abs(since - D.probe_timeout_ms) < 1e-6]

    assert sim.run_until_true(lambda: len(direct()) >= 2, 5000, 10), calls
    assert direct()[:2] == [(frozen.address, 1), (frozen.address, 2)]

    relayed: list[tuple[str, float]] = []
    relay.probe.on_unanswered.append(lambda address: relayed.append((address, sim.now)))
    asked = sim.now
    sim._deliver(prober, relay, PingReq(relay.membership.protocol, SIM_MESH_ID, 7, frozen.node_id, frozen.address, ()))
    sim.run_for(D.probe_timeout_ms + 50)
    assert (frozen.address, asked + D.probe_timeout_ms) in relayed, (asked, relayed)
