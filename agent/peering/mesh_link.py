"""The agent's side of the mesh: publish this node's capacity, route over peers, forward.

One module (over 400 lines) because its three jobs act on the same things: capacity
publication, the pipeline's peers and the slot-offer exchange share one ``MeshNode``, one
forwarding session (mutual TLS, ``expect_node``), one peer table and the set of held slots.
What is pure is elsewhere: the router (``viiwork.agent.serving.router``) and the offers'
state and message formats (``viiwork.agent.peering.offers``); this is the I/O glue.

``MeshLink`` wires ``viiwork.mesh.MeshNode`` (identity, trust, discovery, gossip) to the
supervisor's models and to the pure router (``viiwork.agent.serving.router``):

- the capacity summary is built from the local ``ModelRuntime``s on every gossip round, with
  the ``speeds`` extension when a speed moved by more than its step
  (``viiwork.agent.peering.speed_ext``), the ``endpoints`` each model serves
  (``viiwork.agent.peering.endpoint_ext``) and the ``prefixes`` extension when the recent
  prefixes changed, at most every few seconds (``viiwork.agent.peering.prefix_ext``), and
  the ``gangs`` this node takes part in (``viiwork.agent.peering.gang_ext``);
- ``route`` gives the router a fresh picture of local backends and peers;
- forwarded requests travel over the mesh listener's mutual TLS (``session``), so the
  receiver knows the origin from its certificate, and every request names the peer it is for
  (``expect_node``): the session refuses, before sending anything, a connection whose TLS peer
  is another node (``viiwork.mesh.dialing``);
- it is the pipeline's ``Peers`` (``viiwork.agent.serving.pipeline``): routing, forwarding (and
  counting forwards both ways), and taking a forwarded request into a local slot; the
  waiting requests are the shared origin queues (``viiwork.agent.serving.waitqueue``), which it
  wakes when a forward ends or a fresher summary arrives;
- slot offers (``viiwork.agent.peering.offers``): the origin tells the peers serving a model when
  its queue's head changes (``want``: its highest priority waiting, and the oldest waiter of
  it), and a node whose slot frees offers it to the origin with the first want it knows of
  (priority, then age), keeping it until that origin's request claims it;
- outlier ejection of peers (``viiwork.agent.serving.ejections``): every forward's outcome
  is counted per (peer, model); the router leaves a peer ejected for a model out, and the
  peer stays a member.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import logging
import math
import os
import random
import time
from collections import Counter
from collections.abc import Callable, Collection, Coroutine, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import aiohttp
from aiohttp import web

from viiwork import __version__
from viiwork.agent.auth.gate import forward_headers
from viiwork.agent.config.schema import Config
from viiwork.agent.host.gpus import GpuInventory
from viiwork.agent.peering.endpoint_ext import endpoints_of
from viiwork.agent.peering.gang_ext import gangs_of
from viiwork.agent.peering.offers import (
    OFFER_HEADER,
    WANT_FANOUT,
    Hold,
    Holds,
    Offer,
    Want,
    WantBook,
    WantError,
    parse_offer,
)
from viiwork.agent.peering.prefix_ext import PrefixPublisher
from viiwork.agent.peering.speed_ext import SpeedPublisher
from viiwork.agent.serving.body import BodyError, parse_json, read_body
from viiwork.agent.serving.drain import InFlight
from viiwork.agent.serving.ejections import Ejections
from viiwork.agent.serving.errors import ErrorCode, error_response
from viiwork.agent.serving.pipeline import Call, Handler
from viiwork.agent.serving.prefix_routing import PrefixRouting, PrefixSettings
from viiwork.agent.serving.proxy import BROKE, Failed, Refused, Upstream
from viiwork.agent.serving.route_header import ROUTE_HEADER
from viiwork.agent.serving.router import (
    Decision,
    LocalModel,
    PeerSnapshot,
    Refuse,
    Reservations,
    Router,
    RunOnPeer,
    mesh_models,
)
from viiwork.agent.serving.scoring import PrefixQuery
from viiwork.agent.serving.waitqueue import Queues, WaitQueue
from viiwork.agent.supervision.backends import Backend, ModelRuntime
from viiwork.engines.contract import Engine
from viiwork.engines.registry import ENGINES
from viiwork.mesh.dialing import expect_node, peer_session_parts
from viiwork.mesh.extensions import EMPTY as NO_EXTENSIONS
from viiwork.mesh.extensions import (
    ENDPOINTS,
    GANGS,
    PREFIXES,
    SPEEDS,
    Extensions,
    ExtensionSpec,
    GangMember,
    Priority,
)
from viiwork.mesh.identity import NodeId
from viiwork.mesh.membership import Liveness, PeerView
from viiwork.mesh.node import MeshNode, MeshSettings
from viiwork.mesh.summary import GpuCapacity, ModelCapacity, PublishedState
from viiwork.mesh.transport import peer_of

log = logging.getLogger(__name__)

WANT_PATH = "/mesh/v1/want"
OFFER_PATH = "/mesh/v1/offer"
MESSAGE_MAX_BYTES = 4096  # a want or offer message larger than this is dropped
MESSAGE_TIMEOUT_S = 2.0
# Forwards in flight to a peer end when the peer turns silent (Membership.silent: nothing
# newer heard for suspect_after_ms), whatever state it publishes: a peer that drains, leaves
# or restarts keeps gossiping while its streams finish, so silence means it froze, was cut
# off or crashed (docs/routing.md, "Forwarding and retries before the first byte").


@dataclass(frozen=True, slots=True)
class PeerTarget:
    """A peer's mesh listener as a forwarding target (``id`` for messages, ``base_url``)."""

    id: str
    base_url: str
    node_id: NodeId

    @classmethod
    def of(cls, view: PeerView) -> PeerTarget:
        """The target of a peer in the mesh table (its ``mesh`` address must be set)."""
        return cls(id=view.name, base_url=f"https://{view.mesh}", node_id=view.node_id)


async def read_bounded(stream: aiohttp.StreamReader, limit: int) -> bytes:
    """A body up to ``limit`` bytes, or ``limit + 1`` bytes when it is longer (the caller
    refuses it). One ``read(n)`` returns only what has arrived: read until the end."""
    body = bytearray()  # (appending to bytes would copy the whole body per chunk)
    while len(body) <= limit:
        chunk = await stream.read(limit + 1 - len(body))
        if not chunk:
            break
        body += chunk
    return bytes(body)


def _forward_ok(result: web.StreamResponse | Refused | Failed) -> bool | None:
    """A forward's outcome for outlier ejection: False (a failure of the peer), True (a 2xx or
    3xx), or None (a refusal for want of a slot or state, or a client's 4xx: nothing said
    about the peer's health)."""
    if isinstance(result, Failed):
        return False
    if isinstance(result, Refused):
        return False if result.reason in ("timeout", "suspect") or result.reason.startswith("unreachable") else None
    if result.get(BROKE, False):
        return False
    return None if 400 <= result.status < 500 else True


def gpu_capacities(inventory: GpuInventory) -> list[GpuCapacity]:
    """The GPUs to publish: index, name and memory in MiB (rounded down to 64 MiB so small
    fluctuations do not force a new summary); unknown stays None, never 0."""
    def mib(value: int | None) -> int | None:
        return None if value is None else (value // (1 << 20)) // 64 * 64
    return [GpuCapacity(index=g.index, name=(g.name or f"{g.vendor.value} GPU")[:128],
                        memory_total_mib=mib(g.memory_total_bytes), memory_free_mib=mib(g.memory_free_bytes))
            for g in inventory.gpus if not g.lost]


def model_fingerprint(path: str) -> str | None:
    """Identifies the weights across nodes: sha256 of the file name and size (paths differ
    between hosts; a different quantisation or revision differs in size); None if unknown."""
    try:
        size = os.stat(path).st_size
    except OSError:
        return None
    return hashlib.sha256(f"{os.path.basename(path)}:{size}".encode()).hexdigest()[:16]


class MeshLink:
    """This node in the mesh, seen from the agent (``start``/``stop`` around the API's life).

    ``queues``: the node's origin queues (shared with the pipeline); ``upstream``: the
    agent's HTTP client, forwards go through it; ``draining``: is the node draining?
    ``ejections``: the node's outlier ejection, shared with the pipeline (default: one from
    ``routing.outliers``). ``prefixes``: prefix-aware routing's state, shared with the
    pipeline (default: one from ``routing.prefix_*``).
    """

    in_mesh = True

    def __init__(self, config: Config, runtimes: dict[str, ModelRuntime], *, queues: Queues, upstream: Upstream,
                 draining: Callable[[], bool], gpus: Callable[[], GpuInventory] | None = None,
                 rng: random.Random | None = None, ejections: Ejections | None = None,
                 prefixes: PrefixRouting | None = None) -> None:
        assert config.mesh is not None
        self.config = config
        self.runtimes = runtimes
        self.queues = queues
        self.upstream = upstream
        self.draining = draining
        self.ejections = ejections or Ejections.from_config(runtimes, config.routing.outliers)
        self.gpus = gpus  # callable: the latest GPU inventory (published with the capacity)
        self.rng = rng or random.Random()
        for line in config.mesh.deprecations():  # heartbeat keys that probe mode took over
            log.warning("%s", line)
        self.node = MeshNode(MeshSettings.from_config(config.mesh, config.node, config.api.listen, __version__),
                             provider=self._capacity, rng=random.Random(self.rng.random()))
        self.reservations = Reservations(clock=lambda: time.monotonic() * 1000.0)
        self.router: Router | None = None
        self.session: aiohttp.ClientSession | None = None
        self._fingerprints: dict[str, str | None] = {}
        self.speeds = SpeedPublisher()  # the ``speeds`` extension (agent/peering/speed_ext.py)
        self.prefixes = prefixes or PrefixRouting(PrefixSettings.from_config(config.routing), runtimes)
        # The ``prefixes`` extension (agent/peering/prefix_ext.py).
        self.prefix_publisher = PrefixPublisher(self.prefixes, time.monotonic)
        # This node's extensions by spec (speeds, revocations, ...): published together, since a
        # summary's ``ext`` is one object (MeshNode.set_local_extensions replaces it whole).
        self._extensions: dict[ExtensionSpec[Any], Any] = {}
        # The gangs this node takes part in (agent/peering/gang_ext.py), set by the agent when
        # its config has gang entries: the ``gangs`` extension, republished on change.
        self.gang_members: Callable[[], Iterable[GangMember]] | None = None
        self.forwards_out = 0
        self.forwards_in = 0
        self.refusals_in = 0
        self.refusals_out = 0
        self._stopped = False
        # Set by begin_stop: the state published while the agent stops (leaving/restarting).
        self.leaving: PublishedState | None = None
        # Slot offers (viiwork.agent.peering.offers): a new head of a queue is announced to peers.
        queues.head_listeners.append(self._announce_soon)
        clock_ms = lambda: time.monotonic() * 1000.0  # noqa: E731
        # A want's age counts as at most this node's queue timeout (WantBook: why not the bound).
        self.wants = WantBook(clock=clock_ms, ttl_ms=(config.routing.queue_timeout_s + 5.0) * 1000.0,
                              max_age_ms=config.routing.queue_timeout_s * 1000.0)
        self.holds = Holds(clock=clock_ms)
        self.offer_counters: Counter[str] = Counter()
        self._announced: dict[str, tuple[Priority, float] | None] = {}
        self._announce_due: set[str] = set()
        self._tasks: set[asyncio.Task[Any]] = set()
        # Forwards in flight by peer: the events `watch_peer` handed out.
        self._watches: dict[NodeId, set[asyncio.Event]] = {}
        self.node.app.router.add_post(WANT_PATH, self.handle_want)
        self.node.app.router.add_post(OFFER_PATH, self.handle_offer)

    async def start(self) -> None:
        """Start the mesh node (raises viiwork.mesh.node.MeshStartError naming the fix)."""
        await self.node.start()
        # Probe mode publishes on change only: a live peer's summary is current whatever its
        # age, so liveness (the detector's) is the freshness rule (docs/mesh.md, "Probe mode").
        probing = self.config.mesh is not None and self.config.mesh.detector == "probe"
        stale_after_ms = math.inf if probing else self.config.routing.stale_after_ms
        self.router = Router(self.node.node_id, self.config.node.name, stale_after_ms=stale_after_ms,
                             reservations=self.reservations, rng=random.Random(self.rng.random()))
        assert self.node.membership is not None and self.node.client_ssl_context is not None
        self.session = aiohttp.ClientSession(
            # Every request names its peer (expect_node) and is refused unless the TLS peer
            # is that node: peer_mismatch in the mesh's transport counters.
            **peer_session_parts(self.node.client_ssl_context, counters=self.node.membership.counters.transport,
                                 require_expected=True, limit=0, keepalive_timeout=30),
            auto_decompress=False,
            skip_auto_headers=("User-Agent", "Accept-Encoding"),
            timeout=aiohttp.ClientTimeout(total=None, sock_connect=2.0,
                                          sock_read=self.config.api.stream_idle_timeout_s),
        )
        self.node.subscribe(lambda _peer: self.wake_all())
        assert self.node.membership is not None
        self.node.membership.on_silent.append(self._on_silent)

    def begin_stop(self, restart: bool) -> None:
        """The agent is stopping: publish ``restarting`` (``restart``: systemd starts it again,
        viiwork.agent.notify) or ``leaving`` from the next gossip round on, so peers send no
        new forward here; the listener, the gossip and forwards in flight go on until
        :meth:`stop` (docs/architecture.md, "Stopping")."""
        self.leaving = PublishedState.RESTARTING if restart else PublishedState.LEAVING

    async def stop(self) -> None:
        """Publish ``leaving`` (or ``restarting`` after ``begin_stop(restart=True)``), push it
        to a few peers and close the mesh listener and the forwarding session: call it once
        the requests in flight have ended. Idempotent."""
        if self._stopped:
            return
        self._stopped = True
        for hold in self.holds.all():
            self._free_hold(self.holds.drop(hold.offer_id), reoffer=False)
        for task in list(self._tasks):
            task.cancel()
        await self.node.stop(leave=True, state=self.leaving or PublishedState.LEAVING)
        if self.session is not None:
            await self.session.close()

    # -- capacity --------------------------------------------------------------------------

    def _fingerprint(self, runtime: ModelRuntime) -> str | None:
        if runtime.name not in self._fingerprints:
            self._fingerprints[runtime.name] = model_fingerprint(runtime.config.path)
        return self._fingerprints[runtime.name]

    def publish_extension(self, spec: ExtensionSpec[Any], value: Any | None) -> None:
        """Publish ``value`` as ``spec``'s extension from now on (None: leave it out), beside the
        others this node publishes; a change is published at once (a new summary)."""
        candidate = dict(self._extensions)
        if value is None:
            if candidate.pop(spec, None) is None:
                return
        elif candidate.get(spec) == value:
            return
        else:
            candidate[spec] = value
        try:
            ext = Extensions.of(candidate) if candidate else NO_EXTENSIONS
        except ValueError as exc:  # a publisher's bug (ExtensionError, or a value its own decoder refuses): the
            # extensions published before stay
            log.warning("extension %s not published: %s", spec.name, exc)
            return
        self._extensions = candidate
        self.node.set_local_extensions(ext)

    def _capacity(self) -> tuple[list[ModelCapacity], PublishedState, list[GpuCapacity] | None]:
        ext = self.speeds.update(self.runtimes.values())
        if ext is not None:  # a speed moved by more than the step: published with this round's capacity
            self.publish_extension(SPEEDS, ext.get(SPEEDS))  # None: no model measured
        # The endpoints each model serves (agent/peering/endpoint_ext.py): changes only on a reload.
        self.publish_extension(ENDPOINTS, endpoints_of(self.runtimes.values()))
        if self.gang_members is not None:  # a gang started or stopped: a new summary (equal: none)
            self.publish_extension(GANGS, gangs_of(self.gang_members()))
        published = self.prefix_publisher.update()
        if published is not None:  # the recent prefixes changed (at most every PUBLISH_MIN_S)
            self.publish_extension(PREFIXES, published if published.models else None)
        models = []
        for rt in self.runtimes.values():
            cap = rt.capacity()  # the one sum (agent/supervision/backends.py): stale readings left out
            if cap.ejected and not cap.healthy and not self._offered_elsewhere(rt.name):
                # Every backend here ejected and no peer offers the model: publish them anyway,
                # an ejection never takes a model's last backends away (docs/routing.md).
                cap = rt.capacity(with_ejected=True)
            models.append(ModelCapacity(
                name=rt.name, engine=rt.config.engine, kind=rt.config.kind.value,
                slots=cap.slots, busy=cap.busy, waiting=cap.waiting,
                ctx_per_slot=rt.ctx_per_slot, healthy=cap.healthy, total=cap.total,
                fingerprint=self._fingerprint(rt)))
        if self.leaving is not None:
            state = self.leaving
        else:
            state = PublishedState.DRAINING if self.draining() else PublishedState.SERVING
        return models, state, None if self.gpus is None else gpu_capacities(self.gpus())

    def _offered_elsewhere(self, model: str) -> bool:
        """Does a fresh peer publish a healthy backend for ``model`` (one not ejected in this
        node's view)?"""
        if self.router is None:
            return False
        return any(self.router.fresh(p) and (cap := p.model(model)) is not None and cap.healthy > 0
                   and self.ejections.peer_usable(p.node_id, model) for p in self.peers())

    # -- routing ---------------------------------------------------------------------------

    def local_models(self) -> dict[str, LocalModel]:
        return {name: LocalModel.from_runtime(rt) for name, rt in self.runtimes.items()}

    def peers(self) -> list[PeerSnapshot]:
        return [PeerSnapshot.from_view(v) for v in self.node.peers()]

    def route(self, model: str, *, host: str | None, affinity: str | None, exclude: set[NodeId],
              avoid: Collection[str] = (), endpoint: str | None = None,
              prefix: PrefixQuery | None = None) -> Decision:
        assert self.router is not None, "MeshLink.start() first"
        peers = self.peers()
        ejected = self.ejections.ejected_peers(model, (p.node_id for p in peers))
        return self.router.route(model, self.local_models(), peers, affinity=affinity, host=host,
                                 exclude=exclude, avoid=avoid, ejected=ejected, endpoint=endpoint, prefix=prefix)

    def elsewhere(self, model: str, exclude: Collection[NodeId], avoid: Collection[str]) -> bool:
        runtime = self.runtimes.get(model)
        if runtime is not None and runtime.healthy_outside(avoid):
            return True
        assert self.router is not None, "MeshLink.start() first"
        for peer in self.peers():
            cap = peer.model(model)
            if (cap is not None and cap.slots > 0 and peer.node_id not in exclude and self.router.fresh(peer)
                    and self.ejections.peer_usable(peer.node_id, model)):
                return True
        return False

    def models(self) -> list[dict[str, Any]]:
        """The mesh-wide /v1/models list (every model once, the fleet's smallest context)."""
        return mesh_models(self.local_models(), self.peers())

    def peer_target(self, node_id: NodeId) -> PeerTarget | None:
        for view in self.node.peers():
            if view.node_id == node_id and view.mesh:
                return PeerTarget.of(view)
        return None

    def peer_engine(self, node_id: NodeId, model: str) -> Engine | None:
        """The adapter of the engine ``node_id`` publishes for ``model`` (None: unknown), which
        tells a client's fault from the peer's in an error event of its stream."""
        for view in self.node.peers():
            if view.node_id == node_id:
                cap = next((m for m in view.models if m.name == model), None)
                return ENGINES.get(cap.engine) if cap is not None else None
        return None

    def peer_name(self, node_id: NodeId | None) -> str:
        if node_id is None:
            return "?"
        for view in self.node.peers():
            if view.node_id == node_id:
                return view.name
        return str(node_id)

    @contextlib.contextmanager
    def watch_peer(self, node_id: NodeId) -> Iterator[asyncio.Event]:
        """An event for one forward to ``node_id``: set once the peer is silent in this
        node's view (``Membership.silent``: no summary newer than ``suspect_after_ms``; at once
        when it already is, or is not known), whatever state it publishes.

        Silence is re-evaluated on every gossip round, so the event is set within
        ``suspect_after_ms`` + one ``gossip_interval_ms`` of the peer's last summary. A peer
        that publishes ``leaving``, ``draining`` or ``restarting`` keeps gossiping while it
        stops, so it does not set it while it answers: its streams finish. The restart grace
        (``restart_grace_ms``) governs tombstones only, not forwards in flight.
        """
        event = asyncio.Event()
        membership = self.node.membership
        if membership is None or membership.silent(node_id):
            event.set()
        watchers = self._watches.setdefault(node_id, set())
        watchers.add(event)
        try:
            yield event
        finally:
            watchers.discard(event)
            if not watchers:
                self._watches.pop(node_id, None)

    def _on_silent(self, node_id: NodeId) -> None:
        for event in self._watches.get(node_id, ()):
            event.set()

    def wake(self, model: str) -> None:
        q = self.queues.get(model)
        if q is not None:
            q.wake()

    def wake_all(self) -> None:
        self.queues.wake_all()

    # -- the pipeline's peers (viiwork.agent.serving.pipeline.Peers) ---------------------------------

    def unknown(self, model: str) -> Refuse | None:
        return None  # the router knows the whole mesh's models (its 404 names them)

    def kind_of(self, model: str) -> str | None:
        return next((m.get("kind") for m in self.models() if m.get("id") == model), None)

    def is_here(self, host: str | None) -> bool:
        return host is None or host in (self.node.node_id, self.config.node.name)

    def accept_forwards(self, handler: Handler, paths: Iterable[str], in_flight: InFlight) -> None:
        """Serve forwarded requests on the mesh listener (call before :meth:`start`)."""
        in_flight.attach(self.node.app)  # forwards from peers count as in flight
        for path in paths:
            self.node.app.router.add_post(path, handler)

    async def forward(self, call: Call, to: RunOnPeer, offer_id: str | None,
                      headers: dict[str, str]) -> web.StreamResponse | Refused | Failed:
        """Forward ``call`` to a peer over the mesh's mutual TLS; ``Refused`` when it declines,
        cannot be reached or turns silent before the first byte (the pipeline routes again),
        ``Failed`` when it answered a 5xx before it (the pipeline may retry elsewhere). The
        outcome counts for the peer's outlier ejection for ``call.model``: a failure when
        unreachable, silent, a 5xx or a stream broken off (or ended by an error event that is not
        the client's fault); a refusal (no slot, not served, draining) or a 4xx counts for nothing
        (a half-open probe is released). A ``Failed`` is counted by the pipeline when the request
        ends: a retry that fails too makes it the request's fault (``Pipeline._settle``)."""
        model = call.model
        target = self.peer_target(to.node_id)
        result: web.StreamResponse | Refused | Failed
        if target is None:
            result = Refused(503, "no mesh address")
        else:
            probe = self.ejections.peer_sent(to.node_id, model)
            token = self.reservations.reserve(to.node_id, model)
            log.debug("request %s for %s: forwarding to %s%s", call.request_id, model, to.name,
                      " (offered slot)" if offer_id else "")
            # expect_node: refused before a byte is sent unless the TLS peer is that node
            # (viiwork.mesh.dialing); a refusal routes it again.
            # The client's key travels with the request: the peer verifies it again (agent/auth/gate.py).
            # Its wait here goes with it, for the serving node's usage row (docs/usage.md).
            extra = {"X-Viiwork-Origin": self.config.node.name, **expect_node(target.node_id),
                     **forward_headers(call.request), "X-Viiwork-Queued-Ms": headers.get("X-Viiwork-Queued-Ms", "0")}
            if offer_id is not None:
                extra[OFFER_HEADER] = offer_id
            if ROUTE_HEADER in headers:  # the origin's hop: the peer answers it with its own
                extra[ROUTE_HEADER] = headers[ROUTE_HEADER]
            try:
                # A peer that turns suspect or dead while this forward waits for its first
                # byte is abandoned and the request routed again.
                with self.watch_peer(to.node_id) as lost:
                    result = await self.upstream.forward(
                        call.request, target, call.body, call.stream, headers, call.request_id,
                        session=self.session, extra_headers=extra,
                        relay_headers=("X-Viiwork-Node", "X-Viiwork-Backend", ROUTE_HEADER), refusable=True,
                        lost=lost, engine=self.peer_engine(to.node_id, model), strip_usage=call.strip_usage)
            finally:
                self.reservations.release(token)
                self.wake(model)
            ok = _forward_ok(result)
            if ok is None:
                if probe:
                    self.ejections.peer_unjudged(to.node_id, model)
            elif not isinstance(result, Failed):  # a Failed: counted by the pipeline
                self.ejections.peer_outcome(to.node_id, to.name, model, ok)
        if not isinstance(result, Refused):
            self.forwards_out += 1
            return result
        self.refusals_out += 1
        log.debug("request %s: %s refused (%d %s)", call.request_id, to.name, result.status, result.reason)
        self.reservations.mark_full(to.node_id, model)
        return result

    def admit_forward(self, queue: WaitQueue, offer_id: str | None, origin: NodeId | None,
                      priority: Priority = Priority.NORMAL, prefer: str | None = None) -> Backend | None:
        """The slot for a forward from ``origin`` (its key's verified ``priority``): the one
        held for its offer, else a free one (``prefer``'s when it has one: the backend holding
        its prefix); a receiver never queues (None: refused, the origin tries elsewhere)."""
        backend = self.claim(queue.model, offer_id, origin, priority) or queue.take(prefer)
        runtime = self.runtimes.get(queue.model)
        if backend is None and runtime is not None:  # every backend ejected: the last resort
            last = runtime.most_free_outside(())
            backend = queue.take(last.id) if last is not None else None
        if backend is None:
            self.refusals_in += 1
            return None
        self.forwards_in += 1
        return backend

    # -- slot offers (viiwork.agent.peering.offers) --------------------------------------------------

    def _spawn(self, coro: Coroutine[Any, Any, Any]) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _post(self, target: PeerTarget, path: str, doc: dict[str, Any]) -> dict[str, Any] | None:
        """POST a small JSON message to a peer's mesh listener; its JSON answer ({} for
        204), or None when it failed (counted; a dead peer is routine)."""
        if self.session is None:
            return None
        try:
            async with self.session.post(target.base_url + path, json=doc, headers=expect_node(target.node_id),
                                         timeout=aiohttp.ClientTimeout(total=MESSAGE_TIMEOUT_S)) as resp:
                raw = await read_bounded(resp.content, MESSAGE_MAX_BYTES)
                if resp.status == 204:
                    return {}
                if resp.status != 200:
                    self.offer_counters["message_refused"] += 1
                    log.debug("mesh %s to %s: answered %d %s", path, target.id, resp.status, raw[:200])
                    return None
                if len(raw) > MESSAGE_MAX_BYTES:
                    raise ValueError(f"answer exceeds {MESSAGE_MAX_BYTES} bytes")
                answer = json.loads(raw)
                return answer if isinstance(answer, dict) else None
        except (aiohttp.ClientError, OSError, TimeoutError, ValueError, RecursionError) as exc:
            self.offer_counters["message_failed"] += 1
            log.debug("mesh %s to %s failed: %s", path, target.id, exc)
            return None

    def _announce_soon(self, model: str) -> None:
        """The head of ``model``'s queue changed: announce once this loop turn ends (a
        burst of queue changes sends one message per peer)."""
        if (model in self._announce_due or self.session is None or self._stopped
                or not self.config.routing.slot_offers):
            return
        self._announce_due.add(model)
        asyncio.get_running_loop().call_soon(self._announce, model)

    def _announce(self, model: str) -> None:
        self._announce_due.discard(model)
        q = self.queues.get(model)
        head = q.head_want() if q is not None else None
        if head == self._announced.get(model) or self._stopped:
            return
        self._announced[model] = head
        want = Want(model, len(q) if q is not None else 0,
                    0.0 if head is None else (time.monotonic() - head[1]) * 1000.0,
                    Priority.NORMAL if head is None else head[0])
        targets = []
        assert self.router is not None
        for view in self.node.peers():
            snap = PeerSnapshot.from_view(view)
            cap = snap.model(model)
            if cap is not None and cap.slots > 0 and view.mesh and self.router.fresh(snap):
                targets.append((cap.slots, view))
        targets.sort(key=lambda t: -t[0])
        for _, view in targets[:WANT_FANOUT]:
            self.offer_counters["wants_out"] += 1
            self._spawn(self._post(PeerTarget.of(view), WANT_PATH, want.doc()))

    async def _read_message(self, request: web.Request) -> Any:
        """A want or offer message's JSON: at most MESSAGE_MAX_BYTES, nested at most
        MAX_JSON_DEPTH (agent/serving/body.py); WantError (dropped, 400) otherwise."""
        try:
            return parse_json(await read_body(request, MESSAGE_MAX_BYTES, "MESSAGE_MAX_BYTES"))
        except BodyError as exc:
            raise WantError(f"{exc.code}: {exc}") from None

    def _bad_message(self, kind: str, peer: NodeId | None, exc: Exception) -> web.Response:
        self.offer_counters[f"{kind}_dropped"] += 1
        log.debug("mesh %s from %s dropped: %s", kind, peer, exc)
        return error_response(400, str(exc), code=ErrorCode.INVALID_MESSAGE)

    async def handle_want(self, request: web.Request) -> web.Response:
        """POST /mesh/v1/want from a peer (mutual TLS): its queue's head for a model."""
        peer = peer_of(request)
        try:
            if peer is None:
                raise WantError("no verified peer certificate")
            want = Want.parse(await self._read_message(request))
        except WantError as exc:
            return self._bad_message("want", peer, exc)
        self.offer_counters["wants_in"] += 1
        if want.model not in self.runtimes:
            self.offer_counters["wants_not_served"] += 1
            return web.Response(status=204)
        self.wants.note(peer, want)
        if want.waiting > 0:
            self.slot_freed(self.queues.of(want.model))  # a slot free here now goes to it at once
        return web.Response(status=204)

    async def handle_offer(self, request: web.Request) -> web.Response:
        """POST /mesh/v1/offer from a peer (mutual TLS): it keeps a slot for our first
        waiter (of at least the offer's priority); answers ``{"taking": bool}``."""
        peer = peer_of(request)
        try:
            if peer is None:
                raise WantError("no verified peer certificate")
            offer = parse_offer(await self._read_message(request))
        except WantError as exc:
            return self._bad_message("offer", peer, exc)
        q = self.queues.get(offer.model)
        # Only a waiter of at least the priority the offer was made for: the holder checks the
        # claim's key against it (an older holder states none: any waiter).
        taking = q is not None and not self._stopped and q.give_offer(peer, self.peer_name(peer), offer.offer_id,
                                                                      offer.priority or Priority.LOW)
        self.offer_counters["offers_in_taken" if taking else "offers_in_declined"] += 1
        return web.json_response({"taking": taking})

    def _offerable(self, peer: NodeId) -> bool:
        for view in self.node.peers():
            if view.node_id == peer:
                return view.liveness is Liveness.ALIVE and bool(view.mesh)
        return False

    def slot_freed(self, queue: WaitQueue) -> None:
        """A local slot of ``queue``'s model freed (a request ended, an offer was declined, a
        want arrived): offer it to the origin whose want comes first (a higher priority, then
        an older waiter) when it comes before this node's own queue's head; else it goes to
        this node's first waiter."""
        model = queue.model
        head = queue.head_want()
        own_ms = None if head is None else (time.monotonic() - head[1]) * 1000.0
        own_priority = Priority.NORMAL if head is None else head[0]
        peer = None
        if model in self.runtimes and not self._stopped and not self.draining() and self.config.routing.slot_offers:
            peer = self.wants.pick(model, own_ms, self._offerable, own_priority)
        if peer is None:
            queue.grant()
            return
        target = self.peer_target(peer)
        backend = queue.take() if target is not None else None
        if backend is None or target is None:
            queue.grant()
            return
        stated = self.wants.priority_of(peer, model)
        self.wants.offered(peer, model)
        hold = self.holds.add(model, peer, backend, stated)
        self.offer_counters["offers_out"] += 1
        self._spawn(self._offer(hold, target))

    async def _offer(self, hold: Hold, target: PeerTarget) -> None:
        """Offer the held slot; free it when declined, failed, or not claimed within
        ``hold_ms`` of a "taking" answer. Whatever happens here (even an error this code
        does not foresee), the hold ends with this task; ``stop`` frees holds itself. An
        origin that took the slot and did not claim it, or did not answer, gets a strike
        before the slot is offered again (``WantBook.unclaimed``: its wants are ignored a
        while), so it cannot keep the slot held for ever."""
        try:
            answer = await self._post(target, OFFER_PATH, Offer(hold.model, hold.offer_id, hold.priority).doc())
            if answer is not None and answer.get("taking") is True:
                self.offer_counters["offers_taken"] += 1
                await asyncio.sleep(self.holds.hold_ms / 1000.0)
                if self.holds.drop(hold.offer_id) is not None:  # not claimed meanwhile
                    self.offer_counters["holds_expired"] += 1
                    self._strike(hold, "took the offer and did not claim it")
                    self._free_hold(hold, reoffer=not self._stopped)
                return
            if answer is None:
                self.offer_counters["offers_failed"] += 1
                if not self._stopped:  # (a stopping agent's own session fails it)
                    self._strike(hold, "did not answer the offer")
            else:
                self.offer_counters["offers_declined"] += 1
        finally:
            left = self.holds.drop(hold.offer_id)
            if left is not None:
                self._free_hold(left, reoffer=not self._stopped)

    def _strike(self, hold: Hold, what: str) -> None:
        strike = self.wants.unclaimed(hold.peer)
        self.offer_counters["strikes"] += 1
        if strike.log:  # once per origin per STRIKE_LOG_MS; the counter has every one
            log.warning("mesh: %s %s for %s (strike %d in a row): its wants are ignored for %.0f s "
                        "(docs/routing.md, Slot offers)", self.peer_name(hold.peer), what, hold.model,
                        strike.count, strike.ignored_ms / 1000.0)

    def _free_hold(self, hold: Hold | None, reoffer: bool = True) -> None:
        if hold is None:
            return
        WaitQueue.release(hold.backend)
        if reoffer and hold.model in self.runtimes:  # (a reload may have removed the model)
            self.slot_freed(self.queues.of(hold.model))

    def claim(self, model: str, offer_id: str | None, peer: NodeId | None,
              priority: Priority | None = None) -> Backend | None:
        """The backend of the slot held for ``offer_id`` when this forward (from ``peer``, its
        key's verified ``priority``; None: not checked) claims it, else None (admit it like
        any other forward). A claim below the priority its origin's want stated is refused:
        the origin inflated its want (docs/security.md, "Priorities"); it gets a strike and
        the slot goes to the next in line before this forward is admitted like any other."""
        if not offer_id:
            return None
        hold = self.holds.claim(offer_id, peer, model)
        if hold is None:
            self.offer_counters["claims_unknown"] += 1
            return None
        if priority is not None and hold.below(priority):
            self.offer_counters["claims_below_priority"] += 1
            assert hold.priority is not None
            self._strike(hold, f"claimed an offer made for its {hold.priority.value}-priority want with a "
                               f"{priority.value}-priority key")
            self._free_hold(hold)
            return None
        self.offer_counters["claims"] += 1
        self.wants.claimed(hold.peer)
        return hold.backend

    def status(self) -> dict[str, Any]:
        """The ``mesh`` section of /v1/status: identity, peers by liveness, counters."""
        view = self.node.view()
        peers: dict[str, int] = {}
        for n in view.get("nodes", []):
            peers[n["liveness"]] = peers.get(n["liveness"], 0) + 1
        return {
            "self": {k: (view.get("self") or {}).get(k)
                     for k in ("id", "name", "mesh", "mesh_id", "trust", "state", "identity_conflict")},
            "peers": peers,
            "forwards": {"out": self.forwards_out, "in": self.forwards_in, "refused_in": self.refusals_in,
                         "refused_out": self.refusals_out},
            "queued": self.queues.waiting(),
            "offers": {"held": len(self.holds), "waiting_elsewhere": self.wants.waiting(),
                       **dict(sorted(self.offer_counters.items()))},
            "seeds": view.get("seeds", []),  # MeshNode.seeds(): each seed's dial history
            "counters": view.get("counters", {}),
        }
