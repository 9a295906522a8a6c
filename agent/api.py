"""The client API: OpenAI-compatible endpoints in front of this node's backends (DESIGN §6-7).

Routes: ``POST /v1/chat/completions``, ``/v1/completions``, ``/v1/embeddings``;
``GET /v1/models``, ``/health``, ``/v1/status``, ``/metrics``. Every error is OpenAI-shaped
(``agent/errors.py``): 400 malformed JSON, missing model or the wrong endpoint for the model's
kind; 404 unknown model (naming the known ones) or path; 405 wrong method; 413 body too large;
429 queue full or timed out and 503 nothing can serve, both with ``Retry-After``.

The request body is forwarded as received (re-serialised only to change ``stream`` and
``stream_options`` for an assembled answer: agent/assemble.py, docs/engines.md); mesh headers
(``X-Viiwork-*``) are stripped before a request reaches an engine.
"""

from __future__ import annotations

import asyncio
import gc
import itertools
import logging
import os
import time
import uuid
from collections import Counter
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from aiohttp import web

from viiwork import __version__
from viiwork.agent.admission import AdmissionError, ModelAdmission, NoCapacity
from viiwork.agent.backends import ModelRuntime
from viiwork.agent.drain import InFlight

if TYPE_CHECKING:
    from viiwork.agent.mesh_link import MeshLink, Waiter
from viiwork.agent.body import BodyError, parse_json_object, read_body
from viiwork.agent.errors import ErrorCode, error_response
from viiwork.agent.offers import OFFER_HEADER
from viiwork.agent.proxy import REFUSED_HEADER, Refused, Upstream
from viiwork.agent.router import Decision, Queue, Refuse, RunLocal, RunOnPeer
from viiwork.mesh.dialing import expect_node
from viiwork.mesh.transport import peer_of
from viiwork.engines.contract import Kind

log = logging.getLogger(__name__)

_KIND_OF_PATH = {
    "/v1/chat/completions": Kind.CHAT,
    "/v1/completions": Kind.CHAT,
    "/v1/embeddings": Kind.EMBEDDING,
}


class ClientApi:
    """Handlers of the client API over a node's models.

    runtimes: name -> ModelRuntime (the supervisor's picture). status_source: returns the
    ``models`` list of ``/v1/status`` (the supervisor's ``status()``); extra_status: more
    top-level sections (gpus, mesh counters), each a callable returning JSON-able data.
    """

    def __init__(
        self,
        *,
        node_name: str,
        runtimes: dict[str, ModelRuntime],
        upstream: Upstream,
        max_body_bytes: int,
        queue_max: int,
        queue_timeout_s: float,
        status_source: Callable[[], list[dict[str, Any]]],
        extra_status: dict[str, Callable[[], Any]] | None = None,
        forward_retry: int = 1,
        body_read_timeout_s: float = 30.0,
        body_timeout_s: float = 60.0,
    ) -> None:
        self.node_name = node_name
        self.body_read_timeout_s = body_read_timeout_s
        self.body_timeout_s = body_timeout_s
        # More /metrics lines (the listener's connection counters, malformed requests).
        self.metric_sources: list[Callable[[], list[str]]] = []
        self.forward_retry = forward_retry
        self.mesh: MeshLink | None = None
        self.runtimes = runtimes
        self.upstream = upstream
        # Engine errors are classified by the backend's engine adapter (agent/errors.py).
        upstream.engine_of = lambda backend: getattr(self.runtimes.get(backend.model), "engine", None)
        self.max_body_bytes = max_body_bytes
        self.admissions = {name: ModelAdmission(rt, queue_max, queue_timeout_s) for name, rt in runtimes.items()}
        self.status_source = status_source
        self.extra_status = extra_status or {}
        self.queue_max = queue_max
        self.queue_timeout_s = queue_timeout_s
        self.started = time.monotonic()
        self.responses: Counter[tuple[str, int]] = Counter()
        # Request ids for requests without X-Request-Id: 32 hex digits, a random per-process
        # prefix and a counter (unique for the process' life; uuid4 per request costs a syscall).
        self._id_prefix = os.urandom(8).hex()
        self._id_counter = itertools.count(1)
        # Set by `viiworkctl drain` and by the stop path: new requests get 503; those
        # admitted or queued finish. ``stopping``: the agent is on its way out (SIGTERM).
        self.draining = False
        self.stopping = False
        # Inference requests in flight here, on this API and the mesh listener (the stop
        # path waits for them: viiwork.agent.drain).
        self.in_flight = InFlight()

    def sync_models(self) -> None:
        """Follow ``runtimes`` after a reload: admission for new models, none for removed ones."""
        for name, runtime in self.runtimes.items():
            admission = self.admissions.get(name)
            if admission is None or admission.runtime is not runtime:
                self.admissions[name] = ModelAdmission(runtime, self.queue_max, self.queue_timeout_s)
        for name in list(self.admissions):
            if name not in self.runtimes:
                del self.admissions[name]

    # -- app ---------------------------------------------------------------------------

    def build_app(self) -> web.Application:
        # Bodies are bounded by our own check (413 JSON); aiohttp's limit is a backstop.
        app = web.Application(client_max_size=self.max_body_bytes + 1)
        for path in _KIND_OF_PATH:
            resource = app.router.add_resource(path)
            resource.add_route("POST", self.handle_inference)
            resource.add_route("*", self._method_not_allowed("POST"))
        for path, handler in (
            ("/v1/models", self.handle_models),
            ("/v1/mesh", self.handle_mesh),
            ("/health", self.handle_health),
            ("/v1/status", self.handle_status),
            ("/metrics", self.handle_metrics),
        ):
            resource = app.router.add_resource(path)
            resource.add_route("GET", handler)
            resource.add_route("*", self._method_not_allowed("GET"))
        app.router.add_route("*", "/{tail:.*}", self.handle_not_found)
        app.on_startup.append(_freeze_heap)
        self.in_flight.attach(app)
        return app

    @staticmethod
    def _method_not_allowed(allowed: str) -> Callable[[web.Request], Any]:
        async def handler(request: web.Request) -> web.Response:
            return error_response(405, f"{request.method} is not allowed on {request.path}; use {allowed}",
                                  code=ErrorCode.METHOD_NOT_ALLOWED, headers={"Allow": allowed})
        return handler

    async def handle_not_found(self, request: web.Request) -> web.Response:
        return error_response(404, f"no such endpoint: {request.method} {request.path}; see /v1/models, "
                              "/v1/chat/completions, /v1/completions, /v1/embeddings, /v1/status",
                              code=ErrorCode.NOT_FOUND)

    # -- inference -----------------------------------------------------------------------

    async def handle_inference(self, request: web.Request) -> web.StreamResponse:
        request_id = request.headers.get("X-Request-Id") or f"{self._id_prefix}{next(self._id_counter):016x}"
        try:
            body = await read_body(request, self.max_body_bytes, "api.max_body_bytes", self.body_read_timeout_s,
                                   self.body_timeout_s)
            payload = parse_json_object(body)
        except BodyError as exc:
            return self._count("-", error_response(exc.status, str(exc), code=exc.code))
        model = payload.get("model")
        if not isinstance(model, str) or not model:
            return self._count("-", error_response(400, "'model' is required and must be a string", param="model",
                                                   code=ErrorCode.MISSING_MODEL))
        runtime = self.runtimes.get(model)
        if self.mesh is not None:
            response = await self._mesh_inference(request, body, payload, model, runtime, request_id)
            # A model no node serves is counted as "-": a client cannot grow /metrics at will.
            return self._count(model if response.status != 404 else "-", response)
        if runtime is None:
            known = ", ".join(sorted(self.runtimes)) or "none"
            return self._count("-", error_response(
                404, f"model {model!r} is not served here; known models: {known}", param="model",
                code=ErrorCode.MODEL_NOT_FOUND))
        wanted = _KIND_OF_PATH[request.path]
        if runtime.config.kind is not wanted:
            return self._count(model, error_response(
                400, f"model {model!r} is a {runtime.config.kind.value} model; {request.path} needs a "
                f"{wanted.value} model", param="model", code=ErrorCode.WRONG_MODEL_KIND))
        if self.draining:
            return self._count(model, error_response(
                503, f"node {self.node_name!r} is draining for maintenance and admits no new requests",
                code=ErrorCode.DRAINING, retry_after_s=5))
        admission = self.admissions[model]
        try:
            lease = await admission.acquire()
        except AdmissionError as exc:
            return self._count(model, error_response(exc.status, str(exc), code=_admission_code(exc),
                                                     retry_after_s=exc.retry_after_s))
        try:
            headers = {
                "X-Viiwork-Node": self.node_name,
                "X-Viiwork-Backend": lease.backend.id,
                "X-Viiwork-Queued-Ms": f"{lease.queued_ms:.1f}",
                "X-Request-Id": request_id,
            }
            stream = payload.get("stream") is True
            response = await self.upstream.forward(request, lease.backend, body, stream, headers, request_id)
        finally:
            admission.release(lease.backend)
        return self._count(model, response)

    # -- mesh ----------------------------------------------------------------------------

    def attach_mesh(self, mesh: MeshLink) -> None:
        """Route over the mesh (DESIGN §6) and accept forwards on its listener (call before
        ``mesh.start()``: routes are added to the mesh listener's app)."""
        self.mesh = mesh
        mesh.admissions = self.admissions
        self.in_flight.attach(mesh.node.app)  # forwards from peers count as in flight
        for path in _KIND_OF_PATH:
            mesh.node.app.router.add_post(path, self.handle_forwarded)
        for name, runtime in self.runtimes.items():
            runtime.listeners.append(lambda rt: mesh.wake(rt.name))

    async def _mesh_inference(self, request: web.Request, body: bytes, payload: dict[str, Any], model: str,
                              runtime: ModelRuntime | None, request_id: str) -> web.StreamResponse:
        """Run a request anywhere in the mesh: local first, else the peer with most room,
        else wait in this origin's queue (DESIGN §6). Peers that refuse before the first byte
        are retried elsewhere ``routing.forward_retry`` times."""
        mesh = self.mesh
        assert mesh is not None
        wanted = _KIND_OF_PATH[request.path]
        kind = runtime.config.kind.value if runtime is not None else next(
            (m.get("kind") for m in mesh.models() if m.get("id") == model), None)
        if kind is not None and kind != wanted.value:
            return error_response(400, f"model {model!r} is a {kind} model; {request.path} needs a "
                                  f"{wanted.value} model", param="model", code=ErrorCode.WRONG_MODEL_KIND)
        if self.draining:
            return error_response(503, f"node {self.node_name!r} is draining for maintenance and admits no new "
                                  "requests", code=ErrorCode.DRAINING, retry_after_s=5)
        host = request.query.get("host") or request.headers.get("X-Viiwork-Host")
        affinity = request.headers.get("X-Session-Id") or request.headers.get("X-Session-Affinity")
        stream = payload.get("stream") is True
        admission = self.admissions.get(model)
        queue = mesh.queue(model)
        loop = asyncio.get_running_loop()
        started = loop.time()
        deadline = started + self.queue_timeout_s
        waiter: Waiter | None = None
        tried: set[Any] = set()
        refusals = 0
        if len(queue):  # never overtake a waiting request: wait behind it for the next wake
            if len(queue) >= self.queue_max:
                return self._queue_full(model)
            waiter = queue.enter(host)
        behind = waiter is not None
        try:
            while True:
                if behind:  # older waiters route first when a slot frees (docs/routing.md)
                    behind = False
                    await _park(waiter, deadline - loop.time())
                offer: tuple[Any, str] | None = None
                if waiter is not None:
                    waiter.event.clear()
                    offer, waiter.offer = waiter.offer, None
                decision: Decision
                if offer is not None:  # a peer keeps a slot for this request (slot offers)
                    decision = RunOnPeer(offer[0], mesh.peer_name(offer[0]), 1)
                else:
                    decision = mesh.route(model, host=host, affinity=affinity, exclude=tried)
                if isinstance(decision, RunLocal):
                    backend = admission.try_acquire(decision.backend_id) if admission is not None else None
                    if backend is not None:
                        if waiter is not None:  # it runs now: it waits no more
                            queue.leave(waiter)
                            waiter = None
                        headers = self._where(self.node_name, backend.id, started, request_id)
                        try:
                            return await self.upstream.forward(request, backend, body, stream, headers, request_id)
                        finally:
                            admission.release(backend)  # type: ignore[union-attr]
                            mesh.slot_freed(model)
                    decision = Queue("local slot taken meanwhile")
                elif isinstance(decision, RunOnPeer):
                    target = mesh.peer_target(decision.node_id)
                    result: web.StreamResponse | Refused
                    if target is None:
                        result = Refused(503, "no mesh address")
                    else:
                        token = mesh.reservations.reserve(decision.node_id, model)
                        headers = self._where(decision.name, "", started, request_id)
                        log.debug("request %s for %s: forwarding to %s%s", request_id, model, decision.name,
                                  " (offered slot)" if offer else "")
                        # expect_node: refused before a byte is sent unless the TLS peer is
                        # that node (viiwork.mesh.dialing); a refusal routes it again.
                        extra = {"X-Viiwork-Origin": self.node_name, **expect_node(target.node_id)}
                        if offer is not None:
                            extra[OFFER_HEADER] = offer[1]
                        if waiter is not None:  # not waiting while the forward is in flight
                            queue.dispatch(waiter)
                        try:
                            # A peer that turns suspect or dead while this forward waits for its
                            # first byte is abandoned and the request routed again.
                            with mesh.watch_peer(decision.node_id) as lost:
                                result = await self.upstream.forward(
                                    request, target, body, stream, headers, request_id, session=mesh.session,
                                    extra_headers=extra,
                                    relay_headers=("X-Viiwork-Node", "X-Viiwork-Backend"), refusable=True,
                                    lost=lost)
                        finally:
                            mesh.reservations.release(token)
                            mesh.wake(model)
                    if not isinstance(result, Refused):
                        mesh.forwards_out += 1
                        return result
                    if waiter is not None:  # back in its place in the queue
                        queue.dispatch(waiter, False)
                    mesh.refusals_out += 1
                    log.debug("request %s: %s refused (%d %s)", request_id, decision.name, result.status,
                              result.reason)
                    mesh.reservations.mark_full(decision.node_id, model)
                    tried.add(decision.node_id)
                    refusals += 1
                    if refusals <= self.forward_retry:
                        continue
                    decision = Queue("peers refused")
                if isinstance(decision, Refuse):
                    return error_response(decision.status, decision.message, param=decision.param,
                                          code=decision.code, retry_after_s=decision.retry_after_s)
                # Queue: wait for capacity anywhere, then route again.
                if waiter is None:
                    if len(queue) >= self.queue_max:
                        return self._queue_full(model)
                    waiter = queue.enter(host)
                remaining = deadline - loop.time()
                if remaining <= 0:
                    return self._queue_timeout(model)
                await _park(waiter, remaining)
                tried.clear()
                refusals = 0
        finally:
            if waiter is not None:
                queue.leave(waiter)
                queue.wake()

    def _where(self, node: str, backend: str, started: float, request_id: str) -> dict[str, str]:
        headers = {
            "X-Viiwork-Node": node,
            "X-Viiwork-Origin": self.node_name,
            "X-Viiwork-Queued-Ms": f"{(asyncio.get_running_loop().time() - started) * 1000:.1f}",
            "X-Request-Id": request_id,
        }
        if backend:
            headers["X-Viiwork-Backend"] = backend
        return headers

    def _queue_full(self, model: str) -> web.Response:
        return error_response(429, f"model {model!r}: no free slot in the mesh and the queue is full "
                              f"({self.queue_max} waiting)", code=ErrorCode.RATE_LIMIT_EXCEEDED, retry_after_s=1)

    def _queue_timeout(self, model: str) -> web.Response:
        return error_response(429, f"model {model!r}: no slot freed in the mesh within "
                              f"{self.queue_timeout_s:g} s", code=ErrorCode.RATE_LIMIT_EXCEEDED, retry_after_s=2)

    async def handle_forwarded(self, request: web.Request) -> web.StreamResponse:
        """A request forwarded by a peer, on the mesh listener (mutual TLS).

        Admitted only into a free local slot: never queued, never forwarded again. Otherwise
        answered 429/503 with ``X-Viiwork-Refused`` so the origin can try another peer
        before the first byte.
        """
        mesh = self.mesh
        assert mesh is not None
        origin_id = peer_of(request)
        origin = mesh.peer_name(origin_id)
        request_id = request.headers.get("X-Request-Id") or uuid.uuid4().hex
        # Bounded by this node's api.max_body_bytes, the limit the origin applied (not the
        # listener's client_max_size, which bounds gossip's request.read()).
        try:
            body = await read_body(request, self.max_body_bytes, "api.max_body_bytes", self.body_read_timeout_s,
                                   self.body_timeout_s)
            payload = parse_json_object(body)
        except BodyError as exc:
            return error_response(exc.status, f"forwarded request is malformed: {exc}", code=exc.code)
        model = payload.get("model")
        if not isinstance(model, str) or not model:
            return error_response(400, "forwarded request is malformed: 'model' is required and must be a string",
                                  param="model", code=ErrorCode.MISSING_MODEL)
        runtime = self.runtimes.get(model)
        admission = self.admissions.get(model)
        if runtime is None or admission is None:
            return self._refuse(503, "not-served", f"node {self.node_name!r} does not serve model {model!r}")
        if self.draining:
            held = mesh.claim(request.headers.get(OFFER_HEADER), origin_id, model)
            if held is not None:  # offered just before the drain began: free the slot now
                admission.release(held)
                mesh.slot_freed(model)
            return self._refuse(503, "draining", f"node {self.node_name!r} is draining")
        wanted = _KIND_OF_PATH[request.path]
        if runtime.config.kind is not wanted:
            return error_response(400, f"model {model!r} is a {runtime.config.kind.value} model; {request.path} "
                                  f"needs a {wanted.value} model", param="model", code=ErrorCode.WRONG_MODEL_KIND)
        backend = mesh.claim(request.headers.get(OFFER_HEADER), origin_id, model) or admission.try_acquire()
        if backend is None:
            mesh.refusals_in += 1
            return self._refuse(429, "no-slot", f"node {self.node_name!r} has no free slot for {model!r}")
        mesh.forwards_in += 1
        log.debug("request %s for %s forwarded by %s runs on %s", request_id, model, origin, backend.id)
        headers = {"X-Viiwork-Node": self.node_name, "X-Viiwork-Backend": backend.id,
                   "X-Viiwork-Origin": origin, "X-Request-Id": request_id}
        try:
            return await self.upstream.forward(request, backend, body, payload.get("stream") is True, headers,
                                               request_id)
        finally:
            admission.release(backend)
            mesh.slot_freed(model)

    @staticmethod
    def _refuse(status: int, reason: str, message: str) -> web.Response:
        return error_response(status, message, code=_REFUSAL_CODES.get(reason), retry_after_s=1,
                              headers={REFUSED_HEADER: reason})

    def _count(self, model: str, response: web.StreamResponse) -> web.StreamResponse:
        self.responses[(model, response.status)] += 1
        return response

    # -- read-only views ---------------------------------------------------------------

    async def handle_models(self, request: web.Request) -> web.Response:
        if self.mesh is not None:
            return web.json_response({"object": "list", "data": self.mesh.models()})
        data = []
        for name, rt in sorted(self.runtimes.items()):
            ctx = rt.ctx_per_slot
            data.append({
                "id": name, "object": "model", "created": 0, "owned_by": "viiwork",
                "kind": rt.config.kind.value, "engine": rt.config.engine,
                "max_model_len": ctx, "context_length": ctx,
            })
        return web.json_response({"object": "list", "data": data})

    async def handle_mesh(self, request: web.Request) -> web.Response:
        """GET /v1/mesh: every node this node knows, with liveness, age and models."""
        if self.mesh is None:
            return error_response(404, f"node {self.node_name!r} is standalone: its config has no [mesh] section",
                                  code=ErrorCode.NOT_FOUND)
        return web.json_response(self.mesh.node.view())

    async def handle_health(self, request: web.Request) -> web.Response:
        """200 ``{"status": "ok"}``; 503 with ``Retry-After`` when no backend is healthy, or
        at once when the node drains or stops (``"status": "draining"|"stopping"``, with the
        requests still ``in_flight``): load balancers stop sending here (docs/architecture.md)."""
        healthy = sum(len(rt.healthy_backends) for rt in self.runtimes.values())
        if self.stopping or self.draining:
            return web.json_response({"status": "stopping" if self.stopping else "draining",
                                      "healthy_backends": healthy, "in_flight": len(self.in_flight)},
                                     status=503, headers={"Retry-After": "5"})
        if self.runtimes and healthy == 0:
            return web.json_response({"status": "unavailable", "healthy_backends": 0}, status=503)
        return web.json_response({"status": "ok", "healthy_backends": healthy})

    async def handle_status(self, request: web.Request) -> web.Response:
        models = self.status_source()
        for entry in models:
            entry["queued"] = self._queued(entry.get("name"))
        doc: dict[str, Any] = {
            "node": {"name": self.node_name, "version": __version__, "draining": self.draining,
                     "stopping": self.stopping, "in_flight": len(self.in_flight),
                     "uptime_s": round(time.monotonic() - self.started, 1)},
            "models": models,
        }
        for key, source in self.extra_status.items():
            try:
                doc[key] = source()
            except Exception as exc:  # a broken section must not break /v1/status
                log.warning("status section %s failed: %s", key, exc)
                doc[key] = {"error": str(exc)}
        return web.json_response(doc)

    def _queued(self, model: Any) -> int:
        """Requests waiting for ``model`` here: in the mesh's origin queue with a [mesh],
        else in the standalone admission queue."""
        if self.mesh is not None:
            q = self.mesh.queues.get(model)
            return 0 if q is None else len(q)
        admission = self.admissions.get(model)
        return 0 if admission is None else admission.queued

    async def handle_metrics(self, request: web.Request) -> web.Response:
        lines = [
            "# HELP viiwork_responses_total Client API responses by model and status code.",
            "# TYPE viiwork_responses_total counter",
        ]
        for (model, status), n in sorted(self.responses.items()):
            lines.append(f'viiwork_responses_total{{model="{_esc(model)}",code="{status}"}} {n}')
        lines += ["# HELP viiwork_model_slots Slots of healthy backends.", "# TYPE viiwork_model_slots gauge"]
        lines += [f'viiwork_model_slots{{model="{_esc(n)}"}} {sum(b.slots for b in rt.healthy_backends)}'
                  for n, rt in sorted(self.runtimes.items())]
        lines += ["# HELP viiwork_model_in_flight Requests running on this node's backends.",
                  "# TYPE viiwork_model_in_flight gauge"]
        lines += [f'viiwork_model_in_flight{{model="{_esc(n)}"}} {sum(b.in_flight for b in rt.backends)}'
                  for n, rt in sorted(self.runtimes.items())]
        lines += ["# HELP viiwork_model_queued Requests waiting in this node's queue.",
                  "# TYPE viiwork_model_queued gauge"]
        lines += [f'viiwork_model_queued{{model="{_esc(n)}"}} {self._queued(n)}' for n in sorted(self.admissions)]
        lines += ["# HELP viiwork_backend_respawns_total Respawns per backend.",
                  "# TYPE viiwork_backend_respawns_total counter"]
        for rt in self.runtimes.values():
            for b in rt.backends:
                lines.append(f'viiwork_backend_respawns_total{{model="{_esc(rt.name)}",backend="{_esc(b.id)}"}} '
                             f'{b.respawns}')
        if self.mesh is not None:
            lines += ["# HELP viiwork_mesh_offers_total Slot offer events by kind (docs/routing.md, Slot offers).",
                      "# TYPE viiwork_mesh_offers_total counter"]
            lines += [f'viiwork_mesh_offers_total{{event="{_esc(event)}"}} {n}'
                      for event, n in sorted(self.mesh.offer_counters.items())]
            lines += ["# HELP viiwork_mesh_slots_held Local slots kept for an offer now.",
                      "# TYPE viiwork_mesh_slots_held gauge", f"viiwork_mesh_slots_held {len(self.mesh.holds)}"]
        for source in self.metric_sources:
            lines += source()
        return web.Response(text="\n".join(lines) + "\n", content_type="text/plain")


# The code of a peer's refusal (X-Viiwork-Refused reason) for the origin's logs and relays.
_REFUSAL_CODES = {"no-slot": ErrorCode.RATE_LIMIT_EXCEEDED, "not-served": ErrorCode.NO_CAPACITY,
                  "draining": ErrorCode.DRAINING}


def _admission_code(exc: AdmissionError) -> ErrorCode:
    """429 queue full / timed out: rate_limit_exceeded; 503 nothing can serve: no_capacity."""
    return ErrorCode.NO_CAPACITY if isinstance(exc, NoCapacity) else ErrorCode.RATE_LIMIT_EXCEEDED


async def _park(waiter: Waiter, remaining_s: float) -> None:
    """Wait in the origin queue until woken (a capacity change, an offer) or 0.5 s pass, at
    most ``remaining_s``: a parked waiter re-routes at least twice a second regardless."""
    waiter.parked = True
    try:
        await asyncio.wait_for(waiter.event.wait(), max(0.0, min(remaining_s, 0.5)))
    except TimeoutError:
        pass
    finally:
        waiter.parked = False


async def _freeze_heap(app: web.Application) -> None:
    """Move what start-up allocated (modules, config, pydantic models) out of the cyclic
    collector's view: a full collection of the agent's heap takes tens of milliseconds, a
    pause every request in flight would wait out (gc.freeze, CPython >= 3.7)."""
    gc.collect()
    gc.freeze()


def _esc(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
