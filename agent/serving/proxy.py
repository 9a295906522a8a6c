"""Forward one admitted request to a backend and relay the answer (docs/routing.md; docs/architecture.md, rules 4-6 and 11).

One module (over 400 lines) because the rules below act on one forward: the same upstream
request, connection and client response, from the retry of a stale connection to the
stream's last event. Assembling a stream into one answer is in agent/serving/assemble.py,
the error shapes are in agent/serving/errors.py.

- Streams are relayed chunk by chunk as they arrive (each write flushed; no buffering).
- A pooled connection found dead before any byte reached the client is retried once on a
  fresh connection: llama-server closes the TCP connection after each streamed response
  while still answering ``Connection: keep-alive``, so the next request on that pooled
  socket fails (seen: a bare aiohttp proxy answered 500s, nginx 502s).
- After the first byte there is no retry: an engine that dies or stays silent longer than
  ``stream_idle_timeout_s`` ends the client's stream with a terminal SSE error event (the
  response is marked ``BROKE``: a failure for outlier ejection, agent/serving/ejections.py).
  So does an error event the engine (or a peer) sent in its stream, relayed as is, unless the
  engine adapter classifies it as the client's fault (``engine_failed``, agent/serving/errors.py;
  a peer's with the adapter of the engine it publishes for the model).
- A failure before anything reached the client (an engine 5xx that is not the client's
  fault, a refused or reset connection, silence, a peer's 5xx answer) comes back as
  ``Failed``, carrying the error answer already rendered: the pipeline retries the request
  on another backend or gives the client that answer (docs/routing.md, "Outlier ejection").
- A forward to a peer can be given a ``lost`` event (``MeshLink.watch_peer``: the peer turned
  silent, whatever state it publishes). Before the first byte it abandons the forward (``Refused``: the caller
  routes again); after it, it ends the client's stream with a terminal SSE error event. The
  read is raced against the event (no polling): before the answer's headers by waiting on
  both, after them by failing the pending read (docs/routing.md, "Forwarding and retries
  before the first byte").
- Silence is timed by the client session's ``sock_read`` timer (restarted by every read from
  the engine, paused while the client holds reading back), not by an ``asyncio.timeout`` per
  request and per chunk: same rule, a fraction of the cost on the hot path.
- A client that disconnects cancels the handler (aiohttp ``handler_cancellation``); leaving
  the upstream request's context closes its connection, and the engine frees the slot.
- A client that stays connected but stops reading (or a frozen origin, on a peer) is treated
  as gone once one write of the stream waits longer than ``client_stall_timeout_s``: the
  upstream is closed (the engine frees the slot) and the client's connection aborted. The
  timer is armed only for a write that may wait (the transport is paused, or its buffer would
  pass the low-water mark), so the hot path pays no per-chunk ``asyncio.timeout``
  (docs/routing.md, "Forwarding and retries before the first byte").
- A non-streamed request to a local engine whose adapter says a closed connection does not
  stop a non-streamed generation (``nonstream_stops_on_disconnect`` False) is sent as a stream
  and its answer assembled into the non-streamed form (agent/serving/assemble.py; the only body change
  the agent makes: ``stream`` and ``stream_options``, docs/engines.md "When the client goes away").
- The engine gets only ``Content-Type``, ``Accept``, ``X-Request-Id``, its own key and the
  request's W3C trace context (``traceparent``, ``tracestate``: agent/serving/tracing.py, as
  checked and rebuilt by this node, never the client's header as sent); a peer gets the same
  trace context, and the forward's own headers (agent/peering/mesh_link.py).
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal, Protocol

import aiohttp
from aiohttp import web

from viiwork.agent.serving.accounting import CLIENT_GONE, RequestEnd
from viiwork.agent.serving.assemble import (
    ASSEMBLED_PATHS,
    ErrorEventWatch,
    StreamBroken,
    StreamError,
    assemble,
    parse_events,
    sse_data,
    stream_body,
    stream_lines,
)
from viiwork.agent.serving.errors import (
    Dialect,
    ErrorCode,
    dialect_of,
    engine_error,
    engine_failed,
    engine_message,
    error_response,
    sse_error_event,
)
from viiwork.agent.serving.tokens import RELAYED_STREAM, USAGE, StreamTail, usage_in_body, usage_of
from viiwork.agent.serving.tracing import QUEUED_HEADER, TRACE
from viiwork.agent.supervision.backends import Backend
from viiwork.agent.supervision.engine_keys import auth_headers
from viiwork.engines.contract import Engine, stops_nonstream_on_disconnect

log = logging.getLogger(__name__)

# Failures of a reused keep-alive connection that the server already closed.
_STALE_CONNECTION = (aiohttp.ServerDisconnectedError, aiohttp.ClientOSError)
_UPSTREAM_BROKEN = (aiohttp.ClientPayloadError, aiohttp.ClientConnectionError)


class _ClientGone(Exception):
    """The client closed its connection; nothing more can be written to it."""


class _ClientStalled(_ClientGone):
    """One write to the client waited longer than ``client_stall_timeout_s``."""


class PeerLost(Exception):
    """The peer a forward waits on turned suspect or dead in this node's mesh view."""

_PASS_REQUEST_HEADERS = ("Content-Type", "Accept")

# The code of a terminal SSE error event by its status (docs/routing.md, "Status codes").
_STREAM_ERROR_CODES = {502: ErrorCode.UPSTREAM_ERROR, 503: ErrorCode.DRAINING, 504: ErrorCode.UPSTREAM_TIMEOUT}

# Set by a peer that declines a forwarded request before doing any work (no free slot, model
# not served, draining): the origin may try another peer before the first byte.
REFUSED_HEADER = "X-Viiwork-Refused"


class Target(Protocol):
    """Where ``Upstream.forward`` sends a request: a local ``Backend``, or a peer's mesh
    listener (``viiwork.agent.peering.mesh_link.PeerTarget``). ``id`` names it in messages."""

    @property
    def id(self) -> str: ...

    @property
    def base_url(self) -> str: ...


@dataclass(frozen=True, slots=True)
class Refused:
    """A peer declined a forward before the first byte: HTTP ``status`` and its ``reason``."""

    status: int
    reason: str


@dataclass(frozen=True, slots=True)
class Failed:
    """The target failed before the first byte reached the client: ``response`` (status >=
    500, not yet sent) is the error to give the client when no other backend takes the
    request; ``reason`` says what failed, for logs ("HTTP 503", "unreachable", ...)."""

    response: web.Response
    reason: str


#: Set (True) on a streamed response whose upstream failed after the first byte (an SSE
#: error event ended it): the request counts as a failure of its target.
BROKE = web.ResponseKey("viiwork_upstream_broke", bool)
#: The loop time (s) the first chunk of a streamed response was written to the client: its
#: time to first token, for the request observers (agent/serving/observe.py).
FIRST_CHUNK_AT = web.ResponseKey("viiwork_first_chunk_at", float)


class Upstream:
    """The agent's HTTP client towards its engines: one shared session, pooled connections.

    stream_idle_timeout_s: longest silence tolerated from an engine once it has answered
    (per chunk while streaming, and for the whole body otherwise).
    client_stall_timeout_s: longest wait on one write of a stream to a client that does not
    read (``api.client_stall_timeout_s``); then the client is treated as gone.
    """

    def __init__(self, stream_idle_timeout_s: float, connect_timeout_s: float = 5.0,
                 client_stall_timeout_s: float = 10.0) -> None:
        self.stream_idle_timeout_s = stream_idle_timeout_s
        self.client_stall_timeout_s = client_stall_timeout_s
        self.client_stalls = 0
        self.connect_timeout_s = connect_timeout_s
        self._session: aiohttp.ClientSession | None = None
        # One session (a UnixConnector) per socket backend, by socket path, made on first use.
        self._unix_sessions: dict[str, aiohttp.ClientSession] = {}
        self.stale_retries = 0
        self.stream_errors = 0
        # The engine adapter of a local backend (None: unknown), for its optional
        # ``client_fault`` classifier; set by the ClientApi that owns the runtimes.
        self.engine_of: Callable[[Backend], Engine | None] = lambda backend: None

    async def __aenter__(self) -> Upstream:
        self._session = self._new_session(
            aiohttp.TCPConnector(limit=0, keepalive_timeout=30, enable_cleanup_closed=False))
        return self

    def _new_session(self, connector: aiohttp.BaseConnector) -> aiohttp.ClientSession:
        return aiohttp.ClientSession(
            connector=connector,
            auto_decompress=False,
            skip_auto_headers=("User-Agent", "Accept-Encoding"),
            # sock_read: the longest silence from the engine, from the request sent to the
            # headers and between any two reads of the body; raises ServerTimeoutError, a
            # TimeoutError. ceil_threshold: never round it up to whole seconds.
            timeout=aiohttp.ClientTimeout(total=None, sock_connect=self.connect_timeout_s,
                                          sock_read=self.stream_idle_timeout_s, ceil_threshold=float("inf")),
        )

    def _unix_session(self, path: str) -> aiohttp.ClientSession:
        session = self._unix_sessions.get(path)
        if session is None or session.closed:
            session = self._unix_sessions[path] = self._new_session(
                aiohttp.UnixConnector(path=path, limit=0, keepalive_timeout=30))
        return session

    async def __aexit__(self, *exc: object) -> None:
        if self._session is not None:
            await self._session.close()
        for session in self._unix_sessions.values():
            await session.close()
        self._unix_sessions.clear()

    async def _open(self, url: str, body: bytes, headers: dict[str, str],
                    session: aiohttp.ClientSession | None = None) -> aiohttp.ClientResponse:
        session = session or self._session
        assert session is not None, "use Upstream as an async context manager"
        for attempt in (0, 1):
            try:
                return await session.post(url, data=body, headers=headers)
            except _STALE_CONNECTION as exc:
                if attempt == 1 or isinstance(exc, aiohttp.ClientConnectorError):
                    raise
                self.stale_retries += 1
                log.debug("retrying %s once on a fresh connection after %r", url, exc)
        raise AssertionError("unreachable")

    async def forward(
        self,
        request: web.Request,
        backend: Target,
        body: bytes,
        stream: bool,
        headers: dict[str, str],
        request_id: str,
        *,
        session: aiohttp.ClientSession | None = None,
        extra_headers: dict[str, str] | None = None,
        relay_headers: tuple[str, ...] = (),
        refusable: bool = False,
        lost: asyncio.Event | None = None,
        engine: Engine | None = None,
        strip_usage: bool = False,
        end: RequestEnd | None = None,
    ) -> web.StreamResponse | Refused | Failed:
        """``_forward`` (below) with the request's trace context (``request[TRACE]``,
        agent/serving/tracing.py): its ``traceparent`` and ``tracestate`` go upstream, to the
        engine or the peer, and the dispatch is a span ("engine" or "hop") when recorded. A
        request without one (made outside the client API and the mesh listener) carries none."""
        trace = request.get(TRACE)
        dispatch = None if trace is None else trace.dispatch(
            backend.id, to_engine=isinstance(backend, Backend), request_id=request_id,
            queued_ms=headers.get(QUEUED_HEADER))
        if dispatch is not None:
            extra_headers = {**extra_headers, **dispatch.headers} if extra_headers else dispatch.headers
        result: web.StreamResponse | Refused | Failed | None = None
        try:
            result = await self._forward(request, backend, body, stream, headers, request_id, session=session,
                                         extra_headers=extra_headers, relay_headers=relay_headers,
                                         refusable=refusable, lost=lost, engine=engine, strip_usage=strip_usage,
                                         end=end)
            return result
        finally:
            if dispatch is not None:
                dispatch.end(*_outcome(result))

    async def _forward(
        self,
        request: web.Request,
        backend: Target,
        body: bytes,
        stream: bool,
        headers: dict[str, str],
        request_id: str,
        *,
        session: aiohttp.ClientSession | None,
        extra_headers: dict[str, str] | None,
        relay_headers: tuple[str, ...],
        refusable: bool,
        lost: asyncio.Event | None,
        engine: Engine | None,
        strip_usage: bool,
        end: RequestEnd | None,
    ) -> web.StreamResponse | Refused | Failed:
        """Send ``body`` to ``backend`` at the request's path; relay status, headers, body.

        ``backend`` is a ``Target``: a local Backend, or a peer's mesh listener reached with
        ``session``, whose TLS context authenticates both sides.
        ``extra_headers`` go upstream; ``relay_headers`` are copied from the upstream answer
        to the client's. With ``refusable``, an answer carrying ``X-Viiwork-Refused`` (a peer
        that has no free slot) returns ``Refused`` before anything reaches the client, so the
        caller can try elsewhere. ``lost`` (with ``refusable``): an event set when the peer
        turns suspect or dead; before the first byte the forward is abandoned as
        ``Refused(504, "suspect")``, after it the stream ends with an SSE error event (504).
        ``engine``: the adapter of the engine behind a peer ``backend`` (None: unknown), which
        tells whether an error event in its stream is the client's fault (a local Backend's
        is ``engine_of(backend)``).
        ``strip_usage``: the client did not ask for a stream's usage (the agent did, for it:
        agent/serving/tokens.py); the usage event is removed from what it gets. ``end``: this
        node's backend runs the request: its usage row is recorded (awaited) before the end
        is reported, a stream's ``[DONE]`` held back until then (agent/serving/accounting.py).
        The engine's usage, when read, is set on the response (``USAGE``).
        Returns the response to give the client (already prepared and finished when
        streamed; ``BROKE`` set when its stream broke), or ``Failed`` before the first byte:
        the 502/504 JSON error of an engine or peer that failed, could not be reached or
        stayed silent (a peer's 5xx answer relayed as is).
        """
        upstream_headers = {"X-Request-Id": request_id}
        request_headers = request.headers
        for name in _PASS_REQUEST_HEADERS:
            value = request_headers.get(name)
            if value is not None:
                upstream_headers[name] = value
        if extra_headers:
            upstream_headers.update(extra_headers)
        if isinstance(backend, Backend):
            # Only this node's engine gets its key (agent/supervision/engine_keys.py); a peer never does.
            upstream_headers.update(auth_headers(backend.api_key))
            if backend.socket_path and session is None:
                session = self._unix_session(backend.socket_path)
        url = backend.base_url + request.path
        # This node's engine does not stop a non-streamed generation when the client leaves:
        # ask it for a stream (it stops that) and assemble the answer the client asked for.
        assembled_as: str | None = None
        if (not stream and isinstance(backend, Backend) and request.path in ASSEMBLED_PATHS
                and not stops_nonstream_on_disconnect(self.engine_of(backend))):
            assembled_as = ASSEMBLED_PATHS[request.path]
            body = stream_body(body)
        watch: asyncio.Task[Literal[True]] | None = None
        try:
            if lost is None:
                upstream = await self._open(url, body, upstream_headers, session)
            else:
                watch = asyncio.ensure_future(lost.wait())
                upstream = await self._open_unless_lost(watch, url, body, upstream_headers, session)
        except PeerLost:
            log.warning("request %s: peer %s turned suspect before answering; routing again", request_id,
                        backend.id)
            return Refused(504, "suspect")
        except TimeoutError:  # sock_read (aiohttp.ServerTimeoutError) or sock_connect
            if refusable:
                return Refused(504, "timeout")
            return Failed(error_response(504, f"backend {backend.id} did not answer within "
                                         f"{self.stream_idle_timeout_s:g} s (api.stream_idle_timeout_s)",
                                         code=ErrorCode.UPSTREAM_TIMEOUT, headers=headers), "timeout")
        except aiohttp.ClientError as exc:
            if refusable:
                return Refused(502, f"unreachable: {exc.__class__.__name__}")
            return Failed(error_response(502, f"backend {backend.id} unreachable: {exc.__class__.__name__}",
                                         code=ErrorCode.UPSTREAM_UNREACHABLE, headers=headers),
                          f"unreachable: {exc.__class__.__name__}")
        if watch is not None:
            if watch.done():
                upstream.content.set_exception(PeerLost())
            else:  # a read pending when the peer turns suspect fails with PeerLost
                def on_lost(w: asyncio.Task[Literal[True]], content: aiohttp.StreamReader = upstream.content,
                            ) -> None:
                    if not w.cancelled():
                        content.set_exception(PeerLost())

                watch.add_done_callback(on_lost)
        try:
            if refusable and REFUSED_HEADER in upstream.headers:
                return Refused(upstream.status, upstream.headers[REFUSED_HEADER])
            for name in relay_headers:
                value = upstream.headers.get(name)
                if value is not None:
                    headers[name] = value
            content_type = upstream.headers.get("Content-Type", "application/json")
            if assembled_as is not None and upstream.status == 200 and content_type.startswith("text/event-stream"):
                assembled = await self._relay_assembled(upstream, backend, headers, assembled_as)
                return _failed(await _recorded(assembled, end), upstream)
            if not stream or upstream.status != 200 or not content_type.startswith("text/event-stream"):
                try:
                    whole = await self._relay_whole(upstream, backend, headers, content_type)
                except PeerLost:  # nothing reached the client yet: route again
                    upstream.close()
                    return Refused(504, "suspect")
                return _failed(await _recorded(whole, end), upstream)
            adapter = self.engine_of(backend) if isinstance(backend, Backend) else engine
            tail = StreamTail(strip=strip_usage, hold=end is not None)
            request[RELAYED_STREAM] = tail
            return await self._relay_stream(request, upstream, backend, headers, adapter, tail, end)
        finally:
            if watch is not None:
                watch.cancel()
            upstream.release()

    async def _open_unless_lost(self, watch: asyncio.Task[Literal[True]], url: str, body: bytes,
                                headers: dict[str, str],
                                session: aiohttp.ClientSession | None) -> aiohttp.ClientResponse:
        """``_open`` raced against ``watch`` (the peer turned suspect): the answer's headers,
        or PeerLost (the request is abandoned and its connection closed)."""
        opening = asyncio.ensure_future(self._open(url, body, headers, session))
        try:
            await asyncio.wait((opening, watch), return_when=asyncio.FIRST_COMPLETED)
        except BaseException:  # this handler was cancelled (the client went away)
            opening.cancel()
            watch.cancel()
            raise
        if not opening.done():  # lost: closing the request closes its connection
            opening.cancel()
            raise PeerLost
        exc = opening.exception()
        if exc is not None:
            watch.cancel()
            raise exc
        return opening.result()

    async def _read_whole(self, upstream: aiohttp.ClientResponse, backend: Target,
                          headers: dict[str, str]) -> bytes | web.Response:
        """The whole upstream body, or the 504 (silent for ``stream_idle_timeout_s``) or 502
        (broken off) error answer to give the client instead."""
        try:
            return await upstream.read()
        except TimeoutError:  # sock_read: silent for stream_idle_timeout_s
            return error_response(504, f"backend {backend.id} went silent for {self.stream_idle_timeout_s:g} s "
                                  "(api.stream_idle_timeout_s)", code=ErrorCode.UPSTREAM_TIMEOUT, headers=headers)
        except _UPSTREAM_BROKEN as exc:
            return error_response(502, f"backend {backend.id} broke off its answer: {exc.__class__.__name__}",
                                  code=ErrorCode.UPSTREAM_ERROR, headers=headers)

    async def _relay_whole(self, upstream: aiohttp.ClientResponse, backend: Target,
                           headers: dict[str, str], content_type: str) -> web.Response:
        data = await self._read_whole(upstream, backend, headers)
        if isinstance(data, web.Response):
            return data
        if upstream.status >= 400 and isinstance(backend, Backend):
            # This node's engine refused or failed: one error shape and status rule for every
            # engine (agent/serving/errors.py). A peer's answer was normalised there: relayed as is.
            return engine_error(upstream.status, data, backend.id, self.engine_of(backend), headers=headers)
        headers["Content-Type"] = content_type.split(";", 1)[0]
        return web.Response(status=upstream.status, body=data, headers=headers)

    async def _relay_assembled(self, upstream: aiohttp.ClientResponse, backend: Target,
                               headers: dict[str, str], obj: str) -> web.Response:
        """The engine's whole stream read (same silence and break rules as ``_relay_whole``)
        and answered as one JSON object ``obj`` (agent/serving/assemble.py); an error event in the
        stream is answered as the engine's error (``engine_error``), a stream that cannot be
        assembled (not JSON, no ``[DONE]``) as 502."""
        data = await self._read_whole(upstream, backend, headers)
        if isinstance(data, web.Response):
            return data
        try:
            answer = assemble(parse_events(sse_data(stream_lines(data))), obj)
        except StreamError as exc:
            adapter = self.engine_of(backend) if isinstance(backend, Backend) else None  # always local here
            return engine_error(exc.status, exc.body, backend.id, adapter, headers=headers)
        except StreamBroken as exc:
            return error_response(502, f"backend {backend.id} sent a stream that cannot be assembled: {exc}",
                                  code=ErrorCode.UPSTREAM_ERROR, headers=headers)
        headers["Content-Type"] = "application/json"
        response = web.Response(status=200, body=json.dumps(answer, ensure_ascii=False,
                                                            separators=(",", ":")).encode(), headers=headers)
        usage = usage_of(answer)
        if usage is not None:
            response[USAGE] = usage
        return response

    async def _relay_stream(self, request: web.Request, upstream: aiohttp.ClientResponse, backend: Target,
                            headers: dict[str, str], adapter: Engine | None, tail: StreamTail,
                            end: RequestEnd | None) -> web.StreamResponse:
        """Relay the engine's stream (module doc); ``tail`` reads its usage, removes it for a
        client that did not ask, and holds back ``[DONE]`` until ``end`` (when given) has
        recorded the request: the row is committed before the client sees the end, a
        terminal error event included; a client that went away is recorded without waiting."""
        response = web.StreamResponse(status=200, headers=headers)
        response.content_type = "text/event-stream"
        response.headers["Cache-Control"] = "no-cache"
        response.headers["X-Accel-Buffering"] = "no"
        await response.prepare(request)
        idle = self.stream_idle_timeout_s
        stall = self.client_stall_timeout_s
        read = upstream.content.readany
        write = response.write
        transport = request.transport
        if transport is None:  # the client left while the engine was answering
            upstream.close()
            if end is not None:
                end.soon(CLIENT_GONE, None, None)
            return response
        # A write can wait (aiohttp drains) only while the transport is paused, which it stays
        # only above its low-water mark, or when this chunk takes the buffer over the mark.
        buffered = transport.get_write_buffer_size
        low_water = transport.get_write_buffer_limits()[0]
        protocol = request.protocol
        # The engine's own error event, relayed as is: a failure unless the client's fault.
        watch = ErrorEventWatch()
        dialect = dialect_of(request.path)  # of the agent's own error event
        find_error = watch.feed
        relayed = tail.feed
        first = True
        try:
            while True:
                chunk = await read()  # TimeoutError after `idle` s of silence (sock_read)
                if not chunk:
                    break
                find_error(chunk)
                chunk = relayed(chunk)
                if not chunk:  # held back (an unfinished line, [DONE]) or the removed usage event
                    continue
                try:
                    if protocol.writing_paused or buffered() + len(chunk) > low_water:
                        try:
                            async with asyncio.timeout(stall):
                                await write(chunk)
                        except TimeoutError as exc:
                            raise _ClientStalled from exc
                    else:
                        await write(chunk)
                except ConnectionError as exc:
                    raise _ClientGone from exc
                if first:  # written: time to first token, as the client sees it (agent/serving/observe.py)
                    first = False
                    response[FIRST_CHUNK_AT] = asyncio.get_running_loop().time()
        except asyncio.CancelledError:  # the client went away (handler cancellation)
            if end is not None:
                end.soon(CLIENT_GONE, tail.delivered(), response.get(FIRST_CHUNK_AT))
            raise
        except _ClientStalled:
            if end is not None:
                end.soon(CLIENT_GONE, tail.delivered(), response.get(FIRST_CHUNK_AT))
            self.client_stalls += 1
            log.warning("client of a stream from %s read nothing for %g s (api.client_stall_timeout_s); "
                        "closing both connections", backend.id, stall)
            upstream.close()
            transport.abort()
            return response
        except _ClientGone:
            # Leaving forward() releases the upstream connection unread: aiohttp closes it,
            # and the engine stops generating.
            upstream.close()
            if end is not None:
                end.soon(CLIENT_GONE, tail.delivered(), response.get(FIRST_CHUNK_AT))
            return response
        except PeerLost:
            self.stream_errors += 1
            response[BROKE] = True
            upstream.close()
            log.warning("peer %s turned suspect mid-stream; ending the client's stream", backend.id)
            await _record_stream(end, 504, tail, response)
            await self._write_error(response, 504, f"peer {backend.id} stopped answering mid-stream (suspect "
                                    "in this node's mesh view: mesh.suspect_after_ms)", dialect=dialect)
        except TimeoutError:
            self.stream_errors += 1
            response[BROKE] = True
            log.warning("backend %s silent for %.0f s mid-stream; ending the client's stream", backend.id, idle)
            await _record_stream(end, 504, tail, response)
            await self._write_error(response, 504, f"backend {backend.id} went silent for {idle:g} s "
                                    "(api.stream_idle_timeout_s)", dialect=dialect)
        except _UPSTREAM_BROKEN as exc:
            self.stream_errors += 1
            response[BROKE] = True
            log.warning("backend %s broke off a stream: %r", backend.id, exc)
            await _record_stream(end, 502, tail, response)
            await self._write_error(response, 502, f"backend {backend.id} broke off the stream: "
                                    f"{exc.__class__.__name__}", dialect=dialect)
        else:
            error = watch.error
            if error is not None and engine_failed(error.status, error.body, adapter):
                self.stream_errors += 1
                response[BROKE] = True
                log.warning("backend %s ended a stream with an error event (%d): %s", backend.id, error.status,
                            (engine_message(error.body)[0] or "")[:200])
            # The end is reported (``[DONE]``, the last bytes) only once its row is committed.
            await _record_stream(end, error.status if error is not None else 200, tail, response)
            rest = tail.rest()
            if rest:
                try:
                    await response.write(rest)
                except ConnectionError:
                    pass
        try:
            await response.write_eof()
        except ConnectionError:
            pass
        return response

    @staticmethod
    async def _write_error(response: web.StreamResponse, status: int, message: str,
                           code: str | None = None, dialect: Dialect = Dialect.OPENAI) -> None:
        """The terminal SSE error event in the client's ``dialect``; ``code`` defaults by
        ``status`` (agent/serving/errors.py)."""
        if code is None:
            code = _STREAM_ERROR_CODES.get(status)
        try:
            await response.write(sse_error_event(status, message, code, dialect))
        except ConnectionError:
            pass


async def _record_stream(end: RequestEnd | None, status: int, tail: StreamTail,
                         response: web.StreamResponse) -> None:
    """A stream's row (``end``; nothing when None), with the usage ``tail`` read (also set on
    ``response`` for the limiter, agent/auth/gate.py), or without one the events it relayed
    (``StreamTail.delivered``)."""
    if tail.usage is not None:
        response[USAGE] = tail.usage
    if end is not None:
        await end(status, tail.delivered(), response.get(FIRST_CHUNK_AT))


async def _recorded(response: web.Response, end: RequestEnd | None) -> web.Response:
    """A whole (or assembled) answer of this node's engine, its row recorded first (``end``;
    none for a failure, status >= 500: the request may run again elsewhere). Its usage is
    read from the body when not known yet, and set on it (``USAGE``)."""
    if end is None or response.status >= 500:
        return response
    usage = response.get(USAGE)
    if usage is None and response.status < 300 and isinstance(response.body, bytes):
        usage = usage_in_body(response.body)
        if usage is not None:
            response[USAGE] = usage
    await end(response.status, usage, None)
    return response


def _outcome(result: web.StreamResponse | Refused | Failed | None) -> tuple[int | None, str | None]:
    """A forward's result for its span: the status the target answered (None: none) and what
    failed (None: nothing)."""
    if result is None:
        return None, "no answer: the client went away or the forward failed"
    if isinstance(result, Refused):
        return result.status, f"refused before the first byte: {result.reason}"
    if isinstance(result, Failed):
        return result.response.status, result.reason
    if result.get(BROKE, False):
        return result.status, "the stream broke after its first byte"
    return result.status, None


def _failed(response: web.Response, upstream: aiohttp.ClientResponse) -> web.Response | Failed:
    """A whole answer of status >= 500 (nothing sent yet) as ``Failed``; any other as is."""
    if response.status < 500:
        return response
    what = f"HTTP {upstream.status}" if upstream.status >= 500 else f"answered {response.status}"
    return Failed(response, what)
