"""Probe mode on the wire: the thin asyncio shell around :class:`~viiwork.mesh.probing.ProbeNode`.

The sans-IO core (:mod:`viiwork.mesh.probing`) decides what to send and when; this module
carries its messages over the **mutual-TLS listener** (docs/mesh.md, "Probe mode on the
wire"), the same one gossip and forwarded requests use, with the same peer checks:

- **One endpoint**, ``POST /mesh/v1/probe``: the body is one message
  (:mod:`viiwork.mesh.probe_codec`: ``ping``, ``ack``, ``ping-req``, ``nack``, ``gossip``,
  ``pull``, or the digest exchange's ``push``); the sender is the node of the verified client
  certificate (:func:`~viiwork.mesh.transport.peer_of`), so probe messages need no signature
  of their own (a claim inside one still carries its signer's). The answer (200) is the
  messages the core addresses back to the sender while handling it, one per line
  (``application/x-ndjson``, possibly none): an ``ack`` to a ``ping``, a ``push`` to a
  ``pull``, a ``pull`` for news it lacks. A ping's round trip is therefore one HTTP request
  on a kept-alive connection. Anything the core sends elsewhere, or later (a relay's ``ack``
  to the node that asked for the ping-req), is a request of its own to that node's
  published mesh address.
- **Dropped and counted**, never raised: a body that does not decode (by reason, as any
  mesh message), a sender over its rate (``rate_limited``; :data:`PROBE_RATE_PER_S` per
  peer, twice that as burst), a body beyond the listener's bound (413, ``oversized``).
- **The client** is one aiohttp session (pooled HTTPS presenting this node's certificate,
  :data:`PROBES_PER_HOST` connections per peer, kept alive :data:`POOL_KEEPALIVE_S`), each
  request bounded by ``timeout_s``; the TLS peer must be the node the address belongs to
  (:mod:`viiwork.mesh.dialing`). At most ``max_in_flight`` requests at once: beyond that a
  message is not sent (``probe_skipped_busy``; the core's timers treat it as lost). A peer
  that answers 404 speaks no probe mode (an older agent, or one in heartbeat mode):
  ``probe_unsupported``, and the core heartbeats for it (:meth:`ProbeNode.heartbeat_only`).
- **Anti-entropy** digests from the core run as the existing digest-first exchange
  (``/mesh/v1/exchange``, :class:`~viiwork.mesh.transport.GossipClient`) through the
  ``exchange`` callback, so seeds and heartbeat-mode peers answer them.

Counters (in the membership's ``transport`` counters): probe_sent, probe_ok, probe_failed,
probe_timeout, probe_refused, probe_unsupported, probe_skipped_busy, probe_unaddressed (a
late reply to a sender this node has no address for), probe_reply_oversized.
"""

from __future__ import annotations

import asyncio
import logging
import ssl
import time
from collections.abc import Callable, Iterable

import aiohttp
from aiohttp import web

from viiwork.mesh.counters import DropReason
from viiwork.mesh.dialing import PeerMismatch, expect_node, peer_session_parts
from viiwork.mesh.identity import NodeId
from viiwork.mesh.lookups import NAME_LOOKUP_TIMEOUT_S
from viiwork.mesh.membership import GossipTarget, Membership
from viiwork.mesh.messages import Digest
from viiwork.mesh.probe_codec import MAX_PROBE_MESSAGE_BYTES, encode_any
from viiwork.mesh.probing import Outgoing, ProbeNode
from viiwork.mesh.ratelimit import PeerRateLimiter
from viiwork.mesh.transport import POOL_KEEPALIVE_S, PeerResponse, peer_of, response_peer

log = logging.getLogger(__name__)

PROBE_PATH = "/mesh/v1/probe"
# A node gets, per peer and second: a ping from it about every n probe intervals, its relays'
# pings, a few gossip messages (3 members every 200 ms while news is queued) and pulls; 100/s
# is an order of magnitude above that at any fleet size, and stops a member that floods.
PROBE_RATE_PER_S = 100.0
PROBES_PER_HOST = 4
MAX_PROBES_IN_FLIGHT = 64
# An answer holds at most a few messages to the sender: an ack, a pull and a push of the
# summaries it asked for (each push bounded by the gossip message bound).
MAX_REPLY_BYTES = 4 * MAX_PROBE_MESSAGE_BYTES


class ProbeTransport:
    """Carries one :class:`ProbeNode`'s messages (module doc). Build it before the listener
    starts (its :meth:`handle` is a route of the listener's application), :meth:`attach`
    the core once this node's publisher exists, then :meth:`start` the client.

    ``exchange(target)``: runs a digest exchange with ``target`` (the node's gossip client);
    ``timeout_s`` / ``connect_timeout_s``: one request's whole deadline and TCP connect."""

    def __init__(self, membership: Membership, ssl_context: ssl.SSLContext, exchange: Callable[[GossipTarget], None],
                 timeout_s: float = 1.0, connect_timeout_s: float = 0.5,
                 max_in_flight: int = MAX_PROBES_IN_FLIGHT, rate_per_s: float = PROBE_RATE_PER_S) -> None:
        self.m = membership
        self.ssl_context = ssl_context
        self.exchange = exchange
        self.timeout_s = timeout_s
        self.connect_timeout_s = connect_timeout_s
        self.max_in_flight = max_in_flight
        self.node: ProbeNode | None = None
        self.counters = membership.counters.transport
        self._limiter = PeerRateLimiter(rate_per_s, 2 * rate_per_s, max_buckets=2 * membership.settings.max_peers)
        self._session: aiohttp.ClientSession | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self._wake = asyncio.Event()

    def attach(self, node: ProbeNode) -> None:
        """The core whose messages this carries (until then the endpoint answers 503)."""
        self.node = node

    async def start(self) -> None:
        parts = peer_session_parts(self.ssl_context, counters=self.counters, limit=256,
                                   limit_per_host=PROBES_PER_HOST, keepalive_timeout=POOL_KEEPALIVE_S,
                                   lookup_timeout_s=min(NAME_LOOKUP_TIMEOUT_S, self.timeout_s / 2))
        timeout = aiohttp.ClientTimeout(total=self.timeout_s, sock_connect=self.connect_timeout_s)
        self._session = aiohttp.ClientSession(**parts, timeout=timeout, raise_for_status=False,
                                              response_class=PeerResponse)

    async def close(self) -> None:
        """Cancel the requests in flight and close the session."""
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)
        if self._session is not None:
            await self._session.close()
            self._session = None

    @property
    def in_flight(self) -> int:
        return len(self._tasks)

    async def wait(self, timeout_s: float) -> None:
        """Sleep up to ``timeout_s``, or until a message arrived (the core may then have new
        deadlines: a relay's, a pull's)."""
        if timeout_s > 0 and not self._wake.is_set():
            # asyncio.wait, not wait_for: Python 3.11's wait_for can lose a cancellation that
            # comes as the event is set, and the loop task then outlived stop() (a hang).
            woken = asyncio.ensure_future(self._wake.wait())
            try:
                await asyncio.wait({woken}, timeout=timeout_s)
            finally:
                woken.cancel()
        self._wake.clear()

    # --- receiving --------------------------------------------------------------------------

    async def handle(self, request: web.Request) -> web.Response:
        """``POST /mesh/v1/probe`` (module doc)."""
        node, sender = self.node, peer_of(request)
        if node is None or sender is None:
            return web.Response(status=503)
        try:
            body = await request.read()
        except web.HTTPRequestEntityTooLarge:
            self.m.counters.drop(DropReason.OVERSIZED)
            return web.Response(status=413)
        except web.RequestPayloadError:
            self.m.counters.drop(DropReason.MALFORMED)
            return web.Response(status=400)
        if not self._limiter.allow(sender, self.m.clock()):
            self.m.counters.messages_in["probe"] += 1
            self.m.counters.drop(DropReason.RATE_LIMITED)
            return web.Response(status=429)
        address = self._address_of(sender)
        out = node.receive_bytes(sender, address, body)
        answer = [data for to, data in out if to == address]
        self._send_bytes((to, data) for to, data in out if to != address)
        self._wake.set()
        return web.Response(body=b"\n".join(answer), content_type="application/x-ndjson")

    def _address_of(self, node_id: NodeId) -> str:
        """The mesh address ``node_id`` publishes ("" when unknown: answers to it then go
        only in the response)."""
        rec = self.m.records.get(node_id)
        return "" if rec is None else rec.summary.payload.mesh

    # --- sending ----------------------------------------------------------------------------

    def send(self, out: Iterable[Outgoing]) -> None:
        """Send what the core returned (:meth:`ProbeNode.poll`, :meth:`ProbeNode.leave`):
        digests as exchanges, everything else as probe requests."""
        node = self.node
        encoded: list[tuple[str, bytes]] = []
        for address, msg in out:
            if isinstance(msg, Digest):
                target = None if node is None else node.sync_target(address)
                if target is not None:
                    self.exchange(target)
                continue
            data = encode_any(msg)
            self.m.counters.bytes_out += len(data)
            encoded.append((address, data))
        self._send_bytes(encoded)

    def _send_bytes(self, out: Iterable[tuple[str, bytes]]) -> None:
        owners: dict[str, NodeId] | None = None
        for address, data in out:
            if not address:
                self.counters["probe_unaddressed"] += 1
                continue
            if len(self._tasks) >= self.max_in_flight:
                self.counters["probe_skipped_busy"] += 1
                continue
            if owners is None:
                owners = {rec.summary.payload.mesh: nid for nid, rec in self.m.records.items()}
            task = asyncio.get_running_loop().create_task(self._post(address, owners.get(address), data))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _post(self, address: str, node_id: NodeId | None, data: bytes) -> None:
        """One message to ``address`` (whose TLS peer must be ``node_id`` when known); the
        answer's messages go to the core, and what it returns is sent in turn."""
        session = self._session
        if session is None or session.closed:  # stopping: the session went first
            return
        headers = {"Content-Type": "application/json"}
        if node_id is not None:
            headers.update(expect_node(node_id))
        self.counters["probe_sent"] += 1
        try:
            started = time.monotonic()
            async with session.post(f"https://{address}{PROBE_PATH}", data=data, headers=headers) as resp:
                peer = response_peer(resp)
                status = resp.status
                body = await _read_bounded(resp.content, MAX_REPLY_BYTES)
            rtt_ms = (time.monotonic() - started) * 1000.0
        except TimeoutError:
            self.counters["probe_timeout"] += 1
            return
        except PeerMismatch:  # counted (peer_mismatch) and logged by the connector
            return
        except (aiohttp.ClientError, OSError, ssl.SSLError) as exc:
            self.counters["probe_failed"] += 1
            log.debug("probe to %s: %s: %s", address, type(exc).__name__, exc)
            return
        except RuntimeError:  # "Session is closed": the node stopped while this one was queued
            return
        if status == 404:  # no probe endpoint there: a heartbeat-mode node (rolling upgrade)
            self.counters["probe_unsupported"] += 1
            speaker = peer or node_id
            if self.node is not None and speaker is not None:
                self.node.heartbeat_only(speaker)
            return
        if status != 200:
            self.counters["probe_refused"] += 1
            return
        if body is None:
            self.counters["probe_reply_oversized"] += 1
            self.m.counters.drop(DropReason.OVERSIZED)
            return
        node = self.node
        if peer is None or node is None:
            return
        self.counters["probe_ok"] += 1
        self.m.note_rtt(peer, rtt_ms)
        replies: list[tuple[str, bytes]] = []
        for line in body.split(b"\n"):
            if line:
                replies += node.receive_bytes(peer, address, line)
        self._send_bytes(replies)
        self._wake.set()


async def _read_bounded(stream: aiohttp.StreamReader, limit: int) -> bytes | None:
    """The whole body, or None once it passes ``limit`` bytes."""
    chunks: list[bytes] = []
    size = 0
    async for chunk in stream.iter_chunked(64 * 1024):
        size += len(chunk)
        if size > limit:
            return None
        chunks.append(chunk)
    return b"".join(chunks)


__all__ = ["MAX_PROBES_IN_FLIGHT", "PROBE_PATH", "PROBE_RATE_PER_S", "ProbeTransport"]
