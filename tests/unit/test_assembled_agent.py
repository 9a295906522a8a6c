"""The agent's assembled non-streamed answers, against the fake llama-server (one agent).

The llama.cpp adapter says a closed connection does not reliably stop a non-streamed
generation, so the agent asks the engine for a stream. The fake engine here keeps a
non-streamed generation running after its client has gone (FAKE_NONSTREAM_IGNORES_CLOSE),
as llama-server did in the bench (tests/bench/bench_disconnect.py): a non-streamed client
that leaves still frees its slot at once. An error event in the stream becomes the
engine's error answer; the embeddings route is never assembled.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import pytest

from support.agent import Agent, run_agent
from support.engines import fake_engine_binary

pytestmark = pytest.mark.timeout(90)

# 400 tokens 0.05 s apart: a full answer takes 20 s.
ENGINE_ENV = {"FAKE_LOAD_S": "0.1", "FAKE_TOKENS": "400", "FAKE_TOKEN_DELAY_S": "0.05",
              "FAKE_NONSTREAM_IGNORES_CLOSE": "1"}


def model(binary: Path, name: str, **env: str) -> dict:
    return {"name": name, "engine": "llamacpp", "path": "/dev/null", "parallel": 2, "backends": 1,
            "llamacpp": {"binary": str(binary)}, "env": {**ENGINE_ENV, **env}}


@pytest.fixture(scope="module")
def agent(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Agent]:
    tmp = tmp_path_factory.mktemp("assembled")
    binary = fake_engine_binary(tmp / "bin")
    with run_agent(tmp, [model(binary, "long"), model(binary, "broken", FAKE_ERROR_AFTER_CHUNKS="2")]) as a:
        a.wait_healthy("long")
        a.wait_healthy("broken")
        yield a


def engine_busy(agent: Agent, name: str) -> int:
    return int(agent.engine_stats(name)["busy"])


def chat(name: str, **extra: object) -> dict:
    return {"model": name, "messages": [{"role": "user", "content": "hi"}], **extra}


async def test_nonstreamed_client_that_leaves_frees_the_slot(agent: Agent) -> None:
    async with aiohttp.ClientSession() as http:
        async def run() -> None:
            async with http.post(agent.url + "/v1/chat/completions", json=chat("long")) as r:
                await r.read()
        task = asyncio.create_task(run())
        deadline = time.monotonic() + 10
        while await asyncio.to_thread(engine_busy, agent, "long") == 0:
            assert time.monotonic() < deadline and not task.done(), "the request never reached the engine"
            await asyncio.sleep(0.05)
        await asyncio.sleep(0.3)
        task.cancel()  # closes the client's connection
        await asyncio.gather(task, return_exceptions=True)
    left = time.monotonic()
    while await asyncio.to_thread(engine_busy, agent, "long"):
        # The generation would hold the slot for 20 s: freed only because the agent's
        # stream to the engine was closed.
        assert time.monotonic() - left < 8, "the slot stayed busy after the client left"
        await asyncio.sleep(0.05)


async def test_assembled_answer_has_the_nonstreamed_form(agent: Agent) -> None:
    async with aiohttp.ClientSession() as http:
        async with http.post(agent.url + "/v1/chat/completions", json=chat("long", max_tokens=5)) as r:
            assert r.status == 200 and r.headers["Content-Type"].startswith("application/json")
            doc = await r.json()
        async with http.post(agent.url + "/v1/completions",
                             json={"model": "long", "prompt": "x", "max_tokens": 3, "stream": False}) as r:
            assert r.status == 200
            text = await r.json()
    assert doc["object"] == "chat.completion"
    assert doc["choices"] == [{"finish_reason": "length", "index": 0,
                               "message": {"role": "assistant", "content": "The quick brown fox jumps"}}]
    assert doc["usage"]["completion_tokens"] == 5
    assert text["object"] == "text_completion" and text["choices"][0]["text"] == "The quick brown"


async def test_error_event_in_the_stream_is_an_error_answer(agent: Agent) -> None:
    async with aiohttp.ClientSession() as http:
        async with http.post(agent.url + "/v1/chat/completions", json=chat("broken")) as r:
            status, doc = r.status, await r.json()
    # An engine 500 that is not the client's fault: 502 upstream_error (docs/routing.md).
    assert status == 502, doc
    assert doc["error"]["code"] == "upstream_error" and "fake engine failed mid-stream" in doc["error"]["message"]
