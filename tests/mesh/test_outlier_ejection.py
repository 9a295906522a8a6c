"""Outlier ejection and the retry before the first byte between real agents (issue 22).

The failure fixed: node a's backend answers /health and /slots normally but 503 to every
completion at once (fake engine ``FAKE_COMPLETION_STATUS``). Before, 60 sequential requests
sent to a all ran on a and all failed, and a node taking overflow sent more of it to a than
to a good peer: local-first routing and an instantly freed slot made the failing backend look
best. Now a's backend is ejected after a few failures (5 in a row), every failure before the
first byte is retried on another node, and the client sees none while good backends have room
(docs/routing.md, "Outlier ejection"; figures in docs/reliability.md).

Agents: fake llama-servers, ``parallel = 2``; outlier ejections short (``base_ejection_s`` 1,
``max_ejection_s`` 2) so recovery is seen within seconds.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time
import urllib.request
from collections import Counter
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path

import aiohttp
import pytest

from support.agent import Agent, run_agent
from support.engines import fake_engine_binary

GOOD = {"FAKE_LOAD_S": "0.1", "FAKE_TOKENS": "4", "FAKE_TOKEN_DELAY_S": "0.02"}  # ~0.1 s per answer
OUTLIERS = {"base_ejection_s": 1.0, "max_ejection_s": 2.0, "report_after_ejections": 1000}


def chat(stream: bool = False) -> dict:
    return {"model": "shared", "stream": stream, "messages": [{"role": "user", "content": "hi"}]}


def mesh_section(seeds: list[str]) -> dict:
    return {"trust": "open", "mesh_id": "outliers", "listen": "127.0.0.1:0", "advertise": "127.0.0.1",
            "discovery": ["seeds"], "seeds": seeds, "gossip_interval_ms": 100, "suspect_after_ms": 1000,
            "dead_after_ms": 3000}


def model(binary: Path, env: dict[str, str], name: str = "shared") -> dict:
    return {"name": name, "engine": "llamacpp", "path": "/dev/null", "parallel": 2, "backends": 1,
            "llamacpp": {"binary": str(binary)}, "env": env}


def start_agents(tmp_path: Path, stack: ExitStack, nodes: dict[str, tuple[list[dict], dict]]) -> dict[str, Agent]:
    """One agent per entry ``name: (models, [routing.outliers])``, in one mesh, all healthy."""
    agents: dict[str, Agent] = {}
    seeds: list[str] = []
    for name, (models, outliers) in nodes.items():
        agents[name] = stack.enter_context(run_agent(
            tmp_path, models, name=f"node-{name}",
            extra={"mesh": mesh_section(seeds), "routing": {"queue_timeout_s": 10, "forward_retry": 1},
                   "routing.outliers": outliers}))
        if not seeds:
            seeds = [agents[name].wait_for(lambda d: bool(d["mesh"]["self"]["mesh"]), 30,
                                           "mesh address")["mesh"]["self"]["mesh"]]
    for agent in agents.values():
        agent.wait_for(lambda d: all(b["state"] == "healthy" for m in d["models"] for b in m["backends"]), 30,
                       "backends healthy")
    for agent in agents.values():
        agent.wait_for(lambda d: d["mesh"]["peers"].get("alive", 0) == len(nodes) - 1, 30, "peers alive")
    return agents


def start_mesh(tmp_path: Path, stack: ExitStack, bad_outliers: dict) -> dict[str, Agent]:
    """Agents a (its engine fails while tmp_path/fail holds "503"), b and c (good)."""
    binary = fake_engine_binary(tmp_path / "bin")
    (tmp_path / "fail").write_text("503")
    bad = {**GOOD, "FAKE_COMPLETION_STATUS": str(tmp_path / "fail")}
    return start_agents(tmp_path, stack, {"a": ([model(binary, bad)], bad_outliers),
                                          "b": ([model(binary, GOOD)], OUTLIERS),
                                          "c": ([model(binary, GOOD)], OUTLIERS)})


@pytest.fixture
def mesh_a_fails(tmp_path: Path) -> Iterator[dict[str, Agent]]:
    with ExitStack() as stack:
        yield start_mesh(tmp_path, stack, OUTLIERS)


@pytest.fixture
def mesh_a_fails_and_ejects_nothing(tmp_path: Path) -> Iterator[dict[str, Agent]]:
    """As mesh_a_fails, but a itself ejects nothing: only its peers' views can keep requests away."""
    with ExitStack() as stack:
        yield start_mesh(tmp_path, stack, {**OUTLIERS, "enabled": False})


async def send(http: aiohttp.ClientSession, agent: Agent, stream: bool = False) -> tuple[int, str, bytes]:
    async with http.post(f"{agent.url}/v1/chat/completions", json=chat(stream)) as r:
        return r.status, r.headers.get("X-Viiwork-Node", ""), await r.read()


def engine_requests(agent: Agent) -> int:
    return int(agent.engine_stats("shared")["requests"])


def metrics(agent: Agent) -> str:
    with urllib.request.urlopen(f"{agent.url}/metrics", timeout=5) as r:
        return r.read().decode()


def mesh_view(agent: Agent, name: str) -> dict:
    """The node called ``name`` in ``agent``'s /v1/mesh."""
    with urllib.request.urlopen(f"{agent.url}/v1/mesh", timeout=5) as r:
        return next(n for n in json.load(r)["nodes"] if n["name"] == name)


def targets(agent: Agent, kind: str) -> list[dict]:
    return [t for t in agent.status()["outliers"]["targets"] if t["kind"] == kind]


def viiworkctl(*args: str) -> str:
    out = subprocess.run([str(Path(sys.executable).parent / "viiworkctl"), *args], capture_output=True, text=True,
                         timeout=30, env={"COLUMNS": "240", "PATH": "/usr/bin:/bin"})
    assert out.returncode == 0, out.stderr
    return out.stdout


async def test_entering_at_the_failing_node_no_client_sees_a_failure(mesh_a_fails: dict[str, Agent],
                                                                     tmp_path: Path) -> None:
    a, b = mesh_a_fails["a"], mesh_a_fails["b"]
    published: set[int] = set()  # the slots a publishes for the model, as b sees them

    async def watch() -> None:
        while True:
            published.add((await asyncio.to_thread(mesh_view, b, "node-a"))["models"][0]["slots"])
            await asyncio.sleep(0.05)

    watcher = asyncio.create_task(watch())
    async with aiohttp.ClientSession() as http:
        # The first request, streamed: a's engine answers 503 before the first byte; it runs on a peer.
        status, node, body = await send(http, a, stream=True)
        assert status == 200 and node in ("node-b", "node-c"), body
        assert body.rstrip().endswith(b"data: [DONE]")
        results = [await send(http, a) for _ in range(60)]
    watcher.cancel()
    failed = [r for r in results if r[0] != 200]
    assert not failed, failed[:3]
    served = Counter(node for _, node, _ in results)
    bad = engine_requests(a)
    print(f"\n61 requests sent to a: a's engine got {bad}, ran on {dict(served)}, client failures 0")
    assert bad <= 8  # 5 to eject it, then a probe per ejection (1 s, then 2 s)
    assert served["node-a"] == 0
    doc = a.status()
    backend = next(b for b in doc["models"][0]["backends"])
    rows = targets(a, "backend")
    assert rows and rows[0]["backend"] == backend["id"] and rows[0]["ejected_in_row"] >= 1, rows
    ejections = doc["outliers"]["counters"]["ejections_total"]
    assert doc["outliers"]["retries"] >= bad - 1
    # One WARNING line per ejection; the counters on /metrics.
    assert a.log_text().count(f"backend {backend['id']} ejected for ") == ejections
    text = metrics(a)
    assert f"viiwork_outlier_ejections_total {ejections}.0" in text
    assert 'viiwork_outlier_ejected{kind="backend"}' in text and "viiwork_retries_total" in text
    # Ejected, its slots leave the summary a publishes (peers stop forwarding to it); a stays a member.
    assert {0, 2} <= published, published
    assert mesh_view(b, "node-a")["liveness"] == "alive"
    # Failing still: ejected or half-open, never restored, in a's status and viiworkctl status.
    assert targets(a, "backend")[0]["state"] in ("ejected", "half-open")
    assert f"outlier backend {backend['id']}: " in viiworkctl("status", "--url", a.url)
    # Recovery: the engine answers again; after its ejection a probe restores it.
    (tmp_path / "fail").write_text("")
    deadline = time.monotonic() + 10
    async with aiohttp.ClientSession() as http:
        while time.monotonic() < deadline:
            status, node, _ = await send(http, a)
            assert status == 200
            if node == "node-a":
                break
            await asyncio.sleep(0.1)
        else:
            pytest.fail(f"a's backend not restored within 10 s: {targets(a, 'backend')}")
        assert targets(a, "backend")[0]["state"] == "ok"
        assert (await send(http, a))[1] == "node-a"  # local first again
    assert "restored after a successful probe" in a.log_text()


async def test_entering_at_a_good_node_the_failing_peer_is_ejected_in_its_view(
        mesh_a_fails_and_ejects_nothing: dict[str, Agent]) -> None:
    a, b = mesh_a_fails_and_ejects_nothing["a"], mesh_a_fails_and_ejects_nothing["b"]
    async with aiohttp.ClientSession() as http:
        # Concurrency 3 at b (2 local slots): b's overflow goes to a or c, 60 requests in all.
        pending = list(range(60))
        results: list[tuple[int, str, bytes]] = []

        async def worker() -> None:
            while pending:
                pending.pop()
                results.append(await send(http, b))

        await asyncio.gather(*(worker() for _ in range(3)))
    failed = [r for r in results if r[0] != 200]
    assert not failed, failed[:3]
    served = Counter(node for _, node, _ in results)
    bad = engine_requests(a)
    print(f"\n60 requests at b, concurrency 3: a's engine got {bad}, ran on {dict(served)}, client failures 0")
    assert bad <= 8 and served["node-c"] > bad, (bad, served)
    # a publishes its slots (it ejects nothing itself) and stays a member; in b's view, once 5
    # forwards in a row failed there, it is ejected or half-open for the model while it fails.
    a_seen = mesh_view(b, "node-a")
    assert a_seen["liveness"] == "alive" and a_seen["models"][0]["slots"] == 2
    if bad >= 5:  # (fewer reach a when b's random spread among near-equals favours c)
        rows = [t for t in targets(b, "peer") if t["node"] == "node-a"]
        assert rows and rows[0]["ejected_in_row"] >= 1, targets(b, "peer")
        assert a_seen["models"][0]["ejected"] is True
        assert "(ejected)" in viiworkctl("mesh", "--url", b.url)
        assert "outlier peer node-a for shared: " in viiworkctl("status", "--url", b.url)


async def test_one_bad_backend_alone_answers_its_real_error_and_is_reported(tmp_path: Path) -> None:
    binary = fake_engine_binary(tmp_path / "bin")
    env = {**GOOD, "FAKE_COMPLETION_STATUS": "503"}
    # 1. The model's only backend, ejected: requests still reach it and get its real error at
    # once (never "nothing can serve it", nor a wait for the ejection to end).
    outliers = {"base_ejection_s": 1.5, "max_ejection_s": 3.0, "report_after_ejections": 1000}
    with run_agent(tmp_path, [model(binary, env)], name="alone",
                   extra={"routing": {"queue_timeout_s": 5}, "routing.outliers": outliers}) as agent:
        agent.wait_healthy("shared", timeout_s=30)
        codes, slowest = [], 0.0
        async with aiohttp.ClientSession() as http:
            end = time.monotonic() + 2.5  # past the first ejection (1.5 s after the 5th failure)
            while time.monotonic() < end:
                sent = time.monotonic()
                status, _, body = await send(http, agent)
                slowest = max(slowest, time.monotonic() - sent)
                codes.append((status, json.loads(body)["error"]["code"]))
                await asyncio.sleep(0.02)
        assert set(codes) == {(502, "upstream_error")}, Counter(codes)
        assert slowest < 1.0 and engine_requests(agent) == len(codes), (slowest, engine_requests(agent), len(codes))
        assert agent.status()["outliers"]["counters"]["ejections_total"] >= 1
    # 2. Ejected twice in a row (report_after_ejections 2): reported, and respawned by the ladder.
    outliers = {"base_ejection_s": 0.2, "max_ejection_s": 0.4, "report_after_ejections": 2}
    with run_agent(tmp_path, [model(binary, env)], name="reported", extra={"routing.outliers": outliers}) as agent:
        agent.wait_healthy("shared", timeout_s=30)
        deadline = time.monotonic() + 15
        async with aiohttp.ClientSession() as http:
            while agent.model("shared")["backends"][0]["respawns"] == 0 and time.monotonic() < deadline:
                await send(http, agent)
                await asyncio.sleep(0.02)
        doc = agent.status()
        assert doc["models"][0]["backends"][0]["respawns"] >= 1 and doc["outliers"]["counters"]["reports_total"] >= 1
        assert "reported unhealthy to the supervisor" in agent.log_text()


async def test_a_model_only_the_failing_node_serves_answers_its_real_error_at_every_node(tmp_path: Path) -> None:
    """Every backend of the model in the mesh is a's, and ejected: a still offers it (its
    summary keeps the slots), b still forwards to it, and b's clients get the engine's error
    at once, not a wait in b's queue for a slot that no summary shows."""
    binary = fake_engine_binary(tmp_path / "bin")
    bad = {**GOOD, "FAKE_COMPLETION_STATUS": "503"}
    with ExitStack() as stack:
        agents = start_agents(tmp_path, stack, {"a": ([model(binary, bad)], OUTLIERS),
                                                "b": ([model(binary, GOOD, name="other")], OUTLIERS)})
        a, b = agents["a"], agents["b"]
        b.wait_for(lambda d: mesh_view(b, "node-a")["models"][0]["slots"] == 2, 10, "a's slots in b's view")
        codes, slowest = [], 0.0
        async with aiohttp.ClientSession() as http:
            for _ in range(20):
                sent = time.monotonic()
                status, node, body = await send(http, b)
                slowest = max(slowest, time.monotonic() - sent)
                codes.append((status, node, json.loads(body)["error"]["code"]))
                await asyncio.sleep(0.05)
        assert set(codes) == {(502, "node-a", "upstream_error")}, Counter(codes)
        assert slowest < 1.0 and engine_requests(a) == 20, (slowest, engine_requests(a))
        assert a.model("shared")["backends"][0]["ejected"]  # ejected at a, offered all the same
        assert mesh_view(b, "node-a")["models"][0]["slots"] == 2


def error_event_binary(directory: Path) -> Path:
    """The fake engine, whose first process started ends every stream with llama-server's
    error event after 2 content chunks (``FAKE_ERROR_AFTER_CHUNKS``); later ones answer well."""
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / "fake-llama-server"
    inner = fake_engine_binary(directory, "fake-inner")
    path.write_text(f"#!/bin/sh\nif mkdir '{directory / 'bad'}' 2>/dev/null; then export FAKE_ERROR_AFTER_CHUNKS=2; fi\n"
                    f"exec '{inner}' \"$@\"\n")
    path.chmod(0o755)
    return path


def stream_failed(body: bytes) -> bool:
    """A stream that ended with an error event (no [DONE])."""
    assert body.startswith(b"data: "), body[:200]
    return not body.rstrip().endswith(b"data: [DONE]") and b'"error"' in body


async def test_a_backend_that_ends_its_streams_with_an_error_event_is_ejected(tmp_path: Path) -> None:
    """Issue 22: an error event in a stream (status 200 already sent) is a failure of the
    backend: before, the failing backend (the quickest to answer) got every stream, 20 of 20."""
    binary = error_event_binary(tmp_path / "bin")
    with run_agent(tmp_path, [{**model(binary, GOOD), "backends": 3}], name="alone",
                   extra={"routing.outliers": OUTLIERS}) as agent:
        agent.wait_healthy("shared", count=3, timeout_s=30)
        async with aiohttp.ClientSession() as http:
            failed = [stream_failed((await send(http, agent, stream=True))[2]) for _ in range(20)]
        rows = targets(agent, "backend")
        ejections = agent.status()["outliers"]["counters"]["ejections_total"]
        logged = agent.log_text()
    print(f"\n20 streams, 3 backends (one ends its streams with an error event): {sum(failed)} failed")
    assert 5 <= sum(failed) <= 7 and not any(failed[-5:]), failed  # 5 to eject it, then a probe or two
    assert len([r for r in rows if r["ejected_in_row"] >= 1]) == 1, rows  # the failing one only
    assert ejections >= 1
    assert "ended a stream with an error event (500): fake engine failed mid-stream" in logged


async def test_a_peer_whose_streams_end_with_an_error_event_is_ejected_in_the_origins_view(tmp_path: Path) -> None:
    """The origin sees the peer's stream relayed as is: the same error event counts against
    the peer for the model (a ejects nothing itself: only b's view keeps streams away)."""
    binary = fake_engine_binary(tmp_path / "bin")
    bad = {**GOOD, "FAKE_ERROR_AFTER_CHUNKS": "2"}
    with ExitStack() as stack:
        agents = start_agents(tmp_path, stack, {"a": ([model(binary, bad)], {**OUTLIERS, "enabled": False}),
                                                "b": ([model(binary, GOOD, name="other")], OUTLIERS),
                                                "c": ([model(binary, GOOD)], OUTLIERS)})
        b = agents["b"]
        outcomes: list[tuple[str, bool]] = []
        async with aiohttp.ClientSession() as http:
            while sum(f for _, f in outcomes) < 5 and len(outcomes) < 60:
                _, node, body = await send(http, b, stream=True)
                outcomes.append((node, stream_failed(body)))
            after = [(node, stream_failed(body)) for _, node, body in
                     [await send(http, b, stream=True) for _ in range(5)]]
        rows = [t for t in targets(b, "peer") if t["node"] == "node-a"]
    print(f"\nstreams at b: {len(outcomes)} until 5 failed on node-a, then {after}")
    assert {node for node, f in outcomes if f} == {"node-a"}
    assert after == [("node-c", False)] * 5  # node-a ejected for the model in b's view
    assert rows and rows[0]["ejected_in_row"] >= 1, targets(b, "peer")
