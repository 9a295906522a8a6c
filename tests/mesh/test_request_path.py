"""The origin queue in mesh mode between two real agents on loopback (docs/routing.md, "The
origin queue"): a wait that outlasts ``routing.queue_timeout_s`` ends in 429 with
``Retry-After``, and a new request does not get past a full queue.

Each agent runs one fake llama-server (a separate process) with one slot; a slot is held busy
by a slow streamed request sent straight to that node.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path

import aiohttp
import pytest
from conftest import require

from support.agent import Agent, run_agent
from support.engines import fake_engine_binary
from support.promtool import check_metrics, find_promtool

# ~6 s per answer: longer than the queue timeout below, short enough to keep the tests fast.
SLOW = {"FAKE_LOAD_S": "0.1", "FAKE_TOKENS": "60", "FAKE_TOKEN_DELAY_S": "0.1"}
QUEUE_TIMEOUT_S = 2.0


def chat(stream: bool = False, max_tokens: int | None = None) -> dict:
    """A chat request; the fake engine answers ``max_tokens`` chunks (all 60 without)."""
    doc = {"model": "shared", "stream": stream, "messages": [{"role": "user", "content": "hi"}]}
    if max_tokens is not None:
        doc["max_tokens"] = max_tokens
    return doc


def mesh_section(seeds: list[str]) -> dict:
    return {"trust": "open", "mesh_id": "test-queue", "listen": "127.0.0.1:0", "advertise": "127.0.0.1",
            "discovery": ["seeds"], "seeds": seeds, "gossip_interval_ms": 100, "suspect_after_ms": 1000,
            "dead_after_ms": 3000}


@pytest.fixture(scope="module")
def mesh2(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Agent]]:
    tmp = tmp_path_factory.mktemp("mesh2")
    binary = fake_engine_binary(tmp / "bin")
    agents: dict[str, Agent] = {}
    seeds: list[str] = []
    with ExitStack() as stack:
        for name in "ab":
            models = [{"name": "shared", "engine": "llamacpp", "path": "/dev/null", "parallel": 1, "backends": 1,
                       "llamacpp": {"binary": str(binary)}, "env": SLOW}]
            agents[name] = stack.enter_context(run_agent(
                tmp, models, name=f"node-{name}",
                extra={"mesh": mesh_section(seeds),
                       "routing": {"queue_max": 1, "queue_timeout_s": QUEUE_TIMEOUT_S, "stale_after_ms": 3000,
                                   "slot_offers": False}}))
            if not seeds:
                seeds = [agents[name].wait_for(lambda d: bool(d["mesh"]["self"]["mesh"]), 30,
                                               "mesh address")["mesh"]["self"]["mesh"]]
        for agent in agents.values():
            agent.wait_healthy("shared", 1, 30)
        for agent in agents.values():
            agent.wait_for(lambda d: d.get("mesh", {}).get("peers", {}).get("alive", 0) == 1, 30, "one alive peer")
        yield agents


async def busy_seen_by(origin: Agent, node: str, busy: int, http: aiohttp.ClientSession, timeout_s: float = 10) -> None:
    """Wait until ``origin``'s mesh view says ``node`` has ``busy`` busy slots of "shared"."""
    deadline = time.monotonic() + timeout_s
    last = None
    while time.monotonic() < deadline:
        async with http.get(f"{origin.url}/v1/mesh") as r:
            view = await r.json()
        for peer in view.get("nodes", []):
            if peer.get("name") == node:
                last = [m for m in peer.get("models", []) if m.get("name") == "shared"]
                if last and last[0].get("busy") == busy:
                    return
        await asyncio.sleep(0.05)
    raise AssertionError(f"{origin.url} never saw {node} with {busy} busy slot(s); last: {last}")


async def local_busy(agent: Agent, busy: int, http: aiohttp.ClientSession, timeout_s: float = 10) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        async with http.get(f"{agent.url}/v1/status") as r:
            doc = await r.json()
        (model,) = [m for m in doc["models"] if m["name"] == "shared"]
        if sum(b.get("in_flight", 0) for b in model["backends"]) == busy:
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"{agent.url}: never {busy} request(s) in flight")


async def hold_slot(http: aiohttp.ClientSession, agent: Agent, name: str) -> aiohttp.ClientResponse:
    """A slow stream pinned to ``agent`` (node ``name``) itself, its first line read: it holds
    the node's one slot until closed."""
    resp = await http.post(f"{agent.url}/v1/chat/completions", json=chat(stream=True),
                           headers={"X-Viiwork-Host": name})
    assert resp.status == 200, await resp.text()
    await resp.content.readline()
    return resp


async def test_queue_timeout_in_mesh_mode_is_429_with_retry_after(mesh2: dict[str, Agent]) -> None:
    a, b = mesh2["a"], mesh2["b"]
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as http:
        holders = [await hold_slot(http, a, "node-a"), await hold_slot(http, b, "node-b")]
        try:
            await busy_seen_by(a, "node-b", 1, http)
            started = time.monotonic()
            async with http.post(f"{a.url}/v1/chat/completions", json=chat(max_tokens=1)) as r:
                waited = time.monotonic() - started
                doc = await r.json()
                assert r.status == 429, doc
                assert int(r.headers["Retry-After"]) >= 1
            assert "no slot freed in the mesh" in doc["error"]["message"]
            # It waited in the queue (not refused at once) and was answered before any slot freed.
            assert waited >= QUEUE_TIMEOUT_S * 0.9
            assert all(not h.content.at_eof() for h in holders)
        finally:
            for h in holders:
                h.close()


async def test_a_new_request_does_not_get_past_a_full_queue(mesh2: dict[str, Agent]) -> None:
    """Every slot of the mesh is busy and the queue (queue_max = 1) holds one request that
    could run anywhere. A new request must not run ahead of it: it gets 429 "queue is full"
    at once, and the waiting one runs first when a slot frees."""
    a, b = mesh2["a"], mesh2["b"]
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as http:
        await local_busy(a, 0, http)
        await local_busy(b, 0, http)
        holders = [await hold_slot(http, a, "node-a"), await hold_slot(http, b, "node-b")]
        try:
            await busy_seen_by(a, "node-b", 1, http)

            async def anywhere() -> tuple[int, str]:
                async with http.post(f"{a.url}/v1/chat/completions", json=chat(max_tokens=1)) as r:
                    await r.read()
                    return r.status, r.headers.get("X-Viiwork-Node", "")

            waiting = asyncio.create_task(anywhere())
            await queued_at(a, 1, http)
            async with http.post(f"{a.url}/v1/chat/completions", json=chat(max_tokens=1)) as r:
                doc = await r.json()
                assert r.status == 429, (r.headers.get("X-Viiwork-Node"), doc)
                assert "Retry-After" in r.headers and "queue is full" in doc["error"]["message"]
        finally:
            for h in holders:
                h.close()
        # A slot freed (the holders left): the waiting request runs.
        assert (await asyncio.wait_for(waiting, 20))[0] == 200


async def test_requests_pinned_to_a_busy_peer_do_not_hold_back_an_idle_node(mesh2: dict[str, Agent]) -> None:
    """The queue (queue_max = 1) holds a request pinned to node-b, whose slot is busy;
    node-a's slot is free. A request that may run anywhere does not compete for node-b's
    slot with it: it runs on node-a at once instead of a 429 (found by an attacker: any
    client could make an idle node refuse everything with requests pinned to a busy peer).
    The pinned one still runs on node-b when its slot frees."""
    a, b = mesh2["a"], mesh2["b"]
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as http:
        await local_busy(a, 0, http)
        await local_busy(b, 0, http)
        holder = await hold_slot(http, b, "node-b")
        try:
            await busy_seen_by(a, "node-b", 1, http)

            async def pinned() -> tuple[int, str]:
                async with http.post(f"{a.url}/v1/chat/completions", json=chat(max_tokens=1),
                                     headers={"X-Viiwork-Host": "node-b"}) as r:
                    await r.read()
                    return r.status, r.headers.get("X-Viiwork-Node", "")

            waiting = asyncio.create_task(pinned())
            await queued_at(a, 1, http)
            async with http.post(f"{a.url}/v1/chat/completions", json=chat(max_tokens=1)) as r:
                doc = await r.json()
                assert (r.status, r.headers.get("X-Viiwork-Node")) == (200, "node-a"), doc
            assert not waiting.done()  # still waiting for node-b's slot
        finally:
            holder.close()
        assert await asyncio.wait_for(waiting, 20) == (200, "node-b")


async def queued_at(agent: Agent, queued: int, http: aiohttp.ClientSession, timeout_s: float = 5) -> None:
    """Wait until ``agent``'s queue for model "shared" holds ``queued`` requests."""
    deadline = time.monotonic() + timeout_s
    while True:
        async with http.get(f"{agent.url}/v1/status") as r:
            doc = await r.json()
        (model,) = [m for m in doc["models"] if m["name"] == "shared"]
        if model.get("queued") == queued:
            return
        assert time.monotonic() < deadline, f"the queue never held {queued}: {model}"
        await asyncio.sleep(0.02)


async def test_unknown_models_sent_to_a_draining_node_do_not_grow_metrics(mesh2: dict[str, Agent]) -> None:
    """A draining mesh node refuses every request (503) before routing: a model name that no
    node serves is counted as "-" on /metrics, as a 404 is, so a client sending random names
    cannot grow /metrics without bound (found by an attacker: 5,000 names, 887 KB)."""
    b = mesh2["b"]
    assert b.state_dir is not None
    ctl = Path(sys.executable).parent / "viiworkctl"
    sock = str(b.state_dir / "admin.sock")
    subprocess.run([str(ctl), "drain", "--socket", sock], check=True, capture_output=True, timeout=30)
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as http:
            for i in range(20):
                async with http.post(f"{b.url}/v1/chat/completions", json={**chat(), "model": f"nobody-{i}"}) as r:
                    assert r.status == 503, await r.text()
            async with http.post(f"{b.url}/v1/chat/completions", json=chat()) as r:
                assert r.status == 503  # a model the mesh serves keeps its name
            async with http.get(f"{b.url}/metrics") as r:
                text = await r.text()
        assert "nobody-" not in text
        assert 'viiwork_responses_total{code="503",model="-"} 20.0' in text
        assert 'viiwork_responses_total{code="503",model="shared"}' in text
        # A real mesh node's /metrics (offers, holds, listener counters) passes Prometheus' linter.
        promtool = find_promtool()
        require(promtool is not None, "promtool missing (docs/metrics.md)")
        assert promtool is not None
        done = check_metrics(promtool, text)
        assert done.returncode == 0 and not (done.stdout + done.stderr).strip(), (done.stdout, done.stderr)
    finally:
        subprocess.run([str(ctl), "undrain", "--socket", sock], check=True, capture_output=True, timeout=30)
