"""Which peer a node fetches a newer revocation list from, and how often (agent/peering/revocation_sync.py,
``Refetches``): one fetch at a time, the highest version first, and a peer that publishes a
version it cannot deliver (a liar, or one that cannot be reached) backed off so that it costs at
most one bounded fetch per REFETCH_MAX_S."""

from __future__ import annotations

import random

from viiwork.agent.peering.revocation_sync import REFETCH_MAX_S, REFETCH_MIN_S, Refetches
from viiwork.mesh.identity import NodeId

A, B, C = NodeId("a" * 16), NodeId("b" * 16), NodeId("c" * 16)


class Clock:
    def __init__(self) -> None:
        self.s = 1000.0

    def __call__(self) -> float:
        return self.s


def test_the_highest_version_above_the_held_one_one_fetch_at_a_time() -> None:
    r = Refetches(Clock(), random.Random(1))
    assert r.pick([(A, 3), (B, 3)], held=3) is None  # nobody ahead
    assert r.pick([(A, 4), (B, 7), (C, 2)], held=3) == (B, 7)
    assert r.pick([(A, 4), (B, 7)], held=3) is None  # B's fetch still runs
    r.done(B, caught_up=True)
    assert r.pick([(A, 4), (B, 7)], held=7) is None
    assert r.pick([(A, 9), (B, 7)], held=7) == (A, 9)


def test_a_peer_that_does_not_deliver_is_backed_off_then_forgiven() -> None:
    clock = Clock()
    r = Refetches(clock, random.Random(1))
    assert r.pick([(A, 9), (B, 5)], held=3) == (A, 9)
    r.done(A, caught_up=False)
    # A waits; B, behind A but ahead of this node, is fetched from meanwhile.
    assert r.pick([(A, 9), (B, 5)], held=3) == (B, 5)
    r.done(B, caught_up=True)
    assert r.pick([(A, 9)], held=5) is None
    clock.s += REFETCH_MIN_S
    assert r.pick([(A, 9)], held=5) == (A, 9)
    r.done(A, caught_up=False)
    clock.s += REFETCH_MIN_S  # the second wait is twice the first
    assert r.pick([(A, 9)], held=5) is None
    clock.s += REFETCH_MIN_S
    assert r.pick([(A, 9)], held=5) == (A, 9)
    r.done(A, caught_up=True)  # it delivered: no wait next time
    assert r.pick([(A, 10)], held=9) == (A, 10)


def test_a_lying_peer_costs_at_most_one_fetch_per_refetch_max() -> None:
    clock = Clock()
    r = Refetches(clock, random.Random(1))
    fetches = 0
    for _ in range(3600):  # an hour of checks, one a second; the peer never delivers version 99
        if r.pick([(A, 99)], held=1) is not None:
            fetches += 1
            r.done(A, caught_up=False)
        clock.s += 1.0
    doublings = 6  # 2, 4, 8, 16, 32, then REFETCH_MAX_S
    assert fetches <= 3600 / REFETCH_MAX_S + doublings, fetches
    assert fetches >= 3600 / REFETCH_MAX_S - 1  # and it is still tried: it may have told the truth


def test_a_peer_gone_from_the_table_is_forgotten() -> None:
    clock = Clock()
    r = Refetches(clock, random.Random(1))
    r.pick([(A, 9)], held=1)
    r.done(A, caught_up=False)
    r.forget([B])
    assert r.pick([(A, 9)], held=1) == (A, 9)  # back as a new peer: no wait carried over
