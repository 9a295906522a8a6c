"""A peer is the node it claims to be, on every connection (issue 14, part 1).

The scenario: node B crashes; someone holding another member's certificate and key (node C's
in CA mode; in open mode, anyone who knows the ``mesh_id``) listens on B's advertised address.
Requests pinned to B (``X-Viiwork-Host``) and the origin's gossip to B go to that address:
the origin must refuse the connection before sending a byte (the TLS peer's node id is not
B's), count it and log it with both ids. Before issue 14 the rogue received every prompt.

The origin A is a real agent process (no models of its own); B and the rogue are real mesh
nodes in this process (the rogue on B's port, serving a chat route that records what it
gets). Plus the connector check on its own, against real TLS servers on loopback.
"""

from __future__ import annotations

import asyncio
import logging
import re
import ssl
from collections import Counter
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from support.agent import Agent, run_agent
from support.mesh_nodes import enrol, loopback_settings, make_ca
from viiwork.mesh import dialing, tls
from viiwork.mesh.identity import NodeId, load_or_create_identity
from viiwork.mesh.membership import GossipSettings, GossipTarget
from viiwork.mesh.node import MeshNode
from viiwork.mesh.summary import PROTOCOL_VERSION, ModelCapacity, PublishedState
from viiwork.mesh.transport import GossipClient
from viiwork.mesh.trust import issue_open_certificate, open_mesh_ca

pytestmark = pytest.mark.timeout(90)

MESH_ID = "impersonation-mesh"
# A long silence before B is suspect in A's view: the window in which A still routes to B's
# address after B crashed is the one an impersonator would use.
SUSPECT_MS = 30_000
GOSSIP = GossipSettings(gossip_interval_ms=100, suspect_after_ms=SUSPECT_MS, dead_after_ms=60_000,
                        scale_with_size=False)
MODEL = ModelCapacity("m", "llamacpp", "chat", 4, 0, None, 4096, 1, 1, "fp-m")


class Recorder:
    """What a server received: every request's path and headers (a middleware)."""

    def __init__(self) -> None:
        self.requests: list[tuple[str, dict[str, str]]] = []
        self.client_ports: list[int] = []

    @web.middleware
    async def middleware(self, request: web.Request, handler: Any) -> web.StreamResponse:
        self.requests.append((request.path, dict(request.headers)))
        peer = request.transport.get_extra_info("peername") if request.transport else None
        self.client_ports.append(peer[1] if peer else -1)
        return await handler(request)

    def paths(self) -> Counter[str]:
        return Counter(path for path, _ in self.requests)


async def rogue_chat(request: web.Request) -> web.Response:
    await request.read()
    return web.json_response({"id": "rogue", "object": "chat.completion", "model": "m",
                              "choices": [{"index": 0, "message": {"role": "assistant", "content": "ROGUE"},
                                           "finish_reason": "stop"}]})


async def agent_status(http: aiohttp.ClientSession, agent: Agent) -> dict[str, Any]:
    async with http.get(f"{agent.url}/v1/status") as resp:
        return await resp.json()


async def until(http: aiohttp.ClientSession, agent: Agent, predicate: Any, what: str, timeout_s: float = 20) -> dict:
    """Poll the agent's /v1/status without blocking this loop (B gossips from it)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    doc: dict[str, Any] = {}
    while loop.time() < deadline:
        if agent.proc.poll() is not None:
            raise AssertionError(f"agent exited; log:\n{agent.log_text()[-3000:]}")
        try:
            doc = await agent_status(http, agent)
            if predicate(doc):
                return doc
        except (aiohttp.ClientError, KeyError, ValueError):
            pass
        await asyncio.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}; last status {doc}\nlog:\n{agent.log_text()[-3000:]}")


def mismatches(doc: dict[str, Any]) -> int:
    return int(doc["mesh"]["counters"]["transport"].get("peer_mismatch", 0))


@pytest.mark.parametrize("trust", ["ca", "open"])
async def test_rogue_on_crashed_peers_address_gets_no_request(tmp_path: Path, trust: str) -> None:
    ca = make_ca(tmp_path / "ca") if trust == "ca" else None
    mesh: dict[str, Any] = {"trust": trust, "listen": "127.0.0.1:0", "advertise": "127.0.0.1",
                            "discovery": ["seeds"], "seeds": [], "gossip_interval_ms": 100,
                            "suspect_after_ms": SUSPECT_MS, "dead_after_ms": 60_000}
    if ca is not None:
        enrol(tmp_path / "node-a", ca, "node-a")
        mesh["ca_certificate"] = str(ca / "ca.crt")
    else:
        mesh["mesh_id"] = MESH_ID
    extra = {"mesh": mesh, "routing": {"queue_timeout_s": 1, "stale_after_ms": SUSPECT_MS}}

    def settings(name: str, seeds: tuple[str, ...] = (), listen: str = "127.0.0.1:0") -> Any:
        state = tmp_path / name
        if ca is not None:
            enrol(state, ca, name)
        return loopback_settings(state, name, trust=trust, ca_dir=ca, mesh_id=None if ca else MESH_ID,
                                 seeds=seeds, gossip=GOSSIP, listen=listen)

    with run_agent(tmp_path, [], name="node-a", extra=extra) as a:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=20)) as http:
            a_mesh = (await until(http, a, lambda d: bool(d["mesh"]["self"]["mesh"]), "A's mesh address"))
            b = MeshNode(settings("node-b", seeds=(a_mesh["mesh"]["self"]["mesh"],)),
                         provider=lambda: ([MODEL], PublishedState.SERVING))
            await b.start()
            b_id, b_port = b.node_id, b.listen_port
            try:
                await until(http, a, lambda d: d["mesh"]["peers"].get("alive", 0) == 1, "A to see B alive")
            finally:
                await b.stop(leave=False)  # a crash: no "leaving" is published
            # The rogue: node C's certificate and key (CA mode), or in open mode a key of its
            # own under the mesh's derived CA, naming itself node-b; on B's address.
            if trust == "ca":
                rogue = MeshNode(settings("node-c", listen=f"127.0.0.1:{b_port}"))
            else:
                rogue = MeshNode(loopback_settings(tmp_path / "rogue", "node-b", trust="open", mesh_id=MESH_ID,
                                                   gossip=GOSSIP, listen=f"127.0.0.1:{b_port}"))
            seen = Recorder()
            rogue.app.middlewares.append(seen.middleware)
            rogue.app.router.add_post("/v1/chat/completions", rogue_chat)
            await rogue.start()
            try:
                assert rogue.node_id != b_id and rogue.listen_port == b_port

                async def pinned() -> tuple[int, bytes]:
                    async with http.post(f"{a.url}/v1/chat/completions", headers={"X-Viiwork-Host": "node-b"},
                                         json={"model": "m", "messages": [{"role": "user", "content": "secret"}]}) as r:
                        return r.status, await r.read()

                answers = await asyncio.gather(*(pinned() for _ in range(3)))
                doc = await agent_status(http, a)
            finally:
                await rogue.stop(leave=False)
    assert seen.paths() == Counter(), f"the rogue received {seen.paths()}"
    # Refused before anything was sent, as a peer that cannot be reached: routed again,
    # then queued until routing.queue_timeout_s (no other node serves "m").
    assert [status for status, _ in answers] == [429] * 3 and all(b"ROGUE" not in body for _, body in answers)
    assert doc["mesh"]["forwards"]["out"] == 0 and doc["mesh"]["forwards"]["refused_out"] >= 3
    assert mismatches(doc) >= 3  # every forward at least once, plus the gossip to B's address
    warnings = [line for line in a.log_text().splitlines() if "WARNING" in line and "refusing" in line]
    assert any(b_id in line and rogue.node_id in line for line in warnings), warnings


# --- the connector check, against real TLS servers ------------------------------------------------


class TlsServer:
    """An aiohttp server on loopback presenting one node's certificate (mutual TLS)."""

    def __init__(self, ctx: ssl.SSLContext) -> None:
        self.ctx = ctx
        self.seen = Recorder()
        self.runner: web.AppRunner | None = None
        self.port = 0

    @staticmethod
    async def answer(request: web.Request) -> web.Response:
        await request.read()
        return web.Response(text="ok")

    async def start(self) -> None:
        app = web.Application(middlewares=[self.seen.middleware])
        app.router.add_post("/x", self.answer)
        self.runner = web.AppRunner(app, access_log=None)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0, ssl_context=self.ctx)
        await site.start()
        self.port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]

    async def stop(self) -> None:
        if self.runner is not None:
            await self.runner.cleanup()


class Node:
    """A node's certificate files (open mode: issued under the mesh's derived CA)."""

    def __init__(self, directory: Path, name: str) -> None:
        ident = load_or_create_identity(directory)
        self.node_id: NodeId = ident.node_id
        self.cert = directory / "node.crt"
        self.cert.write_bytes(issue_open_certificate(ident, name, MESH_ID))
        self.key = ident.key_path

    @staticmethod
    def ca_pem() -> bytes:
        from cryptography.hazmat.primitives import serialization
        return open_mesh_ca(MESH_ID)[1].public_bytes(serialization.Encoding.PEM)


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
async def parts(tmp_path: Path) -> AsyncIterator[dict[str, Any]]:
    origin, b, c = (Node(tmp_path / n, n) for n in ("origin", "b", "c"))
    server = TlsServer(tls.server_context(c.cert, c.key, Node.ca_pem()))  # C answers
    await server.start()
    counters: Counter[str] = Counter()
    clock = Clock()
    session = aiohttp.ClientSession(**dialing.peer_session_parts(
        tls.client_context(origin.cert, origin.key, Node.ca_pem()), counters=counters, require_expected=True,
        clock=clock), timeout=aiohttp.ClientTimeout(total=5))
    try:
        yield {"b": b, "c": c, "server": server, "session": session, "counters": counters, "clock": clock,
               "url": f"https://127.0.0.1:{server.port}/x"}
    finally:
        await session.close()
        await server.stop()


async def test_connector_refuses_another_node_before_sending(parts: dict[str, Any]) -> None:
    session, server, b, c = parts["session"], parts["server"], parts["b"], parts["c"]
    with pytest.raises(dialing.PeerMismatch) as info:
        await session.post(parts["url"], data=b"secret", headers=dialing.expect_node(b.node_id))
    assert (info.value.expected, info.value.presented) == (b.node_id, c.node_id)
    assert isinstance(info.value, aiohttp.ClientConnectorError)  # callers treat it as unreachable
    assert server.seen.requests == [] and parts["counters"]["peer_mismatch"] == 1
    async with session.post(parts["url"], data=b"hello", headers=dialing.expect_node(c.node_id)) as resp:
        assert resp.status == 200
    [(path, headers)] = server.seen.requests
    assert dialing.EXPECTED_NODE_HEADER not in headers  # never on the wire


async def test_request_naming_no_node_is_refused_when_required(parts: dict[str, Any]) -> None:
    with pytest.raises(dialing.PeerMismatch):
        await parts["session"].post(parts["url"], data=b"secret")
    assert parts["server"].seen.requests == []


async def test_connection_verified_for_one_node_is_not_used_for_another(parts: dict[str, Any]) -> None:
    session, server, b, c = parts["session"], parts["server"], parts["b"], parts["c"]
    for _ in range(2):
        async with session.post(parts["url"], data=b"1", headers=dialing.expect_node(c.node_id)) as resp:
            await resp.read()
    with pytest.raises(dialing.PeerMismatch):
        await session.post(parts["url"], data=b"2", headers=dialing.expect_node(b.node_id))
    async with session.post(parts["url"], data=b"3", headers=dialing.expect_node(c.node_id)) as resp:
        await resp.read()
    # One pooled connection to C throughout: the request for B got a connection of its own
    # (refused and closed), never C's.
    assert len(server.seen.requests) == 3 and len(set(server.seen.client_ports)) == 1
    assert parts["counters"]["peer_mismatch"] == 1


async def test_mismatch_warns_once_per_address_per_minute(parts: dict[str, Any],
                                                          caplog: pytest.LogCaptureFixture) -> None:
    session, b, c, clock = parts["session"], parts["b"], parts["c"], parts["clock"]

    async def refused() -> None:
        with pytest.raises(dialing.PeerMismatch):
            await session.post(parts["url"], data=b"x", headers=dialing.expect_node(b.node_id))

    def warned() -> list[str]:
        return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING and r.name == dialing.__name__]

    with caplog.at_level(logging.DEBUG, logger=dialing.__name__):
        await refused()
        await refused()
        assert len(warned()) == 1 and b.node_id in warned()[0] and c.node_id in warned()[0]
        clock.now += dialing.WARN_EVERY_S
        await refused()
        assert len(warned()) == 2
    assert parts["counters"]["peer_mismatch"] == 3
    assert re.search(r"127\.0\.0\.1:\d+", warned()[0])


async def test_gossip_to_a_known_node_checks_who_answers(tmp_path: Path) -> None:
    """GossipClient: a target whose node id is known gets no digest unless the TLS peer is
    that node; a seed (node id unknown) is dialled without the check."""
    nodes = {name: MeshNode(loopback_settings(tmp_path / name, name, trust="open", mesh_id=MESH_ID, gossip=GOSSIP))
             for name in ("x", "c")}
    seen = Recorder()
    nodes["c"].app.middlewares.append(seen.middleware)
    for node in nodes.values():
        await node.start()
    x, c = nodes["x"], nodes["c"]
    client = GossipClient(x.membership, x.client_ssl_context, connect_timeout_s=1, exchange_timeout_s=2)
    await client.start()
    try:
        other = NodeId("a" * 16)
        address = f"127.0.0.1:{c.listen_port}"
        assert not await client.exchange(GossipTarget(address, other, PROTOCOL_VERSION))
        assert seen.requests == [] and x.membership.counters.transport["peer_mismatch"] == 1
        assert x.membership.counters.transport["exchange_failed"] == 0  # counted once, as a mismatch
        assert await client.exchange(GossipTarget(address, c.node_id, PROTOCOL_VERSION))
        assert await client.exchange(GossipTarget(address, None, PROTOCOL_VERSION))  # a seed
        assert seen.paths()["/mesh/v1/exchange"] == 2
        assert all(dialing.EXPECTED_NODE_HEADER not in headers for _, headers in seen.requests)
    finally:
        await client.close()
        for node in nodes.values():
            await node.stop(leave=False)
