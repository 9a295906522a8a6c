"""Slot offers, the pure core (viiwork.agent.peering.offers): who gets a freed slot, holds, messages."""

from __future__ import annotations

import pytest

from viiwork.agent.peering.offers import (
    HOLD_MS,
    MAX_OLDEST_MS,
    STRIKE_FIRST_MS,
    STRIKE_FORGET_MS,
    STRIKE_LOG_MS,
    STRIKE_MAX_MS,
    Holds,
    Offer,
    Want,
    WantBook,
    WantError,
    parse_offer,
)
from viiwork.mesh.extensions import Priority
from viiwork.mesh.identity import NodeId

A, B, C = NodeId("a" * 16), NodeId("b" * 16), NodeId("c" * 16)


class Clock:
    def __init__(self) -> None:
        self.ms = 10_000.0

    def __call__(self) -> float:
        return self.ms


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
def book(clock: Clock) -> WantBook:
    return WantBook(clock=clock, ttl_ms=15_000.0)


# --- who gets the slot ------------------------------------------------------------------------


def test_nobody_waiting_anywhere_keeps_the_slot_here(book: WantBook) -> None:
    assert book.pick("m", None) is None
    assert book.pick("m", 500.0) is None


def test_the_oldest_remote_waiter_gets_the_slot(book: WantBook) -> None:
    book.note(A, Want("m", 2, 300.0))
    book.note(B, Want("m", 1, 900.0))
    book.note(C, Want("m", 5, 100.0))
    assert book.pick("m", None) == B


def test_an_older_waiter_here_keeps_the_slot_here(book: WantBook) -> None:
    book.note(A, Want("m", 1, 300.0))
    assert book.pick("m", 301.0) is None
    assert book.pick("m", 299.0) == A


def test_a_tie_goes_to_this_node(book: WantBook) -> None:
    book.note(A, Want("m", 1, 300.0))
    assert book.pick("m", 300.0) is None


def test_ages_grow_with_the_clock_from_when_the_want_was_heard(book: WantBook, clock: Clock) -> None:
    book.note(A, Want("m", 1, 100.0))  # A's oldest arrived at 9900
    clock.ms += 1000.0
    # Here the oldest is 1050 ms old (arrived at 9950): A's, 1100 ms old, is older.
    assert book.pick("m", 1050.0) == A
    assert book.pick("m", 1150.0) is None


def test_models_are_separate(book: WantBook) -> None:
    book.note(A, Want("m", 1, 300.0))
    assert book.pick("other", None) is None
    assert book.waiting() == {"m": 1}


def test_waiting_zero_removes_the_origin(book: WantBook) -> None:
    book.note(A, Want("m", 3, 300.0))
    book.note(A, Want("m", 0, 0.0))
    assert book.pick("m", None) is None
    assert book.waiting() == {}


def test_a_newer_want_replaces_the_older(book: WantBook) -> None:
    book.note(A, Want("m", 3, 900.0))
    book.note(B, Want("m", 1, 500.0))
    book.note(A, Want("m", 2, 100.0))  # A's oldest was served; its next is younger than B's
    assert book.pick("m", None) == B
    assert book.waiting() == {"m": 3}


def test_offered_forgets_the_origin_until_it_announces_again(book: WantBook) -> None:
    book.note(A, Want("m", 2, 900.0))
    book.note(B, Want("m", 1, 500.0))
    book.offered(A, "m")
    assert book.pick("m", None) == B
    book.offered(B, "m")
    assert book.pick("m", None) is None
    book.note(A, Want("m", 1, 100.0))
    assert book.pick("m", None) == A


def test_ineligible_peers_are_skipped_not_forgotten(book: WantBook) -> None:
    book.note(A, Want("m", 1, 900.0))
    book.note(B, Want("m", 1, 500.0))
    assert book.pick("m", None, eligible=lambda p: p != A) == B
    assert book.pick("m", None) == A


def test_entries_expire_after_the_ttl(book: WantBook, clock: Clock) -> None:
    book.note(A, Want("m", 1, 0.0))
    clock.ms += 15_000.0
    assert book.pick("m", None) == A
    clock.ms += 1.0
    assert book.pick("m", None) is None
    assert book.waiting() == {}


def test_forget_drops_a_peer_everywhere(book: WantBook) -> None:
    book.note(A, Want("m", 1, 10.0))
    book.note(A, Want("n", 1, 10.0))
    book.forget(A)
    assert book.pick("m", None) is None and book.pick("n", None) is None



# --- what a member cannot make up: a want's age, offers it takes and never claims ------------------


def test_a_wants_age_counts_as_at_most_the_cap(clock: Clock) -> None:
    """A member says its oldest waiter is a day old: it counts as ``max_age_ms`` (this node's
    queue timeout), so it beats a waiter here only as an honest one that old would, and an
    honest remote waiter just under the cap, heard earlier, is not outranked."""
    book = WantBook(clock=clock, ttl_ms=25_000.0, max_age_ms=20_000.0)
    assert WantBook(clock=clock, ttl_ms=25_000.0).max_age_ms == 25_000.0  # default: the ttl
    book.note(A, Want("m", 1, 19_999.0))
    clock.ms += 2.0  # A's is 20 001 ms old now
    book.note(B, Want("m", 1, MAX_OLDEST_MS))  # counts as 20 000 ms
    assert book.pick("m", None) == A
    book.forget(A)
    assert book.pick("m", None) == B
    assert book.pick("m", 19_999.0) == B  # every waiter here is younger than the cap: B still wins
    assert book.pick("m", 20_000.0) is None  # the same age: a tie, this node's
    clock.ms += 1000.0
    assert book.pick("m", 20_999.0) == B and book.pick("m", 21_000.0) is None  # ages from when heard


def test_an_origin_that_takes_and_never_claims_is_ignored_for_a_doubling_time(book: WantBook, clock: Clock) -> None:
    book.note(A, Want("m", 1, 900.0))
    book.note(B, Want("m", 1, 100.0))
    first = book.unclaimed(A)
    assert (first.count, first.ignored_ms, first.log) == (1, STRIKE_FIRST_MS, True)
    assert book.ignored(A) and not book.ignored(B)
    book.note(A, Want("m", 1, 900.0))  # it announces again at once: still ignored
    assert book.pick("m", None) == B
    assert book.pick("m", 50.0, eligible=lambda p: p != B) is None  # this node's own waiter, younger than A's
    clock.ms += STRIKE_FIRST_MS - 1.0
    assert book.pick("m", None, eligible=lambda p: p != B) is None
    clock.ms += 1.0
    assert book.pick("m", None) == A  # its time is over
    second = book.unclaimed(A)
    assert (second.count, second.ignored_ms, second.log) == (2, 2 * STRIKE_FIRST_MS, False)  # logged once
    clock.ms += 2 * STRIKE_FIRST_MS - 1.0
    assert book.ignored(A)
    clock.ms += 1.0
    assert not book.ignored(A)
    times = [book.unclaimed(A).ignored_ms for _ in range(10)]
    assert times[:4] == [4 * STRIKE_FIRST_MS, 8 * STRIKE_FIRST_MS, 16 * STRIKE_FIRST_MS, 32 * STRIKE_FIRST_MS]
    assert times[4:] == [STRIKE_MAX_MS] * 6
    assert book.unclaimed(A).count == 13
    for _ in range(2000):  # a long row overflows nothing
        assert book.unclaimed(A).ignored_ms == STRIKE_MAX_MS
    assert book.pick("m", None) == B and book.ignored(A)


def test_a_claim_ends_the_strikes(book: WantBook, clock: Clock) -> None:
    book.note(A, Want("m", 1, 900.0))
    for _ in range(4):
        book.unclaimed(A)
    assert book.ignored(A)
    book.claimed(A)
    assert not book.ignored(A) and book.pick("m", None) == A
    strike = book.unclaimed(A)
    assert (strike.count, strike.ignored_ms) == (1, STRIKE_FIRST_MS)
    assert not strike.log  # logged less than STRIKE_LOG_MS ago, claim or not
    clock.ms += STRIKE_LOG_MS
    assert book.unclaimed(A).log and not book.unclaimed(A).log
    book.claimed(B)  # no strikes: nothing to end


def test_strikes_outlive_forget_and_are_forgotten_long_after(book: WantBook, clock: Clock) -> None:
    book.unclaimed(A)
    book.unclaimed(A)
    book.forget(A)  # it left the mesh (or said so) and joins again
    assert book.ignored(A)
    book.note(A, Want("m", 1, 900.0))
    assert book.pick("m", None) is None
    clock.ms += 2 * STRIKE_FIRST_MS + STRIKE_FORGET_MS + 1.0
    book.note(A, Want("m", 1, 900.0))
    book.unclaimed(B)  # a strike tidies up the ones long over
    assert book.unclaimed(A).count == 1


# --- holds ------------------------------------------------------------------------------------


def test_a_hold_is_claimed_once_by_the_peer_it_was_offered_to(clock: Clock) -> None:
    holds = Holds(clock)
    hold = holds.add("m", A, backend="b0")
    assert len(holds) == 1
    assert holds.claim(hold.offer_id, B, "m") is None  # another peer: not its slot
    assert holds.claim(hold.offer_id, A, "other") is None  # another model
    assert holds.claim("nonsense", A, "m") is None
    assert holds.claim(hold.offer_id, A, "m") is hold
    assert holds.claim(hold.offer_id, A, "m") is None
    assert len(holds) == 0


def test_offer_ids_are_unique_and_unguessable(clock: Clock) -> None:
    holds = Holds(clock)
    ids = {holds.add("m", A, backend=i).offer_id for i in range(1000)}
    assert len(ids) == 1000
    assert all(len(i) == 16 for i in ids)


def test_a_dropped_hold_is_gone_once(clock: Clock) -> None:
    holds = Holds(clock, hold_ms=250.0)
    assert holds.hold_ms == 250.0 and Holds(clock).hold_ms == HOLD_MS
    first, second = holds.add("m", A, backend="b0"), holds.add("m", B, backend="b1")
    assert holds.drop(first.offer_id) is first
    assert holds.drop(first.offer_id) is None
    assert holds.claim(first.offer_id, A, "m") is None
    assert holds.all() == [second]
    assert holds.claim(second.offer_id, B, "m") is second
    assert holds.drop(second.offer_id) is None
    assert len(holds) == 0


# --- messages ---------------------------------------------------------------------------------


def test_want_round_trips() -> None:
    want = Want("m", 3, 123.44)
    assert Want.parse(want.doc()) == Want("m", 3, 123.4)
    assert Want.parse({"model": "m", "waiting": 0}) == Want("m", 0, 0.0)


@pytest.mark.parametrize(("doc", "field"), [
    ([], "want must be a JSON object"),
    ("m", "want must be a JSON object"),
    ({}, "want.model"),
    ({"model": "", "waiting": 1}, "want.model"),
    ({"model": 5, "waiting": 1}, "want.model"),
    ({"model": "x" * 257, "waiting": 1}, "want.model"),
    ({"model": "m"}, "want.waiting"),
    ({"model": "m", "waiting": -1}, "want.waiting"),
    ({"model": "m", "waiting": True}, "want.waiting"),
    ({"model": "m", "waiting": 1.5}, "want.waiting"),
    ({"model": "m", "waiting": 10**7}, "want.waiting"),
    ({"model": "m", "waiting": 1, "oldest_ms": -1}, "want.oldest_ms"),
    ({"model": "m", "waiting": 1, "oldest_ms": "1"}, "want.oldest_ms"),
    ({"model": "m", "waiting": 1, "oldest_ms": False}, "want.oldest_ms"),
    ({"model": "m", "waiting": 1, "oldest_ms": float("nan")}, "want.oldest_ms"),
    ({"model": "m", "waiting": 1, "oldest_ms": 1e12}, "want.oldest_ms"),
])
def test_malformed_wants_name_the_field(doc: object, field: str) -> None:
    with pytest.raises(WantError, match=field):
        Want.parse(doc)


def test_offer_parses() -> None:
    assert parse_offer({"model": "m", "offer": "0123abcd"}) == Offer("m", "0123abcd")
    offer = Offer("m", "0123abcd", Priority.HIGH)
    assert offer.doc() == {"model": "m", "offer": "0123abcd", "ext": {"priority": [1, "high"]}}
    assert parse_offer(offer.doc()) == offer


def test_a_wants_priority_travels_as_an_extension_and_older_fields_stay() -> None:
    want = Want("m", 2, 50.0, Priority.LOW)
    doc = want.doc()
    assert doc == {"model": "m", "waiting": 2, "oldest_ms": 50.0, "ext": {"priority": [1, "low"]}}
    assert Want.parse(doc) == want
    # What an older node reads (it takes the three fields and ignores the rest): the same want, unranked.
    assert Want.parse({k: v for k, v in doc.items() if k != "ext"}) == Want("m", 2, 50.0)
    # An extension this node does not understand is ignored, as in a summary: no priority stated.
    for ext in ({"priority": [2, "urgent"]}, {"priority": [1, "urgent"]}, {"later": [1, {"x": 1}]}):
        assert Want.parse({**doc, "ext": ext}).priority is None


@pytest.mark.parametrize("ext", [[], {}, {"priority": "high"}, {"Priority": [1, "high"]}, {"priority": [1, 0.5]},
                                 {"priority": [1, "x" * 2000]}])
def test_an_ext_that_breaks_the_bounds_is_a_malformed_want(ext: object) -> None:
    with pytest.raises(WantError, match="want.ext"):
        Want.parse({"model": "m", "waiting": 1, "oldest_ms": 5, "ext": ext})
    with pytest.raises(WantError, match="offer.ext"):
        parse_offer({"model": "m", "offer": "o", "ext": ext})


def test_a_higher_priority_want_beats_an_older_lower_one(book: WantBook, clock: Clock) -> None:
    book.note(A, Want("m", 5, 9000.0, Priority.LOW))
    book.note(B, Want("m", 1, 10.0, Priority.HIGH))
    assert book.pick("m", None) == B
    assert book.priority_of(B, "m") is Priority.HIGH and book.priority_of(A, "m") is Priority.LOW
    # This node's own head competes by the same rule: its high waiter keeps the slot here ...
    assert book.pick("m", 5.0, own_priority=Priority.HIGH) == B  # ... unless the remote one is older
    assert book.pick("m", 20.0, own_priority=Priority.HIGH) is None
    # ... and its normal waiter, however old, yields to the remote high one.
    assert book.pick("m", 60_000.0, own_priority=Priority.NORMAL) == B
    book.offered(B, "m")
    assert book.pick("m", 60_000.0, own_priority=Priority.NORMAL) is None  # A's is low
    assert book.pick("m", 1.0, own_priority=Priority.LOW) == A


def test_a_want_without_priority_ranks_normal(book: WantBook) -> None:
    book.note(A, Want("m", 1, 100.0))  # an older origin
    assert book.pick("m", 50.0, own_priority=Priority.NORMAL) == A
    assert book.pick("m", 5.0, own_priority=Priority.HIGH) is None
    assert book.pick("m", 500.0, own_priority=Priority.LOW) == A
    assert book.priority_of(A, "m") is None


def test_a_hold_knows_which_claims_fall_below_its_want(clock: Clock) -> None:
    holds = Holds(clock)
    backend = object()
    high = holds.add("m", A, backend, Priority.HIGH)  # type: ignore[arg-type]
    assert high.below(Priority.NORMAL) and high.below(Priority.LOW) and not high.below(Priority.HIGH)
    normal = holds.add("m", A, backend, Priority.NORMAL)  # type: ignore[arg-type]
    assert normal.below(Priority.LOW) and not normal.below(Priority.HIGH)
    unstated = holds.add("m", A, backend)  # type: ignore[arg-type]
    assert not unstated.below(Priority.LOW)


@pytest.mark.parametrize(("doc", "field"), [
    (None, "offer must be a JSON object"),
    ({"offer": "x"}, "offer.model"),
    ({"model": "m"}, "offer.offer"),
    ({"model": "m", "offer": ""}, "offer.offer"),
    ({"model": "m", "offer": "x" * 65}, "offer.offer"),
    ({"model": "m", "offer": 7}, "offer.offer"),
])
def test_malformed_offers_name_the_field(doc: object, field: str) -> None:
    with pytest.raises(WantError, match=field):
        parse_offer(doc)


# --- the origin's queue: announcing and handing out offers ------------------------------------


def test_queue_reports_a_new_oldest_waiter_only() -> None:
    from viiwork.agent.serving.waitqueue import WaitQueue

    changes: list[int] = []
    q = WaitQueue("m", {}, 8, 1.0, on_head_change=lambda: changes.append(len(q)))
    first = q.enter()
    second = q.enter()
    assert changes == [1]  # the second is not the oldest
    q.leave(second)
    assert changes == [1]
    third = q.enter()
    q.leave(first)  # the oldest leaves: third is the oldest now
    assert changes == [1, 1]
    assert q.oldest() == third.arrived
    q.leave(third)
    assert changes == [1, 1, 0] and q.oldest() is None
    q.leave(third)  # leaving twice changes nothing
    assert changes == [1, 1, 0]


def test_an_offer_goes_to_the_oldest_parked_waiter_that_may_run_there() -> None:
    from viiwork.agent.serving.waitqueue import WaitQueue

    q = WaitQueue("m", {}, 8, 1.0)
    busy = q.enter()  # routing right now (not parked): cannot take it
    pinned = q.enter(host="elsewhere")
    pinned.parked = True
    free = q.enter()
    free.parked = True
    later = q.enter(host="node-a")
    later.parked = True
    assert q.give_offer(A, "node-a", "o1")
    assert free.offer == (A, "o1") and free.event.is_set() and not free.parked
    assert busy.offer is None and pinned.offer is None
    assert q.give_offer(A, "node-a", "o2")  # pinned to this very node by name
    assert later.offer == (A, "o2")
    assert not q.give_offer(B, "node-b", "o3")  # only the one pinned elsewhere is parked
    assert pinned.offer is None
    assert q.give_offer(NodeId("e" * 16), "elsewhere", "o4")
    assert pinned.offer == (NodeId("e" * 16), "o4")


def test_an_offer_goes_to_the_first_waiter_of_at_least_its_priority() -> None:
    from viiwork.agent.serving.waitqueue import WaitQueue

    q = WaitQueue("m", {}, 8, 1.0)
    low = q.enter(priority=Priority.LOW, tenant="t")
    normal = q.enter(priority=Priority.NORMAL, tenant="t")
    low.parked = normal.parked = True
    assert q.head_want() == (Priority.NORMAL, normal.arrived)
    assert not q.give_offer(A, "node-a", "o1", Priority.HIGH)  # made for a high want: nobody here
    assert q.give_offer(A, "node-a", "o2", Priority.LOW) and normal.offer == (A, "o2") and low.offer is None
    high = q.enter(priority=Priority.HIGH, tenant="u")
    high.parked = True
    assert q.head_want() == (Priority.HIGH, high.arrived)
    assert q.give_offer(A, "node-a", "o3", Priority.HIGH) and high.offer == (A, "o3")


def test_a_dispatched_waiter_does_not_wait_unless_refused() -> None:
    from viiwork.agent.serving.waitqueue import WaitQueue

    changes: list[int] = []
    q = WaitQueue("m", {}, 8, 1.0, on_head_change=lambda: changes.append(len(q)))
    first, second = q.enter(), q.enter()
    first.parked = second.parked = True
    assert changes == [1] and len(q) == 2
    q.dispatch(first)  # forwarded: the oldest waiting request is now the second
    assert len(q) == 1 and q.oldest() == second.arrived and changes == [1, 1]
    q.wake()
    assert not first.event.is_set() and second.event.is_set()
    assert q.give_offer(A, "node-a", "o1") and second.offer == (A, "o1") and first.offer is None
    q.dispatch(first, False)  # refused: back in its place, the oldest again
    assert len(q) == 2 and q.oldest() == first.arrived and changes == [1, 1, 2]
    q.dispatch(second)  # not the oldest: no new announcement
    assert changes == [1, 1, 2]
    q.leave(second)
    q.dispatch(first)
    assert len(q) == 0 and q.oldest() is None and changes == [1, 1, 2, 0]
