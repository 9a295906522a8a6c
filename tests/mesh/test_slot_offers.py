"""Slot offers between real agents on loopback (``viiwork.agent.peering.offers``, the slot-offer glue
in ``viiwork.agent.peering.mesh_link`` and ``viiwork.agent.serving.api``).

- three agents, ``parallel = 1`` each, slow gossip: a request queued at A runs on B within
  one round trip of B's slot freeing (B offers it to A), not at B's next summary;
- a request pinned to one node is never handed another node's offered slot;
- the want/offer endpoints of the mesh listener refuse malformed messages (400 naming the
  field, counted) and the agent keeps serving;
- a forward with an offer id it does not own (bogus, or another peer's) never takes the
  held slot: an in-process mesh node (a real member) is offered B's slot, and only its own
  forward with that id gets it;
- want/offer bodies that arrive in pieces are read whole (a single read returns only what
  has arrived).

Engines are fake llama-servers: 400 tokens 50 ms apart at most; a request's ``max_tokens``
sets how long it holds its slot (``TOKEN_S`` per token).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import ssl
import time
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from cryptography.hazmat.primitives import serialization

from support.agent import Agent, run_agent
from support.engines import fake_engine_binary
from support.mesh_nodes import loopback_settings
from viiwork.mesh import tls
from viiwork.mesh.identity import load_or_create_identity
from viiwork.mesh.membership import GossipSettings, Liveness
from viiwork.mesh.node import MeshNode
from viiwork.mesh.trust import issue_open_certificate, open_mesh_ca

MESH_ID = "test-mesh"
TOKEN_S = 0.05
ENGINE_ENV = {"FAKE_LOAD_S": "0.1", "FAKE_TOKENS": "400", "FAKE_TOKEN_DELAY_S": str(TOKEN_S)}
GOSSIP_MS = 2000  # slow summaries: a dispatch within ~300 ms of a slot freeing is not gossip's doing
NOT_SERVED = "other-model"


def chat(model: str = "shared", seconds: float = 0.1, stream: bool = False) -> dict:
    """A chat request that holds its slot for about ``seconds``."""
    return {"model": model, "stream": stream, "max_tokens": max(1, round(seconds / TOKEN_S)),
            "messages": [{"role": "user", "content": "hi"}]}


def shared_model(binary: Path) -> dict:
    return {"name": "shared", "engine": "llamacpp", "path": "/dev/null", "parallel": 1, "backends": 1,
            "llamacpp": {"binary": str(binary)}, "env": ENGINE_ENV}


def mesh_section(seeds: list[str], gossip_ms: int) -> dict:
    return {"trust": "open", "mesh_id": MESH_ID, "listen": "127.0.0.1:0", "advertise": "127.0.0.1",
            "discovery": ["seeds"], "seeds": seeds, "gossip_interval_ms": gossip_ms,
            "suspect_after_ms": 20 * gossip_ms, "dead_after_ms": 40 * gossip_ms}


def mesh_address(agent: Agent) -> str:
    return agent.wait_for(lambda d: bool(d["mesh"]["self"]["mesh"]), 30, "mesh address")["mesh"]["self"]["mesh"]


async def wait(agent: Agent, predicate: Any, timeout_s: float, what: str) -> dict:
    """``agent.wait_for`` off the event loop (it blocks), so the test's own connections and
    in-process mesh nodes keep running meanwhile."""
    return await asyncio.to_thread(agent.wait_for, predicate, timeout_s, what)


def offers(doc: dict) -> dict:
    return doc["mesh"]["offers"]


def busy_local(doc: dict) -> int:
    return sum(b.get("busy", 0) for m in doc["models"] if m["name"] == "shared" for b in m["backends"])


def view_of(doc: dict, node: str) -> dict | None:
    """``shared`` on ``node`` in a /v1/mesh document (None unless alive)."""
    for n in doc["nodes"]:
        if n["name"] == node and n["liveness"] == "alive":
            return next((m for m in n["models"] if m["name"] == "shared"), None)
    return None


async def mesh_view(http: aiohttp.ClientSession, agent: Agent) -> dict:
    async with http.get(f"{agent.url}/v1/mesh") as r:
        return await r.json()


async def wait_view(http: aiohttp.ClientSession, agent: Agent, predicate: Any, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    doc: dict = {}
    while time.monotonic() < deadline:
        doc = await mesh_view(http, agent)
        if predicate(doc):
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"timed out after {timeout_s} s waiting for {what}; /v1/mesh: {json.dumps(doc)[:2000]}")


def mesh_client_context(directory: Path, name: str) -> tuple[ssl.SSLContext, str]:
    """A client TLS context with an open-mesh certificate for ``MESH_ID`` (a fresh key):
    what any host that knows the mesh id can present. Returns (context, node id)."""
    identity = load_or_create_identity(directory)
    cert = directory / "client.crt"
    cert.write_bytes(issue_open_certificate(identity, name, MESH_ID))
    ca_pem = open_mesh_ca(MESH_ID)[1].public_bytes(serialization.Encoding.PEM)
    return tls.client_context(cert, identity.key_path, ca_pem), identity.node_id


# --- three agents ---------------------------------------------------------------------------------


@pytest.fixture
def slow_mesh3(tmp_path: Path) -> Iterator[dict[str, Agent]]:
    """Agents a, b, c serving ``shared`` (one slot each), gossiping every GOSSIP_MS."""
    binary = fake_engine_binary(tmp_path / "bin")
    agents: dict[str, Agent] = {}
    seeds: list[str] = []
    with ExitStack() as stack:
        for name in "abc":
            agents[name] = stack.enter_context(run_agent(
                tmp_path, [shared_model(binary)], name=f"node-{name}",
                extra={"mesh": mesh_section(seeds, GOSSIP_MS),
                       "routing": {"queue_max": 4, "queue_timeout_s": 30, "stale_after_ms": 5 * GOSSIP_MS}}))
            if not seeds:
                seeds = [mesh_address(agents[name])]
        for agent in agents.values():
            agent.wait_healthy("shared", timeout_s=30)
        for agent in agents.values():
            agent.wait_for(lambda d: d["mesh"]["peers"].get("alive", 0) == 2, 30, "two alive peers")
        yield agents


async def occupy_all(http: aiohttp.ClientSession, agents: dict[str, Agent],
                     seconds: dict[str, float]) -> dict[str, asyncio.Task]:
    """Make each agent's one slot busy with a streamed request sent to it directly (pinned
    to itself) for ``seconds[name]``; wait until A's view of B and C shows them busy.
    Returns the tasks; each gives (status, X-Viiwork-Node, monotonic time its stream ended)."""
    a = agents["a"]
    await wait_view(http, a, lambda d: all(view_of(d, f"node-{n}") and view_of(d, f"node-{n}")["slots"] == 1
                                           for n in "bc"), 20, "B and C with a slot in A's view")

    async def long(name: str) -> tuple[int, str, float]:
        async with http.post(f"{agents[name].url}/v1/chat/completions?host=node-{name}",
                             json=chat(seconds=seconds[name], stream=True)) as r:
            await r.read()
            return r.status, r.headers.get("X-Viiwork-Node", ""), time.monotonic()

    tasks = {}
    for name in "bca":
        tasks[name] = asyncio.create_task(long(name))
        await wait(agents[name], lambda d: busy_local(d) == 1, 10, f"node-{name} busy")
    await wait_view(http, a, lambda d: all(view_of(d, f"node-{n}") and view_of(d, f"node-{n}")["busy"] == 1
                                           for n in "bc"), 4 * GOSSIP_MS / 1000, "B and C busy in A's view")
    return tasks


async def test_queued_request_runs_on_the_peer_whose_slot_frees(slow_mesh3: dict[str, Agent]) -> None:
    """B's slot frees while a request waits at A: B keeps the slot, offers it to A, and A's
    request runs there within about one round trip (B's next summary is up to 2 s away)."""
    a, b, c = slow_mesh3["a"], slow_mesh3["b"], slow_mesh3["c"]
    async with aiohttp.ClientSession() as http:
        t0 = time.monotonic()
        longs = await occupy_all(http, slow_mesh3, {"b": 7.0, "c": 11.0, "a": 11.0})
        sent = time.monotonic()
        queued = asyncio.create_task(http.post(f"{a.url}/v1/chat/completions", json=chat(seconds=0.2)))
        await wait(a, lambda d: d["mesh"]["queued"].get("shared") == 1, 5, "the request queued at A")
        for peer in (b, c):  # A announced its waiter to both peers serving the model
            doc = await wait(peer, lambda d: offers(d).get("wants_in", 0) >= 1
                             and offers(d)["waiting_elsewhere"] == {"shared": 1}, 5, "A's want")
            assert offers(doc).get("want_dropped", 0) == 0
        assert offers(a.status())["wants_out"] >= 2
        assert not longs["b"].done(), (f"the machine is too slow for this test: B's request ended "
                                       f"{time.monotonic() - t0:.1f} s after the start, before A's waiter was known")

        resp = await queued
        body = await resp.json()
        b_status, b_node, b_ended = await longs["b"]
        assert (b_status, b_node) == (200, "node-b")
        assert resp.status == 200, body
        assert resp.headers["X-Viiwork-Node"] == "node-b"
        assert resp.headers["X-Viiwork-Origin"] == "node-a"
        queued_ms = float(resp.headers["X-Viiwork-Queued-Ms"])
        assert queued_ms > 1000  # it did wait for B's slot (B's request had seconds to run)
        # When A sent it to B (A's clock, mapped onto the test's by when it was sent; the
        # request reached A a little later, so this errs early by that loopback hop) vs when
        # B's stream ended (B frees the slot right after its last byte). Measured: 2-5 ms,
        # also with both cores spun by other processes; without offers it is B's next
        # summary, 0-2 s later (1979 ms in a run with offers switched off), so gossip alone
        # would pass this bound in about 15% of runs; the counters below make it certain.
        gap_ms = (sent + queued_ms / 1000 - b_ended) * 1000
        assert gap_ms < 300, f"A dispatched {gap_ms:.0f} ms after B's slot freed"

        ob, oa = offers(b.status()), offers(a.status())
        assert ob["offers_out"] >= 1 and ob["offers_taken"] >= 1 and ob["claims"] >= 1, ob
        assert ob.get("claims_unknown", 0) == 0 and ob.get("holds_expired", 0) == 0, ob
        assert ob["held"] == 0
        assert oa["offers_in_taken"] >= 1, oa
        assert offers(c.status()).get("offers_out", 0) == 0  # C's slot never freed meanwhile

        for name in "ca":
            status, node, _ = await longs[name]
            assert (status, node) == (200, f"node-{name}")
        # A's queue emptied: it told the peers, they forget its waiter
        for peer in (b, c):
            await wait(peer, lambda d: offers(d)["waiting_elsewhere"] == {}, 5, "A's queue empty at the peers")


async def test_pinned_waiter_is_not_given_another_nodes_slot(slow_mesh3: dict[str, Agent]) -> None:
    """A request pinned to C waits at A; B's slot frees first and is offered to A. The
    pinned request must not take it: it runs on C when C's slot frees."""
    a, b, c = slow_mesh3["a"], slow_mesh3["b"], slow_mesh3["c"]
    async with aiohttp.ClientSession() as http:
        longs = await occupy_all(http, slow_mesh3, {"b": 7.0, "c": 9.0, "a": 11.0})
        pinned = asyncio.create_task(http.post(f"{a.url}/v1/chat/completions?host=node-c", json=chat(seconds=0.2)))
        await wait(a, lambda d: d["mesh"]["queued"].get("shared") == 1, 5, "the pinned request queued at A")
        await wait(b, lambda d: offers(d)["waiting_elsewhere"] == {"shared": 1}, 5, "A's want at B")
        resp = await pinned
        await resp.read()
        assert resp.status == 200
        assert resp.headers["X-Viiwork-Node"] == "node-c", (
            f"a request pinned to node-c ran on {resp.headers['X-Viiwork-Node']}; "
            f"B's offers: {offers(b.status())}, A's: {offers(a.status())}")
        ob, oa, oc = offers(b.status()), offers(a.status()), offers(c.status())
        assert ob["offers_out"] >= 1 and ob["offers_declined"] >= 1 and ob.get("claims", 0) == 0, ob
        assert oa["offers_in_declined"] >= 1 and oa["offers_in_taken"] >= 1, oa  # B's declined, C's taken
        assert oc["claims"] == 1, oc
        for name in "bca":
            status, node, _ = await longs[name]
            assert (status, node) == (200, f"node-{name}")


# --- one agent: the listener's want/offer endpoints and claims --------------------------------------


@pytest.fixture
def one_agent(tmp_path: Path) -> Iterator[Agent]:
    binary = fake_engine_binary(tmp_path / "bin")
    with run_agent(tmp_path, [shared_model(binary)], name="node-b",
                   extra={"mesh": mesh_section([], 100),
                          "routing": {"queue_max": 4, "queue_timeout_s": 10}}) as agent:
        agent.wait_healthy("shared", timeout_s=30)
        mesh_address(agent)
        yield agent


async def test_malformed_wants_and_offers_are_refused(one_agent: Agent, tmp_path: Path) -> None:
    agent = one_agent
    ctx, _ = mesh_client_context(tmp_path / "client", "probe-client")
    base = f"https://{mesh_address(agent)}"
    big = json.dumps({"model": "shared", "waiting": 1, "pad": "x" * 5000})

    bad_wants = [
        (b"not json", "not valid JSON"),
        (b"\xff\xfe", "not valid JSON"),
        (b"[1, 2]", "want must be a JSON object"),
        (b'{"waiting": 1, "oldest_ms": 5}', "want.model"),
        (b'{"model": "", "waiting": 1}', "want.model"),
        (json.dumps({"model": "m" * 257, "waiting": 1}).encode(), "want.model"),
        (b'{"model": "shared", "waiting": -1}', "want.waiting"),
        (b'{"model": "shared", "waiting": true}', "want.waiting"),
        (b'{"model": "shared", "waiting": 1.5}', "want.waiting"),
        (b'{"model": "shared", "waiting": 10000001}', "want.waiting"),
        (b'{"model": "shared"}', "want.waiting"),
        (b'{"model": "shared", "waiting": 1, "oldest_ms": -5}', "want.oldest_ms"),
        (b'{"model": "shared", "waiting": 1, "oldest_ms": "5"}', "want.oldest_ms"),
        (b'{"model": "shared", "waiting": 1, "oldest_ms": false}', "want.oldest_ms"),
        (b'{"model": "shared", "waiting": 1, "oldest_ms": 1e300}', "want.oldest_ms"),
        (big.encode(), "4096"),
    ]
    bad_offers = [
        (b"{", "not valid JSON"),
        (b'"shared"', "offer must be a JSON object"),
        (b'{"offer": "abc"}', "offer.model"),
        (b'{"model": 7, "offer": "abc"}', "offer.model"),
        (b'{"model": "shared"}', "offer.offer"),
        (b'{"model": "shared", "offer": ""}', "offer.offer"),
        (json.dumps({"model": "shared", "offer": "o" * 65}).encode(), "offer.offer"),
        (b'{"model": "shared", "offer": 12}', "offer.offer"),
        (big.replace('"waiting": 1', '"offer": "abc"').encode(), "4096"),
    ]
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(ssl=ctx)) as mesh:
        async def post(path: str, data: bytes) -> tuple[int, str]:
            async with mesh.post(base + path, data=data, headers={"Content-Type": "application/json"}) as r:
                return r.status, await r.text()

        for path, cases in (("/mesh/v1/want", bad_wants), ("/mesh/v1/offer", bad_offers)):
            for data, field in cases:
                status, text = await post(path, data)
                assert status == 400, f"{path} {data[:80]!r}: {status} {text[:300]}"
                message = json.loads(text)["error"]["message"]
                assert field in message, f"{path} {data[:80]!r}: {message!r} does not name {field!r}"

        doc = agent.status()
        assert offers(doc)["want_dropped"] == len(bad_wants)
        assert offers(doc)["offer_dropped"] == len(bad_offers)
        assert offers(doc).get("wants_in", 0) == 0 and offers(doc)["waiting_elsewhere"] == {}

        # well-formed, but nothing to do: an offer for a model with no queue here, or no waiter
        for model in ("unknown", "shared"):
            status, text = await post("/mesh/v1/offer", json.dumps({"model": model, "offer": "abc"}).encode())
            assert (status, json.loads(text)) == (200, {"taking": False})
        assert (await post("/mesh/v1/want", json.dumps({"model": NOT_SERVED, "waiting": 3}).encode()))[0] == 204
        # a want from a host that is not a member: kept, but no slot is offered to it
        assert (await post("/mesh/v1/want", b'{"model": "shared", "waiting": 2, "oldest_ms": 10}'))[0] == 204
        o = offers(agent.status())
        assert o["offers_in_declined"] == 2 and o.get("offers_in_taken", 0) == 0
        assert o["wants_in"] == 2 and o["wants_not_served"] == 1
        assert o["waiting_elsewhere"] == {"shared": 2}
        assert o.get("offers_out", 0) == 0 and o["held"] == 0
        assert (await post("/mesh/v1/want", b'{"model": "shared", "waiting": 0}'))[0] == 204
        assert offers(agent.status())["waiting_elsewhere"] == {}

    async with aiohttp.ClientSession() as http:  # the agent keeps serving
        async with http.post(f"{agent.url}/v1/chat/completions", json=chat()) as r:
            assert r.status == 200 and r.headers["X-Viiwork-Node"] == "node-b"
    assert agent.proc.poll() is None


async def test_messages_arriving_in_pieces_are_read_whole(one_agent: Agent, tmp_path: Path) -> None:
    """A well-formed want whose body arrives in two pieces (headers and the first 10 bytes,
    the rest 200 ms later) is accepted; an oversized chunked body (no Content-Length) that
    arrives in pieces is refused for its size, not as broken JSON."""
    ctx, _ = mesh_client_context(tmp_path / "client", "probe-client")
    host, port = mesh_address(one_agent).rsplit(":", 1)
    body = json.dumps({"model": "shared", "waiting": 1, "oldest_ms": 5}).encode()
    reader, writer = await asyncio.open_connection(host, int(port), ssl=ctx)
    try:
        writer.write(b"POST /mesh/v1/want HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\nConnection: close\r\n\r\n" % len(body) + body[:10])
        await writer.drain()
        await asyncio.sleep(0.2)
        writer.write(body[10:])
        await writer.drain()
        answer = await asyncio.wait_for(reader.read(), 10)
    finally:
        writer.close()
    assert answer.split(b"\r\n", 1)[0] == b"HTTP/1.1 204 No Content", answer[:400]
    assert offers(one_agent.status())["waiting_elsewhere"] == {"shared": 1}

    async def pieces():
        for _ in range(5):
            yield b" " * 1000
            await asyncio.sleep(0.05)
        yield b'{"model": "shared", "waiting": 1}'

    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(ssl=ctx)) as mesh:
        async with mesh.post(f"https://{host}:{port}/mesh/v1/want", data=pieces()) as r:
            assert r.status == 400
            message = (await r.json())["error"]["message"]
    assert "4096" in message, message


async def start_probe(tmp_path: Path, agent: Agent, handle_offer: Any) -> MeshNode:
    """An in-process mesh node named "probe" (a real member, serving nothing) seeded with
    ``agent``; ``handle_offer`` answers the offers sent to it."""
    probe = MeshNode(loopback_settings(tmp_path / "probe", "probe", trust="open", mesh_id=MESH_ID,
                                       seeds=(mesh_address(agent),),
                                       gossip=GossipSettings(gossip_interval_ms=100, suspect_after_ms=2000,
                                                             dead_after_ms=4000, scale_with_size=False)))
    probe.set_local_summary([])
    probe.app.router.add_post("/mesh/v1/offer", handle_offer)
    await probe.start()
    return probe


async def start_taking_probe(tmp_path: Path, agent: Agent) -> tuple[MeshNode, asyncio.Queue[dict]]:
    """A probe (see :func:`start_probe`) that takes every offer; the offers it got, in order."""
    offered: asyncio.Queue[dict] = asyncio.Queue()

    async def handle_offer(request: web.Request) -> web.Response:
        await offered.put(await request.json())
        return web.json_response({"taking": True})

    return await start_probe(tmp_path, agent, handle_offer), offered


async def test_forward_claims_only_its_own_offer(one_agent: Agent, tmp_path: Path) -> None:
    """An in-process mesh node ("probe", a real member) tells B it has a request waiting; B
    keeps its only slot and offers it to the probe. While B holds it, forwards carrying the
    offer's id from another certificate, or a bogus id from the probe, are refused 429 (the
    held slot is not theirs and no other is free); the probe's forward with the id gets it."""
    b = one_agent
    probe, offered = await start_taking_probe(tmp_path, b)
    intruder_ctx, intruder_id = mesh_client_context(tmp_path / "intruder", "intruder")
    base = f"https://{mesh_address(b)}"
    try:
        await wait(b, lambda d: d["mesh"]["peers"].get("alive", 0) == 1, 15, "the probe alive at B")
        assert any(p.name == "node-b" and p.liveness is Liveness.ALIVE for p in probe.peers())
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(ssl=probe.client_ssl_context)) as as_probe, \
                aiohttp.ClientSession(connector=aiohttp.TCPConnector(ssl=intruder_ctx)) as as_intruder:
            async def forward(session: aiohttp.ClientSession, offer_id: str | None) -> tuple[int, str, str]:
                headers = {"X-Viiwork-Origin": "probe"} | ({"X-Viiwork-Offer": offer_id} if offer_id else {})
                async with session.post(base + "/v1/chat/completions", json=chat(seconds=0.1),
                                        headers=headers) as r:
                    await r.read()
                    return r.status, r.headers.get("X-Viiwork-Refused", ""), r.headers.get("X-Viiwork-Node", "")

            # a bogus id into a free slot: admitted like any forward
            assert await forward(as_intruder, "0123456789abcdef") == (200, "", "node-b")
            assert offers(b.status())["claims_unknown"] == 1

            async with as_probe.post(base + "/mesh/v1/want",
                                     json={"model": "shared", "waiting": 1, "oldest_ms": 50}) as r:
                assert r.status == 204
            offer = await asyncio.wait_for(offered.get(), 5)
            got_at = time.monotonic()
            assert offer["model"] == "shared" and 1 <= len(offer["offer"]) <= 64
            # B's slot is held for the probe (hold: 1 s)
            assert await forward(as_intruder, offer["offer"]) == (429, "no-slot", "")
            assert await forward(as_probe, "0123456789abcdef") == (429, "no-slot", "")
            assert await forward(as_probe, None) == (429, "no-slot", "")
            elapsed = time.monotonic() - got_at
            assert await forward(as_probe, offer["offer"]) == (200, "", "node-b"), f"claimed after {elapsed:.2f} s"
            o = offers(b.status())
            assert o["offers_out"] == 1 and o["offers_taken"] == 1 and o["claims"] == 1, o
            assert o["claims_unknown"] == 3 and o.get("holds_expired", 0) == 0 and o["held"] == 0, o
            assert b.status()["mesh"]["forwards"]["refused_in"] == 3
            # the id is spent: another forward with it is an ordinary one (slot free again)
            assert await forward(as_probe, offer["offer"]) == (200, "", "node-b")
            assert offers(b.status())["claims"] == 1  # (and claims_unknown 4)
            async with aiohttp.ClientSession() as http, http.get(f"{b.url}/metrics") as r:
                metrics = (await r.text()).splitlines()
            assert 'viiwork_mesh_offers_total{event="claims"} 1.0' in metrics
            assert 'viiwork_mesh_offers_total{event="claims_unknown"} 4.0' in metrics
            assert "viiwork_mesh_slots_held 0.0" in metrics
    finally:
        await probe.stop(leave=False)
    assert intruder_id != probe.node_id


def test_slot_offers_off_makes_no_offers(tmp_path: Path) -> None:
    """``routing.slot_offers = false``: a want from a member arriving while the slot is free
    is noted (the node still answers) but gets no offer; a request that queues here sends
    no want. The same want with offers on gets an offer within a second (see above)."""
    binary = fake_engine_binary(tmp_path / "bin")
    with run_agent(tmp_path, [shared_model(binary)], name="node-b",
                   extra={"mesh": mesh_section([], 100),
                          "routing": {"queue_max": 4, "queue_timeout_s": 10, "slot_offers": False}}) as b:
        b.wait_healthy("shared", timeout_s=30)

        async def run() -> None:
            probe, offered = await start_taking_probe(tmp_path, b)
            try:
                await wait(b, lambda d: d["mesh"]["peers"].get("alive", 0) == 1, 15, "the probe alive at B")
                async with aiohttp.ClientSession(
                        connector=aiohttp.TCPConnector(ssl=probe.client_ssl_context)) as as_probe:
                    async with as_probe.post(f"https://{mesh_address(b)}/mesh/v1/want",
                                             json={"model": "shared", "waiting": 1, "oldest_ms": 50}) as r:
                        assert r.status == 204
                with pytest.raises(TimeoutError):
                    await asyncio.wait_for(offered.get(), 1.5)
                async with aiohttp.ClientSession() as http:
                    first = asyncio.create_task(http.post(f"{b.url}/v1/chat/completions", json=chat(seconds=1.0)))
                    await wait(b, lambda d: busy_local(d) == 1, 5, "B's slot busy")
                    second = await http.post(f"{b.url}/v1/chat/completions", json=chat(seconds=0.1))
                    assert second.status == 200
                    assert float(second.headers["X-Viiwork-Queued-Ms"]) > 300  # it did queue
                    assert (await first).status == 200
                o = offers(b.status())
                assert o["waiting_elsewhere"] == {"shared": 1} and o["wants_in"] == 1, o
                assert o.get("offers_out", 0) == 0 and o.get("wants_out", 0) == 0 and o["held"] == 0, o
            finally:
                await probe.stop(leave=False)

        asyncio.run(run())


async def test_a_request_that_runs_no_longer_counts_as_waiting(tmp_path: Path) -> None:
    """A request that queued and then started running leaves the origin queue at once: it
    neither fills ``queue_max`` (a new request finds the free slot) nor stays the "oldest
    waiter" that would keep freed slots from peers' waiters."""
    binary = fake_engine_binary(tmp_path / "bin")
    model = shared_model(binary) | {"parallel": 2}
    with run_agent(tmp_path, [model], name="node-a",
                   extra={"mesh": mesh_section([], 100),
                          "routing": {"queue_max": 1, "queue_timeout_s": 10}}) as a:
        await asyncio.to_thread(lambda: a.wait_healthy("shared", timeout_s=30))
        async with aiohttp.ClientSession() as http:
            async def post(seconds: float) -> tuple[int, float]:
                async with http.post(f"{a.url}/v1/chat/completions", json=chat(seconds=seconds)) as r:
                    await r.read()
                    return r.status, float(r.headers.get("X-Viiwork-Queued-Ms", "nan"))

            first = asyncio.create_task(post(1.0))
            second = asyncio.create_task(post(2.0))
            await wait(a, lambda d: busy_local(d) == 2, 5, "both slots busy")
            third = asyncio.create_task(post(4.0))
            await wait(a, lambda d: d["mesh"]["queued"].get("shared") == 1, 5, "the third request queued")
            assert (await first)[0] == 200
            # the third runs now (on the slot the first freed): nothing waits any more
            await wait(a, lambda d: busy_local(d) == 2 and not d["mesh"]["queued"], 5, "the third running")
            assert (await second)[0] == 200  # a slot is free again; the third still runs
            status, queued_ms = await post(0.1)
            assert status == 200, "a running request still counted against queue_max"
            assert queued_ms < 500, queued_ms
            status, queued_ms = await third
            assert status == 200 and queued_ms > 500, queued_ms


# --- found by review: holds never honoured or never freed; queue counts -----------------------------


async def test_a_draining_node_makes_no_offer_it_would_refuse(one_agent: Agent, tmp_path: Path) -> None:
    """B drains (`viiworkctl drain`: it admits no new request, forwards included). A member
    then tells B it has a request waiting while B's slot is free. B must not keep its slot
    for that request only to refuse the claim: it makes no offer."""
    import subprocess
    import sys

    b = one_agent
    probe, offered = await start_taking_probe(tmp_path, b)
    base = f"https://{mesh_address(b)}"
    try:
        await wait(b, lambda d: d["mesh"]["peers"].get("alive", 0) == 1, 15, "the probe alive at B")
        ctl = Path(sys.executable).parent / "viiworkctl"
        sock = tmp_path / "node-b" / "admin.sock"
        await asyncio.to_thread(subprocess.run, [str(ctl), "drain", "--socket", str(sock)],
                                check=True, capture_output=True, timeout=30)
        assert b.status()["node"]["draining"] is True
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(ssl=probe.client_ssl_context)) as as_probe:
            async with as_probe.post(base + "/mesh/v1/want",
                                     json={"model": "shared", "waiting": 1, "oldest_ms": 50}) as r:
                assert r.status == 204
            try:
                offer = await asyncio.wait_for(offered.get(), 1.5)
            except TimeoutError:
                offer = None
            assert offer is None, f"B offered its slot while draining; B's offers: {offers(b.status())}"
            o = offers(b.status())
            assert o["wants_in"] == 1 and o.get("offers_out", 0) == 0 and o["held"] == 0, o
    finally:
        await probe.stop(leave=False)


async def test_a_hold_is_freed_whatever_the_offer_answer(one_agent: Agent, tmp_path: Path) -> None:
    """A member answers B's offer with a body B cannot parse (deeply nested JSON: json.loads
    raises RecursionError, not ValueError). The hold must still end within about HOLD_MS:
    B's slot must not stay held (busy to every peer and to B's own requests) for ever."""
    b = one_agent

    async def handle_offer(request: web.Request) -> web.Response:
        await request.read()
        return web.Response(body=b"[" * 100_000, content_type="application/json")

    probe = await start_probe(tmp_path, b, handle_offer)
    try:
        await wait(b, lambda d: d["mesh"]["peers"].get("alive", 0) == 1, 15, "the probe alive at B")
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(ssl=probe.client_ssl_context)) as as_probe:
            async with as_probe.post(f"https://{mesh_address(b)}/mesh/v1/want",
                                     json={"model": "shared", "waiting": 1, "oldest_ms": 50}) as r:
                assert r.status == 204
        await wait(b, lambda d: offers(d).get("offers_out", 0) == 1, 5, "B's offer")
        doc = await wait(b, lambda d: offers(d)["held"] == 0 and busy_local(d) == 0, 6,
                         "B's hold freed (HOLD_MS is 1 s, the message timeout 2 s)")
        assert doc
    finally:
        await probe.stop(leave=False)


async def test_a_member_that_takes_offers_and_never_claims_cannot_starve_local_waiters(
        one_agent: Agent, tmp_path: Path) -> None:
    """A member (open trust: anyone who knows the mesh id) tells B every 50 ms that its oldest
    waiter is a day old, takes every offer and never claims one. B's own requests pinned to
    B, each sent while B's slot is held for the member, still run within about HOLD_MS: the
    day counts as B's queue timeout at most, and each unclaimed offer is a strike (its wants
    ignored 1 s, then 2 s, ...). Before: B kept its only slot held for the member, and the
    pinned request got 429 after the queue timeout (10 s)."""
    b = one_agent
    probe, offered = await start_taking_probe(tmp_path, b)
    base = f"https://{mesh_address(b)}"
    wants_sent = 0
    try:
        await wait(b, lambda d: d["mesh"]["peers"].get("alive", 0) == 1, 15, "the probe alive at B")
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(ssl=probe.client_ssl_context)) as as_probe, \
                aiohttp.ClientSession() as http:
            async def flood() -> None:
                nonlocal wants_sent
                while True:
                    async with as_probe.post(base + "/mesh/v1/want",
                                             json={"model": "shared", "waiting": 1, "oldest_ms": 86_000_000}) as r:
                        assert r.status == 204
                    wants_sent += 1
                    await asyncio.sleep(0.05)

            flooding = asyncio.create_task(flood())
            offered_at: list[float] = []
            try:
                for i in range(3):
                    # B's slot is held for the probe now (each offer after the last strike's time)
                    await asyncio.wait_for(offered.get(), 10)
                    t0 = time.monotonic()
                    offered_at.append(t0)
                    async with http.post(f"{b.url}/v1/chat/completions?host=node-b", json=chat(seconds=0.2)) as r:
                        await r.read()
                        took = time.monotonic() - t0
                        assert r.status == 200, (f"pinned request {i}: {r.status} after {took:.1f} s; "
                                                 f"B's offers: {offers(b.status())}")
                    assert took < 3.0, f"pinned request {i} took {took:.1f} s; B's offers: {offers(b.status())}"
                assert not flooding.done()
            finally:
                flooding.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await flooding
        o = offers(b.status())
        assert wants_sent >= 10 and o["wants_in"] >= wants_sent, (wants_sent, o)
        assert o["holds_expired"] >= 3 and o["strikes"] == o["holds_expired"] and o.get("claims", 0) == 0, o
        assert o["offers_out"] <= o["strikes"] + 1, o  # one offer per strike's time at most
        # between offers: the hold (1 s) and the strike's time, 1 s then 2 s (at least; measured ~2.0, ~3.0)
        gaps = [later - earlier for earlier, later in zip(offered_at, offered_at[1:], strict=False)]
        assert gaps[0] >= 1.9 and gaps[1] >= 2.9, gaps
        logged = [line for line in b.log_text().splitlines() if "did not claim it" in line]
        assert len(logged) == 1 and "probe" in logged[0] and "strike 1" in logged[0], logged
    finally:
        await probe.stop(leave=False)


async def test_queued_requests_are_reported_where_they_wait(tmp_path: Path) -> None:
    """Two agents, one slot each, both busy. Two requests queue at A one after the other
    (not in one event-loop turn). A reports them per model in /v1/status and /metrics (the
    mesh's origin queue, not the unused standalone one); B knows A has at least one waiting
    (`waiting_elsewhere` is the count A sent when its oldest waiter last changed)."""
    binary = fake_engine_binary(tmp_path / "bin")
    seeds: list[str] = []
    agents: dict[str, Agent] = {}
    with ExitStack() as stack:
        for name in "ab":
            agents[name] = stack.enter_context(run_agent(
                tmp_path, [shared_model(binary)], name=f"node-{name}",
                extra={"mesh": mesh_section(seeds, 200), "routing": {"queue_max": 4, "queue_timeout_s": 30}}))
            if not seeds:
                seeds = [mesh_address(agents[name])]
        a, b = agents["a"], agents["b"]
        for agent in (a, b):
            await asyncio.to_thread(agent.wait_healthy, "shared", None, 30)
            await wait(agent, lambda d: d["mesh"]["peers"].get("alive", 0) == 1, 30, "one alive peer")
        async with aiohttp.ClientSession() as http:
            async def post(url: str, seconds: float) -> int:
                async with http.post(url, json=chat(seconds=seconds)) as r:
                    await r.read()
                    return r.status

            await wait_view(http, a, lambda d: (view_of(d, "node-b") or {}).get("slots") == 1, 20, "B in A's view")
            longs = [asyncio.create_task(post(f"{agents[n].url}/v1/chat/completions?host=node-{n}", 6.0)) for n in "ab"]
            for agent in (a, b):
                await wait(agent, lambda d: busy_local(d) == 1, 10, "busy")
            await wait_view(http, a, lambda d: (view_of(d, "node-b") or {}).get("busy") == 1, 5, "B busy in A's view")
            queued = [asyncio.create_task(post(f"{a.url}/v1/chat/completions", 0.1))]
            await wait(a, lambda d: d["mesh"]["queued"].get("shared") == 1, 5, "the first request queued at A")
            await wait(b, lambda d: offers(d)["waiting_elsewhere"] == {"shared": 1}, 5, "A's first want at B")
            queued.append(asyncio.create_task(post(f"{a.url}/v1/chat/completions", 0.1)))
            await wait(a, lambda d: d["mesh"]["queued"].get("shared") == 2, 5, "the second request queued at A")
            await asyncio.sleep(0.5)
            seen = offers(b.status())["waiting_elsewhere"]
            models = a.status()["models"]
            async with http.get(f"{a.url}/metrics") as r:
                metrics = (await r.text()).splitlines()
            for task in longs + queued:
                assert await task == 200
            assert [m["queued"] for m in models if m["name"] == "shared"] == [2], models
            assert 'viiwork_model_queued{model="shared"} 2.0' in metrics
            assert seen.get("shared", 0) >= 1, f"A has 2 requests queued; B's waiting_elsewhere: {seen}"
