"""The APIs clients speak besides chat (issue 19), through real agents in front of real llama-server.

Two agents on loopback in one mesh: node-a serves ``tiny`` (chat), node-b serves ``tiny`` and
``ranker`` (kind rerank: a tiny Qwen3 GGUF with a classification head, pooling "rank", made
by tests/support/tiny_gguf.py). Official clients: the ``anthropic`` SDK on ``/v1/messages``
(create, stream, count tokens), the ``openai`` SDK's Responses client; tokenize/detokenize and
rerank with plain HTTP. "Through one agent": node-a runs ``tiny`` itself; "across a hop": a
request to node-a pinned to node-b (``X-Viiwork-Host``), or for ``ranker``, which only node-b
serves. One pair of agents for the whole module (every engine start costs seconds).
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path

import aiohttp
import anthropic
import openai
import pytest

from support.agent import Agent, run_agent
from support.tiny_gguf import write_tiny_gguf

pytestmark = [pytest.mark.engine, pytest.mark.timeout(120)]

HOP = {"X-Viiwork-Host": "node-b"}
HELLO = [{"role": "user", "content": "hello world"}]


def mesh_section(seeds: list[str]) -> dict:
    return {"trust": "open", "mesh_id": "endpoints-mesh", "listen": "127.0.0.1:0", "advertise": "127.0.0.1",
            "discovery": ["seeds"], "seeds": seeds, "gossip_interval_ms": 100, "suspect_after_ms": 2000,
            "dead_after_ms": 6000}


def llama_model(binary: Path, gguf: Path, name: str, **overrides: object) -> dict:
    return {"name": name, "engine": "llamacpp", "path": str(gguf), "ctx_per_slot": 512, "parallel": 2,
            "backends": 1, "startup_timeout_s": 60, "llamacpp": {"binary": str(binary), "threads": 1},
            **overrides}


@pytest.fixture(scope="module")
def mesh(tmp_path_factory: pytest.TempPathFactory, llama_server: Path, tiny_gguf: Path) -> Iterator[dict[str, Agent]]:
    tmp = tmp_path_factory.mktemp("endpoints")
    ranker = write_tiny_gguf(tmp / "ranker.gguf", seed=3, arch="qwen3", pooling="rank").path
    agents: dict[str, Agent] = {}
    with ExitStack() as stack:
        a = agents["a"] = stack.enter_context(run_agent(
            tmp, [llama_model(llama_server, tiny_gguf, "tiny")], name="node-a", extra={"mesh": mesh_section([])}))
        seed = a.wait_for(lambda d: bool(d["mesh"]["self"]["mesh"]), 30, "mesh address")["mesh"]["self"]["mesh"]
        agents["b"] = stack.enter_context(run_agent(
            tmp, [llama_model(llama_server, tiny_gguf, "tiny"),
                  llama_model(llama_server, ranker, "ranker", kind="rerank", parallel=1)],
            name="node-b", extra={"mesh": mesh_section([seed])}))
        for agent in agents.values():
            agent.wait_for(lambda d: all(b["state"] == "healthy" for m in d["models"] for b in m["backends"]),
                           60, "backends healthy")
            agent.wait_for(lambda d: d.get("mesh", {}).get("peers", {}).get("alive", 0) == 1, 30, "peer alive")
        yield agents


@pytest.fixture
def claude(mesh: dict[str, Agent]) -> anthropic.AsyncAnthropic:
    return anthropic.AsyncAnthropic(base_url=mesh["a"].url, api_key="unused", max_retries=0, timeout=30)


@pytest.fixture
def oai(mesh: dict[str, Agent]) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{mesh['a'].url}/v1", api_key="unused", max_retries=0, timeout=30)


def named_events(raw: bytes) -> list[tuple[str, dict]]:
    """``(event name, data)`` of each SSE event; the name is the ``event:`` line's, verbatim."""
    out = []
    for block in raw.decode().split("\n\n"):
        lines = block.strip().split("\n")
        name = next((line[7:] for line in lines if line.startswith("event: ")), "")
        data = next((line[6:] for line in lines if line.startswith("data: ")), None)
        if data is not None:
            out.append((name, json.loads(data)))
    return out


def usage_tokens(metrics: str, model: str, kind: str) -> float:
    found = re.search(rf'viiwork_usage_tokens_total\{{kind="{kind}",model="{model}",tenant="-"\}} (\S+)', metrics)
    return float(found.group(1)) if found else 0.0


@pytest.mark.parametrize("hop", [False, True], ids=["one-agent", "across-a-hop"])
async def test_anthropic_sdk_creates_streams_and_counts(mesh: dict[str, Agent], claude: anthropic.AsyncAnthropic,
                                                        hop: bool) -> None:
    headers = HOP if hop else {}
    serving = mesh["b" if hop else "a"]
    async with aiohttp.ClientSession() as http:
        async with http.get(f"{serving.url}/metrics") as r:
            before = usage_tokens(await r.text(), "tiny", "prompt")
    raw = await claude.messages.with_raw_response.create(model="tiny", max_tokens=8, messages=HELLO,
                                                         extra_headers=headers)
    assert raw.headers["X-Viiwork-Node"] == ("node-b" if hop else "node-a")
    message = await raw.parse()
    assert message.type == "message" and message.role == "assistant"
    assert message.usage.input_tokens + (message.usage.cache_read_input_tokens or 0) > 0
    # Its usage row, from Anthropic's input_tokens, on the node whose engine answered.
    async with aiohttp.ClientSession() as http:
        async with http.get(f"{serving.url}/metrics") as r:
            assert usage_tokens(await r.text(), "tiny", "prompt") > before

    stream = await claude.messages.create(model="tiny", max_tokens=8, messages=HELLO, stream=True,
                                          extra_headers=headers)
    types = [event.type async for event in stream]
    assert types[0] == "message_start" and types[-1] == "message_stop" and "message_delta" in types

    counted = await claude.messages.count_tokens(model="tiny", messages=HELLO, extra_headers=headers)
    assert counted.input_tokens > 0


async def test_anthropic_stream_is_relayed_with_its_named_events(mesh: dict[str, Agent]) -> None:
    body = {"model": "tiny", "max_tokens": 8, "stream": True, "messages": HELLO}
    async with aiohttp.ClientSession() as http:
        async with http.post(f"{mesh['a'].url}/v1/messages", json=body, headers=HOP) as r:
            assert r.status == 200 and r.headers["Content-Type"].startswith("text/event-stream")
            events = named_events(await r.read())
    assert [name for name, _ in events] == [data["type"] for _, data in events]  # every event: line kept
    assert events[0][0] == "message_start" and events[-1][0] == "message_stop"


@pytest.mark.parametrize("hop", [False, True], ids=["one-agent", "across-a-hop"])
async def test_openai_sdk_responses(mesh: dict[str, Agent], oai: openai.AsyncOpenAI, hop: bool) -> None:
    headers = HOP if hop else {}
    raw = await oai.responses.with_raw_response.create(model="tiny", input="hello world", max_output_tokens=8,
                                                       extra_headers=headers)
    assert raw.headers["X-Viiwork-Node"] == ("node-b" if hop else "node-a")
    response = raw.parse()
    assert response.status == "completed" and response.usage is not None and response.usage.input_tokens > 0
    stream = await oai.responses.create(model="tiny", input="hello world", max_output_tokens=8, stream=True,
                                        extra_headers=headers)
    types = [event.type async for event in stream]
    assert types[0] == "response.created" and types[-1] == "response.completed"


async def test_responses_stored_state_is_refused(oai: openai.AsyncOpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as stored:
        await oai.responses.create(model="tiny", input="hello", store=True)
    assert stored.value.code == "stored_responses_not_supported" and stored.value.param == "store"
    with pytest.raises(openai.BadRequestError) as chained:
        await oai.responses.create(model="tiny", input="hello", previous_response_id="resp_123")
    assert chained.value.param == "previous_response_id"


@pytest.mark.parametrize(("model", "headers", "node"), [("tiny", {}, "node-a"), ("tiny", HOP, "node-b"),
                                                        ("ranker", {}, "node-b")],
                         ids=["one-agent", "pinned-hop", "model-only-on-peer"])
async def test_tokenize_detokenize_round_trip(mesh: dict[str, Agent], model: str, headers: dict, node: str) -> None:
    async with aiohttp.ClientSession() as http:
        async with http.post(f"{mesh['a'].url}/tokenize", json={"model": model, "content": "hello world"},
                             headers=headers) as r:
            assert r.status == 200 and r.headers["X-Viiwork-Node"] == node
            tokens = (await r.json())["tokens"]
        assert tokens and all(isinstance(t, int) for t in tokens)
        async with http.post(f"{mesh['a'].url}/detokenize", json={"model": model, "tokens": tokens},
                             headers=headers) as r:
            assert r.status == 200
            assert (await r.json())["content"].strip() == "hello world"


async def test_a_token_id_outside_the_vocabulary_is_the_clients_400_and_ejects_nothing(mesh: dict[str, Agent]) -> None:
    # llama-server answers it 500 "vector::_M_range_check": five of them ejected the healthy backend.
    async with aiohttp.ClientSession() as http:
        for _ in range(6):
            async with http.post(f"{mesh['a'].url}/detokenize", json={"model": "tiny", "tokens": [99_999_999]}) as r:
                assert r.status == 400 and r.headers["X-Viiwork-Node"] == "node-a"
                error = (await r.json())["error"]
            assert error["code"] == "invalid_request" and "_M_range_check" in error["message"]
        async with http.post(f"{mesh['a'].url}/detokenize", json={"model": "tiny", "tokens": [-1]}) as r:
            assert r.status == 400 and (await r.json())["error"]["param"] == "tokens"  # refused before routing
    backends = [b for m in mesh["a"].status()["models"] if m["name"] == "tiny" for b in m["backends"]]
    assert backends and not any(b["ejected"] for b in backends)


async def test_messages_without_max_tokens_is_refused_before_it_runs(mesh: dict[str, Agent]) -> None:
    async with aiohttp.ClientSession() as http:
        async with http.post(f"{mesh['a'].url}/v1/messages", json={"model": "tiny", "messages": HELLO}) as r:
            assert r.status == 400 and "X-Viiwork-Backend" not in r.headers
            doc = await r.json()
    assert doc["type"] == "error" and doc["error"]["type"] == "invalid_request_error"
    assert doc["error"]["message"].startswith("max_tokens:")


async def test_rerank_across_a_hop(mesh: dict[str, Agent]) -> None:
    body = {"model": "ranker", "query": "hello", "documents": ["hello world", "tiny test", "model token"]}
    async with aiohttp.ClientSession() as http:
        async with http.post(f"{mesh['a'].url}/v1/rerank", json=body) as r:
            assert r.status == 200 and r.headers["X-Viiwork-Node"] == "node-b"
            doc = await r.json()
    assert sorted(item["index"] for item in doc["results"]) == [0, 1, 2]
    assert all(isinstance(item["relevance_score"], float) for item in doc["results"])


async def test_an_endpoint_no_backend_serves_is_refused_naming_what_it_serves(
        mesh: dict[str, Agent], claude: anthropic.AsyncAnthropic) -> None:
    async with aiohttp.ClientSession() as http:
        async with http.post(f"{mesh['a'].url}/v1/rerank",
                             json={"model": "tiny", "query": "q", "documents": ["d"]}) as r:
            assert r.status == 400
            error = (await r.json())["error"]
    assert error["code"] == "endpoint_not_supported" and error["param"] == "model"
    assert "'tiny'" in error["message"] and "/v1/messages" in error["message"] and "/v1/responses" in error["message"]
    # The peer's endpoints came in its summary: node-a refuses for node-b's ranker, in Anthropic's shape.
    with pytest.raises(anthropic.BadRequestError) as refused:
        await claude.messages.create(model="ranker", max_tokens=8, messages=HELLO)
    assert refused.value.body["type"] == "error"
    assert refused.value.body["error"]["type"] == "invalid_request_error"
    assert "/v1/rerank" in refused.value.body["error"]["message"]


async def test_anthropic_clients_get_anthropic_errors(claude: anthropic.AsyncAnthropic) -> None:
    with pytest.raises(anthropic.NotFoundError) as unknown:
        await claude.messages.create(model="no-such-model", max_tokens=8, messages=HELLO)
    assert unknown.value.body == {"type": "error", "error": {"type": "not_found_error",
                                                             "message": unknown.value.body["error"]["message"]}}
    assert "no-such-model" in unknown.value.body["error"]["message"]


async def test_models_list_the_endpoints_each_model_is_served_at(mesh: dict[str, Agent]) -> None:
    async with aiohttp.ClientSession() as http:
        async with http.get(f"{mesh['a'].url}/v1/models") as r:
            models = {m["id"]: m for m in (await r.json())["data"]}
    assert models["ranker"]["endpoints"] == ["/detokenize", "/tokenize", "/v1/rerank"]  # from node-b's summary
    assert models["ranker"]["kind"] == "rerank"
    assert {"/v1/messages", "/v1/messages/count_tokens", "/v1/responses", "/v1/chat/completions"} <= set(
        models["tiny"]["endpoints"])
