"""Outlier ejection acted on (issue 22): the router's rules, the backends' flag, the retry
before the first byte on a standalone node, and the views (viiworkctl status and mesh).

The detector itself is tests/unit/test_outliers.py; agents on loopback, with peers, are
tests/mesh/test_outlier_ejection.py.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from urllib.parse import urlsplit

import aiohttp
import pytest
from rich.console import Console

from support.api_app import agent_api
from support.procs import fake_engine
from support.replay import Captured, ReplayServer
from viiwork.agent.cli import mesh as cli_mesh
from viiwork.agent.cli import status as cli_status
from viiwork.agent.config.schema import ModelConfig
from viiwork.agent.serving.ejections import Ejections
from viiwork.agent.serving.outliers import OutlierSettings
from viiwork.agent.serving.pipeline import NoPeers
from viiwork.agent.serving.router import (
    LocalBackend,
    LocalModel,
    PeerSnapshot,
    Queue,
    Reservations,
    Router,
    RunLocal,
    RunOnPeer,
)
from viiwork.agent.supervision.backends import Backend, BackendId, BackendState, ModelRuntime
from viiwork.engines.registry import get_engine
from viiwork.mesh.identity import NodeId
from viiwork.mesh.membership import Liveness
from viiwork.mesh.summary import ModelCapacity, PublishedState

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
ENGINE_503 = Captured(503, (("Content-Type", "application/json"),),
                      b'{"error":{"code":503,"message":"CUDA error: out of memory","type":"server_error"}}')
# A 5xx that llama.cpp's adapter classifies as the client's fault (docs/engines.md): not a failure.
IMAGE_500 = Captured(500, (("Content-Type", "application/json"),),
                     b'{"error":{"code":500,"message":"image input is not supported - hint: if this is unexpected, '
                     b'you may need to provide the mmproj","type":"server_error"}}')


# --- the router ----------------------------------------------------------------------------------

def router() -> Router:
    return Router(NodeId("self"), "self", stale_after_ms=3000, reservations=Reservations(clock=lambda: 0.0),
                  rng=random.Random(1))


def peer(node: str, free: int, slots: int = 2) -> PeerSnapshot:
    cap = ModelCapacity(name="m", engine="llamacpp", kind="chat", slots=slots, busy=slots - free, waiting=0,
                        ctx_per_slot=4096, healthy=1, total=1)
    return PeerSnapshot(node_id=NodeId(node), name=node, liveness=Liveness.ALIVE, state=PublishedState.SERVING,
                        age_ms=10.0, order=(1, 1), models=(cap,), rtt_ms=1.0)


def local(free: dict[str, int], ejected: dict[str, int] | None = None) -> dict[str, LocalModel]:
    ejected = ejected or {}
    backends = tuple(LocalBackend(b, n) for b, n in free.items()) + tuple(LocalBackend(b, 0) for b in ejected)
    return {"m": LocalModel(name="m", kind="chat", backends=backends, slots=2 * len(free), can_serve=True,
                            ejected=tuple(LocalBackend(b, n) for b, n in ejected.items()))}


def test_an_ejected_peer_gets_nothing_while_another_candidate_exists() -> None:
    r = router()
    peers = [peer("bad", 2), peer("good", 1)]
    for _ in range(20):
        assert r.route("m", {}, peers, ejected={NodeId("bad")}) == RunOnPeer(NodeId("good"), "good", 1)
    # The good one busy: wait for it rather than send to the ejected one.
    assert isinstance(r.route("m", {}, [peer("bad", 2), peer("good", 0)], ejected={NodeId("bad")}), Queue)


def test_when_every_candidate_is_ejected_the_ejections_are_ignored() -> None:
    r = router()
    assert r.route("m", {}, [peer("bad", 2)], ejected={NodeId("bad")}) == RunOnPeer(NodeId("bad"), "bad", 2)
    # This node's only backend ejected, no peer: it still runs here (the client gets its real error).
    assert r.route("m", local({}, {"m-0": 2}), []) == RunLocal("m-0")
    # ... but with a peer that is not ejected, the peer takes it.
    assert r.route("m", local({}, {"m-0": 2}), [peer("good", 1)]) == RunOnPeer(NodeId("good"), "good", 1)
    # Both ejected: ignored together; local first.
    assert r.route("m", local({}, {"m-0": 2}), [peer("bad", 2)], ejected={NodeId("bad")}) == RunLocal("m-0")


def test_a_request_avoids_the_local_backend_it_failed_on() -> None:
    r = router()
    assert r.route("m", local({"m-0": 2, "m-1": 1}), [], avoid={"m-0"}) == RunLocal("m-1")
    assert r.route("m", local({"m-0": 2}), [peer("good", 1)], avoid={"m-0"}) == RunOnPeer(NodeId("good"), "good", 1)
    assert isinstance(r.route("m", local({"m-0": 2}), [], avoid={"m-0"}), Queue)


def test_a_pinned_request_ignores_ejections() -> None:
    r = router()
    assert r.route("m", {}, [peer("bad", 2)], host="bad", ejected={NodeId("bad")}) == RunOnPeer(NodeId("bad"), "bad", 2)
    assert r.route("m", local({}, {"m-0": 2}), [], host="self") == RunLocal("m-0")


# --- backends, capacity and the Ejections glue -----------------------------------------------------

def runtime(n: int = 2, port: int = 1, engine: str = "llamacpp") -> ModelRuntime:
    cfg = ModelConfig.model_validate({"name": "m", "engine": engine, "path": "/x.gguf", "parallel": 2})
    rt = ModelRuntime(config=cfg, engine=get_engine(engine))
    for i in range(n):
        rt.backends.append(Backend(id=BackendId(f"m-{i}"), model="m", index=i, state=BackendState.HEALTHY,
                                   port=port + i, parallel=2))
    return rt


def test_an_ejected_backend_leaves_capacity_and_routing_but_stays_a_last_resort() -> None:
    rt = runtime(2)
    rt.backends[0].ejected = True
    cap = rt.capacity()
    assert (cap.slots, cap.free, cap.healthy, cap.total) == (2, 2, 1, 2)
    assert cap.free_by_backend == (("m-0", 0), ("m-1", 2)) and cap.ejected == (("m-0", 2),)
    assert rt.most_free() is rt.backends[1]
    peers = NoPeers({"m": rt})
    assert peers.route("m", host=None, affinity=None, exclude=set()) == RunLocal(BackendId("m-1"))
    rt.backends[1].ejected = True  # every backend ejected: the one with the most spare slots
    assert rt.capacity().slots == 0 and rt.most_free() is None
    assert peers.route("m", host=None, affinity=None, exclude=set()) == RunLocal(BackendId("m-0"))
    assert peers.route("m", host=None, affinity=None, exclude=set(), avoid={"m-0"}) == RunLocal(BackendId("m-1"))
    assert isinstance(peers.route("m", host=None, affinity=None, exclude=set(), avoid={"m-0", "m-1"}), Queue)


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_the_flag_follows_the_detector_and_a_repeat_offender_is_reported() -> None:
    rt = runtime(1)
    backend = rt.backends[0]
    changes: list[bool] = []
    rt.listeners.append(lambda _rt: changes.append(backend.ejected))
    reports: list[tuple[str, str, str]] = []
    clock = Clock()
    ej = Ejections({"m": rt}, OutlierSettings(jitter=0.0, base_ejection_s=5.0, report_after_ejections=2),
                   report=lambda m, b, why: reports.append((m, b, why)) or True, clock=clock)
    for _ in range(4):
        ej.outcome(backend, False)
    assert not backend.ejected
    ej.outcome(backend, True)  # a success in between: 4 failures in a row, not 5
    for _ in range(5):
        ej.outcome(backend, False)
    assert backend.ejected and changes == [True] and not reports
    clock.now = 5.1  # the ejection is over: half-open (the timer's sync, done here by hand)
    ej._sync(backend)
    assert not backend.ejected and changes == [True, False]
    ej.sent(backend)  # the probe goes: nothing else until its outcome
    assert backend.ejected
    ej.outcome(backend, False)  # ejected again (2 in a row): reported
    assert reports == [("m", "m-0", "ejected 2 times in a row: probe failed")]
    # The supervisor replaces the engine: the new one is probed as soon as it admits, not
    # after the 10 s this ejection would last (found by a newcomer: a fresh engine sat idle).
    assert not backend.ejected and ej.detector.state(backend.id, clock.now) == "half-open"
    assert ej.detector.ejected_in_row(backend.id) == 2
    ej.sent(backend)
    ej.outcome(backend, True)  # the probe succeeded: restored
    assert not backend.ejected
    assert ej.status()["counters"] == {"ejections_total": 2, "restores_total": 1, "probes_total": 2,
                                       "dropped_total": 0, "reports_total": 1, "request_faults_total": 0}
    assert ej.rows()[0]["kind"] == "backend" and ej.rows()[0]["state"] == "ok"


def test_a_declined_report_keeps_the_backend_ejected() -> None:
    """The supervisor keeps the backend in service (a report never spends its last respawn,
    agent/supervision/health_ladder.py): nothing replaces the engine, so its ejection runs on,
    rather than a probe at once after every report."""
    rt = runtime(1)
    backend = rt.backends[0]
    clock = Clock()
    ej = Ejections({"m": rt}, OutlierSettings(jitter=0.0, report_after_ejections=1),
                   report=lambda m, b, why: False, clock=clock)
    for _ in range(5):
        ej.outcome(backend, False)
    assert ej.reports == 1 and backend.ejected and ej.detector.state(backend.id, clock.now) == "ejected"


def test_a_probe_that_says_nothing_is_released() -> None:
    rt = runtime(1)
    backend = rt.backends[0]
    clock = Clock()
    ej = Ejections({"m": rt}, OutlierSettings(jitter=0.0), clock=clock)
    for _ in range(5):
        ej.outcome(backend, False)
    assert not ej.sent(backend)  # ejected: no probe
    clock.now = 5.1
    assert ej.sent(backend) and backend.ejected  # the probe runs
    assert not ej.sent(backend)
    ej.unjudged(backend)  # it ended in a client's 4xx
    assert not backend.ejected and ej.detector.usable(backend.id, clock.now)
    assert ej.sent(backend)  # the next request is the probe
    ej.outcome(backend, True)
    assert ej.detector.state(backend.id, clock.now) == "ok" and not ej.sent(backend)
    # Peers: the same, per (peer, model).
    for _ in range(5):
        ej.peer_outcome(NodeId("p"), "p", "m", False)
    clock.now = 11.0
    assert ej.peer_sent(NodeId("p"), "m") and not ej.peer_usable(NodeId("p"), "m")
    ej.peer_unjudged(NodeId("p"), "m")
    assert ej.peer_usable(NodeId("p"), "m") and ej.peer_sent(NodeId("p"), "m")


def test_disabled_records_nothing() -> None:
    rt = runtime(1)
    ej = Ejections({"m": rt}, enabled=False)
    for _ in range(50):
        ej.outcome(rt.backends[0], False)
        ej.peer_outcome(NodeId("p"), "p", "m", False)
    assert not rt.backends[0].ejected and ej.peer_usable(NodeId("p"), "m") and ej.rows() == []


def test_a_peer_is_ejected_per_model_and_restored_after_its_probe() -> None:
    clock = Clock()
    ej = Ejections({}, OutlierSettings(jitter=0.0), clock=clock)
    for _ in range(5):
        ej.peer_outcome(NodeId("p"), "node-p", "m", False)
    assert not ej.peer_usable(NodeId("p"), "m") and ej.peer_usable(NodeId("p"), "other")
    assert ej.ejected_peers("m", [NodeId("p"), NodeId("q")]) == {NodeId("p")}
    row = ej.rows()[0]
    assert (row["kind"], row["node"], row["model"], row["state"]) == ("peer", "node-p", "m", "ejected")
    clock.now = 6.0
    assert ej.peer_usable(NodeId("p"), "m")
    ej.peer_sent(NodeId("p"), "m")  # the probe
    assert not ej.peer_usable(NodeId("p"), "m")
    ej.peer_outcome(NodeId("p"), "node-p", "m", True)
    assert ej.peer_usable(NodeId("p"), "m") and ej.peer_state("p", "m") == "ok"


# --- the retry before the first byte, standalone ---------------------------------------------------

@pytest.fixture(scope="module")
def good_port() -> Iterator[int]:
    with fake_engine("m", parallel=4, env={"FAKE_TOKENS": "3"}) as port:
        yield port


async def test_a_local_5xx_runs_again_on_the_other_backend_and_the_bad_one_is_ejected(good_port: int) -> None:
    async with ReplayServer({"/v1/chat/completions": ENGINE_503}) as bad:
        rt = runtime(2)
        rt.backends[0].port = urlsplit(bad).port  # the first of equals: routing tries it first
        bad_server = rt.backends[0]
        rt.backends[1].port = good_port
        async with agent_api({"m": rt}) as (url, api), aiohttp.ClientSession() as http:
            hits = []
            for stream in [False, True] * 10:
                async with http.post(f"{url}/v1/chat/completions", json={**CHAT, "stream": stream}) as r:
                    body = await r.read()
                    assert r.status == 200 and r.headers["X-Viiwork-Backend"] == "m-1", body
                hits.append(bad_server.ejected)
            assert hits.index(True) == 4  # ejected after 5 failures in a row, each retried on m-1
            doc = api.ejections.status()
            assert doc["counters"]["ejections_total"] == 1 and api.pipeline.retries == 5
            # No retry left (forward_retry 0): the engine's error, as the error contract renders it.
            api.pipeline.forward_retry = 0
            bad_server.ejected = False
            api.ejections.detector.forget("m-0")
            async with http.post(f"{url}/v1/chat/completions", json=CHAT) as r:
                assert r.status == 502 and (await r.json())["error"]["code"] == "upstream_error"


async def test_a_client_fault_5xx_is_not_a_failure_nor_retried(good_port: int) -> None:
    async with ReplayServer({"/v1/chat/completions": IMAGE_500}) as bad:
        rt = runtime(2)
        rt.backends[0].port = urlsplit(bad).port
        rt.backends[1].port = good_port
        async with agent_api({"m": rt}) as (url, api), aiohttp.ClientSession() as http:
            for _ in range(8):
                async with http.post(f"{url}/v1/chat/completions", json=CHAT) as r:
                    assert r.status == 400 and (await r.json())["error"]["code"] == "unsupported_content"
            assert not rt.backends[0].ejected and api.pipeline.retries == 0
            assert api.ejections.status()["counters"]["ejections_total"] == 0


async def test_the_metrics_and_status_sections(good_port: int) -> None:
    async with ReplayServer({"/v1/chat/completions": ENGINE_503}) as bad:
        rt = runtime(1)
        rt.backends[0].port = urlsplit(bad).port
        async with agent_api({"m": rt}) as (url, _), aiohttp.ClientSession() as http:
            for _ in range(6):
                async with http.post(f"{url}/v1/chat/completions", json=CHAT) as r:
                    assert r.status == 502  # the only backend: its own error, ejected or not
            async with http.get(f"{url}/metrics") as r:
                text = await r.text()
            async with http.get(f"{url}/v1/status") as r:
                doc = await r.json()
    assert "viiwork_outlier_ejections_total 1.0" in text
    assert 'viiwork_outlier_ejected{kind="backend"} 1.0' in text and "viiwork_retries_total 0.0" in text
    assert doc["outliers"]["enabled"] is True and doc["outliers"]["targets"][0]["backend"] == "m-0"


# --- viiworkctl -------------------------------------------------------------------------------------

def render(func: object, doc: dict) -> str:
    console = Console(width=240, record=True, force_terminal=False)
    func(doc, console)  # type: ignore[operator]
    return console.export_text()


def test_viiworkctl_status_and_mesh_show_ejections() -> None:
    status_doc = {"node": {"name": "a"}, "models": [{"name": "m", "backends": [
        {"id": "m-0", "state": "healthy", "ejected": True, "busy": 0, "slots": 2}]}],
        "outliers": {"targets": [
            {"kind": "backend", "backend": "m-0", "state": "ejected", "ejected_remaining_s": 4.2,
             "ejected_in_row": 1, "reason": "5 consecutive failures"},
            {"kind": "peer", "node": "node-b", "model": "m", "state": "half-open", "ejected_in_row": 2,
             "reason": "probe failed"},
            {"kind": "peer", "node": "node-c", "model": "m", "state": "ok", "ejected_in_row": 0, "reason": ""}]}}
    out = render(cli_status.render, status_doc)
    assert "healthy (ejected)" in out
    assert "outlier backend m-0: ejected, 4.2 s left (ejection 1 in a row): 5 consecutive failures" in out
    assert "outlier peer node-b for m: half-open (ejection 2 in a row): probe failed" in out
    assert "node-c" not in out
    mesh_doc = {"self": {"name": "a", "models": [{"name": "m", "busy": 0, "slots": 0, "ejected_backends": ["m-0"]}]},
                "nodes": [{"name": "b", "id": "bbb", "liveness": "alive", "state": "serving",
                           "models": [{"name": "m", "busy": 0, "slots": 2, "ejected": True}]}]}
    out = render(cli_mesh.render, mesh_doc)
    assert "m 0/2 (ejected)" in out and "ejected here: m-0 (m)" in out
