"""The broadcast queue (viiwork.mesh.broadcasts): order, replacement, retirement, packing,
bounds, and a toy epidemic over 100 nodes."""

from __future__ import annotations

import random
from dataclasses import dataclass

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from viiwork.mesh.broadcasts import BroadcastQueue

Queue = BroadcastQueue[str, str]


def one_at_a_time(queue: Queue, takes: int, n_nodes: int = 10) -> list[str]:
    """What ``takes`` takes with room for one 100-byte item each send, flattened."""
    sent: list[str] = []
    for _ in range(takes):
        sent += queue.take(n_nodes, 100)
    return sent


@pytest.mark.parametrize(("n_nodes", "decades"), [(1, 1), (9, 1), (10, 2), (99, 2), (100, 3), (1000, 4)],
                         ids=lambda v: str(v))
@pytest.mark.parametrize("mult", [1, 2, 4])
def test_limit_is_mult_times_ceil_log10_of_n_plus_1(n_nodes: int, decades: int, mult: int) -> None:
    assert Queue(retransmit_mult=mult).limit(n_nodes) == mult * decades


def test_limit_and_settings_refuse_nonsense() -> None:
    with pytest.raises(ValueError, match="n_nodes"):
        Queue().limit(0)
    with pytest.raises(ValueError, match="retransmit_mult"):
        Queue(retransmit_mult=0)
    with pytest.raises(ValueError, match="max_items"):
        Queue(max_items=0)
    with pytest.raises(ValueError, match="max_skipped"):
        Queue(max_skipped=-1)
    with pytest.raises(ValueError, match="per_item_overhead"):
        Queue().take(10, 1400, per_item_overhead=-1)
    with pytest.raises(ValueError, match="size_bytes"):
        Queue().put("a", "a1", -1, 1)


def test_least_transmitted_first_newest_first_among_equals() -> None:
    queue = Queue(retransmit_mult=4)  # limit(10) = 8: nothing retires here
    for key in "abc":
        assert queue.put(key, key, 100, 1)
    assert one_at_a_time(queue, 6) == ["c", "b", "a", "c", "b", "a"]


def test_a_new_item_goes_before_items_already_sent() -> None:
    queue = Queue(retransmit_mult=4)
    queue.put("a", "a", 100, 1)
    queue.put("b", "b", 100, 1)
    assert one_at_a_time(queue, 1) == ["b"]
    queue.put("c", "c", 100, 1)
    # a and c are unsent, c is newer; b (sent once) waits for both.
    assert one_at_a_time(queue, 2) == ["c", "a"]


def test_newer_version_replaces_with_its_transmit_count_reset() -> None:
    queue = Queue(retransmit_mult=2)  # limit(10) = 4
    queue.put("a", "a@1", 100, (1, 1))
    queue.put("b", "b@1", 100, (1, 1))
    assert one_at_a_time(queue, 4) == ["b@1", "a@1", "b@1", "a@1"]
    assert queue.put("a", "a@2", 100, (1, 2))
    assert len(queue) == 2 and queue.counters.replaced == 1
    # a@2 starts over: it goes first until it has caught up with b@1 (sent twice), then
    # newest first among equals; each gets all 4 of its transmissions.
    assert one_at_a_time(queue, 6) == ["a@2", "a@2", "a@2", "b@1", "a@2", "b@1"]
    assert len(queue) == 0


@pytest.mark.parametrize("version", [(1, 4), (1, 5), (0, 9)], ids=["older-seq", "equal", "older-generation"])
def test_older_or_equal_version_is_refused(version: tuple[int, int]) -> None:
    queue = Queue()
    assert queue.put("a", "a@1.5", 100, (1, 5))
    assert not queue.put("a", "a@other", 100, version)
    assert queue.counters.stale == 1 and queue.counters.replaced == 0
    assert queue.take(10, 1400) == ["a@1.5"]


def test_newer_generation_beats_higher_seq() -> None:
    queue = Queue()
    queue.put("a", "a@1.9", 100, (1, 9))
    assert queue.put("a", "a@2.0", 100, (2, 0))
    assert queue.take(10, 1400) == ["a@2.0"]


@pytest.mark.parametrize("n_nodes", [1, 9, 10, 99, 1000])
def test_an_item_retires_after_exactly_limit_takes(n_nodes: int) -> None:
    queue = Queue(retransmit_mult=2)
    queue.put("a", "a", 100, 1)
    limit = queue.limit(n_nodes)
    for sent in range(limit):
        assert "a" in queue
        assert queue.take(n_nodes, 1400) == ["a"], f"take {sent + 1} of {limit}"
    assert "a" not in queue and len(queue) == 0 and queue.pending_bytes == 0
    assert queue.take(n_nodes, 1400) == []
    assert queue.counters.sent == limit and queue.counters.retired == 1


def test_an_item_over_a_shrunk_limit_retires_unsent() -> None:
    queue = Queue(retransmit_mult=1)
    queue.put("a", "a", 100, 1)
    assert one_at_a_time(queue, 2, n_nodes=1000) == ["a", "a"]
    # The mesh shrank to 5 nodes: limit 1, already sent twice.
    assert queue.take(5, 1400) == []
    assert len(queue) == 0 and queue.counters.retired == 1


def test_packing_fills_the_budget_in_send_order_and_skips_what_does_not_fit() -> None:
    queue = Queue()
    queue.put("small", "small", 300, 1)
    queue.put("mid", "mid", 900, 1)
    queue.put("big", "big", 1000, 1)
    # Send order big, mid, small: big fits (1010), mid does not (1920), small does (1320).
    assert queue.take(10, 1400, per_item_overhead=10) == ["big", "small"]
    # mid is the only unsent one, then small fits again beside it (910 + 310).
    assert queue.take(10, 1400, per_item_overhead=10) == ["mid", "small"]


def test_an_item_larger_than_the_budget_goes_alone_when_nothing_else_fits() -> None:
    queue = Queue()
    queue.put("huge", "huge", 5000, 1)
    assert queue.take(10, 1400) == ["huge"]
    queue.put("small", "small", 100, 1)
    # small fits, so huge (sent more and larger than the budget) waits.
    assert queue.take(10, 1400) == ["small"]
    queue.put("huge2", "huge2", 5000, 1)
    # huge2 is first in send order and does not fit; small (sent once) is taken instead.
    assert queue.take(10, 1400) == ["small"]


@pytest.mark.parametrize(("max_skipped", "sent"), [(0, ["a"]), (2, ["a"]), (3, ["a", "e"])])
def test_a_take_stops_looking_after_max_skipped_items_that_do_not_fit(
        max_skipped: int, sent: list[str]) -> None:
    queue = Queue(max_skipped=max_skipped)
    # Send order (newest first): a fits, b, c, d do not fit beside it, e does.
    for key, size in [("e", 100), ("d", 900), ("c", 900), ("b", 900), ("a", 1000)]:
        queue.put(key, key, size, 1)
    assert queue.take(10, 1400) == sent


def test_skipping_is_unbounded_until_one_item_fits() -> None:
    queue = Queue(max_skipped=0)
    queue.put("small", "small", 100, 1)
    for key in "abc":
        queue.put(key, key, 5000, 1)  # newer, so first in send order, and oversized
    assert queue.take(10, 1400) == ["small"]


def test_no_room_sends_nothing() -> None:
    queue = Queue()
    queue.put("a", "a", 10, 1)
    assert queue.take(10, 0) == []
    assert queue.counters.sent == 0


@settings(max_examples=200, deadline=None)
@given(sizes=st.lists(st.integers(0, 3000), min_size=1, max_size=30),
       budget=st.integers(1, 4000), overhead=st.integers(0, 50), takes=st.integers(1, 10))
def test_a_take_never_exceeds_its_budget_except_one_oversized_item(
        sizes: list[int], budget: int, overhead: int, takes: int) -> None:
    queue = Queue(retransmit_mult=4, max_skipped=len(sizes))  # exact greedy packing
    size_of = {f"k{i}": size for i, size in enumerate(sizes)}
    for key, size in size_of.items():
        queue.put(key, key, size, 1)
    for _ in range(takes):
        held = {key for key in size_of if key in queue}
        sent = queue.take(1000, budget, per_item_overhead=overhead)
        assert held == set() or sent, "a non-empty queue sent nothing"
        assert len(sent) == len(set(sent))
        cost = sum(size_of[key] + overhead for key in sent)
        if len(sent) > 1 or any(size_of[key] + overhead <= budget for key in held):
            assert cost <= budget, (sent, cost, budget)
        # Greedy packing: whatever was held and not sent does not fit in what was left.
        if sent and cost <= budget:
            left = budget - cost
            assert all(size_of[key] + overhead > left for key in held - set(sent))


def test_max_items_evicts_the_most_transmitted_then_the_oldest() -> None:
    queue = Queue(retransmit_mult=4, max_items=3)
    for key in "abc":
        queue.put(key, key, 100, 1)
    assert one_at_a_time(queue, 1) == ["c"]
    queue.put("d", "d", 100, 1)  # c was sent once: it goes, though a is older
    assert "c" not in queue and len(queue) == 3
    queue.put("e", "e", 100, 1)  # a, b, d all unsent: the oldest, a, goes
    assert "a" not in queue and {"b", "d", "e"} == {k for k in "abcde" if k in queue}
    assert queue.counters.evicted == 2
    assert queue.pending_bytes == 300


def test_drop_removes_the_item_about_a_key() -> None:
    queue = Queue()
    queue.put("a", "a", 100, 1)
    queue.put("b", "b", 200, 1)
    assert queue.drop("b") and not queue.drop("b") and not queue.drop("zzz")
    assert queue.pending_bytes == 100 and queue.take(10, 1400) == ["a"]
    assert queue.put("b", "b-again", 200, 1)  # nothing about b is queued any more


@dataclass
class Held:
    """The model's view of one queued item."""

    item: str
    size: int
    version: int
    put: int
    transmits: int = 0

    def send_order(self) -> tuple[int, int]:
        return self.transmits, -self.put


class QueueAgainstAModel(RuleBasedStateMachine):
    """Random puts, takes and drops against a plain sorted-list model of the same rules."""

    def __init__(self) -> None:
        super().__init__()
        self.queue = Queue()
        self.n_nodes = 10
        self.limit = 1
        self.model: dict[str, Held] = {}
        self.puts = 0
        self.sends: dict[str, int] = {}  # item -> times sent

    @initialize(mult=st.integers(1, 3), n_nodes=st.sampled_from([1, 9, 10, 99, 1000]),
                max_items=st.integers(1, 6), max_skipped=st.integers(0, 3))
    def configure(self, mult: int, n_nodes: int, max_items: int, max_skipped: int) -> None:
        self.queue = Queue(retransmit_mult=mult, max_items=max_items, max_skipped=max_skipped)
        self.n_nodes = n_nodes
        self.limit = mult * len(str(n_nodes))

    @rule(key=st.sampled_from("abcdefgh"), version=st.integers(0, 5), size=st.integers(0, 900))
    def put(self, key: str, version: int, size: int) -> None:
        self.puts += 1
        item = f"{key}#{self.puts}"
        held = self.model.get(key)
        expect = held is None or held.version < version
        assert self.queue.put(key, item, size, version) == expect
        if not expect:
            return
        self.model[key] = Held(item, size, version, self.puts)
        while len(self.model) > self.queue.max_items:
            del self.model[max(self.model, key=lambda k: self.model[k].send_order())]

    @rule(budget=st.integers(1, 2000), overhead=st.integers(0, 40))
    def take(self, budget: int, overhead: int) -> None:
        order = sorted(self.model, key=lambda k: self.model[k].send_order())
        free, expect, skipped = budget, [], 0
        for key in order:
            if self.model[key].size + overhead <= free:
                free -= self.model[key].size + overhead
                expect.append(key)
            elif expect:
                skipped += 1
                if skipped > self.queue.max_skipped:
                    break
        if not expect and order:
            expect = [order[0]]
        sent = self.queue.take(self.n_nodes, budget, per_item_overhead=overhead)
        assert sent == [self.model[key].item for key in expect]
        for key in expect:
            held = self.model[key]
            held.transmits += 1
            self.sends[held.item] = self.sends.get(held.item, 0) + 1
            if held.transmits == self.limit:
                del self.model[key]

    @rule(key=st.sampled_from("abcdefgh"))
    def drop(self, key: str) -> None:
        assert self.queue.drop(key) == (key in self.model)
        self.model.pop(key, None)

    @invariant()
    def one_item_per_key_and_bounded_sends(self) -> None:
        assert len(self.queue) == len(self.model) <= self.queue.max_items
        assert all((key in self.queue) == (key in self.model) for key in "abcdefgh")
        assert self.queue.pending_bytes == sum(held.size for held in self.model.values())
        assert all(count <= self.limit for count in self.sends.values())


TestQueueAgainstAModel = QueueAgainstAModel.TestCase
TestQueueAgainstAModel.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)


def epidemic(seed: int, n_nodes: int = 100, mult: int = 2, fanout: int = 3) -> tuple[int | None, int, int]:
    """One broadcast from node 0, in rounds: each node takes from its queue once for each of
    ``fanout`` random peers, and a peer queues what is new to it. Returns (the round by which
    all nodes knew it, or None; how many knew it in the end; total item sends)."""
    rng = random.Random(seed)
    queues = [BroadcastQueue[str, str](retransmit_mult=mult) for _ in range(n_nodes)]
    knows = [False] * n_nodes
    knows[0] = True
    queues[0].put("node-0", "summary (1, 1)", 300, (1, 1))
    sends, rounds, all_by = 0, 0, None
    while any(queues):
        rounds += 1
        assert rounds < 100, "the queues never emptied"
        received: list[tuple[int, str]] = []
        for node, queue in enumerate(queues):
            for peer in rng.sample(range(n_nodes - 1), fanout):
                peer += peer >= node  # any node but this one
                for item in queue.take(n_nodes, 1400):
                    sends += 1
                    received.append((peer, item))
        for peer, item in received:
            if not knows[peer]:
                knows[peer] = True
                assert queues[peer].put("node-0", item, 300, (1, 1))
        if all_by is None and all(knows):
            all_by = rounds
    return all_by, sum(knows), sends


def test_a_broadcast_reaches_100_nodes_in_log_rounds_with_bounded_sends() -> None:
    n_nodes, limit = 100, BroadcastQueue[str, str](retransmit_mult=2).limit(100)
    runs = [epidemic(seed) for seed in range(40)]
    # Every node that learns it sends it exactly limit times, so the total is bounded.
    assert all(sends <= n_nodes * limit for _, _, sends in runs)
    assert all(sends == knew * limit for _, knew, sends in runs)
    # With 6 sends per node a node is missed with probability about e^-6 (~0.25%): most
    # broadcasts reach all 100 (about 80% here), the rest all but a few, which the
    # anti-entropy exchange repairs. All within ~log2(100) rounds.
    reached_all = [by for by, _, _ in runs if by is not None]
    assert len(reached_all) >= 0.65 * len(runs)
    assert max(reached_all) <= 9
    assert min(knew for _, knew, _ in runs) >= 95


def test_a_larger_multiplier_reaches_every_node() -> None:
    runs = [epidemic(seed, mult=4) for seed in range(20)]
    assert all(by is not None and by <= 9 for by, _, _ in runs)


def test_a_floor_of_transmissions_below_the_decades():
    """``min_transmits`` lifts the product below it (probe mode: 6, mesh/probing.py), and only there."""
    queue = Queue(retransmit_mult=2, min_transmits=6)
    assert [queue.limit(n) for n in (1, 10, 50, 99, 100, 1000)] == [6, 6, 6, 6, 6, 8]
    with pytest.raises(ValueError, match="min_transmits"):
        Queue(min_transmits=0)
