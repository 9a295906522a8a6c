"""Slot offers: a slot that frees goes to the oldest request waiting anywhere in the mesh.

Pure: no asyncio, no I/O; an injected monotonic clock in milliseconds. The agent's glue is
``viiwork.agent.peering.mesh_link`` (messages over the mesh listener's mutual TLS, so the sender of
every message is known from its certificate); the protocol and its measured effect are in
docs/routing.md ("Slot offers").

Why: capacity summaries are up to a second old, so an origin with queued requests learns
that a slot freed elsewhere up to a second late, while the slot stays idle. In the routing
simulation (8 nodes x 4 slots, 80% load, docs/benchmarks-routing.md) that lag alone put
the p99 queueing delay at 1.7x an ideal global FIFO queue. With offers, a freed slot is
handed to the oldest waiter the freeing node knows of within about one round trip.

The exchange, for model ``M``:

1. **want**: an origin whose queue for ``M`` gets a new oldest waiter (or empties) tells
   the peers serving ``M``: ``{"model": M, "waiting": n, "oldest_ms": age}``. The receiver
   keeps it in its :class:`WantBook` (``waiting`` 0 removes the entry).
2. **offer**: a node whose slot for ``M`` frees asks :meth:`WantBook.pick`; when a remote
   waiter is older than its own oldest, it keeps the slot (a :class:`Hold`) and offers it
   to that origin; otherwise its own queue takes the slot as before.
3. **claim**: the origin answers ``taking`` and forwards its oldest waiting request with
   the offer's id; the holder admits it into the held slot (:meth:`Holds.claim`, only
   from the peer the offer went to). An origin with nothing waiting any more answers
   ``not taking``; the holder frees the slot and asks :meth:`WantBook.pick` again (the
   origin that declined is forgotten until it announces again).
4. A hold that is not claimed within :data:`HOLD_MS` of the origin's answer (the answer
   itself may take up to the message timeout, 2 s) is freed by the glue, which also frees
   it whatever else ends the offer (a failed answer, a stopping agent).
"""

from __future__ import annotations

import secrets
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from viiwork.agent.supervision.backends import Backend
from viiwork.mesh.identity import NodeId

OFFER_HEADER = "X-Viiwork-Offer"  # on a forward: the id of the offer whose held slot it claims
HOLD_MS = 1000.0  # ms: a held slot not claimed within this is freed (a claim takes ~1 RTT)
WANT_FANOUT = 32  # peers told about an origin's waiters, per model (most slots first)
MAX_WAITING = 1_000_000  # a want's `waiting` above this is malformed


class WantError(ValueError):
    """A malformed want or offer message; the message names the field."""


@dataclass(frozen=True, slots=True)
class Want:
    """A want message: ``model``, ``waiting`` (requests queued at the origin, 0 = none),
    ``oldest_ms`` (age of the oldest, ms; 0 when none)."""

    model: str
    waiting: int
    oldest_ms: float

    @classmethod
    def parse(cls, doc: Any) -> Want:
        """From decoded JSON; raises :class:`WantError` naming the bad field."""
        if not isinstance(doc, dict):
            raise WantError("want must be a JSON object")
        model, waiting, oldest = doc.get("model"), doc.get("waiting"), doc.get("oldest_ms", 0)
        if not isinstance(model, str) or not model or len(model) > 256:
            raise WantError("want.model must be a non-empty string of at most 256 characters")
        if isinstance(waiting, bool) or not isinstance(waiting, int) or not 0 <= waiting <= MAX_WAITING:
            raise WantError(f"want.waiting must be an integer from 0 to {MAX_WAITING}")
        if isinstance(oldest, bool) or not isinstance(oldest, int | float) or not 0 <= oldest <= 86_400_000:
            raise WantError("want.oldest_ms must be a number of milliseconds from 0 to 86400000")
        return cls(model, waiting, float(oldest))

    def doc(self) -> dict[str, Any]:
        return {"model": self.model, "waiting": self.waiting, "oldest_ms": round(self.oldest_ms, 1)}


def parse_offer(doc: Any) -> tuple[str, str]:
    """An offer message ``{"model": M, "offer": id}`` -> (model, offer id); raises
    :class:`WantError` naming the bad field."""
    if not isinstance(doc, dict):
        raise WantError("offer must be a JSON object")
    model, offer = doc.get("model"), doc.get("offer")
    if not isinstance(model, str) or not model or len(model) > 256:
        raise WantError("offer.model must be a non-empty string of at most 256 characters")
    if not isinstance(offer, str) or not 1 <= len(offer) <= 64:
        raise WantError("offer.offer must be a string of 1 to 64 characters")
    return model, offer


@dataclass(slots=True)
class _Entry:
    oldest_at_ms: float  # when the origin's oldest waiter arrived, by this node's clock
    waiting: int
    heard_at_ms: float


class WantBook:
    """What this node knows of other origins' waiting requests, per model.

    ``clock``: monotonic milliseconds; ``ttl_ms``: an entry not renewed within this is
    dropped (a waiter never waits longer than ``routing.queue_timeout_s``, and the origin
    announces every new oldest waiter, so an older entry is a lost message).
    """

    def __init__(self, clock: Callable[[], float], ttl_ms: float) -> None:
        self.clock = clock
        self.ttl_ms = ttl_ms
        self._models: dict[str, dict[NodeId, _Entry]] = {}

    def note(self, peer: NodeId, want: Want) -> None:
        """``peer`` announced ``want`` (its oldest waiter is ``oldest_ms`` old now)."""
        book = self._models.setdefault(want.model, {})
        if want.waiting <= 0:
            book.pop(peer, None)
            if not book:
                del self._models[want.model]
            return
        now = self.clock()
        book[peer] = _Entry(now - want.oldest_ms, want.waiting, now)

    def pick(self, model: str, own_oldest_ms: float | None,
             eligible: Callable[[NodeId], bool] = lambda _peer: True) -> NodeId | None:
        """The origin that should get a slot of ``model`` that just freed here: the one
        whose oldest waiter is older than this node's own oldest (``own_oldest_ms``: its
        age, None when nothing waits here); None: this node's own queue (or nobody) takes
        it. Ties go to this node (no round trip). Only peers for which ``eligible`` is true
        (alive, still serving the model) are considered."""
        book = self._models.get(model)
        if not book:
            return None
        now = self.clock()
        best: NodeId | None = None
        best_at = now - own_oldest_ms if own_oldest_ms is not None else float("inf")
        for peer, entry in list(book.items()):
            if now - entry.heard_at_ms > self.ttl_ms:
                del book[peer]
                continue
            if entry.oldest_at_ms < best_at and eligible(peer):
                best, best_at = peer, entry.oldest_at_ms
        return best

    def offered(self, peer: NodeId, model: str) -> None:
        """A slot was offered to ``peer`` (or it declined): forget its entry until it
        announces again (its oldest waiter changes when it takes the slot)."""
        book = self._models.get(model)
        if book is not None:
            book.pop(peer, None)

    def forget(self, peer: NodeId) -> None:
        """Drop everything about ``peer`` (it left, died or stopped serving)."""
        for book in self._models.values():
            book.pop(peer, None)

    def waiting(self) -> dict[str, int]:
        """Requests known waiting at other origins, by model (for /v1/status)."""
        return {m: sum(e.waiting for e in book.values()) for m, book in self._models.items() if book}


@dataclass(frozen=True, slots=True)
class Hold:
    """A slot kept for an offer: ``offer_id``, ``model``, the ``peer`` it was offered to,
    the ``backend`` whose slot is taken (the one the caller's admission returned), and
    ``made_at_ms``."""

    offer_id: str
    model: str
    peer: NodeId
    backend: Backend
    made_at_ms: float


class Holds:
    """Slots kept for offers in flight (see the module doc). ``clock``: monotonic ms;
    ``hold_ms``: how long the glue keeps a slot an origin said it is taking."""

    def __init__(self, clock: Callable[[], float], hold_ms: float = HOLD_MS) -> None:
        self.clock = clock
        self.hold_ms = hold_ms
        self._holds: dict[str, Hold] = {}

    def __len__(self) -> int:
        return len(self._holds)

    def add(self, model: str, peer: NodeId, backend: Backend) -> Hold:
        hold = Hold(secrets.token_hex(8), model, peer, backend, self.clock())
        self._holds[hold.offer_id] = hold
        return hold

    def claim(self, offer_id: str, peer: NodeId | None, model: str) -> Hold | None:
        """The held slot for a forward from ``peer`` carrying ``offer_id``, or None (unknown
        id, expired, another peer's offer, or another model: admitted like any forward)."""
        hold = self._holds.get(offer_id)
        if hold is None or hold.peer != peer or hold.model != model:
            return None
        del self._holds[offer_id]
        return hold

    def drop(self, offer_id: str) -> Hold | None:
        """End the hold (declined or the offer failed); the caller frees its slot."""
        return self._holds.pop(offer_id, None)

    def all(self) -> list[Hold]:
        return list(self._holds.values())
