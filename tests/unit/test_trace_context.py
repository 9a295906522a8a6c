"""W3C trace context (issue 19, item 4): the headers' rules, and their way through one agent to
a real fake-engine process (the client API and proxy as the agent runs them, no [tracing]).

Across a hop between two agents, and the spans exported with [tracing]: tests/mesh/test_agents_tracing.py.
"""

from __future__ import annotations

import asyncio
import logging
import os
import random
import subprocess
import sys
import textwrap
from pathlib import Path

import aiohttp
import pytest

from support.agent import write_config
from support.api_app import agent_api
from support.procs import fake_engine, free_port
from viiwork.agent.config.load import ConfigError, parse_config
from viiwork.agent.config.schema import ModelConfig
from viiwork.agent.serving.traceparent import (
    MAX_TRACEPARENT_CHARS,
    MAX_TRACESTATE_CHARS,
    IdSource,
    Invalid,
    TraceParent,
    parse_traceparent,
    parse_tracestate,
)
from viiwork.agent.serving.tracing import traces_url
from viiwork.agent.supervision.backends import Backend, BackendId, BackendState, ModelRuntime
from viiwork.engines.registry import get_engine

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT_ID = "00f067aa0ba902b7"
VALID = f"00-{TRACE_ID}-{PARENT_ID}-01"


@pytest.mark.parametrize(("values", "expected"), [
    pytest.param([], None, id="absent"),
    pytest.param([VALID], TraceParent(TRACE_ID, PARENT_ID, True), id="valid-sampled"),
    pytest.param([f"00-{TRACE_ID}-{PARENT_ID}-00"], TraceParent(TRACE_ID, PARENT_ID, False), id="valid-unsampled"),
    pytest.param([f"00-{TRACE_ID}-{PARENT_ID}-03"], TraceParent(TRACE_ID, PARENT_ID, True), id="other-flag-bits"),
    pytest.param([f"cc-{TRACE_ID}-{PARENT_ID}-01"], TraceParent(TRACE_ID, PARENT_ID, True), id="later-version"),
    pytest.param([f"cc-{TRACE_ID}-{PARENT_ID}-01-what-comes-next"], TraceParent(TRACE_ID, PARENT_ID, True),
                 id="later-version-with-more-fields"),
    pytest.param([f"cc-{TRACE_ID}-{PARENT_ID}-01x"], Invalid.MALFORMED, id="later-version-no-dash-after-flags"),
    pytest.param([f"00-{TRACE_ID}-{PARENT_ID}-01-"], Invalid.MALFORMED, id="version-00-too-long"),
    pytest.param([f"00-{TRACE_ID}-{PARENT_ID}-1"], Invalid.MALFORMED, id="short"),
    pytest.param([f"ff-{TRACE_ID}-{PARENT_ID}-01"], Invalid.VERSION, id="version-ff"),
    pytest.param([f"00-{TRACE_ID.upper()}-{PARENT_ID}-01"], Invalid.MALFORMED, id="uppercase-hex"),
    pytest.param([f"00-{TRACE_ID}-{PARENT_ID}-0g"], Invalid.MALFORMED, id="flags-not-hex"),
    pytest.param([f"00_{TRACE_ID}_{PARENT_ID}_01"], Invalid.MALFORMED, id="wrong-separator"),
    pytest.param([f"00-{'0' * 32}-{PARENT_ID}-01"], Invalid.ZERO_ID, id="zero-trace-id"),
    pytest.param([f"00-{TRACE_ID}-{'0' * 16}-01"], Invalid.ZERO_ID, id="zero-parent-id"),
    pytest.param([f"cc-{TRACE_ID}-{PARENT_ID}-01-" + "x" * MAX_TRACEPARENT_CHARS], Invalid.TOO_LONG, id="too-long"),
    pytest.param([VALID, VALID], Invalid.REPEATED, id="two-headers"),
])
def test_traceparent_rules(values: list[str], expected: TraceParent | Invalid | None) -> None:
    assert parse_traceparent(values) == expected


@pytest.mark.parametrize(("values", "expected"), [
    pytest.param(["congo=t61rcWkgMzE,rojo=00f067aa0ba902b7"], "congo=t61rcWkgMzE,rojo=00f067aa0ba902b7", id="two"),
    pytest.param(["congo=t61rcWkgMzE", "rojo=00f067aa0ba902b7"], "congo=t61rcWkgMzE,rojo=00f067aa0ba902b7",
                 id="two-headers-one-list"),
    pytest.param([" a=1 ,, b@sys=2\t"], "a=1,b@sys=2", id="spaces-empty-members-multi-tenant-key"),
    pytest.param(["a=1,a=2"], None, id="key-twice"),
    pytest.param(["Upper=1"], None, id="uppercase-key"),
    pytest.param(["a=1,novalue"], None, id="member-without-equals"),
    pytest.param(["a=x,y"], None, id="comma-in-value-makes-a-bad-member"),
    pytest.param(["a=b=c"], None, id="equals-in-value"),
    pytest.param(["a=caf\u00e9"], None, id="non-ascii-value"),
    pytest.param([",".join(f"k{i}=v" for i in range(33))], None, id="33-members"),
    pytest.param(["a=" + "x" * 9000], None, id="too-long-to-read"),
    pytest.param([""], None, id="empty"),
])
def test_tracestate_rules(values: list[str], expected: str | None) -> None:
    assert parse_tracestate(values) == expected


def test_a_long_tracestate_is_cut_long_members_first_then_from_the_end() -> None:
    long_member = "long=" + "l" * 200
    members = [f"k{i:02d}=" + "v" * 40 for i in range(12)]  # 44 characters each
    cut = parse_tracestate([",".join([members[0], long_member, *members[1:]])])
    assert cut is not None and len(cut) <= MAX_TRACESTATE_CHARS
    assert "long=" not in cut
    kept = cut.split(",")
    assert kept == members[:len(kept)] and len(kept) == 11  # 11 * 45 - 1 = 494 fits, 12 do not


class _ZerosFirst(random.Random):
    """Gives 0 for its first ``zeros`` draws (an id the recommendation forbids), then 5."""

    def __init__(self, zeros: int) -> None:
        super().__init__(0)
        self.zeros = zeros

    def getrandbits(self, k: int, /) -> int:
        self.zeros -= 1
        return 0 if self.zeros >= 0 else 5


def test_new_ids_are_never_all_zero() -> None:
    ids = IdSource(_ZerosFirst(2))
    assert ids.trace_id() == "0" * 31 + "5"
    ids = IdSource(_ZerosFirst(1))
    assert ids.span_id() == "0" * 15 + "5"
    fresh = IdSource()
    assert len({fresh.trace_id() for _ in range(100)}) == 100


@pytest.mark.parametrize(("endpoint", "url"), [
    ("http://collector:4318", "http://collector:4318/v1/traces"),
    ("http://collector:4318/", "http://collector:4318/v1/traces"),
    ("https://otel.example/custom/path", "https://otel.example/custom/path"),
])
def test_traces_url(endpoint: str, url: str) -> None:
    assert traces_url(endpoint) == url


@pytest.mark.parametrize(("table", "path", "fragment"), [
    pytest.param('endpoint = "collector:4318"', "tracing.endpoint", "does not start with http:// or https://", id="no-scheme"),
    pytest.param('endpoint = "not a url"', "tracing.endpoint", "space or a control character", id="spaces"),
    pytest.param('endpoint = "http://"', "tracing.endpoint", "no host", id="no-host"),
    pytest.param('endpoint = "http://u:p@h:4318"', "tracing.endpoint", "credentials", id="credentials"),
    pytest.param('endpoint = "http://h:4318"\nsample_ratio = 1.5', "tracing.sample_ratio",
                 "less than or equal to 1", id="ratio-above-1"),
    pytest.param('endpoint = "http://h:4318"\nsample_ratio = -0.1', "tracing.sample_ratio",
                 "greater than or equal to 0", id="ratio-below-0"),
    pytest.param("sample_ratio = 0.5", "tracing.endpoint", "required", id="no-endpoint"),
])
def test_bad_tracing_config_names_the_key(table: str, path: str, fragment: str) -> None:
    with pytest.raises(ConfigError) as info:
        parse_config(f"[tracing]\n{table}\n", "test.toml")
    [issue] = info.value.issues
    assert issue.dotted == path, str(issue)
    assert fragment in issue.message, str(issue)


def test_tracing_config_defaults() -> None:
    config = parse_config('[tracing]\nendpoint = "http://127.0.0.1:4318"\n', "test.toml")
    assert config.tracing is not None
    assert (config.tracing.sample_ratio, config.tracing.service_name) == (1.0, "viiwork")
    assert parse_config("", "test.toml").tracing is None


def test_without_tracing_the_sdk_is_never_imported() -> None:
    """An agent without [tracing] loads no OpenTelemetry module (its import costs ~100 ms and
    memory); with it, Tracing.start loads the SDK (so the check above can fail)."""
    script = textwrap.dedent("""\
        import sys
        import viiwork.agent.main
        from viiwork.agent.config.schema import TracingConfig
        from viiwork.agent.serving.tracing import Tracing
        Tracing(None, node_name="n").start()
        print(sorted(m for m in sys.modules if m.startswith("opentelemetry")))
        Tracing(TracingConfig(endpoint="http://127.0.0.1:9"), node_name="n").start()
        print("opentelemetry.sdk.trace" in sys.modules)
        """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.split("\n")[:2] == ["[]", "True"], out.stdout + out.stderr


# -- through one agent (no [tracing]: the headers only) ------------------------------------------


@pytest.fixture(scope="module")
def engine_port() -> int:
    with fake_engine("m", parallel=4, env={"FAKE_TOKENS": "3"}) as port:
        yield port


def _runtime(port: int) -> ModelRuntime:
    rt = ModelRuntime(config=ModelConfig.model_validate({"name": "m", "engine": "llamacpp", "path": "/x.gguf"}),
                      engine=get_engine("llamacpp"))
    rt.backends.append(Backend(id=BackendId("m#0"), model="m", index=0, state=BackendState.HEALTHY, port=port,
                               parallel=4))
    return rt


CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}


async def _engine_traces(http: aiohttp.ClientSession, engine_port: int) -> list[dict]:
    async with http.get(f"http://127.0.0.1:{engine_port}/fake/stats") as r:
        return (await r.json())["traces"]


async def _metric(http: aiohttp.ClientSession, url: str, line_start: str) -> float:
    async with http.get(f"{url}/metrics") as r:
        text = await r.text()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(line_start))


async def test_traceparent_reaches_the_engine_unchanged(engine_port: int, caplog: pytest.LogCaptureFixture) -> None:
    """Without [tracing] the node records nothing: the trace id and the caller's parent id go on
    as received, the sampled flag is this node's decision (not sampled: the client's 01 does not
    force it), tracestate goes on, and the request id is logged with the trace id."""
    caplog.set_level(logging.DEBUG, logger="viiwork.agent.serving.tracing")
    async with agent_api({"m": _runtime(engine_port)}) as (url, _), aiohttp.ClientSession() as http:
        for stream in (False, True):
            async with http.post(f"{url}/v1/chat/completions", json={**CHAT, "stream": stream}, headers={
                    "traceparent": VALID, "tracestate": "congo=t61rcWkgMzE", "X-Request-Id": f"req-{stream}"}) as r:
                assert r.status == 200, await r.text()
                await r.read()
            seen = (await _engine_traces(http, engine_port))[-1]
            assert seen == {"X-Request-Id": f"req-{stream}", "traceparent": f"00-{TRACE_ID}-{PARENT_ID}-00",
                            "tracestate": "congo=t61rcWkgMzE"}
    assert any("req-True" in m and TRACE_ID in m for m in caplog.messages), caplog.messages


async def test_absent_or_invalid_traceparent_gets_a_new_trace(engine_port: int) -> None:
    async with agent_api({"m": _runtime(engine_port)}) as (url, _), aiohttp.ClientSession() as http:
        invalid = f'viiwork_trace_context_invalid_total{{header="traceparent",reason="{Invalid.VERSION.value}"}}'
        dropped = 'viiwork_trace_context_invalid_total{header="tracestate",reason="malformed"}'
        assert await _metric(http, url, invalid) == 0
        new_ids = set()
        for headers in ({}, {"traceparent": f"ff-{TRACE_ID}-{PARENT_ID}-01", "tracestate": "a=1"}):
            async with http.post(f"{url}/v1/chat/completions", json=CHAT, headers=headers) as r:
                assert r.status == 200, await r.text()
            seen = (await _engine_traces(http, engine_port))[-1]
            parsed = parse_traceparent([seen["traceparent"]])
            assert isinstance(parsed, TraceParent) and not parsed.sampled
            assert parsed.trace_id != TRACE_ID and parsed.parent_id != PARENT_ID
            assert seen["tracestate"] is None  # a new trace carries no caller's state
            new_ids.add(parsed.trace_id)
        assert len(new_ids) == 2
        assert await _metric(http, url, invalid) == 1
        # A valid traceparent with a tracestate that breaks a rule: the state is dropped, counted.
        async with http.post(f"{url}/v1/chat/completions", json=CHAT,
                             headers={"traceparent": VALID, "tracestate": "a=1,a=2"}) as r:
            assert r.status == 200
        seen = (await _engine_traces(http, engine_port))[-1]
        assert seen["traceparent"].split("-")[1] == TRACE_ID and seen["tracestate"] is None
        assert await _metric(http, url, dropped) == 1


def test_tracing_without_the_sdk_is_a_clear_error_at_start(tmp_path: Path) -> None:
    """An agent whose config has [tracing] on an installation without the OpenTelemetry SDK
    exits 1 at start, saying what to install (an ``opentelemetry`` package that fails to import,
    first on PYTHONPATH, stands for the missing SDK)."""
    blocker = tmp_path / "blocker" / "opentelemetry"
    blocker.mkdir(parents=True)
    (blocker / "__init__.py").write_text("raise ImportError('not installed here', name='opentelemetry')\n")
    config = write_config(tmp_path, [], "node-t", {"tracing": {"endpoint": "http://127.0.0.1:9/v1/traces"}},
                          free_port())
    agent = Path(sys.executable).parent / "viiwork-agent"
    done = subprocess.run([str(agent), "--config", str(config)], capture_output=True, text=True, timeout=60,
                          env={**os.environ, "PYTHONPATH": str(blocker.parent)})
    assert done.returncode == 1, done.stderr[-2000:]
    assert "[tracing] is set but the OpenTelemetry SDK is not installed" in done.stderr
    assert "pip install 'viiwork[tracing]'" in done.stderr


async def test_a_receiver_that_is_down_is_counted_and_logged_once(engine_port: int,
                                                                 caplog: pytest.LogCaptureFixture) -> None:
    """[tracing] pointed at a port nothing listens on: the requests are answered, the spans
    that could not be exported are counted in /metrics, and the failure is one WARNING line
    (the SDK's retry lines each once), however many batches fail."""
    from viiwork.agent.config.schema import TracingConfig
    from viiwork.agent.serving.tracing import Tracing

    caplog.set_level(logging.INFO)
    tracing = Tracing(TracingConfig(endpoint=f"http://127.0.0.1:{free_port()}/v1/traces", timeout_s=0.3),
                      node_name="test-node")
    tracing.start()
    assert tracing.spans is not None
    try:
        async with agent_api({"m": _runtime(engine_port)}, tracing=tracing) as (url, _), \
                aiohttp.ClientSession() as http:
            for _batch in range(3):
                async with http.post(f"{url}/v1/chat/completions", json=CHAT) as r:
                    assert r.status == 200
                # Each batch exported now (and refused): the SDK's thread, off the loop.
                await asyncio.to_thread(tracing.spans.provider.force_flush, 5000)
            failed = 'viiwork_tracing_spans_exported_total{result="failed"}'
            assert await _metric(http, url, failed) == 3 * 4  # request, admission, queue wait, engine
            assert await _metric(http, url, 'viiwork_tracing_spans_exported_total{result="ok"}') == 0
    finally:
        await tracing.stop()
    ours = [r for r in caplog.records if r.name == "viiwork.agent.serving.otel" and r.levelno >= logging.WARNING]
    assert len(ours) == 1 and "not exported" in ours[0].getMessage(), [r.getMessage() for r in ours]
    sdk = [(r.name, r.msg) for r in caplog.records if r.name.startswith("opentelemetry")]
    assert len(sdk) == len(set(sdk)), sdk  # each SDK message at most once
