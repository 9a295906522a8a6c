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
forgotten (its next waiter starts at the virtual time: having waited is no debt).
"""

from __future__ import annotations

import bisect
from collections.abc import Hashable, Iterator
from dataclasses import dataclass, field
from typing import Generic, TypeVar

from viiwork.mesh.extensions import Priority

T = TypeVar("T", bound=Hashable)

#: Rank of each priority: lower is served first.
RANK: dict[Priority, int] = {Priority.HIGH: 0, Priority.NORMAL: 1, Priority.LOW: 2}


@dataclass(frozen=True, order=True, slots=True)
class Place:
    """Where a waiter stands: compared as a tuple, the smaller is served first. ``rank`` of
    its priority (:data:`RANK`), its tenant's ``turn``, ``arrived`` (the caller's clock,
    e.g. monotonic s), ``seq`` (entry order: ties)."""

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

    ``tenant`` is an opaque string (``""`` without keys). Every operation is O(n) at most in
    the waiters of one tenant, except :meth:`order`, O(n log n) after a change (cached).
    """

    def __init__(self) -> None:
        self._lines: dict[int, dict[str, _Line[T]]] = {}  # rank -> tenant -> line
        self._where: dict[T, tuple[int, str]] = {}  # item -> (rank, tenant)
        self._seq = 0
        self._ranked: list[tuple[Place, T]] | None = None

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

    def add(self, item: T, priority: Priority, tenant: str, arrived: float) -> Place:
        """Enter ``item``; returns its place now. ValueError when it is already in."""
        if item in self._where:
            raise ValueError("already waiting")
        place = self.place_for(priority, tenant, arrived)
        rank, line, at, turn = self._slot(priority, tenant, arrived)
        if line is None:
            line = self._lines.setdefault(rank, {})[tenant] = _Line()
        line.items.insert(at, item)
        line.keys.insert(at, (arrived, self._seq))
        line.turns.append(turn)  # >= every turn in the line: the turns stay ascending
        self._where[item] = (rank, tenant)
        self._seq += 1
        self._ranked = None
        return place

    def remove(self, item: T) -> bool:
        """Take ``item`` out (served, gone or given up); False when it was not in. The turn of
        its place goes with it; the others keep theirs."""
        where = self._where.pop(item, None)
        if where is None:
            return False
        rank, tenant = where
        lines = self._lines[rank]
        line = lines[tenant]
        at = line.items.index(item)
        del line.items[at], line.keys[at], line.turns[at]
        if not line.items:
            del lines[tenant]
            if not lines:
                del self._lines[rank]
        self._ranked = None
        return True

    def place_of(self, item: T) -> Place:
        """``item``'s place now (KeyError when it is not in)."""
        rank, tenant = self._where[item]
        line = self._lines[rank][tenant]
        at = line.items.index(item)
        arrived, seq = line.keys[at]
        return Place(rank, line.turns[at], arrived, seq)

    def priority_of(self, item: T) -> Priority:
        """``item``'s priority (KeyError when it is not in)."""
        return _PRIORITY_OF_RANK[self._where[item][0]]

    def ranked(self) -> list[tuple[Place, T]]:
        """Every item with its place, the one to serve first first (a copy)."""
        if self._ranked is None:
            ranked: list[tuple[Place, T]] = []
            for rank, lines in self._lines.items():
                for line in lines.values():
                    for item, (arrived, seq), turn in zip(line.items, line.keys, line.turns, strict=True):
                        ranked.append((Place(rank, turn, arrived, seq), item))
            ranked.sort(key=lambda pair: pair[0])
            self._ranked = ranked
        return list(self._ranked)

    def order(self) -> list[T]:
        """Every item, the one to serve first first (a copy)."""
        return [item for _, item in self.ranked()]

    def __iter__(self) -> Iterator[T]:
        return iter(self.order())


_PRIORITY_OF_RANK = {rank: priority for priority, rank in RANK.items()}
