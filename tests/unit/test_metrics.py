"""/metrics by the book: prometheus-client's exposition checked by Prometheus' own promtool, the
per-model request histograms, the engines' text parsed with labels, and the Grafana dashboard
naming only metrics /metrics has."""

from __future__ import annotations

import asyncio
import json
import re

import aiohttp
import pytest
from aiohttp import web
from conftest import REPO, require
from prometheus_client.parser import text_string_to_metric_families

from support.procs import fake_engine
from support.promtool import check_metrics, find_promtool, promtool_cache
from support.replay import read_capture
from viiwork.agent.config.schema import ModelConfig
from viiwork.agent.serving.api import ClientApi
from viiwork.agent.serving.api_listener import ApiSite, ConnectionLimits
from viiwork.agent.serving.protocol_log import ProtocolErrorLog
from viiwork.agent.serving.proxy import Upstream
from viiwork.agent.supervision.backends import Backend, BackendId, BackendState, ModelRuntime
from viiwork.engines.prometheus import parse_gauges, parse_samples
from viiwork.engines.registry import get_engine

DASHBOARD = REPO / "packaging" / "grafana" / "viiwork.json"
TOKEN_DELAY_S = 0.1  # the fake engine sleeps this long before each token after the first
TOKENS = 5
CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8}


def make_runtime(name: str, port: int, parallel: int) -> ModelRuntime:
    cfg = ModelConfig.model_validate({"name": name, "engine": "llamacpp", "path": "/x.gguf", "parallel": parallel})
    rt = ModelRuntime(config=cfg, engine=get_engine("llamacpp"))
    rt.backends.append(Backend(id=BackendId(f"{name}#0"), model=name, index=0, state=BackendState.HEALTHY, port=port,
                               parallel=parallel))
    return rt


@pytest.fixture(scope="module")
def slow_engine_port() -> int:
    with fake_engine("m", parallel=1, env={"FAKE_TOKENS": str(TOKENS), "FAKE_TOKEN_DELAY_S": str(TOKEN_DELAY_S)}) \
            as port:
        yield port


async def scrape_after_traffic(port: int, accept: str | None = None) -> tuple[str, str]:
    """Two streamed requests at once on a 1-slot backend (one waits for the other), one
    non-streamed, one for an unknown model: /metrics' text and content type afterwards."""
    async with Upstream(10) as upstream, aiohttp.ClientSession() as http:
        api = ClientApi(node_name="test-node", runtimes={"m": make_runtime("m", port, 1)}, upstream=upstream,
                        max_body_bytes=1 << 20, queue_max=8, queue_timeout_s=10, status_source=lambda: [])
        runner = web.AppRunner(api.build_app(), access_log=None)
        await runner.setup()
        # The agent's own listener (agent/main.py), so its connection counters are on /metrics too.
        site = ApiSite(runner, "127.0.0.1", 0, ConnectionLimits(head_timeout_s=10, max_connections=64,
                                                               max_connections_per_address=64))
        await site.start()
        assert site.guard is not None
        api.metric_sources += [site.guard.metric_families, ProtocolErrorLog().metric_families]
        url = f"http://127.0.0.1:{site.port}"

        async def post(body: dict) -> int:
            async with http.post(f"{url}/v1/chat/completions", json=body) as r:
                await r.read()
                return r.status

        assert await asyncio.gather(post({**CHAT, "stream": True}), post({**CHAT, "stream": True})) == [200, 200]
        assert await post(CHAT) == 200
        assert await post({**CHAT, "model": "nobody"}) == 404
        try:
            async with http.get(f"{url}/metrics", headers={"Accept": accept} if accept else {}) as r:
                assert r.status == 200
                return await r.text(), r.headers["Content-Type"]
        finally:
            await runner.cleanup()


def samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


async def test_request_histograms_per_model(slow_engine_port: int) -> None:
    text, content_type = await scrape_after_traffic(slow_engine_port)
    assert content_type.startswith("text/plain; version=0.0.4")
    got = samples(text)
    m = (("model", "m"),)
    assert got[("viiwork_request_duration_seconds_count", m)] == 3
    assert got[("viiwork_time_to_first_token_seconds_count", m)] == 3
    assert got[("viiwork_request_queue_seconds_count", m)] == 3
    # The unknown model: its answer timed, under "-"; no token, never queued.
    gone = (("model", "-"),)
    assert got[("viiwork_request_duration_seconds_count", gone)] == 1
    assert got.get(("viiwork_time_to_first_token_seconds_count", gone), 0) == 0
    assert got.get(("viiwork_request_queue_seconds_count", gone), 0) == 0
    # Each stream ends at least (TOKENS - 1) token delays after its first chunk; the
    # non-streamed answer's first token is its end. So the TTFT sum trails the duration sum
    # by at least two streams' delays.
    gap = got[("viiwork_request_duration_seconds_sum", m)] - got[("viiwork_time_to_first_token_seconds_sum", m)]
    assert gap >= 2 * (TOKENS - 1) * TOKEN_DELAY_S * 0.99
    # One stream waited for the other's whole answer in the queue (one slot).
    assert got[("viiwork_request_queue_seconds_sum", m)] >= (TOKENS - 1) * TOKEN_DELAY_S * 0.99
    assert got[("viiwork_responses_total", (("code", "200"), ("model", "m")))] == 3


async def test_openmetrics_when_asked(slow_engine_port: int) -> None:
    text, content_type = await scrape_after_traffic(slow_engine_port, "application/openmetrics-text; version=1.0.0")
    assert content_type.startswith("application/openmetrics-text") and text.endswith("# EOF\n")


async def test_promtool_accepts_our_metrics(slow_engine_port: int) -> None:
    promtool = find_promtool()
    require(promtool is not None, "promtool missing: `apt-get download prometheus` and `dpkg -x` it into "
                                  f"{promtool_cache()} (docs/metrics.md)")
    text, _ = await scrape_after_traffic(slow_engine_port)
    done = check_metrics(promtool, text)
    assert done.returncode == 0 and not done.stdout.strip() and not done.stderr.strip(), (done.stdout, done.stderr)


async def test_promtool_refuses_a_counter_without_total() -> None:
    """The check above can fail: promtool flags what the conventions forbid."""
    promtool = find_promtool()
    require(promtool is not None, "promtool missing (see test_promtool_accepts_our_metrics)")
    bad = "# HELP viiwork_things Things.\n# TYPE viiwork_things counter\nviiwork_things 1\n"
    done = check_metrics(promtool, bad)
    assert done.returncode != 0 and "_total" in done.stdout + done.stderr


async def test_every_dashboard_expression_names_an_exposed_metric(slow_engine_port: int) -> None:
    text, _ = await scrape_after_traffic(slow_engine_port)
    exposed = {name for name, _ in samples(text)}
    doc = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for p in doc["panels"] for t in p["targets"]]
    exprs += [v["query"] for v in doc["templating"]["list"] if v["type"] == "query"]
    named = {n for e in exprs for n in re.findall(r"\bviiwork_[a-z_]+", e)}
    assert len(exprs) >= 8 and len(named) >= 10
    assert named <= exposed, sorted(named - exposed)


def test_engine_text_keeps_labels_and_skips_only_a_malformed_line() -> None:
    vllm = read_capture(REPO / "tests" / "engines" / "vllm" / "captures" / "vllm-0.32.0-cpu-derived-dp2-metrics_busy.txt")
    running = [s for s in parse_samples(vllm.body.decode()) if s.name == "vllm:num_requests_running"]
    assert len(running) == 2 and {s.labels["engine"] for s in running} == {"0", "1"}
    assert parse_gauges(vllm.body.decode())["vllm:num_requests_running"] == sum(s.value for s in running)
    text = 'a{k="v"} 1\nb{k="unterminated} 2\nc 3\nd NaN\n'
    assert [(s.name, s.labels, s.value) for s in parse_samples(text)] == [("a", {"k": "v"}, 1.0), ("c", {}, 3.0)]
