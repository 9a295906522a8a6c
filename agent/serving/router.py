"""The mesh-wide router: where one request for one model should run (docs/routing.md).

One module (over 400 lines) because it is one decision: the rules below are applied in
order to one picture, and the picture's types (``LocalModel``, ``PeerSnapshot``, the
origin's ``Reservations``) exist to feed ``Router.route``; the rules read in the same
order as docs/routing.md gives them.

Pure: no asyncio, no I/O. It reads a snapshot of this node's backends (:class:`LocalModel`)
and of its peers (:class:`PeerSnapshot`, built from the mesh's ``PeerView`` with
:meth:`PeerSnapshot.from_view`), this node's own :class:`Reservations`, an injected
``random.Random`` and an injected monotonic clock (milliseconds, for reservation expiry
only), and returns a :class:`Decision`:

- :class:`RunLocal` (backend id), :class:`RunOnPeer` (node id): run it there now;
- :class:`Queue`: nothing is free now but something could serve it later; wait in the
  origin's FIFO queue and route again when a slot frees (local release, a forwarded request
  ends, or a fresher summary arrives);
- :class:`Refuse`: an error with its HTTP status (404 unknown model or node, 400 pinned to a
  node that does not serve the model, 503 nothing can serve it now) and a message that names
  what is wrong.

Rules, in order (docs/routing.md has the reasoning and the measured effect):

1. Host selection (``?host=`` / ``X-Viiwork-Host``): a node id, or a node name that exactly
   one node carries; unknown or ambiguous -> 404; the node does not serve the model -> 400;
   the node is dead, has left or is in identity ``conflict`` -> 503; the node is full,
   suspect or its summary stale -> queue. Nothing else is considered.
2. Affinity (``X-Session-Id`` / ``X-Session-Affinity``): the nodes that serve the model and
   are reachable (this node when it has healthy backends; peers alive, serving and fresh)
   are ranked by weighted rendezvous hashing of the key (weight: the node's slots); the
   first in that ranking with room takes the request, so a session stays on one node while
   that node has room and moves (to its next node in the ranking, the same for every
   request of that session) only when it is full or gone.
2b. Prefix (a :class:`~viiwork.agent.serving.scoring.PrefixQuery` given; docs/routing.md,
   "Prefix-aware routing"): every local backend and fresh peer with a free slot is a
   candidate, scored by predicted time to first token (agent/serving/scoring.py: wait, round
   trip, the prompt's uncached part at the candidate's prefill speed) behind the balance
   guard; the smallest wins when a candidate within the guard holds at least
   ``min_blocks`` of the prompt. A miss everywhere goes on to rule 3.
3. A local healthy backend with a free slot (the one with the most free slots): no hop.
4. A fresh peer (liveness ``alive``, state ``serving``, summary younger than
   ``stale_after_ms``, not in the request's ``exclude`` set) with free slots, counting
   ``slots - busy - our reservations since its summary + our completions since its summary``
   (a peer that refused a forward since its summary counts as full).
   More free slots first, then lower RTT; the choice is random among near-equals (within
   :data:`NEAR_FREE` slots of the most free and :data:`NEAR_RTT_MS` ms or x2 of the lowest
   RTT), weighted by free slots, so origins working from the same picture spread out.
5. With ``probe`` on (off by default), when no peer appears to have room: the fresh peer whose picture (its
   summary, or its last refusal) is oldest, since one of its busy slots has most likely
   freed since; a peer known full for less than :data:`PROBE_MIN_MS` is not asked. A wrong
   guess costs one refused forward (one round trip, before the first byte).
6. Else queue when something could serve it later (a local backend starting or healthy; a
   peer alive or suspect, serving or restarting, listing the model with at least one
   backend); else 503. A peer that publishes ``draining``, ``leaving`` or ``restarting``
   gets no new forward (rule 4 needs ``serving``); its requests in flight run on.

Outlier ejection (docs/routing.md, "Outlier ejection"; agent/serving/ejections.py): rules 2-5
leave out the local backends that are ejected (``LocalModel.ejected``) and the peers ejected
for the model in this node's view (``ejected``), and the local backends this request already
failed on (``avoid``). When that leaves no candidate at all (no local healthy backend and no
fresh peer with slots for the model, busy or not), the ejections are ignored: an ejection
never takes a model's last backends away, so the client gets their real error rather than a
503. A pinned request (rule 1) ignores ejections too.

A model nobody in the table lists (this node, or any peer, including dead and departed
ones, whose models are still known) is 404 with the models of the mesh listed.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
import random
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from viiwork.agent.serving.prefixes import peer_hit
from viiwork.agent.serving.scoring import Candidate, PrefixQuery, choose, guarded_blocks
from viiwork.agent.supervision.backends import ModelRuntime
from viiwork.engines.contract import CLASSIC_ENDPOINTS, ENDPOINT_PATHS, Endpoint
from viiwork.mesh.extensions import ENDPOINTS, PREFIXES, SPEEDS, Endpoints, Prefixes, Speeds
from viiwork.mesh.identity import NodeId
from viiwork.mesh.membership import Liveness, PeerView
from viiwork.mesh.summary import ModelCapacity, PublishedState

NEAR_FREE = 1  # slots: peers this close to the most free count as near-equals
NEAR_RTT_MS = 2.0  # ms: among near-equals, RTTs within max(this, 2 x the lowest) are equal
RESERVATION_MAX_AGE_MS = 600_000.0  # ms: safety net: a reservation never released expires
PROBE_MIN_MS = 100.0  # ms: a peer known full more recently than this is not probed
#: The endpoints of a model whose node says nothing more (a peer from before the ``endpoints``
#: extension, engines/contract.py ``CLASSIC_ENDPOINTS``); its kind still tells chat from embeddings.
CLASSIC = frozenset(e.value for e in CLASSIC_ENDPOINTS)


# --- inputs -----------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class LocalBackend:
    """One local backend of a model: ``backend_id`` and ``free`` slots now (0 when busy, not
    healthy or draining: only an admitting backend has free slots); ``slots`` (0: unknown) and
    ``prefill_tps`` (tokens/s, None until measured) for prefix scoring."""

    backend_id: str
    free: int
    slots: int = 0
    prefill_tps: float | None = None


@dataclass(frozen=True, slots=True)
class LocalModel:
    """A model configured on this node. ``backends``: its backends with free slots now;
    ``slots``: slots of its healthy backends (the affinity weight); ``can_serve``: False when
    nothing here can ever serve it now (every backend dead, the model down), True while a
    backend is healthy or still starting (``ModelRuntime.can_ever_serve``);
    ``ctx_per_slot``: tokens per sequence (0 when unknown). ``ejected``: its healthy
    backends that outlier ejection took out of ``backends`` and ``slots`` (``free``: what
    they would have free), for the fallback when every candidate is ejected. ``away``: why a
    gang model cannot serve (its worker host gone, ``GangLauncher.away``), for the 503."""

    name: str
    kind: str
    backends: tuple[LocalBackend, ...]
    slots: int
    can_serve: bool
    ctx_per_slot: int = 0
    engine: str = ""
    ejected: tuple[LocalBackend, ...] = ()
    endpoints: frozenset[str] = CLASSIC  # the endpoint names its backends serve
    away: str = ""

    @classmethod
    def from_runtime(cls, runtime: ModelRuntime) -> LocalModel:
        """The picture of one of this node's models now (read it just before routing)."""
        cap = runtime.capacity()
        return cls(name=runtime.name, kind=runtime.config.kind.value,
                   backends=tuple(LocalBackend(b, free, backend.slots, backend.speed.prefill_tps)
                                  for (b, free), backend in zip(cap.free_by_backend, runtime.backends, strict=True)),
                   slots=cap.slots, can_serve=runtime.can_ever_serve,
                   ctx_per_slot=runtime.ctx_per_slot, engine=runtime.config.engine,
                   ejected=tuple(LocalBackend(b, free) for b, free in cap.ejected) if cap.ejected else (),
                   endpoints=runtime.endpoints,
                   away=(runtime.gang.away() or "") if runtime.gang is not None else "")

    def restored(self) -> LocalModel:
        """This picture as if no backend were ejected."""
        if not self.ejected:
            return self
        out = {b.backend_id: b for b in self.backends}
        out.update((b.backend_id, b) for b in self.ejected)
        # An ejected backend's slots: at least its free ones (its busy ones are not known here).
        slots = self.slots + sum(max(b.free, 1) for b in self.ejected)
        return dataclasses.replace(self, backends=tuple(out.values()), slots=slots, ejected=())

    def without(self, avoid: Collection[str]) -> LocalModel:
        """This picture without the backends in ``avoid`` (those a request failed on) among
        ``backends`` and ``ejected``; ``slots`` stays (the node still counts as serving it)."""
        return dataclasses.replace(self, backends=tuple(b for b in self.backends if b.backend_id not in avoid),
                                   ejected=tuple(b for b in self.ejected if b.backend_id not in avoid))


@dataclass(frozen=True, slots=True)
class PeerSnapshot:
    """One peer as this node sees it now (see ``viiwork.mesh.membership.PeerView``).

    ``age_ms``: time since the peer published the summary we hold, by our clock; ``order``:
    the summary's (generation, seq), which tells reservations that a newer summary came;
    ``rtt_ms``: the last measured round trip, None until measured; ``endpoints``: its
    ``endpoints`` extension, None when it publishes none (every model: :data:`CLASSIC`);
    ``prefixes`` and ``speeds``: its ``prefixes`` and ``speeds`` extensions (None: it
    publishes none)."""

    node_id: NodeId
    name: str
    liveness: Liveness
    state: PublishedState
    age_ms: float
    order: tuple[int, int]
    models: tuple[ModelCapacity, ...]
    rtt_ms: float | None = None
    endpoints: Endpoints | None = None
    prefixes: Prefixes | None = None
    speeds: Speeds | None = None

    @classmethod
    def from_view(cls, view: PeerView) -> PeerSnapshot:
        return cls(node_id=view.node_id, name=view.name, liveness=view.liveness, state=view.state,
                   age_ms=float(view.age_ms), order=(view.generation, view.seq), models=view.models,
                   rtt_ms=view.rtt_ms, endpoints=view.extensions.get(ENDPOINTS),
                   prefixes=view.extensions.get(PREFIXES), speeds=view.extensions.get(SPEEDS))

    def model(self, name: str) -> ModelCapacity | None:
        for m in self.models:
            if m.name == name:
                return m
        return None

    def endpoints_of(self, model: str) -> frozenset[str]:
        """The endpoint names this peer serves ``model`` at: as it publishes them, else
        :data:`CLASSIC` (a peer, or a model, it says nothing of)."""
        served = self.endpoints.of(model) if self.endpoints is not None else None
        return CLASSIC if served is None else served


# --- reservations -----------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Reservation:
    """A token for one request sent to ``peer`` for ``model``; give it back with
    :meth:`Reservations.release` when the request ends (success, error or refusal)."""

    peer: NodeId
    model: str
    epoch: int
    made_at_ms: float


@dataclass(slots=True)
class _PeerBook:
    order: tuple[int, int] | None = None  # None: no summary seen yet
    epoch: int = 0
    pending: dict[str, list[float]] = field(default_factory=dict)  # model -> made_at of this epoch
    completed: dict[str, int] = field(default_factory=dict)  # counted in the summary, since ended
    full: dict[str, float] = field(default_factory=dict)  # model -> when last refused, since the summary


class Reservations:
    """This node's own effect on each peer since that peer's last summary.

    A peer's summary is up to a second old; in the meantime this node knows what it did
    itself: requests it sent there (``reserve``: one fewer free slot), requests it sent
    earlier that the summary counted as busy and that have ended (``release`` of an older
    reservation: one more free slot), and refusals (``mark_full``: no free slot until the
    next summary). All of it is dropped when a newer summary of that peer is seen (its
    ``order`` increases): the peer's own figures then include it.

    ``clock``: monotonic milliseconds. Single-threaded (the event loop); no locks.
    """

    def __init__(self, clock: Callable[[], float], max_age_ms: float = RESERVATION_MAX_AGE_MS) -> None:
        self.clock = clock
        self.max_age_ms = max_age_ms
        self._books: dict[NodeId, _PeerBook] = {}

    def _book(self, peer: NodeId) -> _PeerBook:
        book = self._books.get(peer)
        if book is None:
            book = self._books[peer] = _PeerBook()
        return book

    def observe(self, peer: NodeId, order: tuple[int, int]) -> None:
        """A summary of ``peer`` with ``order`` (generation, seq) is held: a newer one than
        last seen clears what this node counted against that peer."""
        book = self._book(peer)
        if book.order is None:
            book.order = order  # the first summary seen: what was reserved before still counts
        elif order > book.order:
            book.order = order
            book.epoch += 1
            book.pending.clear()
            book.completed.clear()
            book.full.clear()

    def reserve(self, peer: NodeId, model: str) -> Reservation:
        """Count one request sent to ``peer`` for ``model``."""
        book = self._book(peer)
        now = self.clock()
        book.pending.setdefault(model, []).append(now)
        return Reservation(peer, model, book.epoch, now)

    def release(self, token: Reservation) -> None:
        """The request of ``token`` ended. Reserved since the current summary: it no longer
        takes a slot. Reserved before it: that summary counted it busy, so one slot more is
        free than the summary says, until the next one."""
        book = self._books.get(token.peer)
        if book is None:
            return
        if token.epoch == book.epoch:
            made = book.pending.get(token.model)
            if made and token.made_at_ms in made:
                made.remove(token.made_at_ms)
        else:
            book.completed[token.model] = book.completed.get(token.model, 0) + 1

    def mark_full(self, peer: NodeId, model: str) -> None:
        """``peer`` refused a forward for ``model`` (429/503): treat it as full until its next
        summary."""
        self._book(peer).full[model] = self.clock()

    def refused_ago_ms(self, peer: NodeId, model: str) -> float | None:
        """Milliseconds since ``peer`` last refused ``model`` since its summary, or None."""
        book = self._books.get(peer)
        at = None if book is None else book.full.get(model)
        return None if at is None else self.clock() - at

    def adjustment(self, peer: NodeId, model: str) -> int | None:
        """Slots to add to the summary's free count (negative: taken by us), or None when the
        peer refused since its summary (count it as full)."""
        book = self._books.get(peer)
        if book is None:
            return 0
        if model in book.full:
            return None
        made = book.pending.get(model)
        if made:
            horizon = self.clock() - self.max_age_ms
            if made[0] < horizon:
                made[:] = [t for t in made if t >= horizon]
        return book.completed.get(model, 0) - (len(made) if made else 0)

    def forget(self, peer: NodeId) -> None:
        """Drop everything about ``peer`` (it left the table)."""
        self._books.pop(peer, None)


# --- decisions --------------------------------------------------------------------------------


# The rule that decided (the X-Viiwork-Route header, docs/routing.md "Explaining a route").
ROUTE_PINNED = "pinned"
ROUTE_AFFINITY = "affinity"
ROUTE_LEAST_LOADED = "least-loaded"
ROUTE_PROBE = "probe"


def route_guarded(blocks: int) -> str:
    """The route of the least-loaded rule: with the blocks of a hit the balance guard declined."""
    return f"{ROUTE_LEAST_LOADED} guarded={blocks}" if blocks > 0 else ROUTE_LEAST_LOADED


def route_prefix(blocks: int) -> str:
    """The route of a prefix decision: a hit of ``blocks`` blocks, or (0) the predicted
    fastest candidate when a hit elsewhere was not the fastest."""
    return f"prefix-hit blocks={blocks}" if blocks > 0 else "predicted-ttft"


@dataclass(frozen=True, slots=True)
class RunLocal:
    """Run on this node's ``backend_id``; ``route``: the rule that chose it."""

    backend_id: str
    route: str = field(default=ROUTE_LEAST_LOADED, compare=False)  # an explanation, not part of the decision


@dataclass(frozen=True, slots=True)
class RunOnPeer:
    """Forward to ``node_id``; ``free``: the free slots counted for it (for logs); ``route``:
    the rule that chose it."""

    node_id: NodeId
    name: str
    free: int
    route: str = field(default=ROUTE_LEAST_LOADED, compare=False)


@dataclass(frozen=True, slots=True)
class Queue:
    """Wait at the origin and route again when capacity changes. ``reason`` for logs."""

    reason: str


@dataclass(frozen=True, slots=True)
class Refuse:
    """An error for the client: ``status`` 400/404/503, an OpenAI-shaped error's ``message``,
    ``param`` and ``code``; ``retry_after_s`` for 503."""

    status: int
    message: str
    param: str | None = None
    code: str | None = None
    retry_after_s: int | None = None


Decision = RunLocal | RunOnPeer | Queue | Refuse


@dataclass(frozen=True, slots=True)
class _Target:
    node_id: NodeId
    name: str
    free: int
    slots: int
    rtt_ms: float | None
    local_backend: str | None = None  # set for this node


# --- the router -------------------------------------------------------------------------------


class Router:
    """Routing decisions for one node (see the module doc for the rules).

    ``self_id`` / ``self_name``: this node (host selection may name it); ``stale_after_ms``:
    ``routing.stale_after_ms`` (a peer's summary older than this is not routed to);
    ``reservations``: this node's :class:`Reservations`; ``rng``: randomness for spreading;
    ``probe``: ask a likely peer when none appears free (rule 5 of the module doc). Off by
    default: with slot offers (``viiwork.agent.peering.offers``) a freed slot reaches the oldest
    waiter without guessing, and probing then only lets a younger request take a slot out of
    turn (simulation at 80% load: p99 563 ms with probing, 538 ms without, and 4x the refused
    forwards; docs/benchmarks-routing.md).
    """

    def __init__(self, self_id: NodeId, self_name: str, *, stale_after_ms: float, reservations: Reservations,
                 rng: random.Random, probe: bool = False) -> None:
        self.self_id = self_id
        self.self_name = self_name
        self.stale_after_ms = stale_after_ms
        self.reservations = reservations
        self.rng = rng
        self.probe = probe

    # -- public --------------------------------------------------------------------------

    def route(self, model: str, local: Mapping[str, LocalModel], peers: Sequence[PeerSnapshot], *,
              affinity: str | None = None, host: str | None = None,
              exclude: Collection[NodeId] = (), avoid: Collection[str] = (),
              ejected: Collection[NodeId] = (), endpoint: str | None = None,
              prefix: PrefixQuery | None = None) -> Decision:
        """Decide where a request for ``model`` at ``endpoint`` runs now.

        ``local``: this node's models by name; ``peers``: every peer in the mesh table;
        ``affinity``: the session key, or None; ``host``: the pinned node (id or name), or
        None; ``exclude``: peers already tried for this request (they refused or failed
        before the first byte); ``avoid``: local backends it failed on; ``ejected``: peers
        ejected for ``model`` in this node's view (outlier ejection, see the module doc);
        ``endpoint``: the endpoint's name (engines/contract.py ``Endpoint``): only this node and
        the peers that serve it for ``model`` are considered, and when none does (the model is
        known) 400 ``endpoint_not_supported`` (:func:`endpoint_refusal`); None: any;
        ``prefix``: the request's prefix and this node's hits (rule 2b; None: not scored).
        Never raises for any input; errors are :class:`Refuse`.
        """
        for p in peers:
            self.reservations.observe(p.node_id, p.order)
        here = local.get(model)
        serving = [p for p in peers if p.model(model) is not None]
        if here is None and not serving:
            known = ", ".join(m["id"] for m in mesh_models(local, peers)) or "none"
            return Refuse(404, f"model {model!r} is not served anywhere in the mesh; known models: {known}",
                          param="model", code="model_not_found")
        if endpoint is not None:
            here_serves = here is not None and endpoint in here.endpoints
            serves = [p for p in serving if endpoint in p.endpoints_of(model)]
            if not here_serves and not serves:
                if host is not None:  # the pinned node's own refusal names it (or the host's fault)
                    pinned = self._pinned_endpoint(model, endpoint, here, here_serves, peers, host)
                    if pinned is None and isinstance(decided := self._pinned(model, here, peers, host), Refuse):
                        pinned = decided
                    if pinned is not None:
                        return pinned
                served = set(here.endpoints) if here is not None else set()
                for p in serving:
                    served |= p.endpoints_of(model)
                return endpoint_refusal(model, endpoint, served)
            if host is not None:
                refusal = self._pinned_endpoint(model, endpoint, here, here_serves, peers, host)
                if refusal is not None:
                    return refusal
            here, serving = (here if here_serves else None), serves
        if here is not None and avoid:
            here = here.without(avoid)
        if host is not None:
            return self._pinned(model, here.restored() if here is not None else None, peers, host)
        if ejected or (here is not None and here.ejected):
            here, exclude = self._eject(model, here, serving, exclude, ejected)
        targets = self._targets(model, here, serving, exclude)
        if affinity:
            chosen = self._by_affinity(affinity, targets)
            if chosen is not None:
                return self._decision(chosen, ROUTE_AFFINITY)
        least_loaded = ROUTE_LEAST_LOADED
        if prefix is not None:
            scored, guarded = self._by_prefix(model, here, serving, targets, prefix)
            if scored is not None:
                return scored
            least_loaded = route_guarded(guarded)
        if here is not None:
            best = _best_local(here)
            if best is not None:
                return RunLocal(best.backend_id, least_loaded)
        remote = [t for t in targets if t.local_backend is None and t.free > 0]
        if remote:
            return self._decision(self._spread(remote), least_loaded)
        if self.probe:
            probe = self._probe(model, serving, exclude)
            if probe is not None:
                return probe
        return self._queue_or_refuse(model, here, serving)

    def models(self, local: Mapping[str, LocalModel], peers: Sequence[PeerSnapshot]) -> list[dict[str, Any]]:
        """The mesh-wide ``/v1/models`` list (see :func:`mesh_models`)."""
        return mesh_models(local, peers)

    # -- internals -----------------------------------------------------------------------

    def _eject(self, model: str, here: LocalModel | None, serving: Sequence[PeerSnapshot],
               exclude: Collection[NodeId], ejected: Collection[NodeId]) -> tuple[LocalModel | None, Collection[NodeId]]:
        """The picture with ejected peers excluded, or, when nothing else is left (no local
        healthy backend, no routable peer that is not ejected), with every ejection ignored."""
        if (here is not None and here.slots > 0) or any(
                p.node_id not in ejected and self._routable(p, model, exclude) is not None for p in serving):
            return here, {*exclude, *ejected}
        return (here.restored() if here is not None else None), exclude

    def fresh(self, peer: PeerSnapshot) -> bool:
        """Routable now: alive, serving, summary younger than ``stale_after_ms``."""
        return (peer.liveness is Liveness.ALIVE and peer.state is PublishedState.SERVING
                and peer.age_ms < self.stale_after_ms)

    def _routable(self, peer: PeerSnapshot, model: str, exclude: Collection[NodeId]) -> ModelCapacity | None:
        """``peer``'s capacity for ``model`` when a request may go there now (not in
        ``exclude``, ``fresh``, with slots for it), else None."""
        if peer.node_id in exclude or not self.fresh(peer):
            return None
        cap = peer.model(model)
        return cap if cap is not None and cap.slots > 0 else None

    def _peer_free(self, peer: PeerSnapshot, cap: ModelCapacity) -> int:
        adjust = self.reservations.adjustment(peer.node_id, cap.name)
        if adjust is None:
            return 0
        return max(0, min(cap.slots, cap.free + adjust))

    def _targets(self, model: str, here: LocalModel | None, serving: Iterable[PeerSnapshot],
                 exclude: Collection[NodeId]) -> list[_Target]:
        out: list[_Target] = []
        if here is not None and here.slots > 0:
            best = _best_local(here)
            out.append(_Target(self.self_id, self.self_name, best.free if best else 0, here.slots, 0.0,
                               best.backend_id if best else ""))
        for p in serving:
            cap = self._routable(p, model, exclude)
            if cap is None:
                continue
            out.append(_Target(p.node_id, p.name, self._peer_free(p, cap), cap.slots, p.rtt_ms))
        return out

    def _by_affinity(self, key: str, targets: list[_Target]) -> _Target | None:
        ranked = sorted(targets, key=lambda t: _rendezvous_score(key, t.node_id, t.slots), reverse=True)
        for t in ranked:
            if t.free > 0:
                return t
        return None

    def _by_prefix(self, model: str, here: LocalModel | None, serving: Sequence[PeerSnapshot],
                   targets: Sequence[_Target], prefix: PrefixQuery) -> tuple[Decision | None, int]:
        """Rule 2b: score every local backend and routable peer with a free slot. Returns the
        decision (None: the least-loaded rule decides) and the blocks of a hit the balance
        guard declined (0: none)."""
        candidates = _local_candidates(here, prefix, self.self_id) if here is not None else []
        snapshots = {p.node_id: p for p in serving}
        for t in targets:
            if t.local_backend is not None or t.free <= 0:
                continue
            p = snapshots[t.node_id]
            blocks: int | None = None
            if p.prefixes is not None:
                blocks = peer_hit(prefix.hex, p.prefixes.set_of(model))
            speed = p.speeds.of(model) if p.speeds is not None else None
            tps = float(speed.prefill_tps) if speed is not None and speed.prefill_tps > 0 else None
            candidates.append(Candidate(t.node_id, None, t.free, t.slots, t.rtt_ms, tps, blocks))
        scored = choose(candidates, prefix.prompt_bytes, prefix.service_s, prefix.guard)
        if scored is None:
            return None, guarded_blocks(candidates, prefix.guard)
        c = scored.candidate
        route = route_prefix(c.blocks or 0)
        if c.backend_id is not None:
            return RunLocal(c.backend_id, route), 0
        peer = snapshots[NodeId(c.node)]
        return RunOnPeer(peer.node_id, peer.name, c.free, route), 0

    def _spread(self, remote: list[_Target]) -> _Target:
        most = max(t.free for t in remote)
        near = [t for t in remote if t.free >= most - NEAR_FREE]
        rtts = [t.rtt_ms for t in near if t.rtt_ms is not None]
        if rtts:
            bound = max(NEAR_RTT_MS, 2.0 * min(rtts))
            # An unmeasured RTT is neither preferred nor excluded.
            near = [t for t in near if t.rtt_ms is None or t.rtt_ms <= bound]
        if len(near) == 1:
            return near[0]
        total = sum(t.free for t in near)
        pick = self.rng.random() * total
        for t in near:
            pick -= t.free
            if pick < 0:
                return t
        return near[-1]

    def _probe(self, model: str, serving: Sequence[PeerSnapshot], exclude: Collection[NodeId]) -> Decision | None:
        best: tuple[float, PeerSnapshot, ModelCapacity] | None = None
        for p in serving:
            cap = self._routable(p, model, exclude)
            if cap is None:
                continue
            # What we know of the peer is as old as its summary or its last refusal; the older,
            # the likelier one of its busy slots has freed since.
            known_ms = p.age_ms
            refused = self.reservations.refused_ago_ms(p.node_id, model)
            if refused is not None:
                known_ms = min(known_ms, refused)
            if known_ms < PROBE_MIN_MS:
                continue
            score = known_ms * cap.slots * (1.0 + 0.25 * self.rng.random())
            if best is None or score > best[0]:
                best = (score, p, cap)
        if best is None or best[0] <= 0:
            return None
        return RunOnPeer(best[1].node_id, best[1].name, 0, ROUTE_PROBE)

    def _decision(self, t: _Target, route: str = ROUTE_LEAST_LOADED) -> Decision:
        if t.local_backend is not None:
            return RunLocal(t.local_backend, route)
        return RunOnPeer(t.node_id, t.name, t.free, route)

    def _pinned(self, model: str, here: LocalModel | None, peers: Sequence[PeerSnapshot], host: str) -> Decision:
        if host in (self.self_id, self.self_name) and not any(p.node_id == host for p in peers):
            named = [p for p in peers if p.name == host]
            if host == self.self_name and named:
                ids = ", ".join(sorted([self.self_id, *(p.node_id for p in named)]))
                return Refuse(404, f"host {host!r} is ambiguous: {len(named) + 1} nodes carry that name; "
                              f"name one by node id: {ids}", param="host", code="host_ambiguous")
            if here is None:
                return Refuse(400, f"host {host!r} (this node) does not serve model {model!r}",
                              param="host", code="model_not_on_host")
            best = _best_local(here)
            if best is not None:
                return RunLocal(best.backend_id, ROUTE_PINNED)
            if not here.can_serve:
                return Refuse(503, f"host {host!r} (this node) cannot serve model {model!r} now: no backend "
                              "is healthy or starting", code="no_capacity", retry_after_s=5)
            return Queue(f"pinned to this node, no free slot for {model!r}")
        by_id = [p for p in peers if p.node_id == host]
        matches = by_id or [p for p in peers if p.name == host]
        if not matches:
            nodes = ", ".join(sorted({self.self_name, *(p.name for p in peers)}))
            return Refuse(404, f"host {host!r} is not a node of this mesh (by id or name); known nodes: {nodes}",
                          param="host", code="host_not_found")
        if len(matches) > 1:
            ids = ", ".join(sorted(p.node_id for p in matches))
            return Refuse(404, f"host {host!r} is ambiguous: {len(matches)} nodes carry that name; name one by "
                          f"node id: {ids}", param="host", code="host_ambiguous")
        peer = matches[0]
        cap = peer.model(model)
        if cap is None:
            served = ", ".join(m.name for m in peer.models) or "no models"
            return Refuse(400, f"host {peer.name!r} ({peer.node_id}) does not serve model {model!r}; it serves "
                          f"{served}", param="host", code="model_not_on_host")
        if peer.liveness is Liveness.CONFLICT:
            return Refuse(503, f"host {peer.name!r} ({peer.node_id}) is run by two agents at once (a copied state "
                          "dir); it gets no requests until one of them stops (docs/mesh.md, \"One node per "
                          "identity\")", code="no_capacity", retry_after_s=5)
        if peer.liveness in (Liveness.DEAD, Liveness.LEFT) or peer.state is PublishedState.LEAVING:
            return Refuse(503, f"host {peer.name!r} ({peer.node_id}) is {peer.liveness.value}; it cannot run "
                          f"{model!r} now", code="no_capacity", retry_after_s=5)
        if cap.total == 0:
            return Refuse(503, f"host {peer.name!r} ({peer.node_id}) has no backend for {model!r}",
                          code="no_capacity", retry_after_s=5)
        if self.fresh(peer) and self._peer_free(peer, cap) > 0:
            return RunOnPeer(peer.node_id, peer.name, self._peer_free(peer, cap), ROUTE_PINNED)
        return Queue(f"pinned to {peer.name}, which has no free slot for {model!r} now "
                     f"({peer.liveness.value}, summary {peer.age_ms:.0f} ms old)")

    def _pinned_endpoint(self, model: str, endpoint: str, here: LocalModel | None, here_serves: bool,
                         peers: Sequence[PeerSnapshot], host: str) -> Refuse | None:
        """400 ``endpoint_not_supported`` when the pinned node serves ``model`` but not at
        ``endpoint``; None otherwise (:meth:`_pinned` then decides as for any request)."""
        if host in (self.self_id, self.self_name) and not any(p.node_id == host or p.name == host for p in peers):
            if here is not None and not here_serves:
                return endpoint_refusal(model, endpoint, here.endpoints, f"host {host!r} (this node)")
            return None
        matches = [p for p in peers if p.node_id == host] or [p for p in peers if p.name == host]
        if len(matches) == 1 and matches[0].model(model) is not None:
            served = matches[0].endpoints_of(model)
            if endpoint not in served:
                return endpoint_refusal(model, endpoint, served, f"host {matches[0].name!r} ({matches[0].node_id})")
        return None

    def _queue_or_refuse(self, model: str, here: LocalModel | None, serving: Sequence[PeerSnapshot]) -> Decision:
        if here is not None and here.can_serve:
            return Queue(f"no free slot for {model!r} on this node or a fresh peer")
        # Worth waiting for: a serving peer that is alive or suspect, and one restarting (it
        # said it is back soon, docs/mesh.md); draining and leaving peers are not.
        later = [p for p in serving if p.liveness in (Liveness.ALIVE, Liveness.SUSPECT)
                 and p.state in (PublishedState.SERVING, PublishedState.RESTARTING)
                 and (cap := p.model(model)) is not None and cap.total > 0]
        if later:
            return Queue(f"no free slot for {model!r}; {len(later)} peer(s) serve it")
        where = []
        if here is not None:
            where.append("this node has no healthy or starting backend"
                         + (f" (its gang's worker host {here.away})" if here.away else ""))
        gone = [f"{p.name} ({p.liveness.value}, {p.state.value})" for p in serving]
        if gone:
            where.append("peers that serve it: " + ", ".join(sorted(gone)))
        return Refuse(503, f"model {model!r} cannot be served now: " + "; ".join(where), code="no_capacity",
                      retry_after_s=5)


def endpoint_refusal(model: str, endpoint: str, served: Iterable[str], where: str = "") -> Refuse:
    """400 ``endpoint_not_supported``: no backend of ``model`` (on ``where``, a pinned node;
    "": anywhere) serves ``endpoint``; the message names the endpoints it does serve
    (``served``, names; those this node does not know are left out)."""
    paths = endpoint_paths(served)
    path = ENDPOINT_PATHS[Endpoint(endpoint)] if endpoint in _KNOWN_ENDPOINTS else endpoint
    on = f" on {where}" if where else ""
    return Refuse(400, f"model {model!r} is not served at {path}{on}; its backends serve: "
                  f"{', '.join(paths) or 'no endpoint this node knows'}", param="model", code="endpoint_not_supported")


_KNOWN_ENDPOINTS = frozenset(e.value for e in Endpoint)
def _local_candidates(here: LocalModel, prefix: PrefixQuery, self_id: str) -> list[Candidate]:
    return [Candidate(self_id, b.backend_id, b.free, max(b.slots, b.free), 0.0, b.prefill_tps,
                      prefix.local_hits.get(b.backend_id, 0)) for b in here.backends if b.free > 0]


def local_by_prefix(here: LocalModel, prefix: PrefixQuery) -> tuple[RunLocal | None, int]:
    """Rule 2b over this node's backends alone (a node without a mesh): the backend with the
    smallest predicted TTFT when one within the guard holds a hit, else None; and the blocks
    of a hit the guard declined (0: none)."""
    candidates = _local_candidates(here, prefix, "")
    scored = choose(candidates, prefix.prompt_bytes, prefix.service_s, prefix.guard)
    if scored is None or scored.candidate.backend_id is None:
        return None, guarded_blocks(candidates, prefix.guard)
    return RunLocal(scored.candidate.backend_id, route_prefix(scored.candidate.blocks or 0)), 0


def _best_local(here: LocalModel) -> LocalBackend | None:
    best: LocalBackend | None = None
    for b in here.backends:
        if b.free > 0 and (best is None or b.free > best.free):
            best = b
    return best


def _rendezvous_score(key: str, node_id: str, weight: int) -> float:
    """Weighted rendezvous (highest random weight) score: ``-weight / ln(u)`` with ``u`` in
    (0, 1) from a hash of key and node, so each node wins a share of keys proportional to its
    weight and removing a node moves only the keys it won."""
    digest = hashlib.blake2b(f"{key}\0{node_id}".encode("utf-8", "surrogatepass"), digest_size=8).digest()
    u = (int.from_bytes(digest, "big") + 1) / (2**64 + 2)
    return -max(weight, 1) / math.log(u)


def mesh_models(local: Mapping[str, LocalModel], peers: Sequence[PeerSnapshot]) -> list[dict[str, Any]]:
    """Every model served in the mesh, once, sorted by name: this node's models and those of
    peers that are alive or suspect and not leaving. Each entry is an OpenAI model object
    plus ``kind``, ``engine``, ``nodes`` (how many nodes serve it) and ``max_model_len`` /
    ``context_length``: the smallest known ``ctx_per_slot`` across the fleet (a request that
    fits it fits wherever it is routed; 0 when no node knows it yet), and ``endpoints``: the
    paths some node serves it at, sorted (docs/routing.md, "Endpoints")."""
    seen: dict[str, dict[str, Any]] = {}
    served: dict[str, set[str]] = {}

    def add(name: str, kind: str, engine: str, ctx: int, endpoints: frozenset[str]) -> None:
        served.setdefault(name, set()).update(endpoints)
        entry = seen.get(name)
        if entry is None:
            seen[name] = {"id": name, "object": "model", "created": 0, "owned_by": "viiwork", "kind": kind,
                          "engine": engine, "nodes": 1, "max_model_len": ctx, "context_length": ctx}
            return
        entry["nodes"] += 1
        if ctx > 0 and (entry["max_model_len"] == 0 or ctx < entry["max_model_len"]):
            entry["max_model_len"] = entry["context_length"] = ctx

    for m in local.values():
        add(m.name, m.kind, m.engine, m.ctx_per_slot, m.endpoints)
    for p in peers:
        if p.liveness in (Liveness.ALIVE, Liveness.SUSPECT) and p.state is not PublishedState.LEAVING:
            for cap in p.models:
                add(cap.name, cap.kind, cap.engine, cap.ctx_per_slot, p.endpoints_of(cap.name))
    for name, entry in seen.items():
        entry["endpoints"] = endpoint_paths(served[name])
    return [seen[name] for name in sorted(seen)]


def endpoint_paths(names: Iterable[str]) -> list[str]:
    """The paths of the endpoint ``names`` this node knows, sorted (unknown names left out)."""
    return sorted(ENDPOINT_PATHS[Endpoint(name)] for name in set(names) if name in _KNOWN_ENDPOINTS)


__all__ = ["CLASSIC", "ROUTE_AFFINITY", "ROUTE_LEAST_LOADED", "route_guarded", "ROUTE_PINNED", "ROUTE_PROBE", "Decision",
           "LocalBackend", "LocalModel", "PeerSnapshot", "Queue", "Refuse", "Reservation", "Reservations", "Router",
           "RunLocal", "RunOnPeer", "endpoint_paths", "endpoint_refusal", "local_by_prefix", "mesh_models",
           "route_prefix"]
