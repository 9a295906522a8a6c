"""TLS 1.3 only, both ways (docs/mesh.md, mesh/tls.py): a real ssl client limited to TLS 1.2
is refused by a real mesh listener, and a node never dials into a TLS 1.2 server."""

from __future__ import annotations

import asyncio
import ssl
from pathlib import Path

import pytest

from support.mesh_nodes import enrol, loopback_settings, make_ca, wait_for
from viiwork.mesh import tls
from viiwork.mesh.node import MeshNode


@pytest.fixture
async def mesh_listener(tmp_path: Path):
    ca = make_ca(tmp_path / "ca")
    enrol(tmp_path / "server", ca, "server")
    enrol(tmp_path / "client", ca, "client")
    node = MeshNode(loopback_settings(tmp_path / "server", "server", ca_dir=ca))
    await node.start()
    yield node, ca, tmp_path / "client"
    await node.stop(leave=False)


def enrolled_client(ca: Path, client: Path, maximum: ssl.TLSVersion) -> ssl.SSLContext:
    """A plain ssl client context with an enrolled node's certificate, up to ``maximum``."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.check_hostname = False
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    ctx.maximum_version = maximum
    ctx.load_cert_chain(str(client / "node.crt"), str(client / "node.key"))
    ctx.load_verify_locations(cafile=str(ca / "ca.crt"))
    return ctx


async def handshake(port: int, ctx: ssl.SSLContext) -> str:
    """The negotiated TLS version of a full handshake with 127.0.0.1:``port``."""
    reader, writer = await asyncio.wait_for(asyncio.open_connection("127.0.0.1", port, ssl=ctx), 5)
    try:
        return writer.get_extra_info("ssl_object").version()
    finally:
        writer.close()
        try:
            await writer.wait_closed()
        except (ssl.SSLError, ConnectionError):
            pass


async def test_tls12_client_is_refused_by_the_mesh_listener(mesh_listener) -> None:
    node, ca, client = mesh_listener
    failures = node.membership.counters.transport
    # The same enrolled certificate completes a handshake over TLS 1.3 ...
    assert await handshake(node.listen_port, enrolled_client(ca, client, ssl.TLSVersion.TLSv1_3)) == "TLSv1.3"
    assert failures["handshake_failed"] == 0
    # ... and is refused when the client offers nothing newer than TLS 1.2.
    with pytest.raises((ssl.SSLError, ConnectionError)) as refused:
        await handshake(node.listen_port, enrolled_client(ca, client, ssl.TLSVersion.TLSv1_2))
    if isinstance(refused.value, ssl.SSLError):
        assert "VERSION" in refused.value.reason.upper() or "ALERT" in refused.value.reason.upper(), refused.value
    await wait_for(lambda: failures["handshake_failed"] == 1, 5, "the refused handshake to be counted")


async def test_node_does_not_dial_into_a_tls12_server(tmp_path: Path) -> None:
    ca = make_ca(tmp_path / "ca")
    enrol(tmp_path / "old", ca, "old")
    enrol(tmp_path / "node", ca, "node")
    ca_pem = (ca / "ca.crt").read_bytes()
    server_ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    server_ctx.minimum_version = server_ctx.maximum_version = ssl.TLSVersion.TLSv1_2
    server_ctx.load_cert_chain(str(tmp_path / "old" / "node.crt"), str(tmp_path / "old" / "node.key"))
    server_ctx.load_verify_locations(cadata=ca_pem.decode("ascii"))
    server_ctx.verify_mode = ssl.CERT_REQUIRED

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.close()

    server = await asyncio.start_server(serve, "127.0.0.1", 0, ssl=server_ctx)
    try:
        port = server.sockets[0].getsockname()[1]
        node_ctx = tls.client_context(tmp_path / "node" / "node.crt", tmp_path / "node" / "node.key", ca_pem)
        assert node_ctx.minimum_version is ssl.TLSVersion.TLSv1_3
        with pytest.raises((ssl.SSLError, ConnectionError)):
            await handshake(port, node_ctx)
    finally:
        server.close()
        await server.wait_closed()
