"""Probe mode on the wire: the thin asyncio shell around :class:`~viiwork.mesh.probing.ProbeNode`.

The sans-IO core (:mod:`viiwork.mesh.probing`) decides what to send and when; this module
carries its messages over the **mutual-TLS listener** (docs/mesh.md, "Probe mode on the
wire"), the same one gossip and forwarded requests use, with the same peer checks, as
frames of a **WebSocket channel** per peer:

- **One endpoint**, ``GET /mesh/v1/probe`` upgraded to a WebSocket: each binary frame is one
  message (:mod:`viiwork.mesh.probe_codec`: ``ping``, ``ack``, ``ping-req``, ``nack``,
  ``gossip``, ``pull``, ``loads`` or the digest exchange's ``push``); the sender is the node of
  the verified client certificate (:func:`~viiwork.mesh.transport.peer_of`), so probe
  messages need no signature of their own (a claim inside one still carries its signer's).
  What the core addresses back to the sender while handling a frame (an ``ack`` to a
  ``ping``, a ``pull`` for news it lacks, the ``loads`` a pull asked for) goes back as frames
  on the same channel; anything it sends elsewhere goes on this node's channel to that node's
  published mesh address. Why frames and not a request per message: a node of a churning
  mesh sends tens of messages a second, and at the same rate a node used 37% less CPU with
  frames than with an HTTPS request each (docs/benchmarks-mesh.md, "Channels against a
  request per message").
- **Dropped and counted**, never raised: a frame that does not decode (by reason, as any
  mesh message), a text frame (``malformed``), a peer over its rate (``rate_limited``;
  :data:`PROBE_RATE_PER_S` frames per peer and second, twice that as burst, on both ends of a
  channel), a frame beyond :data:`~viiwork.mesh.probe_codec.MAX_PROBE_MESSAGE_BYTES`
  (``oversized``: the channel is closed, 1009).
- **No compression**: neither end offers or takes permessage-deflate (aiohttp's default on
  both): its zlib state cost ~107 KiB more per channel (measured on a real node), beyond the
  listener's per-connection bound (docs/security.md), for frames of a few hundred bytes.
- **Channels are bounded**: this node opens at most :data:`MAX_CHANNELS` (the least recently
  used one is closed for a new one), queues at most :data:`CHANNEL_QUEUE` frames on each
  (beyond that a message is not sent: ``probe_skipped_busy``; the core's timers treat it as
  lost, and a frozen peer's channel fills so), closes one idle for :data:`CHANNEL_IDLE_S`,
  and the listener closes a channel that brought nothing for
  :data:`~viiwork.mesh.transport.KEEPALIVE_TIMEOUT_S` (a WebSocket ping counts: a member can
  keep a channel as it can keep any connection alive, within the listener's caps) and one
  whose peer does not read this node's answers within ``timeout_s`` (``channel_stalled``;
  aborted when its closing frame cannot go either). A ping that goes unanswered within its
  timeout (the core's ``on_unanswered``) on a channel that brought nothing for ``timeout_s``
  drops that channel before the next attempt (``channels_reset``; see
  :meth:`ProbeTransport.reset`): a channel that lived through a partition is still
  open after the heal, its TCP connection in retransmission backoff for seconds, and every
  ping written on it missed, so a peer alive again was suspected anew two or three times
  over 5 s after an 8 s cut (found by a newcomer's check). Opening one (TCP, mutual TLS, the
  upgrade) is bounded by ``connect_timeout_s`` and ``timeout_s``; the TLS peer must be the
  node the address belongs to (:mod:`viiwork.mesh.dialing`). Frames queued while a channel
  opens go once it is open; a channel that fails to open or breaks drops what it held
  (``probe_failed``, ``probe_timeout``) and the next message opens a new one.
- **A peer that answers the upgrade with 404** speaks no probe mode (an older agent, or one
  in heartbeat mode): ``probe_unsupported``, and the core heartbeats for it
  (:meth:`ProbeNode.heartbeat_only`).
- **Anti-entropy** digests from the core run as the existing digest-first exchange
  (``/mesh/v1/exchange``, :class:`~viiwork.mesh.transport.GossipClient`) through the
  ``exchange`` callback, so seeds and heartbeat-mode peers answer them.

Counters (in the membership's ``transport`` counters): probe_sent (frames written),
probe_ok (frames received on a channel this node opened), probe_failed, probe_timeout,
probe_refused (an upgrade answered with another status), probe_unsupported,
probe_skipped_busy, channels_reset (a channel dropped after an unanswered ping),
channel_stalled (a channel a peer opened whose answers it did not read
within ``timeout_s``: closed), probe_unaddressed (a reply to a sender this node has no address for,
made outside that sender's channel), channels_opened, channels_closed.

One module (about 440 lines, half of them docstrings) because the two ends of a channel
share one state: the channels this node opened, the ones peers opened, the rate limiter
and the counters are read by both the writing and the answering paths.
"""

from __future__ import annotations

import asyncio
import logging
import ssl
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import aiohttp
from aiohttp import WSCloseCode, web

from viiwork.mesh.counters import DropReason
from viiwork.mesh.dialing import PeerMismatch, expect_node, peer_session_parts
from viiwork.mesh.identity import NodeId
from viiwork.mesh.lookups import NAME_LOOKUP_TIMEOUT_S
from viiwork.mesh.membership import GossipTarget, Membership
from viiwork.mesh.messages import Digest
from viiwork.mesh.probe_codec import MAX_PROBE_MESSAGE_BYTES, encode_any
from viiwork.mesh.probing import Outgoing, ProbeNode
from viiwork.mesh.ratelimit import PeerRateLimiter
from viiwork.mesh.tls import peer_node_id
from viiwork.mesh.transport import KEEPALIVE_TIMEOUT_S, POOL_KEEPALIVE_S, PeerResponse, peer_of

log = logging.getLogger(__name__)

PROBE_PATH = "/mesh/v1/probe"
# Frames a node takes per peer and second: a ping from it about every n probe intervals, its
# relays' pings, a few gossip messages (3 members every 200 ms while news is queued), pulls
# and the records they bring; 100/s is an order of magnitude above that at any fleet size,
# and stops a member that floods.
PROBE_RATE_PER_S = 100.0
# Channels this node opens: a node talks to a few members a second (its probe target, gossip
# targets, relays), so 128 leave every member of a mesh of that size its channel and, above
# it, recycle the least recently used one (the listener takes 1024 connections in all).
MAX_CHANNELS = 128
# Frames waiting on one channel: a few rounds of gossip and answers. More means the peer does
# not read (frozen) or the channel is still opening; a probe's timers then call it lost.
CHANNEL_QUEUE = 64
# A channel idle this long is closed by its opener, before the listener's KEEPALIVE_TIMEOUT_S.
CHANNEL_IDLE_S = POOL_KEEPALIVE_S


class ProbeTransport:
    """Carries one :class:`ProbeNode`'s messages (module doc). Build it before the listener
    starts (its :meth:`handle` is a route of the listener's application), :meth:`attach`
    the core once this node's publisher exists, then :meth:`start` the client.

    ``exchange(target)``: runs a digest exchange with ``target`` (the node's gossip client);
    ``timeout_s`` / ``connect_timeout_s``: opening a channel, whole and its TCP connect."""

    def __init__(self, membership: Membership, ssl_context: ssl.SSLContext, exchange: Callable[[GossipTarget], None],
                 timeout_s: float = 1.0, connect_timeout_s: float = 0.5, max_channels: int = MAX_CHANNELS,
                 rate_per_s: float = PROBE_RATE_PER_S, idle_s: float = CHANNEL_IDLE_S) -> None:
        self.m = membership
        self.ssl_context = ssl_context
        self.exchange = exchange
        self.timeout_s = timeout_s
        self.connect_timeout_s = connect_timeout_s
        self.max_channels = max_channels
        self.idle_s = idle_s
        self.node: ProbeNode | None = None
        self.counters = membership.counters.transport
        self._limiter = PeerRateLimiter(rate_per_s, 2 * rate_per_s, max_buckets=2 * membership.settings.max_peers)
        self._session: aiohttp.ClientSession | None = None
        self._channels: OrderedDict[str, _Channel] = OrderedDict()  # by address, least recently used first
        # The channels peers opened, with their connections (a stalled one is aborted).
        self._served: dict[web.WebSocketResponse, asyncio.Transport | None] = {}
        self._wake = asyncio.Event()
        self._sleeping_until = -float("inf")  # clock ms until which the probe loop sleeps (wait)
        self._closing = False

    def attach(self, node: ProbeNode) -> None:
        """The core whose messages this carries (until then the endpoint answers 503)."""
        self.node = node
        node.on_unanswered.append(self.reset)

    def reset(self, address: str) -> None:
        """A ping to ``address`` went unanswered (module doc): when this node's channel to it
        has brought nothing for ``timeout_s``, the next message opens a new one (counted
        ``channels_reset``); the old one is still read for ``timeout_s`` (a late answer on it
        counts) and then closed, with what it still queues (``probe_dropped``). A channel that
        brought something within ``timeout_s`` is kept: its peer is slow, not cut off, and a
        new connection would only add a handshake to its next answer. No-op without one."""
        channel = self._channels.get(address)
        if channel is None or time.monotonic() - channel.read_at < self.timeout_s:
            return
        del self._channels[address]
        self.counters["channels_reset"] += 1
        if channel.task is not None:
            asyncio.get_running_loop().call_later(self.timeout_s, channel.task.cancel)

    async def start(self) -> None:
        parts = peer_session_parts(self.ssl_context, counters=self.counters, limit=0,
                                   lookup_timeout_s=min(NAME_LOOKUP_TIMEOUT_S, self.timeout_s / 2))
        timeout = aiohttp.ClientTimeout(total=self.timeout_s, sock_connect=self.connect_timeout_s)
        self._session = aiohttp.ClientSession(**parts, timeout=timeout, raise_for_status=False,
                                              response_class=PeerResponse)

    async def close(self) -> None:
        """Close every channel, both ways, and the session."""
        self._closing = True
        tasks = [ch.task for ch in self._channels.values() if ch.task is not None]
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)
        self._channels.clear()
        await asyncio.gather(*(self._close_served(ws, transport, WSCloseCode.GOING_AWAY)
                               for ws, transport in list(self._served.items())))
        if self._session is not None:
            await self._session.close()
            self._session = None

    @property
    def channels(self) -> list[str]:
        """The addresses of the channels this node holds open or opening, least recently used first."""
        return list(self._channels)

    async def wait(self, timeout_s: float) -> None:
        """Sleep up to ``timeout_s``, or until a message arrived (the core may then have new
        deadlines: a relay's, a pull's)."""
        self._sleeping_until = self.m.clock() + timeout_s * 1000.0
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

    async def handle(self, request: web.Request) -> web.StreamResponse:
        """``GET /mesh/v1/probe`` (module doc): the channel a peer opened to this node."""
        node, sender = self.node, peer_of(request)
        if node is None or sender is None or self._closing:
            return web.Response(status=503)
        ws = web.WebSocketResponse(max_msg_size=MAX_PROBE_MESSAGE_BYTES, autoping=True, compress=False)
        if not ws.can_prepare(request).ok:
            self.m.counters.drop(DropReason.MALFORMED)
            return web.Response(status=400, text="a WebSocket upgrade")
        await ws.prepare(request)
        transport = request.transport
        self._served[ws] = transport
        try:
            while not ws.closed:
                try:
                    msg = await ws.receive(timeout=KEEPALIVE_TIMEOUT_S)
                except TimeoutError:  # a channel idle this long: its opener closes one sooner
                    break
                if msg.type in _CLOSING:
                    self._closed_by_peer(msg)
                    break
                address = self._address_of(sender)
                back = self._frame(sender, address, msg)
                try:
                    async with asyncio.timeout(self.timeout_s):
                        for data in back:
                            await ws.send_bytes(data)
                            self.counters["probe_sent"] += 1
                except TimeoutError:  # the peer reads nothing (frozen, or never meant to)
                    self.counters["channel_stalled"] += 1
                    break
                except ConnectionError:  # gone while answered
                    break
        finally:
            self._served.pop(ws, None)
            await self._close_served(ws, transport)
        return ws

    async def _close_served(self, ws: web.WebSocketResponse, transport: asyncio.Transport | None,
                            code: int = WSCloseCode.OK) -> None:
        """Close a channel a peer opened; one whose peer does not read its closing frame
        within ``timeout_s`` (its writes wait for room that never comes) is aborted, so a
        member that stops reading holds neither the channel nor this node's stop."""
        try:
            async with asyncio.timeout(self.timeout_s):
                await ws.close(code=code)
        except TimeoutError:
            if transport is not None:
                transport.abort()
        except ConnectionError:
            pass

    def _frame(self, sender: NodeId, address: str, msg: aiohttp.WSMessage) -> list[bytes]:
        """One frame from ``sender`` to the core: the answers for ``sender`` (the rest sent)."""
        node = self.node
        if node is None:
            return []
        if msg.type != aiohttp.WSMsgType.BINARY:
            self.m.counters.messages_in["probe"] += 1
            self.m.counters.drop(DropReason.MALFORMED)
            return []
        if not self._limiter.allow(sender, self.m.clock()):
            self.m.counters.messages_in["probe"] += 1
            self.m.counters.drop(DropReason.RATE_LIMITED)
            return []
        out = node.receive_bytes(sender, address, msg.data)
        self._send_bytes((to, data) for to, data in out if to != address)
        if node.next_wakeup() < self._sleeping_until:  # a new deadline before the loop wakes: bring it forward
            self._wake.set()
        return [data for to, data in out if to == address]

    def _closed_by_peer(self, msg: aiohttp.WSMessage) -> None:
        """A channel's end: a frame over the bound (aiohttp closed it with 1009) is counted."""
        if msg.type == aiohttp.WSMsgType.ERROR and getattr(msg.data, "code", None) == WSCloseCode.MESSAGE_TOO_BIG:
            self.m.counters.drop(DropReason.OVERSIZED)

    def _address_of(self, node_id: NodeId) -> str:
        """The mesh address ``node_id`` publishes ("" when unknown: answers to it then go
        only on its own channel)."""
        rec = self.m.records.get(node_id)
        return "" if rec is None else rec.summary.payload.mesh

    # --- sending ----------------------------------------------------------------------------

    def send(self, out: Iterable[Outgoing]) -> None:
        """Send what the core returned (:meth:`ProbeNode.poll`, :meth:`ProbeNode.leave`):
        digests as exchanges, everything else as frames."""
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
            self.m.counters.messages_out[type(msg).__name__.lower()] += 1
            encoded.append((address, data))
        self._send_bytes(encoded)

    def _send_bytes(self, out: Iterable[tuple[str, bytes]]) -> None:
        if self._closing:
            return
        owners: dict[str, NodeId] | None = None
        for address, data in out:
            if not address:
                self.counters["probe_unaddressed"] += 1
                continue
            channel = self._channels.get(address)
            if channel is None:
                if owners is None:
                    owners = {rec.summary.payload.mesh: nid for nid, rec in self.m.records.items()}
                channel = self._open(address, owners.get(address))
            else:
                self._channels.move_to_end(address)
            if len(channel.queue) >= CHANNEL_QUEUE:
                self.counters["probe_skipped_busy"] += 1
                continue
            channel.queue.append(data)
            channel.ready.set()

    def _open(self, address: str, node_id: NodeId | None) -> _Channel:
        while len(self._channels) >= self.max_channels:  # the least recently used one goes
            _, old = self._channels.popitem(last=False)
            if old.task is not None:
                old.task.cancel()
        channel = _Channel(address, node_id)
        self._channels[address] = channel
        channel.task = asyncio.get_running_loop().create_task(self._run(channel))
        return channel

    async def _run(self, channel: _Channel) -> None:
        """Open ``channel``, write its queue as frames until it is idle for ``idle_s`` or
        breaks, read the peer's answers meanwhile; then forget it."""
        ws: aiohttp.ClientWebSocketResponse | None = None
        reader: asyncio.Task[None] | None = None
        try:
            ws = await self._connect(channel)
            if ws is None:
                return
            self.counters["channels_opened"] += 1
            peer = _tls_peer(ws)
            reader = asyncio.get_running_loop().create_task(self._read(channel, ws, peer))
            reader.add_done_callback(lambda _: channel.ready.set())  # a closed channel wakes its writer
            while not ws.closed and not reader.done():
                while channel.queue and not ws.closed:
                    await ws.send_bytes(channel.queue.popleft())
                    self.counters["probe_sent"] += 1
                if channel.queue or ws.closed or reader.done():
                    break
                channel.ready.clear()
                try:
                    async with asyncio.timeout(self.idle_s):
                        await channel.ready.wait()
                except TimeoutError:  # idle
                    break
        except (aiohttp.ClientError, OSError, ssl.SSLError, RuntimeError) as exc:
            # RuntimeError: the session closed under a channel while the node stopped
            self.counters["probe_failed"] += 1
            log.debug("probe channel to %s: %s: %s", channel.address, type(exc).__name__, exc)
        finally:
            if self._channels.get(channel.address) is channel:  # first: a frame sent now opens a new one
                del self._channels[channel.address]
            if channel.queue:  # queued and never written: lost (the core's timers expect losses)
                self.counters["probe_dropped"] += len(channel.queue)
                channel.queue.clear()
            if reader is not None:
                reader.cancel()
            if ws is not None:
                await asyncio.shield(ws.close())
                self.counters["channels_closed"] += 1

    async def _connect(self, channel: _Channel) -> aiohttp.ClientWebSocketResponse | None:
        """The channel's WebSocket, or None (counted) when it cannot be opened."""
        session = self._session
        if session is None or session.closed:  # stopping: the session went first
            return None
        headers = {} if channel.node_id is None else expect_node(channel.node_id)
        try:
            return await session.ws_connect(f"https://{channel.address}{PROBE_PATH}", headers=headers,
                                            max_msg_size=MAX_PROBE_MESSAGE_BYTES, autoping=True, compress=0)
        except TimeoutError:
            self.counters["probe_timeout"] += 1
        except PeerMismatch:  # counted (peer_mismatch) and logged by the connector
            pass
        except aiohttp.WSServerHandshakeError as exc:
            if exc.status != 404:
                self.counters["probe_refused"] += 1
            else:  # no probe endpoint there: a heartbeat-mode node (rolling upgrade)
                self.counters["probe_unsupported"] += 1
                if self.node is not None and channel.node_id is not None:
                    self.node.heartbeat_only(channel.node_id)
        except (aiohttp.ClientError, OSError, ssl.SSLError) as exc:
            self.counters["probe_failed"] += 1
            log.debug("probe channel to %s: %s: %s", channel.address, type(exc).__name__, exc)
        except RuntimeError:  # "Session is closed": the node stopped while this one was queued
            pass
        return None

    async def _read(self, channel: _Channel, ws: aiohttp.ClientWebSocketResponse, peer: NodeId | None) -> None:
        """The peer's frames on a channel this node opened (answers) to the core."""
        while True:
            msg = await ws.receive()
            if msg.type in _CLOSING:
                self._closed_by_peer(msg)
                return
            if peer is None:
                continue
            self.counters["probe_ok"] += 1
            channel.read_at = time.monotonic()
            for data in self._frame(peer, channel.address, msg):
                self._send_bytes([(channel.address, data)])


@dataclass(eq=False)
class _Channel:
    """This node's channel to ``address`` (whose TLS peer must be ``node_id`` when known)."""

    address: str
    node_id: NodeId | None
    queue: deque[bytes] = field(default_factory=deque)
    ready: asyncio.Event = field(default_factory=asyncio.Event)
    task: asyncio.Task[None] | None = None
    read_at: float = field(default_factory=time.monotonic)  # when it last brought a frame (or opened)


_CLOSING = (aiohttp.WSMsgType.CLOSE, aiohttp.WSMsgType.CLOSING, aiohttp.WSMsgType.CLOSED, aiohttp.WSMsgType.ERROR)


def _tls_peer(ws: aiohttp.ClientWebSocketResponse) -> NodeId | None:
    try:
        return peer_node_id(ws.get_extra_info("ssl_object"))
    except (ValueError, ssl.SSLError):  # an undecodable certificate names no node
        return None


__all__ = ["CHANNEL_IDLE_S", "CHANNEL_QUEUE", "MAX_CHANNELS", "PROBE_PATH", "PROBE_RATE_PER_S", "ProbeTransport"]
