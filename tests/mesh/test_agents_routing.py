"""Three real agents on loopback forming a mesh and serving each other's overflow (issue 5).

Each agent runs fake llama-servers (separate processes) with ``parallel = 1``; agents find
each other by seeds, gossip over mutual TLS (open trust), and route with the real router.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path

import aiohttp
import pytest

from support.agent import Agent, run_agent
from support.engines import fake_engine_binary

SLOW = {"FAKE_LOAD_S": "0.1", "FAKE_TOKENS": "20", "FAKE_TOKEN_DELAY_S": "0.05"}  # ~1 s per answer


def chat(model: str, stream: bool = False) -> dict:
    return {"model": model, "stream": stream, "messages": [{"role": "user", "content": "hi"}]}


def mesh_section(seeds: list[str]) -> dict:
    """Mesh listener on a port the agent picks (0: no race with other processes for a port
    chosen in advance); later agents seed with the first one's address, gossip does the rest."""
    return {"trust": "open", "mesh_id": "test-mesh", "listen": "127.0.0.1:0",
            "advertise": "127.0.0.1", "discovery": ["seeds"], "seeds": seeds, "gossip_interval_ms": 100,
            "suspect_after_ms": 1000, "dead_after_ms": 3000}


def mesh_address(agent: Agent) -> str:
    return agent.wait_for(lambda d: bool(d["mesh"]["self"]["mesh"]), 30, "mesh address")["mesh"]["self"]["mesh"]


@pytest.fixture
def mesh3(tmp_path: Path) -> Iterator[dict[str, Agent]]:
    binary = fake_engine_binary(tmp_path / "bin")
    agents: dict[str, Agent] = {}
    seeds: list[str] = []
    with ExitStack() as stack:
        for name in "abc":
            models = [{"name": "shared", "engine": "llamacpp", "path": "/dev/null", "parallel": 1, "backends": 1,
                       "llamacpp": {"binary": str(binary)}, "env": SLOW}]
            if name == "c":
                models.append({"name": "only-c", "engine": "llamacpp", "path": "/dev/null", "parallel": 1,
                               "backends": 1, "llamacpp": {"binary": str(binary)}, "env": SLOW})
            agents[name] = stack.enter_context(run_agent(
                tmp_path, models, name=f"node-{name}",
                extra={"mesh": mesh_section(seeds),
                       "routing": {"queue_max": 1, "queue_timeout_s": 10, "stale_after_ms": 3000}}))
            if not seeds:
                seeds = [mesh_address(agents[name])]
        for agent in agents.values():
            agent.wait_for(lambda d: all(b["state"] == "healthy" for m in d["models"] for b in m["backends"]),
                           30, "backends healthy")
        for agent in agents.values():
            agent.wait_for(lambda d: len(d.get("mesh", {}).get("peers", {})) and
                           d["mesh"]["peers"].get("alive", 0) == 2, 30, "two alive peers")
        yield agents


async def test_overflow_runs_on_peers_then_queues_then_429(mesh3: dict[str, Agent]) -> None:
    a = mesh3["a"]
    async with aiohttp.ClientSession() as http:
        async with http.get(f"{a.url}/v1/models") as r:
            ids = [m["id"] for m in (await r.json())["data"]]
        assert ids == ["only-c", "shared"]

        async def one() -> tuple[int, str, str]:
            async with http.post(f"{a.url}/v1/chat/completions", json=chat("shared")) as r:
                await r.read()
                return r.status, r.headers.get("X-Viiwork-Node", ""), r.headers.get("X-Viiwork-Origin", "")

        first = [asyncio.create_task(one()) for _ in range(3)]
        await asyncio.sleep(0.3)
        fourth = asyncio.create_task(one())  # waits in A's queue
        await asyncio.sleep(0.3)
        async with http.post(f"{a.url}/v1/chat/completions", json=chat("shared")) as r:
            assert r.status == 429 and "Retry-After" in r.headers  # queue_max = 1
        results = await asyncio.gather(*first)
        assert sorted(node for _, node, _ in results) == ["node-a", "node-b", "node-c"]
        assert all(status == 200 and origin == "node-a" for status, _, origin in results)
        status, _, _ = await fourth
        assert status == 200


async def test_model_only_on_c_streams_through_a(mesh3: dict[str, Agent]) -> None:
    a = mesh3["a"]
    async with aiohttp.ClientSession() as http:
        async with http.post(f"{a.url}/v1/chat/completions", json=chat("only-c", stream=True),
                             headers={"X-Request-Id": "trace-1"}) as r:
            assert r.status == 200
            assert r.headers["X-Viiwork-Node"] == "node-c"
            assert r.headers["X-Viiwork-Origin"] == "node-a"
            assert r.headers["X-Request-Id"] == "trace-1"
            events = [line[6:] for line in (await r.read()).decode().split("\n") if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    words = [c["delta"].get("content") for e in events[:-1] for c in json.loads(e)["choices"]
             if c["delta"].get("content")]
    assert len(words) == 20  # every chunk, in order, through the hop
    assert "trace-1" in mesh3["c"].log_text()


async def test_host_selection_and_unknown_model(mesh3: dict[str, Agent]) -> None:
    a = mesh3["a"]
    async with aiohttp.ClientSession() as http:
        async with http.post(f"{a.url}/v1/chat/completions?host=node-b", json=chat("shared")) as r:
            assert r.status == 200 and r.headers["X-Viiwork-Node"] == "node-b"
        async with http.post(f"{a.url}/v1/chat/completions", json=chat("shared"),
                             headers={"X-Viiwork-Host": "nowhere"}) as r:
            assert r.status == 404 and "nowhere" in (await r.json())["error"]["message"]
        async with http.post(f"{a.url}/v1/chat/completions?host=node-b", json=chat("only-c")) as r:
            assert r.status == 400
        async with http.post(f"{a.url}/v1/chat/completions", json=chat("nope")) as r:
            doc = await r.json()
            assert r.status == 404 and "only-c" in doc["error"]["message"]
        # mesh headers sent by a client change nothing
        async with http.post(f"{a.url}/v1/chat/completions", json=chat("shared"),
                             headers={"X-Viiwork-Origin": "evil", "X-Viiwork-Refused": "no-slot"}) as r:
            assert r.status == 200 and r.headers["X-Viiwork-Origin"] == "node-a"


async def test_status_lists_each_seed_with_the_node_that_answered(mesh3: dict[str, Agent]) -> None:
    """The ``seeds`` of /v1/status's mesh section (what `viiworkctl doctor`'s agent.mesh_seeds reads)."""
    a_self = mesh3["a"].status()["mesh"]["self"]
    assert mesh3["a"].status()["mesh"]["seeds"] == []  # the first agent has no seed
    for name in "bc":
        [seed] = mesh3[name].status()["mesh"]["seeds"]
        assert seed["address"] == a_self["mesh"] and seed["answered"] and seed["attempts"] >= 1, seed
        assert seed["node_id"] == a_self["id"] and seed["last_error"] is None, seed


async def test_killed_peer_mid_stream_and_failover(mesh3: dict[str, Agent]) -> None:
    a, c = mesh3["a"], mesh3["c"]
    async with aiohttp.ClientSession() as http:
        resp = await http.post(f"{a.url}/v1/chat/completions", json=chat("only-c", stream=True))
        assert resp.headers["X-Viiwork-Node"] == "node-c"
        await resp.content.readline()
        os.kill(c.proc.pid, signal.SIGKILL)
        raw = await asyncio.wait_for(resp.read(), 30)
        resp.close()
        events = [line[6:] for line in raw.decode().split("\n") if line.startswith("data: ")]
        assert "[DONE]" not in events and "error" in json.loads(events[-1])
        # C's engines die with it (process runner); A stops routing there once C is suspect.
        a.wait_for(lambda d: d["mesh"]["peers"].get("alive", 0) == 1, 10, "C no longer alive")
        async with http.post(f"{a.url}/v1/chat/completions", json=chat("only-c")) as r:
            assert r.status in (429, 503)
        for _ in range(3):
            async with http.post(f"{a.url}/v1/chat/completions", json=chat("shared")) as r:
                assert r.status == 200 and r.headers["X-Viiwork-Node"] in ("node-a", "node-b")


def test_forward_refused_by_draining_peer_is_retried(tmp_path: Path) -> None:
    """B has a free slot in A's picture but refuses (it drained after its last summary):
    A takes the refusal before the first byte and the request runs on C instead."""
    import subprocess
    import sys
    import time
    import urllib.request

    binary = fake_engine_binary(tmp_path / "bin")
    seeds: list[str] = []
    # ~3 s: C must stay busy while viiworkctl drains B and A routes (slow on a loaded box)
    long_env = {"FAKE_LOAD_S": "0.1", "FAKE_TOKENS": "30", "FAKE_TOKEN_DELAY_S": "0.1"}
    shared = {"name": "shared", "engine": "llamacpp", "path": "/dev/null", "parallel": 1, "backends": 1,
              "llamacpp": {"binary": str(binary)}, "env": long_env}
    with ExitStack() as stack:
        agents = {}
        for name in "abc":
            mesh = mesh_section(seeds)
            if name == "b":  # B publishes rarely: A keeps believing B serves for seconds
                mesh.update(gossip_interval_ms=5000, suspect_after_ms=20000, dead_after_ms=40000)
            else:
                mesh.update(suspect_after_ms=20000, dead_after_ms=40000)
            agents[name] = stack.enter_context(run_agent(
                tmp_path, [] if name == "a" else [shared], name=f"node-{name}",
                extra={"mesh": mesh, "routing": {"stale_after_ms": 15000, "forward_retry": 1}}))
            if not seeds:
                seeds = [mesh_address(agents[name])]
        a, b, c = agents["a"], agents["b"], agents["c"]
        for agent in (b, c):
            agent.wait_healthy("shared")

        def free_in_a(node: str) -> int:
            doc = json.load(urllib.request.urlopen(f"{a.url}/v1/mesh", timeout=5))
            for n in doc["nodes"]:
                if n["name"] == node and n["liveness"] == "alive":
                    return sum(m["slots"] - m["busy"] for m in n["models"] if m["name"] == "shared")
            return -1

        a.wait_for(lambda d: free_in_a("node-b") == 1 and free_in_a("node-c") == 1, 30, "B and C free in A's view")
        # occupy C (runs on C itself) and wait until A sees it busy
        body = json.dumps(chat("shared")).encode()
        busy = subprocess.Popen([sys.executable, "-c",
                                 "import sys, urllib.request; urllib.request.urlopen(urllib.request.Request("
                                 f"{c.url + '/v1/chat/completions'!r}, data=sys.stdin.buffer.read(), "
                                 "headers={'Content-Type': 'application/json'}), timeout=30).read()"],
                                stdin=subprocess.PIPE)
        busy.stdin.write(body)
        busy.stdin.close()
        try:
            a.wait_for(lambda d: free_in_a("node-c") == 0, 10, "C busy in A's view")
            sock = tmp_path / "node-b" / "admin.sock"
            ctl = Path(sys.executable).parent / "viiworkctl"
            subprocess.run([str(ctl), "drain", "--socket", str(sock)], check=True, capture_output=True, timeout=30)
            assert free_in_a("node-b") == 1  # A has not heard of the drain yet
            started = time.monotonic()
            req = urllib.request.Request(f"{a.url}/v1/chat/completions", data=body,
                                         headers={"Content-Type": "application/json"})
            with urllib.request.urlopen(req, timeout=30) as r:
                assert r.status == 200
                assert r.headers["X-Viiwork-Node"] == "node-c"
                assert r.headers["X-Viiwork-Origin"] == "node-a"
            assert time.monotonic() - started < 10
            assert a.status()["mesh"]["forwards"]["refused_out"] >= 1
            # One request, however many forwards it took: counted once, by the route that answered.
            metrics = urllib.request.urlopen(f"{a.url}/metrics", timeout=5).read().decode()
            routed = [line for line in metrics.splitlines() if line.startswith('viiwork_routes_total{model="shared"')]
            assert sum(float(line.rsplit(" ", 1)[1]) for line in routed) == 1, routed
        finally:
            busy.wait(30)
