"""A tiny OTLP/HTTP traces receiver on loopback, for tests of agents run with ``[tracing]``.

It stands for an OpenTelemetry collector (a remote party): ``POST /v1/traces`` with an
``ExportTraceServiceRequest`` protobuf (gzip or not), decoded with opentelemetry-proto's
classes, answered with an empty ``ExportTraceServiceResponse``. It runs in a thread with its
own event loop, so agents (separate processes) can export to it while a test blocks.
"""

from __future__ import annotations

import asyncio
import gzip
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

from aiohttp import web
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)


@dataclass(frozen=True)
class ReceivedSpan:
    """One exported span: its resource's ``service.name`` and ``service.instance.id`` (the
    agent's node name), ``name``, ``kind`` (OTLP's: 1 internal, 2 server, 3 client), ids in
    hex (``parent_id`` "" for a root), ``attributes`` (as strings), ``error`` (status ERROR)."""

    service: str
    node: str
    name: str
    kind: int
    trace_id: str
    span_id: str
    parent_id: str
    attributes: dict[str, str] = field(default_factory=dict)
    error: bool = False


def _value(any_value: object) -> str:
    kind = any_value.WhichOneof("value")  # type: ignore[attr-defined]
    return str(getattr(any_value, kind)) if kind else ""


class OtlpReceiver:
    """``url`` (the traces URL), ``spans`` (all received so far), ``posts`` (requests taken)."""

    def __init__(self) -> None:
        self.spans: list[ReceivedSpan] = []
        self.posts = 0
        self.url = ""
        self._lock = threading.Lock()

    async def _traces(self, request: web.Request) -> web.Response:
        body = await request.read()
        if request.headers.get("Content-Encoding") == "gzip":
            body = gzip.decompress(body)
        export = ExportTraceServiceRequest.FromString(body)
        received = []
        for resource_spans in export.resource_spans:
            resource = {a.key: _value(a.value) for a in resource_spans.resource.attributes}
            for scope_spans in resource_spans.scope_spans:
                for span in scope_spans.spans:
                    received.append(ReceivedSpan(
                        service=resource.get("service.name", ""), node=resource.get("service.instance.id", ""),
                        name=span.name, kind=span.kind, trace_id=span.trace_id.hex(), span_id=span.span_id.hex(),
                        parent_id=span.parent_span_id.hex(),
                        attributes={a.key: _value(a.value) for a in span.attributes},
                        error=span.status.code == 2))
        with self._lock:
            self.posts += 1
            self.spans.extend(received)
        return web.Response(body=ExportTraceServiceResponse().SerializeToString(),
                            content_type="application/x-protobuf")

    def of_trace(self, trace_id: str) -> list[ReceivedSpan]:
        with self._lock:
            return [s for s in self.spans if s.trace_id == trace_id]

    def wait_for(self, predicate: Callable[[list[ReceivedSpan]], bool], timeout_s: float = 20,
                 what: str = "spans") -> list[ReceivedSpan]:
        """The spans received, once ``predicate`` holds for them (AssertionError after ``timeout_s``)."""
        deadline = time.monotonic() + timeout_s
        while True:
            with self._lock:
                spans = list(self.spans)
            if predicate(spans):
                return spans
            if time.monotonic() > deadline:
                raise AssertionError(f"timed out after {timeout_s} s waiting for {what}; received: {spans}")
            time.sleep(0.05)

    @classmethod
    @contextmanager
    def running(cls) -> Iterator[OtlpReceiver]:
        """A receiver listening on 127.0.0.1 (a free port) until the block ends."""
        receiver = cls()
        loop = asyncio.new_event_loop()
        ready = threading.Event()
        app = web.Application()
        app.router.add_post("/v1/traces", receiver._traces)
        runner = web.AppRunner(app, access_log=None)

        def serve() -> None:
            asyncio.set_event_loop(loop)
            loop.run_until_complete(runner.setup())
            site = web.TCPSite(runner, "127.0.0.1", 0)
            loop.run_until_complete(site.start())
            receiver.url = f"http://127.0.0.1:{runner.addresses[0][1]}/v1/traces"
            ready.set()
            loop.run_forever()
            loop.run_until_complete(runner.cleanup())
            loop.close()

        thread = threading.Thread(target=serve, name="otlp-receiver", daemon=True)
        thread.start()
        if not ready.wait(10):
            raise AssertionError("the OTLP receiver did not start within 10 s")
        try:
            yield receiver
        finally:
            loop.call_soon_threadsafe(loop.stop)
            thread.join(10)
