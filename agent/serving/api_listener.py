"""The client API's TCP listener: a cap on open connections and a deadline for the request head.

aiohttp bounds a request head's size but not the time it may take to arrive: a client that
sends one header byte now and then (slowloris), or nothing at all, holds a connection, its
file descriptor and its :class:`aiohttp.web_protocol.RequestHandler` for as long as it likes
(aiohttp's only clock on it is ``keepalive_timeout``, 3630 s by default). Nothing bounds how
many such connections may be open. :class:`ApiSite` serves the runner's application through
:class:`ConnectionGuard`, a protocol factory that wraps each aiohttp handler in
:class:`_GuardedConnection` (docs/security.md, "Connection floods"):

- **Connection cap.** At most ``max_connections`` open at once, and at most
  ``max_connections_per_address`` from one source address (0: no per-address cap). The last
  :data:`RESERVED_FRACTION` of ``max_connections`` is kept for addresses that hold fewer than
  :data:`RESERVED_PER_ADDRESS` connections: a flood from a few addresses fills at most the
  rest, and a client on another address still gets in (docs/security.md gives the bound).
  Beyond either, the connection gets a minimal ``HTTP/1.1 503`` with ``Retry-After`` and an
  OpenAI-shaped body (code ``too_many_connections``) before any aiohttp state exists, is
  half-closed, and is dropped at the client's EOF or after :data:`REFUSAL_LINGER_S` (so the
  kernel does not reset the answer away with the client's unread request bytes). Counted.
- **Head deadline.** A timer armed when the connection is made and cancelled when aiohttp
  has parsed the first request's head (its ``request_factory`` is called for it, a malformed
  head included). When it fires first, the connection gets ``408`` and is closed. Counted.
  Later requests on a kept-alive connection are bounded by the runner's
  ``keepalive_timeout``: aiohttp closes a connection that has not delivered a whole head
  that long after its previous answer.

Body reads have their own deadline (agent/serving/body.py, ``read_timeout_s``).
"""

from __future__ import annotations

import asyncio
import json
import logging
import resource
from collections import Counter
from dataclasses import dataclass
from typing import Any

from aiohttp import web
from aiohttp.web_runner import BaseRunner, BaseSite
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from viiwork.agent.serving.errors import ErrorCode, error_body
from viiwork.mesh.places import AddressPlaces

log = logging.getLogger(__name__)

# How long a refused connection may stay half-closed waiting for the client's EOF, and how
# many may do so at once (beyond it they are closed at once: the answer may then be lost).
REFUSAL_LINGER_S = 1.0
MAX_LINGERING_REFUSALS = 1024
# The last eighth of max_connections (512 of 4096) only admits an address that holds fewer
# than 4 connections now: k flooding addresses take at most min(k x per-address cap, 7/8 of
# the cap) + 4k of it, so filling it all takes max_connections / 8 / 4 = 128 addresses.
RESERVED_FRACTION = 8
RESERVED_PER_ADDRESS = 4
_HEAD_TIMEOUT_ANSWER = b"HTTP/1.1 408 Request Timeout\r\nConnection: close\r\nContent-Length: 0\r\n\r\n"


@dataclass(frozen=True)
class ConnectionLimits:
    """The listener's limits (``[api]`` settings, docs/configuration.md).

    head_timeout_s: seconds from accept to a complete first request head. max_connections:
    open connections at most; max_connections_per_address: from one source address at most
    (0: no such cap). retry_after_s: the ``Retry-After`` of a refusal.
    """

    head_timeout_s: float = 10.0
    max_connections: int = 4096
    max_connections_per_address: int = 256
    retry_after_s: int = 1

    @property
    def reserved(self) -> int:
        """Places kept for addresses holding fewer than RESERVED_PER_ADDRESS connections."""
        return self.max_connections // RESERVED_FRACTION


class ConnectionGuard:
    """A protocol factory for ``loop.create_server`` around an aiohttp :class:`web.Server`.

    ``open``: connections open now (refused ones excluded); ``counters``: ``accepted``,
    ``refused_max_connections``, ``refused_per_address``, ``head_timeouts``. Single-threaded:
    the event loop owns it.
    """

    def __init__(self, server: web.Server, limits: ConnectionLimits, node_name: str = "") -> None:
        self.server = server
        self.limits = limits
        self.node_name = node_name
        self.places = AddressPlaces()
        self.counters: Counter[str] = Counter()
        self._by_handler: dict[Any, _GuardedConnection] = {}
        self.lingering = 0
        self._warned = False
        # aiohttp calls request_factory once per parsed request head, a malformed one
        # included (web_protocol.RequestHandler.start), before the request is handled: the
        # moment the head deadline is met. RequestHandler copies the attribute at creation,
        # so the wrapper is in place before the first connection.
        inner = server.request_factory

        def request_factory(message: Any, payload: Any, protocol: Any, writer: Any, task: Any) -> Any:
            conn = self._by_handler.get(protocol)
            if conn is not None:
                conn.head_received()
            return inner(message, payload, protocol, writer, task)

        server.request_factory = request_factory

    def __call__(self) -> asyncio.Protocol:
        return _GuardedConnection(self)

    @property
    def open(self) -> int:
        """Connections open now."""
        return self.places.open

    def admit(self, address: str) -> str | None:
        """Take a place for a connection from ``address``; the refusal reason when none is free."""
        limits = self.limits
        if self.open >= limits.max_connections:
            return "max_connections"
        from_address = self.places.held_by(address)
        if limits.max_connections_per_address and from_address >= limits.max_connections_per_address:
            return "per_address"
        if self.open >= limits.max_connections - limits.reserved and from_address >= RESERVED_PER_ADDRESS:
            return "reserved"
        self.places.take(address)
        self.counters["accepted"] += 1
        return None

    def release(self, address: str) -> None:
        self.places.give_back(address)

    def refusal(self, reason: str, address: str) -> bytes:
        """The bytes of a refusal (a whole HTTP/1.1 503 answer), counted and logged once."""
        limits = self.limits
        self.counters["refused_per_address" if reason == "per_address" else "refused_max_connections"] += 1
        if reason == "max_connections":
            what = f"{self.open} connections are open (api.max_connections = {limits.max_connections})"
        elif reason == "reserved":
            what = (f"{self.open} connections are open and {self.places.held_by(address)} from {address}; the "
                    f"last {limits.reserved} of api.max_connections = {limits.max_connections} are kept for "
                    f"addresses holding fewer than {RESERVED_PER_ADDRESS}")
        else:
            what = (f"{self.places.held_by(address)} connections from {address} are open "
                    f"(api.max_connections_per_address = {limits.max_connections_per_address})")
        if not self._warned:
            self._warned = True
            log.warning("client API: refusing new connections with 503: %s; further refusals are only counted "
                        "(viiwork_api_connections_refused_total on /metrics)", what)
        node = f"node {self.node_name!r}: " if self.node_name else ""
        body = json.dumps(error_body(503, f"{node}{what}; retry later", code=ErrorCode.TOO_MANY_CONNECTIONS)).encode()
        head = (f"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\n"
                f"Content-Length: {len(body)}\r\nRetry-After: {limits.retry_after_s}\r\nConnection: close\r\n\r\n")
        return head.encode() + body

    def metric_families(self) -> list[CounterMetricFamily | GaugeMetricFamily]:
        """The guard's families for /metrics (read now)."""
        c = self.counters
        refused = CounterMetricFamily("viiwork_api_connections_refused", "Client API connections refused at accept "
                                      "with 503, by the cap reached.", labels=["cap"])
        refused.add_metric(["max_connections"], c["refused_max_connections"])
        refused.add_metric(["max_connections_per_address"], c["refused_per_address"])
        return [
            GaugeMetricFamily("viiwork_api_connections_open", "Client API connections open now.", value=self.open),
            refused,
            CounterMetricFamily("viiwork_api_head_timeouts", "Client API connections closed (408) because no whole "
                                "request head arrived within api.head_timeout_s.", value=c["head_timeouts"]),
        ]

    def status(self) -> dict[str, Any]:
        """The ``api`` section of /v1/status."""
        return {"connections_open": self.open, "max_connections": self.limits.max_connections,
                **{k: self.counters[k] for k in ("accepted", "refused_max_connections", "refused_per_address",
                                                  "head_timeouts")}}


class _GuardedConnection(asyncio.Protocol):
    """One accepted connection: aiohttp's handler behind the head deadline, or a refusal."""

    def __init__(self, guard: ConnectionGuard) -> None:
        self._guard = guard
        self._handler: Any = None  # aiohttp's RequestHandler once admitted
        self._transport: asyncio.Transport | None = None
        self._address = "?"
        self._timer: asyncio.TimerHandle | None = None
        self._lingering = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self._transport = transport
        peer = transport.get_extra_info("peername")
        self._address = str(peer[0]) if isinstance(peer, tuple) and peer else "?"
        guard = self._guard
        loop = asyncio.get_running_loop()
        reason = guard.admit(self._address)
        if reason is not None:
            transport.write(guard.refusal(reason, self._address))
            if guard.lingering >= MAX_LINGERING_REFUSALS or not transport.can_write_eof():
                transport.close()
                return
            transport.write_eof()
            guard.lingering += 1
            self._lingering = True
            self._timer = loop.call_later(REFUSAL_LINGER_S, transport.abort)
            return
        self._handler = guard.server()
        guard._by_handler[self._handler] = self
        self._timer = loop.call_later(guard.limits.head_timeout_s, self._head_timeout)
        self._handler.connection_made(transport)

    def head_received(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _head_timeout(self) -> None:
        self._timer = None
        self._guard.counters["head_timeouts"] += 1
        if self._transport is not None and not self._transport.is_closing():
            self._transport.write(_HEAD_TIMEOUT_ANSWER)
            self._transport.close()

    def data_received(self, data: bytes) -> None:
        if self._handler is not None:
            self._handler.data_received(data)

    def eof_received(self) -> bool | None:
        if self._handler is not None:
            return self._handler.eof_received()
        return False  # a refused connection: the client is done, close

    def pause_writing(self) -> None:
        if self._handler is not None:
            self._handler.pause_writing()

    def resume_writing(self) -> None:
        if self._handler is not None:
            self._handler.resume_writing()

    def connection_lost(self, exc: BaseException | None) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        guard = self._guard
        if self._lingering:
            self._lingering = False
            guard.lingering -= 1
        if self._handler is not None:
            handler, self._handler = self._handler, None
            guard._by_handler.pop(handler, None)
            guard.release(self._address)
            handler.connection_lost(exc)


class ApiSite(BaseSite):
    """An aiohttp site on ``host:port`` whose connections go through a :class:`ConnectionGuard`
    (see the module doc). ``port`` 0 binds a free port (see :attr:`port`); :attr:`guard` is
    set by :meth:`start`."""

    def __init__(self, runner: BaseRunner, host: str, port: int, limits: ConnectionLimits, *,
                 node_name: str = "", backlog: int = 1024) -> None:
        super().__init__(runner, backlog=backlog)
        self.host, self._port = host, port
        self.limits = limits
        self.node_name = node_name
        self.guard: ConnectionGuard | None = None

    @property
    def name(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def port(self) -> int:
        # BaseSite types _server as AbstractServer; start() stores loop.create_server's Server.
        if isinstance(self._server, asyncio.Server) and self._server.sockets:
            return int(self._server.sockets[0].getsockname()[1])
        return self._port

    async def start(self) -> None:
        await super().start()
        server = self._runner.server
        if server is None:
            raise RuntimeError("call runner.setup() before starting the site")
        self.guard = ConnectionGuard(server, self.limits, self.node_name)
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(self.guard, self.host, self._port, backlog=self._backlog,
                                                reuse_address=True)


def raise_open_file_limit() -> tuple[int, int]:
    """Raise this process's soft RLIMIT_NOFILE to its hard limit; returns (soft, hard) after.

    Every connection holds a descriptor: with the usual soft limit of 1024, accept() fails
    (EMFILE) long before api.max_connections, and asyncio then stops accepting for a second at
    a time. systemd/viiwork.service sets LimitNOFILE=65536; elsewhere the hard limit is used.
    """
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or soft < hard:
        target = hard if hard != resource.RLIM_INFINITY else max(soft, 1 << 20)
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError) as exc:
            log.debug("cannot raise RLIMIT_NOFILE to %s: %s", target, exc)
    return soft, hard
