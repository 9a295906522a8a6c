"""Forward one admitted request to a backend and relay the answer (DESIGN §6, §11).

- Streams are relayed chunk by chunk as they arrive (each write flushed; no buffering).
- A pooled connection found dead before any byte reached the client is retried once on a
  fresh connection: llama-server closes the TCP connection after each streamed response
  while still answering ``Connection: keep-alive``, so the next request on that pooled
  socket fails (seen: a bare aiohttp proxy answered 500s, nginx 502s).
- After the first byte there is no retry: an engine that dies or stays silent longer than
  ``stream_idle_timeout_s`` ends the client's stream with a terminal SSE error event.
- Silence is timed by the client session's ``sock_read`` timer (restarted by every read from
  the engine, paused while the client holds reading back), not by an ``asyncio.timeout`` per
  request and per chunk: same rule, a fraction of the cost on the hot path.
- A client that disconnects cancels the handler (aiohttp ``handler_cancellation``); leaving
  the upstream request's context closes its connection, and the engine frees the slot.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import aiohttp
from aiohttp import web

from viiwork.agent.backends import Backend
from viiwork.agent.errors import error_response, sse_error_event

log = logging.getLogger(__name__)

# Failures of a reused keep-alive connection that the server already closed.
_STALE_CONNECTION = (aiohttp.ServerDisconnectedError, aiohttp.ClientOSError)
_UPSTREAM_BROKEN = (aiohttp.ClientPayloadError, aiohttp.ClientConnectionError)


class _ClientGone(Exception):
    """The client closed its connection; nothing more can be written to it."""

_PASS_REQUEST_HEADERS = ("Content-Type", "Accept")

# Set by a peer that declines a forwarded request before doing any work (no free slot, model
# not served, draining): the origin may try another peer before the first byte.
REFUSED_HEADER = "X-Viiwork-Refused"


@dataclass(frozen=True, slots=True)
class Refused:
    """A peer declined a forward before the first byte: HTTP ``status`` and its ``reason``."""

    status: int
    reason: str


class Upstream:
    """The agent's HTTP client towards its engines: one shared session, pooled connections.

    stream_idle_timeout_s: longest silence tolerated from an engine once it has answered
    (per chunk while streaming, and for the whole body otherwise).
    """

    def __init__(self, stream_idle_timeout_s: float, connect_timeout_s: float = 5.0) -> None:
        self.stream_idle_timeout_s = stream_idle_timeout_s
        self.connect_timeout_s = connect_timeout_s
        self._session: aiohttp.ClientSession | None = None
        self.stale_retries = 0
        self.stream_errors = 0

    async def __aenter__(self) -> Upstream:
        connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=30, enable_cleanup_closed=False)
        self._session = aiohttp.ClientSession(
            connector=connector,
            auto_decompress=False,
            skip_auto_headers=("User-Agent", "Accept-Encoding"),
            # sock_read: the longest silence from the engine, from the request sent to the
            # headers and between any two reads of the body; raises ServerTimeoutError, a
            # TimeoutError. ceil_threshold: never round it up to whole seconds.
            timeout=aiohttp.ClientTimeout(total=None, sock_connect=self.connect_timeout_s,
                                          sock_read=self.stream_idle_timeout_s, ceil_threshold=float("inf")),
        )
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self._session is not None:
            await self._session.close()

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
        backend: Backend,
        body: bytes,
        stream: bool,
        headers: dict[str, str],
        request_id: str,
        *,
        session: aiohttp.ClientSession | None = None,
        extra_headers: dict[str, str] | None = None,
        relay_headers: tuple[str, ...] = (),
        refusable: bool = False,
    ) -> web.StreamResponse | Refused:
        """Send ``body`` to ``backend`` at the request's path; relay status, headers, body.

        ``backend`` is anything with ``id`` and ``base_url`` (a local Backend, or a peer's mesh
        listener reached with ``session``, whose TLS context authenticates both sides).
        ``extra_headers`` go upstream; ``relay_headers`` are copied from the upstream answer
        to the client's. With ``refusable``, an answer carrying ``X-Viiwork-Refused`` (a peer
        that has no free slot) returns ``Refused`` before anything reaches the client, so the
        caller can try elsewhere. Returns the response to give the client (already prepared
        and finished when streamed). Errors before the first byte become 502/504 JSON errors.
        """
        upstream_headers = {"X-Request-Id": request_id}
        request_headers = request.headers
        for name in _PASS_REQUEST_HEADERS:
            value = request_headers.get(name)
            if value is not None:
                upstream_headers[name] = value
        if extra_headers:
            upstream_headers.update(extra_headers)
        url = backend.base_url + request.path
        try:
            upstream = await self._open(url, body, upstream_headers, session)
        except TimeoutError:  # sock_read (aiohttp.ServerTimeoutError) or sock_connect
            if refusable:
                return Refused(504, "timeout")
            return error_response(504, f"backend {backend.id} did not answer within "
                                  f"{self.stream_idle_timeout_s:g} s (api.stream_idle_timeout_s)", headers=headers)
        except aiohttp.ClientError as exc:
            if refusable:
                return Refused(502, f"unreachable: {exc.__class__.__name__}")
            return error_response(502, f"backend {backend.id} unreachable: {exc.__class__.__name__}",
                                  headers=headers)
        try:
            if refusable and REFUSED_HEADER in upstream.headers:
                return Refused(upstream.status, upstream.headers[REFUSED_HEADER])
            for name in relay_headers:
                value = upstream.headers.get(name)
                if value is not None:
                    headers[name] = value
            content_type = upstream.headers.get("Content-Type", "application/json")
            if not stream or upstream.status != 200 or not content_type.startswith("text/event-stream"):
                return await self._relay_whole(upstream, backend, headers, content_type)
            return await self._relay_stream(request, upstream, backend, headers, content_type)
        finally:
            upstream.release()

    async def _relay_whole(self, upstream: aiohttp.ClientResponse, backend: Backend,
                           headers: dict[str, str], content_type: str) -> web.Response:
        try:
            data = await upstream.read()
        except TimeoutError:  # sock_read: silent for stream_idle_timeout_s
            return error_response(504, f"backend {backend.id} went silent for {self.stream_idle_timeout_s:g} s "
                                  "(api.stream_idle_timeout_s)", headers=headers)
        except _UPSTREAM_BROKEN as exc:
            return error_response(502, f"backend {backend.id} broke off its answer: {exc.__class__.__name__}",
                                  headers=headers)
        headers["Content-Type"] = content_type.split(";", 1)[0]
        return web.Response(status=upstream.status, body=data, headers=headers)

    async def _relay_stream(self, request: web.Request, upstream: aiohttp.ClientResponse, backend: Backend,
                            headers: dict[str, str], content_type: str) -> web.StreamResponse:
        response = web.StreamResponse(status=200, headers=headers)
        response.content_type = "text/event-stream"
        response.headers["Cache-Control"] = "no-cache"
        response.headers["X-Accel-Buffering"] = "no"
        await response.prepare(request)
        idle = self.stream_idle_timeout_s
        read = upstream.content.readany
        write = response.write
        try:
            while True:
                chunk = await read()  # TimeoutError after `idle` s of silence (sock_read)
                if not chunk:
                    break
                try:
                    await write(chunk)
                except ConnectionError as exc:
                    raise _ClientGone from exc
        except _ClientGone:
            # Leaving forward() releases the upstream connection unread: aiohttp closes it,
            # and the engine stops generating.
            upstream.close()
            return response
        except TimeoutError:
            self.stream_errors += 1
            log.warning("backend %s silent for %.0f s mid-stream; ending the client's stream", backend.id, idle)
            await self._write_error(response, 504, f"backend {backend.id} went silent for {idle:g} s "
                                    "(api.stream_idle_timeout_s)")
        except _UPSTREAM_BROKEN as exc:
            self.stream_errors += 1
            log.warning("backend %s broke off a stream: %r", backend.id, exc)
            await self._write_error(response, 502, f"backend {backend.id} broke off the stream: "
                                    f"{exc.__class__.__name__}")
        try:
            await response.write_eof()
        except ConnectionError:
            pass
        return response

    @staticmethod
    async def _write_error(response: web.StreamResponse, status: int, message: str) -> None:
        try:
            await response.write(sse_error_event(status, message))
        except ConnectionError:
            pass
