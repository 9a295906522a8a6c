"""The trace context of each inference request, carried to peers and engines, and its spans
(docs/metrics.md, "Tracing").

Every inference request, on the client API and on the mesh listener (a peer's forward), has a
:class:`RequestTrace` (``request[TRACE]``, set by :meth:`Tracing.traced` around the handler):
the client's W3C ``traceparent`` when it is valid (agent/serving/traceparent.py), else a new
trace (an invalid one is counted in /metrics, ``viiwork_trace_context_invalid_total``, and
logged once at WARNING, then at DEBUG). Each dispatch of the request (``Upstream.forward``,
agent/serving/proxy.py) sends its ``traceparent`` and ``tracestate`` on, to the engine or to
the peer, with the same trace id, and logs the request id with the trace id at DEBUG.

With a ``[tracing]`` section (``Tracing.start`` loads the OpenTelemetry SDK then, and only
then: agent/serving/otel.py) a sampled request records spans: the request (``SERVER``, child of
the caller's span), and in it ``admission`` (arrival to routing), ``queue wait`` (routing to
the first dispatch: the pipeline's ``X-Viiwork-Queued-Ms``; origin only) and one ``hop``
(to a peer) or ``engine`` span (``CLIENT``) per dispatch. The parent id sent on is the
dispatch's span when this node records the request, else the parent id it received (a node
that records nothing passes its caller's through, so the trace stays linked), or a new one;
the sampled flag sent is this node's own decision (never the client's).
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING

from aiohttp import web
from prometheus_client.core import CounterMetricFamily

from viiwork.agent.config.schema import TracingConfig
from viiwork.agent.serving.traceparent import (
    TRACEPARENT,
    TRACESTATE,
    IdSource,
    Invalid,
    TraceParent,
    parse_traceparent,
    parse_tracestate,
    traceparent_header,
)

if TYPE_CHECKING:
    from viiwork.agent.serving.otel import OtlpSpans, Span

log = logging.getLogger(__name__)

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]

#: The header of the pipeline's queue time on a dispatch (milliseconds from routing to dispatch).
QUEUED_HEADER = "X-Viiwork-Queued-Ms"
#: The longest wait for the last spans' export when the agent stops (s): the stop path's
#: budget (docs/architecture.md, "Stopping") has 5 s for everything after the engines.
STOP_EXPORT_S = 3.0


class TracingUnavailable(Exception):
    """``[tracing]`` is configured but the OpenTelemetry SDK cannot be imported; the message
    says what to install."""


class Tracing:
    """This node's trace context handling: the W3C headers always, spans with ``config``.

    ``config``: the ``[tracing]`` section (None: no spans, no SDK). ``node_name``: the spans'
    ``service.instance.id``. ``invalid``: (header, reason) -> count of headers not taken.
    """

    def __init__(self, config: TracingConfig | None = None, *, node_name: str = "",
                 ids: IdSource | None = None) -> None:
        self.config = config
        self.node_name = node_name
        self.ids = ids or IdSource()
        self.invalid: Counter[tuple[str, str]] = Counter()
        self._warned: set[str] = set()
        self.spans: OtlpSpans | None = None

    def start(self) -> None:
        """With ``[tracing]``: import the SDK and make the exporter (no connection is made yet).
        Raises TracingUnavailable when the SDK is not installed."""
        config = self.config
        if config is None or self.spans is not None:
            return
        try:
            from viiwork.agent.serving.otel import OtlpSpans
        except ImportError as exc:
            raise TracingUnavailable(
                f"[tracing] is set but the OpenTelemetry SDK is not installed ({exc.name or exc}): install "
                "viiwork's tracing extra (pip install 'viiwork[tracing]') or remove the [tracing] section") from exc
        self.spans = OtlpSpans(endpoint=traces_url(config.endpoint), sample_ratio=config.sample_ratio,
                               service_name=config.service_name, node_name=self.node_name,
                               timeout_s=config.timeout_s)
        log.info("tracing: spans of %g of the traces exported to %s", config.sample_ratio,
                 traces_url(config.endpoint))

    async def stop(self) -> None:
        """Export the spans left and stop the exporter, waiting at most STOP_EXPORT_S (the
        export goes on in a daemon thread, abandoned at exit, when the receiver is slow)."""
        spans, self.spans = self.spans, None
        if spans is None:
            return
        loop = asyncio.get_running_loop()
        done = loop.create_future()

        def finished() -> None:
            if not done.done():
                done.set_result(None)

        def shutdown() -> None:
            try:
                spans.shutdown()
            except Exception as exc:  # the exporter's own failure: logged, never raised at exit
                log.warning("tracing: the last spans were not exported: %s", exc)
            try:
                loop.call_soon_threadsafe(finished)
            except RuntimeError:  # the loop closed meanwhile
                pass

        threading.Thread(target=shutdown, name="otlp-shutdown", daemon=True).start()
        try:
            async with asyncio.timeout(STOP_EXPORT_S):
                await done
        except TimeoutError:
            log.warning("tracing: the last spans were not exported within %g s; leaving them", STOP_EXPORT_S)

    # -- per request -----------------------------------------------------------------------

    def traced(self, handler: Handler, *, forwarded: bool = False) -> Handler:
        """``handler`` with a :class:`RequestTrace` in ``request[TRACE]`` and its request span
        ended (with the answer's status) when it returns. ``forwarded``: the mesh listener's
        handler (a peer's forward, whose ``traceparent`` is the peer's hop)."""

        async def traced_handler(request: web.Request) -> web.StreamResponse:
            trace = request[TRACE] = self.begin(request, forwarded)
            response: web.StreamResponse | None = None
            try:
                response = await handler(request)
                return response
            finally:
                trace.finish(response)

        return traced_handler

    def begin(self, request: web.Request, forwarded: bool = False) -> RequestTrace:
        """The trace of ``request`` (module doc); its request span started when recording."""
        headers = request.headers
        parent = parse_traceparent(headers.getall(TRACEPARENT, ()))
        tracestate: str | None = None
        if isinstance(parent, Invalid):
            self._count(TRACEPARENT, parent.value, request)
            parent = None
        elif parent is not None:
            states = headers.getall(TRACESTATE, ())
            if states:
                tracestate = parse_tracestate(states)
                if tracestate is None:
                    self._count(TRACESTATE, "malformed", request)
        loop_now = asyncio.get_running_loop().time()
        wall_now = time.time_ns()
        spans = self.spans
        root: Span | None = None
        if spans is None:
            trace_id = parent.trace_id if parent is not None else self.ids.trace_id()
        else:
            attributes: dict[str, str | int | float | bool] = {
                "http.request.method": request.method, "url.path": request.path, "viiwork.node": self.node_name}
            if forwarded:
                attributes["viiwork.origin"] = headers.get("X-Viiwork-Origin", "")[:253]
            root = spans.start(f"{request.method} {request.path}", "server", parent, wall_now, attributes)
            trace_id = spans.ids(root)[0]
            if not root.is_recording():
                root = None
        return RequestTrace(self, trace_id, parent, tracestate, root, wall_now, loop_now)

    def _count(self, header: str, reason: str, request: web.Request) -> None:
        """An invalid ``header``, not taken: counted; logged at WARNING once per reason, then DEBUG."""
        self.invalid[(header, reason)] += 1
        key = f"{header}:{reason}"
        level = logging.DEBUG if key in self._warned else logging.WARNING
        self._warned.add(key)
        log.log(level, "%s from %s is invalid (%s) and is not used%s", header, request.remote, reason,
                "; a new trace is started" if header == TRACEPARENT else "",
                extra={"header": header, "reason": reason})

    def metric_families(self) -> list[CounterMetricFamily]:
        """/metrics: the trace context headers not taken, by header and reason (read now)."""
        family = CounterMetricFamily("viiwork_trace_context_invalid", "W3C trace context headers from clients or "
                                     "peers that were invalid and not used (traceparent: a new trace was started; "
                                     "tracestate: dropped), by header and reason.", labels=["header", "reason"])
        for reason in Invalid:
            family.add_metric([TRACEPARENT, reason.value], self.invalid[(TRACEPARENT, reason.value)])
        family.add_metric([TRACESTATE, "malformed"], self.invalid[(TRACESTATE, "malformed")])
        families = [family]
        spans = self.spans
        if spans is not None:
            exported = CounterMetricFamily("viiwork_tracing_spans_exported", "Spans handed to the OTLP/HTTP "
                                           "receiver ([tracing] endpoint), by result (failed: the receiver refused "
                                           "them or did not answer within tracing.timeout_s; they are dropped).",
                                           labels=["result"])
            for result in ("ok", "failed"):
                exported.add_metric([result], spans.exports.spans[result])
            families.append(exported)
        return families


class RequestTrace:
    """One request's trace: ``trace_id`` (32 hex digits, sent on unchanged), ``parent`` (the
    caller's valid traceparent, or None), ``tracestate`` (the caller's, bounded, or None),
    ``root`` (its request span while this node records it, else None)."""

    __slots__ = ("tracing", "trace_id", "parent", "tracestate", "root", "_wall0", "_loop0", "_dispatched",
                 "_own_id", "request_id")

    def __init__(self, tracing: Tracing, trace_id: str, parent: TraceParent | None, tracestate: str | None,
                 root: Span | None, wall0_ns: int, loop0: float) -> None:
        self.tracing = tracing
        self.trace_id = trace_id
        self.parent = parent
        self.tracestate = tracestate
        self.root = root
        self._wall0 = wall0_ns
        self._loop0 = loop0
        self._dispatched = False
        self._own_id: str | None = None
        self.request_id: str | None = None

    def _ns(self, loop_time: float) -> int:
        """A loop time (s) as the spans' clock: ns since the epoch."""
        return self._wall0 + int((loop_time - self._loop0) * 1e9)

    def dispatch(self, target: str, *, to_engine: bool, request_id: str, queued_ms: str | None) -> Dispatch:
        """The request goes to ``target`` (an engine's backend id, or a peer's name): its span
        started (recording), the headers it carries (``traceparent``, ``tracestate``), and the
        DEBUG line with its request id and trace id. ``queued_ms``: the pipeline's
        X-Viiwork-Queued-Ms on the origin (None on the node a peer forwarded it to)."""
        self.request_id = request_id
        where = "engine" if to_engine else "peer"
        if log.isEnabledFor(logging.DEBUG):  # (the extra dict is not built for nothing)
            log.debug("request %s: trace %s, to %s %s", request_id, self.trace_id, where, target,
                      extra={"request_id": request_id, "trace_id": self.trace_id})
        root = self.root
        spans = self.tracing.spans
        span: Span | None = None
        if root is not None and spans is not None:
            now = asyncio.get_running_loop().time()
            if not self._dispatched:
                self._record_wait(spans, root, now, queued_ms)
            attributes = {"viiwork.backend": target} if to_engine else {"viiwork.peer": target}
            span = spans.start(where if to_engine else "hop", "client", root, self._ns(now), attributes)
            parent_id = spans.ids(span)[1]
        elif self.parent is not None:
            parent_id = self.parent.parent_id
        else:
            if self._own_id is None:
                self._own_id = self.tracing.ids.span_id()
            parent_id = self._own_id
        self._dispatched = True
        headers = {TRACEPARENT: traceparent_header(self.trace_id, parent_id, span is not None)}
        if self.tracestate is not None:
            headers[TRACESTATE] = self.tracestate
        return Dispatch(self, span, headers)

    def _record_wait(self, spans: OtlpSpans, root: Span, now: float, queued_ms: str | None) -> None:
        """The ``admission`` and ``queue wait`` spans, at the first dispatch (``now``)."""
        queued_s = _seconds(queued_ms)
        routed = max(self._loop0, now - queued_s) if queued_s is not None else now
        spans.end(spans.start("admission", "internal", root, self._wall0, {}), self._ns(routed), None, {})
        if queued_s is not None:
            spans.end(spans.start("queue wait", "internal", root, self._ns(routed), {}), self._ns(now), None,
                      {"viiwork.queued_ms": queued_s * 1000})

    def finish(self, response: web.StreamResponse | None) -> None:
        """The handler returned ``response`` (None: it raised or was cancelled, the client gone):
        the request span ends."""
        root, self.root = self.root, None
        spans = self.tracing.spans
        if root is None or spans is None:
            return
        attributes: dict[str, str | int | float | bool] = {}
        error: str | None = None
        if response is None:
            error = "the request ended without an answer (the client went away, or the handler failed)"
        else:
            attributes["http.response.status_code"] = response.status
            if response.status >= 500:
                error = f"answered {response.status}"
        request_id = self.request_id or (response.headers.get("X-Request-Id") if response is not None else None)
        if request_id:
            attributes["viiwork.request_id"] = request_id
        spans.end(root, self._ns(asyncio.get_running_loop().time()), error, attributes)


class Dispatch:
    """One dispatch of a request: ``headers`` to send, ``span`` (None: not recorded)."""

    __slots__ = ("trace", "span", "headers")

    def __init__(self, trace: RequestTrace, span: Span | None, headers: dict[str, str]) -> None:
        self.trace = trace
        self.span = span
        self.headers = headers

    def end(self, status: int | None, error: str | None) -> None:
        """The dispatch ended: the target answered ``status`` (None: none), ``error`` says what
        failed (None: nothing)."""
        span, self.span = self.span, None
        spans = self.trace.tracing.spans
        if span is None or spans is None:
            return
        attributes: dict[str, str | int | float | bool] = {}
        if status is not None:
            attributes["http.response.status_code"] = status
        spans.end(span, self.trace._ns(asyncio.get_running_loop().time()), error, attributes)


#: The request's trace, set by ``Tracing.traced`` (read by the proxy on each dispatch).
TRACE = web.RequestKey("viiwork_trace", RequestTrace)


def traces_url(endpoint: str) -> str:
    """``endpoint`` as the OTLP/HTTP traces URL: ``/v1/traces`` appended when it has no path
    (``http://collector:4318``), else as written."""
    stripped = endpoint.rstrip("/")
    scheme_end = stripped.find("://") + 3
    return stripped + "/v1/traces" if "/" not in stripped[scheme_end:] else endpoint


def _seconds(ms: str | None) -> float | None:
    """The pipeline's X-Viiwork-Queued-Ms as seconds (None: absent or not a number from 0 up)."""
    if ms is None:
        return None
    try:
        value = float(ms) / 1000
    except ValueError:
        return None
    return value if value >= 0 else None
