"""One request's life on this node: admit -> route -> run locally | forward | wait.

One module (over 400 lines) because it is that one life, read top to bottom in
``Pipeline.run``; the two ``Peers`` it runs with (a mesh's, and :class:`NoPeers`) are the
contract of its "forward" and "wait" steps. The decisions are elsewhere (the router, the
wait queue, outlier ejection).

``Pipeline.run`` is the whole path of a client's inference request, top to bottom; a
request a peer forwarded here enters at "run locally" (``Pipeline.run_forwarded``). A node
without ``[mesh]`` runs the same pipeline with :class:`NoPeers`; with ``[mesh]`` the
:class:`Peers` are ``viiwork.agent.peering.mesh_link.MeshLink`` (routing over the mesh table,
forwarding over its mutual TLS, slot offers). Waiting is the model's origin queue
(``agent/serving/waitqueue.py``): a freed slot, local or offered by a peer, goes to its first
waiter (the key's priority, then tenants in turn, then arrival). The HTTP layer
(``agent/serving/api.py``) parses and validates the request before, and renders what this
returns after: an upstream response, or a :class:`Refuse`.

A failure before the first byte reached the client (an engine 5xx that is not the client's
fault, a reset, silence: ``Failed``) is retried on another backend, here or on a peer, within
``routing.forward_retry``, at once or after a wait in the queue; the client gets the engine's
error only when no other backend can take the request. Every outcome feeds outlier ejection
(``agent/serving/ejections.py``; docs/routing.md, "Outlier ejection"): a 2xx or 3xx is a
success, a 4xx the client's (counted for nothing), a failure a failure; but a failure before
the first byte is held until the request ends (``Pipeline._settle``): a retry that fails too
makes both the request's fault, counted against no backend.

Answers that differ with or without a mesh keep their own words: an unknown model is "not
served here" on a standalone node and "not served anywhere in the mesh" in a mesh; a full
queue or a wait too long names the mesh only in a mesh (docs/routing.md, "Status codes").
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Collection, Iterable, Mapping
from dataclasses import dataclass
from typing import Protocol

from aiohttp import web

from viiwork.agent.serving.accounting import Accounting
from viiwork.agent.serving.drain import InFlight
from viiwork.agent.serving.ejections import Ejections
from viiwork.agent.serving.errors import ErrorCode
from viiwork.agent.serving.prefix_routing import PrefixRouting, PrefixSettings
from viiwork.agent.serving.prefixes import PrefixKey
from viiwork.agent.serving.proxy import BROKE, Failed, Refused, Upstream
from viiwork.agent.serving.route_header import ROUTE_HEADER, route_entry, route_from_origin
from viiwork.agent.serving.router import (
    ROUTE_LEAST_LOADED,
    Decision,
    LocalModel,
    Queue,
    Refuse,
    RunLocal,
    RunOnPeer,
    endpoint_refusal,
    local_by_prefix,
    route_guarded,
)
from viiwork.agent.serving.scoring import PrefixQuery
from viiwork.agent.serving.waitqueue import Queues, Waiter, WaitQueue
from viiwork.agent.supervision.backends import Backend, ModelRuntime
from viiwork.mesh.extensions import Priority
from viiwork.mesh.identity import NodeId

log = logging.getLogger(__name__)

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


@dataclass(slots=True)
class Call:
    """One inference request, parsed and validated by the HTTP layer."""

    request: web.Request
    body: bytes
    model: str
    kind: str | None  # the kind the endpoint needs (chat, embedding); None: any (the endpoint decides)
    stream: bool
    request_id: str
    # The endpoint's name (engines/contract.py ``Endpoint``): only backends that serve it run it.
    endpoint: str | None = None
    host: str | None = None  # ?host= / X-Viiwork-Host
    affinity: str | None = None  # X-Session-Id / X-Session-Affinity
    # Seconds from admission to its last dispatch to a backend or peer (X-Viiwork-Queued-Ms);
    # None while it has not been dispatched (refused, or timed out in the queue). A forward
    # from a peer: the origin's (its X-Viiwork-Queued-Ms).
    queued_s: float | None = None
    # Its key's priority and tenant (agent/auth; normal and "" without keys): its place in the
    # origin queue (agent/serving/turns.py), and on a forward the priority a claim is checked at.
    priority: Priority = Priority.NORMAL
    tenant: str = ""
    # For its usage row (agent/serving/accounting.py): the client key's tenant and id ("" with
    # keys off), the peer that forwarded it ("" for this node's client), the loop time it arrived.
    jti: str = ""
    origin: str = ""
    arrived: float = 0.0
    # A stream whose client did not ask for usage: the agent asked (agent/serving/tokens.py)
    # and removes the usage event from the client's stream.
    strip_usage: bool = False
    # Its prompt's chained block digests (agent/serving/prefixes.py); None: no prompt, or
    # prefix routing off.
    prefix: PrefixKey | None = None


class Peers(Protocol):
    """The rest of the mesh, as the pipeline sees it (``MeshLink``, or :class:`NoPeers`)."""

    in_mesh: bool

    def unknown(self, model: str) -> Refuse | None:
        """The 404 for a model that cannot be known here at all, before any other check."""

    def kind_of(self, model: str) -> str | None:
        """The kind of a model this node does not serve, as peers publish it (None: unknown)."""

    def is_here(self, host: str | None) -> bool:
        """A request pinned to ``host`` (None: not pinned) may run on this node."""

    def route(self, model: str, *, host: str | None, affinity: str | None, exclude: set[NodeId],
              avoid: Collection[str] = (), endpoint: str | None = None,
              prefix: PrefixQuery | None = None) -> Decision:
        """Where ``model``'s request at ``endpoint`` (None: any) runs now; ``exclude``: peers tried
        for it, ``avoid``: local backends it failed on; ``prefix``: its prefix for scoring (None:
        none)."""

    async def forward(self, call: Call, to: RunOnPeer, offer_id: str | None,
                      headers: dict[str, str]) -> web.StreamResponse | Refused | Failed:
        """Send ``call`` to a peer; ``Refused`` before the first byte (route it again),
        ``Failed`` when the peer answered a 5xx before it (retry elsewhere, or relay it)."""

    def elsewhere(self, model: str, exclude: Collection[NodeId], avoid: Collection[str]) -> bool:
        """Could another backend take a request for ``model``, now or once a slot frees: a
        healthy local one not in ``avoid``, a fresh peer serving it not in ``exclude`` and not
        ejected? (After a failure: wait for it, or answer the failure at once.)"""

    def slot_freed(self, queue: WaitQueue) -> None:
        """A local slot of ``queue``'s model freed: hold it for an older waiter elsewhere,
        or ``queue.grant()`` it to the first waiter here."""

    def peer_name(self, node_id: NodeId | None) -> str: ...

    def claim(self, model: str, offer_id: str | None, origin: NodeId | None) -> Backend | None:
        """The slot held for ``origin``'s offer ``offer_id``, or None."""

    def admit_forward(self, queue: WaitQueue, offer_id: str | None, origin: NodeId | None,
                      priority: Priority = Priority.NORMAL, prefer: str | None = None) -> Backend | None:
        """The slot for a request ``origin`` forwarded (its key's verified ``priority``): the
        one held for its offer, else a free one (``prefer``'s when it has one; never queued);
        None when there is none."""

    def accept_forwards(self, handler: Handler, paths: Iterable[str], in_flight: InFlight) -> None:
        """Serve ``handler`` for forwards from peers at ``paths`` (counted in ``in_flight``)."""


class NoPeers:
    """A node without ``[mesh]``: a mesh of one. Routes to this node's backends only."""

    in_mesh = False

    def __init__(self, runtimes: Mapping[str, ModelRuntime]) -> None:
        self.runtimes = runtimes

    def unknown(self, model: str) -> Refuse | None:
        if model in self.runtimes:
            return None
        known = ", ".join(sorted(self.runtimes)) or "none"
        return Refuse(404, f"model {model!r} is not served here; known models: {known}", param="model",
                      code=ErrorCode.MODEL_NOT_FOUND)

    def kind_of(self, model: str) -> str | None:
        return None

    def is_here(self, host: str | None) -> bool:
        return True  # no other node to pin to: ?host= means nothing here

    def route(self, model: str, *, host: str | None, affinity: str | None, exclude: set[NodeId],
              avoid: Collection[str] = (), endpoint: str | None = None,
              prefix: PrefixQuery | None = None) -> Decision:
        runtime = self.runtimes[model]
        if endpoint is not None and endpoint not in runtime.endpoints:
            return endpoint_refusal(model, endpoint, runtime.endpoints)
        least_loaded = ROUTE_LEAST_LOADED
        if prefix is not None:  # the same score as in a mesh, over this node's backends
            scored, guarded = local_by_prefix(LocalModel.from_runtime(runtime).without(avoid), prefix)
            if scored is not None:
                return scored
            least_loaded = route_guarded(guarded)
        best = runtime.most_free()
        if best is None or best.id in avoid:  # every free backend ejected, or this one failed it
            best = runtime.most_free_outside(avoid)
        if best is not None:
            return RunLocal(best.id, least_loaded)
        if not runtime.can_ever_serve:
            states = ", ".join(f"{b.id} {b.state.value}" + (f": {b.reason}" if b.reason else "")
                               for b in runtime.backends)
            why = f"model is {runtime.state.value}" + (f"; {states}" if states else "")
            return Refuse(503, f"model {model!r} has no backend that can serve it ({why})",
                          code=ErrorCode.NO_CAPACITY, retry_after_s=5)
        return Queue("all slots busy")

    async def forward(self, call: Call, to: RunOnPeer, offer_id: str | None,
                      headers: dict[str, str]) -> web.StreamResponse | Refused | Failed:
        return Refused(503, "no peers")  # never routed to: there are none

    def elsewhere(self, model: str, exclude: Collection[NodeId], avoid: Collection[str]) -> bool:
        runtime = self.runtimes.get(model)
        return runtime is not None and runtime.healthy_outside(avoid)

    def slot_freed(self, queue: WaitQueue) -> None:
        queue.grant()

    def peer_name(self, node_id: NodeId | None) -> str:
        return str(node_id)

    def claim(self, model: str, offer_id: str | None, origin: NodeId | None) -> Backend | None:
        return None

    def admit_forward(self, queue: WaitQueue, offer_id: str | None, origin: NodeId | None,
                      priority: Priority = Priority.NORMAL, prefer: str | None = None) -> Backend | None:
        return None

    def accept_forwards(self, handler: Handler, paths: Iterable[str], in_flight: InFlight) -> None:
        pass


class Pipeline:
    """The request path of one node (see the module doc).

    ``draining``: set by ``viiworkctl drain`` and the stop path; new requests get 503, those
    admitted or queued finish. ``forward_retry``: peers that refuse, and backends (local or
    peers) that fail, before the first byte are tried elsewhere this many times in all before
    the request waits (a refusal) or gets the error (a failure). ``ejections``: the node's
    outlier ejection (default: enabled, with default settings, nobody told). ``accounting``:
    the usage rows of the requests run here (agent/serving/accounting.py; None: none recorded).
    ``prefixes``: prefix-aware routing's state (agent/serving/prefix_routing.py; default: on,
    default settings).
    """

    def __init__(self, *, node_name: str, runtimes: Mapping[str, ModelRuntime], queues: Queues, peers: Peers,
                 upstream: Upstream, forward_retry: int = 1, ejections: Ejections | None = None,
                 accounting: Accounting | None = None, prefixes: PrefixRouting | None = None) -> None:
        self.node_name = node_name
        self.runtimes = runtimes
        self.queues = queues
        self.peers = peers
        self.upstream = upstream
        self.forward_retry = forward_retry
        self.ejections = ejections if ejections is not None else Ejections(runtimes)
        self.accounting = accounting
        self.prefixes = prefixes if prefixes is not None else PrefixRouting(PrefixSettings(), runtimes)
        self.draining = False
        self.retries = 0  # runs again elsewhere after a failure before the first byte

    async def run(self, call: Call) -> web.StreamResponse | Refuse:
        """A client's request: admit, then route and run it here or on a peer, or wait."""
        model = call.model
        # 1. Admit: a known model, the right endpoint for its kind, a node not draining.
        refusal = self.peers.unknown(model) or self._gate(model, call)
        if refusal is not None:
            return refusal
        queue = self.queues.of(model)
        loop = asyncio.get_running_loop()
        started = loop.time()
        deadline = started + queue.timeout_s
        waiter: Waiter | None = None
        tried: set[NodeId] = set()  # peers that refused or failed since the request last waited
        refusals = 0
        # A failure before the first byte (``Failed``): the request runs again elsewhere, within
        # forward_retry failures; ``failed`` is the answer when nothing else takes it.
        failed: Failed | None = None
        failures = 0
        failed_peers: set[NodeId] = set()
        avoid: set[str] = set()  # local backends it failed on
        # Its failures before the first byte, counted for outlier ejection when it ends (_settle).
        held: list[_Held] | None = None
        here = self.peers.is_here(call.host)
        prefix = self.prefixes.query(model, call.prefix)
        # Never overtake a waiting request served before it (agent/serving/turns.py): wait behind it.
        if queue.ahead(call.host, here, priority=call.priority, tenant=call.tenant):
            if queue.full():
                return self._queue_full(queue)
            waiter = queue.enter(call.host, here, priority=call.priority, tenant=call.tenant)
        behind = waiter is not None
        try:
            while True:
                if behind and waiter is not None:  # older waiters are served first when a slot frees
                    behind = False
                    await queue.park(waiter, deadline - loop.time())
                # 2. Route: a slot granted or offered while waiting, else the router's choice.
                granted: Backend | None = None
                offer: tuple[NodeId, str] | None = None
                if waiter is not None:
                    granted, waiter.grant = waiter.grant, None
                    offer, waiter.offer = waiter.offer, None
                    if offer is not None and offer[0] in failed_peers:
                        offer = None  # it failed there: the peer's hold expires unclaimed
                decision: Decision
                if granted is not None:
                    decision = RunLocal(granted.id, ROUTE_GRANTED)
                elif offer is not None:  # a peer keeps a slot for this request (slot offers)
                    decision = RunOnPeer(offer[0], self.peers.peer_name(offer[0]), 1, ROUTE_OFFER)
                else:
                    decision = self.peers.route(model, host=call.host, affinity=call.affinity, exclude=tried,
                                                avoid=avoid, endpoint=call.endpoint, prefix=prefix)
                # 3a. Run locally.
                if isinstance(decision, RunLocal):
                    backend = granted or queue.take(decision.backend_id)
                    if backend is not None:
                        if waiter is not None:  # it runs now: it waits no more
                            queue.leave(waiter)
                            waiter = None
                        headers = self._headers(call, started, self.node_name, backend.id)
                        # (the router's backend was taken meanwhile: the one with most free slots)
                        route = decision.route if backend.id == decision.backend_id else ROUTE_LEAST_LOADED
                        headers[ROUTE_HEADER] = route_entry(self.node_name, route)
                        self.prefixes.served(model, backend.id, call.prefix)
                        self.retries += failed is not None
                        probe = self.ejections.sent(backend)
                        result = await self._run_here(call, queue, backend, headers, probe, hold=True)
                        if not isinstance(result, Failed):
                            self.prefixes.routed(model, route)  # once per request: the route that answered
                            if held is not None:  # a retry answered it
                                self._settle(call, held, result.status < 400)
                            return result
                        # Failed before the first byte: run it again elsewhere.
                        failed, failures = result, failures + 1
                        held = _hold(held, _Held(backend, None, probe))
                        avoid.add(backend.id)
                        if self._retry(call, backend.id, failed, failures):
                            continue
                        return self._give_up(call, held, failed)
                    decision = Queue("local slot taken meanwhile")
                # 3b. Forward: a refusal or failure before the first byte routes it again, elsewhere.
                elif isinstance(decision, RunOnPeer):
                    if failed is not None and decision.node_id in failed_peers:  # pinned there
                        return self._give_up(call, held, failed)
                    if waiter is not None:  # not waiting while the forward is in flight
                        queue.dispatch(waiter)
                    headers = self._headers(call, started, decision.name, None)
                    headers[ROUTE_HEADER] = route_entry(self.node_name, decision.route)
                    self.retries += failed is not None
                    forwarded = await self.peers.forward(call, decision, offer[1] if offer else None, headers)
                    if not isinstance(forwarded, (Refused, Failed)):
                        self.prefixes.routed(model, decision.route)  # not each refused attempt
                        if held is not None:  # a retry answered it
                            self._settle(call, held, forwarded.status < 400)
                        return forwarded
                    if waiter is not None:  # back in its place in the queue
                        queue.dispatch(waiter, False)
                    tried.add(decision.node_id)
                    if isinstance(forwarded, Failed):
                        failed, failures = forwarded, failures + 1
                        held = _hold(held, _Held(None, decision, False))
                        failed_peers.add(decision.node_id)
                        if self._retry(call, decision.name, failed, failures):
                            continue
                        return self._give_up(call, held, failed)
                    refusals += 1
                    if refusals <= self.forward_retry:
                        continue
                    decision = Queue("peers refused")
                if isinstance(decision, Refuse):
                    if failed is not None:  # nothing else can serve it: the engine's own error
                        return self._give_up(call, held, failed)
                    if waiter is None:  # a model nobody serves leaves no queue behind
                        self.queues.forget_idle(model)
                    return decision
                # 3c. Wait in the origin queue for a slot anywhere, then route again. After a
                # failure only for another backend (a pinned request waits for none).
                if failed is not None and (call.host is not None
                                           or not self.peers.elsewhere(model, failed_peers, avoid)):
                    return self._give_up(call, held, failed)
                if waiter is None:
                    if queue.full():
                        return self._give_up(call, held, failed) if failed is not None else self._queue_full(queue)
                    # A request that failed here waits for a slot routed to it, not a local grant.
                    # In its place by arrival: a request refused elsewhere first is not
                    # put behind those that came after it.
                    arrived = time.monotonic() - (loop.time() - started)
                    waiter = queue.enter(call.host, here and not avoid, arrived, priority=call.priority,
                                         tenant=call.tenant)
                remaining = deadline - loop.time()
                if remaining <= 0:
                    return self._give_up(call, held, failed) if failed is not None else self._queue_timeout(queue)
                await queue.park(waiter, remaining)
                tried = set(failed_peers)
                refusals = 0
        finally:
            if held:  # the client went away before the request ended: nothing is known, none counted
                self._release(call, held)
            if waiter is not None:
                unused = queue.leave(waiter)
                if unused is not None:  # granted while it gave up: the next waiter's
                    self._free(queue, unused)
                queue.wake()

    async def run_forwarded(self, call: Call, origin: NodeId | None, offer_id: str | None) -> web.StreamResponse | Refuse:
        """A request a peer forwarded here: run locally in a free (or held) slot, never
        queued nor forwarded again; else a refusal the origin may retry elsewhere
        (``X-Viiwork-Refused``: not-served, draining, no-slot)."""
        model = call.model
        if model not in self.runtimes:
            return _refusal(503, "not-served", f"node {self.node_name!r} does not serve model {model!r}")
        queue = self.queues.of(model)
        if self.draining:
            held = self.peers.claim(model, offer_id, origin)
            if held is not None:  # offered just before the drain began: free the slot now
                self._free(queue, held)
            return _refusal(503, "draining", f"node {self.node_name!r} is draining")
        refusal = self._gate(model, call)
        if refusal is not None:
            return refusal
        if call.endpoint is not None and call.endpoint not in self.runtimes[model].endpoints:
            # The origin's picture was wrong (a reload here since): it routes elsewhere.
            held = self.peers.claim(model, offer_id, origin)
            if held is not None:
                self._free(queue, held)
            return _refusal(503, "not-served", f"node {self.node_name!r} does not serve model {model!r} at "
                            f"{call.request.path}")
        runtime = self.runtimes[model]
        hit = self.prefixes.local_hit(model, call.prefix,
                                      ((b.id, b.busy) for b in runtime.backends if b.free_slots > 0))
        backend = self.peers.admit_forward(queue, offer_id, origin, call.priority, hit[0] if hit else None)
        if backend is None:
            return _refusal(429, "no-slot", f"node {self.node_name!r} has no free slot for {model!r}")
        if hit is not None and backend.id == hit[0]:
            route = f"prefix-hit blocks={hit[1]}"
        else:
            route = ROUTE_OFFER if offer_id else ROUTE_FREE_SLOT
        self.prefixes.served(model, backend.id, call.prefix)
        log.debug("request %s for %s forwarded by %s runs on %s", call.request_id, model,
                  self.peers.peer_name(origin), backend.id)
        headers = {"X-Viiwork-Node": self.node_name, "X-Viiwork-Backend": backend.id,
                   "X-Viiwork-Origin": self.peers.peer_name(origin), "X-Request-Id": call.request_id,
                   ROUTE_HEADER: route_from_origin(call.request.headers.get(ROUTE_HEADER),
                                                   route_entry(self.node_name, route))}
        # A failure is answered to the origin, which may retry it on another node; counted at once.
        result = await self._run_here(call, queue, backend, headers, self.ejections.sent(backend), hold=False)
        return result.response if isinstance(result, Failed) else result

    # -- the steps -------------------------------------------------------------------------

    def _gate(self, model: str, call: Call) -> Refuse | None:
        """The model's kind fits the endpoint, and the node admits new requests."""
        runtime = self.runtimes.get(model)
        kind = runtime.config.kind.value if runtime is not None else self.peers.kind_of(model)
        if call.kind is not None and kind is not None and kind != call.kind:
            return Refuse(400, f"model {model!r} is {_a(kind)} model; {call.request.path} needs {_a(call.kind)} model",
                          param="model", code=ErrorCode.WRONG_MODEL_KIND)
        if self.draining:
            return Refuse(503, f"node {self.node_name!r} is draining for maintenance and admits no new requests",
                          code=ErrorCode.DRAINING, retry_after_s=5)
        return None

    async def _run_here(self, call: Call, queue: WaitQueue, backend: Backend, headers: dict[str, str],
                        probe: bool, *, hold: bool) -> web.StreamResponse | Failed:
        """Run ``call`` on this node's ``backend`` (its slot taken; ``probe``: what
        ``Ejections.sent`` said, the request is the backend's half-open probe): the response,
        or ``Failed`` before the first byte. The outcome is counted (``_count``; none when the
        client went away: the handler is cancelled), a ``Failed`` only when not ``hold`` (the
        caller holds it until the request ends: ``_settle``)."""
        answer: web.StreamResponse | Failed | None = None
        accounting = self.accounting
        end = None if accounting is None else accounting.end_of(
            request_id=call.request_id, tenant=call.tenant, jti=call.jti, model=call.model, origin_node=call.origin,
            queued_s=call.queued_s, arrived=call.arrived)
        began = asyncio.get_running_loop().time()
        try:
            # The request's row is recorded before its end reaches the client (``end``).
            response = await self.upstream.forward(call.request, backend, call.body, call.stream, headers,
                                                   call.request_id, strip_usage=call.strip_usage, end=end)
            assert not isinstance(response, Refused)  # only a refusable forward (to a peer) is refused
            answer = response
            return response
        finally:
            if answer is not None and not (hold and isinstance(answer, Failed)):
                self._count(backend, answer, probe)
            if answer is not None and not isinstance(answer, Failed):  # its service time, for prefix scoring
                self.prefixes.ended(call.model, asyncio.get_running_loop().time() - began)
            self._free(queue, backend)

    def _count(self, backend: Backend, answer: web.StreamResponse | Failed, probe: bool) -> None:
        """``answer``'s outcome on ``backend``, for outlier ejection and the health ladder's
        hysteresis (``Backend.note_success``, agent/supervision/health_ladder.py): a 2xx or 3xx
        is a success; a failure (``Failed``, a stream broken after its first byte) a failure;
        a 4xx is the client's, neither: nothing is counted, and a half-open ``probe`` is
        released (the next request is the probe)."""
        if isinstance(answer, Failed) or answer.get(BROKE, False) or answer.status >= 500:
            self.ejections.outcome(backend, False)
        elif answer.status < 400:
            self.ejections.outcome(backend, True)
            backend.note_success()
        elif probe:
            self.ejections.unjudged(backend)

    def _settle(self, call: Call, held: list[_Held], retried_ok: bool | None) -> None:
        """Count the failures before the first byte that ``call`` met (``held``, oldest first)
        now that it ends. A retry answered it below 400 (``retried_ok`` True): each is a failure
        of its target. No retry answered (None: the client gets the failure's error) and it
        failed once: that failure (no retry was possible: no other backend, pinned, no budget).
        Else (a retry failed too, or answered a 4xx) the request's fault: none is counted
        (``Ejections.request_fault``). ``held`` is emptied."""
        if retried_ok or (retried_ok is None and len(held) == 1):
            for item in held:
                if item.backend is not None:
                    self.ejections.outcome(item.backend, False)
                elif item.peer is not None:
                    self.ejections.peer_outcome(item.peer.node_id, item.peer.name, call.model, False)
            held.clear()
            return
        log.debug("request %s failed before the first byte on %s: the request's fault, counted against none",
                  call.request_id, ", ".join(item.name for item in held))
        self.ejections.request_fault()
        self._release(call, held)

    def _release(self, call: Call, held: list[_Held]) -> None:
        """Count none of ``held``: the half-open probes among them are released; ``held`` is emptied."""
        for item in held:
            if item.backend is not None:
                if item.probe:
                    self.ejections.unjudged(item.backend)
            elif item.peer is not None:  # a half-open peer gets no other forward while its probe runs
                self.ejections.peer_unjudged(item.peer.node_id, call.model)
        held.clear()

    def _give_up(self, call: Call, held: list[_Held] | None, failed: Failed) -> web.Response:
        """The error of the last failure, for the client: no other backend takes the request."""
        if held is not None:
            self._settle(call, held, None)
        return failed.response

    def _retry(self, call: Call, target: str, failed: Failed, failures: int) -> bool:
        """May the request that failed on ``target`` before its first byte run elsewhere
        (``failures`` so far, at most ``forward_retry`` retried)?"""
        if failures > self.forward_retry:
            log.debug("request %s: %s failed before the first byte (%s); no retry left", call.request_id, target,
                      failed.reason)
            return False
        log.debug("request %s: %s failed before the first byte (%s); trying another backend", call.request_id,
                  target, failed.reason)
        return True

    def _free(self, queue: WaitQueue, backend: Backend) -> None:
        """A local slot frees: it goes to the first waiter, here or (offers) elsewhere (an
        ejected backend's slot to no one: the waiters route again)."""
        queue.release(backend)
        self.peers.slot_freed(queue)
        if backend.ejected:
            queue.wake()

    def _headers(self, call: Call, started: float, node: str, backend_id: str | None) -> dict[str, str]:
        """The answer's ``X-Viiwork-*`` headers (a peer's answer replaces Node and Backend)."""
        call.queued_s = queued = asyncio.get_running_loop().time() - started
        headers = {"X-Viiwork-Node": node,
                   "X-Viiwork-Queued-Ms": f"{queued * 1000:.1f}",
                   "X-Request-Id": call.request_id}
        if self.peers.in_mesh:
            headers["X-Viiwork-Origin"] = self.node_name
        if backend_id is not None:
            headers["X-Viiwork-Backend"] = backend_id
        return headers

    def _queue_full(self, queue: WaitQueue) -> Refuse:
        what = "no free slot in the mesh" if self.peers.in_mesh else "all slots busy"
        return Refuse(429, f"model {queue.model!r}: {what} and the queue is full ({queue.queue_max} waiting)",
                      code=ErrorCode.RATE_LIMIT_EXCEEDED, retry_after_s=1)

    def _queue_timeout(self, queue: WaitQueue) -> Refuse:
        where = " in the mesh" if self.peers.in_mesh else ""
        return Refuse(429, f"model {queue.model!r}: no slot freed{where} within {queue.timeout_s:g} s",
                      code=ErrorCode.RATE_LIMIT_EXCEEDED, retry_after_s=2)


@dataclass(frozen=True, slots=True)
class _Held:
    """A failure before the first byte, not counted yet (``Pipeline._settle``): on this node's
    ``backend`` (``probe``: the request was its half-open probe), else on ``peer``."""

    backend: Backend | None
    peer: RunOnPeer | None
    probe: bool

    @property
    def name(self) -> str:
        return self.backend.id if self.backend is not None else self.peer.name if self.peer is not None else "?"


def _hold(held: list[_Held] | None, item: _Held) -> list[_Held]:
    """``held`` with ``item`` added (a new list for the request's first failure)."""
    if held is None:
        return [item]
    held.append(item)
    return held


# Routes of a request the router did not choose (X-Viiwork-Route, docs/routing.md).
ROUTE_GRANTED = "queued"  # it waited in the origin queue and a local slot was granted to it
ROUTE_OFFER = "offer"  # a slot a peer offered (slot offers), or a forward claiming one
ROUTE_FREE_SLOT = "free-slot"  # a forward from a peer took the backend with the most free slots


# The code of a refusal to a peer (X-Viiwork-Refused reason), for the origin's logs and relays.
_REFUSAL_CODES = {"no-slot": ErrorCode.RATE_LIMIT_EXCEEDED, "not-served": ErrorCode.NO_CAPACITY,
                  "draining": ErrorCode.DRAINING}


@dataclass(frozen=True, slots=True)
class PeerRefusal(Refuse):
    """A :class:`Refuse` for a peer's forward: rendered with ``X-Viiwork-Refused: reason``."""

    reason: str = ""


def _refusal(status: int, reason: str, message: str) -> PeerRefusal:
    return PeerRefusal(status, message, code=_REFUSAL_CODES.get(reason), retry_after_s=1, reason=reason)


def _a(word: str) -> str:
    """``word`` with its indefinite article: "a chat", "an embedding"."""
    return ("an " if word[:1] in "aeiou" else "a ") + word
