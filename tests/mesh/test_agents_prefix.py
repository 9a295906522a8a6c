"""Prefix-aware routing with real agents on loopback (issue 18): a conversation's later turns
land on the backend that served its first turn while it has room, and move when it is full;
across the mesh, a peer's published digests draw the turn to it; every answer says why in
``X-Viiwork-Route``.

Fake llama-servers (separate processes) stand for the engines; ``parallel = 1`` makes "full"
one request in flight.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from support.agent import Agent, run_agent
from support.engines import fake_engine_binary
from viiwork.agent.serving.prefixes import prefix_key

SLOW = {"FAKE_LOAD_S": "0.1", "FAKE_TOKENS": "10", "FAKE_TOKEN_DELAY_S": "0.1"}  # ~1 s per answer
SYSTEM = "You answer questions about the routing of inference requests. " * 60  # ~3.8 KB: 3 blocks


def turns(n: int, conversation: str = "c1", system: str = SYSTEM) -> dict[str, Any]:
    """A conversation after ``n`` user turns, sent with its whole history."""
    messages = [{"role": "system", "content": system}]
    for i in range(n):
        messages.append({"role": "user", "content": f"{conversation} question {i}: " + "why? " * 120})
        if i < n - 1:
            messages.append({"role": "assistant", "content": f"answer {i} " * 100})
    return {"model": "m", "messages": messages, "max_tokens": 8}


def mesh_section(seeds: list[str]) -> dict[str, Any]:
    return {"trust": "open", "mesh_id": "test-prefix", "listen": "127.0.0.1:0", "advertise": "127.0.0.1",
            "discovery": ["seeds"], "seeds": seeds, "gossip_interval_ms": 100, "suspect_after_ms": 1000,
            "dead_after_ms": 3000}


def mesh_address(agent: Agent) -> str:
    return agent.wait_for(lambda d: bool(d["mesh"]["self"]["mesh"]), 30, "mesh address")["mesh"]["self"]["mesh"]


def model(backends: int) -> dict[str, Any]:
    return {"name": "m", "engine": "llamacpp", "path": "/dev/null", "parallel": 1, "backends": backends,
            "env": SLOW}


async def post(http: aiohttp.ClientSession, agent: Agent, body: dict[str, Any]) -> tuple[int, dict[str, str]]:
    async with http.post(f"{agent.url}/v1/chat/completions", json=body) as r:
        await r.read()
        return r.status, {k: v for k, v in r.headers.items() if k.startswith("X-Viiwork")}


@pytest.fixture
def two_backends(tmp_path: Path) -> Iterator[Agent]:
    binary = fake_engine_binary(tmp_path / "bin")
    with run_agent(tmp_path, [{**model(2), "llamacpp": {"binary": str(binary)}}]) as agent:
        agent.wait_for(lambda d: all(b["state"] == "healthy" for m in d["models"] for b in m["backends"]),
                       30, "backends healthy")
        yield agent


async def test_later_turns_follow_the_first_turns_backend_and_move_when_it_is_full(two_backends: Agent) -> None:
    agent = two_backends
    async with aiohttp.ClientSession() as http:
        status, first = await post(http, agent, turns(1))
        assert status == 200 and first["X-Viiwork-Route"] == "node-a:least-loaded"  # nothing cached anywhere
        home = first["X-Viiwork-Backend"]
        for n in (2, 3):
            status, later = await post(http, agent, turns(n))
            assert status == 200 and later["X-Viiwork-Backend"] == home
            assert later["X-Viiwork-Route"].startswith("node-a:prefix-hit blocks=")
        # A turn busies its home (parallel = 1: full); the next one moves to the other backend.
        running = asyncio.create_task(post(http, agent, turns(4)))  # on `home` (a hit, ~1 s)
        await asyncio.sleep(0.3)
        status, moved = await post(http, agent, turns(5))
        assert status == 200 and moved["X-Viiwork-Backend"] != home
        assert moved["X-Viiwork-Route"] == "node-a:least-loaded"  # no free backend holds it
        status, ran = await running
        assert status == 200 and ran["X-Viiwork-Backend"] == home
        # Both free again: the backend holding the longest prefix (turn 5's) takes turn 6.
        status, back = await post(http, agent, turns(6))
        assert status == 200 and back["X-Viiwork-Backend"] == moved["X-Viiwork-Backend"]
        assert back["X-Viiwork-Route"].startswith("node-a:prefix-hit")
        async with http.get(f"{agent.url}/metrics") as r:
            metrics = await r.text()
    assert 'viiwork_routes_total{model="m",route="prefix-hit"}' in metrics
    assert 'viiwork_prefix_hit_blocks_total{model="m"}' in metrics


@pytest.fixture
def mesh2(tmp_path: Path) -> Iterator[dict[str, Agent]]:
    binary = fake_engine_binary(tmp_path / "bin")
    agents: dict[str, Agent] = {}
    seeds: list[str] = []
    with ExitStack() as stack:
        for name in "ab":
            agents[name] = stack.enter_context(run_agent(
                tmp_path, [{**model(1), "llamacpp": {"binary": str(binary)}}], name=f"node-{name}",
                extra={"mesh": mesh_section(seeds), "routing": {"stale_after_ms": 3000}}))
            if not seeds:
                seeds = [mesh_address(agents[name])]
        for agent in agents.values():
            agent.wait_for(lambda d: all(b["state"] == "healthy" for m in d["models"] for b in m["backends"]),
                           30, "backends healthy")
            agent.wait_for(lambda d: d.get("mesh", {}).get("peers", {}).get("alive", 0) == 1, 30, "one alive peer")
        yield agents


def whole_blocks(body: dict[str, Any]) -> int:
    key = prefix_key(body, "m", "")
    assert key is not None
    return len(key.digests)


def published_digests(doc: dict[str, Any], peer: str) -> int:
    """The digests ``peer`` publishes for model m while it has a free slot (0: none, or busy)."""
    for node in doc.get("nodes", []):
        if node["name"] == peer:
            return next((m.get("prefix_digests") or 0 for m in node["models"] if m["name"] == "m" and m["busy"] == 0),
                        0)
    return 0


async def test_a_turn_sent_to_another_node_is_forwarded_to_the_node_holding_its_prefix(
        mesh2: dict[str, Agent]) -> None:
    a, b = mesh2["a"], mesh2["b"]
    async with aiohttp.ClientSession() as http:
        status, first = await post(http, b, turns(1))  # runs on b: a free local backend comes first
        assert status == 200 and first["X-Viiwork-Node"] == "node-b"
        # a learns b's digests from its summary (published at most every few seconds), and that
        # b is idle again (its summary may show the first turn busy a moment longer)
        for _ in range(100):
            async with http.get(f"{a.url}/v1/mesh") as r:
                if published_digests(await r.json(), "node-b") > 0:
                    break
            await asyncio.sleep(0.1)
        else:
            raise AssertionError("node-b's prefix digests never reached node-a")
        status, later = await post(http, a, turns(2))
        # without the digest it would run on a's own free backend
        assert status == 200 and later["X-Viiwork-Node"] == "node-b", later.get("X-Viiwork-Route")
        hops = later["X-Viiwork-Route"].split(", ")
        assert hops[0].startswith("node-a:prefix-hit blocks=") and hops[1].startswith("node-b:prefix-hit blocks=")
        # b remembered the forwarded turn too: turn 3, sent to b, finds all of turn 2's blocks there
        status, third = await post(http, b, turns(3))
        assert status == 200 and third["X-Viiwork-Node"] == "node-b"
        found = int(third["X-Viiwork-Route"].rsplit("blocks=", 1)[1])
        assert found == whole_blocks(turns(2)) > whole_blocks(turns(1))
        # a conversation nobody holds (another system prompt) stays on a
        status, fresh = await post(http, a, turns(1, "c9", system="Another system prompt. " * 200))
        assert status == 200 and fresh["X-Viiwork-Node"] == "node-a"
        assert fresh["X-Viiwork-Route"] == "node-a:least-loaded"
