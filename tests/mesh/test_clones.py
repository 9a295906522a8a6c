"""One node per identity (mesh/clones.py): two running boots of one node id are a conflict,
a restart or an address change never is. The pure rule, then the protocol core with real keys
and certificates and an injected clock (docs/mesh.md, "One node per identity")."""

from __future__ import annotations

import random
from typing import TYPE_CHECKING

import pytest

from support.mesh_crypto import ManualClock, TestCA, chat_model, exchange
from viiwork.mesh.boot import Boot
from viiwork.mesh.clones import BootTracker
from viiwork.mesh.membership import GossipSettings, Liveness, Membership
from viiwork.mesh.messages import Push, RelayedSummary
from viiwork.mesh.publisher import LocalPublisher

if TYPE_CHECKING:
    from support.mesh_crypto import TestNode

DEAD_MS = 1500
SETTINGS = GossipSettings(gossip_interval_ms=100, suspect_after_ms=600, dead_after_ms=DEAD_MS, scale_with_size=False)
LOW, HIGH = "1" * 16, "f" * 16  # boot nonces: HIGH is the one that leaves


def boot_core(node: TestNode, ca: TestCA, clock: ManualClock, nonce: str, generation: int = 1,
              mesh: str | None = None, seed: int = 0) -> tuple[Membership, LocalPublisher]:
    """A membership core and publisher for one boot (``nonce``) of ``node``, published once."""
    m = Membership(node.node_id, ca.mesh_id, node.signer.certificate_der, ca.trust(), SETTINGS, clock, clock.wall,
                   random.Random(seed))
    pub = LocalPublisher(m, node.signer, node.name, api=f"{node.name}:8086", mesh=mesh or f"{node.name}:8087",
                         version="test", boot=Boot(generation, nonce), heartbeat_ms=100)
    pub.set_local([chat_model()])
    pub.maybe_publish()
    return m, pub


def round_of(clock: ManualClock, pairs: list[tuple[Membership, LocalPublisher]], hub: Membership) -> None:
    """One 100 ms gossip round: everyone publishes, ticks, and exchanges with ``hub``."""
    clock.advance(100)
    for _, pub in pairs:
        pub.maybe_publish()
    hub.tick()
    for m, _ in pairs:
        m.tick()
        if m is not hub:
            exchange(m, hub)


# --- the pure rule ------------------------------------------------------------------------------


@pytest.mark.parametrize(("spans", "conflict"), [
    pytest.param({"a": (0, 5000), "b": (5100, 9000)}, False, id="restart: one ends before the other begins"),
    pytest.param({"a": (0, 5000), "b": (4000, 9000)}, False, id="overlap shorter than dead_after"),
    pytest.param({"a": (0, 9000), "b": (1000, 9000)}, True, id="both publishing for longer than dead_after"),
    pytest.param({"a": (0, 7000), "b": (1000, 9000)}, False, id="one silent for dead_after: over"),
])
def test_two_boots_conflict_only_while_both_publish_for_dead_after(spans, conflict):
    tracker = BootTracker()
    for boot, (first, last) in spans.items():
        tracker.see(boot, f"{boot}:8087", (1, 1), first)
        tracker.see(boot, f"{boot}:8087", (1, 2), last)
    found = tracker.conflict("n", now=9000, dead_ms=DEAD_MS)
    assert (found is not None) is conflict
    if found is not None:
        assert found.leaves == "b" and {found.address, found.other_address} == {"a:8087", "b:8087"}


# --- the protocol core --------------------------------------------------------------------------


def test_clone_on_another_address_is_a_conflict_the_higher_boot_leaves_peers_stop_routing():
    """A state dir copied to a second machine: both boots report it once (the higher one is
    told it leaves), the peer marks the id ``conflict`` (steadily: no flip-flop) while both
    run and takes it back once the clone is gone."""
    ca, clock = TestCA(), ManualClock()
    a, c = ca.node("a"), ca.node("c")
    low = boot_core(a, ca, clock, LOW, mesh="10.0.0.1:8087")
    mc, pc = boot_core(c, ca, clock, "c" * 16, seed=2)
    for _ in range(3):
        round_of(clock, [low, (mc, pc)], mc)
    high = boot_core(a, ca, clock, HIGH, mesh="10.0.0.2:8087", seed=1)  # the copy starts later
    reports: dict[str, list] = {LOW: [], HIGH: []}
    low[0].on_identity_conflict.append(reports[LOW].append)
    high[0].on_identity_conflict.append(reports[HIGH].append)
    seen_by_c = []
    for _ in range(40):  # 4 s: both run
        round_of(clock, [low, high, (mc, pc)], mc)
        seen_by_c.append(next(p for p in mc.peers() if p.node_id == a.node_id).liveness)
    assert [r.address for r in reports[LOW]] == ["10.0.0.2:8087"]
    assert [r.address for r in reports[HIGH]] == ["10.0.0.1:8087"]
    assert reports[LOW][0].leaves == reports[HIGH][0].leaves == HIGH
    first = seen_by_c.index(Liveness.CONFLICT)
    assert first <= 25 and set(seen_by_c[first:]) == {Liveness.CONFLICT}, seen_by_c
    view = next(p for p in mc.peers() if p.node_id == a.node_id)
    assert view.conflict is not None and set(view.conflict.doc()["boots"].values()) == {"10.0.0.1:8087",
                                                                                       "10.0.0.2:8087"}
    # The higher boot leaves (stops publishing): over for everyone within dead_after.
    for _ in range(2 * DEAD_MS // 100):
        round_of(clock, [low, (mc, pc)], mc)
    assert next(p for p in mc.peers() if p.node_id == a.node_id).liveness is Liveness.ALIVE
    assert low[0].identity_conflict is None and len(reports[LOW]) == 1


@pytest.mark.parametrize(("generation", "mesh"), [
    pytest.param(2, "a:8087", id="restart on the same address"),
    pytest.param(2, "10.9.9.9:8087", id="address change"),
    pytest.param(1, "a:8087", id="restart with the boot file lost"),
])
def test_restart_or_address_change_is_never_a_conflict(generation, mesh):
    ca, clock = TestCA(), ManualClock()
    a, c = ca.node("a"), ca.node("c")
    old = boot_core(a, ca, clock, HIGH)
    mc, pc = boot_core(c, ca, clock, "c" * 16, seed=2)
    for _ in range(30):
        round_of(clock, [old, (mc, pc)], mc)
    stash = [old[1].maybe_publish(force=True) for _ in range(30)]  # kept by a misbehaving member
    clock.advance(300)  # the restart: the old boot is gone, the new one begins
    new = boot_core(a, ca, clock, LOW, generation=generation, mesh=mesh, seed=3)
    reports: list = []
    new[0].on_identity_conflict.append(reports.append)
    for i in range(4 * DEAD_MS // 100):
        round_of(clock, [new, (mc, pc)], mc)
        view = next(p for p in mc.peers() if p.node_id == a.node_id)
        assert view.liveness is not Liveness.CONFLICT
        # The stashed summaries of the previous boot replayed as fresh (age 0) change nothing.
        new[0].handle_push(c.node_id, Push(3, mc.mesh_id, (RelayedSummary(stash[i % len(stash)], 0),)))
    assert not reports and new[0].identity_conflict is None
    assert view.mesh == mesh and view.liveness is Liveness.ALIVE


# --- what a mesh member can do to the rule (docs/security.md, "Mesh members") ----------------


@pytest.mark.parametrize("age_ms", [0, SETTINGS.suspect_after_ms, DEAD_MS - 100, 10 * DEAD_MS])
def test_a_member_relaying_a_restarted_boot_with_a_forged_age_makes_no_conflict(age_ms):
    """The relayed ``age_ms`` is not signed: a member (c) relays the first summary of the
    honestly restarted node's new boot as if published long ago. The peer's span of the new
    boot starts when it received it, so it never overlaps the old boot's: never ``conflict``."""
    ca, clock = TestCA(), ManualClock()
    a, c, p = ca.node("a"), ca.node("c"), ca.node("p")
    old = boot_core(a, ca, clock, HIGH)
    mp, _ = boot_core(p, ca, clock, "p" * 16, seed=2)
    for _ in range(30):
        round_of(clock, [old], mp)
    clock.advance(300)  # the restart
    new = boot_core(a, ca, clock, LOW, generation=2, seed=3)
    assert new[0].self_summary is not None
    mp.handle_push(c.node_id, Push(3, mp.mesh_id, (RelayedSummary(new[0].self_summary, age_ms),)))
    for _ in range(3 * DEAD_MS // 100):
        round_of(clock, [new], mp)
        view = next(v for v in mp.peers() if v.node_id == a.node_id)
        assert view.liveness is Liveness.ALIVE and view.conflict is None
    assert mp.counters.transport["peer_identity_conflicts"] == 0


def test_a_member_replaying_the_previous_run_with_forged_ages_cannot_make_the_node_leave():
    """The boot file was lost: the restarted node (the higher boot: the one that would leave)
    publishes below its previous run. A member holding that run's summaries pushes two of them
    at once, the second aged to look published since before the new boot began (stretching
    the span the first one opened), then keeps replaying them. The node moves past them and
    neither reports a clone nor leaves."""
    ca, clock = TestCA(), ManualClock()
    a, c = ca.node("a"), ca.node("c")
    old = boot_core(a, ca, clock, LOW)
    stash = [old[1].maybe_publish(force=True) for _ in range(60)]
    clock.advance(300)  # the restart, boot file lost: generation 1 again, seq from 1
    new, pub = boot_core(a, ca, clock, HIGH, seed=3)
    reports: list = []
    new.on_identity_conflict.append(reports.append)
    for _ in range(20):  # 2 s alone, longer than dead_after
        clock.advance(100)
        pub.maybe_publish()
        new.tick()
    forged = (RelayedSummary(stash[40], 0), RelayedSummary(stash[50], 10 * DEAD_MS))
    new.handle_push(c.node_id, Push(3, new.mesh_id, forged))
    for i in range(3 * DEAD_MS // 100):
        clock.advance(100)
        pub.maybe_publish()
        new.tick()
        new.handle_push(c.node_id, Push(3, new.mesh_id, (RelayedSummary(stash[i % len(stash)], 10 * DEAD_MS),
                                                          RelayedSummary(stash[-1], 0))))
        assert new.identity_conflict is None
    assert not reports and new.counters.transport["identity_conflicts"] == 0
    assert pub.generation == 2  # it did move past its previous run
