"""What the request path counts for outlier ejection (issue 22): a failure a retry repeats is
the request's, a 4xx the client's, with a real Upstream and two engines on loopback.

The flaw fixed: llama-server answers 500 to some malformed requests, and each bad request,
retried on the second backend, counted a failure against both: 6 bad requests ejected two
good backends, a steady 2 per second got them reported, respawned and finally dead. And a
4xx counted as a success: an engine that answers 400 to one client kept a backend failing
every other request healthy. The rules (docs/routing.md, "Outlier ejection"): a 2xx or 3xx is
a success, a 4xx nothing (a half-open probe that ends so is released), a failure before the
first byte is held until the request ends: counted when a retry answered below 400, or when
no retry was possible; dropped (``request_faults_total``) when a retry failed too or
answered a 4xx.

The engines are aiohttp servers standing for llama-server (a remote party): each answers
every completion with the status and body it is set to; the pipeline, its queues, the
upstream and the outlier ejection are the agent's own.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Collection
from dataclasses import dataclass, field

import pytest
from aiohttp import web
from aiohttp.test_utils import make_mocked_request

from support.llamacpp_replays import CAPTURES
from support.replay import read_capture
from viiwork.agent.config.schema import ModelConfig
from viiwork.agent.serving.ejections import Ejections
from viiwork.agent.serving.errors import error_response
from viiwork.agent.serving.outliers import OutlierSettings
from viiwork.agent.serving.pipeline import Call, NoPeers, Pipeline
from viiwork.agent.serving.proxy import Failed, Refused, Upstream
from viiwork.agent.serving.router import Decision, RunOnPeer
from viiwork.agent.serving.scoring import PrefixQuery
from viiwork.agent.serving.waitqueue import Queues
from viiwork.agent.supervision.backends import Backend, BackendId, BackendState, ModelRuntime
from viiwork.engines.registry import get_engine
from viiwork.mesh.identity import NodeId

OK = (200, {"id": "x", "object": "chat.completion", "model": "m",
            "choices": [{"index": 0, "message": {"role": "assistant", "content": "hi"}, "finish_reason": "stop"}]})
# A 500 no adapter rule knows: the engine's own failure, as far as the agent can tell.
CRASH = (500, {"error": {"code": 500, "message": "something went wrong", "type": "server_error"}})
BAD_REQUEST = (400, {"error": {"code": 400, "message": "Expected 'messages' to be an array",
                               "type": "invalid_request_error"}})


@dataclass
class Engine:
    """One engine on loopback: answers every completion with ``answer`` (status, JSON body)."""

    port: int = 0
    answer: tuple[int, object] = OK
    hits: int = 0
    raw: bytes | None = None  # a captured body, sent verbatim instead of ``answer``'s
    runner: web.AppRunner | None = field(default=None, repr=False)

    async def handle(self, request: web.Request) -> web.Response:
        self.hits += 1
        status, body = self.answer
        data = self.raw if self.raw is not None else json.dumps(body).encode()
        return web.Response(status=status, body=data, content_type="application/json")


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@dataclass
class Node:
    pipeline: Pipeline
    runtime: ModelRuntime
    engines: list[Engine]
    clock: Clock

    @property
    def ejections(self) -> Ejections:
        return self.pipeline.ejections

    def row(self, index: int) -> dict | None:
        """The detector's row of backend ``index`` (None: it holds no state)."""
        return next((r for r in self.ejections.rows() if r["backend"] == f"m-{index}"), None)

    def failures(self, index: int) -> int:
        row = self.row(index)
        return 0 if row is None else int(row["failures"])

    def successes(self, index: int) -> int:
        row = self.row(index)
        return 0 if row is None else int(row["successes"])

    async def send(self, n: int = 1, body: bytes = b'{"model":"m","messages":[]}') -> list[tuple[int, dict]]:
        out = []
        for i in range(n):
            request = make_mocked_request("POST", "/v1/chat/completions", headers={"Content-Type": "application/json"})
            response = await self.pipeline.run(Call(request, body, "m", "chat", False, f"r{i}"))
            assert isinstance(response, web.Response)
            out.append((response.status, json.loads(response.text or "null")))
        return out


@pytest.fixture
async def node() -> AsyncIterator[Node]:
    """A node with backends m-0 and m-1 (one slot each) on two loopback engines, both answering 200."""
    engines = [Engine(), Engine()]
    for engine in engines:
        app = web.Application()
        app.router.add_post("/v1/chat/completions", engine.handle)
        engine.runner = web.AppRunner(app)
        await engine.runner.setup()
        site = web.TCPSite(engine.runner, "127.0.0.1", 0)
        await site.start()
        engine.port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    cfg = ModelConfig.model_validate({"name": "m", "engine": "llamacpp", "path": "/m.gguf", "parallel": 1})
    rt = ModelRuntime(config=cfg, engine=get_engine("llamacpp"))
    for i, engine in enumerate(engines):
        rt.backends.append(Backend(id=BackendId(f"m-{i}"), model="m", index=i, state=BackendState.HEALTHY,
                                   port=engine.port, parallel=1))
    clock = Clock()
    ejections = Ejections({"m": rt}, OutlierSettings(jitter=0.0), clock=clock)
    try:
        async with Upstream(stream_idle_timeout_s=5.0) as upstream:
            upstream.engine_of = lambda backend: rt.engine
            pipeline = Pipeline(node_name="n", runtimes={"m": rt}, queues=Queues({"m": rt}, 4, 5.0),
                                peers=NoPeers({"m": rt}), upstream=upstream, ejections=ejections)
            yield Node(pipeline, rt, engines, clock)
    finally:
        for engine in engines:
            assert engine.runner is not None
            await engine.runner.cleanup()


async def test_a_failure_the_retry_repeats_is_the_requests_and_ejects_nobody(node: Node) -> None:
    node.engines[0].answer = node.engines[1].answer = CRASH
    results = await node.send(20)
    assert {status for status, _ in results} == {502}  # the engine's error, as the error contract renders it
    assert [e.hits for e in node.engines] == [20, 20]  # each request tried both
    assert node.failures(0) == node.failures(1) == 0 and node.ejections.rows() == []
    assert not any(b.ejected for b in node.runtime.backends)
    counters = node.ejections.status()["counters"]
    assert counters["request_faults_total"] == 20 and counters["ejections_total"] == 0
    assert {f.name: f.samples[0].value for f in node.ejections.metric_families()}["viiwork_outlier_request_faults"] == 20


async def test_a_failure_the_retry_serves_counts_against_the_first_backend(node: Node) -> None:
    node.engines[0].answer = CRASH
    results = await node.send(4)
    assert {status for status, _ in results} == {200}
    assert (node.failures(0), node.successes(1)) == (4, 4) and node.row(0)["consecutive_failures"] == 4
    assert node.runtime.backends[1].last_success_at is not None and node.runtime.backends[0].last_success_at is None
    await node.send(1)  # the 5th failure in a row: m-0 is ejected
    assert node.runtime.backends[0].ejected and node.row(0)["state"] == "ejected"
    assert node.ejections.status()["counters"]["request_faults_total"] == 0


async def test_with_no_retry_possible_the_failure_counts_at_once(node: Node) -> None:
    node.engines[0].answer = CRASH
    node.pipeline.forward_retry = 0  # no budget
    assert [s for s, _ in await node.send(3)] == [502] * 3
    assert node.failures(0) == 3 and node.engines[1].hits == 0
    node.pipeline.forward_retry = 1
    node.runtime.backends[1].state = BackendState.UNHEALTHY  # no other backend
    assert [s for s, _ in await node.send(2)] == [502] * 2
    assert node.failures(0) == 5 and node.runtime.backends[0].ejected
    assert node.ejections.status()["counters"]["request_faults_total"] == 0


async def test_a_retry_that_answers_a_4xx_makes_the_failure_the_requests(node: Node) -> None:
    node.engines[0].answer, node.engines[1].answer = CRASH, BAD_REQUEST
    assert [s for s, _ in await node.send(6)] == [400] * 6
    assert node.ejections.rows() == [] and node.ejections.status()["counters"]["request_faults_total"] == 6


async def test_a_4xx_is_neither_a_success_nor_a_failure(node: Node) -> None:
    node.runtime.backends[1].state = BackendState.UNHEALTHY  # m-0 alone
    node.engines[0].answer = CRASH
    await node.send(4)
    assert node.row(0)["consecutive_failures"] == 4
    node.engines[0].answer = BAD_REQUEST  # a client's 400 between failures: resets nothing, counts nothing
    assert [s for s, _ in await node.send(3)] == [400] * 3
    assert node.row(0)["consecutive_failures"] == 4 and node.successes(0) == 0
    assert node.runtime.backends[0].last_success_at is None  # no hysteresis for the health ladder
    node.engines[0].answer = CRASH
    await node.send(1)
    assert node.runtime.backends[0].ejected and node.row(0)["reason"] == "5 consecutive failures"
    node.engines[0].answer = OK
    await node.send(1)  # a last resort while ejected (outcomes while ejected change nothing)
    assert node.runtime.backends[0].last_success_at is not None


async def test_a_half_open_probe_that_ends_in_a_4xx_is_released(node: Node) -> None:
    node.runtime.backends[1].state = BackendState.UNHEALTHY
    node.engines[0].answer = CRASH
    await node.send(5)
    backend = node.runtime.backends[0]
    assert backend.ejected
    node.clock.now += 6.0  # past the 5 s ejection: half-open
    node.ejections._sync(backend)  # (the timer's sync, by hand)
    assert not backend.ejected and node.row(0)["state"] == "half-open"
    node.engines[0].answer = BAD_REQUEST
    probes = node.ejections.detector.probes_total
    assert [s for s, _ in await node.send(1)] == [400]
    # The probe said nothing of the backend: released, not "probing" until probe_timeout_s.
    assert node.ejections.detector.probes_total == probes + 1
    assert not backend.ejected and node.ejections.detector.usable(backend.id, node.clock.now)
    node.engines[0].answer = OK
    assert [s for s, _ in await node.send(1)] == [200]  # the next request is the probe: restored
    assert node.row(0)["state"] == "ok" and node.ejections.detector.probes_total == probes + 2


async def test_a_half_open_probe_whose_failure_is_the_requests_is_released(node: Node) -> None:
    node.engines[0].answer = CRASH
    await node.send(5)  # each served by m-1: m-0 ejected
    backend = node.runtime.backends[0]
    node.clock.now += 6.0
    node.ejections._sync(backend)
    node.engines[1].answer = CRASH  # the next request (m-0's probe, the first of equals) fails on both
    hits = node.engines[0].hits
    assert [s for s, _ in await node.send(1)] == [502]
    assert node.engines[0].hits == hits + 1
    assert node.row(0)["state"] == "half-open" and node.row(0)["ejected_in_row"] == 1
    assert node.ejections.detector.usable(backend.id, node.clock.now) and not backend.ejected
    assert node.ejections.status()["counters"]["request_faults_total"] == 1


@pytest.mark.parametrize("case", ["text_part_no_text", "tools_not_list", "reasoning_format_chat"])
async def test_llama_server_parse_errors_are_the_clients_400_and_count_nothing(node: Node, case: str) -> None:
    """The real llama-server's answers (captures/7e4c0a9-smollm2-error_*): a 500 the adapter
    classifies is the client's 400, never retried nor counted (engines/llamacpp/errors.py)."""
    captured = read_capture(CAPTURES / f"7e4c0a9-smollm2-error_{case}.txt")
    assert captured.status == 500
    for engine in node.engines:
        engine.answer, engine.raw = (500, None), captured.body
    results = await node.send(10)
    assert {(s, body["error"]["code"]) for s, body in results} == {(400, "invalid_request")}
    assert node.engines[1].hits == 0 and node.pipeline.retries == 0  # not retried: the client's fault
    assert node.ejections.rows() == [] and node.ejections.status()["counters"]["request_faults_total"] == 0


# --- a retry on a peer ----------------------------------------------------------------------------

PEER = NodeId("peer-p")


class OnePeer(NoPeers):
    """This node's backends and one peer, ``PEER``, which answers every forward ``answer``
    (the mesh link's part, minus the mesh); ``peer_first``: the router picks the peer first."""

    in_mesh = True

    def __init__(self, node: Node, answer: web.StreamResponse | Failed, peer_first: bool = False) -> None:
        super().__init__({"m": node.runtime})
        self.answer, self.peer_first, self.forwards = answer, peer_first, 0

    def route(self, model: str, *, host: str | None, affinity: str | None, exclude: set[NodeId],
              avoid: Collection[str] = (), endpoint: str | None = None,
              prefix: PrefixQuery | None = None) -> Decision:
        if PEER not in exclude and (self.peer_first or avoid):
            return RunOnPeer(PEER, "p", 1)
        return super().route(model, host=host, affinity=affinity, exclude=exclude, avoid=avoid, endpoint=endpoint,
                             prefix=prefix)

    async def forward(self, call: Call, to: RunOnPeer, offer_id: str | None,
                      headers: dict[str, str]) -> web.StreamResponse | Refused | Failed:
        self.forwards += 1
        return self.answer

    def elsewhere(self, model: str, exclude: Collection[NodeId], avoid: Collection[str]) -> bool:
        return PEER not in exclude or super().elsewhere(model, exclude, avoid)


def peer_failed() -> Failed:
    return Failed(error_response(502, "peer p: backend answered HTTP 500", code="upstream_error"), "HTTP 500")


def peer_row(node: Node) -> dict | None:
    return next((r for r in node.ejections.rows() if r["kind"] == "peer"), None)


async def test_a_local_failure_the_peer_repeats_counts_against_neither(node: Node) -> None:
    node.runtime.backends[1].state = BackendState.UNHEALTHY
    node.engines[0].answer = CRASH
    node.pipeline.peers = peers = OnePeer(node, peer_failed())
    assert [s for s, _ in await node.send(8)] == [502] * 8 and peers.forwards == 8
    assert node.ejections.rows() == [] and node.ejections.status()["counters"]["request_faults_total"] == 8


async def test_a_local_failure_the_peer_serves_counts_against_the_backend(node: Node) -> None:
    node.runtime.backends[1].state = BackendState.UNHEALTHY
    node.engines[0].answer = CRASH
    node.pipeline.peers = OnePeer(node, web.json_response(OK[1]))
    assert [s for s, _ in await node.send(3)] == [200] * 3
    assert node.failures(0) == 3 and peer_row(node) is None  # the peer's success: the mesh link counts it


async def test_a_peer_failure_a_local_backend_serves_counts_against_the_peer(node: Node) -> None:
    node.pipeline.peers = OnePeer(node, peer_failed(), peer_first=True)
    assert [s for s, _ in await node.send(5)] == [200] * 5
    row = peer_row(node)
    assert row is not None and (row["node_id"], row["model"], row["state"]) == (PEER, "m", "ejected")
    assert node.successes(0) == 5


async def test_a_peer_failure_a_local_backend_repeats_counts_against_neither(node: Node) -> None:
    node.engines[0].answer = node.engines[1].answer = CRASH
    node.pipeline.forward_retry = 2
    node.pipeline.peers = OnePeer(node, peer_failed(), peer_first=True)
    assert [s for s, _ in await node.send(6)] == [502] * 6
    assert node.ejections.rows() == [] and node.ejections.status()["counters"]["request_faults_total"] == 6
