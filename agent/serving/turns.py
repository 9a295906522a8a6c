"""The order an origin queue serves its waiters in: priority, then tenants in turn, then arrival.

Pure: no asyncio, no clock (arrival times come in as numbers). The origin queue
(``agent/serving/waitqueue.py``) keeps its waiters in a :class:`Turns` and hands a freed slot
to the first one in :meth:`Turns.order` that may take it. The rules (issue 17 item 7;
docs/routing.md, "The origin queue"):

1. **Priority**: every ``high`` waiter comes before every ``normal`` one, every ``normal``
   before every ``low`` one (a key's ``priority`` claim; ``normal`` without keys).
2. **Tenants take turns within one priority**: start-time fair queueing with a unit cost per
   request (Goyal, Vin and Cheng, "Start-time Fair Queueing", SIGCOMM 1996). A waiter gets a
   *turn* number when it enters: one more than its tenant's last waiter's at that priority,
   and no less than the smallest turn waiting there (the virtual time); a tenant with nobody
   waiting starts at the virtual time. Waiters are served by (turn, arrival). So two tenants
   with many waiters alternate, and a tenant that arrives behind another's burst of N waits
   behind one of them per turn, not N: one tenant's burst cannot starve another's steady
   traffic.
3. **FIFO within one tenant and priority**: a tenant's waiters hold its turns in arrival
   order; one that enters with an earlier arrival (refused elsewhere first) takes its place
   by arrival among its tenant's, and the turns stay with the places. A waiter never
   overtakes an older one of the same priority and tenant.

With keys off every waiter is ``normal`` and of one tenant: the order is plain FIFO by
arrival (ties by entry). Memory: one entry per waiter; a tenant with nobody waiting is
forgotten (its next waiter starts at the virtual time: having waited is no debt). Cost: 30-60
µs more per queued request than the deque it replaced, flat in the queue's length
(docs/benchmarks-routing.md, "The origin queue's serving order").
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Hashable, Iterator
from dataclasses import dataclass, field
from typing import Generic, NamedTuple, TypeVar

from viiwork.mesh.extensions import Priority

T = TypeVar("T", bound=Hashable)

#: Rank of each priority: lower is served first.
RANK: dict[Priority, int] = {Priority.HIGH: 0, Priority.NORMAL: 1, Priority.LOW: 2}


class Place(NamedTuple):
    """Where a waiter stands: compared as a tuple, the smaller is served first. ``rank`` of
    its priority (:data:`RANK`), its tenant's ``turn``, ``arrived`` (the caller's clock,
    e.g. monotonic s), ``seq`` (entry order: ties; unique per waiter)."""

    rank: int
    turn: int
    arrived: float
    seq: int


@dataclass(slots=True)
class _Line(Generic[T]):
    """One tenant's waiters at one priority: ``items`` by (arrived, seq), ``keys`` their
    (arrived, seq), ``turns`` ascending, all three of one length."""

    items: list[T] = field(default_factory=list)
    keys: list[tuple[float, int]] = field(default_factory=list)
    turns: list[int] = field(default_factory=list)


class Turns(Generic[T]):
    """Waiters (any hashable items, each at most once) in serving order (see the module doc).

    ``tenant`` is an opaque string (``""`` without keys). The order is kept as it changes: an
    entry or a departure costs a binary search and a list insertion or deletion (a memmove) in
    the waiters of its tenant and in all of them, plus a pass over the tenants waiting at its
    priority (the virtual time); iterating is lazy (do not change the structure meanwhile).
    """

    def __init__(self) -> None:
        self._lines: dict[int, dict[str, _Line[T]]] = {}  # rank -> tenant -> line
        self._where: dict[T, tuple[str, Place]] = {}  # item -> (tenant, its place)
        self._ranked: list[Place] = []  # every place, ascending
        self._items: dict[int, T] = {}  # seq -> item
        self._seq = 0

    def __len__(self) -> int:
        return len(self._where)

    def __contains__(self, item: object) -> bool:
        return item in self._where

    def _virtual_time(self, rank: int) -> int:
        """The smallest turn waiting at ``rank`` (0 when nobody waits there)."""
        lines = self._lines.get(rank)
        return min((line.turns[0] for line in lines.values()), default=0) if lines else 0

    def _slot(self, priority: Priority, tenant: str, arrived: float) -> tuple[int, _Line[T] | None, int, int]:
        """(rank, the tenant's line or None, the index a new waiter arrived at ``arrived``
        would take in it, the turn a new waiter would add)."""
        rank = RANK[priority]
        line = self._lines.get(rank, {}).get(tenant)
        virtual = self._virtual_time(rank)
        if line is None:
            return rank, None, 0, virtual
        at = bisect.bisect_right(line.keys, (arrived, self._seq))
        return rank, line, at, max(virtual, line.turns[-1] + 1)

    def place_for(self, priority: Priority, tenant: str, arrived: float) -> Place:
        """The place a new waiter (``priority``, ``tenant``, arrived at ``arrived``) would
        take if it entered now; nothing changes."""
        rank, line, at, turn = self._slot(priority, tenant, arrived)
        if line is not None and at < len(line.turns):
            turn = line.turns[at]
        return Place(rank, turn, arrived, self._seq)

    def _unrank(self, place: Place) -> None:
        del self._ranked[bisect.bisect_left(self._ranked, place)]

    def add(self, item: T, priority: Priority, tenant: str, arrived: float) -> Place:
        """Enter ``item``; returns its place now. ValueError when it is already in."""
        if item in self._where:
            raise ValueError("already waiting")
        rank, line, at, turn = self._slot(priority, tenant, arrived)
        if line is None:
            line = self._lines.setdefault(rank, {})[tenant] = _Line()
        # The turns stay with the places: the tenant's waiters from ``at`` on (later arrivals,
        # when this one arrived earlier) each move one turn on.
        for k in range(at, len(line.items)):
            self._unrank(self._where[line.items[k]][1])
        line.items.insert(at, item)
        line.keys.insert(at, (arrived, self._seq))
        line.turns.append(turn)  # >= every turn in the line: the turns stay ascending
        self._items[self._seq] = item
        self._seq += 1
        for k in range(at, len(line.items)):
            place = Place(rank, line.turns[k], *line.keys[k])
            self._where[line.items[k]] = (tenant, place)
            bisect.insort(self._ranked, place)
        return self._where[item][1]

    def remove(self, item: T) -> bool:
        """Take ``item`` out (served, gone or given up); False when it was not in. The turn of
        its place goes with it; the others keep theirs."""
        where = self._where.pop(item, None)
        if where is None:
            return False
        tenant, place = where
        lines = self._lines[place.rank]
        line = lines[tenant]
        at = bisect.bisect_left(line.keys, (place.arrived, place.seq))
        del line.items[at], line.keys[at], line.turns[at]
        if not line.items:
            del lines[tenant]
            if not lines:
                del self._lines[place.rank]
        self._unrank(place)
        del self._items[place.seq]
        return True

    def place_of(self, item: T) -> Place:
        """``item``'s place now (KeyError when it is not in)."""
        return self._where[item][1]

    def priority_of(self, item: T) -> Priority:
        """``item``'s priority (KeyError when it is not in)."""
        return _PRIORITY_OF_RANK[self._where[item][1].rank]

    def ranked(self) -> Iterator[tuple[Place, T]]:
        """Every item with its place, the one to serve first first (lazy)."""
        items = self._items
        return ((place, items[place.seq]) for place in self._ranked)

    def order(self) -> list[T]:
        """Every item, the one to serve first first (a copy)."""
        return [self._items[place.seq] for place in self._ranked]

    def __iter__(self) -> Iterator[T]:
        items = self._items
        return (items[place.seq] for place in self._ranked)

    def first_by_arrival(self, rank: int, wanted: Callable[[T], bool]) -> Place | None:
        """The place of the earliest arrival at ``rank`` among the items ``wanted`` accepts
        (None when none): each tenant's line is in arrival order, so this reads only up to
        the first wanted item of each tenant."""
        best: Place | None = None
        for line in self._lines.get(rank, {}).values():
            for item in line.items:
                if wanted(item):
                    place = self._where[item][1]
                    if best is None or (place.arrived, place.seq) < (best.arrived, best.seq):
                        best = place
                    break
        return best


_PRIORITY_OF_RANK = {rank: priority for priority, rank in RANK.items()}
