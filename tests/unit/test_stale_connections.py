"""The retry of a pooled connection that the engine closed (agent/serving/proxy.py, module doc).

An engine may close a keep-alive connection just as the next request is written to it (its
keep-alive timer firing, llama-server ending a connection): the agent's pooled socket is
dead although aiohttp could not know it when it picked it. The stand-in engine here does
exactly that on purpose: the first request on each connection is answered with keep-alive,
the second one on the same connection is read and the connection closed without an answer.
Every request must still get its answer, through the retry on a fresh connection, and the
retry must be counted.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator

import aiohttp
import pytest
from aiohttp import web

from viiwork.agent.config.schema import ModelConfig
from viiwork.agent.serving.api import ClientApi
from viiwork.agent.serving.proxy import Upstream
from viiwork.agent.supervision.backends import Backend, BackendId, BackendState, ModelRuntime
from viiwork.engines.registry import get_engine

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
ANSWER = {"id": "x", "object": "chat.completion", "model": "m",
          "choices": [{"index": 0, "message": {"role": "assistant", "content": "ok"}, "finish_reason": "stop"}]}


class ClosingEngine:
    """Answers the first request of each connection (keep-alive); closes the connection on
    the second, after reading it. ``answered`` / ``closed``: counts."""

    def __init__(self) -> None:
        # The transports themselves, not their id(): a closed transport's id can be reused by
        # the next one, which would then be taken for a connection already served.
        self.served: set[object] = set()
        self.answered = 0
        self.closed = 0

    async def chat(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        transport = request.transport
        assert transport is not None
        if transport in self.served:
            self.closed += 1
            transport.close()  # the pooled socket dies under the agent's request
            raise web.HTTPServiceUnavailable()  # never written: the connection is gone
        self.served.add(transport)
        self.answered += 1
        if not body.get("stream"):
            return web.json_response(ANSWER, headers={"Connection": "keep-alive"})
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Connection": "keep-alive"})
        await response.prepare(request)
        chunk = {"id": "x", "object": "chat.completion.chunk", "model": "m",
                 "choices": [{"index": 0, "delta": {"content": "ok"}, "finish_reason": None}]}
        await response.write(f"data: {json.dumps(chunk)}\n\n".encode())
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
        return response


@pytest.fixture
async def closing_engine() -> AsyncIterator[tuple[int, ClosingEngine]]:
    engine = ClosingEngine()
    app = web.Application()
    app.router.add_post("/v1/chat/completions", engine.chat)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    try:
        yield site._server.sockets[0].getsockname()[1], engine  # type: ignore[union-attr]
    finally:
        await runner.cleanup()


@pytest.fixture
async def agent(closing_engine) -> AsyncIterator[tuple[str, Upstream]]:
    port, _ = closing_engine
    cfg = ModelConfig.model_validate({"name": "m", "engine": "llamacpp", "path": "/x.gguf", "parallel": 1})
    rt = ModelRuntime(config=cfg, engine=get_engine("llamacpp"))
    rt.backends.append(Backend(id=BackendId("m#0"), model="m", index=0, state=BackendState.HEALTHY, port=port,
                               parallel=1))
    async with Upstream(10) as upstream:
        api = ClientApi(node_name="test-node", runtimes={"m": rt}, upstream=upstream, max_body_bytes=1 << 20,
                        queue_max=8, queue_timeout_s=10, status_source=lambda: [{"name": "m"}])
        runner = web.AppRunner(api.build_app(), handler_cancellation=True, access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        try:
            yield f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}", upstream  # type: ignore[union-attr]
        finally:
            await runner.cleanup()


async def test_a_pooled_connection_closed_by_the_engine_is_retried_on_a_fresh_one(agent, closing_engine) -> None:
    url, upstream = agent
    _, engine = closing_engine
    async with aiohttp.ClientSession() as http:
        for i in range(6):
            stream = i % 2 == 1
            async with http.post(f"{url}/v1/chat/completions", json={**CHAT, "stream": stream}) as r:
                body = await r.read()
                assert r.status == 200, body
                if stream:
                    assert body.rstrip().endswith(b"data: [DONE]"), body
                else:
                    assert json.loads(body)["choices"][0]["message"]["content"] == "ok"
    # Request 1 opened a connection; each later one was sent on the pooled connection of the
    # one before, which the engine closed, and retried once on a fresh connection.
    assert engine.answered == 6
    assert engine.closed >= 1
    assert upstream.stale_retries == engine.closed
