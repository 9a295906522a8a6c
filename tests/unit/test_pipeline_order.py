"""The pipeline's "never overtake" rule, with a real Upstream and an engine on loopback.

A slot frees while an older request waits and has not been handed it yet (a peer's slot seen
free, or a local one released between two routing turns): a new request must not take it.
The engine is an aiohttp server standing for llama-server (a remote party); the pipeline,
its queues and the upstream are the agent's own.
"""

from __future__ import annotations

import asyncio

import pytest
from aiohttp import web
from aiohttp.test_utils import make_mocked_request

from viiwork.agent.config.schema import ModelConfig
from viiwork.agent.serving.pipeline import Call, NoPeers, Pipeline
from viiwork.agent.serving.proxy import Upstream
from viiwork.agent.serving.waitqueue import Queues
from viiwork.agent.supervision.backends import Backend, BackendId, BackendState, ModelRuntime
from viiwork.engines.registry import get_engine


@pytest.fixture
async def engine_port():
    hits: list[str] = []

    async def embeddings(request: web.Request) -> web.Response:
        hits.append(request.headers.get("X-Request-Id", ""))
        return web.json_response({"object": "list", "data": [], "model": "m"})

    app = web.Application()
    app.router.add_post("/v1/embeddings", embeddings)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    try:
        yield port, hits
    finally:
        await runner.cleanup()


async def test_a_new_request_waits_behind_an_older_waiter_for_a_free_slot(engine_port) -> None:
    port, hits = engine_port
    cfg = ModelConfig.model_validate({"name": "m", "engine": "llamacpp", "path": "/m.gguf", "kind": "embedding"})
    rt = ModelRuntime(config=cfg, engine=get_engine("llamacpp"))
    rt.backends.append(Backend(id=BackendId("m#0"), model="m", index=0, state=BackendState.HEALTHY, port=port,
                               parallel=1))
    queues = Queues({"m": rt}, 4, 5.0)
    q = queues.of("m")
    held = q.take()
    assert held is not None
    early = q.enter()  # an older request waits for the one slot
    q.release(held)  # the slot is free, and not yet handed to it
    async with Upstream(stream_idle_timeout_s=5.0) as upstream:
        pipeline = Pipeline(node_name="n", runtimes={"m": rt}, queues=queues, peers=NoPeers({"m": rt}),
                            upstream=upstream)
        request = make_mocked_request("POST", "/v1/embeddings", headers={"Content-Type": "application/json"})
        call = Call(request, b'{"model": "m", "input": "x"}', "m", "embedding", False, "late")
        late = asyncio.create_task(pipeline.run(call))
        await asyncio.sleep(0.15)  # less than REROUTE_S (0.5 s): it has not routed again yet
        assert hits == [] and not late.done(), "the new request took the slot the older one waits for"
        q.grant()  # the older one gets the slot, runs and ends
        slot = early.grant
        assert slot is not None
        early.grant = None
        q.leave(early)
        q.release(slot)
        pipeline.peers.slot_freed(q)  # the slot frees: now it is the new request's
        response = await asyncio.wait_for(late, 5)
    assert response.status == 200 and hits == ["late"]
    assert rt.backends[0].in_flight == 0
