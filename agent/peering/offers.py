"""Slot offers: a slot that frees goes to the first request waiting anywhere in the mesh.

Pure: no asyncio, no I/O; an injected monotonic clock in milliseconds. The agent's glue is
``viiwork.agent.peering.mesh_link`` (messages over the mesh listener's mutual TLS, so the sender of
every message is known from its certificate); the protocol and its measured effect are in
docs/routing.md ("Slot offers").

Why: capacity summaries are up to a second old, so an origin with queued requests learns
that a slot freed elsewhere up to a second late, while the slot stays idle. In the routing
simulation (8 nodes x 4 slots, 80% load, docs/benchmarks-routing.md) that lag alone put
the p99 queueing delay at 1.7x an ideal global FIFO queue. With offers, a freed slot is
handed to the first waiter the freeing node knows of (the highest priority, then the
oldest) within about one round trip.

The exchange, for model ``M``:

1. **want**: an origin whose queue for ``M`` gets a new head (its highest priority waiting,
   or the oldest waiter of it, changes; or it empties) tells the peers serving ``M``:
   ``{"model": M, "waiting": n, "oldest_ms": age, "ext": {"priority": [1, p]}}``, ``age``
   that of the oldest waiter of the highest priority ``p`` waiting (``ext``: the
   ``priority`` extension of mesh/extensions.py; older nodes read the first three fields
   only, and a want without it ranks ``normal``). The receiver keeps it in its
   :class:`WantBook` (``waiting`` 0 removes the entry).
2. **offer**: a node whose slot for ``M`` frees asks :meth:`WantBook.pick`; when a remote
   want comes first (a higher priority than its own queue's head, or the same and older),
   it keeps the slot (a :class:`Hold`, noting the priority it was made for) and offers it
   to that origin, ``{"model": M, "offer": id, "ext": {"priority": [1, p]}}``; otherwise
   its own queue takes the slot as before.
3. **claim**: the origin answers ``taking`` and forwards its first waiting request of at
   least priority ``p`` with the offer's id; the holder admits it into the held slot
   (:meth:`Holds.claim`, only from the peer the offer went to) once the forward's key,
   verified again there, has at least that priority (agent/peering/mesh_link.py: a claim
   below it is a strike, and the slot goes to the next in line). An origin with nothing
   (of that priority) waiting any more answers
   ``not taking``; the holder frees the slot and asks :meth:`WantBook.pick` again (the
   origin that declined is forgotten until it announces again).
4. A hold that is not claimed within :data:`HOLD_MS` of the origin's answer (the answer
   itself may take up to the message timeout, 2 s) is freed by the glue, which also frees
   it whatever else ends the offer (a failed answer, a stopping agent).

Any member can send wants, so the book does not take them on trust (docs/security.md): a
want's age is capped (:class:`WantBook`, ``max_age_ms``), and an origin that said "taking"
and never claimed, or never answered, gets a strike (:meth:`WantBook.unclaimed`): its wants
are ignored for :data:`STRIKE_FIRST_MS`, doubling per strike in a row up to
:data:`STRIKE_MAX_MS`, until it claims an offer again. Without that, one member announcing
a day-old waiter and taking every offer kept a node's slot held for it for good.
"""

from __future__ import annotations

import secrets
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from viiwork.agent.config.schema import MAX_DURATION_S
from viiwork.agent.serving.turns import RANK
from viiwork.agent.supervision.backends import Backend
from viiwork.mesh.extensions import PRIORITY, ExtensionError, Extensions, Priority, decode_extensions
from viiwork.mesh.identity import NodeId

OFFER_HEADER = "X-Viiwork-Offer"  # on a forward: the id of the offer whose held slot it claims
HOLD_MS = 1000.0  # ms: a held slot not claimed within this is freed (a claim takes ~1 RTT)
WANT_FANOUT = 32  # peers told about an origin's waiters, per model (most slots first)
MAX_WAITING = 1_000_000  # a want's `waiting` above this is malformed
MAX_OLDEST_MS = MAX_DURATION_S * 1000.0  # a want's `oldest_ms` above this is malformed (no queue waits longer)
STRIKE_FIRST_MS = 1000.0  # an origin's first unclaimed offer: its wants are ignored this long
STRIKE_MAX_MS = 60_000.0  # the ignoring doubles per strike in a row, up to this
STRIKE_LOG_MS = 60_000.0  # at most one log line per origin this often
STRIKE_FORGET_MS = 600_000.0  # strikes whose ignoring ended this long ago are forgotten


class WantError(ValueError):
    """A malformed want or offer message; the message names the field."""


def _priority_ext(doc: dict[str, Any], what: str) -> Priority | None:
    """The ``priority`` extension of a want or offer message (mesh/extensions.py): None when
    ``ext`` is absent or does not carry one this node understands (ignored, as in a
    summary); :class:`WantError` when ``ext`` breaks the extensions' bounds."""
    if "ext" not in doc:
        return None
    try:
        return decode_extensions(doc["ext"], where=f"{what}.ext").get(PRIORITY)
    except ExtensionError as exc:
        raise WantError(str(exc)) from None


def _with_priority(doc: dict[str, Any], priority: Priority | None) -> dict[str, Any]:
    if priority is not None:
        doc["ext"] = Extensions.of({PRIORITY: priority}).encode()
    return doc


@dataclass(frozen=True, slots=True)
class Want:
    """A want message: ``model``, ``waiting`` (requests queued at the origin, 0 = none),
    ``oldest_ms`` (age of the oldest of the highest priority waiting, ms; 0 when none),
    ``priority`` (that priority; None: the origin did not say, an older node, ranked
    ``normal`` and never checked)."""

    model: str
    waiting: int
    oldest_ms: float
    priority: Priority | None = None

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
        if isinstance(oldest, bool) or not isinstance(oldest, int | float) or not 0 <= oldest <= MAX_OLDEST_MS:
            raise WantError(f"want.oldest_ms must be a number of milliseconds from 0 to {MAX_OLDEST_MS:.0f}")
        return cls(model, waiting, float(oldest), _priority_ext(doc, "want"))

    @property
    def rank(self) -> int:
        """Its priority's rank (``agent/serving/turns.py``; ``normal`` when not stated)."""
        return RANK[self.priority or Priority.NORMAL]

    def doc(self) -> dict[str, Any]:
        doc = {"model": self.model, "waiting": self.waiting, "oldest_ms": round(self.oldest_ms, 1)}
        return _with_priority(doc, self.priority)


@dataclass(frozen=True, slots=True)
class Offer:
    """An offer message: ``model``, ``offer_id``, and ``priority``: the priority of the want
    it was made for (None: not stated, an older node; any waiter may take it)."""

    model: str
    offer_id: str
    priority: Priority | None = None

    def doc(self) -> dict[str, Any]:
        return _with_priority({"model": self.model, "offer": self.offer_id}, self.priority)


def parse_offer(doc: Any) -> Offer:
    """An offer message ``{"model": M, "offer": id, "ext"?: {"priority": [1, p]}}``; raises
    :class:`WantError` naming the bad field."""
    if not isinstance(doc, dict):
        raise WantError("offer must be a JSON object")
    model, offer = doc.get("model"), doc.get("offer")
    if not isinstance(model, str) or not model or len(model) > 256:
        raise WantError("offer.model must be a non-empty string of at most 256 characters")
    if not isinstance(offer, str) or not 1 <= len(offer) <= 64:
        raise WantError("offer.offer must be a string of 1 to 64 characters")
    return Offer(model, offer, _priority_ext(doc, "offer"))


@dataclass(slots=True)
class _Entry:
    oldest_at_ms: float  # when the origin's oldest waiter (of its priority) arrived, by this node's clock
    waiting: int
    heard_at_ms: float
    priority: Priority | None  # as the want stated it (None: not stated, ranks normal)

    @property
    def key(self) -> tuple[int, float]:
        """Smaller comes first: the priority's rank, then when the waiter arrived."""
        return RANK[self.priority or Priority.NORMAL], self.oldest_at_ms


@dataclass(frozen=True, slots=True)
class Strike:
    """What :meth:`WantBook.unclaimed` decided: the origin's ``count``-th strike in a row, its
    wants ignored for ``ignored_ms`` from now; ``log``: the first strike of this origin in
    :data:`STRIKE_LOG_MS` (log it; the others only count)."""

    count: int
    ignored_ms: float
    log: bool


@dataclass(slots=True)
class _Strikes:
    count: int
    until_ms: float  # its wants are ignored until then (this node's clock)


class WantBook:
    """What this node knows of other origins' waiting requests, per model, and which
    origins' wants it ignores for now (strikes, see the module doc).

    ``clock``: monotonic milliseconds; ``ttl_ms``: an entry not renewed within this is
    dropped (a waiter never waits longer than ``routing.queue_timeout_s``, and the origin
    announces every new oldest waiter, so an older entry is a lost message);
    ``max_age_ms`` (default ``ttl_ms``): a want's ``oldest_ms`` above this counts as this
    much. The agent passes its own ``routing.queue_timeout_s``, not the config's bound (a
    day, which caps nothing): this node's own waiters are never older than its timeout, so
    a waiter at an honest origin with a longer timeout, capped, still beats every one of
    them, as it did uncapped; between remote origins, a made-up day-old waiter ranks no
    older than an honest one at the cap (only among wants older than the cap is the order
    lost: the first heard wins). The cap alone cannot stop a member from outranking this
    node's waiters (any age up to it may be honest); the strikes do.
    """

    def __init__(self, clock: Callable[[], float], ttl_ms: float, max_age_ms: float | None = None) -> None:
        self.clock = clock
        self.ttl_ms = ttl_ms
        self.max_age_ms = ttl_ms if max_age_ms is None else max_age_ms
        self._models: dict[str, dict[NodeId, _Entry]] = {}
        self._strikes: dict[NodeId, _Strikes] = {}
        self._logged: dict[NodeId, float] = {}  # when each origin's strike was last logged

    def note(self, peer: NodeId, want: Want) -> None:
        """``peer`` announced ``want`` (its oldest waiter is ``oldest_ms`` old now, counted
        as at most ``max_age_ms``)."""
        book = self._models.setdefault(want.model, {})
        if want.waiting <= 0:
            book.pop(peer, None)
            if not book:
                del self._models[want.model]
            return
        now = self.clock()
        book[peer] = _Entry(now - min(want.oldest_ms, self.max_age_ms), want.waiting, now, want.priority)

    def pick(self, model: str, own_oldest_ms: float | None,
             eligible: Callable[[NodeId], bool] = lambda _peer: True,
             own_priority: Priority = Priority.NORMAL) -> NodeId | None:
        """The origin that should get a slot of ``model`` that just freed here: the one
        whose want comes before this node's own queue's head (``own_priority``, and
        ``own_oldest_ms``: the age of its oldest waiter of that priority, None when nothing
        waits here): a higher priority, or the same and an older waiter. None: this node's
        own queue (or nobody) takes it. Ties go to this node (no round trip). Only peers
        for which ``eligible`` is true (alive, still serving the model) and whose wants are
        not ignored for a strike (:meth:`unclaimed`) are considered."""
        book = self._models.get(model)
        if not book:
            return None
        now = self.clock()
        best: NodeId | None = None
        best_key = (RANK[own_priority], now - own_oldest_ms) if own_oldest_ms is not None else (len(RANK), 0.0)
        for peer, entry in list(book.items()):
            if now - entry.heard_at_ms > self.ttl_ms:
                del book[peer]
                continue
            if entry.key < best_key and not self.ignored(peer, now) and eligible(peer):
                best, best_key = peer, entry.key
        return best

    def priority_of(self, peer: NodeId, model: str) -> Priority | None:
        """The priority ``peer``'s want for ``model`` stated (None: none stated, or no want)."""
        entry = self._models.get(model, {}).get(peer)
        return None if entry is None else entry.priority

    def ignored(self, peer: NodeId, now: float | None = None) -> bool:
        """Are ``peer``'s wants ignored now (a strike's time not yet over)?"""
        strikes = self._strikes.get(peer)
        return strikes is not None and (self.clock() if now is None else now) < strikes.until_ms

    def unclaimed(self, peer: NodeId) -> Strike:
        """``peer`` answered "taking" to an offer and did not claim it in time (or did not
        answer at all): a strike. Its wants are ignored for :data:`STRIKE_FIRST_MS` times 2
        per earlier strike in a row, at most :data:`STRIKE_MAX_MS`; :meth:`claimed` ends the
        row. Strikes outlive :meth:`forget` (leaving and joining again clears nothing) and
        are forgotten :data:`STRIKE_FORGET_MS` after their time is over."""
        now = self.clock()
        for other, old in list(self._strikes.items()):
            if now - old.until_ms > STRIKE_FORGET_MS:
                del self._strikes[other]
        for other, at in list(self._logged.items()):
            if now - at >= STRIKE_LOG_MS:
                del self._logged[other]
        count = self._strikes[peer].count + 1 if peer in self._strikes else 1
        ignored_ms = min(STRIKE_FIRST_MS * 2.0 ** min(count - 1, 32), STRIKE_MAX_MS)
        self._strikes[peer] = _Strikes(count, now + ignored_ms)
        log = peer not in self._logged
        if log:
            self._logged[peer] = now
        return Strike(count, ignored_ms, log)

    def claimed(self, peer: NodeId) -> None:
        """``peer`` claimed an offer: its strikes end (its wants count again at once)."""
        self._strikes.pop(peer, None)

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
    the ``backend`` whose slot is taken (the one the caller's admission returned),
    ``made_at_ms``, and ``priority``: what the want it answers stated (None: not stated;
    the claim is then not checked)."""

    offer_id: str
    model: str
    peer: NodeId
    backend: Backend
    made_at_ms: float
    priority: Priority | None = None

    def below(self, priority: Priority) -> bool:
        """Would a claim whose key has ``priority`` be below what the want stated (a member
        that inflated its want's priority)?"""
        return self.priority is not None and RANK[priority] > RANK[self.priority]


class Holds:
    """Slots kept for offers in flight (see the module doc). ``clock``: monotonic ms;
    ``hold_ms``: how long the glue keeps a slot an origin said it is taking."""

    def __init__(self, clock: Callable[[], float], hold_ms: float = HOLD_MS) -> None:
        self.clock = clock
        self.hold_ms = hold_ms
        self._holds: dict[str, Hold] = {}

    def __len__(self) -> int:
        return len(self._holds)

    def add(self, model: str, peer: NodeId, backend: Backend, priority: Priority | None = None) -> Hold:
        hold = Hold(secrets.token_hex(8), model, peer, backend, self.clock(), priority)
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
