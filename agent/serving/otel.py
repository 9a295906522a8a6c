"""OpenTelemetry spans exported over OTLP/HTTP: the official SDK behind the few calls of
agent/serving/tracing.py.

Imported only when the config has a ``[tracing]`` section (``Tracing.start``), so an agent
without one never loads the SDK. The provider is this agent's own (never the process-global
one), with a ``TraceIdRatioBased`` sampler: the decision is the trace id's alone, the same on
every node with the same ratio, and a client's sampled flag never forces it (a
``ParentBased`` sampler would let any client turn recording on). Spans are batched and
exported by the SDK's worker thread (``BatchSpanProcessor``; its ``OTEL_BSP_*`` environment
variables apply), never on the event loop.

The SDK's exports are counted (``exports``: spans by ``ok`` / ``failed``, for /metrics) and
its own log lines (a retry every few seconds while a collector is down, "Queue full" per span)
pass once per message at their level, then go to this module's DEBUG: a collector that is
down for an hour writes a few lines, not thousands (the agent's rule for faults that repeat).
"""

from __future__ import annotations

import logging
import threading
from collections import Counter
from collections.abc import Mapping, Sequence

from opentelemetry import trace as api
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter, SpanExportResult
from opentelemetry.sdk.trace.sampling import TraceIdRatioBased

from viiwork import __version__
from viiwork.agent.serving.traceparent import TraceParent

log = logging.getLogger(__name__)

Span = api.Span
Attributes = Mapping[str, str | int | float | bool]

#: The span kinds tracing.py asks for, by name.
KINDS = {"server": api.SpanKind.SERVER, "client": api.SpanKind.CLIENT, "internal": api.SpanKind.INTERNAL}


class OtlpSpans:
    """Spans of one agent, exported to ``endpoint`` (an OTLP/HTTP traces URL) with
    ``service.name`` = ``service_name`` and ``service.instance.id`` = ``node_name``;
    ``sample_ratio`` (0..1) of the trace ids are recorded; ``timeout_s`` bounds one export."""

    def __init__(self, *, endpoint: str, sample_ratio: float, service_name: str, node_name: str,
                 timeout_s: float) -> None:
        resource = Resource.create({"service.name": service_name, "service.instance.id": node_name,
                                    "service.version": __version__})
        # shutdown_on_exit=False: the agent flushes on its stop path (Tracing.stop), bounded; the
        # SDK's atexit hook would wait for a slow receiver at interpreter exit.
        self.provider = TracerProvider(resource=resource, sampler=TraceIdRatioBased(sample_ratio),
                                       shutdown_on_exit=False)
        self.exports = _CountingExporter(OTLPSpanExporter(endpoint=endpoint, timeout=timeout_s), endpoint)
        self.provider.add_span_processor(BatchSpanProcessor(self.exports))
        self.tracer = self.provider.get_tracer("viiwork", __version__)
        _quiet_sdk_logs()

    def start(self, name: str, kind: str, parent: TraceParent | Span | None, start_ns: int,
              attributes: Attributes) -> Span:
        """A span started at ``start_ns`` (ns since the epoch), child of ``parent``: a remote
        caller's ``TraceParent``, one of this node's spans, or None (a new trace, its id the
        SDK's). Not recording (``is_recording()`` False) when the sampler drops its trace."""
        if parent is None:
            context = None
        elif isinstance(parent, TraceParent):
            remote = api.SpanContext(trace_id=int(parent.trace_id, 16), span_id=int(parent.parent_id, 16),
                                     is_remote=True, trace_flags=api.TraceFlags(int(parent.sampled)))
            context = api.set_span_in_context(api.NonRecordingSpan(remote))
        else:
            context = api.set_span_in_context(parent)
        return self.tracer.start_span(name, context=context, kind=KINDS[kind], attributes=attributes,
                                      start_time=start_ns, record_exception=False, set_status_on_exception=False)

    @staticmethod
    def end(span: Span, end_ns: int, error: str | None, attributes: Attributes) -> None:
        """End ``span`` at ``end_ns`` with ``attributes``, its status ERROR with ``error`` when set."""
        if attributes:
            span.set_attributes(attributes)
        if error is not None:
            span.set_status(api.Status(api.StatusCode.ERROR, error))
        span.end(end_time=end_ns)

    @staticmethod
    def ids(span: Span) -> tuple[str, str]:
        """``span``'s trace id (32 hex digits) and span id (16)."""
        context = span.get_span_context()
        return f"{context.trace_id:032x}", f"{context.span_id:016x}"

    def shutdown(self) -> None:
        """Export what is left, then stop the exporter (blocking: up to one export's timeout)."""
        self.provider.shutdown()


class _CountingExporter(SpanExporter):
    """``inner`` with its results counted: ``spans[result]`` (``ok``, ``failed``), read by the
    event loop while the SDK's thread adds (plain integer updates under the GIL). The first
    failure after a success (or at start) is logged at WARNING, the next ones at DEBUG."""

    def __init__(self, inner: SpanExporter, endpoint: str) -> None:
        self.inner = inner
        self.endpoint = endpoint
        self.spans: Counter[str] = Counter()
        self._failing = False

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        result = self.inner.export(spans)
        ok = result is SpanExportResult.SUCCESS
        self.spans["ok" if ok else "failed"] += len(spans)
        if not ok:
            log.log(logging.DEBUG if self._failing else logging.WARNING,
                    "tracing: %d spans not exported to %s (the receiver refused or did not answer); "
                    "further failures are logged at DEBUG until an export succeeds", len(spans), self.endpoint)
        self._failing = not ok
        return result

    def shutdown(self) -> None:
        self.inner.shutdown()

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return self.inner.force_flush(timeout_millis)


class _OncePerMessage(logging.Filter):
    """Lets each message template of the SDK's loggers through once; later records of it go to
    this module's logger at DEBUG instead."""

    def __init__(self) -> None:
        super().__init__()
        self._seen: set[str] = set()
        self._lock = threading.Lock()

    def filter(self, record: logging.LogRecord) -> bool:
        key = f"{record.name}:{record.msg}"
        with self._lock:  # (the SDK's thread and the loop both log)
            first = key not in self._seen and len(self._seen) < 256  # templates are the SDK's: few
            if first:
                self._seen.add(key)
        if not first and log.isEnabledFor(logging.DEBUG):
            log.debug("%s: %s", record.name, record.getMessage())
        return first


_SDK_LOGGERS = ("opentelemetry.exporter.otlp.proto.http.trace_exporter", "opentelemetry.exporter.otlp.common.http",
                "opentelemetry.sdk._shared_internal", "opentelemetry.sdk.trace.export")


def _quiet_sdk_logs() -> None:
    """The SDK's loggers that repeat per batch or per span, each message once (``_OncePerMessage``)."""
    for name in _SDK_LOGGERS:
        logger = logging.getLogger(name)
        if not any(isinstance(f, _OncePerMessage) for f in logger.filters):
            logger.addFilter(_OncePerMessage())
