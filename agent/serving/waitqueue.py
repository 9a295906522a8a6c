"""The origin queue: the waiting requests of one model, and the local slots they take.

A request that finds no free slot anywhere waits here (``agent/serving/pipeline.py``), on a node
with or without ``[mesh]`` alike. Waiters are served in the order of
``agent/serving/turns.py``: higher priority first, tenants taking turns within a priority,
FIFO within a tenant (plain FIFO with keys off: one priority, one tenant). A slot that frees
goes to the first waiter in that order that may take it, one waiter per slot:

- a local slot: :meth:`WaitQueue.grant` takes it for the first waiter that may run here
  (not pinned to another node) and wakes only that one;
- a peer's held slot (slot offers, ``agent/peering/offers.py``): :meth:`WaitQueue.give_offer`
  hands it to the first waiter that may run on that peer (of at least the priority the
  offer was made for);
- news that may free capacity elsewhere (a fresher peer summary, a backend that changed
  state): :meth:`WaitQueue.wake` lets every waiter route again, in serving order (the event
  loop resumes woken tasks in the order they were woken); a parked waiter also routes again
  at least every :data:`REROUTE_S`.

A new arrival never overtakes a waiter that comes before it in that order (the pipeline
makes it wait behind). While its
forward to a peer is in flight a waiter is ``dispatched``: it does not count as waiting and
is back in its place if the peer refuses. ``routing.queue_max`` and
``routing.queue_timeout_s`` are enforced here (:meth:`WaitQueue.full`, the deadline of
:meth:`WaitQueue.park`) and nowhere else.

Runs on the event loop only; every state change is synchronous, so no locks.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from viiwork.agent.serving.turns import RANK, Turns
from viiwork.agent.supervision.backends import Backend, ModelRuntime
from viiwork.mesh.extensions import Priority
from viiwork.mesh.identity import NodeId

REROUTE_S = 0.5  # a parked waiter routes again at least this often


@dataclass(slots=True, eq=False)
class Waiter:
    """One request in a :class:`WaitQueue`: ``event`` is set to make it route again;
    ``arrived`` (monotonic s); ``host``: its pinned node (id or name) or None; ``here``:
    it may run on this node; ``grant``: a local slot taken for it; ``offer``: ``(peer,
    offer id)`` when a peer offered it a held slot; ``parked`` while it waits;
    ``dispatched`` while it is being forwarded (it waits no more unless the peer refuses);
    ``priority`` and ``tenant``: its key's (``normal`` and ``""`` without keys), its place in
    ``agent/serving/turns.py``'s order."""

    event: asyncio.Event
    arrived: float
    host: str | None = None
    here: bool = True
    grant: Backend | None = None
    offer: tuple[NodeId, str] | None = None
    parked: bool = False
    dispatched: bool = False
    priority: Priority = Priority.NORMAL
    tenant: str = ""


class WaitQueue:
    """The origin's queue for one model, and the model's local slots (see the module doc).

    ``runtimes``: the node's models by name, read at each use (a reload may replace them);
    ``on_head_change``: called when :meth:`head_want` changes (to announce it).
    """

    def __init__(self, model: str, runtimes: Mapping[str, ModelRuntime], queue_max: int, timeout_s: float,
                 on_head_change: Callable[[], None] | None = None) -> None:
        self.model = model
        self.runtimes = runtimes
        self.queue_max = queue_max
        self.timeout_s = timeout_s
        self.on_head_change = on_head_change
        self._waiters: Turns[Waiter] = Turns()

    # -- local slots ---------------------------------------------------------------------

    def take(self, backend_id: str | None = None) -> Backend | None:
        """Take a free local slot now, never waiting: ``backend_id``'s if it has one (even
        ejected: the router names an ejected backend only when every candidate is ejected),
        else the backend with the most free slots; None when nothing is free here."""
        runtime = self.runtimes.get(self.model)
        if runtime is None:
            return None
        backend = None
        if backend_id is not None:
            backend = next((b for b in runtime.backends if b.id == backend_id and b.spare_slots > 0), None)
        if backend is None:
            backend = runtime.most_free()
        if backend is not None:
            backend.in_flight += 1
        return backend

    @staticmethod
    def release(backend: Backend) -> None:
        """Give back a slot taken with :meth:`take` (who gets it next: the caller's
        ``slot_freed``, agent/serving/pipeline.py)."""
        backend.end_request()

    def grant(self) -> None:
        """Hand free local slots to the first waiters that may run here, one slot each."""
        for waiter in self._waiters:
            if waiter.here and not waiter.dispatched and waiter.grant is None and waiter.offer is None:
                backend = self.take()
                if backend is None:
                    return
                waiter.grant = backend
                waiter.event.set()

    # -- the queue -----------------------------------------------------------------------

    def __len__(self) -> int:
        """Requests waiting (dispatched ones do not count)."""
        return sum(1 for w in self._waiters if not w.dispatched)

    def idle(self) -> bool:
        """No request waits nor is being forwarded from here."""
        return not self._waiters

    def full(self) -> bool:
        return len(self) >= self.queue_max

    def _head(self) -> tuple[Priority, float] | None:
        return self.head_want()

    def _changed(self, head: tuple[Priority, float] | None) -> None:
        if self._head() != head and self.on_head_change is not None:
            self.on_head_change()

    def ahead(self, host: str | None, here: bool, *, priority: Priority = Priority.NORMAL, tenant: str = "") -> bool:
        """A request waits here that a new one (pinned to ``host``, None: not pinned; of
        ``priority`` and ``tenant``) must not overtake: one that comes before it in serving
        order (``agent/serving/turns.py``: a higher priority, or its tenant's turn first) and
        could take the slot the new one would, i.e. an unpinned waiter, or one pinned to the
        same node. A waiter pinned to a node waits only while that node is busy (a slot freed
        there is handed to it first), so it holds back no request that can run elsewhere.
        ``here`` (the new request may run on this node) is for the caller's records; it does
        not change the answer."""
        place = self._waiters.place_for(priority, tenant, time.monotonic())
        for at, w in self._waiters.ranked():
            if at >= place:
                return False
            if not w.dispatched and (w.host is None or w.host == host):
                return True
        return False

    def enter(self, host: str | None = None, here: bool = True, arrived: float | None = None, *,
              priority: Priority = Priority.NORMAL, tenant: str = "") -> Waiter:
        """A new waiter, in its place (``agent/serving/turns.py``): ``arrived`` (monotonic s;
        default now) places a request that arrived earlier (it was refused elsewhere first)
        before later ones of its priority and tenant."""
        head = self._head()
        waiter = Waiter(asyncio.Event(), time.monotonic() if arrived is None else arrived, host, here,
                        priority=priority, tenant=tenant)
        self._waiters.add(waiter, priority, tenant, waiter.arrived)
        self._changed(head)
        return waiter

    def leave(self, waiter: Waiter) -> Backend | None:
        """``waiter`` leaves; returns the slot granted to it and not used (the caller frees it)."""
        head = self._head()
        if not self._waiters.remove(waiter):
            return None
        self._changed(head)
        unused, waiter.grant = waiter.grant, None
        return unused

    def dispatch(self, waiter: Waiter, dispatched: bool = True) -> None:
        """``waiter`` is being forwarded (True) or was refused and waits again (False)."""
        head = self._head()
        waiter.dispatched = dispatched
        self._changed(head)

    def wake(self) -> None:
        for waiter in self._waiters:
            if not waiter.dispatched:
                waiter.event.set()

    def head_want(self) -> tuple[Priority, float] | None:
        """What this queue asks of a freed slot (a want, agent/peering/offers.py): the highest
        priority waiting (not dispatched), and when the oldest request of that priority
        arrived (monotonic s); None when nothing waits."""
        first = next((w for w in self._waiters if not w.dispatched), None)
        if first is None:
            return None
        rank = self._waiters.place_of(first).rank
        oldest = self._waiters.first_by_arrival(rank, lambda w: not w.dispatched)
        assert oldest is not None  # ``first`` is one
        return self._waiters.priority_of(first), oldest.arrived

    def oldest(self) -> float | None:
        """When the oldest waiting request of the highest priority waiting arrived
        (monotonic s), or None (:meth:`head_want` without the priority)."""
        head = self.head_want()
        return None if head is None else head[1]

    def give_offer(self, peer: NodeId, peer_name: str, offer_id: str,
                   at_least: Priority = Priority.LOW) -> bool:
        """Hand a slot offered by ``peer`` to the first parked waiter in serving order that may
        run there (not pinned to another node) and whose priority is ``at_least`` (the
        priority the offer was made for: the holder checks the claim's key against it); False
        when none can take it."""
        for waiter in self._waiters:
            if (waiter.parked and not waiter.dispatched and waiter.offer is None and waiter.grant is None
                    and waiter.host in (None, peer, peer_name) and RANK[waiter.priority] <= RANK[at_least]):
                waiter.offer = (peer, offer_id)
                waiter.parked = False
                waiter.event.set()
                return True
        return False

    @staticmethod
    async def park(waiter: Waiter, remaining_s: float) -> None:
        """Wait until woken (a granted slot, an offer, a capacity change) or
        :data:`REROUTE_S` pass, at most ``remaining_s``."""
        if waiter.grant is not None or waiter.offer is not None:
            return
        waiter.parked = True
        try:
            await asyncio.wait_for(waiter.event.wait(), max(0.0, min(remaining_s, REROUTE_S)))
        except TimeoutError:
            pass
        finally:
            waiter.parked = False
            waiter.event.clear()


class Queues:
    """Every model's :class:`WaitQueue` on this node, made on first use.

    ``head_listeners``: called with the model's name when its head changes
    (:meth:`WaitQueue.head_want`; the mesh link announces it to peers). A backend that
    changes state or capacity hands free slots to the first waiters and lets the others
    route again.
    """

    def __init__(self, runtimes: Mapping[str, ModelRuntime], queue_max: int, queue_timeout_s: float) -> None:
        self.runtimes = runtimes
        self.queue_max = queue_max
        self.queue_timeout_s = queue_timeout_s
        self.head_listeners: list[Callable[[str], None]] = []
        self._queues: dict[str, WaitQueue] = {}
        self._watched: set[int] = set()
        self.sync()

    def sync(self) -> None:
        """Follow ``runtimes`` after a reload: watch new models' backends."""
        for runtime in self.runtimes.values():
            if id(runtime) not in self._watched:
                self._watched.add(id(runtime))
                runtime.listeners.append(self._on_change)

    def _on_change(self, runtime: ModelRuntime) -> None:
        q = self._queues.get(runtime.name)
        if q is not None:
            q.grant()
            q.wake()

    def of(self, model: str) -> WaitQueue:
        q = self._queues.get(model)
        if q is None:
            q = self._queues[model] = WaitQueue(model, self.runtimes, self.queue_max, self.queue_timeout_s,
                                                on_head_change=lambda: self._head_changed(model))
        return q

    def get(self, model: str) -> WaitQueue | None:
        return self._queues.get(model)

    def forget_idle(self, model: str) -> None:
        """Drop ``model``'s queue when nothing waits in it and this node does not serve it
        (a client naming models at will cannot grow the table)."""
        q = self._queues.get(model)
        if q is not None and q.idle() and model not in self.runtimes:
            del self._queues[model]

    def _head_changed(self, model: str) -> None:
        for listener in list(self.head_listeners):
            listener(model)

    def queued(self, model: str) -> int:
        q = self._queues.get(model)
        return 0 if q is None else len(q)

    def waiting(self) -> dict[str, int]:
        """Requests waiting by model (models with none left out)."""
        return {m: len(q) for m, q in self._queues.items() if len(q)}

    def wake_all(self) -> None:
        for q in self._queues.values():
            q.wake()
