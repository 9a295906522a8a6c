"""The protocol core at scale, in virtual time (viiwork.mesh.sim)."""

from __future__ import annotations

import dataclasses

import pytest

from viiwork.mesh.membership import GossipSettings, Liveness
from viiwork.mesh.sim import Simulator
from viiwork.mesh.summary import ModelCapacity

BUSY = (ModelCapacity("model-x", "llamacpp", "chat", 8, 7, 3, 4096, 2, 2, "fp-x"),)


def converge(sim: Simulator, timeout_ms: float = 20_000) -> float:
    start = sim.now
    assert sim.run_until_true(sim.converged, timeout_ms, 100), "the mesh did not converge"
    return sim.now - start


def change_reaches_everyone(sim: Simulator, origin: int, timeout_ms: float = 10_000) -> float:
    order = sim.set_models(origin, BUSY)
    start = sim.now
    ok = sim.run_until_true(
        lambda: all(sim.knows(o, sim.nodes[origin], order) for o in sim.up_nodes() if o.index != origin),
        timeout_ms, 50)
    assert ok, "the capacity change did not reach every node"
    for o in sim.up_nodes():
        if o.index != origin:
            payload = o.membership.records[sim.nodes[origin].node_id].summary.payload
            # Protocol 1 carries no fingerprints.
            expected = BUSY if payload.protocol >= 2 else tuple(dataclasses.replace(m, fingerprint=None) for m in BUSY)
            assert payload.models == expected
    return sim.now - start


@pytest.mark.parametrize("n,loss", [(10, 0.0), (10, 0.05), (100, 0.0), (100, 0.05)],
                         ids=["10-lossless", "10-loss5", "100-lossless", "100-loss5"])
def test_convergence_of_join_and_capacity_change(n, loss):
    sim = Simulator(n, seed=n, loss=loss)
    assert converge(sim) <= 5_000
    assert change_reaches_everyone(sim, n // 2) <= 3_000


@pytest.mark.parametrize("loss", [0.0, 0.05], ids=["lossless", "loss5"])
def test_killed_node_turns_suspect_then_dead_everywhere(loss):
    sim = Simulator(30, seed=3, loss=loss)
    converge(sim)
    sim.kill(7)
    victim = sim.nodes[7]
    suspect_ms = max(o.membership.suspect_ms for o in sim.up_nodes())
    assert sim.run_until_true(
        lambda: all(sim.view_of(o.index, 7) is not Liveness.ALIVE for o in sim.up_nodes()), suspect_ms + 2_000)
    assert sim.run_until_true(
        lambda: all(sim.view_of(o.index, 7) is Liveness.DEAD for o in sim.up_nodes()), 12_000)
    # Everyone else stays alive.
    assert all(sim.knows(a, b) for a in sim.up_nodes() for b in sim.up_nodes() if a is not b)
    assert victim.node_id not in [p.node_id for p in sim.nodes[0].membership.peers()
                                  if p.liveness is Liveness.ALIVE]


def test_graceful_leave_is_left_everywhere_within_a_few_rounds():
    sim = Simulator(30, seed=4)
    converge(sim)
    sim.leave(5)
    assert sim.run_until_true(
        lambda: all(sim.view_of(o.index, 5) is Liveness.LEFT for o in sim.up_nodes()), 3_000)


def test_stale_relay_does_not_resurrect_dead_peer():
    sim = Simulator(20, seed=5)
    converge(sim)
    resurrections = []
    x = sim.nodes[3]
    sim.liveness_watchers.append(
        lambda node, origin, old, new: resurrections.append(node.index)
        if origin == x.node_id and old is Liveness.DEAD else None)
    # A group that stops hearing news while x dies, then rejoins with its stale copies.
    sim.partition([[i for i in range(20) if i < 15], list(range(15, 20))])
    sim.run_for(300)
    sim.kill(3)
    sim.run_for(15_000)
    assert all(sim.view_of(o.index, 3) is Liveness.DEAD for o in sim.up_nodes())
    sim.heal()
    sim.run_for(10_000)
    assert all(sim.view_of(o.index, 3) is Liveness.DEAD for o in sim.up_nodes())
    assert resurrections == []


@pytest.mark.parametrize("wait_ms", [0, 15_000], ids=["before-detection", "after-dead"])
def test_restarted_node_is_accepted_at_once(wait_ms):
    sim = Simulator(20, seed=6)
    converge(sim)
    sim.kill(9)
    sim.run_for(wait_ms)
    sim.restart(9)
    node = sim.nodes[9]
    assert node.generation == 2
    order = node.publisher.last.payload.order
    assert order == (2, 1)
    assert sim.run_until_true(
        lambda: all(sim.knows(o, node, (2, 1)) for o in sim.up_nodes() if o is not node), 4_000)
    converge(sim, 4_000)


def test_restart_that_lost_its_generation_file_recovers():
    sim = Simulator(20, seed=7)
    converge(sim)
    sim.kill(4)
    sim.restart(4, lose_generation=True)
    node = sim.nodes[4]
    assert node.publisher.last.payload.order[0] == 1
    # Peers still hold its previous run at generation 1 with a higher seq; the node sees
    # that, moves past it and stores the new generation.
    assert sim.run_until_true(lambda: node.generation == 2, 3_000)
    assert sim.run_until_true(lambda: all(sim.knows(o, node, (2, 1)) for o in sim.up_nodes() if o is not node),
                              4_000)


def test_partition_heals():
    sim = Simulator(40, seed=8, loss=0.05)
    converge(sim)
    left, right = list(range(20)), list(range(20, 40))
    sim.partition([left, right])
    sim.run_for(15_000)
    assert sim.view_of(0, 30) is Liveness.DEAD and sim.view_of(30, 0) is Liveness.DEAD
    assert sim.view_of(0, 10) is Liveness.ALIVE
    sim.heal()
    assert converge(sim, 15_000) <= 10_000


def test_clock_skew_of_an_hour_changes_nothing():
    def scenario(skew):
        sim = Simulator(25, seed=9, loss=0.05, clock_skew_ms=skew)
        converge(sim)
        t_change = change_reaches_everyone(sim, 3)
        sim.kill(11)
        sim.run_for(12_000)
        views = [[(p.node_id, p.liveness, p.seq) for p in sorted(o.membership.peers(), key=lambda p: p.node_id)]
                 for o in sim.nodes]
        return t_change, views

    plain = scenario(0.0)
    skewed = scenario(3_600_000.0)
    assert plain == skewed
    assert any(abs(n.offset_ms) > 1_800_000 for n in Simulator(25, seed=9, clock_skew_ms=3_600_000.0).nodes)


def test_previous_protocol_version_interoperates_during_an_upgrade():
    protocols = [1] * 6 + [2] * 14
    sim = Simulator(20, seed=10, protocols=protocols)
    converge(sim)
    change_reaches_everyone(sim, 2)  # an old node's change reaches the new ones
    change_reaches_everyone(sim, 15)  # and a new node's reaches the old ones
    assert all(n.publisher.last.payload.protocol == 1 for n in sim.nodes)
    # Upgrade the old nodes one by one: once none is left, everyone speaks 2 again.
    for i in range(6):
        sim.nodes[i].protocol = 2
        sim.kill(i)
        sim.restart(i)
        converge(sim, 8_000)
    assert sim.run_until_true(lambda: all(n.publisher.last.payload.protocol == 2 for n in sim.nodes), 5_000)
    converge(sim)


def test_wire_mode_with_real_crypto_converges_and_counts_verifications():
    sim = Simulator(8, seed=11, wire=True, crypto="real")
    converge(sim)
    change_reaches_everyone(sim, 1)
    totals = sim.totals()
    assert totals["signature_verifications"] > 0 and totals["chain_verifications"] >= 8 * 7
    assert all(not n.membership.counters.drops.get("bad_signature") for n in sim.nodes)


def test_no_live_node_is_suspected_under_loss_at_100_nodes():
    sim = Simulator(100, seed=12, loss=0.05, settings=GossipSettings())
    converge(sim)
    sim.run_for(2_000)
    suspicions = []
    sim.liveness_watchers.append(lambda node, origin, old, new: suspicions.append(new))
    sim.run_for(6_000)
    assert suspicions == []
