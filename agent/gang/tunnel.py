"""The gang tunnel: llama.cpp RPC carried over the mesh's mutual TLS between a gang's hosts.

One module (about 400 lines) because its two ends are the two halves of one wire: the
entry's records are what the exit parses, and both share the splice, the bounds and the
refusal counts; apart, the framing and its limits would drift.

``rpc-server`` (ggml's RPC backend) has no authentication and no encryption, and anyone who
reaches its port can make it allocate buffers, read and write them and run graphs; it has
had memory-safety bugs in that path (docs/security.md, "Multi-host gangs"). So a gang's
rpc-server listens on 127.0.0.1 only, and the agents carry its stream:

    head host                                           worker host
    llama-server --rpc 127.0.0.1:E  ->  TunnelEntry  ==mTLS==>  TunnelExit  ->  127.0.0.1:R
                                        (loopback:E)            (mesh address:X)  rpc-server

- :class:`TunnelExit` (worker side, one per gang part) listens on the worker's mesh address.
  Every connection must complete a TLS 1.3 handshake (the worker's node certificate; a client
  certificate is required: :func:`viiwork.agent.gang.tunnel_cert.exit_context`) and the
  client's certificate must be, byte for byte, the gang's tunnel certificate that the head
  sent in its start request over the mesh's mutual TLS (agent/gang/tunnel_cert.py: the head's
  end runs as a process of its own, without the node's mesh key). Only then is the stream
  spliced to ``127.0.0.1:<rpc_port>``: the target host is not a parameter, and the port is
  fixed when the exit is made, so the head can reach that one rpc-server and nothing else
  (no preamble names a target).
- :class:`TunnelEntry` (head side, one per worker) listens on 127.0.0.1 only; llama-server's
  ``--rpc 127.0.0.1:<entry port>`` connects there, and each connection is carried over a new
  mutual-TLS connection to the worker's exit, whose certificate must be, byte for byte, the
  worker's tunnel certificate of this gang (sent by the worker's agent to the head's over the
  mesh), before a byte is sent.

Why a listener of its own and not a route on the mesh's aiohttp listener: the RPC stream is
a long-lived raw byte stream, and aiohttp hands a handler a request, not its socket; a
WebSocket would frame and copy every message. Each end trusts exactly the other end's
certificate of the gang, which the two agents swapped over the mesh's mutual TLS
(agent/gang/tunnel_cert.py): one port per gang part, and no trust beyond the mesh's.

**Framing.** asyncio's TLS transport cannot half-close (``write_eof`` is unsupported: a TLS
close_notify closes the whole connection there), yet a stream protocol may rely on one side
finishing while the other still answers. So inside TLS the stream is carried as records: a
4-byte big-endian length then that many bytes (1 to :data:`MAX_RECORD_BYTES`); a record of
length 0 says the sender's half is finished, and the receiver half-closes its plain TCP side
(``write_eof``). The TLS connection closes once both halves are finished. A length above the
bound is a protocol error (``malformed``): both sides are aborted.

**Back-pressure.** Each direction reads at most :data:`MAX_RECORD_BYTES` and writes it before
reading again, waiting in ``drain()`` while the other side's transport is above its high-water
mark; nothing is buffered beyond the stream reader's limit and the transports' write
buffers, so a slow reader slows the writer on the other host instead of filling memory.

**Bounds and counts.** At most ``max_connections`` connections at once per tunnel (llama.cpp
keeps one per RPC device; a pending handshake counts), beyond it a connection is closed at
accept; of these, at most a quarter from elsewhere than the other end's known address (an
exit: the head's gang address), so that idle connections, which need no certificate to be
accepted, cannot lock the head out. A handshake has ``handshake_timeout_s``. Every refusal increments one reason in
:attr:`TunnelCounters.refused` (:class:`Refusal`), logged at WARNING once per reason, then
DEBUG: a wrong peer never stops the agent.
"""

from __future__ import annotations

import abc
import asyncio
import contextlib
import logging
import ssl
import struct
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from viiwork.mesh.identity import NodeId
from viiwork.mesh.tls import peer_node_id

log = logging.getLogger(__name__)

#: Where an exit delivers, and where an entry listens: loopback only (module doc).
LOOPBACK = "127.0.0.1"
#: The largest record payload, and the most read from a socket before it is written on.
MAX_RECORD_BYTES = 64 * 1024
HANDSHAKE_TIMEOUT_S = 5.0
CONNECT_TIMEOUT_S = 5.0
#: llama.cpp opens one connection per ``--rpc`` endpoint (and briefly a second while it
#: queries a device); 16 leave room for restarts while a dead connection closes.
MAX_CONNECTIONS = 16
_HEADER = struct.Struct("!I")


class Refusal(str, Enum):
    """Why a tunnel connection was refused or cut (one count each, :class:`TunnelCounters`).

    - ``handshake_failed``: the TLS handshake failed (plain TCP, garbage, no client
      certificate, another CA's, an expired one) or timed out.
    - ``wrong_node``: the peer's certificate is not the gang's tunnel certificate (exit: a
      mesh member's, for one) or not the worker's (entry).
    - ``too_many_connections``: ``max_connections`` were open; closed at accept.
    - ``target_unreachable``: exit side: nothing accepts on ``127.0.0.1:<rpc_port>``.
    - ``peer_unreachable``: entry side: the worker's exit could not be reached.
    - ``malformed``: a record length above :data:`MAX_RECORD_BYTES`.
    """

    HANDSHAKE_FAILED = "handshake_failed"
    WRONG_NODE = "wrong_node"
    TOO_MANY_CONNECTIONS = "too_many_connections"
    TARGET_UNREACHABLE = "target_unreachable"
    PEER_UNREACHABLE = "peer_unreachable"
    MALFORMED = "malformed"


@dataclass
class TunnelCounters:
    """One tunnel end's counts (the event loop owns them). Bytes are the carried stream's
    payload, not TLS overhead: ``bytes_out`` sent toward the other host, ``bytes_in``
    received from it."""

    connections_open: int = 0
    connections_total: int = 0  # spliced (past every check)
    bytes_in: int = 0
    bytes_out: int = 0
    refused: Counter[str] = field(default_factory=Counter)

    def as_dict(self) -> dict[str, Any]:
        """A JSON-ready copy, every refusal reason listed (zeros included)."""
        refused = {r.value: 0 for r in Refusal}
        refused.update(self.refused)
        return {"connections_open": self.connections_open, "connections_total": self.connections_total,
                "bytes_in": self.bytes_in, "bytes_out": self.bytes_out, "refused": refused}


    @classmethod
    def from_dict(cls, doc: dict[str, Any]) -> TunnelCounters:
        """The counters :meth:`as_dict` wrote (a tunnel process's file: agent/gang/tunnel_process.py);
        a value of the wrong type reads as 0."""
        def count(value: object) -> int:
            return value if type(value) is int and value >= 0 else 0

        refused = doc.get("refused")
        return cls(count(doc.get("connections_open")), count(doc.get("connections_total")), count(doc.get("bytes_in")),
                   count(doc.get("bytes_out")),
                   Counter({r.value: count(refused.get(r.value)) for r in Refusal} if isinstance(refused, dict) else {}))


@dataclass(frozen=True)
class TunnelEndView:
    """A tunnel end's counters as read from elsewhere (a tunnel process's file), for
    :func:`metric_families` beside the ends of this process."""

    gang: str
    role: str
    counters: TunnelCounters


class _Unframed(Exception):
    """A record length above the bound."""


class _End(abc.ABC):
    """What an entry and an exit share: the loopback-or-TLS listener, the connection cap,
    the counters, the splice. Each end serves an accepted connection its own way
    (:meth:`_serve`)."""

    role = ""

    def __init__(self, *, gang: str, max_connections: int, handshake_timeout_s: float,
                 connect_timeout_s: float) -> None:
        self.gang = gang
        self.max_connections = max_connections
        self.handshake_timeout_s = handshake_timeout_s
        self.connect_timeout_s = connect_timeout_s
        self.counters = TunnelCounters()
        self._server: asyncio.Server | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self._held = 0  # connections accepted and not yet closed (pending handshakes included)
        self._held_others = 0  # of which from elsewhere than ``peer_host``
        #: The address the other end's connections come from (an exit: the head's), when known.
        self.peer_host: str | None = None
        self.max_others = max(1, max_connections // 4)
        self._warned: set[str] = set()

    @property
    def port(self) -> int:
        """The bound port (after :meth:`start`)."""
        assert self._server is not None and self._server.sockets, "call start() first"
        return int(self._server.sockets[0].getsockname()[1])

    async def _listen(self, host: str, port: int) -> None:
        self._server = await asyncio.start_server(self._accepted, host, port, limit=MAX_RECORD_BYTES)

    async def stop(self) -> None:
        """Stop listening and cut every carried connection."""
        if self._server is not None:
            self._server.close()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._server is not None:
            await self._server.wait_closed()

    async def __aenter__(self) -> _End:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    def _refuse(self, reason: Refusal, detail: str) -> None:
        self.counters.refused[reason.value] += 1
        level = logging.DEBUG if reason.value in self._warned else logging.WARNING
        self._warned.add(reason.value)
        log.log(level, "gang %s tunnel %s: refused (%s): %s", self.gang, self.role, reason.value, detail,
                extra={"gang": self.gang, "refusal": reason.value})

    def _accepted(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        # A connection from elsewhere than the expected peer's address holds one of at most
        # ``max_others`` slots: idle connections from anyone who reaches the port (they need no
        # certificate to be accepted) cannot take the peer's own.
        other = self.peer_host is not None and _peer_address(writer).rpartition(":")[0] != self.peer_host
        if self._held >= self.max_connections or (other and self._held_others >= self.max_others):
            self._refuse(Refusal.TOO_MANY_CONNECTIONS, f"{self._held} open, {self._held_others} from elsewhere "
                                                       f"than {self.peer_host}")
            writer.transport.abort()
            return
        self._held += 1
        self._held_others += other
        task = asyncio.get_running_loop().create_task(self._run(reader, writer))
        self._tasks.add(task)
        task.add_done_callback(lambda t: self._done(t, other))

    def _done(self, task: asyncio.Task[None], other: bool) -> None:
        self._tasks.discard(task)
        self._held -= 1
        self._held_others -= other

    async def _run(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            await self._serve(reader, writer)
        finally:  # cancelled (stop) or failed before the splice: cut the accepted connection
            if not writer.transport.is_closing():
                writer.transport.abort()

    @abc.abstractmethod
    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """One accepted connection: the exit checks the head and dials rpc-server, the entry
        dials the exit; both then splice."""

    async def _splice(self, plain: tuple[asyncio.StreamReader, asyncio.StreamWriter],
                      tls: tuple[asyncio.StreamReader, asyncio.StreamWriter]) -> None:
        """Carry bytes both ways until both halves are finished, then close both sides; on an
        error or a cancellation abort both."""
        counters = self.counters
        counters.connections_open += 1
        counters.connections_total += 1
        to_tls = asyncio.ensure_future(_plain_to_records(plain[0], tls[1], counters))
        to_plain = asyncio.ensure_future(_records_to_plain(tls[0], plain[1], counters))
        clean = False
        try:
            done, _ = await asyncio.wait((to_tls, to_plain), return_when=asyncio.FIRST_EXCEPTION)
            errors = [t.exception() for t in done if t.exception() is not None]
            if errors:
                if isinstance(errors[0], _Unframed):
                    self._refuse(Refusal.MALFORMED, str(errors[0]))
                else:
                    log.debug("gang %s tunnel %s: connection cut: %r", self.gang, self.role, errors[0])
            else:
                clean = True
        finally:
            counters.connections_open -= 1
            for task in (to_tls, to_plain):
                task.cancel()
            await asyncio.gather(to_tls, to_plain, return_exceptions=True)
            for _, writer in (plain, tls):
                await _close(writer, abort=not clean)


async def _plain_to_records(reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                            counters: TunnelCounters) -> None:
    """Read the plain side until EOF; write each chunk as a record, then the empty record."""
    while True:
        # read() returns what the reader holds, at most MAX_RECORD_BYTES, waiting only when
        # it holds nothing: small RPC messages are not delayed to fill a record.
        chunk = await reader.read(MAX_RECORD_BYTES)
        writer.write(_HEADER.pack(len(chunk)) + chunk)
        if not chunk:
            await writer.drain()
            return
        counters.bytes_out += len(chunk)
        await writer.drain()  # back-pressure: wait while the TLS side's buffer is full


async def _records_to_plain(reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                            counters: TunnelCounters) -> None:
    """Read records until the empty one; write their payload to the plain side, then
    half-close it (``write_eof``)."""
    while True:
        (length,) = _HEADER.unpack(await reader.readexactly(_HEADER.size))
        if length == 0:
            if writer.can_write_eof():
                writer.write_eof()
            return
        if length > MAX_RECORD_BYTES:
            raise _Unframed(f"record of {length} bytes (at most {MAX_RECORD_BYTES})")
        payload = await reader.readexactly(length)
        counters.bytes_in += length
        writer.write(payload)
        await writer.drain()


async def _close(writer: asyncio.StreamWriter, *, abort: bool = False) -> None:
    if abort:
        writer.transport.abort()
        return
    writer.close()
    with contextlib.suppress(OSError, ssl.SSLError, TimeoutError, ConnectionError):
        async with asyncio.timeout(HANDSHAKE_TIMEOUT_S):
            await writer.wait_closed()


def _peer_address(writer: asyncio.StreamWriter) -> str:
    peer = writer.get_extra_info("peername")
    return f"{peer[0]}:{peer[1]}" if isinstance(peer, tuple) else str(peer)


class TunnelExit(_End):
    """Worker side of one gang part: a mutual-TLS listener on ``listen_host:listen_port``
    (0: a free port, see :attr:`port`) that admits only a client presenting ``client_cert``
    (DER: the gang's tunnel certificate from the head ``head``) and splices each admitted
    connection to ``127.0.0.1:rpc_port`` (the part's rpc-server; the host is fixed).

    ``ssl_context``: :func:`viiwork.agent.gang.tunnel_cert.exit_context`.
    Refusals are counted (:class:`Refusal`), never raised.
    """

    role = "exit"

    def __init__(self, *, gang: str, head: NodeId, client_cert: bytes, rpc_port: int, ssl_context: ssl.SSLContext,
                 listen_host: str, listen_port: int = 0, max_connections: int = MAX_CONNECTIONS,
                 handshake_timeout_s: float = HANDSHAKE_TIMEOUT_S, connect_timeout_s: float = CONNECT_TIMEOUT_S,
                 head_host: str | None = None) -> None:
        if ssl_context.verify_mode != ssl.CERT_REQUIRED:
            raise ValueError("the tunnel exit needs a context that requires a client certificate "
                             "(viiwork.agent.gang.tunnel_cert.exit_context)")
        if not client_cert:
            raise ValueError("the tunnel exit needs the gang's tunnel certificate (DER)")
        super().__init__(gang=gang, max_connections=max_connections, handshake_timeout_s=handshake_timeout_s,
                         connect_timeout_s=connect_timeout_s)
        self.head, self.client_cert, self.rpc_port = head, client_cert, rpc_port
        self.peer_host = head_host
        self.ssl_context = ssl_context
        self.listen_host, self.listen_port = listen_host, listen_port

    async def start(self) -> TunnelExit:
        """Bind the listener; returns self. Raises OSError when the address is taken."""
        await self._listen(self.listen_host, self.listen_port)
        return self

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        address = _peer_address(writer)
        try:
            await writer.start_tls(self.ssl_context, ssl_handshake_timeout=self.handshake_timeout_s)
        except (TimeoutError, ssl.SSLError, OSError, ConnectionError) as exc:
            self._refuse(Refusal.HANDSHAKE_FAILED, f"{address}: {exc!r}")
            exc.__traceback__ = None  # the frames hold asyncio's TLS buffers in a cycle (mesh/transport.py)
            await _close(writer, abort=True)
            return
        ssl_object = writer.get_extra_info("ssl_object")
        if ssl_object is None or ssl_object.getpeercert(binary_form=True) != self.client_cert:
            presented = peer_node_id(ssl_object)
            self._refuse(Refusal.WRONG_NODE, f"{address} presented "
                                             + (f"node {presented}'s certificate" if presented else "another certificate")
                                             + f", not gang {self.gang}'s tunnel certificate (head {self.head})")
            await _close(writer, abort=True)
            return
        try:
            async with asyncio.timeout(self.connect_timeout_s):
                target = await asyncio.open_connection(LOOPBACK, self.rpc_port, limit=MAX_RECORD_BYTES)
        except (OSError, TimeoutError) as exc:
            self._refuse(Refusal.TARGET_UNREACHABLE, f"{LOOPBACK}:{self.rpc_port}: {exc!r}")
            await _close(writer, abort=True)
            return
        await self._splice(target, (reader, writer))


class TunnelEntry(_End):
    """Head side, one per worker: a listener on ``127.0.0.1:listen_port`` (0: a free port,
    see :attr:`port`; llama-server's ``--rpc 127.0.0.1:<port>``) whose every connection is
    carried over a new mutual-TLS connection to ``worker_host:worker_port`` (the worker's
    :class:`TunnelExit`), whose certificate must be ``server_cert`` (DER: the worker
    ``worker``'s tunnel certificate of this gang).

    ``ssl_context``: :func:`viiwork.agent.gang.tunnel_cert.entry_context`.
    A worker that cannot be reached, or is another node, closes the local connection
    (llama-server then fails to load, and the gang restarts: the agent's concern).
    """

    role = "entry"

    def __init__(self, *, gang: str, worker: NodeId, server_cert: bytes, worker_host: str, worker_port: int,
                 ssl_context: ssl.SSLContext, listen_port: int = 0, max_connections: int = MAX_CONNECTIONS,
                 handshake_timeout_s: float = HANDSHAKE_TIMEOUT_S, connect_timeout_s: float = CONNECT_TIMEOUT_S) -> None:
        if not server_cert:
            raise ValueError("the tunnel entry needs the worker's tunnel certificate (DER)")
        super().__init__(gang=gang, max_connections=max_connections, handshake_timeout_s=handshake_timeout_s,
                         connect_timeout_s=connect_timeout_s)
        self.worker, self.server_cert = worker, server_cert
        self.worker_host, self.worker_port = worker_host, worker_port
        self.ssl_context = ssl_context
        self.listen_port = listen_port

    async def start(self) -> TunnelEntry:
        """Bind the loopback listener; returns self. Raises OSError when the port is taken."""
        await self._listen(LOOPBACK, self.listen_port)
        return self

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        where = f"{self.worker_host}:{self.worker_port}"
        try:
            async with asyncio.timeout(self.connect_timeout_s + self.handshake_timeout_s):
                remote = await asyncio.open_connection(
                    self.worker_host, self.worker_port, ssl=self.ssl_context, server_hostname="",
                    ssl_handshake_timeout=self.handshake_timeout_s, limit=MAX_RECORD_BYTES)
        except (OSError, TimeoutError, ssl.SSLError) as exc:
            self._refuse(Refusal.PEER_UNREACHABLE, f"{where}: {exc!r}")
            await _close(writer, abort=True)
            return
        ssl_object = remote[1].get_extra_info("ssl_object")
        if ssl_object is None or ssl_object.getpeercert(binary_form=True) != self.server_cert:
            self._refuse(Refusal.WRONG_NODE, f"{where} did not present gang {self.gang}'s tunnel certificate "
                                             f"of worker {self.worker}")
            await _close(remote[1], abort=True)
            await _close(writer, abort=True)
            return
        await self._splice((reader, writer), remote)


def metric_families(ends: Iterable[TunnelEntry | TunnelExit | TunnelEndView]) -> list[GaugeMetricFamily | CounterMetricFamily]:
    """Prometheus families for tunnel ends (a ``MetricSource`` of agent/serving/metrics.py),
    labelled by gang and role (entry, exit): ``viiwork_gang_tunnel_connections_open`` (now),
    ``viiwork_gang_tunnel_connections_total`` (spliced), ``viiwork_gang_tunnel_bytes_total``
    (payload, by direction in/out) and ``viiwork_gang_tunnel_refused_total`` (by reason)."""
    open_now = GaugeMetricFamily("viiwork_gang_tunnel_connections_open", "Connections carried by a gang tunnel end now.",
                                 labels=["gang", "role"])
    total = CounterMetricFamily("viiwork_gang_tunnel_connections", "Connections a gang tunnel end has carried "
                                "(past every check).", labels=["gang", "role"])
    carried = CounterMetricFamily("viiwork_gang_tunnel_bytes", "Payload bytes carried by a gang tunnel end, by "
                                  "direction (out: toward the other host).", labels=["gang", "role", "direction"])
    refused = CounterMetricFamily("viiwork_gang_tunnel_refused", "Connections a gang tunnel end refused or cut, "
                                  "by reason.", labels=["gang", "role", "reason"])
    for end in ends:
        c = end.counters
        open_now.add_metric([end.gang, end.role], c.connections_open)
        total.add_metric([end.gang, end.role], c.connections_total)
        carried.add_metric([end.gang, end.role, "in"], c.bytes_in)
        carried.add_metric([end.gang, end.role, "out"], c.bytes_out)
        for reason in Refusal:
            refused.add_metric([end.gang, end.role, reason.value], c.refused[reason.value])
    return [open_now, total, carried, refused]
