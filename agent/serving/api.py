"""The client API: OpenAI-compatible endpoints in front of this node's backends (docs/routing.md).

Routes: ``POST`` at every inference endpoint (engines/contract.py ``ENDPOINT_PATHS``: OpenAI's
``/v1/chat/completions``, ``/v1/completions``, ``/v1/embeddings``, ``/v1/responses``; Anthropic's
``/v1/messages`` and ``/v1/messages/count_tokens``; ``/v1/rerank``, ``/v1/score``, ``/tokenize``,
``/detokenize``; docs/routing.md, "Endpoints"), all through the one pipeline;
``GET /v1/models``, ``/health``, ``/v1/status``, ``/metrics``, and the dashboard under ``/ui``
(agent/serving/dashboard.py), all behind the browser checks (agent/serving/browser_guard.py:
403 a rebinding Host or a cross-site Origin, 415 a browser's form POST). Every error is OpenAI-shaped
(``agent/serving/errors.py``), rewritten in Anthropic's shape on ``/v1/messages*`` (``_dialect``):
400 malformed JSON, missing model, the wrong endpoint for the model's kind, an endpoint none of its
backends serves, or a Responses request using stored state; 404 unknown model (naming the known
ones) or path; 405 wrong method; 413 body too large; 429 queue full or timed out and 503 nothing
can serve, both with ``Retry-After``.

This module parses, validates and renders; a request's life (admit, route, run locally,
forward, wait) is ``agent/serving/pipeline.py``, on a standalone node and in a mesh alike, and a
request a peer forwarded enters it at "run locally" (the mesh listener's forward route).

The request body is forwarded as received (re-serialised only to change ``stream`` and
``stream_options`` for an assembled answer: agent/serving/assemble.py, docs/engines.md); mesh headers
(``X-Viiwork-*``) are stripped before a request reaches an engine.

One module (over 400 lines) because every route shares the same parse, validate and render
steps and the listener's state (drain, auth gate, metrics); split by route, one request's
checks would be spread over several files. A request's own fields for the queue and the usage
row are filled here too (``_queue_place``, ``_for_usage``), from the key this node verified.
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
from typing import Any

from aiohttp import web

from viiwork import __version__
from viiwork.agent.auth.gate import AuthGate, claims_of
from viiwork.agent.auth.headers import MAX_HEADER_BYTES
from viiwork.agent.peering.mesh_link import MeshLink
from viiwork.agent.peering.offers import OFFER_HEADER
from viiwork.agent.serving.accounting import Accounting
from viiwork.agent.serving.assemble import ASSEMBLED_PATHS
from viiwork.agent.serving.body import BodyError, count_param_error, parse_json_object, read_body
from viiwork.agent.serving.browser_guard import BrowserGuard
from viiwork.agent.serving.dashboard import Dashboard, RequestStats
from viiwork.agent.serving.drain import InFlight
from viiwork.agent.serving.ejections import Ejections
from viiwork.agent.serving.errors import Dialect, ErrorCode, as_anthropic, dialect_of, error_response
from viiwork.agent.serving.metrics import MetricSource, build_registry, exposition
from viiwork.agent.serving.observe import Observers
from viiwork.agent.serving.pipeline import Call, NoPeers, PeerRefusal, Pipeline
from viiwork.agent.serving.prefix_routing import PrefixRouting
from viiwork.agent.serving.proxy import BROKE, FIRST_CHUNK_AT, REFUSED_HEADER, Upstream
from viiwork.agent.serving.router import Refuse, endpoint_paths
from viiwork.agent.serving.tokens import ask_stream_usage
from viiwork.agent.serving.tracing import Tracing
from viiwork.agent.serving.waitqueue import Queues
from viiwork.agent.supervision.backends import ModelRuntime
from viiwork.agent.usage.ledger import Ledger
from viiwork.engines.contract import ENDPOINT_OF_PATH, Kind
from viiwork.mesh.transport import peer_of

log = logging.getLogger(__name__)

# The kind of model the classic endpoints need (400 wrong_model_kind otherwise); the others need
# only a backend that serves them (400 endpoint_not_supported: agent/serving/router.py).
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
    ejections: the node's outlier ejection (default: the mesh link's, else one with default
    settings); its ``outliers`` section of /v1/status and its /metrics lines are added here.
    browser: the Host/Origin/content-type checks run on every route (agent/serving/browser_guard.py;
    default: no api.allowed_hosts or api.allowed_origins); its ``browser`` section and counter too.
    auth: the client-key checks (agent/auth/gate.py: a middleware, ``admit`` once the body names
    the model, ``check_forwarded`` on a peer's forward); None when ``[auth] mode`` is ``none``.
    ledger: the usage ledger the requests run on this node's backends are recorded in
    (agent/serving/accounting.py; None: no rows, the /metrics usage counters still count).
    tracing: the requests' trace context and spans (agent/serving/tracing.py; default: the W3C
    headers carried on, no spans).
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
        queues: Queues | None = None,
        mesh: MeshLink | None = None,
        ejections: Ejections | None = None,
        browser: BrowserGuard | None = None,
        auth: AuthGate | None = None,
        ledger: Ledger | None = None,
        tracing: Tracing | None = None,
        prefixes: PrefixRouting | None = None,
    ) -> None:
        self.node_name = node_name
        self.body_read_timeout_s = body_read_timeout_s
        self.body_timeout_s = body_timeout_s
        # More /metrics families (the listener's connection counters, malformed requests),
        # and the subscribers to each answered request (agent/serving/observe.py).
        self.browser = browser or BrowserGuard()
        self.metric_sources: list[MetricSource] = [self.browser.metric_families]
        self.tracing = tracing or Tracing(node_name=node_name)
        self.metric_sources.append(self.tracing.metric_families)
        self.mesh = mesh
        self.runtimes = runtimes
        self.upstream = upstream
        # Engine errors are classified by the backend's engine adapter (agent/serving/errors.py).
        upstream.engine_of = lambda backend: getattr(self.runtimes.get(backend.model), "engine", None)
        self.max_body_bytes = max_body_bytes
        # The origin queues (shared with the mesh link, which offers freed slots to peers).
        self.queues = queues or Queues(runtimes, queue_max, queue_timeout_s)
        self.ejections = ejections or (mesh.ejections if mesh is not None else Ejections(runtimes))
        # Rows of the requests this node serves, by its node id in a mesh (agent/serving/accounting.py).
        self.accounting = Accounting(ledger, (lambda: str(mesh.node.node_id)) if mesh is not None
                                     else (lambda: node_name))
        self.metric_sources.append(self.accounting.metric_families)
        self.pipeline = Pipeline(node_name=node_name, runtimes=runtimes, queues=self.queues,
                                 peers=mesh or NoPeers(runtimes), upstream=upstream, forward_retry=forward_retry,
                                 ejections=self.ejections, accounting=self.accounting,
                                 prefixes=prefixes or (mesh.prefixes if mesh is not None else None))
        self.metric_sources.append(self.pipeline.prefixes.metric_families)
        self.status_source = status_source
        self.extra_status = {"outliers": self._outliers_status, "browser": self.browser.status,
                             **(extra_status or {})}
        self.started = time.monotonic()
        self.responses: Counter[tuple[str, int]] = Counter()
        # Each answered inference request, told to the dashboard's ring (and any observer added).
        self.request_stats = RequestStats()
        self.observers = Observers(self.request_stats)
        # Request ids for requests without X-Request-Id: 32 hex digits, a random per-process
        # prefix and a counter (unique for the process' life; uuid4 per request costs a syscall).
        self._id_prefix = os.urandom(8).hex()
        self._id_counter = itertools.count(1)
        # ``stopping``: the agent is on its way out (SIGTERM); ``draining``: the pipeline's.
        self.stopping = False
        # Inference requests in flight here, on this API and the mesh listener (the stop
        # path waits for them: viiwork.agent.serving.drain).
        self.in_flight = InFlight()
        if mesh is not None:  # forwards from peers enter the pipeline at "run locally"
            mesh.accept_forwards(self.tracing.traced(self.handle_forwarded, forwarded=True), ENDPOINT_OF_PATH,
                                 self.in_flight)
        # /metrics: a registry of this API's own, read at scrape time (agent/serving/metrics.py);
        # its request histograms join ``observers``.
        self.registry, self.histograms = build_registry(self)
        # Client keys (agent/auth/gate.py): None when [auth] mode is "none".
        self.auth = auth
        if auth is not None:
            self.metric_sources.append(auth.metric_families)
            self.extra_status["auth"] = auth.status

    @property
    def draining(self) -> bool:
        """Set by `viiworkctl drain` and by the stop path: new requests get 503; those
        admitted or queued finish."""
        return self.pipeline.draining

    @draining.setter
    def draining(self, value: bool) -> None:
        self.pipeline.draining = value

    def sync_models(self) -> None:
        """Follow ``runtimes`` after a reload: the queues watch new models' backends, and a
        model that left (served neither here nor, as far as this node knows, by a peer) loses
        its series: the request histograms', ``viiwork_responses_total``'s, the usage counters' and
        prefix routing's (its index too)."""
        self.queues.sync()
        labels = (set(self.histograms.models()) | {model for model, _ in self.responses}
                  | {model for _, model, _ in self.accounting.requests} | self.pipeline.prefixes.models())
        for model in labels:
            if model != "-" and model not in self.runtimes and self.pipeline.peers.kind_of(model) is None:
                self.histograms.remove(model)
                self.accounting.forget_model(model)
                self.pipeline.prefixes.forget_model(model)
                for key in [k for k in self.responses if k[0] == model]:
                    del self.responses[key]

    # -- app ---------------------------------------------------------------------------

    def build_app(self) -> web.Application:
        # Bodies are bounded by our own check (413 JSON); aiohttp's limit is a backstop.
        # Every route, the dashboard's and the 404 included, is behind the browser checks,
        # then (keys mode) the client-key gate.
        # The dialect rewrite is outermost: it sees every error, the browser checks' and the keys' too.
        middlewares = [_dialect, self.browser.middleware()] + ([self.auth.middleware] if self.auth is not None else [])
        app = web.Application(client_max_size=self.max_body_bytes + 1, middlewares=middlewares)
        if self.auth is not None:
            app.on_response_prepare.append(self.auth.on_response_prepare)
        inference = self.tracing.traced(self.handle_inference)  # request[TRACE]: agent/serving/tracing.py
        for path in ENDPOINT_OF_PATH:
            resource = app.router.add_resource(path)
            resource.add_route("POST", inference)
            resource.add_route("*", self._inference_method_not_allowed)
        for path, handler in (
            ("/v1/models", self.handle_models),
            ("/v1/mesh", self.handle_mesh),
            ("/health", self.handle_health),
            ("/v1/status", self.handle_status),
            ("/metrics", self.handle_metrics),
        ):
            resource = app.router.add_resource(path)
            # HEAD too, as aiohttp's add_get does: a probe's HEAD /health is the GET without a body.
            resource.add_route("GET", handler)
            resource.add_route("HEAD", handler)
            resource.add_route("*", self._method_not_allowed("GET, HEAD"))
        Dashboard(status=self.status_doc, mesh=self.mesh_doc, stats=self.request_stats).add_routes(app)
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

    async def _inference_method_not_allowed(self, request: web.Request) -> web.StreamResponse:
        """405 on an inference path (observed as model "-": an answer of the inference API)."""
        started = asyncio.get_running_loop().time()
        message = f"{request.method} is not allowed on {request.path}; use POST"
        return self._refused_early(started, error_response(405, message, code=ErrorCode.METHOD_NOT_ALLOWED,
                                                           headers={"Allow": "POST"}), message)

    async def handle_not_found(self, request: web.Request) -> web.Response:
        return error_response(404, f"no such endpoint: {request.method} {request.path}; see /v1/models, /v1/status "
                              f"and POST {', '.join(ENDPOINT_OF_PATH)}", code=ErrorCode.NOT_FOUND)

    # -- inference: parse and validate, run the pipeline (agent/serving/pipeline.py), render -------

    async def handle_inference(self, request: web.Request) -> web.StreamResponse:
        loop = asyncio.get_running_loop()
        started = loop.time()
        request_id = client_request_id(request.headers.get("X-Request-Id")) or \
            f"{self._id_prefix}{next(self._id_counter):016x}"
        try:
            body = await read_body(request, self.max_body_bytes, "api.max_body_bytes", self.body_read_timeout_s,
                                   self.body_timeout_s)
            payload = parse_json_object(body)
        except BodyError as exc:
            return self._refused_early(started, error_response(exc.status, str(exc), code=exc.code), str(exc))
        model = payload.get("model")
        if not isinstance(model, str) or not model:
            message = "'model' is required and must be a string"
            return self._refused_early(started, error_response(400, message, param="model",
                                                               code=ErrorCode.MISSING_MODEL), message)
        if (bad := count_param_error(payload) or endpoint_param_error(request.path, payload)) is not None:
            param, code, message = bad
            return self._refused_early(started, error_response(400, message, param=param, code=code), message)
        if self.auth is not None:
            await self.auth.pace(request, payload)  # then admit, with no await between (UsageShare.pace)
            if (refusal := self.auth.admit(request, model, payload)) is not None:
                return self._refused_early(started, refusal, "client key refused")
        call = Call(request, body, model, _kind_of(request.path), payload.get("stream") is True,
                    request_id, endpoint=ENDPOINT_OF_PATH[request.path].value,
                    host=request.query.get("host") or request.headers.get("X-Viiwork-Host"),
                    affinity=request.headers.get("X-Session-Id") or request.headers.get("X-Session-Affinity"),
                    arrived=started, **_queue_place(request))
        _for_usage(call, payload)
        call.prefix = self.pipeline.prefixes.key(payload, model, call.tenant)
        outcome = await self.pipeline.run(call)
        response = _render(outcome)
        # A model no node serves is counted as "-": a client cannot grow /metrics at will
        # (a refusal before routing, such as a drain's 503, names a model nobody checked).
        known = model in self.runtimes or not isinstance(outcome, Refuse) or (
            outcome.status != 404 and self.pipeline.peers.kind_of(model) is not None)
        label = model if known else "-"
        end = loop.time()
        self.observers.observe(label, response.status, call.queued_s, response.get(FIRST_CHUNK_AT, end) - started,
                               end - started, _failure(outcome, response))
        return self._count(label, response)

    async def handle_forwarded(self, request: web.Request) -> web.StreamResponse:
        """A request forwarded by a peer, on the mesh listener (mutual TLS): it enters the
        pipeline at "run locally" (``Pipeline.run_forwarded``: never queued, never forwarded
        again; otherwise 429/503 with ``X-Viiwork-Refused`` so the origin can try another
        peer before the first byte)."""
        arrived = asyncio.get_running_loop().time()
        request_id = client_request_id(request.headers.get("X-Request-Id")) or uuid.uuid4().hex
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
        if (bad := count_param_error(payload) or endpoint_param_error(request.path, payload)) is not None:
            param, code, message = bad
            return error_response(400, f"forwarded request is malformed: {message}", param=param, code=code)
        if self.auth is not None and (refusal := self.auth.check_forwarded(request, model)) is not None:
            return refusal
        call = Call(request, body, model, _kind_of(request.path), payload.get("stream") is True,
                    request_id, endpoint=ENDPOINT_OF_PATH[request.path].value,
                    queued_s=_queued_s(request.headers.get("X-Viiwork-Queued-Ms")),
                    origin=str(peer_of(request) or ""), arrived=arrived, **_queue_place(request))
        _for_usage(call, payload)
        call.prefix = self.pipeline.prefixes.key(payload, model, call.tenant)
        return _render(await self.pipeline.run_forwarded(call, peer_of(request), request.headers.get(OFFER_HEADER)))

    def _refused_early(self, started: float, response: web.StreamResponse, message: str) -> web.StreamResponse:
        """An answer the agent gives before it knows a model (unreadable, oversized or
        malformed body, no model; a wrong method on an inference path): observed and
        counted as model "-", like every answer (docs/metrics.md)."""
        end = asyncio.get_running_loop().time()
        self.observers.observe("-", response.status, None, end - started, end - started, message)
        return self._count("-", response)

    def _count(self, model: str, response: web.StreamResponse) -> web.StreamResponse:
        self.responses[(model, response.status)] += 1
        return response

    # -- read-only views ---------------------------------------------------------------

    async def handle_models(self, request: web.Request) -> web.Response:
        if self.mesh is not None:
            return web.json_response({"object": "list", "data": self._visible(request, self.mesh.models())})
        data = []
        for name, rt in sorted(self.runtimes.items()):
            ctx = rt.ctx_per_slot
            data.append({
                "id": name, "object": "model", "created": 0, "owned_by": "viiwork",
                "kind": rt.config.kind.value, "engine": rt.config.engine,
                "max_model_len": ctx, "context_length": ctx, "endpoints": endpoint_paths(rt.endpoints),
            })
        return web.json_response({"object": "list", "data": self._visible(request, data)})

    def _visible(self, request: web.Request, data: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """The models the request's client key allows (all of them with keys off)."""
        return data if self.auth is None else self.auth.visible_models(request, data)

    async def handle_mesh(self, request: web.Request) -> web.Response:
        """GET /v1/mesh: every node this node knows, with liveness, age and models."""
        doc = self.mesh_doc()
        if doc is None:
            return error_response(404, f"node {self.node_name!r} is standalone: its config has no [mesh] section",
                                  code=ErrorCode.NOT_FOUND)
        return web.json_response(doc)

    def mesh_doc(self) -> dict[str, Any] | None:
        """The /v1/mesh document (``MeshNode.view`` with outlier ejection), None when standalone."""
        if self.mesh is None:
            return None
        doc = self.mesh.node.view()
        # Outlier ejection in this node's view: per peer's model "ejected" (ejected or half-open
        # here), per own model "ejected_backends" (docs/routing.md, "Outlier ejection").
        for node in doc.get("nodes", []):
            for m in node.get("models", []):
                m["ejected"] = self.ejections.peer_state(node["id"], m["name"]) != "ok"
        for m in (doc.get("self") or {}).get("models", []):
            runtime = self.runtimes.get(m.get("name"))
            m["ejected_backends"] = [b.id for b in runtime.backends if b.ejected] if runtime is not None else []
        return doc

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

    def _outliers_status(self) -> dict[str, Any]:
        """/v1/status "outliers": ``Ejections.status`` and ``retries`` (requests run again
        elsewhere after a failure before the first byte)."""
        return {**self.ejections.status(), "retries": self.pipeline.retries}

    async def handle_status(self, request: web.Request) -> web.Response:
        return web.json_response(self.status_doc())

    def status_doc(self) -> dict[str, Any]:
        """The /v1/status document."""
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
        return doc

    def _queued(self, model: Any) -> int:
        """Requests waiting for ``model`` in this node's origin queue."""
        return self.queues.queued(model) if isinstance(model, str) else 0

    async def handle_metrics(self, request: web.Request) -> web.Response:
        """GET /metrics: Prometheus text (OpenMetrics when ``Accept`` asks), docs/metrics.md."""
        body, content_type = exposition(self.registry, request.headers.get("Accept"))
        return web.Response(body=body, headers={"Content-Type": content_type})

def _kind_of(path: str) -> str | None:
    """The kind of model ``path`` needs (a classic endpoint), None for any other endpoint."""
    kind = _KIND_OF_PATH.get(path)
    return kind.value if kind is not None else None


#: Fields of a Responses request that use state kept on the engine (docs/routing.md, "Stored state").
_STORED_STATE_FIELDS = ("previous_response_id", "conversation")


def endpoint_param_error(path: str, payload: dict[str, Any]) -> tuple[str, str, str] | None:
    """``(param, code, message)`` for a body its endpoint refuses before routing, else None
    (docs/routing.md, "Endpoints"):

    - ``/v1/messages`` without ``max_tokens`` (null counts as absent): 400
      ``missing_required_parameter``. Anthropic's API requires it; llama-server would
      generate until its own limit, long past the agent's timeout. ``count_tokens`` needs none.
    - ``/v1/responses``: :func:`stored_state_error`.
    - ``/detokenize`` whose ``tokens`` is not a list of integers >= 0: 400 ``invalid_type`` or
      ``integer_below_min_value`` naming ``tokens`` (llama-server answers a negative id 500).
    """
    if path == "/v1/messages" and payload.get("max_tokens") is None:
        return ("max_tokens", ErrorCode.MISSING_REQUIRED_PARAMETER,
                "max_tokens: Field required (an integer >= 1: the most tokens to generate)")
    if path == "/detokenize":
        tokens = payload.get("tokens")
        if not isinstance(tokens, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in tokens):
            return ("tokens", ErrorCode.INVALID_TYPE, "'tokens' is required and must be a list of integers")
        if any(t < 0 for t in tokens):
            return ("tokens", ErrorCode.INTEGER_BELOW_MIN_VALUE,
                    f"Invalid 'tokens': token ids are >= 0, got {min(tokens)}")
    return stored_state_error(path, payload)


def stored_state_error(path: str, payload: dict[str, Any]) -> tuple[str, str, str] | None:
    """``(param, code, message)`` for a ``/v1/responses`` request that stores or reads a response
    kept on an engine (``store`` anything but false or null, ``previous_response_id`` or
    ``conversation`` not null), else None.

    Refused by default: a stored response lives on the one backend that made it, where any
    client routed there could read it back by id, and the next request of the conversation
    may be routed to another backend that does not have it (docs/routing.md, "Stored state").
    ``store`` is checked by identity, not truth: vLLM's pydantic reads ``"true"`` and ``1`` as
    true, so a ``store`` that is not a boolean is a 400 ``invalid_type``. A request without
    ``store`` is forwarded as is (llama-server keeps nothing; vLLM keeps responses only with
    ``VLLM_ENABLE_RESPONSES_API_STORE``)."""
    if path != "/v1/responses":
        return None
    store = payload.get("store")
    if store is True:
        return ("store", ErrorCode.STORED_RESPONSES,
                "'store': true is not supported: a stored response would live on one backend, readable by "
                "whoever is routed there, and a later request may run on another; send 'store': false and "
                "the conversation's input with each request")
    if store is not None and store is not False:
        return ("store", ErrorCode.INVALID_TYPE,
                "Invalid type for 'store': expected a boolean (and only false is supported here)")
    for name in _STORED_STATE_FIELDS:
        if payload.get(name) is not None:
            return (name, ErrorCode.STORED_RESPONSES,
                    f"{name!r} is not supported: it reads a response stored on one backend, and this request "
                    "may run on another; send the conversation's input with each request instead")
    return None


@web.middleware
async def _dialect(request: web.Request, handler: Any) -> web.StreamResponse:
    """An error answer on Anthropic's endpoints in Anthropic's shape (agent/serving/errors.py):
    every error is made in OpenAI's shape, whoever made it (the browser checks, the keys, the
    pipeline, an engine's error as ``engine_error`` renders it), and rewritten here once."""
    response: web.StreamResponse = await handler(request)
    if (response.status >= 400 and dialect_of(request.path) is Dialect.ANTHROPIC
            and isinstance(response, web.Response) and not response.prepared and isinstance(response.body, bytes)):
        body = as_anthropic(response.status, response.body)
        if body is not None:
            response.body = body
    return response


def _queue_place(request: web.Request) -> dict[str, Any]:
    """A :class:`Call`'s ``priority`` and ``tenant``: its verified key's (for a forward, as this
    node verified it again); none without keys (``normal``, one tenant: plain FIFO)."""
    claims = claims_of(request)
    return {} if claims is None else {"priority": claims.priority, "tenant": claims.tenant}


def _for_usage(call: Call, payload: dict[str, Any]) -> None:
    """Fill ``call``'s usage fields: its key's tenant and id (none with keys off: the key itself
    is never kept), and for a stream whose client did not ask for usage, a body that asks
    (agent/serving/tokens.py; the usage event is removed from the client's stream)."""
    claims = claims_of(call.request)
    if claims is not None:
        call.tenant, call.jti = claims.tenant, claims.jti
    if call.stream and call.request.path in ASSEMBLED_PATHS:
        body = ask_stream_usage(payload)
        if body is not None:
            call.body, call.strip_usage = body, True


def _queued_s(header: str | None) -> float | None:
    """A forward's ``X-Viiwork-Queued-Ms`` (the origin's wait) in seconds; None when absent or
    not a finite number from 0 to one day."""
    if not header:
        return None
    try:
        ms = float(header)
    except ValueError:
        return None
    return ms / 1000 if 0 <= ms <= 86_400_000 else None


#: The HTTP parser's limit on the client API's header lines and values (aiohttp's
#: ``max_field_size`` and ``max_line_size``; its own default is 8190 bytes). Above a client key's MAX_HEADER_BYTES
#: (8,256), so a key's header over that limit reaches our check and is the OpenAI-shaped 401
#: ``invalid_api_key`` (malformed), not aiohttp's text/plain 400; a value over this is still
#: aiohttp's 400 (docs/routing.md, "Status codes").
PARSER_MAX_FIELD_BYTES = 2 * MAX_HEADER_BYTES

#: The longest ``X-Request-Id`` taken from a client or a peer (docs/routing.md, "Response headers").
MAX_REQUEST_ID_CHARS = 128


def client_request_id(header: str | None) -> str | None:
    """``header`` (an ``X-Request-Id``) when it is 1..MAX_REQUEST_ID_CHARS visible ASCII
    characters (``!`` to ``~``: no space, control or non-ASCII character), else None and the
    request gets a fresh id. The id is stored in the usage ledger, sent to the engine and
    peers, logged and echoed in the answer's ``X-Request-Id``, so a client cannot make it
    kilobytes long nor hide a line break or an escape sequence in it."""
    if not header or len(header) > MAX_REQUEST_ID_CHARS:
        return None
    return header if all("!" <= c <= "~" for c in header) else None


def _render(outcome: web.StreamResponse | Refuse) -> web.StreamResponse:
    """The pipeline's outcome as the client's answer: a refusal as an OpenAI-shaped error
    (with ``X-Viiwork-Refused`` when it refuses a peer's forward)."""
    if not isinstance(outcome, Refuse):
        return outcome
    headers = {REFUSED_HEADER: outcome.reason} if isinstance(outcome, PeerRefusal) else None
    return error_response(outcome.status, outcome.message, param=outcome.param, code=outcome.code,
                          retry_after_s=outcome.retry_after_s, headers=headers)


def _failure(outcome: web.StreamResponse | Refuse, response: web.StreamResponse) -> str | None:
    """The observers' ``error``: a refusal's message, a failure's status, a stream broken
    after its first byte; None for an answer. Never the engine's own text (it can quote prompts)."""
    if isinstance(outcome, Refuse):
        return outcome.message
    if response.status >= 500:
        return f"backend {response.headers.get('X-Viiwork-Backend') or response.headers.get('X-Viiwork-Node', '?')} " \
               f"answered {response.status}"
    if response.get(BROKE):
        return "the stream broke after its first byte"
    return None


async def _freeze_heap(app: web.Application) -> None:
    """Move what start-up allocated (modules, config, pydantic models) out of the cyclic
    collector's view: a full collection of the agent's heap takes tens of milliseconds, a
    pause every request in flight would wait out (gc.freeze, CPython >= 3.7)."""
    gc.collect()
    gc.freeze()

