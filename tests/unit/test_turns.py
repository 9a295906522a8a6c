"""The origin queue's serving order (viiwork.agent.serving.turns): priority, tenants in turn, FIFO.

Pure: items are plain integers, arrivals plain numbers. Examples first, then properties over
random sequences of arrivals, departures and services (hypothesis).
"""

from __future__ import annotations

from collections import Counter

from hypothesis import given, settings
from hypothesis import strategies as st

from viiwork.agent.serving.turns import RANK, Turns
from viiwork.mesh.extensions import Priority

HIGH, NORMAL, LOW = Priority.HIGH, Priority.NORMAL, Priority.LOW


def tenants_of(turns: Turns[int], tenant: dict[int, str]) -> str:
    return "".join(tenant[i] for i in turns.order())


def test_keys_off_is_plain_fifo_by_arrival() -> None:
    turns: Turns[int] = Turns()
    for i, arrived in enumerate([1.0, 2.0, 3.0]):
        turns.add(i, NORMAL, "", arrived)
    turns.add(3, NORMAL, "", 1.5)  # refused elsewhere first: its place by arrival
    assert turns.order() == [0, 3, 1, 2]


def test_a_higher_priority_comes_first_whatever_its_arrival() -> None:
    turns: Turns[int] = Turns()
    turns.add(0, LOW, "a", 1.0)
    turns.add(1, NORMAL, "a", 2.0)
    turns.add(2, HIGH, "b", 3.0)
    turns.add(3, LOW, "a", 0.5)
    assert turns.order() == [2, 1, 3, 0]
    assert turns.priority_of(2) is HIGH


def test_a_tenant_behind_anothers_burst_waits_one_turn_not_the_burst() -> None:
    turns: Turns[int] = Turns()
    tenant = {}
    for i in range(20):
        turns.add(i, NORMAL, "burst", float(i))
        tenant[i] = "B"
    turns.remove(0)  # the burst's first is served
    turns.add(100, NORMAL, "steady", 30.0)
    tenant[100] = "s"
    assert tenants_of(turns, tenant)[:3] == "BsB"


def test_two_tenants_with_many_waiters_alternate() -> None:
    turns: Turns[int] = Turns()
    tenant = {}
    for i in range(6):
        turns.add(i, NORMAL, "x", float(i))
        tenant[i] = "x"
    for i in range(6, 12):
        turns.add(i, NORMAL, "y", float(i))
        tenant[i] = "y"
    assert tenants_of(turns, tenant) == "xyxyxyxyxyxy"


def test_place_for_says_where_a_new_waiter_would_go_and_changes_nothing() -> None:
    turns: Turns[int] = Turns()
    turns.add(0, NORMAL, "a", 1.0)
    turns.add(1, NORMAL, "a", 2.0)
    before = turns.order()
    place = turns.place_for(NORMAL, "b", 3.0)
    assert turns.order() == before
    assert turns.place_of(0) < place < turns.place_of(1)  # b's first turn is a's first
    assert turns.place_for(HIGH, "c", 9.0) < turns.place_of(0)
    assert turns.place_for(LOW, "a", 0.0) > turns.place_of(1)


def test_a_tenant_with_nobody_waiting_is_forgotten() -> None:
    turns: Turns[int] = Turns()
    for i in range(5):
        turns.add(i, NORMAL, "a", float(i))
    for i in range(5):
        turns.remove(i)
    assert len(turns) == 0 and not turns._lines
    assert not turns.remove(0)


# --- properties -------------------------------------------------------------------------------

PRIORITIES = st.sampled_from([HIGH, NORMAL, LOW])
TENANTS = st.sampled_from(["a", "b", "c"])
# An operation: ("add", priority, tenant, arrival offset) or ("leave", index) or ("serve",).
OPS = st.lists(st.one_of(
    st.tuples(st.just("add"), PRIORITIES, TENANTS, st.integers(-3, 3)),
    st.tuples(st.just("leave"), st.integers(0, 50)),
    st.tuples(st.just("serve")),
), max_size=60)


def run(ops: list[tuple], single: bool = False) -> tuple[Turns[int], dict[int, tuple[Priority, str, float, int]]]:
    """Apply ``ops``; ``single``: every waiter normal and of one tenant (keys off)."""
    turns: Turns[int] = Turns()
    info: dict[int, tuple[Priority, str, float, int]] = {}
    n = 0
    for op in ops:
        if op[0] == "add":
            priority, tenant = (NORMAL, "") if single else (op[1], op[2])
            arrived = float(n + op[3])  # mostly in order; some arrived earlier (refused elsewhere)
            turns.add(n, priority, tenant, arrived)
            info[n] = (priority, tenant, arrived, n)
            n += 1
        elif op[0] == "leave" and len(turns):
            turns.remove(turns.order()[op[1] % len(turns)])
        elif op[0] == "serve" and len(turns):
            turns.remove(turns.order()[0])
    return turns, info


@settings(max_examples=150, deadline=None)
@given(OPS)
def test_one_priority_one_tenant_is_fifo_by_arrival(ops: list[tuple]) -> None:
    turns, info = run(ops, single=True)
    order = turns.order()
    assert order == sorted(order, key=lambda i: (info[i][2], info[i][3]))


@settings(max_examples=150, deadline=None)
@given(OPS)
def test_higher_priorities_first_and_fifo_within_a_priority_and_tenant(ops: list[tuple]) -> None:
    turns, info = run(ops)
    order = turns.order()
    ranks = [RANK[info[i][0]] for i in order]
    assert ranks == sorted(ranks)
    for priority in (HIGH, NORMAL, LOW):
        for tenant in ("a", "b", "c"):
            mine = [i for i in order if info[i][:2] == (priority, tenant)]
            assert mine == sorted(mine, key=lambda i: (info[i][2], info[i][3]))
    assert len(turns) == len(order) == len(set(order))
    # The order kept as it changes is the order of the places, and each item's place is its own.
    ranked = list(turns.ranked())
    assert [place for place, _ in ranked] == sorted(turns.place_of(i) for i in order)
    assert all(turns.place_of(item) == place for place, item in ranked)


@settings(max_examples=300, deadline=None)
@given(st.lists(st.one_of(st.tuples(st.just("add"), st.just(NORMAL), TENANTS, st.just(0)),
                          st.tuples(st.just("serve"))), max_size=80))
def test_while_a_tenant_waits_each_other_is_served_at_most_once_per_turn_plus_two(ops: list[tuple]) -> None:
    """Arrivals in order and services from the head only: between a waiter's entry and its
    service, no other tenant is served more than once per waiter of its own tenant ahead of
    it, plus two (the turn it entered in, and one the other tenant may hold from before: a
    tenant whose waiter entered one turn early keeps it). Plain FIFO breaks this at once: a
    tenant behind another's burst of N waits N."""
    turns: Turns[int] = Turns()
    tenant: dict[int, str] = {}
    entered: dict[int, tuple[int, int]] = {}  # item -> (services so far, its tenant's waiters ahead)
    served: list[int] = []
    for n, op in enumerate(ops):
        if op[0] == "add":
            ahead = sum(1 for i in turns.order() if tenant[i] == op[2])
            turns.add(n, NORMAL, op[2], float(n))
            tenant[n] = op[2]
            entered[n] = (len(served), ahead)
        elif len(turns):
            head = turns.order()[0]
            turns.remove(head)
            since, ahead = entered.pop(head)
            others = Counter(tenant[i] for i in served[since:] if tenant[i] != tenant[head])
            assert all(count <= ahead + 2 for count in others.values()), (others, ahead)
            served.append(head)
