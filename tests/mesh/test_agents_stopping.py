"""Stopping and draining between real agents (issue 13, item 1): every request in flight ends
right, peers learn the node's state, nothing new is sent there.

Real ``viiwork-agent`` processes on loopback with fake llama-servers (separate processes),
gossiping over mutual TLS (open trust). docs/architecture.md, "Stopping".
"""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from support.agent import Agent, run_agent
from support.engines import fake_engine_binary

TOKEN_S = 0.05
ENGINE_ENV = {"FAKE_LOAD_S": "0.1", "FAKE_TOKENS": "1000", "FAKE_TOKEN_DELAY_S": str(TOKEN_S)}
GOSSIP_MS = 100
DRAIN_S = 20.0  # health.drain_timeout_s in these tests
STOP_S = 5.0  # supervisor.stop_timeout_s
CTL = Path(sys.executable).parent / "viiworkctl"


def chat(model: str, tokens: int, stream: bool = True) -> dict:
    """A chat request of ``tokens`` content chunks (TOKEN_S apart)."""
    return {"model": model, "stream": stream, "max_tokens": tokens, "messages": [{"role": "user", "content": "hi"}]}


def model(name: str, binary: Path, parallel: int = 1) -> dict:
    return {"name": name, "engine": "llamacpp", "path": "/dev/null", "parallel": parallel, "backends": 1,
            "llamacpp": {"binary": str(binary)}, "env": ENGINE_ENV}


def extra(seeds: list[str]) -> dict[str, dict[str, Any]]:
    return {"mesh": {"trust": "open", "mesh_id": "stop-mesh", "listen": "127.0.0.1:0", "advertise": "127.0.0.1",
                     "discovery": ["seeds"], "seeds": seeds, "gossip_interval_ms": GOSSIP_MS,
                     "suspect_after_ms": 1000, "dead_after_ms": 3000},
            "routing": {"queue_max": 4, "queue_timeout_s": 3, "stale_after_ms": 3000},
            "health": {"drain_timeout_s": DRAIN_S}, "supervisor": {"stop_timeout_s": STOP_S}}


def start_mesh(stack: ExitStack, tmp_path: Path, models: dict[str, list[dict]]) -> dict[str, Agent]:
    """One agent per entry of ``models`` (name -> its models), seeded with the first one's
    mesh address; returns once every backend is healthy and every agent sees the others alive."""
    agents: dict[str, Agent] = {}
    seeds: list[str] = []
    for name, served in models.items():
        agents[name] = stack.enter_context(run_agent(tmp_path, served, name=f"node-{name}", extra=extra(seeds)))
        if not seeds:
            seeds = [agents[name].wait_for(lambda d: bool(d["mesh"]["self"]["mesh"]), 30,
                                           "mesh address")["mesh"]["self"]["mesh"]]
    for agent in agents.values():
        agent.wait_for(lambda d: all(b["state"] == "healthy" for m in d["models"] for b in m["backends"])
                       and d["mesh"]["peers"].get("alive", 0) == len(models) - 1, 30, "healthy, peers alive")
    return agents


async def peer_in(http: aiohttp.ClientSession, viewer: Agent, name: str) -> dict:
    async with http.get(f"{viewer.url}/v1/mesh") as r:
        doc = await r.json()
    return next(n for n in doc["nodes"] if n["name"] == name)


async def first_change(http: aiohttp.ClientSession, viewer: Agent, name: str, key: str, old: str,
                       timeout_s: float = 15.0) -> str:
    """The first value of ``key`` (liveness, state) other than ``old`` that ``viewer`` shows
    for peer ``name``, polled every 20 ms (a passing state, like ``suspect``, is seen)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = (await peer_in(http, viewer, name))[key]
        if value != old:
            return value
        await asyncio.sleep(0.02)
    raise AssertionError(f"{viewer.url} kept {name} {key}={old} for {timeout_s} s")


async def open_stream(http: aiohttp.ClientSession, url: str, body: dict) -> aiohttp.ClientResponse:
    """POST a streamed request and read its first event (the stream is under way)."""
    resp = await http.post(url, json=body)
    assert resp.status == 200, await resp.text()
    assert (await resp.content.readline()).startswith(b"data: ")
    return resp


async def events_of(resp: aiohttp.ClientResponse) -> list[str]:
    """The remaining ``data:`` payloads of a stream opened with ``open_stream``."""
    raw = await asyncio.wait_for(resp.read(), DRAIN_S + 10)
    resp.close()
    return [line[6:] for line in raw.decode().split("\n") if line.startswith("data: ")]


def content_chunks(events: list[str]) -> int:
    return sum(1 for e in events if e != "[DONE]" and "error" not in json.loads(e)
               for c in json.loads(e)["choices"] if c["delta"].get("content"))


def exit_within(agent: Agent, timeout_s: float) -> float:
    """Wait for the agent's exit (status 0); seconds it took from now."""
    began = time.monotonic()
    assert agent.proc.wait(timeout_s) == 0, agent.log_text()[-3000:]
    return time.monotonic() - began


async def test_sigterm_of_an_origin_lets_local_and_relayed_streams_finish(tmp_path: Path) -> None:
    """A is the origin of a stream relayed from C and of a local one, and runs a stream
    forwarded by B. SIGTERM to A: all three end with [DONE], every chunk there; new requests
    to A get 503 + Retry-After and /health 503 while they run; B and C see A ``left`` (never
    ``suspect``) and A exits within drain + engine stop + 5 s."""
    binary = fake_engine_binary(tmp_path / "bin")
    # ~4, 3 and 2 s: the stream relayed from C outlasts the one B relays through A's mesh
    # listener, so closing A's mesh session any earlier than the last stream's end shows.
    tokens = {"relayed": 80, "local": 60, "forwarded": 40}
    with ExitStack() as stack:
        agents = start_mesh(stack, tmp_path, {"a": [model("shared", binary, parallel=2)], "b": [],
                                              "c": [model("only-c", binary)]})
        a, b, c = agents["a"], agents["b"], agents["c"]
        async with aiohttp.ClientSession() as http:
            relayed = await open_stream(http, f"{a.url}/v1/chat/completions", chat("only-c", tokens["relayed"]))
            local = await open_stream(http, f"{a.url}/v1/chat/completions", chat("shared", tokens["local"]))
            forwarded = await open_stream(http, f"{b.url}/v1/chat/completions?host=node-a",
                                          chat("shared", tokens["forwarded"]))
            assert relayed.headers["X-Viiwork-Node"] == "node-c" and local.headers["X-Viiwork-Node"] == "node-a"
            assert forwarded.headers["X-Viiwork-Node"] == "node-a" and forwarded.headers["X-Viiwork-Origin"] == "node-b"
            ends = [asyncio.create_task(events_of(r)) for r in (relayed, local, forwarded)]
            a.proc.send_signal(signal.SIGTERM)
            sent = time.monotonic()
            seen_by_b, seen_by_c = await asyncio.gather(first_change(http, b, "node-a", "liveness", "alive"),
                                                        first_change(http, c, "node-a", "liveness", "alive"))
            assert (seen_by_b, seen_by_c) == ("left", "left")
            left_after_s = time.monotonic() - sent
            assert not all(t.done() for t in ends), "the streams ended before the peers heard of the stop"
            async with http.post(f"{a.url}/v1/chat/completions", json=chat("shared", 2, stream=False)) as r:
                assert r.status == 503 and "Retry-After" in r.headers, await r.text()
            async with http.get(f"{a.url}/health") as r:
                assert r.status == 503 and (await r.json())["status"] == "stopping"
            for events, count in zip(await asyncio.gather(*ends), tokens.values(), strict=True):
                assert events[-1] == "[DONE]" and content_chunks(events) == count, events[-3:]
        streams_done_s = time.monotonic() - sent
        exit_within(a, DRAIN_S + STOP_S + 5)
        exited_s = time.monotonic() - sent
    print(f"\nSIGTERM with 3 streams in flight (relayed out, local, relayed in): peers saw left after "
          f"{left_after_s:.2f} s; 3/3 streams completed with [DONE], 0 error events, by {streams_done_s:.2f} s; "
          f"exit {exited_s:.2f} s after SIGTERM")


async def test_a_drained_peer_is_seen_draining_gets_no_new_forward_then_leaves(tmp_path: Path) -> None:
    """`viiworkctl drain` on B while A's request streams from it: A sees B ``draining``, sends
    it no new forward (answers 503 itself), B's stream ends with [DONE] and B's /health is
    503 ``draining``. Then SIGTERM to the idle B: A sees it ``left`` (the final summary is
    pushed at once: B had no request to wait for)."""
    binary = fake_engine_binary(tmp_path / "bin")
    tokens = 40
    with ExitStack() as stack:
        agents = start_mesh(stack, tmp_path, {"a": [], "b": [model("shared", binary, parallel=2)]})
        a, b = agents["a"], agents["b"]
        async with aiohttp.ClientSession() as http:
            stream = await open_stream(http, f"{a.url}/v1/chat/completions", chat("shared", tokens))
            assert stream.headers["X-Viiwork-Node"] == "node-b"
            end = asyncio.create_task(events_of(stream))
            done = subprocess.run([str(CTL), "drain", "--socket", str(tmp_path / "node-b" / "admin.sock")],
                                  capture_output=True, text=True, timeout=30)
            assert done.returncode == 0, done.stderr
            async with http.get(f"{b.url}/health") as r:
                assert r.status == 503 and (await r.json())["status"] == "draining"
            assert await first_change(http, a, "node-b", "state", "serving") == "draining"
            assert (await peer_in(http, a, "node-b"))["liveness"] == "alive"
            forwards_in = b.status()["mesh"]["forwards"]["in"]
            async with http.post(f"{a.url}/v1/chat/completions", json=chat("shared", 2, stream=False)) as r:
                assert r.status == 503 and "Retry-After" in r.headers, await r.text()
            assert b.status()["mesh"]["forwards"]["in"] == forwards_in  # not even tried
            events = await end
            assert events[-1] == "[DONE]" and content_chunks(events) == tokens
            b.proc.send_signal(signal.SIGTERM)
            assert await first_change(http, a, "node-b", "liveness", "alive") == "left"
        exit_within(b, DRAIN_S + STOP_S + 5)


async def test_a_leaving_peer_that_freezes_ends_the_relayed_stream_within_suspect_after(tmp_path: Path) -> None:
    """A relays a 50 s stream from B. SIGTERM to B: A sees B ``left`` and the stream goes on
    (B keeps gossiping while it drains). Then SIGSTOP B: silent for ``suspect_after_ms``, it
    no longer holds A's client, whose stream ends with an SSE error event within
    ``suspect_after_ms`` + 2 s, not ``api.stream_idle_timeout_s`` (120 s) later
    (docs/routing.md, "Forwarding and retries before the first byte")."""
    binary = fake_engine_binary(tmp_path / "bin")
    suspect_s = 1.0  # mesh.suspect_after_ms of extra()
    with ExitStack() as stack:
        agents = start_mesh(stack, tmp_path, {"a": [], "b": [model("shared", binary)]})
        a, b = agents["a"], agents["b"]
        async with aiohttp.ClientSession() as http:
            stream = await open_stream(http, f"{a.url}/v1/chat/completions", chat("shared", 1000))
            assert stream.headers["X-Viiwork-Node"] == "node-b"
            b.proc.send_signal(signal.SIGTERM)
            assert await first_change(http, a, "node-b", "liveness", "alive") == "left"
            await asyncio.sleep(3 * suspect_s)  # left for longer than suspect_after: still streaming
            line = b"\n"
            while line == b"\n":
                line = await stream.content.readline()
            assert line.startswith(b"data: ") and b"error" not in line, line
            b.proc.send_signal(signal.SIGSTOP)
            try:
                frozen = time.monotonic()
                raw = await asyncio.wait_for(stream.content.read(), 30)
                errored_s = time.monotonic() - frozen
            finally:
                b.proc.send_signal(signal.SIGCONT)
                stream.close()
        events = [line[6:] for line in raw.decode().split("\n") if line.startswith("data: ")]
        assert "[DONE]" not in events and "error" in json.loads(events[-1]), events[-3:]
        assert errored_s < suspect_s + 2, f"the stream ended {errored_s:.2f} s after B froze"
        exit_within(b, DRAIN_S + STOP_S + 5)
    print(f"\nB leaving, then frozen: A's relayed stream ended with an error event {errored_s:.2f} s after "
          f"SIGSTOP (suspect_after_ms = {suspect_s * 1000:.0f})")


@pytest.fixture
def standalone(tmp_path: Path) -> Iterator[Agent]:
    """One agent without a mesh, one slot, and a drain timeout of 1 s."""
    binary = fake_engine_binary(tmp_path / "bin")
    with run_agent(tmp_path, [model("m", binary)], name="solo",
                   extra={"health": {"drain_timeout_s": 1.0}, "supervisor": {"stop_timeout_s": STOP_S},
                          "routing": {"queue_max": 4, "queue_timeout_s": 30}}) as agent:
        agent.wait_healthy("m", timeout_s=30)
        yield agent


async def test_what_outlives_the_drain_timeout_ends_with_an_error_event_or_a_503(standalone: Agent) -> None:
    """A 50 s stream holds the one slot and a second request waits for it; SIGTERM with
    ``health.drain_timeout_s = 1``: the stream ends with a terminal SSE error event (no
    [DONE]), the waiting request gets 503 + Retry-After, the agent exits (status 0)."""
    agent = standalone
    async with aiohttp.ClientSession() as http:
        stream = await open_stream(http, f"{agent.url}/v1/chat/completions", chat("m", 1000))
        waiting = asyncio.create_task(http.post(f"{agent.url}/v1/chat/completions", json=chat("m", 2, stream=False)))
        await asyncio.to_thread(agent.wait_for, lambda d: d["models"][0]["queued"] == 1, 10, "one queued")
        agent.proc.send_signal(signal.SIGTERM)
        sent = time.monotonic()
        events = await events_of(stream)
        cut_s = time.monotonic() - sent
        assert "[DONE]" not in events
        error = json.loads(events[-1])["error"]
        assert error["type"] == "unavailable_error" and "drain_timeout_s" in error["message"]
        assert error["code"] == "draining"
        resp = await waiting
        assert resp.status == 503 and "Retry-After" in resp.headers
        refused = (await resp.json())["error"]
        assert refused["code"] == "draining" and "drain_timeout_s" in refused["message"]
        resp.close()
    exit_within(agent, 1 + STOP_S + 5)
    print(f"\nSIGTERM, drain_timeout_s = 1: the stream ended with an error event after {cut_s:.2f} s, the "
          f"waiting request got 503; exit {time.monotonic() - sent:.2f} s after SIGTERM")
