"""The thin asyncio layer around the protocol core: the mutual-TLS mesh listener and the
gossip client.

One module (over 400 lines) because it is both ends of one wire: the listener (most of it:
the TLS gate and its bounds) closes idle connections after :data:`KEEPALIVE_TIMEOUT_S`, set
above the client's pool keep-alive (:data:`POOL_KEEPALIVE_S`), and serves the paths the
client posts to; apart, the two halves of those bounds would drift. The peer check is in
:mod:`viiwork.mesh.dialing`.

**Listener.** An aiohttp application (gossip endpoints below, plus whatever routes the
agent adds, e.g. forwarded requests) served by :class:`MutualTlsSite`: a plain TCP server
whose connections do their TLS handshake explicitly (``loop.start_tls``) before aiohttp's
request handler sees them. That way every failed handshake (no client certificate, another
CA's, an expired one, garbage, a timeout) is counted (``transport.handshake_failed``) and
logged once per address at WARNING, which asyncio's built-in server TLS cannot do. The
verified peer's node id is put on the request (:func:`peer_of`).

**Pending handshakes are bounded** (docs/security.md, "Connection floods"): each one holds
asyncio's TLS read buffer (256 KiB, ``SSLProtocol.max_size``; about 300 KiB in all) until it completes or
``handshake_timeout_s`` passes, so at most ``max_pending_handshakes`` may be pending at once,
and at most ``max_pending_per_address`` from one source address. A connection beyond either
is closed at accept, before ``start_tls`` allocates anything, and counted
(``on_handshake_refused``; the agent counts ``transport.handshake_refused``).

**Established connections are bounded too.** In open trust anyone who knows the mesh id can
make a certificate and complete the handshake; each connection then holds the same TLS
buffers (about 270 KiB). So at most ``max_connections`` connections may be open at once
(pending handshakes included) and ``max_connections_per_address`` from one source address:
beyond either a connection is closed at accept (``on_connection_event("connection_refused")``).
A connection whose first request head has not arrived ``first_request_timeout_s`` after its
handshake is closed (``"first_request_timeout"``; a peer sends its request at once), and the
agent's runner closes one idle between requests after :data:`KEEPALIVE_TIMEOUT_S`, longer
than the clients' pools keep an idle connection (30 s: :class:`GossipClient`,
agent/peering/mesh_link.py), so a peer never reuses a connection the listener is closing.

Endpoints (POST, body and answer are :mod:`viiwork.mesh.messages` JSON):

- ``/mesh/v1/exchange``: a digest in, the reply out (200), or 400 when dropped;
- ``/mesh/v1/push``: a push in, 204, or 400 when dropped.

**Client.** :class:`GossipClient` runs one exchange per target (digest, reply, push) over a
pooled HTTPS connection presenting this node's certificate, each bounded by
``exchange_timeout_s`` (connect ``connect_timeout_s``; a name lookup half of
``exchange_timeout_s``, on the mesh's own threads: :mod:`viiwork.mesh.lookups`), all of a
round in parallel: a dead or slow peer costs one timed-out task, never the round or the
event loop. When the target's node id is known (a peer from the table, an mDNS
advertisement naming one; not a seed), the TLS peer must be that node before the digest is
sent (:mod:`viiwork.mesh.dialing`). The node that answered (read when the response starts:
:class:`PeerResponse`) gets the exchange's round trip (``Membership.note_rtt``: ``rtt_ms``,
which the router uses to prefer near peers, docs/routing.md) and names a seed's node.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import ssl
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

import aiohttp
from aiohttp import web
from aiohttp.connector import Connection
from aiohttp.web_runner import BaseRunner, BaseSite

from viiwork.mesh.counters import DropReason
from viiwork.mesh.dialing import PeerMismatch, expect_node, peer_session_parts
from viiwork.mesh.identity import NodeId
from viiwork.mesh.lookups import NAME_LOOKUP_TIMEOUT_S, NameLookupTimeout
from viiwork.mesh.membership import GossipTarget, Membership
from viiwork.mesh.places import AddressPlaces
from viiwork.mesh.tls import peer_node_id

log = logging.getLogger(__name__)

EXCHANGE_PATH = "/mesh/v1/exchange"
PUSH_PATH = "/mesh/v1/push"
HANDSHAKE_TIMEOUT_S = 5.0
# A pending handshake costs about 300 KiB (measured: tests/bench/bench_floods.py), so 64 of
# them about 19 MiB under a flood. Peers keep their connections pooled (gossip for 30 s) and
# a handshake on a LAN is pending for a few milliseconds: even a thousand nodes dialling this
# one a few times a second keep well under 64 pending. 16 per address leaves room for a
# peer's burst of parallel forwards.
MAX_PENDING_HANDSHAKES = 64
MAX_PENDING_PER_ADDRESS = 16
# Established (and pending) connections: 1024 x ~270 KiB is at most about 280 MiB under a
# flood from 8+ addresses of an open mesh. A peer keeps 2 pooled gossip connections and as
# many forwards as this node serves at once (its slots plus routing.queue_max): far below 128.
MAX_CONNECTIONS = 1024
MAX_CONNECTIONS_PER_ADDRESS = 128
FIRST_REQUEST_TIMEOUT_S = 5.0
#: The longest header line or value the mesh listener's parser takes (aiohttp's default is
#: 8190): a forward carries the client's key, which may be 8 KiB (agent/auth/jws.py).
MAX_HEADER_FIELD_BYTES = 16 * 1024
# Idle time between requests before the listener closes a connection: above the 30 s for
# which GossipClient and agent/peering/mesh_link.py keep an idle connection pooled.
KEEPALIVE_TIMEOUT_S = 40.0
POOL_KEEPALIVE_S = 30.0
PEER_KEY: web.AppKey[Callable[[web.Request], NodeId | None]] = web.AppKey("viiwork_mesh_peer_of")


def peer_of(request: web.Request) -> NodeId | None:
    """The node id of the verified client certificate of a request on the mesh listener."""
    transport = request.transport
    return None if transport is None else peer_node_id(transport.get_extra_info("ssl_object"))


class _Buffer(asyncio.Protocol):
    """Holds application data that arrives between the end of the handshake and the
    hand-over to the request handler."""

    def __init__(self) -> None:
        self.chunks: list[bytes] = []
        self.eof = False
        self.lost: BaseException | None | bool = False

    def data_received(self, data: bytes) -> None:
        self.chunks.append(data)

    def eof_received(self) -> bool:
        self.eof = True
        return True

    def connection_lost(self, exc: BaseException | None) -> None:
        self.lost = exc if exc is not None else True


class _Established(asyncio.Protocol):
    """aiohttp's request handler on an established TLS connection, behind the first-request
    deadline; gives the connection's place back when it closes."""

    def __init__(self, site: MutualTlsSite, handler: Any, host: str) -> None:
        self._site, self.handler, self._host = site, handler, host
        self._transport: asyncio.Transport | None = None
        self._timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self._transport = transport
        self._site._awaiting[self.handler] = self
        self._timer = asyncio.get_running_loop().call_later(self._site.first_request_timeout_s,
                                                            self._first_request_timeout)
        self.handler.connection_made(transport)

    def request_arrived(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self._site._awaiting.pop(self.handler, None)

    def _first_request_timeout(self) -> None:
        self._timer = None
        self._site._awaiting.pop(self.handler, None)
        self._site.connection_event("first_request_timeout")
        if self._transport is not None and not self._transport.is_closing():
            self._transport.abort()

    def data_received(self, data: bytes) -> None:
        self.handler.data_received(data)

    def eof_received(self) -> bool | None:
        return self.handler.eof_received()  # type: ignore[no-any-return]

    def pause_writing(self) -> None:
        self.handler.pause_writing()

    def resume_writing(self) -> None:
        self.handler.resume_writing()

    def connection_lost(self, exc: BaseException | None) -> None:
        self.request_arrived()  # cancels the timer
        self._site.connection_closed(self._host)
        self.handler.connection_lost(exc)


class _TlsGate(asyncio.Protocol):
    """Accepts one TCP connection, performs the server-side TLS handshake, then hands the
    TLS transport to aiohttp's request handler."""

    def __init__(self, site: MutualTlsSite):
        self._site = site
        self._task: asyncio.Task[None] | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        # No byte of the ClientHello may land here: start_tls takes over reading.
        transport.pause_reading()
        host = _host_of(transport.get_extra_info("peername"))
        if not self._site.admit_connection(host):
            transport.abort()
            return
        if not self._site.admit_handshake(host):
            self._site.connection_closed(host)
            transport.abort()  # nothing was allocated for it yet: an RST, no TIME_WAIT here
            return
        self._task = asyncio.get_running_loop().create_task(self._handshake(transport, host))
        self._site._tasks.add(self._task)
        self._task.add_done_callback(self._site._tasks.discard)

    async def _handshake(self, transport: asyncio.Transport, host: str) -> None:
        loop = asyncio.get_running_loop()
        peer = transport.get_extra_info("peername")
        buffer = _Buffer()
        try:
            tls = await loop.start_tls(transport, buffer, self._site.ssl_context, server_side=True,
                                       ssl_handshake_timeout=self._site.handshake_timeout_s)
        except (TimeoutError, ssl.SSLError, OSError, ConnectionError, RuntimeError) as exc:
            self._site.handshake_failed(peer, exc)
            # The traceback's frames hold asyncio's SSLProtocol (and its 256 KiB buffer) in a
            # cycle with the exception: without this it waits for a full gc collection.
            exc.__traceback__ = None
            transport.close()
            self._site.connection_closed(host)
            return
        except BaseException:  # cancelled (the site stops)
            self._site.connection_closed(host)
            raise
        finally:
            self._site.handshake_done(host)
        if tls is None:  # the peer went away during the handshake
            self._site.handshake_failed(peer, ConnectionError("closed during handshake"))
            self._site.connection_closed(host)
            return
        handler = _Established(self._site, self._site.server_factory(), host)
        tls.set_protocol(handler)
        handler.connection_made(tls)
        for chunk in buffer.chunks:
            handler.data_received(chunk)
        if buffer.eof:
            handler.eof_received()
        if buffer.lost is not False:
            handler.connection_lost(None if buffer.lost is True else buffer.lost)

    def data_received(self, data: bytes) -> None:  # pragma: no cover - reading is paused
        pass

    def connection_lost(self, exc: BaseException | None) -> None:
        pass


class MutualTlsSite(BaseSite):
    """An aiohttp site on ``host:port`` whose connections must complete mutual TLS with
    ``ssl_context`` (see the module doc). ``on_handshake_failure(peer, exc)`` is called for
    every failed handshake, ``on_handshake_refused(host)`` for every connection closed at
    accept because ``max_pending_handshakes`` (all sources) or ``max_pending_per_address``
    (``host``) handshakes are already pending. ``port`` 0 binds a free port (see :attr:`port`)."""

    def __init__(self, runner: BaseRunner, host: str, port: int, ssl_context: ssl.SSLContext,
                 on_handshake_failure: Callable[[Any, BaseException], None] | None = None,
                 handshake_timeout_s: float = HANDSHAKE_TIMEOUT_S, backlog: int = 128,
                 on_handshake_refused: Callable[[str], None] | None = None,
                 max_pending_handshakes: int = MAX_PENDING_HANDSHAKES,
                 max_pending_per_address: int = MAX_PENDING_PER_ADDRESS,
                 max_connections: int = MAX_CONNECTIONS,
                 max_connections_per_address: int = MAX_CONNECTIONS_PER_ADDRESS,
                 first_request_timeout_s: float = FIRST_REQUEST_TIMEOUT_S,
                 on_connection_event: Callable[[str], None] | None = None):
        super().__init__(runner, backlog=backlog)
        self.host, self._port = host, port
        self.ssl_context = ssl_context
        self.handshake_timeout_s = handshake_timeout_s
        self.max_pending_handshakes = max_pending_handshakes
        self.max_pending_per_address = max_pending_per_address
        self._on_failure = on_handshake_failure
        self._on_refused = on_handshake_refused
        self._tasks: set[asyncio.Task[None]] = set()
        self._warned: set[str] = set()
        self._pending = AddressPlaces()  # TLS handshakes pending, per source address
        self._refusals_warned = False
        self.max_connections = max_connections
        self.max_connections_per_address = max_connections_per_address
        self.first_request_timeout_s = first_request_timeout_s
        self._on_event = on_connection_event
        self._open = AddressPlaces()  # connections open (pending handshakes included), per source address
        self._awaiting: dict[Any, _Established] = {}  # aiohttp handler -> its connection, until a request
        self.counters: Counter[str] = Counter()
        self._connection_refusals_warned = False

    @property
    def name(self) -> str:
        return f"https://{self.host}:{self.port}"

    @property
    def port(self) -> int:
        # BaseSite types _server as AbstractServer; start() stores loop.create_server's Server.
        if isinstance(self._server, asyncio.Server) and self._server.sockets:
            return int(self._server.sockets[0].getsockname()[1])
        return self._port

    @property
    def server_factory(self) -> Callable[[], asyncio.Protocol]:
        server = self._runner.server
        assert server is not None, "call runner.setup() before starting the site"
        return server

    @property
    def pending_handshakes(self) -> int:
        return self._pending.open

    @property
    def connections_open(self) -> int:
        return self._open.open

    def admit_connection(self, host: str) -> bool:
        """Take a connection place for ``host``; False (and counted) when none is free."""
        from_host = self._open.held_by(host)
        if self.connections_open >= self.max_connections or from_host >= self.max_connections_per_address:
            if not self._connection_refusals_warned:
                self._connection_refusals_warned = True
                log.warning("mesh listener: closing new connections at accept: %d open (%d from %s; caps %d and %d "
                            "per address); further refusals are only counted (transport.connection_refused)",
                            self.connections_open, from_host, host, self.max_connections,
                            self.max_connections_per_address)
            self.connection_event("connection_refused")
            return False
        self._open.take(host)
        return True

    def connection_closed(self, host: str) -> None:
        """Give back the place :meth:`admit_connection` took."""
        self._open.give_back(host)

    def connection_event(self, name: str) -> None:
        self.counters[name] += 1
        if self._on_event is not None:
            self._on_event(name)

    def admit_handshake(self, host: str) -> bool:
        """Take a pending-handshake place for ``host``; False (and counted) when none is free."""
        from_host = self._pending.held_by(host)
        if self.pending_handshakes >= self.max_pending_handshakes or from_host >= self.max_pending_per_address:
            if not self._refusals_warned:
                self._refusals_warned = True
                log.warning("mesh listener: closing new connections at accept: %d TLS handshakes pending (%d from "
                            "%s; caps %d and %d per address); further refusals are only counted "
                            "(transport.handshake_refused)", self.pending_handshakes, from_host, host,
                            self.max_pending_handshakes, self.max_pending_per_address)
            if self._on_refused is not None:
                self._on_refused(host)
            return False
        self._pending.take(host)
        return True

    def handshake_done(self, host: str) -> None:
        """Give back the place :meth:`admit_handshake` took (the handshake ended either way)."""
        self._pending.give_back(host)

    def handshake_failed(self, peer: Any, exc: BaseException) -> None:
        host = _host_of(peer)
        if host not in self._warned and len(self._warned) < 10_000:
            self._warned.add(host)
            log.warning("mesh listener: TLS handshake from %s failed: %s: %s", host, type(exc).__name__, exc)
        else:
            log.debug("mesh listener: TLS handshake from %s failed: %s: %s", host, type(exc).__name__, exc)
        if self._on_failure is not None:
            self._on_failure(peer, exc)

    async def start(self) -> None:
        await super().start()
        # aiohttp calls request_factory once per parsed request head (a malformed one
        # included): the first request has arrived. RequestHandler copies the attribute at
        # creation, so the wrapper is in place before the first connection.
        server = self._runner.server
        assert server is not None, "call runner.setup() before starting the site"
        inner = server.request_factory

        def request_factory(message: Any, payload: Any, protocol: Any, writer: Any, task: Any) -> Any:
            conn = self._awaiting.get(protocol)
            if conn is not None:
                conn.request_arrived()
            return inner(message, payload, protocol, writer, task)

        server.request_factory = request_factory
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(lambda: _TlsGate(self), self.host, self._port,
                                                backlog=self._backlog, reuse_address=True)

    async def stop(self) -> None:
        await super().stop()
        for task in list(self._tasks):
            task.cancel()
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)


def _host_of(peer: Any) -> str:
    """The address part of a ``peername`` ("?" when there is none)."""
    return str(peer[0]) if isinstance(peer, tuple) and peer else "?"


def gossip_routes(membership: Membership) -> list[web.RouteDef]:
    """The gossip endpoints for ``membership`` (added to the listener's application)."""

    async def read_body(request: web.Request) -> bytes | int:
        """The body, or the status to answer when it is dropped (and counted): 413 beyond
        ``client_max_size`` (``oversized``), 400 when it cannot be read (``malformed``): a
        ``Content-Encoding`` that does not decode or a broken chunked framing (aiohttp's
        ``RequestPayloadError``)."""
        try:
            return await request.read()
        except web.HTTPRequestEntityTooLarge:
            membership.counters.drop(DropReason.OVERSIZED)
            return 413
        except web.RequestPayloadError:
            membership.counters.drop(DropReason.MALFORMED)
            return 400

    async def exchange(request: web.Request) -> web.Response:
        body = await read_body(request)
        if isinstance(body, int):
            return web.Response(status=body)
        reply = membership.on_digest_bytes(peer_of(request), body)
        if reply is None:
            return web.Response(status=400)
        return web.Response(body=reply, content_type="application/json")

    async def push(request: web.Request) -> web.Response:
        body = await read_body(request)
        if isinstance(body, int):
            return web.Response(status=body)
        return web.Response(status=204 if membership.on_push_bytes(peer_of(request), body) else 400)

    return [web.post(EXCHANGE_PATH, exchange), web.post(PUSH_PATH, push)]


class GossipClient:
    """Dials peers over mutual TLS and runs exchanges for ``membership`` (see module doc)."""

    def __init__(self, membership: Membership, ssl_context: ssl.SSLContext, connect_timeout_s: float = 1.0,
                 exchange_timeout_s: float = 2.0):
        self.membership = membership
        self.ssl_context = ssl_context
        self.connect_timeout_s = connect_timeout_s
        self.exchange_timeout_s = exchange_timeout_s
        self._session: aiohttp.ClientSession | None = None
        self._warned: set[str] = set()

    async def start(self) -> None:
        # A name lookup fails on its own deadline, within the exchange's: "name lookup timed out".
        parts = peer_session_parts(self.ssl_context, counters=self.membership.counters.transport, limit=256,
                                   limit_per_host=2, keepalive_timeout=POOL_KEEPALIVE_S,
                                   lookup_timeout_s=min(NAME_LOOKUP_TIMEOUT_S, self.exchange_timeout_s / 2))
        timeout = aiohttp.ClientTimeout(total=self.exchange_timeout_s, sock_connect=self.connect_timeout_s)
        self._session = aiohttp.ClientSession(**parts, timeout=timeout, raise_for_status=False,
                                              response_class=PeerResponse)

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    def _url(self, address: str, path: str) -> str:
        return f"https://{address}{path}"

    async def exchange(self, target: GossipTarget) -> bool:
        """One exchange with ``target``; True when it completed. Never raises for network
        or peer faults (counted in ``transport``: exchange_failed, exchange_timeout, and
        peer_mismatch when the TLS peer is not ``target.node_id``)."""
        return await self.try_exchange(target) is None

    async def try_exchange(self, target: GossipTarget) -> str | None:
        """:meth:`exchange`, saying what went wrong: None when the exchange completed, else
        a few words ("connection refused", "timed out", "answered 400", "TLS: ...")."""
        m = self.membership
        counters = m.counters.transport
        if self._session is None:
            raise RuntimeError("call GossipClient.start() first")
        try:
            async with asyncio.timeout(self.exchange_timeout_s):
                started = time.monotonic()
                digest = m.digest_bytes(target)
                headers = {"Content-Type": "application/json"}
                if target.node_id is not None:  # a seed's node is unknown: no check
                    headers.update(expect_node(target.node_id))
                async with self._session.post(self._url(target.address, EXCHANGE_PATH), data=digest,
                                              headers=headers) as resp:
                    peer = response_peer(resp)
                    body = await resp.read()
                    status = resp.status
                rtt_ms = (time.monotonic() - started) * 1000.0
                if status != 200:
                    counters["exchange_refused"] += 1
                    self._warn(target.address, f"answered {status}")
                    return f"answered {status}"
                push = m.on_reply_bytes(peer, body, target)
                if peer is not None:  # after the reply: a seed's first one adds its record
                    m.note_rtt(peer, rtt_ms)
                if push is not None:
                    async with self._session.post(self._url(target.address, PUSH_PATH), data=push,
                                                  headers=headers) as resp:
                        await resp.read()
                        if resp.status != 204:
                            counters["push_refused"] += 1
                counters["exchanges_ok"] += 1
                return None
        except TimeoutError:
            counters["exchange_timeout"] += 1
            self._warn(target.address, "timed out", debug=True)
            return "timed out"
        except PeerMismatch as exc:  # counted (peer_mismatch) and logged by the connector
            return f"not the expected node: {exc.strerror}"
        except (aiohttp.ClientError, OSError, ssl.SSLError) as exc:
            counters["exchange_failed"] += 1
            self._warn(target.address, f"{type(exc).__name__}: {exc}", debug=True)
            return _fault(exc)

    def _warn(self, address: str, what: str, debug: bool = False) -> None:
        # Dead peers are routine (their death is what liveness reports): DEBUG. Refusals
        # from a live peer are worth one WARNING per address.
        if not debug and address not in self._warned and len(self._warned) < 10_000:
            self._warned.add(address)
            log.warning("gossip with %s: %s", address, what)
        else:
            log.debug("gossip with %s: %s", address, what)


def _fault(exc: BaseException) -> str:
    """A failed dial in a few words: the OS error's text ("connection refused", "no route to
    host"), "name lookup failed: ..." (the lookup's own text) or "name lookup timed out",
    "TLS: ..." for a failed handshake, else the exception's type and message."""
    if isinstance(exc, (ssl.SSLError, aiohttp.ClientSSLError)):
        reason = getattr(exc, "reason", None) or getattr(getattr(exc, "os_error", None), "reason", None)
        return f"TLS: {reason or exc}"
    os_error = getattr(exc, "os_error", exc)  # (aiohttp's ClientConnectorDNSError carries the lookup's)
    if isinstance(os_error, NameLookupTimeout):
        return "name lookup timed out"
    if isinstance(os_error, socket.gaierror):  # a name lookup: its errno is not an OS error's
        return f"name lookup failed: {os_error.strerror or os_error}".lower()
    if isinstance(os_error, OSError) and os_error.errno:
        return os.strerror(os_error.errno).lower()
    return f"{type(exc).__name__}: {exc}"


class PeerResponse(aiohttp.ClientResponse):
    """A gossip response that keeps the node id of the TLS peer that answered (:attr:`peer`),
    read from its connection when the response starts. It cannot be read later: a small
    answer arrives whole with its head, and aiohttp releases the connection to the pool at
    the body's end, inside :meth:`start` (``resp.connection`` is then None)."""

    peer: NodeId | None = None

    async def start(self, connection: Connection) -> aiohttp.ClientResponse:
        transport = connection.transport
        if transport is not None:
            try:
                self.peer = peer_node_id(transport.get_extra_info("ssl_object"))
            except (ValueError, ssl.SSLError):  # an undecodable certificate names no node
                self.peer = None
        return await super().start(connection)


def response_peer(resp: aiohttp.ClientResponse) -> NodeId | None:
    """The node that answered ``resp`` (None: unknown), for the RTT and a seed's node id."""
    return resp.peer if isinstance(resp, PeerResponse) else None
