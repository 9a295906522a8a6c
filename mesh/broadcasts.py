"""The broadcast queue: changes waiting to ride on outgoing probes and gossip (sans-IO).

A node that learns something new (its own summary changed, or a peer's new summary arrived)
puts it here; every outgoing message takes a few queued items to piggyback, until each item
has been sent ``retransmit_mult * ceil(log10(n + 1))`` times and retires. The digest-first
anti-entropy exchange (:mod:`viiwork.mesh.messages`) repairs whatever a broadcast missed, so
the limit trades bytes against how often that repair is needed (issue 16, item 2; the
dissemination rule is in docs/mesh.md).

Rules (after memberlist's transmit-limited queue, as its documentation describes it):

- One item per key (a key is what the item is about, e.g. a node id). A put with a version
  newer than the queued one replaces it with its transmit count reset; an older or equal one
  is refused and counted as ``stale``. Only the queued item is compared: once an item retired,
  the caller's own table (not this queue) decides what is new.
- A take sends the least-transmitted items first, the newest first among equals (newest: put
  last), as many as fit in the budget. When nothing fits, the first item in that order goes
  alone, so an oversized item is never stuck behind the budget.
- ``retransmit_mult`` defaults to 2, not memberlist's LAN 4: our budget (issue 16: at most
  10 / 20 / 50 kB per node per second at 10 / 100 / 1,000 nodes) is measured against it in
  the simulator, and anti-entropy repairs the rare node a broadcast misses.
- Bounded: beyond ``max_items`` the least useful item goes (most transmitted, then oldest).

Pure: no sockets, no clocks, no randomness. Single-threaded: the event loop or the simulator
owns a queue. Cost: put, drop and each item a take looks at are O(log n) (heaps with lazy
deletion, rebuilt when half garbage); a take stops as soon as the smallest queued item it has
not looked at cannot fit, or when it has passed over ``max_skipped`` items that do not fit,
so it does not walk the whole queue to fill a message's last few bytes.
"""

from __future__ import annotations

import heapq
from collections.abc import Hashable
from dataclasses import dataclass
from typing import Any, Generic, Protocol, TypeVar

K = TypeVar("K", bound=Hashable)
T = TypeVar("T")

DEFAULT_RETRANSMIT_MULT = 2
# One item per node at the largest mesh a digest describes (messages.MAX_ENTRIES).
DEFAULT_MAX_ITEMS = 4096
# Items a take passes over (too large for the room left) once it holds one, before it stops:
# filling a message's last bytes is not worth a walk over a long queue (measured: a take on
# 1,000 queued items of 200-900 bytes falls from ~80 to ~20 us).
DEFAULT_MAX_SKIPPED = 16
# A heap is rebuilt once it holds this many more tuples than twice the live items.
_GARBAGE_SLACK = 64


class Version(Protocol):
    """Anything ordered by ``<``: e.g. a summary's ``(generation, seq)``."""

    def __lt__(self, other: Any, /) -> bool: ...


@dataclass(slots=True, eq=False)
class _Entry(Generic[K, T]):
    key: K
    item: T
    size_bytes: int
    version: Version
    order: int  # put number: larger is newer
    transmits: int = 0
    live: bool = True


@dataclass(slots=True)
class BroadcastCounters:
    """Plain counters of one queue.

    - ``queued``: puts accepted (new keys and replacements).
    - ``replaced``: accepted puts that replaced a queued item about the same key.
    - ``stale``: puts refused (version older than or equal to the queued one).
    - ``sent``: item transmissions handed out by takes.
    - ``retired``: items dropped after ``limit(n_nodes)`` transmissions.
    - ``evicted``: items pushed out by ``max_items``.
    - ``dropped``: items removed by :meth:`BroadcastQueue.drop`.
    """

    queued: int = 0
    replaced: int = 0
    stale: int = 0
    sent: int = 0
    retired: int = 0
    evicted: int = 0
    dropped: int = 0


class BroadcastQueue(Generic[K, T]):
    """Items about keys ``K`` waiting to be piggybacked, each retransmitted a bounded number
    of times.

    ``retransmit_mult`` (>= 1): transmissions per decade of mesh size (see :meth:`limit`).
    ``max_items`` (>= 1): the most items held; beyond it the most transmitted (then oldest)
    item is evicted. ``max_skipped`` (>= 0): once a take holds an item, how many items that
    do not fit in the room left it passes over before it stops looking. Raises ValueError on
    values out of range.
    """

    def __init__(self, retransmit_mult: int = DEFAULT_RETRANSMIT_MULT,
                 max_items: int = DEFAULT_MAX_ITEMS,
                 max_skipped: int = DEFAULT_MAX_SKIPPED, min_transmits: int = 1) -> None:
        if retransmit_mult < 1:
            raise ValueError(f"retransmit_mult must be >= 1, got {retransmit_mult}")
        if min_transmits < 1:
            raise ValueError(f"min_transmits must be >= 1, got {min_transmits}")
        self.min_transmits = min_transmits
        if max_items < 1:
            raise ValueError(f"max_items must be >= 1, got {max_items}")
        if max_skipped < 0:
            raise ValueError(f"max_skipped must be >= 0, got {max_skipped}")
        self.retransmit_mult = retransmit_mult
        self.max_items = max_items
        self.max_skipped = max_skipped
        self.counters = BroadcastCounters()
        self._by_key: dict[K, _Entry[K, T]] = {}
        self._puts = 0
        self._pending_bytes = 0
        # (transmits, -order, entry): the top is what a take sends first.
        self._send_heap: list[tuple[int, int, _Entry[K, T]]] = []
        # (-transmits, order, entry): the top is what eviction removes first. A tuple whose
        # transmits is no longer the entry's is garbage (each take pushes a fresh one).
        self._evict_heap: list[tuple[int, int, _Entry[K, T]]] = []
        # Sizes of the live items in the send heap (multiset) and a lazy min-heap over them.
        self._size_counts: dict[int, int] = {}
        self._size_heap: list[int] = []

    def limit(self, n_nodes: int) -> int:
        """Transmissions of one item in a mesh of ``n_nodes`` nodes (self included):
        ``max(min_transmits, retransmit_mult * ceil(log10(n_nodes + 1)))``, memberlist's
        retransmit limit with a floor. For n = 1, 9, 10, 99, 1000 the product is 1, 1, 2, 2, 4
        times ``retransmit_mult``. Raises ValueError when ``n_nodes`` < 1 (a mesh holds at
        least this node)."""
        if n_nodes < 1:
            raise ValueError(f"n_nodes must be >= 1, got {n_nodes}")
        # ceil(log10(n + 1)) is the count of decimal digits of n for n >= 1: exact, unlike
        # floating-point log10 near powers of ten.
        return max(self.min_transmits, self.retransmit_mult * len(str(n_nodes)))

    def put(self, key: K, item: T, size_bytes: int, version: Version) -> bool:
        """Queue ``item`` about ``key``; ``size_bytes`` (>= 0) is its encoded size, which
        takes count against their budget. Returns True when queued (new key, or ``version``
        newer than the queued one, which it replaces with its transmit count reset), False
        when refused because the queued version is newer or equal (counted as ``stale``).
        Raises ValueError on a negative size."""
        if size_bytes < 0:
            raise ValueError(f"size_bytes must be >= 0, got {size_bytes}")
        queued = self._by_key.get(key)
        if queued is not None:
            if not queued.version < version:
                self.counters.stale += 1
                return False
            self._remove(queued)
            self.counters.replaced += 1
        self._puts += 1
        entry = _Entry(key, item, size_bytes, version, self._puts)
        self._by_key[key] = entry
        self._pending_bytes += size_bytes
        self._push(entry)
        self.counters.queued += 1
        while len(self._by_key) > self.max_items:
            self._evict_one()
        self._compact()
        return True

    def take(self, n_nodes: int, budget_bytes: int, per_item_overhead: int = 0) -> list[T]:
        """The items to piggyback on one outgoing message, least transmitted first (newest
        first among equals), as many as fit: ``sum(size_bytes + per_item_overhead) <=
        budget_bytes``, greedily in that order (passing over at most ``max_skipped`` items
        that do not fit once one is taken). When none fits, the first item in that order is
        returned alone (the caller must be able to send one item beyond its budget). An empty
        list when the queue is empty or ``budget_bytes`` <= 0.

        Each returned item's transmit count grows by one; an item that reaches
        ``limit(n_nodes)`` retires. An item already at or over the limit (``n_nodes`` shrank
        since its last take) retires without being sent. Raises ValueError when
        ``n_nodes`` < 1 or ``per_item_overhead`` < 0."""
        if per_item_overhead < 0:
            raise ValueError(f"per_item_overhead must be >= 0, got {per_item_overhead}")
        limit = self.limit(n_nodes)
        if budget_bytes <= 0:
            return []
        free = budget_bytes
        taken: list[_Entry[K, T]] = []
        skipped: list[_Entry[K, T]] = []
        skipped_since_taken = 0
        while True:
            smallest = self._smallest_size()
            if smallest is None or smallest + per_item_overhead > free:
                break  # nothing not yet looked at fits
            entry = self._pop_live()
            if entry.transmits >= limit:
                self._retire(entry)
                continue
            cost = entry.size_bytes + per_item_overhead
            if cost <= free:
                free -= cost
                taken.append(entry)
            else:
                skipped.append(entry)
                if taken:
                    skipped_since_taken += 1
                    if skipped_since_taken > self.max_skipped:
                        break
        if not taken:
            # Nothing fits: the first in send order goes alone. The skipped ones (if any)
            # were popped in that order, so it is skipped[0], or else the heap's top.
            while not taken:
                if skipped:
                    entry = skipped.pop(0)
                elif self._smallest_size() is not None:
                    entry = self._pop_live()
                else:
                    break
                if entry.transmits >= limit:
                    self._retire(entry)
                else:
                    taken.append(entry)
        for entry in skipped:
            self._push_send(entry)
        for entry in taken:
            entry.transmits += 1
            self.counters.sent += 1
            if entry.transmits >= limit:
                self._retire(entry)
            else:
                self._push(entry)
        self._compact()
        return [entry.item for entry in taken]

    def drop(self, key: K) -> bool:
        """Remove the item about ``key`` (e.g. a node that left, or a change superseded by
        other means). Returns whether one was queued."""
        entry = self._by_key.get(key)
        if entry is None:
            return False
        self._remove(entry)
        self.counters.dropped += 1
        self._compact()
        return True

    def __len__(self) -> int:
        return len(self._by_key)

    def __contains__(self, key: object) -> bool:
        return key in self._by_key

    @property
    def pending_bytes(self) -> int:
        """Sum of ``size_bytes`` over the queued items (each counted once, not per
        remaining transmission)."""
        return self._pending_bytes

    # -- internals: every live entry has exactly one tuple in the send heap, and its size
    # in the size multiset, except while a take holds it.

    def _push(self, entry: _Entry[K, T]) -> None:
        self._push_send(entry)
        heapq.heappush(self._evict_heap, (-entry.transmits, entry.order, entry))

    def _push_send(self, entry: _Entry[K, T]) -> None:
        heapq.heappush(self._send_heap, (entry.transmits, -entry.order, entry))
        count = self._size_counts.get(entry.size_bytes, 0)
        if count == 0:
            heapq.heappush(self._size_heap, entry.size_bytes)
        self._size_counts[entry.size_bytes] = count + 1

    def _pop_live(self) -> _Entry[K, T]:
        """The send heap's first live entry, taken out of the heap and the size multiset
        (the caller checked that one exists)."""
        while True:
            entry = heapq.heappop(self._send_heap)[2]
            if entry.live:
                self._uncount_size(entry.size_bytes)
                return entry

    def _uncount_size(self, size_bytes: int) -> None:
        count = self._size_counts[size_bytes] - 1
        if count:
            self._size_counts[size_bytes] = count
        else:
            del self._size_counts[size_bytes]

    def _smallest_size(self) -> int | None:
        heap = self._size_heap
        while heap and heap[0] not in self._size_counts:
            heapq.heappop(heap)
        return heap[0] if heap else None

    def _remove(self, entry: _Entry[K, T]) -> None:
        """Forget a live entry that sits in the send heap (its tuples become garbage)."""
        self._forget(entry)
        self._uncount_size(entry.size_bytes)

    def _retire(self, entry: _Entry[K, T]) -> None:
        """Forget an entry a take holds (already out of the send heap and size multiset)."""
        self._forget(entry)
        self.counters.retired += 1

    def _forget(self, entry: _Entry[K, T]) -> None:
        entry.live = False
        del self._by_key[entry.key]
        self._pending_bytes -= entry.size_bytes

    def _evict_one(self) -> None:
        while True:
            neg_transmits, _, entry = heapq.heappop(self._evict_heap)
            if entry.live and entry.transmits == -neg_transmits:
                self._remove(entry)
                self.counters.evicted += 1
                return

    def _compact(self) -> None:
        live = len(self._by_key)
        bound = 2 * live + _GARBAGE_SLACK
        if len(self._send_heap) > bound:
            self._send_heap = [(e.transmits, -e.order, e) for e in self._by_key.values()]
            heapq.heapify(self._send_heap)
        if len(self._evict_heap) > bound:
            self._evict_heap = [(-e.transmits, e.order, e) for e in self._by_key.values()]
            heapq.heapify(self._evict_heap)
        if len(self._size_heap) > 2 * len(self._size_counts) + _GARBAGE_SLACK:
            self._size_heap = list(self._size_counts)
            heapq.heapify(self._size_heap)
