"""The whole agent (``viiwork-agent --config``) in front of the real llama-server on the CPU.

Uses the pinned llama-server and the project's tiny random GGUF (gibberish at ~1,000 tok/s);
greedy sampling makes direct and proxied answers comparable token for token.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
from pathlib import Path

import aiohttp
import pytest

from support.agent import ENGINE_URL, Agent, run_agent

pytestmark = pytest.mark.engine

GREEDY = {"temperature": 0, "seed": 7, "max_tokens": 12}


def chat(model: str = "tiny", stream: bool = False, **extra: object) -> dict:
    return {"model": model, "messages": [{"role": "user", "content": "hello there"}], "stream": stream,
            **GREEDY, **extra}


def llama_model(binary: Path, gguf: Path, name: str = "tiny", **overrides: object) -> dict:
    return {"name": name, "engine": "llamacpp", "path": str(gguf), "ctx_per_slot": 256, "parallel": 2,
            "backends": 1, "startup_timeout_s": 60, "llamacpp": {"binary": str(binary), "threads": 1},
            **overrides}


def sse(raw: bytes) -> list[str]:
    return [line[6:] for line in raw.decode().split("\n") if line.startswith("data: ")]


async def test_chat_through_agent_matches_engine(tmp_path: Path, llama_server: Path, tiny_gguf: Path) -> None:
    with run_agent(tmp_path, [llama_model(llama_server, tiny_gguf)]) as agent:
        agent.wait_healthy("tiny")
        async with aiohttp.ClientSession() as http, agent.engine_session("tiny") as engine:
            async with engine.post(f"{ENGINE_URL}/v1/chat/completions", json=chat()) as r:
                d = await r.json()
            async with http.post(f"{agent.url}/v1/chat/completions", json=chat()) as r:
                assert r.status == 200 and r.headers["X-Viiwork-Backend"]
                a = await r.json()
            assert a["model"] == d["model"] == "tiny"
            assert a["choices"][0]["message"]["content"] == d["choices"][0]["message"]["content"] != ""
            async with engine.post(f"{ENGINE_URL}/v1/chat/completions", json=chat(stream=True)) as r:
                ds = sse(await r.read())
            async with http.post(f"{agent.url}/v1/chat/completions", json=chat(stream=True)) as r:
                assert r.headers["Content-Type"].startswith("text/event-stream")
                as_ = sse(await r.read())
        assert as_[-1] == ds[-1] == "[DONE]"

        def text(events: list[str]) -> str:
            return "".join((c["delta"].get("content") or "") for e in events[:-1]
                           for c in json.loads(e).get("choices", []))
        assert text(as_) == text(ds) != ""
        assert all(json.loads(e)["model"] == "tiny" for e in as_[:-1])


async def test_200_sequential_streams_no_errors(tmp_path: Path, llama_server: Path, tiny_gguf: Path) -> None:
    with run_agent(tmp_path, [llama_model(llama_server, tiny_gguf)]) as agent:
        agent.wait_healthy("tiny")
        errors = 0
        async with aiohttp.ClientSession() as http:
            for _ in range(200):
                async with http.post(f"{agent.url}/v1/chat/completions",
                                     json=chat(stream=True, max_tokens=4)) as r:
                    events = sse(await r.read())
                    if r.status != 200 or not events or events[-1] != "[DONE]":
                        errors += 1
        assert errors == 0


async def test_two_backends_both_take_work(tmp_path: Path, llama_server: Path, tiny_gguf: Path) -> None:
    model = llama_model(llama_server, tiny_gguf, backends=2, parallel=1)
    with run_agent(tmp_path, [model], extra={"supervisor": {"max_parallel_loads": 2}}) as agent:
        agent.wait_healthy("tiny", 2)
        async with aiohttp.ClientSession() as http:
            async def one() -> str:
                async with http.post(f"{agent.url}/v1/chat/completions", json=chat(max_tokens=24)) as r:
                    assert r.status == 200
                    return r.headers["X-Viiwork-Backend"]
            used = await asyncio.gather(*(one() for _ in range(8)))
        assert len(set(used)) == 2, used


async def test_killed_backend_is_respawned_and_serves(tmp_path: Path, llama_server: Path, tiny_gguf: Path) -> None:
    with run_agent(tmp_path, [llama_model(llama_server, tiny_gguf)]) as agent:
        first = agent.wait_healthy("tiny")
        pid = next(m for m in first["models"] if m["name"] == "tiny")["backends"][0]["pid"]
        os.kill(pid, signal.SIGKILL)
        agent.wait_for(lambda d: (b := d["models"][0]["backends"][0])["respawns"] >= 1
                       and b["state"] == "healthy" and b["pid"] != pid, 30, "respawn")
        async with aiohttp.ClientSession() as http:
            async with http.post(f"{agent.url}/v1/chat/completions", json=chat()) as r:
                assert r.status == 200


async def test_parallel_one_queue_order_overflow_and_timeout(tmp_path: Path, llama_server: Path,
                                                             tiny_gguf: Path) -> None:
    # ~1 s per answer at the tiny model's ~1,000 tok/s: long enough to see the queue fill.
    model = llama_model(llama_server, tiny_gguf, parallel=1, ctx_per_slot=4096)
    long = {"max_tokens": 1000, "ignore_eos": True}
    with run_agent(tmp_path, [model], extra={"routing": {"queue_max": 2, "queue_timeout_s": 30}}) as agent:
        agent.wait_healthy("tiny")
        async with aiohttp.ClientSession() as http:
            done: list[int] = []

            async def one(n: int) -> int:
                async with http.post(f"{agent.url}/v1/chat/completions", json=chat(**long)) as r:
                    await r.read()
                    done.append(n)
                    return r.status

            tasks = []
            for n in range(3):
                tasks.append(asyncio.create_task(one(n)))
                await _wait(lambda n=n: _queued_and_busy(agent) >= n + 1)
            async with http.post(f"{agent.url}/v1/chat/completions", json=chat()) as r:
                assert r.status == 429 and int(r.headers["Retry-After"]) >= 1
            assert await asyncio.gather(*tasks) == [200, 200, 200]
            assert done == [0, 1, 2]
    with run_agent(tmp_path, [model], name="node-b",
                   extra={"routing": {"queue_max": 2, "queue_timeout_s": 0.2}}) as agent:
        agent.wait_healthy("tiny")
        async with aiohttp.ClientSession() as http:
            slow = asyncio.create_task(http.post(f"{agent.url}/v1/chat/completions",
                                                 json=chat(max_tokens=2000, ignore_eos=True)))
            await _wait(lambda: _queued_and_busy(agent) >= 1)
            async with http.post(f"{agent.url}/v1/chat/completions", json=chat()) as r:
                assert r.status == 429 and "Retry-After" in r.headers
            (await slow).close()


def _queued_and_busy(agent: Agent) -> int:
    m = agent.model("tiny")
    return int(m.get("queued", 0)) + int(sum(b.get("in_flight", 0) for b in m["backends"]))


async def _wait(predicate, timeout_s: float = 10) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while not await asyncio.to_thread(predicate):
        assert loop.time() < deadline, "condition not reached"
        await asyncio.sleep(0.02)


async def test_requests_during_load_are_queued_then_served(tmp_path: Path, llama_server: Path,
                                                           smollm2_path: Path) -> None:
    model = llama_model(llama_server, smollm2_path, name="smollm2")
    with run_agent(tmp_path, [model]) as agent:
        status = agent.model("smollm2")
        assert status["backends"][0]["state"] in ("starting", "healthy")
        async with aiohttp.ClientSession() as http:
            async with http.post(f"{agent.url}/v1/chat/completions", json=chat("smollm2")) as r:
                assert r.status == 200
                body = await r.json()
        assert body["choices"][0]["message"]["content"]


async def test_client_disconnect_frees_slot(tmp_path: Path, llama_server: Path, tiny_gguf: Path) -> None:
    # 8k tokens of context: the tiny model needs seconds to fill it, so the stream is still
    # generating when the client leaves.
    with run_agent(tmp_path, [llama_model(llama_server, tiny_gguf, parallel=1, ctx_per_slot=8192)]) as agent:
        agent.wait_healthy("tiny")
        async with aiohttp.ClientSession() as http, agent.engine_session("tiny") as engine:
            resp = await http.post(f"{agent.url}/v1/chat/completions",
                                   json=chat(stream=True, max_tokens=100000, ignore_eos=True))
            await resp.content.readline()
            async with engine.get(f"{ENGINE_URL}/slots") as r:
                assert any(s["is_processing"] for s in await r.json())
            resp.close()
            loop = asyncio.get_running_loop()
            deadline = loop.time() + 2.5
            while True:
                async with engine.get(f"{ENGINE_URL}/slots") as r:
                    if not any(s["is_processing"] for s in await r.json()):
                        break
                assert loop.time() < deadline, "slot still processing after the client left"
                await asyncio.sleep(0.05)


async def test_embedding_model(tmp_path: Path, llama_server: Path, tiny_gguf: Path) -> None:
    model = llama_model(llama_server, tiny_gguf, name="emb", kind="embedding")
    with run_agent(tmp_path, [model]) as agent:
        agent.wait_healthy("emb")
        async with aiohttp.ClientSession() as http:
            async with http.post(f"{agent.url}/v1/embeddings", json={"model": "emb", "input": "hello"}) as r:
                assert r.status == 200
                doc = await r.json()
            assert len(doc["data"][0]["embedding"]) > 0
            async with http.post(f"{agent.url}/v1/chat/completions", json=chat("emb")) as r:
                assert r.status == 400


async def test_missing_binary_is_dead_and_agent_stays_up(tmp_path: Path, tiny_gguf: Path) -> None:
    model = {"name": "ghost", "engine": "llamacpp", "path": str(tiny_gguf), "backends": 1,
             "llamacpp": {"binary": str(tmp_path / "no-such-llama-server")}}
    with run_agent(tmp_path, [model], extra={"health": {"max_respawns": 1}}) as agent:
        doc = agent.wait_for(lambda d: d["models"][0]["backends"][0]["state"] == "dead", 30, "dead")
        reason = doc["models"][0]["backends"][0]["reason"]
        assert "no-such-llama-server" in reason
        async with aiohttp.ClientSession() as http:
            async with http.post(f"{agent.url}/v1/chat/completions", json=chat("ghost")) as r:
                assert r.status == 503 and "Retry-After" in r.headers
            async with http.get(f"{agent.url}/health") as r:
                assert r.status == 503
        assert agent.proc.poll() is None
