"""Speeds (issue 20): read from the engines' token counters (captures and a real fake
llama-server over loopback), folded into per-backend means, shown in /v1/status, published as
the ``speeds`` extension through a signed summary to a peer; and the observers agree: the
dashboard's TTFT and the Prometheus histogram count the same answers, every answer of the
inference API is observed (bounded labels), a model that leaves loses its series."""

from __future__ import annotations

import math
from collections.abc import Iterator

import aiohttp
import pytest
from aiohttp import web
from conftest import REPO
from prometheus_client.parser import text_string_to_metric_families

from support.mesh_crypto import ManualClock, TestCA, core, exchange
from support.procs import fake_engine
from support.replay import read_capture
from viiwork.agent.config.schema import ModelConfig
from viiwork.agent.peering.speed_ext import SpeedPublisher, moved
from viiwork.agent.serving.api import ClientApi
from viiwork.agent.serving.proxy import Upstream
from viiwork.agent.supervision.backends import Backend, BackendId, BackendState, ModelRuntime
from viiwork.agent.supervision.load import record_load
from viiwork.agent.supervision.speeds import WINDOW_S, SpeedEstimate, model_speed
from viiwork.agent.supervision.waits import Outcome, Wake
from viiwork.engines import llamacpp, vllm
from viiwork.engines.contract import BackendSpec, Kind, TokenCounters
from viiwork.engines.prometheus import parse_gauges, token_counters
from viiwork.engines.registry import get_engine
from viiwork.mesh.extensions import SPEEDS, ModelSpeed, Speeds
from viiwork.mesh.membership import GossipSettings

LLAMACPP_CAPTURES = REPO / "tests" / "engines" / "llamacpp" / "captures"
VLLM_CAPTURES = REPO / "tests" / "engines" / "vllm" / "captures"
CHAT = {"model": "m", "messages": [{"role": "user", "content": "say hi to the speed test"}], "max_tokens": 8}


def runtime(name: str, port: int, backends: int = 1) -> ModelRuntime:
    cfg = ModelConfig.model_validate({"name": name, "engine": "llamacpp", "path": "/x.gguf", "parallel": 2,
                                      "backends": backends})
    rt = ModelRuntime(config=cfg, engine=get_engine("llamacpp"))
    for i in range(backends):
        rt.backends.append(Backend(id=BackendId(f"{name}#{i}"), model=name, index=i, state=BackendState.HEALTHY,
                                   port=port, parallel=2))
    return rt


def counters(p: float, ps: float, d: float, ds: float) -> TokenCounters:
    return TokenCounters(p, ps, d, ds)


# -- the engines' counters ------------------------------------------------------------------


def test_llamacpp_capture_gives_its_cumulative_counters() -> None:
    text = read_capture(LLAMACPP_CAPTURES / "7e4c0a9-smollm2-metrics.txt").body.decode()
    got = token_counters(parse_gauges(text), *llamacpp.TOKEN_COUNTERS)
    assert got == TokenCounters(66, 0.165827, 571, 5.68063)


def test_vllm_capture_gives_prefill_and_decode_time_sums() -> None:
    text = read_capture(VLLM_CAPTURES / "vllm-0.32.0-cpu-metrics.txt").body.decode()
    got = token_counters(parse_gauges(text), *vllm.TOKEN_COUNTERS)
    assert got is not None
    assert got.prompt_tokens == 110 and got.decode_tokens == 362
    assert math.isclose(got.prompt_seconds, 0.10932974400020612)


def test_a_missing_counter_leaves_the_speed_unknown() -> None:
    assert token_counters({"a": 1.0, "b": 1.0, "c": 1.0}, "a", "b", "c", "d") is None
    assert token_counters({"a": 1.0, "b": -1.0, "c": 1.0, "d": 1.0}, "a", "b", "c", "d") is None


# -- the estimate --------------------------------------------------------------------------


def test_estimate_is_a_time_weighted_mean_of_interval_speeds() -> None:
    e = SpeedEstimate()
    e.update(counters(0, 0, 0, 0), 0.0)
    assert (e.prefill_tps, e.decode_tps) == (None, None)  # one reading: no interval yet
    e.update(counters(1000, 2, 100, 4), 1.0)  # 500 and 25 tokens/s: the first interval is taken whole
    assert (e.prefill_tps, e.decode_tps) == (500, 25)
    e.update(counters(1000, 2, 100, 4), 30.0)  # idle: nothing measured, nothing changes
    assert (e.prefill_tps, e.decode_tps) == (500, 25)
    e.update(counters(2000, 3, 200, 6), 30.0 + WINDOW_S)  # 1000 and 50 tokens/s, one window later
    w = 1 - math.exp(-1)
    assert e.prefill_tps == pytest.approx(500 + w * 500)
    assert e.decode_tps == pytest.approx(25 + w * 25)
    before = (e.prefill_tps, e.decode_tps)
    e.update(counters(10, 0.1, 1, 0.1), 200.0)  # counters went back: the engine restarted
    assert (e.prefill_tps, e.decode_tps) == before
    e.update(counters(20, 0.2, 2, 0.2), 201.0)
    assert e.prefill_tps != before[0]  # measured again from the new baseline


def test_an_interval_where_only_the_tokens_moved_goes_on_until_the_seconds_do() -> None:
    """vLLM counts tokens as it makes them and adds a request's seconds when it ends."""
    e = SpeedEstimate()
    e.update(counters(0, 0, 0, 0), 0.0)
    e.update(counters(76, 0, 23, 0), 1.0)  # in flight: tokens, no seconds yet
    assert (e.prefill_tps, e.decode_tps) == (None, None)
    e.update(counters(100, 0.5, 40, 2.0), 2.0)  # ended: the whole interval since the baseline
    assert (e.prefill_tps, e.decode_tps) == (200, 20)


def test_model_speed_is_the_mean_over_backends_that_measured() -> None:
    a, b, c = SpeedEstimate.of(500.0, 20.0), SpeedEstimate.of(700.0, None), SpeedEstimate()
    got = model_speed([a, b, c])
    assert got is not None and (got.prefill_tps, got.decode_tps) == (600, 20)
    assert model_speed([c]) is None


# -- a real fake llama-server, the adapter, the supervisor's recording, /v1/status -----------


@pytest.fixture(scope="module")
def engine_port() -> Iterator[int]:
    with fake_engine("m", parallel=2, env={"FAKE_PREFILL_TPS": "800", "FAKE_DECODE_TPS": "32"}) as port:
        yield port


async def read_and_record(rt: ModelRuntime, port: int, http: aiohttp.ClientSession) -> None:
    spec = BackendSpec(model=rt.name, kind=Kind.CHAT, path="/x.gguf", port=port, parallel=2, ctx_per_slot=2048,
                       options=llamacpp.LlamaCppOptions())
    for backend in rt.backends:
        load = await rt.engine.read_load(http, spec, backend.base_url)
        record_load(rt, backend, Outcome(Wake.DONE, load), stale_after_s=5)


async def test_status_shows_the_speeds_the_engine_counted(engine_port: int) -> None:
    rt = runtime("m", engine_port)
    async with Upstream(10) as upstream, aiohttp.ClientSession() as http:
        api = ClientApi(node_name="n", runtimes={"m": rt}, upstream=upstream, max_body_bytes=1 << 20, queue_max=8,
                        queue_timeout_s=10, status_source=lambda: [rt.status_doc()])
        runner = web.AppRunner(api.build_app(), access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        url = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"  # type: ignore[union-attr]
        try:
            await read_and_record(rt, engine_port, http)  # the baseline
            async with http.get(f"{url}/v1/status") as r:
                assert (await r.json())["models"][0]["speed"] is None  # nothing measured yet: unknown
            for _ in range(2):
                async with http.post(f"{url}/v1/chat/completions", json=CHAT) as r:
                    assert r.status == 200
                    await r.read()
            await read_and_record(rt, engine_port, http)
            async with http.get(f"{url}/v1/status") as r:
                assert (await r.json())["models"][0]["speed"] == {"prefill_tps": 800, "decode_tps": 32}
            async with http.get(f"{url}/ui/api/state", headers={"Host": url[7:]}) as r:
                assert (await r.json())["nodes"][0]["models"][0]["speed"] == {"prefill_tps": 800, "decode_tps": 32}
        finally:
            await runner.cleanup()


# -- publishing: the step, and a signed summary to a peer -----------------------------------


def speeds(*figures: tuple[str, int, int]) -> Speeds:
    return Speeds(tuple(ModelSpeed(*f) for f in figures))


def test_the_step_keeps_small_moves_unpublished() -> None:
    base = speeds(("m", 600, 40))
    assert not moved(base, speeds(("m", 650, 42)))  # within 10 % (and 2 tokens/s)
    assert moved(base, speeds(("m", 700, 40)))
    assert moved(base, speeds(("m", 600, 45)))
    assert not moved(speeds(("m", 10, 10)), speeds(("m", 12, 8)))  # at least 2 tokens/s
    assert moved(base, speeds(("m", 600, 0)))  # a figure went unknown
    assert moved(base, speeds(("m", 600, 40), ("n", 1, 1)))  # a model appeared


def test_speeds_reach_a_peer_through_a_signed_summary() -> None:
    ca, clock = TestCA(), ManualClock()
    a, b = ca.node("a"), ca.node("b")
    settings = GossipSettings(scale_with_size=False)
    ma, pa = core(a, ca, clock, settings=settings, protocol=4)
    mb, _ = core(b, ca, clock, settings=settings, protocol=4, seed=1)
    rt = runtime("llama", 1)
    rt.backends[0].speed = SpeedEstimate.of(612.4, 0.2)  # decode rounds to 0: published as 1 (measured)
    publisher = SpeedPublisher()
    ext = publisher.update([rt])
    assert ext is not None
    pa.set_extensions(ext)
    assert pa.maybe_publish() is not None
    exchange(ma, mb, "b:8087")
    view = next(p for p in mb.peers() if p.node_id == a.node_id)
    assert view.extensions.get(SPEEDS) == speeds(("llama", 612, 1))
    rt.backends[0].speed = SpeedEstimate.of(640.0, 1.0)
    assert publisher.update([rt]) is None  # below the step: no new summary


# -- observers that agree --------------------------------------------------------------------


def families(text: str) -> dict[tuple[str, str], float]:
    return {(s.name, s.labels.get("model", "")): s.value for f in text_string_to_metric_families(text)
            for s in f.samples}


async def test_error_answers_are_observed_but_carry_no_ttft(engine_port: int) -> None:
    rt = runtime("m", engine_port)
    async with Upstream(10) as upstream, aiohttp.ClientSession() as http:
        api = ClientApi(node_name="n", runtimes={"m": rt}, upstream=upstream, max_body_bytes=256, queue_max=8,
                        queue_timeout_s=10, status_source=lambda: [rt.status_doc()])
        runner = web.AppRunner(api.build_app(), access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        url = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"  # type: ignore[union-attr]
        chat = f"{url}/v1/chat/completions"
        try:
            for data, status in ((b"{not json", 400), (b'{"messages": []}', 400), (b"x" * 1000, 413),
                                 (b'{"model": "client-chosen-name"}', 404)):
                async with http.post(chat, data=data, headers={"Content-Type": "application/json"}) as r:
                    assert r.status == status
            async with http.get(chat) as r:
                assert r.status == 405
            async with http.get(f"{url}/ui/api/state", headers={"Host": url[7:]}) as r:
                state = await r.json()
            bucket = [b for b in state["buckets"] if b["requests"]]
            assert sum(b["requests"] for b in bucket) == 5
            assert all(b["ttft_ms_avg"] is None for b in bucket), "error answers counted in the dashboard's TTFT"
            async with http.get(f"{url}/metrics") as r:
                got = families(await r.text())
            assert got[("viiwork_request_duration_seconds_count", "-")] == 5
            assert got.get(("viiwork_time_to_first_token_seconds_count", "-"), 0) == 0
            assert not any(model == "client-chosen-name" for _, model in got)  # no client-chosen label
            async with http.post(chat, json=CHAT) as r:
                assert r.status == 200
                await r.read()
            async with http.get(f"{url}/ui/api/state", headers={"Host": url[7:]}) as r:
                state = await r.json()
            assert any(b["ttft_ms_avg"] is not None for b in state["buckets"])
        finally:
            await runner.cleanup()


async def test_a_model_that_leaves_loses_its_series(engine_port: int) -> None:
    runtimes = {"m": runtime("m", engine_port), "keep": runtime("keep", engine_port)}
    async with Upstream(10) as upstream, aiohttp.ClientSession() as http:
        api = ClientApi(node_name="n", runtimes=runtimes, upstream=upstream, max_body_bytes=1 << 20, queue_max=8,
                        queue_timeout_s=10, status_source=lambda: [])
        runner = web.AppRunner(api.build_app(), access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        url = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"  # type: ignore[union-attr]
        try:
            for model in ("m", "keep"):
                async with http.post(f"{url}/v1/chat/completions", json={**CHAT, "model": model}) as r:
                    assert r.status == 200
                    await r.read()
            del runtimes["m"]  # what a reload does to the supervisor's picture
            api.sync_models()
            async with http.get(f"{url}/metrics") as r:
                got = families(await r.text())
            assert got[("viiwork_request_duration_seconds_count", "keep")] == 1
            assert not any(model == "m" for _, model in got), "the removed model's series stayed"
        finally:
            await runner.cleanup()


def test_speeds_of_many_long_named_models_stay_within_the_cap() -> None:
    # 10 models named 200 characters would take ~2.3 KB: the last by name are left out.
    rts = []
    for i in range(10):
        rt = runtime(f"{'m' * 196}{i:04d}", 1)
        rt.backends[0].speed = SpeedEstimate.of(1000.0 + i, 50.0)
        rts.append(rt)
    ext = SpeedPublisher().update(rts)  # Extensions.of raises when over the cap
    assert ext is not None
    published = ext.get(SPEEDS)
    assert published is not None and 0 < len(published.models) < 10
    assert [s.model for s in published.models] == sorted(r.name for r in rts)[:len(published.models)]
