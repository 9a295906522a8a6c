"""The mesh listener's mutual TLS: who gets in, who is refused (and counted)."""

from __future__ import annotations

import datetime as dt
import ssl

import aiohttp
import pytest

from support.mesh_nodes import enrol, loopback_settings, make_ca, wait_for
from viiwork.mesh import tls
from viiwork.mesh.node import MeshNode, MeshStartError
from viiwork.mesh.transport import EXCHANGE_PATH


@pytest.fixture
async def ca_node(tmp_path):
    ca = make_ca(tmp_path / "ca")
    enrol(tmp_path / "server", ca, "server")
    node = MeshNode(loopback_settings(tmp_path / "server", "server", ca_dir=ca))
    await node.start()
    yield node, ca
    await node.stop(leave=False)


def client_ctx(cert_path, key_path, ca_pem):
    return tls.client_context(cert_path, key_path, ca_pem)


async def post_digest(node, ctx):
    url = f"https://127.0.0.1:{node.listen_port}{EXCHANGE_PATH}"
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(ssl=ctx),
                                     timeout=aiohttp.ClientTimeout(total=5)) as session:
        async with session.post(url, data=node.membership.digest_bytes()) as resp:
            return resp.status, await resp.read()


def failures(node):
    return node.membership.counters.transport["handshake_failed"]


async def test_enrolled_client_is_admitted_and_identified(tmp_path, ca_node):
    node, ca = ca_node
    enrol(tmp_path / "client", ca, "client")
    ca_pem = (ca / "ca.crt").read_bytes()
    ctx = client_ctx(tmp_path / "client" / "node.crt", tmp_path / "client" / "node.key", ca_pem)
    status, body = await post_digest(node, ctx)
    assert status == 200 and body.startswith(b'{"type":"reply"')
    assert failures(node) == 0


async def test_client_without_certificate_is_refused_and_counted(ca_node):
    node, ca = ca_node
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.check_hostname = False
    ctx.load_verify_locations(cafile=str(ca / "ca.crt"))
    with pytest.raises(aiohttp.ClientError):
        await post_digest(node, ctx)
    await wait_for(lambda: failures(node) == 1, 5, "the failed handshake to be counted")


async def test_client_of_another_ca_is_refused_and_counted(tmp_path, ca_node):
    node, ca = ca_node
    other = make_ca(tmp_path / "other-ca")
    enrol(tmp_path / "intruder", other, "intruder")
    # The intruder trusts our CA for the server side, but its own certificate is from its CA.
    ctx = client_ctx(tmp_path / "intruder" / "node.crt", tmp_path / "intruder" / "node.key",
                     (ca / "ca.crt").read_bytes())
    with pytest.raises(aiohttp.ClientError):
        await post_digest(node, ctx)
    await wait_for(lambda: failures(node) == 1, 5, "the failed handshake to be counted")


async def test_expired_client_certificate_is_refused_and_counted(tmp_path, ca_node):
    node, ca = ca_node
    long_ago = dt.datetime.now(dt.UTC) - dt.timedelta(days=400)
    enrol(tmp_path / "expired", ca, "expired", days=2, now=long_ago)
    ctx = client_ctx(tmp_path / "expired" / "node.crt", tmp_path / "expired" / "node.key",
                     (ca / "ca.crt").read_bytes())
    with pytest.raises(aiohttp.ClientError):
        await post_digest(node, ctx)
    await wait_for(lambda: failures(node) == 1, 5, "the failed handshake to be counted")


async def test_plain_http_and_garbage_are_refused_and_counted(ca_node):
    import asyncio

    node, _ = ca_node
    reader, writer = await asyncio.open_connection("127.0.0.1", node.listen_port)
    writer.write(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
    await writer.drain()
    assert await asyncio.wait_for(reader.read(), 5) == b""
    writer.close()
    await wait_for(lambda: failures(node) == 1, 5, "the failed handshake to be counted")


async def test_server_of_another_ca_is_refused_by_the_client(tmp_path, ca_node):
    node, ca = ca_node
    other = make_ca(tmp_path / "other-ca")
    enrol(tmp_path / "client", other, "client")
    ctx = client_ctx(tmp_path / "client" / "node.crt", tmp_path / "client" / "node.key",
                     (other / "ca.crt").read_bytes())
    with pytest.raises(aiohttp.ClientConnectorCertificateError):
        await post_digest(node, ctx)


async def test_missing_node_certificate_is_a_start_error_naming_the_fix(tmp_path):
    ca = make_ca(tmp_path / "ca")
    node = MeshNode(loopback_settings(tmp_path / "fresh", "fresh", ca_dir=ca))
    with pytest.raises(MeshStartError, match="viiworkctl mesh request"):
        await node.start()


async def test_certificate_of_another_node_is_a_start_error(tmp_path):
    ca = make_ca(tmp_path / "ca")
    enrol(tmp_path / "a", ca, "a")
    enrol(tmp_path / "b", ca, "b")
    (tmp_path / "a" / "node.crt").write_bytes((tmp_path / "b" / "node.crt").read_bytes())
    with pytest.raises(MeshStartError, match="is for node"):
        await MeshNode(loopback_settings(tmp_path / "a", "a", ca_dir=ca)).start()


async def test_listen_address_in_use_is_a_start_error(tmp_path, ca_node):
    node, ca = ca_node
    enrol(tmp_path / "second", ca, "second")
    settings = loopback_settings(tmp_path / "second", "second", ca_dir=ca, listen=f"127.0.0.1:{node.listen_port}")
    with pytest.raises(MeshStartError, match="cannot bind"):
        await MeshNode(settings).start()


async def test_authenticated_garbage_costs_a_counter(tmp_path, ca_node):
    node, ca = ca_node
    enrol(tmp_path / "client", ca, "client")
    ctx = client_ctx(tmp_path / "client" / "node.crt", tmp_path / "client" / "node.key", (ca / "ca.crt").read_bytes())
    base = f"https://127.0.0.1:{node.listen_port}"
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(ssl=ctx)) as session:
        async with session.post(base + EXCHANGE_PATH, data=b"\x00garbage") as resp:
            assert resp.status == 400
        too_big = b"x" * (node.settings.gossip.max_message_bytes + 128 * 1024)
        async with session.post(base + "/mesh/v1/push", data=too_big) as resp:
            assert resp.status == 413
    drops = node.membership.counters.drops
    assert drops["malformed"] == 1 and drops["oversized"] == 1


async def test_undecodable_gzip_body_is_dropped_and_counted(tmp_path, ca_node):
    """A peer's body whose ``Content-Encoding: gzip`` does not decode is a 400 and a
    ``malformed`` drop on both gossip routes, never a 500 (mesh/transport.py ``read_body``)."""
    node, ca = ca_node
    enrol(tmp_path / "client", ca, "client")
    ctx = client_ctx(tmp_path / "client" / "node.crt", tmp_path / "client" / "node.key", (ca / "ca.crt").read_bytes())
    base = f"https://127.0.0.1:{node.listen_port}"
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(ssl=ctx),
                                     timeout=aiohttp.ClientTimeout(total=10)) as session:
        for path in (EXCHANGE_PATH, "/mesh/v1/push"):
            async with session.post(base + path, data=b"\x1f\x8b\x08garbage",
                                    headers={"Content-Encoding": "gzip"}) as resp:
                assert resp.status == 400, (path, await resp.text())
        # The listener still serves the same peer afterwards.
        async with session.post(base + EXCHANGE_PATH, data=node.membership.digest_bytes()) as resp:
            assert resp.status == 200
    assert node.membership.counters.drops["malformed"] == 2
