"""The SWIM/Lifeguard detector (viiwork.mesh.detector), driven by a tiny in-test network with
a virtual clock, a set of crashed nodes and per-message loss drawn from a seeded rng."""

from __future__ import annotations

import math
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from viiwork.mesh.detector import (
    Alive,
    Dead,
    Detector,
    DetectorSettings,
    DetectorSettingsError,
    Refute,
    Suspected,
    false_suspicion_probability,
    suspicion_timeout_ms,
)
from viiwork.mesh.identity import NodeId

SELF = NodeId("self")
DEFAULTS = DetectorSettings()


class Net:
    """One detector (``SELF``) probing ``n - 1`` peers over a lossy network."""

    def __init__(self, n: int, loss: float = 0.0, seed: int = 1) -> None:
        self.now = 0.0
        self.loss = loss
        self.loss_rng = random.Random(seed + 1000)
        self.crashed: set[NodeId] = set()
        self.peers = [NodeId(f"n{i}") for i in range(1, n)]
        self.det = Detector(SELF, DEFAULTS, lambda: self.now, random.Random(seed))
        for peer in self.peers:
            self.det.add(peer, (1, 0))

    def delivered(self) -> bool:
        return self.loss_rng.random() >= self.loss

    def ping(self, target: NodeId, attempts: int) -> bool:
        # Each attempt is a ping and an ack; the next is sent only when one failed.
        return any(target not in self.crashed and self.delivered() and self.delivered()
                   for _ in range(attempts))

    def round(self) -> tuple[NodeId, Suspected | None]:
        """Run one whole probe cycle; returns its target and the suspicion it raised."""
        due = self.det.due()
        assert due is not None
        self.now = max(self.now, due)
        probe = self.det.next_probe()
        assert probe is not None
        ok = self.ping(probe.target, probe.attempts)
        self.now += probe.timeout_ms
        plan = self.det.direct_result(probe.probe_id, ok)
        if plan is None:
            return probe.target, None
        acks = nacks = 0
        for relay in plan.relays:
            if relay in self.crashed or not self.delivered():  # ping-req lost
                continue
            reached = self.ping(plan.target, DEFAULTS.relay_attempts)
            if self.delivered():  # the relay's answer
                acks += reached
                nacks += not reached
        self.now += plan.timeout_ms
        return probe.target, self.det.indirect_result(plan.probe_id, acks, nacks)


def test_crash_is_suspected_by_its_prober_after_a_direct_and_an_indirect_miss():
    net = Net(10)
    crashed = net.peers[4]
    net.crashed.add(crashed)
    for _ in range(9):  # round-robin: within one pass over the 9 peers
        net.now = net.det.due() or net.now
        probe = net.det.next_probe()
        assert probe is not None
        ok = net.ping(probe.target, probe.attempts)
        plan = net.det.direct_result(probe.probe_id, ok)
        if probe.target != crashed:
            assert plan is None
            continue
        assert plan is not None and plan.target == crashed
        assert len(set(plan.relays)) == DEFAULTS.indirect_checks
        assert crashed not in plan.relays and SELF not in plan.relays
        assert net.det.state(crashed) == "alive"
        event = net.det.indirect_result(plan.probe_id, 0, len(plan.relays))
        assert event == Suspected(crashed, (1, 0), by_self=True)
        assert net.det.state(crashed) == "suspect"
        assert net.det.suspected_at(crashed) == net.now
        assert net.det.counters["suspicions_raised"] == 1
        assert net.det.counters["probe_misses"] == 1
        return
    pytest.fail("the crashed peer was not probed within one pass")


def test_an_ack_through_a_relay_keeps_the_target_alive():
    net = Net(10)
    probe = net.det.next_probe()
    assert probe is not None
    plan = net.det.direct_result(probe.probe_id, False)
    assert plan is not None
    assert net.det.indirect_result(plan.probe_id, 1, 0) is None
    assert net.det.state(probe.target) == "alive"


def test_live_nodes_without_loss_are_never_suspected_over_10000_rounds():
    net = Net(10)
    probed: dict[NodeId, int] = {}
    for _ in range(10_000):
        target, event = net.round()
        assert event is None
        probed[target] = probed.get(target, 0) + 1
    assert all(net.det.state(p) == "alive" for p in net.peers)
    assert net.det.counters["probe_misses"] == 0 and net.det.health_score == 0
    assert max(probed.values()) - min(probed.values()) <= 1  # once per pass each


def test_false_suspicions_under_loss_match_the_documented_probability():
    # 30% loss makes false suspicions common enough to count; each one is refuted at once.
    net = Net(10, loss=0.3, seed=7)
    rounds, suspicions = 20_000, 0
    for i in range(rounds):
        target, event = net.round()
        if event is not None:
            suspicions += 1
            assert net.det.set_incarnation(target, (2, i)) == Alive(target, (2, i), True)
    expected = false_suspicion_probability(0.3, DEFAULTS) * rounds
    assert abs(suspicions - expected) < 5 * math.sqrt(expected)


def test_documented_false_suspicion_rate_at_5_percent_loss_meets_issue_16():
    per_probe = false_suspicion_probability(0.05, DEFAULTS)
    assert per_probe == pytest.approx(1.2037e-6, rel=1e-3)
    assert per_probe * 3600 * 1000 / DEFAULTS.probe_interval_ms <= 0.01


@pytest.mark.parametrize(("n", "confirmations", "expected"), [
    (10, 0, 12_000.0),
    (10, 1, 12_000 - 10_000 * math.log(2) / math.log(3)),
    (10, 2, 2_000.0),
    (10, 5, 2_000.0),
    (100, 0, 24_000.0),
    (100, 1, 24_000 - 20_000 * math.log(2) / math.log(3)),
    (1000, 0, 36_000.0),
    (1000, 9, 6_000.0),
    (3, 0, 2_000.0),  # fewer than k others could confirm: k = 0, the minimum at once
    (2, 0, 2_000.0),  # log10 scale floored at 1
], ids=["n10-c0", "n10-c1", "n10-c2", "n10-c5", "n100-c0", "n100-c1", "n1000-c0", "n1000-c9",
        "n3-k0", "n2-floor"])
def test_suspicion_timeout_formula(n, confirmations, expected):
    assert suspicion_timeout_ms(n, confirmations, DEFAULTS) == pytest.approx(expected, rel=1e-12)


def _detector(n_peers: int) -> tuple[Detector, list[float]]:
    now = [0.0]
    det = Detector(SELF, DEFAULTS, lambda: now[0], random.Random(3))
    for i in range(n_peers):
        det.add(NodeId(f"p{i}"), (1, 0))
    return det, now


@pytest.mark.parametrize(("n_peers", "suspectors", "timeout"), [
    (9, ["a"], 12_000.0),
    (9, ["a", "b"], 12_000 - 10_000 * math.log(2) / math.log(3)),
    (9, ["a", "b", "a", "c"], 2_000.0),
    (99, ["a"], 24_000.0),
    (99, ["a", "b", "c"], 4_000.0),
], ids=["10-none", "10-one", "10-two-distinct", "100-none", "100-two"])
def test_suspicion_expires_into_dead_at_its_timeout(n_peers, suspectors, timeout):
    det, now = _detector(n_peers)
    target = NodeId("p0")
    first = det.suspect(target, (1, 0), by=suspectors[0])
    assert first == Suspected(target, (1, 0), by_self=False)
    for by in suspectors[1:]:
        assert det.suspect(target, (1, 0), by=by) is None
    assert det.confirmations(target) == len(set(suspectors)) - 1
    assert det.tick(timeout - 0.001) == []
    assert det.state(target) == "suspect"
    assert det.tick(timeout) == [Dead(target, (1, 0))]
    assert det.state(target) == "dead" and det.tick(timeout * 10) == []


def test_a_higher_incarnation_refutes_a_suspicion():
    det, now = _detector(9)
    target = NodeId("p1")
    det.suspect(target, (1, 0), by="a")
    assert det.set_incarnation(target, (1, 0)) is None  # not newer
    assert det.state(target) == "suspect"
    assert det.set_incarnation(target, (1, 1)) == Alive(target, (1, 1), refuted=True)
    assert det.state(target) == "alive" and det.suspected_at(target) is None
    assert det.tick(1e9) == []
    assert det.counters["refutations"] == 1


def test_a_dead_member_stays_known_until_a_newer_incarnation_revives_it():
    det, now = _detector(9)
    target = NodeId("p1")
    det.suspect(target, (1, 0), by="a")
    assert det.tick(1e9) == [Dead(target, (1, 0))]
    assert det.suspect(target, (1, 0), by="b") is None  # dead stays dead
    assert det.set_incarnation(target, (2, 0)) == Alive(target, (2, 0), refuted=False)
    assert det.state(target) == "alive"
    det.remove(target)
    assert det.state(target) is None


def test_claims_below_the_known_incarnation_or_about_unknown_members_are_ignored():
    det, now = _detector(9)
    target = NodeId("p1")
    det.set_incarnation(target, (1, 5))
    assert det.suspect(target, (1, 4), by="a") is None
    assert det.suspect(NodeId("stranger"), (9, 9), by="a") is None
    assert det.suspect(target, (1, 5), by=target) is None  # nobody suspects itself
    assert det.state(target) == "alive"
    assert det.counters["claims_ignored"] == 3
    assert det.suspect(target, (1, 5), by="a") == Suspected(target, (1, 5), by_self=False)


def test_a_claim_about_self_gives_refute_and_raises_the_health_score():
    det, now = _detector(3)
    assert det.suspect(SELF, (1, 3), by="a") == Refute((1, 3))
    assert det.health_score == 1
    det.set_incarnation(SELF, (1, 4))  # the caller published a newer one
    assert det.suspect(SELF, (1, 3), by="b") is None  # already refuted
    assert det.health_score == 1


def test_local_health_scales_interval_and_timeouts_and_decays_on_acks():
    det, now = _detector(3)
    for _ in range(2):
        det.suspect(SELF, (1, 0), by="a")
    assert det.health_score == 2
    probe = det.next_probe()
    assert probe is not None and probe.timeout_ms == 3 * DEFAULTS.probe_timeout_ms
    assert det.relay_timeout_ms() == DEFAULTS.probe_timeout_ms  # a relay answers within the requester's window
    assert det.direct_result(probe.probe_id, True) is None  # an ack: 2 -> 1
    assert det.health_score == 1
    assert det.due() == 2 * DEFAULTS.probe_interval_ms
    now[0] = 2 * DEFAULTS.probe_interval_ms - 1
    assert det.next_probe() is None  # not yet
    now[0] += 1
    probe = det.next_probe()
    assert probe is not None and probe.timeout_ms == 2 * DEFAULTS.probe_timeout_ms
    plan = det.direct_result(probe.probe_id, False)
    assert plan is not None and plan.timeout_ms == 2 * DEFAULTS.indirect_timeout_ms
    assert len(plan.relays) == 2
    # Both relays silent (+2): our own network is the likely fault.
    assert det.indirect_result(plan.probe_id, 0, 0) is not None
    assert det.health_score == 3
    for _ in range(20):
        det.suspect(SELF, (1, 0), by="a")
    assert det.health_score == DEFAULTS.awareness_max_multiplier - 1


def test_a_silent_relay_found_suspect_gives_its_health_charge_back():
    det, now = _detector(5)
    probe = det.next_probe()
    assert probe is not None
    plan = det.direct_result(probe.probe_id, False)
    assert plan is not None and len(plan.relays) == 4
    crashed, *answering = plan.relays
    # Three relays nack, one stays silent (+1); the nacks vouch for this node's path.
    assert det.indirect_result(plan.probe_id, 0, 3, silent=[crashed]) is not None
    assert det.health_score == 1
    # The silent relay turns out to have crashed (another node's claim): its silence was its
    # own, not this node's path: the +1 it cost is given back, once.
    assert isinstance(det.suspect(crashed, (1, 0), by="other"), Suspected)
    assert det.health_score == 0 and det.counters["relay_refunds"] == 1
    det.suspect(crashed, (1, 0), by="third")
    assert det.health_score == 0
    # A silent relay acked later keeps its charge (the fault was on this node's side).
    now[0] += 10_000
    probe = det.next_probe()
    assert probe is not None
    plan = det.direct_result(probe.probe_id, False)
    assert plan is not None
    quiet = plan.relays[0]
    det.indirect_result(plan.probe_id, 1, 0, silent=[quiet])
    while True:  # probe until the quiet relay's own probe is acked
        now[0] += 10_000
        probe = det.next_probe()
        assert probe is not None
        det.direct_result(probe.probe_id, True)
        if probe.target == quiet:
            break
    det.suspect(quiet, (1, 0), by="other")
    assert det.counters["relay_refunds"] == 1


def test_an_unreported_probe_is_abandoned_after_its_budget():
    det, now = _detector(3)
    first = det.next_probe()
    assert first is not None
    now[0] = 2_000.0
    assert det.due() is None and det.next_probe() is None  # still in flight
    now[0] = 10_000.0
    second = det.next_probe()
    assert second is not None and second.probe_id != first.probe_id
    assert det.counters["probes_abandoned"] == 1
    assert det.direct_result(first.probe_id, True) is None
    assert det.counters["results_ignored"] == 1


@pytest.mark.parametrize("bad", [
    {"probe_interval_ms": 0}, {"probe_timeout_ms": -1.0}, {"direct_attempts": 0},
    {"indirect_checks": -1}, {"indirect_timeout_ms": 400.0}, {"suspicion_mult": math.nan},
    {"suspicion_max_timeout_mult": 0.5}, {"awareness_max_multiplier": 0},
], ids=lambda b: next(iter(b)))
def test_settings_out_of_range_name_the_field(bad):
    with pytest.raises(DetectorSettingsError, match=next(iter(bad))):
        DetectorSettings(**bad)


ops = st.lists(st.one_of(st.just(("join", 0)), st.just(("probe", 0)),
                         st.tuples(st.just("leave"), st.integers(0, 50))), max_size=200)


@settings(max_examples=150, deadline=None)
@given(ops, st.integers(0, 2**32))
def test_round_robin_probes_every_member_once_per_pass(sequence, seed):
    now = [0.0]
    det = Detector(SELF, DEFAULTS, lambda: now[0], random.Random(seed))
    members: list[NodeId] = []
    joined = 0
    pass_start: set[NodeId] = set()  # members when the current pass began
    left: set[NodeId] = set()  # members removed during the current pass
    probed: list[NodeId] = []  # targets in the current pass
    current_pass = None
    for op, arg in sequence:
        if op == "join":
            joined += 1
            members.append(NodeId(f"m{joined}"))
            det.add(members[-1], (1, 0))
        elif op == "leave" and members:
            gone = members.pop(arg % len(members))
            det.remove(gone)
            left.add(gone)
        elif op == "probe":
            now[0] += 10 * DEFAULTS.probe_interval_ms
            before = set(members)
            probe = det.next_probe()
            if probe is None:
                assert not members
                continue
            det.direct_result(probe.probe_id, True)
            if det.passes != current_pass:
                if current_pass is not None:  # the previous pass is over
                    assert set(probed) >= pass_start - left, "a member was skipped"
                current_pass, pass_start, left, probed = det.passes, before, set(), []
            assert probe.target not in probed, "a member was probed twice in one pass"
            assert probe.target in members
            probed.append(probe.target)


@pytest.mark.parametrize("n_peers", [5, 9, 100], ids=lambda n: f"{n}-peers")
def test_relays_are_distinct_alive_members_other_than_the_target(n_peers):
    det, now = _detector(n_peers)
    suspects = {NodeId(f"p{i}") for i in range(1, n_peers, 3)}
    for node_id in suspects:
        det.suspect(node_id, (1, 0), by="a")
    alive = {NodeId(f"p{i}") for i in range(n_peers)} - suspects
    for _ in range(30):
        now[0] = det.due() or now[0]
        probe = det.next_probe()
        assert probe is not None
        plan = det.direct_result(probe.probe_id, False)
        assert plan is not None
        others = alive - {probe.target}
        assert len(plan.relays) == min(DEFAULTS.indirect_checks, len(others))
        assert len(set(plan.relays)) == len(plan.relays) and set(plan.relays) <= others
        det.indirect_result(plan.probe_id, 1, 0)


def test_a_crashed_member_that_every_relay_nacks_costs_no_health_and_an_indirect_ack_lowers_it():
    """memberlist's rule (Lifeguard): a failed probe costs the missing nacks, not the miss
    itself, when relays were asked. A crashed member stays suspect for seconds and is probed
    on every pass; charging each such probe slowed the whole mesh's detection of the next
    crash (docs/benchmarks-mesh.md)."""
    det, now = _detector(6)
    for _ in range(3):
        det.suspect(SELF, (1, 0), by="a")
    assert det.health_score == 3
    for _ in range(3):
        now[0] += 60_000
        probe = det.next_probe()
        assert probe is not None
        plan = det.direct_result(probe.probe_id, False)
        assert plan is not None and plan.relays
        det.indirect_result(plan.probe_id, 0, len(plan.relays))
        assert det.health_score == 3  # every relay answered: the target is the fault
    now[0] += 60_000
    probe = det.next_probe()
    assert probe is not None
    plan = det.direct_result(probe.probe_id, False)
    assert plan is not None
    assert det.indirect_result(plan.probe_id, 1, 0) is None
    assert det.health_score == 2


def test_a_leaving_member_costs_no_health_when_it_goes_silent_and_is_no_relay():
    det, now = _detector(6)
    leaving = NodeId("p0")
    det.set_leaving(leaving, True)
    # Never a relay while it leaves (it is about to go silent).
    for _ in range(12):
        now[0] += 10_000
        probe = det.next_probe()
        assert probe is not None
        if probe.target == leaving:
            plan = det.direct_result(probe.probe_id, False)
            assert plan is not None and len(plan.relays) == 4
            # Its relays are silent too (it went away): no charge, but it is suspected.
            event = det.indirect_result(plan.probe_id, 0, 0, silent=plan.relays)
            assert isinstance(event, Suspected) and event.node_id == leaving
            assert det.health_score == 0 and det.counters["leaving_misses"] == 1
            break
        plan = det.direct_result(probe.probe_id, False)
        assert plan is not None and leaving not in plan.relays
        assert det.indirect_result(plan.probe_id, 1, 0) is None
    else:
        raise AssertionError("the leaving member was never probed")
    # A member that is not leaving: the same silence is charged (+4 silent relays).
    det.set_leaving(NodeId("p1"), False)
    while True:
        now[0] += 10_000
        probe = det.next_probe()
        assert probe is not None
        if probe.target == NodeId("p1"):
            break
        det.direct_result(probe.probe_id, True)
    plan = det.direct_result(probe.probe_id, False)
    assert plan is not None and len(plan.relays) == 4
    det.indirect_result(plan.probe_id, 0, 0, silent=plan.relays)
    assert det.health_score == 4


def test_a_leaving_member_that_comes_back_is_a_relay_again():
    det, now = _detector(2)
    back, other = NodeId("p0"), NodeId("p1")

    def relays_for_other() -> tuple[NodeId, ...]:
        while True:
            now[0] += 10_000
            probe = det.next_probe()
            assert probe is not None
            if probe.target == other:
                plan = det.direct_result(probe.probe_id, False)
                assert plan is not None
                det.indirect_result(plan.probe_id, min(1, len(plan.relays)), 0)  # acked through a relay
                return plan.relays
            det.direct_result(probe.probe_id, True)

    det.set_leaving(back, True)
    assert relays_for_other() == ()
    det.set_leaving(back, False)  # restarted: its new summary does not say leaving
    assert relays_for_other() == (back,)


@pytest.mark.parametrize("suspected_first", [False, True])
def test_a_probe_that_misses_after_a_newer_incarnation_was_heard_raises_no_suspicion(suspected_first):
    # A partition heals: the target's refutation (a newer summary) arrives while a probe of
    # it that started during the partition is still in flight; the probe's miss is older
    # than that proof of life and must not suspect the new incarnation (CI, test_partition).
    det, now = _detector(3)
    probe = det.next_probe()
    assert probe is not None
    if suspected_first:
        det.suspect(probe.target, (1, 0), by="a")
    plan = det.direct_result(probe.probe_id, False)
    assert plan is not None
    det.set_incarnation(probe.target, (1, 1))
    assert det.state(probe.target) == "alive"
    assert det.indirect_result(plan.probe_id, 0, len(plan.relays)) is None
    assert det.state(probe.target) == "alive"
    assert det.counters["probes_outdated"] == 1 and det.counters["suspicions_raised"] == 0
    # the next probe of it starts on (1, 1): its miss suspects (1, 1)
    det, now = _detector(1)
    det.set_incarnation(NodeId("p0"), (1, 1))
    probe = det.next_probe()
    assert probe is not None
    plan = det.direct_result(probe.probe_id, False)
    assert plan is not None
    det.set_incarnation(probe.target, (1, 1))  # not newer than the probe's start
    assert det.indirect_result(plan.probe_id, 0, 0) == Suspected(probe.target, (1, 1), by_self=True)
