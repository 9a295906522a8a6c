"""Non-streamed answers assembled from llama-server's stream, against the engine's own.

llama.cpp's adapter says a closed connection does not reliably stop a non-streamed
generation (``nonstream_stops_on_disconnect`` False; docs/engines.md, "When the client goes
away"), so the agent sends a non-streamed request to llama-server as a stream and assembles
the answer. Here the whole agent runs in front of the real llama-server with SmolLM2-135M
(one agent for the module); a seeded greedy request is asked of the engine directly
(natively non-streamed) and through the agent (assembled): same keys and types at every
level, same content, finish_reason and usage. Ids and timings differ.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from support.agent import ENGINE_URL, Agent, run_agent
from viiwork.agent.usage.store import open_read_only, read_rows

pytestmark = [pytest.mark.engine, pytest.mark.timeout(120)]

# cache_prompt false (llama-server's own key, passed through as is): prompt_tokens_details
# .cached_tokens would otherwise count the prefix the first of the two requests left cached.
GREEDY = {"temperature": 0, "seed": 1, "max_tokens": 32, "cache_prompt": False}
BODIES = {
    "/v1/chat/completions": {"model": "smol", "messages": [{"role": "user", "content": "Write a poem about the sea."}],
                             **GREEDY},
    "/v1/completions": {"model": "smol", "prompt": "The history of the sea", **GREEDY},
}
# Values that differ between two runs of one request.
VOLATILE = {"id", "created", "timings"}


@pytest.fixture(scope="module")
def agent(tmp_path_factory: pytest.TempPathFactory, llama_server: Path, smollm2_path: Path) -> Iterator[Agent]:
    tmp = tmp_path_factory.mktemp("assembled")
    model = {"name": "smol", "engine": "llamacpp", "path": str(smollm2_path), "ctx_per_slot": 1024, "parallel": 2,
             "backends": 1, "startup_timeout_s": 60, "llamacpp": {"binary": str(llama_server)}}
    with run_agent(tmp, [model]) as a:
        a.wait_healthy("smol")
        yield a


def shape(value: Any) -> Any:
    """Keys and JSON types, recursively (lists by their first item)."""
    if isinstance(value, dict):
        return {k: shape(v) for k, v in value.items()}
    if isinstance(value, list):
        return [shape(value[0])] if value else []
    return type(value).__name__


def without(doc: dict[str, Any], keys: set[str]) -> dict[str, Any]:
    return {k: v for k, v in doc.items() if k not in keys}


@pytest.mark.parametrize("path", sorted(BODIES))
async def test_assembled_answer_matches_the_engines_own(agent: Agent, path: str) -> None:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as http, \
            agent.engine_session("smol") as engine:
        async with engine.post(ENGINE_URL + path, json=BODIES[path]) as r:
            assert r.status == 200, await r.text()
            native = await r.json()
        async with http.post(agent.url + path, json=BODIES[path]) as r:
            assert r.status == 200, await r.text()
            assert r.headers["Content-Type"].startswith("application/json")
            assembled = await r.json()
    assert shape(assembled) == shape(native)
    assert without(assembled, VOLATILE) == without(native, VOLATILE)
    assert assembled["usage"]["completion_tokens"] > 0
    text = assembled["choices"][0]["message"]["content"] if "chat" in path else assembled["choices"][0]["text"]
    assert text


async def test_engine_error_in_answer_keeps_its_status(agent: Agent) -> None:
    """An error the engine answers before its stream (a prompt over the context) is the
    engine's error normalised, as for a request the agent did not assemble."""
    body = {**BODIES["/v1/chat/completions"], "messages": [{"role": "user", "content": "sea " * 3000}]}
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as http:
        async with http.post(agent.url + "/v1/chat/completions", json=body) as r:
            doc = await r.json()
            assert r.status == 400, doc
    assert doc["error"]["message"] and doc["error"]["code"] == "context_length_exceeded"


async def test_nonstreamed_client_that_leaves_frees_the_slot(agent: Agent) -> None:
    """A non-streamed request of 2,000 tokens whose client leaves: the slot frees at once
    (the answer would take many seconds on the CPU)."""
    slots = ENGINE_URL + "/slots"
    body = {**BODIES["/v1/chat/completions"], "max_tokens": 2000, "ignore_eos": True}
    async with agent.engine_session("smol") as http:
        async def busy() -> int:
            async with http.get(slots) as r:
                return sum(1 for s in await r.json() if s["is_processing"])

        async def run() -> None:
            async with aiohttp.ClientSession() as client, client.post(agent.url + "/v1/chat/completions",
                                                                      json=body) as r:
                await r.read()
        task = asyncio.create_task(run())
        deadline = time.monotonic() + 30
        while await busy() == 0:
            assert time.monotonic() < deadline and not task.done(), "the request never reached the engine"
            await asyncio.sleep(0.05)
        await asyncio.sleep(0.5)
        task.cancel()  # closes the client's connection
        await asyncio.gather(task, return_exceptions=True)
        left = time.monotonic()
        while await busy():
            assert time.monotonic() - left < 10, "the slot stayed busy after the client left"
            await asyncio.sleep(0.05)
    print(f"llama-server slot free {time.monotonic() - left:.2f} s after the client left (non-streamed)")


async def test_stream_rows_have_the_engines_counts_its_client_did_not_ask_for(agent: Agent) -> None:
    """A stream whose client did not ask for usage (docs/usage.md, "Token counts of streams"):
    the real llama-server was asked for it, the client gets no usage event, and the usage row
    has the engine's counts, the same as its own non-streamed answer to the same greedy
    request; that answer left the prompt in the slot, so the stream (prompt cache on) counts
    cached prompt tokens (llama.cpp's ``prompt_tokens_details.cached_tokens``)."""
    body = {**BODIES["/v1/chat/completions"], "max_tokens": 4}
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as http, \
            agent.engine_session("smol") as engine:
        async with engine.post(ENGINE_URL + "/v1/chat/completions", json=body) as r:
            native = (await r.json())["usage"]
        async with http.post(agent.url + "/v1/chat/completions", headers={"X-Request-Id": "real-stream"},
                             json={**body, "stream": True, "cache_prompt": True}) as r:
            text = await r.text()
    assert r.status == 200 and text.rstrip().endswith("data: [DONE]"), text
    assert '"usage"' not in text, text
    assert agent.state_dir is not None
    conn = open_read_only(agent.state_dir / "usage.sqlite3")
    try:
        (row,) = [row for row in read_rows(conn) if row.request_id == "real-stream"]
    finally:
        conn.close()
    assert (row.prompt_tokens, row.completion_tokens) == (native["prompt_tokens"], native["completion_tokens"]), row
    assert row.status == 200 and row.ttft_ms is not None and row.ttft_ms <= row.duration_ms
    assert row.cached_tokens is not None and 0 < row.cached_tokens <= row.prompt_tokens, row
