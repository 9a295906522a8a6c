"""The gang tunnel (agent/gang/tunnel.py) on loopback with real mesh certificates and a real
gang tunnel credential (agent/gang/tunnel_cert.py): the stream both ways intact (a large
transfer, half-close, either side closing), the gang's tunnel certificate the only one the
exit admits (a mesh member's, even the head node's own, refused), plain TCP and garbage
refused and counted, and the exit delivering to 127.0.0.1 only."""

from __future__ import annotations

import asyncio
import errno
import hashlib
import os
import ssl
import struct
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path

import pytest

from support.mesh_nodes import enrol, make_ca, wait_for
from viiwork.agent.gang.tunnel import MAX_RECORD_BYTES, TunnelEntry, TunnelExit, metric_families
from viiwork.agent.gang.tunnel_cert import entry_context, exit_context, make_credential, pinned_der, write_peer
from viiwork.mesh import tls
from viiwork.mesh.identity import NodeId, load_or_create_identity

pytestmark = pytest.mark.timeout(60)


@dataclass
class Node:
    node_id: NodeId
    server: ssl.SSLContext
    client: ssl.SSLContext


PINNED: dict[str, bytes] = {}


@pytest.fixture(scope="module")
def nodes(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Node]:
    """head-node, worker-node and stranger: three nodes enrolled in one mesh CA (their mesh
    contexts); ``head`` and ``worker``: the two ends of gang g1's tunnel, each with its own
    credential and the other's certificate pinned, as the agents make them
    (agent/gang/tunnel_cert.py)."""
    root = tmp_path_factory.mktemp("gang-mesh")
    ca = make_ca(root / "ca")
    ca_pem = (ca / "ca.crt").read_bytes()
    out = {}
    for name in ("head-node", "worker-node", "stranger"):
        state = root / name
        cert = enrol(state, ca, name)
        out[name] = Node(load_or_create_identity(state).node_id,
                         tls.server_context(cert, state / "node.key", ca_pem),
                         tls.client_context(cert, state / "node.key", ca_pem))
    head_dir, worker_dir = root / "h" / "big-gang-tunnel", root / "w" / "big-gang-tunnel"
    head_pem = make_credential(head_dir, "g1", None)
    worker_pem = make_credential(worker_dir, "g1", None)
    PINNED["head"], PINNED["worker"] = pinned_der(head_pem), pinned_der(worker_pem)
    head_peer = write_peer(head_dir, "r1", worker_pem, None)
    worker_peer = write_peer(worker_dir, "head", head_pem, None)
    out["head"] = Node(out["head-node"].node_id, out["head-node"].server, entry_context(head_dir, head_peer))
    out["worker"] = Node(out["worker-node"].node_id, exit_context(worker_dir, worker_peer),
                         out["worker-node"].client)
    return out


class Target:
    """A stand-in for rpc-server on ``host`` (a remote party): runs ``behaviour`` on each
    connection and records who connected."""

    def __init__(self, behaviour: Callable[[asyncio.StreamReader, asyncio.StreamWriter], object]) -> None:
        self.behaviour = behaviour
        self.connections = 0
        self.server: asyncio.Server | None = None

    async def start(self, host: str = "127.0.0.1", port: int = 0) -> Target:
        async def accepted(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            self.connections += 1
            try:
                await self.behaviour(reader, writer)  # type: ignore[misc]
            finally:
                writer.close()

        self.server = await asyncio.start_server(accepted, host, port)
        return self

    @property
    def port(self) -> int:
        assert self.server is not None
        return int(self.server.sockets[0].getsockname()[1])

    async def stop(self) -> None:
        assert self.server is not None
        self.server.close()
        await self.server.wait_closed()


async def echo(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    while chunk := await reader.read(65536):
        writer.write(chunk)
        await writer.drain()


async def digest_after_eof(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """Read to EOF (the client's half-close), then answer the sha256 of what came."""
    data = await reader.read()
    writer.write(hashlib.sha256(data).digest() + len(data).to_bytes(8, "big"))
    await writer.drain()


@dataclass
class Tunnel:
    target: Target
    exit: TunnelExit
    entry: TunnelEntry

    async def open(self) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        return await asyncio.open_connection("127.0.0.1", self.entry.port)


@pytest.fixture
async def make_tunnel(nodes: dict[str, Node]) -> AsyncIterator[Callable[..., object]]:
    """Builds target + exit (worker's, admitting ``head``) + entry (``dialer``'s, expecting
    ``expect``); everything is stopped in the finalizer."""
    made: list[Tunnel] = []

    async def make(behaviour: Callable[..., object] = echo, *, dialer: str = "head", expect: str = "worker",
                   head: str = "head", max_connections: int = 16) -> Tunnel:
        target = await Target(behaviour).start()
        tunnel_exit = await TunnelExit(gang="g1", head=nodes[head].node_id, client_cert=PINNED["head"], rpc_port=target.port,
                                       ssl_context=nodes["worker"].server, listen_host="127.0.0.1",
                                       max_connections=max_connections).start()
        entry = await TunnelEntry(gang="g1", worker=nodes[expect].node_id, server_cert=PINNED[expect],
                                  worker_host="127.0.0.1",
                                  worker_port=tunnel_exit.port, ssl_context=nodes[dialer].client).start()
        made.append(Tunnel(target, tunnel_exit, entry))
        return made[-1]

    yield make
    for t in made:
        await t.entry.stop()
        await t.exit.stop()
        await t.target.stop()


async def read_closed(reader: asyncio.StreamReader, timeout_s: float = 5.0) -> bytes:
    """Everything until the connection ends (EOF or reset)."""
    async with asyncio.timeout(timeout_s):
        try:
            return await reader.read()
        except ConnectionError:
            return b""


async def test_large_transfer_both_ways_is_intact(make_tunnel) -> None:
    t = await make_tunnel()
    reader, writer = await t.open()
    payload = os.urandom(24 * 1024 * 1024 + 7)

    async def send() -> None:
        view = memoryview(payload)
        for i in range(0, len(payload), 1 << 20):
            writer.write(view[i:i + (1 << 20)])
            await writer.drain()
        writer.write_eof()

    sender = asyncio.create_task(send())
    async with asyncio.timeout(45):
        echoed = await reader.read()
    await sender
    writer.close()
    assert hashlib.sha256(echoed).digest() == hashlib.sha256(payload).digest()
    assert len(echoed) == len(payload)
    await wait_for(lambda: t.exit.counters.connections_open == 0 and t.entry.counters.connections_open == 0, 5,
                   "both ends to close the connection")
    for end in (t.entry, t.exit):
        assert end.counters.bytes_in == end.counters.bytes_out == len(payload)
        assert end.counters.connections_total == 1
        assert sum(end.counters.refused.values()) == 0


async def test_half_close_reaches_the_target_and_the_answer_comes_back(make_tunnel) -> None:
    t = await make_tunnel(digest_after_eof)
    reader, writer = await t.open()
    body = os.urandom(300_000)
    writer.write(body)
    writer.write_eof()  # the target answers only after this EOF crossed the tunnel
    answer = await read_closed(reader)
    writer.close()
    assert answer == hashlib.sha256(body).digest() + len(body).to_bytes(8, "big")


async def test_small_messages_round_trip_on_one_connection(make_tunnel) -> None:
    """RPC-like: many request/response exchanges on one long-lived connection."""
    t = await make_tunnel()
    reader, writer = await t.open()
    for i in range(200):
        msg = struct.pack("!I", i) * (1 + i % 7)
        writer.write(msg)
        await writer.drain()
        async with asyncio.timeout(5):
            assert await reader.readexactly(len(msg)) == msg
    writer.close()
    assert t.target.connections == 1


async def test_target_closing_closes_the_client(make_tunnel) -> None:
    async def answer_then_close(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readexactly(5)
        writer.write(b"bye")
        await writer.drain()

    t = await make_tunnel(answer_then_close)
    reader, writer = await t.open()
    writer.write(b"hello")
    assert await read_closed(reader) == b"bye"
    writer.close()
    await wait_for(lambda: t.exit.counters.connections_open == 0 and t.entry.counters.connections_open == 0, 5,
                   "both ends to close the connection")


async def test_target_reset_and_client_abort_release_the_connection(make_tunnel) -> None:
    async def reset(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readexactly(1)
        writer.transport.abort()

    t = await make_tunnel(reset)
    reader, writer = await t.open()
    writer.write(b"x")
    assert await read_closed(reader) == b""
    writer.close()
    # The client side vanishing mid-stream: the target's connection is closed too.
    t2 = await make_tunnel()
    reader, writer = await t2.open()
    writer.write(b"ping")
    assert await reader.readexactly(4) == b"ping"
    writer.transport.abort()
    await wait_for(lambda: t2.exit.counters.connections_open == 0, 5, "the exit to close the target connection")
    for tun in (t, t2):
        await wait_for(lambda tun=tun: tun.entry.counters.connections_open == 0, 5, "the entry to close")


@pytest.mark.parametrize("dialer", ["stranger", "head-node"])
async def test_exit_refuses_a_node_other_than_the_head(make_tunnel, nodes: dict[str, Node], dialer: str) -> None:
    # A member of the mesh, not the gang's head; or the head node's own mesh certificate: only
    # the head's tunnel certificate of the gang is admitted, at the handshake already.
    t = await make_tunnel(dialer=dialer)
    reader, writer = await t.open()
    writer.write(b"GET_DEVICE_MEMORY")
    assert await read_closed(reader) == b""
    writer.close()
    await wait_for(lambda: t.exit.counters.refused["handshake_failed"] == 1, 5, "the wrong node to be counted")
    assert t.target.connections == 0, "a byte reached rpc-server from a node that is not the head"
    assert t.exit.counters.connections_total == 0
    # The exit keeps serving its head.
    entry = await TunnelEntry(gang="g1", worker=t.entry.worker, server_cert=PINNED["worker"], worker_host="127.0.0.1",
                              worker_port=t.exit.port,
                              ssl_context=nodes["head"].client).start()
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", entry.port)
        writer.write(b"ok?")
        async with asyncio.timeout(5):
            assert await reader.readexactly(3) == b"ok?"
        writer.close()
    finally:
        await entry.stop()
    assert t.target.connections == 1


async def test_exit_checks_the_exact_certificate_past_the_handshake(nodes: dict[str, Node], tmp_path: Path) -> None:
    """An exit whose context would let a mesh member's certificate through the handshake (the
    mesh CA trusted too) still admits only the pinned one: the byte-for-byte check."""
    ca = make_ca(tmp_path / "ca")
    cert = enrol(tmp_path / "w", ca, "w")
    member = enrol(tmp_path / "m", ca, "m")
    ca_pem = (ca / "ca.crt").read_bytes()
    wide = tls.server_context(cert, tmp_path / "w" / "node.key", ca_pem)
    target = await Target(echo).start()
    tunnel_exit = await TunnelExit(gang="g1", head=nodes["head"].node_id, client_cert=PINNED["head"],
                                   rpc_port=target.port, ssl_context=wide, listen_host="127.0.0.1").start()
    try:
        client = tls.client_context(member, tmp_path / "m" / "node.key", ca_pem)
        reader, writer = await asyncio.open_connection("127.0.0.1", tunnel_exit.port, ssl=client, server_hostname="")
        writer.write(b"hello")
        assert await read_closed(reader) == b""
        writer.close()
        await wait_for(lambda: tunnel_exit.counters.refused["wrong_node"] == 1, 5, "the member to be refused")
        assert target.connections == 0
    finally:
        await tunnel_exit.stop()
        await target.stop()


async def test_entry_refuses_a_worker_that_is_another_node(make_tunnel) -> None:
    # The entry expects the head's certificate at the exit (as if another node answered at the
    # worker's address): its context lets the worker's through the handshake, the exact check not.
    t = await make_tunnel(expect="head")
    reader, writer = await t.open()
    writer.write(b"secret prompt")
    assert await read_closed(reader) == b""
    writer.close()
    await wait_for(lambda: t.entry.counters.refused["wrong_node"] == 1, 5, "the wrong worker to be counted")
    assert t.target.connections == 0


@pytest.mark.parametrize("first_bytes", [b"", b"GET / HTTP/1.1\r\nHost: x\r\n\r\n", os.urandom(4096)],
                         ids=["silent-close", "plain-http", "garbage"])
async def test_plain_tcp_and_garbage_are_refused_and_counted(make_tunnel, first_bytes: bytes) -> None:
    t = await make_tunnel()
    reader, writer = await asyncio.open_connection("127.0.0.1", t.exit.port)
    writer.write(first_bytes)
    if not first_bytes:
        writer.write_eof()
    assert await read_closed(reader) == b""
    writer.close()
    await wait_for(lambda: t.exit.counters.refused["handshake_failed"] == 1, 10, "the failed handshake to be counted")
    assert t.target.connections == 0
    reader, writer = await t.open()  # and the exit still serves the head
    writer.write(b"still here")
    async with asyncio.timeout(5):
        assert await reader.readexactly(10) == b"still here"
    writer.close()


async def test_client_without_a_certificate_is_refused(make_tunnel, tmp_path: Path) -> None:
    t = await make_tunnel()
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.check_hostname, ctx.verify_mode = False, ssl.CERT_NONE
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", t.exit.port, ssl=ctx, server_hostname="")
        writer.write(b"x" * 16)
        assert await read_closed(reader) == b""
        writer.close()
    except (ssl.SSLError, ConnectionError):
        pass  # TLS 1.3: the server's alert may arrive during or after the client's handshake
    await wait_for(lambda: t.exit.counters.refused["handshake_failed"] == 1, 10, "the refusal to be counted")
    assert t.target.connections == 0


async def test_oversized_record_is_malformed_and_cut(make_tunnel, nodes: dict[str, Node]) -> None:
    t = await make_tunnel()
    reader, writer = await asyncio.open_connection("127.0.0.1", t.exit.port, ssl=nodes["head"].client,
                                                   server_hostname="")
    writer.write(struct.pack("!I", MAX_RECORD_BYTES + 1) + b"\0" * 64)
    assert await read_closed(reader) == b""
    writer.close()
    await wait_for(lambda: t.exit.counters.refused["malformed"] == 1, 5, "the malformed record to be counted")


async def test_connections_beyond_the_cap_are_closed_at_accept(make_tunnel) -> None:
    t = await make_tunnel(max_connections=1)
    r1, w1 = await t.open()
    w1.write(b"one")
    async with asyncio.timeout(5):
        assert await r1.readexactly(3) == b"one"
    r2, w2 = await t.open()
    w2.write(b"two")
    assert await read_closed(r2) == b""
    w2.close()
    await wait_for(lambda: t.exit.counters.refused["too_many_connections"] == 1, 5, "the refusal at the cap")
    w1.close()


async def same_port_on_two_addresses(first: str, second: str) -> tuple[Target, Target]:
    """Echo targets on ``first`` and ``second`` with one port number. The port the kernel gave
    ``first`` may be held on ``second`` (or on the wildcard) by another process of a parallel
    run (CI failed once so), so a taken port is given back and another tried."""
    for _ in range(20):
        one = await Target(echo).start(first)
        try:
            return one, await Target(echo).start(second, one.port)
        except OSError as exc:
            if exc.errno != errno.EADDRINUSE:
                raise
            await one.stop()
    raise AssertionError(f"no port free on both {first} and {second} in 20 tries")


async def test_exit_delivers_to_loopback_only(nodes: dict[str, Node]) -> None:
    """The exit listens on another address (127.0.0.2, its 'mesh address' here) where a decoy
    holds the rpc port too: the stream must reach 127.0.0.1:<rpc_port> and nothing else."""
    real, decoy = await same_port_on_two_addresses("127.0.0.1", "127.0.0.2")
    tunnel_exit = await TunnelExit(gang="g1", head=nodes["head"].node_id, client_cert=PINNED["head"], rpc_port=real.port,
                                   ssl_context=nodes["worker"].server, listen_host="127.0.0.2").start()
    entry = await TunnelEntry(gang="g1", worker=nodes["worker"].node_id, server_cert=PINNED["worker"],
                              worker_host="127.0.0.2",
                              worker_port=tunnel_exit.port, ssl_context=nodes["head"].client).start()
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", entry.port)
        writer.write(b"where?")
        async with asyncio.timeout(5):
            assert await reader.readexactly(6) == b"where?"
        writer.close()
        assert (real.connections, decoy.connections) == (1, 0)
    finally:
        await entry.stop()
        await tunnel_exit.stop()
        await decoy.stop()
        await real.stop()


async def test_stop_cuts_carried_connections_and_metrics_name_them(make_tunnel) -> None:
    t = await make_tunnel()
    reader, writer = await t.open()
    writer.write(b"abc")
    async with asyncio.timeout(5):
        assert await reader.readexactly(3) == b"abc"
    families = {f.name: f for f in metric_families([t.entry, t.exit])}
    opened = {tuple(s.labels.values()): s.value for s in families["viiwork_gang_tunnel_connections_open"].samples}
    assert opened == {("g1", "entry"): 1, ("g1", "exit"): 1}
    await t.exit.stop()
    assert await read_closed(reader) == b""
    writer.close()
    await wait_for(lambda: t.entry.counters.connections_open == 0, 5, "the entry to close")
    carried = {tuple(s.labels.values()): s.value for s in families["viiwork_gang_tunnel_bytes"].samples}
    assert carried[("g1", "entry", "out")] == 3


async def test_idle_connections_from_elsewhere_do_not_lock_the_head_out(nodes: dict[str, Node]) -> None:
    """Sixteen idle TCP connections (no certificate needed to be accepted) from an address that
    is not the head's take at most a quarter of the exit's slots: the head still gets through
    (the attacker pass locked it out with 16 before)."""
    target = await Target(echo).start()
    tunnel_exit = await TunnelExit(gang="g1", head=nodes["head"].node_id, client_cert=PINNED["head"],
                                   rpc_port=target.port, ssl_context=nodes["worker"].server, listen_host="127.0.0.1",
                                   head_host="127.0.0.1").start()
    entry = await TunnelEntry(gang="g1", worker=nodes["worker"].node_id, server_cert=PINNED["worker"],
                              worker_host="127.0.0.1", worker_port=tunnel_exit.port,
                              ssl_context=nodes["head"].client).start()
    idle = []
    try:
        for _ in range(16):
            idle.append(await asyncio.open_connection("127.0.0.1", tunnel_exit.port, local_addr=("127.0.0.5", 0)))
        await wait_for(lambda: tunnel_exit.counters.refused["too_many_connections"] == 12, 5, "the others capped")
        reader, writer = await asyncio.open_connection("127.0.0.1", entry.port)
        writer.write(b"head")
        async with asyncio.timeout(5):
            assert await reader.readexactly(4) == b"head"
        writer.close()
    finally:
        for _, w in idle:
            w.transport.abort()
        await entry.stop()
        await tunnel_exit.stop()
        await target.stop()
