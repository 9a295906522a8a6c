"""Trace context across a hop between two real agents, and their spans over OTLP/HTTP (issue 19, item 4).

Node B serves the only model; node A is the origin. Both run ``[tracing]`` pointed at an
OTLP/HTTP receiver this test runs (support/otlp_receiver.py, opentelemetry-proto's decoder),
with ``sample_ratio = 0.5``: a trace id's low 64 bits below 2^63 are recorded, the others not,
whatever the client's sampled flag says. B's fake engine records the headers it got. The
agents get ``OTEL_BSP_SCHEDULE_DELAY=100`` (the SDK's batch delay, ms) so spans arrive soon.
"""

from __future__ import annotations

import re
import shutil
import tempfile
import urllib.request
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path

import pytest

from support.agent import Agent, run_agent
from support.client_keys import chat, request
from support.engines import fake_engine_binary
from support.otlp_receiver import OtlpReceiver, ReceivedSpan
from viiwork.agent.serving.traceparent import TraceParent, parse_traceparent

pytestmark = pytest.mark.timeout(120)

CLIENT_PARENT = "00f067aa0ba902b7"
SAMPLED = "4bf92f3577b34da6" + "0000000000000001"  # low 64 bits < 2^63: recorded at ratio 0.5
SAMPLED_TOO = "4bf92f3577b34da6" + "0000000000000002"
DROPPED = "4bf92f3577b34da6" + "ffffffffffffffff"  # not recorded at ratio 0.5, even when the client says 01
SERVER, CLIENT, INTERNAL = 2, 3, 1


def mesh_section(seeds: list[str]) -> dict:
    return {"trust": "open", "mesh_id": "trace-mesh", "listen": "127.0.0.1:0", "advertise": "127.0.0.1",
            "discovery": ["seeds"], "seeds": seeds, "gossip_interval_ms": 100, "suspect_after_ms": 1000,
            "dead_after_ms": 3000}


@pytest.fixture(scope="module")
def traced_mesh() -> Iterator[tuple[Agent, Agent, OtlpReceiver]]:
    tmp = Path(tempfile.mkdtemp(prefix="viiwork-trace-mesh-", dir="/tmp"))
    try:
        with OtlpReceiver.running() as receiver, pytest.MonkeyPatch.context() as env, ExitStack() as stack:
            env.setenv("OTEL_BSP_SCHEDULE_DELAY", "100")
            tracing = {"endpoint": receiver.url, "sample_ratio": 0.5}
            binary = fake_engine_binary(tmp / "bin")
            b = stack.enter_context(run_agent(
                tmp, [{"name": "only-b", "engine": "llamacpp", "path": "/dev/null", "parallel": 2, "backends": 1,
                       "llamacpp": {"binary": str(binary)}, "env": {"FAKE_TOKENS": "3"}}],
                name="node-b", extra={"mesh": mesh_section([]), "tracing": tracing}))
            seed = b.wait_for(lambda d: bool(d["mesh"]["self"]["mesh"]), 30, "mesh address")["mesh"]["self"]["mesh"]
            a = stack.enter_context(run_agent(tmp, [], name="node-a",
                                              extra={"mesh": mesh_section([seed]), "tracing": tracing}))
            b.wait_healthy("only-b")
            a.wait_for(lambda d: d["mesh"]["peers"].get("alive", 0) == 1, 30, "node-b alive")
            yield a, b, receiver
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def post(agent: Agent, b: Agent, request_id: str, traceparent: str, tracestate: str | None = None,
         stream: bool = False) -> dict[str, str]:
    """A chat request for only-b to ``agent`` (A or B itself); the headers B's engine got for it."""
    headers = {"X-Request-Id": request_id, "traceparent": traceparent}
    if tracestate is not None:
        headers["tracestate"] = tracestate
    status, body, answer = request(f"{agent.url}/v1/chat/completions", chat("only-b", stream=stream), headers)
    assert status == 200, body
    assert answer["x-viiwork-node"] == "node-b"
    seen = [t for t in b.engine_stats("only-b")["traces"] if t["X-Request-Id"] == request_id]
    assert len(seen) == 1, seen
    return seen[0]


def metric(agent: Agent, name: str) -> float:
    with urllib.request.urlopen(f"{agent.url}/metrics", timeout=5) as r:
        text = r.read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name))


def one(spans: list[ReceivedSpan], node: str, name: str) -> ReceivedSpan:
    found = [s for s in spans if s.node == node and s.name == name]
    assert len(found) == 1, (node, name, spans)
    return found[0]


def logged(agent: Agent, request_id: str, trace_id: str) -> bool:
    """The agent's log has a line naming the request id and the trace id."""
    return any(request_id in line and trace_id in line for line in agent.log_text().splitlines())


def test_across_a_hop_the_trace_reaches_the_engine_with_its_spans(
        traced_mesh: tuple[Agent, Agent, OtlpReceiver]) -> None:
    a, b, receiver = traced_mesh
    # The client says "not sampled": the nodes record it anyway (the ratio decides, on the trace id).
    seen = post(a, b, "hop-1", f"00-{SAMPLED}-{CLIENT_PARENT}-00", tracestate="congo=t61rcWkgMzE", stream=True)
    sent = parse_traceparent([seen["traceparent"]])
    assert isinstance(sent, TraceParent)
    assert (sent.trace_id, sent.sampled, seen["tracestate"]) == (SAMPLED, True, "congo=t61rcWkgMzE")
    spans = receiver.wait_for(lambda got: len([s for s in got if s.trace_id == SAMPLED]) >= 7, what="7 spans")
    spans = [s for s in spans if s.trace_id == SAMPLED]
    assert sorted((s.node, s.name) for s in spans) == sorted([
        ("node-a", "POST /v1/chat/completions"), ("node-a", "admission"), ("node-a", "queue wait"),
        ("node-a", "hop"), ("node-b", "POST /v1/chat/completions"), ("node-b", "admission"),
        ("node-b", "engine")])
    a_request, b_request = one(spans, "node-a", "POST /v1/chat/completions"), one(spans, "node-b",
                                                                                   "POST /v1/chat/completions")
    hop, engine = one(spans, "node-a", "hop"), one(spans, "node-b", "engine")
    # The tree: client -> A's request -> (admission, queue wait, hop) -> B's request -> (admission, engine) -> engine.
    assert a_request.parent_id == CLIENT_PARENT and a_request.kind == SERVER
    for name in ("admission", "queue wait", "hop"):
        assert one(spans, "node-a", name).parent_id == a_request.span_id
    assert {one(spans, "node-a", name).kind for name in ("admission", "queue wait")} == {INTERNAL}
    assert b_request.parent_id == hop.span_id and hop.kind == CLIENT and hop.attributes["viiwork.peer"] == "node-b"
    for name in ("admission", "engine"):
        assert one(spans, "node-b", name).parent_id == b_request.span_id
    assert (b_request.kind, engine.kind) == (SERVER, CLIENT)
    assert sent.parent_id == engine.span_id and engine.attributes["viiwork.backend"] == "only-b-0"
    assert {s.service for s in spans} == {"viiwork"} and not any(s.error for s in spans)
    for span in (a_request, b_request):
        assert (span.attributes["viiwork.request_id"], span.attributes["http.response.status_code"]) == ("hop-1", "200")
    assert b_request.attributes["viiwork.origin"] == "node-a"
    # Both nodes log the request id with the trace id; the exports went through.
    assert logged(a, "hop-1", SAMPLED) and logged(b, "hop-1", SAMPLED)
    assert not any("not exported" in agent.log_text() for agent in (a, b))
    for agent in (a, b):
        assert metric(agent, 'viiwork_tracing_spans_exported_total{result="ok"}') >= 3
        assert metric(agent, 'viiwork_tracing_spans_exported_total{result="failed"}') == 0


def test_through_one_agent(traced_mesh: tuple[Agent, Agent, OtlpReceiver]) -> None:
    a, b, receiver = traced_mesh
    seen = post(b, b, "one-1", f"00-{SAMPLED_TOO}-{CLIENT_PARENT}-01")
    assert seen["traceparent"].startswith(f"00-{SAMPLED_TOO}-") and seen["tracestate"] is None
    spans = receiver.wait_for(lambda got: len([s for s in got if s.trace_id == SAMPLED_TOO]) >= 4, what="4 spans")
    assert sorted(s.name for s in spans if s.trace_id == SAMPLED_TOO) == [
        "POST /v1/chat/completions", "admission", "engine", "queue wait"]
    assert logged(b, "one-1", SAMPLED_TOO)


def test_a_clients_sampled_flag_does_not_force_recording(traced_mesh: tuple[Agent, Agent, OtlpReceiver]) -> None:
    """The client says "sampled" for a trace id the ratio leaves out: no node records it, and
    each passes the client's parent id on (nothing of its own is in the trace), not sampled."""
    a, b, receiver = traced_mesh
    seen = post(a, b, "dropped-1", f"00-{DROPPED}-{CLIENT_PARENT}-01")
    assert seen["traceparent"] == f"00-{DROPPED}-{CLIENT_PARENT}-00"
    # A trace recorded after it: once its spans are in, the first one's would have been too.
    marker = "4bf92f3577b34da6" + "0000000000000003"
    post(a, b, "after-1", f"00-{marker}-{CLIENT_PARENT}-00")
    receiver.wait_for(lambda got: len([s for s in got if s.trace_id == marker]) >= 7, what="the marker's spans")
    assert receiver.of_trace(DROPPED) == []
    assert logged(a, "dropped-1", DROPPED) and logged(b, "dropped-1", DROPPED)


def test_an_invalid_traceparent_is_replaced_and_counted(traced_mesh: tuple[Agent, Agent, OtlpReceiver]) -> None:
    a, b, receiver = traced_mesh
    counter = 'viiwork_trace_context_invalid_total{header="traceparent",reason="zero_id"}'
    before = metric(a, counter)
    seen = post(a, b, "invalid-1", f"00-{'0' * 32}-{CLIENT_PARENT}-01")
    sent = parse_traceparent([seen["traceparent"]])
    assert isinstance(sent, TraceParent) and sent.trace_id != "0" * 32 and sent.parent_id != CLIENT_PARENT
    assert metric(a, counter) == before + 1
    assert metric(b, counter) == 0  # A sent B a valid one: the new trace
    assert logged(a, "invalid-1", sent.trace_id) and logged(b, "invalid-1", sent.trace_id)
    assert re.search(r"traceparent from \S+ is invalid \(zero_id\)", a.log_text())
