"""The client API and proxy in front of real (fake-engine) backend processes.

The fake engine is a separate process speaking llama-server's HTTP; admission, API and
proxy are the real ones. Supervision is out of scope here: backends are marked healthy.
"""

from __future__ import annotations

import asyncio
import json

import aiohttp
import pytest

from support.api_app import agent_api
from support.procs import fake_engine
from viiwork.agent.config.schema import ModelConfig
from viiwork.agent.supervision.backends import Backend, BackendId, BackendState, ModelRuntime
from viiwork.engines.registry import get_engine

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8}


def make_runtime(name: str, ports: list[int], parallel: int, kind: str = "chat") -> ModelRuntime:
    cfg = ModelConfig.model_validate({"name": name, "engine": "llamacpp", "path": "/x.gguf", "kind": kind,
                                      "parallel": parallel})
    rt = ModelRuntime(config=cfg, engine=get_engine("llamacpp"))
    for i, port in enumerate(ports):
        rt.backends.append(Backend(id=BackendId(f"{name}#{i}"), model=name, index=i,
                                   state=BackendState.HEALTHY, port=port, parallel=parallel))
    return rt


def sse_events(raw: bytes) -> list[str]:
    return [line[len("data: "):] for line in raw.decode().split("\n") if line.startswith("data: ")]


@pytest.fixture(scope="module")
def engine_port() -> int:
    with fake_engine("m", parallel=4, env={"FAKE_TOKENS": "5"}) as port:
        yield port


async def test_chat_nonstream_matches_engine(engine_port: int) -> None:
    rt = make_runtime("m", [engine_port], 4)
    async with agent_api({"m": rt}) as (url, _), aiohttp.ClientSession() as http:
        async with http.post(f"http://127.0.0.1:{engine_port}/v1/chat/completions", json=CHAT) as r:
            direct = await r.json()
        async with http.post(f"{url}/v1/chat/completions", json=CHAT,
                             headers={"X-Request-Id": "req-1"}) as r:
            assert r.status == 200
            assert r.headers["X-Viiwork-Node"] == "test-node"
            assert r.headers["X-Viiwork-Backend"] == "m#0"
            assert r.headers["X-Request-Id"] == "req-1"
            assert float(r.headers["X-Viiwork-Queued-Ms"]) >= 0
            proxied = await r.json()
    assert proxied["model"] == direct["model"] == "m"
    assert proxied["choices"][0]["message"]["content"] == direct["choices"][0]["message"]["content"]
    assert rt.backends[0].in_flight == 0


async def test_chat_stream_relays_every_event(engine_port: int) -> None:
    rt = make_runtime("m", [engine_port], 4)
    async with agent_api({"m": rt}) as (url, _), aiohttp.ClientSession() as http:
        async with http.post(f"http://127.0.0.1:{engine_port}/v1/chat/completions",
                             json={**CHAT, "stream": True}) as r:
            direct = sse_events(await r.read())
        async with http.post(f"{url}/v1/chat/completions", json={**CHAT, "stream": True}) as r:
            assert r.status == 200
            assert r.headers["Content-Type"].startswith("text/event-stream")
            assert r.headers["X-Accel-Buffering"] == "no"
            proxied = sse_events(await r.read())
    assert proxied[-1] == "[DONE]"
    assert len(proxied) == len(direct)
    content = "".join(json.loads(e)["choices"][0]["delta"].get("content") or ""
                      for e in proxied[:-1] if json.loads(e)["choices"])
    assert content
    assert all(json.loads(e)["model"] == "m" for e in proxied[:-1])


async def test_sequential_streams_survive_closed_pooled_connections(engine_port: int) -> None:
    """llama-server closes the socket after each stream while saying keep-alive (200 in a row)."""
    rt = make_runtime("m", [engine_port], 4)
    errors = 0
    async with agent_api({"m": rt}) as (url, api), aiohttp.ClientSession() as http:
        for i in range(200):
            stream = i % 5 != 4  # mix in some non-streamed requests
            async with http.post(f"{url}/v1/chat/completions", json={**CHAT, "stream": stream}) as r:
                body = await r.read()
                if r.status != 200 or (stream and not body.rstrip().endswith(b"data: [DONE]")):
                    errors += 1
    assert errors == 0


@pytest.mark.parametrize(
    ("method", "path", "body", "status", "needle"),
    [
        ("POST", "/v1/chat/completions", b"{not json", 400, "not valid JSON"),
        ("POST", "/v1/chat/completions", b"[1, 2]", 400, "JSON object"),
        ("POST", "/v1/chat/completions", b'{"messages": []}', 400, "'model' is required"),
        ("POST", "/v1/chat/completions", b'{"model": 7}', 400, "'model' is required"),
        ("POST", "/v1/chat/completions", b'{"model": "nope"}', 404, "known models: e, m"),
        ("POST", "/v1/embeddings", b'{"model": "m", "input": "x"}', 400, "needs an embedding model"),
        ("POST", "/v1/chat/completions", b'{"model": "e", "messages": []}', 400, "is an embedding model"),
        ("GET", "/v1/chat/completions", None, 405, "use POST"),
        ("DELETE", "/v1/models", None, 405, "use GET"),
        ("GET", "/v2/nothing", None, 404, "no such endpoint"),
        ("POST", "/v1/chat/completions", b'{"model": "m", "pad": "' + b"x" * 5000 + b'"}', 413, "max_body_bytes"),
    ],
    ids=["malformed-json", "not-object", "missing-model", "model-not-string", "unknown-model",
         "embeddings-on-chat-model", "chat-on-embedding-model", "get-on-post", "delete-on-get",
         "unknown-path", "oversized"],
)
async def test_bad_requests(engine_port: int, method: str, path: str, body: bytes | None, status: int,
                            needle: str) -> None:
    runtimes = {"m": make_runtime("m", [engine_port], 4), "e": make_runtime("e", [engine_port], 4, "embedding")}
    async with agent_api(runtimes, max_body_bytes=4096) as (url, _), aiohttp.ClientSession() as http:
        async with http.request(method, f"{url}{path}", data=body,
                                headers={"Content-Type": "application/json"}) as r:
            assert r.status == status
            doc = await r.json()
    assert needle in doc["error"]["message"]
    assert set(doc["error"]) >= {"message", "type", "code"}
    assert runtimes["m"].backends[0].in_flight == 0


async def test_engine_dying_mid_stream_ends_with_error_event() -> None:
    with fake_engine("m", parallel=1, env={"FAKE_TOKENS": "50", "FAKE_TOKEN_DELAY_S": "0.01",
                                           "FAKE_DIE_AFTER_CHUNKS": "3"}) as port:
        rt = make_runtime("m", [port], 1)
        async with agent_api({"m": rt}) as (url, _), aiohttp.ClientSession() as http:
            async with http.post(f"{url}/v1/chat/completions", json={**CHAT, "stream": True}) as r:
                events = sse_events(await r.read())
    assert events, "no events relayed"
    last = json.loads(events[-1])
    assert last["error"]["code"] == "upstream_error" and "broke off" in last["error"]["message"]
    assert "[DONE]" not in events


async def test_engine_silent_mid_stream_ends_with_error_event() -> None:
    with fake_engine("m", parallel=1, env={"FAKE_TOKENS": "50", "FAKE_HANG_AFTER_CHUNKS": "2"}) as port:
        rt = make_runtime("m", [port], 1)
        async with agent_api({"m": rt}, idle_s=0.5) as (url, _), aiohttp.ClientSession() as http:
            async with http.post(f"{url}/v1/chat/completions", json={**CHAT, "stream": True}) as r:
                events = sse_events(await asyncio.wait_for(r.read(), 10))
    last = json.loads(events[-1])
    assert last["error"]["code"] == "upstream_timeout" and "api.stream_idle_timeout_s" in last["error"]["message"]


async def test_engine_silent_before_answering_gives_504() -> None:
    # A non-streamed answer is computed whole before its headers: silence from the start.
    # (llama.cpp's is asked as a stream and assembled, agent/serving/assemble.py: its headers come
    # first, the silence after them; the answer is the same 504.)
    with fake_engine("m", parallel=1, env={"FAKE_TOKENS": "3", "FAKE_TOKEN_DELAY_S": "5"}) as port:
        rt = make_runtime("m", [port], 1)
        async with agent_api({"m": rt}, idle_s=0.5) as (url, _), aiohttp.ClientSession() as http:
            async with http.post(f"{url}/v1/chat/completions", json=CHAT) as r:
                body = await asyncio.wait_for(r.json(), 10)
    message = body["error"]["message"]
    assert r.status == 504 and ("did not answer within 0.5 s" in message or "went silent for 0.5 s" in message)


async def test_client_disconnect_frees_engine_slot() -> None:
    with fake_engine("m", parallel=1, env={"FAKE_TOKENS": "2000", "FAKE_TOKEN_DELAY_S": "0.01"}) as port:
        rt = make_runtime("m", [port], 1)
        async with agent_api({"m": rt}) as (url, _), aiohttp.ClientSession() as http:
            resp = await http.post(f"{url}/v1/chat/completions", json={**CHAT, "max_tokens": 2000, "stream": True})
            await resp.content.readline()  # the stream is flowing
            async with http.get(f"http://127.0.0.1:{port}/slots") as r:
                assert any(s["is_processing"] for s in await r.json())
            resp.close()  # the client goes away mid-stream
            loop = asyncio.get_running_loop()
            deadline = loop.time() + 2.0
            while True:
                async with http.get(f"http://127.0.0.1:{port}/slots") as r:
                    if not any(s["is_processing"] for s in await r.json()):
                        break
                assert loop.time() < deadline, "engine still generating 2 s after the client left"
                await asyncio.sleep(0.05)
            while rt.backends[0].in_flight:
                assert loop.time() < deadline + 1
                await asyncio.sleep(0.01)


async def test_queue_order_overflow_and_timeout() -> None:
    with fake_engine("m", parallel=1, env={"FAKE_TOKENS": "10", "FAKE_TOKEN_DELAY_S": "0.03"}) as port:
        rt = make_runtime("m", [port], 1)
        async with agent_api({"m": rt}, queue_max=2) as (url, api), aiohttp.ClientSession() as http:
            finished: list[int] = []

            async def one(n: int) -> int:
                async with http.post(f"{url}/v1/chat/completions", json=CHAT) as r:
                    await r.read()
                    finished.append(n)
                    return r.status

            tasks = []
            for n in range(3):
                tasks.append(asyncio.create_task(one(n)))
                # wait until request n holds the slot (n = 0) or sits in the queue
                while rt.backends[0].in_flight < 1 or api.queues.queued("m") < n:
                    await asyncio.sleep(0.005)
            # slot busy + 2 queued: a 4th is refused at once
            async with http.post(f"{url}/v1/chat/completions", json=CHAT) as r:
                assert r.status == 429
                assert int(r.headers["Retry-After"]) >= 1
                assert "queue is full" in (await r.json())["error"]["message"]
            assert await asyncio.gather(*tasks) == [200, 200, 200]
            assert finished == [0, 1, 2]
        async with agent_api({"m": rt}, queue_max=2, queue_timeout_s=0.1) as (url, _), \
                aiohttp.ClientSession() as http:
            slow = asyncio.create_task(http.post(f"{url}/v1/chat/completions", json=CHAT))
            while rt.backends[0].in_flight < 1:
                await asyncio.sleep(0.005)
            async with http.post(f"{url}/v1/chat/completions", json=CHAT) as r:
                assert r.status == 429 and "Retry-After" in r.headers
                assert "no slot freed" in (await r.json())["error"]["message"]
            (await slow).close()


async def test_views(engine_port: int) -> None:
    runtimes = {"m": make_runtime("m", [engine_port], 4), "e": make_runtime("e", [engine_port], 4, "embedding")}
    async with agent_api(runtimes) as (url, _), aiohttp.ClientSession() as http:
        async with http.get(f"{url}/v1/models") as r:
            models = await r.json()
        async with http.get(f"{url}/health") as r:
            assert r.status == 200
        async with http.get(f"{url}/metrics") as r:
            text = await r.text()
        async with http.get(f"{url}/v1/status") as r:
            status = await r.json()
    assert [m["id"] for m in models["data"]] == ["e", "m"]
    assert all(m["context_length"] == m["max_model_len"] == 4096 for m in models["data"])
    assert 'viiwork_model_slots{model="m"} 4.0' in text
    assert status["node"]["name"] == "test-node"
    assert {m["name"] for m in status["models"]} == {"e", "m"}
    for b in runtimes["m"].backends:
        b.state = BackendState.STARTING
    for b in runtimes["e"].backends:
        b.state = BackendState.DEAD
    async with agent_api(runtimes) as (url, _), aiohttp.ClientSession() as http:
        async with http.get(f"{url}/health") as r:
            assert r.status == 503



@pytest.mark.parametrize("path", ["/health", "/v1/status", "/metrics", "/v1/models", "/ui", "/ui/api/state"])
async def test_every_get_route_answers_head(engine_port: int, path: str) -> None:
    """HEAD is the GET without a body (a load balancer's ``HEAD /health``, docs/security.md)."""
    runtimes = {"m": make_runtime("m", [engine_port], 4)}
    async with agent_api(runtimes) as (url, _), aiohttp.ClientSession() as http:
        async with http.get(f"{url}{path}") as r:
            assert r.status == 200
            content_type = r.headers["Content-Type"]
        async with http.head(f"{url}{path}") as r:
            assert (r.status, r.headers["Content-Type"]) == (200, content_type)
            assert await r.read() == b""


@pytest.mark.parametrize("path", ["/health", "/v1/status", "/metrics", "/v1/models"])
async def test_other_methods_on_get_routes_name_get_and_head(engine_port: int, path: str) -> None:
    async with agent_api({"m": make_runtime("m", [engine_port], 4)}) as (url, _), aiohttp.ClientSession() as http:
        async with http.delete(f"{url}{path}") as r:
            assert (r.status, r.headers["Allow"]) == (405, "GET, HEAD")
            assert "use GET, HEAD" in (await r.json())["error"]["message"]
