"""Dialling a known peer: the node at the other end must be the node the caller meant to reach.

Mutual TLS (:mod:`viiwork.mesh.tls`) proves that a peer holds *a* certificate of this mesh
(issued by the mesh CA, or in open mode by the CA every node derives from the ``mesh_id``),
not that it is the node the caller wants. Without more, anyone holding another member's
certificate and key who listens on a node's advertised address (the node crashed, or its
address was taken over) would receive what is meant for that node: forwarded prompts, slot
offers, gossip. So every request to a known peer names the node it is for, and
:class:`PeerConnector` compares that with the node id of the TLS peer's certificate key
(:func:`viiwork.mesh.tls.peer_node_id`) on every connection, new or pooled, after the
handshake and before :meth:`aiohttp.ClientRequest.send` writes a byte of the request
(aiohttp's ``ClientSession._request`` calls ``connector.connect(req)`` first, then
``req.send(conn)``). A mismatch closes the connection and raises :class:`PeerMismatch`, a
``ClientConnectorError``, so callers treat it like a peer that could not be reached (a
forward is routed elsewhere, never sent; aiohttp never retries a connector error). Each one
is counted (``peer_mismatch`` in the mesh's transport counters) and logged at WARNING with
both node ids, once per address per :data:`WARN_EVERY_S`, else at DEBUG.

How a request names its node: the header :data:`EXPECTED_NODE_HEADER`, set with
:func:`expect_node`. :class:`PeerRequest` (the session's ``request_class``) takes it off the
request when the request is built, so it never goes on the wire, and adds the node id to the
connection pool key: a connection verified for one node is never reused for another node at
the same address. A connector built with ``require_expected=True`` (the agent's forwarding
session) refuses a request that names no node; the gossip client's does not, because seeds
(``mesh.seeds``) are addresses whose node nobody knows yet (the check applies as soon as the
target's node id is known: a peer from the table, or an mDNS advertisement naming one).

A :class:`PeerConnector` looks names up (a seed such as ``gpu-box-3:8087``) with
:class:`viiwork.mesh.lookups.MeshResolver`: on the mesh's own threads, never on the event
loop's default executor, each within a deadline.
"""

from __future__ import annotations

import logging
import ssl
import time
from collections import Counter, OrderedDict
from collections.abc import Callable
from typing import Any

import aiohttp
from aiohttp.client_reqrep import ConnectionKey

from viiwork.mesh.identity import NodeId
from viiwork.mesh.lookups import NAME_LOOKUP_TIMEOUT_S, MeshResolver
from viiwork.mesh.tls import peer_node_id

log = logging.getLogger(__name__)

EXPECTED_NODE_HEADER = "X-Viiwork-Expected-Node"
WARN_EVERY_S = 60.0
_MAX_WARNED = 4096  # addresses remembered for rate-limiting the warning (oldest forgotten)


def expect_node(node_id: NodeId | str) -> dict[str, str]:
    """The request header naming the node a request to a peer is for (never sent: see the
    module doc)."""
    return {EXPECTED_NODE_HEADER: str(node_id)}


class PeerMismatch(aiohttp.ClientConnectorError):
    """The TLS peer at ``address`` is ``presented`` (None: no usable certificate), not the
    ``expected`` node; or (``expected`` None) the request named no node on a connector that
    requires one. Nothing of the request was sent."""

    def __init__(self, key: ConnectionKey, expected: NodeId | None, presented: NodeId | None) -> None:
        self.expected, self.presented = expected, presented
        what = (f"the TLS peer is node {presented or '(no node certificate)'}, not node {expected}"
                if expected is not None else "the request names no expected node (expect_node)")
        super().__init__(key, ConnectionRefusedError(0, what))

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    def __str__(self) -> str:
        return f"{self.address}: {self.strerror}"


class PeerRequest(aiohttp.ClientRequest):
    """An aiohttp request that carries the node it is for (``expected_node``, taken off its
    headers) and keeps connections to different nodes apart in the pool."""

    expected_node: NodeId | None = None

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        values = self.headers.popall(EXPECTED_NODE_HEADER, [])
        if len(set(values)) > 1:
            raise ValueError(f"{EXPECTED_NODE_HEADER} given more than once: {values}")
        self.expected_node = NodeId(values[0]) if values else None

    @property
    def connection_key(self) -> ConnectionKey:
        key = super().connection_key
        if self.expected_node is None:
            return key
        # The pool key field aiohttp uses for nothing but keying (the proxy headers' hash;
        # there is no proxy here). A collision would only make connections share a pool
        # entry: the check in PeerConnector.connect still runs on every reuse.
        return key._replace(proxy_headers_hash=hash(("viiwork-node", self.expected_node)))


class PeerConnector(aiohttp.TCPConnector):
    """A ``TCPConnector`` whose connections are checked against the request's expected node
    (see the module doc); use with ``ClientSession(request_class=PeerRequest)``.

    ``counters``: where ``peer_mismatch`` is counted (the mesh's transport counters);
    ``require_expected``: refuse requests that name no node; ``clock``: monotonic seconds,
    for the warning's rate limit; ``lookup_timeout_s``: a name lookup's deadline
    (:class:`~viiwork.mesh.lookups.MeshResolver`, unless ``resolver`` is given). Other
    arguments go to ``TCPConnector`` (``ssl`` is the mesh client context)."""

    def __init__(self, *, counters: Counter[str] | None = None, require_expected: bool = False,
                 clock: Callable[[], float] = time.monotonic, lookup_timeout_s: float = NAME_LOOKUP_TIMEOUT_S,
                 **kwargs: Any) -> None:
        kwargs.setdefault("resolver", MeshResolver(timeout_s=lookup_timeout_s))
        super().__init__(**kwargs)
        self.counters: Counter[str] = counters if counters is not None else Counter()
        self.require_expected = require_expected
        self._clock = clock
        self._warned: OrderedDict[str, float] = OrderedDict()

    async def connect(self, req: aiohttp.ClientRequest, traces: list[Any],
                      timeout: aiohttp.ClientTimeout) -> aiohttp.connector.Connection:
        expected = getattr(req, "expected_node", None)
        if expected is None and self.require_expected:
            self.counters["peer_unnamed"] += 1
            raise PeerMismatch(req.connection_key, None, None)
        conn = await super().connect(req, traces, timeout)
        if expected is None:
            return conn
        transport = conn.transport
        ssl_object = None if transport is None else transport.get_extra_info("ssl_object")
        try:
            presented = peer_node_id(ssl_object)
        except (ValueError, ssl.SSLError):  # an undecodable certificate names no node
            presented = None
        if presented == expected:
            return conn
        # Not that node: close the connection (it never returns to the pool) before anything
        # of the request is written, and refuse.
        conn.close()
        self.counters["peer_mismatch"] += 1
        error = PeerMismatch(req.connection_key, expected, presented)
        self._warn(error)
        raise error

    def _warn(self, error: PeerMismatch) -> None:
        address, now = error.address, self._clock()
        last = self._warned.get(address)
        if last is None or now - last >= WARN_EVERY_S:
            self._warned[address] = now
            self._warned.move_to_end(address)
            if len(self._warned) > _MAX_WARNED:
                self._warned.popitem(last=False)
            log.warning("mesh: refusing %s: expected node %s, the TLS peer presents node %s (another member's "
                        "certificate on that address?); nothing was sent", address, error.expected,
                        error.presented or "(none)",
                        extra={"peer_address": address, "expected_node": error.expected,
                               "presented_node": error.presented})
        else:
            log.debug("mesh: refusing %s: expected node %s, TLS peer is node %s", address, error.expected,
                      error.presented)


def peer_session_parts(ssl_context: ssl.SSLContext, *, counters: Counter[str] | None = None,
                       require_expected: bool = False, **connector_kwargs: Any) -> dict[str, Any]:
    """``ClientSession`` keyword arguments (``connector``, ``request_class``) for a session
    that dials peers over ``ssl_context`` with the check of this module."""
    connector = PeerConnector(ssl=ssl_context, counters=counters, require_expected=require_expected,
                              **connector_kwargs)
    return {"connector": connector, "request_class": PeerRequest}
