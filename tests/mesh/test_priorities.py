"""Priorities and tenant turns between real agents in keys mode (issue 17 item 7; docs/routing.md,
"The origin queue" and "Slot offers"; docs/security.md, "Priorities").

Node B serves ``shared`` with one slot (a fake llama-server: ``max_tokens`` sets how long a
request holds it, ``TOKEN_S`` per token); node A serves nothing and forwards. Keys come from
the issuing module (what ``viiworkctl keys issue`` signs) with a tenant and a priority each. The module's tests:

- a low-priority tenant's burst of 20 queued at B does not delay a high-priority request
  beyond the one request in flight (one service time);
- two tenants of one priority alternate at B: the second, arriving behind the first's burst,
  waits one turn per request, not the burst;
- across the two agents, a high-priority request waiting at A gets B's freed slot (B offers
  it to A's want) before an older normal-priority request waiting at B itself;
- a member whose want states ``high`` and whose claim carries a low-priority key is refused
  the held slot and gets a strike.
"""

from __future__ import annotations

import asyncio
import shutil
import tempfile
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from support.agent import Agent, run_agent
from support.engines import fake_engine_binary
from support.mesh_nodes import loopback_settings
from viiwork.agent.auth.claims import KeyClaims, Priority, Scope
from viiwork.agent.auth.gate import FORWARD_KEY_HEADER
from viiwork.agent.auth.issuing import init_issuer, new_jti, sign_key
from viiwork.mesh.membership import GossipSettings
from viiwork.mesh.node import MeshNode

pytestmark = pytest.mark.timeout(120)

MESH_ID = "priority-mesh"
TOKEN_S = 0.05
SERVICE_S = 0.25  # a "service time": how long each request of the burst holds the slot
OCCUPY_S = 1.0  # the request in flight when the others queue


def chat(seconds: float) -> dict:
    return {"model": "shared", "max_tokens": max(1, round(seconds / TOKEN_S)),
            "messages": [{"role": "user", "content": "hi"}]}


def mesh_section(seeds: list[str]) -> dict:
    return {"trust": "open", "mesh_id": MESH_ID, "listen": "127.0.0.1:0", "advertise": "127.0.0.1",
            "discovery": ["seeds"], "seeds": seeds, "gossip_interval_ms": 100, "suspect_after_ms": 2000,
            "dead_after_ms": 4000}


class Mesh:
    def __init__(self, a: Agent, b: Agent, keys: dict[str, str], tmp: Path) -> None:
        self.a, self.b, self.keys, self.tmp = a, b, keys, tmp


@pytest.fixture(scope="module")
def mesh() -> Iterator[Mesh]:
    tmp = Path(tempfile.mkdtemp(prefix="viiwork-priorities-", dir="/tmp"))
    try:
        issuer = init_issuer(tmp / "issuer")  # as `viiworkctl keys issuer init` (test_keys_cli.py runs that)
        pub = tmp / "issuer" / "issuer.pub"

        def make(tenant: str, priority: Priority, scope: frozenset[Scope] = frozenset({Scope.INFERENCE})) -> str:
            return sign_key(issuer, KeyClaims(iss=issuer.name, aud=(MESH_ID,), jti=new_jti(),
                                              exp=int(time.time()) + 3600, tenant=tenant, priority=priority,
                                              scope=scope))

        keys = {"reader": make("ops", Priority.NORMAL, frozenset({Scope.INFERENCE, Scope.READ})),
                "bulk_low": make("bulk", Priority.LOW), "web_high": make("web", Priority.HIGH),
                "x": make("tenant-x", Priority.NORMAL), "y": make("tenant-y", Priority.NORMAL),
                "probe_low": make("probe", Priority.LOW)}
        binary = fake_engine_binary(tmp / "bin")
        auth = {"mode": "keys", "issuer_keys": str(pub), "allow_open_mesh": True}
        model = {"name": "shared", "engine": "llamacpp", "path": "/dev/null", "parallel": 1, "backends": 1,
                 "llamacpp": {"binary": str(binary)},
                 "env": {"FAKE_LOAD_S": "0.1", "FAKE_TOKENS": "400", "FAKE_TOKEN_DELAY_S": str(TOKEN_S)}}
        with ExitStack() as stack:
            b = stack.enter_context(run_agent(tmp, [model], name="node-b", api_key=keys["reader"],
                                              extra={"mesh": mesh_section([]), "auth": auth,
                                                     "routing": {"queue_max": 64, "queue_timeout_s": 20}}))
            seed = b.wait_for(lambda d: bool(d["mesh"]["self"]["mesh"]), 30, "mesh address")["mesh"]["self"]["mesh"]
            a = stack.enter_context(run_agent(tmp, [], name="node-a", api_key=keys["reader"],
                                              extra={"mesh": mesh_section([seed]), "auth": auth}))
            b.wait_healthy("shared")
            a.wait_for(lambda d: d["mesh"]["peers"].get("alive", 0) == 1, 30, "node-b alive at node-a")
            b.wait_for(lambda d: d["mesh"]["peers"].get("alive", 0) == 1, 30, "node-a alive at node-b")
            yield Mesh(a, b, keys, tmp)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as session:
        yield session


def queued_at(agent: Agent) -> int:
    return next(m for m in agent.status()["models"] if m["name"] == "shared")["queued"]


async def wait(agent: Agent, predicate: Any, what: str, timeout_s: float = 15) -> dict:
    return await asyncio.to_thread(agent.wait_for, predicate, timeout_s, what)


def shared(doc: dict) -> dict:
    return next(m for m in doc["models"] if m["name"] == "shared")


def idle(doc: dict) -> bool:
    m = shared(doc)
    return m["queued"] == 0 and sum(b.get("busy", 0) for b in m["backends"]) == 0 and doc["mesh"]["offers"]["held"] == 0


class Finishes:
    """Requests sent concurrently; the labels of those answered, in the order they ended."""

    def __init__(self, http: aiohttp.ClientSession) -> None:
        self.http = http
        self.order: list[str] = []
        self.answers: dict[str, tuple[int, dict[str, str]]] = {}
        self.tasks: list[asyncio.Task[None]] = []

    def send(self, label: str, url: str, token: str, seconds: float) -> None:
        async def one() -> None:
            async with self.http.post(f"{url}/v1/chat/completions", json=chat(seconds),
                                      headers={"Authorization": f"Bearer {token}"}) as r:
                await r.read()
                self.answers[label] = (r.status, dict(r.headers))
                self.order.append(label)
        self.tasks.append(asyncio.get_running_loop().create_task(one()))

    async def all(self) -> None:
        await asyncio.wait_for(asyncio.gather(*self.tasks), 60)
        assert all(status == 200 for status, _ in self.answers.values()), self.answers


async def test_a_low_priority_burst_does_not_delay_a_high_priority_request_beyond_one_service_time(
        mesh: Mesh, http: aiohttp.ClientSession) -> None:
    b = mesh.b
    await wait(b, idle, "node-b idle")
    runs = Finishes(http)
    # The burst's first holds the slot long enough (OCCUPY_S) for the others to queue, on a loaded host too.
    runs.send("low-running", b.url, mesh.keys["bulk_low"], OCCUPY_S)
    await wait(b, lambda d: sum(x.get("busy", 0) for x in shared(d)["backends"]) == 1, "B's slot busy")
    for i in range(19):
        runs.send(f"low{i}", b.url, mesh.keys["bulk_low"], SERVICE_S)
    await wait(b, lambda d: shared(d)["queued"] == 19, "the burst queued behind the one in flight")
    ended_before = len(runs.order)
    runs.send("high", b.url, mesh.keys["web_high"], SERVICE_S)
    await runs.all()
    before = runs.order[ended_before:runs.order.index("high")]
    assert before in ([], ["low-running"]), f"the high-priority request ended after {before}"
    # It waited for the request in flight only: at most its service time (and a margin for a loaded host).
    queued_ms = float(runs.answers["high"][1]["X-Viiwork-Queued-Ms"])
    assert queued_ms <= OCCUPY_S * 1000 + 500, queued_ms


async def test_two_tenants_of_one_priority_take_turns(mesh: Mesh, http: aiohttp.ClientSession) -> None:
    b = mesh.b
    await wait(b, idle, "node-b idle")
    runs = Finishes(http)
    runs.send("x-running", b.url, mesh.keys["x"], OCCUPY_S)
    await wait(b, lambda d: sum(x.get("busy", 0) for x in shared(d)["backends"]) == 1, "B's slot busy")
    for i in range(7):
        runs.send(f"x{i}", b.url, mesh.keys["x"], 0.2)
    await wait(b, lambda d: shared(d)["queued"] == 7, "x's burst queued")
    ended_before = len(runs.order)
    for i in range(3):
        runs.send(f"y{i}", b.url, mesh.keys["y"], 0.2)
    await runs.all()
    tenants = "".join(label[0] for label in runs.order[ended_before:])
    # y arrived behind x's 7 waiting: it waits one of x's turns per request, not the burst.
    first, last = tenants.index("y"), tenants.rindex("y")
    assert first <= 3 and tenants[first:last + 1] == "yxyxy", runs.order


async def test_a_high_priority_want_beats_an_older_normal_waiter_for_a_freed_slot(
        mesh: Mesh, http: aiohttp.ClientSession) -> None:
    a, b = mesh.a, mesh.b
    await wait(b, idle, "node-b idle")
    runs = Finishes(http)
    runs.send("running", b.url, mesh.keys["x"], 1.5)  # holds B's only slot
    await wait(b, lambda d: sum(x.get("busy", 0) for x in shared(d)["backends"]) == 1, "B's slot busy")
    runs.send("older-normal", b.url, mesh.keys["x"], 0.2)  # waits at B
    await wait(b, lambda d: shared(d)["queued"] == 1, "a normal request waiting at B")
    runs.send("high-at-a", a.url, mesh.keys["web_high"], 0.2)  # waits at A, announced to B
    await wait(b, lambda d: d["mesh"]["offers"]["waiting_elsewhere"].get("shared", 0) == 1,
               "A's high-priority want noted at B")
    assert "running" not in runs.order, "the slot freed before the want arrived: nothing was compared"
    await runs.all()
    assert runs.order == ["running", "high-at-a", "older-normal"], runs.order
    assert runs.answers["high-at-a"][1]["X-Viiwork-Node"] == "node-b"
    offers = b.status()["mesh"]["offers"]
    assert offers["claims"] >= 1 and offers.get("claims_below_priority", 0) == 0, offers


async def test_a_claim_below_its_wants_priority_is_refused_and_struck(mesh: Mesh, http: aiohttp.ClientSession) -> None:
    """An in-process member ("probe") announces a high-priority want, takes B's offer and claims
    it with a low-priority key: B does not give it the held slot (the slot goes to whoever is
    next: nobody, so the forward is then admitted into the free slot like any forward), counts
    ``claims_below_priority`` and a strike, and ignores the probe's wants for a while."""
    b = mesh.b
    await wait(b, idle, "node-b idle")
    offered: asyncio.Queue[dict] = asyncio.Queue()

    async def handle_offer(request: web.Request) -> web.Response:
        await offered.put(await request.json())
        return web.json_response({"taking": True})

    seed = b.status()["mesh"]["self"]["mesh"]
    probe = MeshNode(loopback_settings(mesh.tmp / "probe", "probe", trust="open", mesh_id=MESH_ID, seeds=(seed,),
                                       gossip=GossipSettings(gossip_interval_ms=100, suspect_after_ms=2000,
                                                             dead_after_ms=4000, scale_with_size=False)))
    probe.set_local_summary([])
    probe.app.router.add_post("/mesh/v1/offer", handle_offer)
    await probe.start()
    try:
        await wait(b, lambda d: d["mesh"]["peers"].get("alive", 0) == 2, "the probe alive at B")
        before = b.status()["mesh"]["offers"]
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(ssl=probe.client_ssl_context)) as as_probe:
            base = f"https://{seed}"
            want = {"model": "shared", "waiting": 1, "oldest_ms": 10, "ext": {"priority": [1, "high"]}}
            async with as_probe.post(base + "/mesh/v1/want", json=want) as r:
                assert r.status == 204
            offer = await asyncio.wait_for(offered.get(), 5)
            assert offer["ext"] == {"priority": [1, "high"]}  # the priority the offer was made for
            headers = {"X-Viiwork-Origin": "probe", "X-Viiwork-Offer": offer["offer"],
                       FORWARD_KEY_HEADER: mesh.keys["probe_low"]}
            async with as_probe.post(base + "/v1/chat/completions", json=chat(0.1), headers=headers) as r:
                await r.read()
                assert r.status == 200  # the slot was freed first, then taken like any forward's
        after = b.status()["mesh"]["offers"]
        assert after.get("claims_below_priority", 0) == before.get("claims_below_priority", 0) + 1, after
        assert after["strikes"] == before.get("strikes", 0) + 1 and after.get("claims", 0) == before.get("claims", 0), after
        assert "claimed an offer made for its high-priority want with a low-priority key" in b.log_text()
    finally:
        await probe.stop(leave=False)
