"""The SGLang adapter: golden command lines, options, the label-aware metrics reading, and
probe/load over loopback servers replaying responses reconstructed from SGLang 0.5.23's
source (captures/README.md: SGLang does not run on the machines this is built on)."""

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
    UsageReporting,
)
from viiwork.engines.registry import get_engine
from viiwork.engines.sglang import SglangEngine, SglangOptions
from viiwork.engines.sglang.metrics import Sample, parse_samples, scheduler_constant, scheduler_total

CAPTURES = Path(__file__).resolve().parent / "captures"
R = "sglang-0.5.23-reconstructed-"
ENGINE = SglangEngine()


def cap(name: str) -> Captured:
    return read_capture(CAPTURES / f"{R}{name}.txt")


def spec(**kw) -> BackendSpec:
    base = dict(model="qwen3-8b", kind=Kind.CHAT, path="/models/Qwen3-8B", port=30001,
                ctx_per_slot=8192, parallel=8, options=SglangOptions())
    base.update(kw)
    return BackendSpec(**base)


@pytest.fixture
async def http():
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=2)) as session:
        yield session


# --- command lines ---------------------------------------------------------------------


def test_command_single_gpu() -> None:
    cmd = ENGINE.build_command(spec(gpus=("0",), vendor="nvidia", options=SglangOptions(mem_fraction_static=0.85)))
    assert cmd == LaunchCommand(
        argv=("python3", "-m", "sglang.launch_server", "--model-path", "/models/Qwen3-8B",
              "--served-model-name", "qwen3-8b", "--host", "127.0.0.1", "--port", "30001",
              "--max-running-requests", "8", "--context-length", "8192", "--enable-metrics",
              "--tp-size", "1", "--mem-fraction-static", "0.85"),
        env={},
    )


def test_command_tensor_parallel_operator_args_last() -> None:
    cmd = ENGINE.build_command(spec(
        gpus=("4", "5", "6", "7"), vendor="nvidia", ctx_per_slot=131072, parallel=64,
        options=SglangOptions(python="/opt/sglang/bin/python"),
        args=("--enable-cache-report", "--attention-backend", "fa3"),
    ))
    assert cmd.argv == (
        "/opt/sglang/bin/python", "-m", "sglang.launch_server", "--model-path", "/models/Qwen3-8B",
        "--served-model-name", "qwen3-8b", "--host", "127.0.0.1", "--port", "30001",
        "--max-running-requests", "64", "--context-length", "131072", "--enable-metrics",
        "--tp-size", "4",
        "--enable-cache-report", "--attention-backend", "fa3",
    )
    assert dict(cmd.env) == {}


def test_command_cpu() -> None:
    cmd = ENGINE.build_command(spec(options=SglangOptions(mem_fraction_static=0.5)))
    assert cmd.argv[-2:] == ("--device", "cpu")
    assert "--tp-size" not in cmd.argv and "--mem-fraction-static" not in cmd.argv
    assert dict(cmd.env) == {"SGLANG_USE_CPU_ENGINE": "1", "CUDA_VISIBLE_DEVICES": ""}


def test_command_embedding() -> None:
    cmd = ENGINE.build_command(spec(kind=Kind.EMBEDDING, gpus=("0",), args=("--trust-remote-code",)))
    assert cmd.argv[-2:] == ("--is-embedding", "--trust-remote-code")


def test_every_generated_flag_exists_in_sglang_argument_parser() -> None:
    """Flags checked against the help of SGLang 0.5.23's own argument parser
    (``ServerArgs.add_cli_args``), so an upstream rename shows up here."""
    help_text = (CAPTURES / "sglang-0.5.23-server_args-help.txt").read_text()
    known = set(re.findall(r"(--[a-z0-9][a-z0-9-]*)", help_text))
    for s in (spec(gpus=("0", "1"), options=SglangOptions(mem_fraction_static=0.8)), spec(kind=Kind.EMBEDDING)):
        flags = {a for a in ENGINE.build_command(s).argv if a.startswith("--")}
        assert flags <= known, flags - known


def test_options_defaults_and_rejections() -> None:
    assert SglangOptions() == SglangOptions(python="python3", mem_fraction_static=None)
    for bad, field in (({"mem_fraction_static": 1.0}, "mem_fraction_static"),
                       ({"mem_fraction_static": 0}, "mem_fraction_static"),
                       ({"python": ""}, "python"),
                       ({"binary": "sglang"}, "binary")):
        with pytest.raises(ValidationError) as info:
            SglangOptions.model_validate(bad)
        assert info.value.errors()[0]["loc"] == (field,)


def test_config_errors_name_the_sglang_field() -> None:
    text = '[[models]]\nname = "m"\nengine = "sglang"\npath = "/models/m"\n[models.sglang]\nmem_fraction_static = 2\n'
    with pytest.raises(ConfigError) as info:
        parse_config(text)
    assert [i.dotted for i in info.value.issues] == ["models[0].sglang.mem_fraction_static"]
    assert parse_config(text.replace("mem_fraction_static = 2", "mem_fraction_static = 0.8")).models[0].options \
        == SglangOptions(mem_fraction_static=0.8)


def test_registered_with_capabilities() -> None:
    engine = get_engine("sglang")
    assert isinstance(engine, SglangEngine)
    assert engine.display_name == "SGLang" and engine.default_startup_timeout_s == 1200.0
    assert isinstance(engine, RunsOnCPU) and engine.supports_cpu()
    assert isinstance(engine, UsageReporting) and engine.stream_usage_supported()


# --- metrics parsing ---------------------------------------------------------------------


def test_parse_samples_labels_escapes_and_junk() -> None:
    text = (
        "# HELP x y\n"
        'a{k="v",q="say \\"hi\\"\\n",e=""} 3.0\n'
        "b 4\n"
        'c{k="unterminated} 1\n'
        "d NaN\n"
        "e{} 2.5 1700000000\n"
        "f notanumber\n"
    )
    assert parse_samples(text) == [
        Sample("a", 3.0, {"k": "v", "q": 'say "hi"\n', "e": ""}),
        Sample("b", 4.0, {}),
        Sample("e", 2.5, {}),
    ]


def test_scheduler_total_rules() -> None:
    s = [
        Sample("g", 5.0, {"tp_rank": "0"}), Sample("g", 5.0, {"tp_rank": "1"}),  # one scheduler, two ranks
        Sample("h", 4.0, {"dp_rank": "0"}), Sample("h", 3.0, {"dp_rank": "1"}),  # two schedulers
        Sample("p", 6.0, {"priority": ""}), Sample("p", 2.0, {"priority": "0"}), Sample("p", 4.0, {"priority": "5"}),
    ]
    assert scheduler_total(s, "g") == 5.0
    assert scheduler_total(s, "h") == 7.0
    assert scheduler_total(s, "p") == 6.0
    assert scheduler_total(s, "absent") is None
    assert scheduler_constant(s, "g") == 5.0 and scheduler_constant(s, "absent") is None


# --- probe -------------------------------------------------------------------------------


async def test_probe_loading_is_refused(http) -> None:
    with pytest.raises(EngineUnavailable, match="GET /health_generate"):
        await ENGINE.probe(http, refused_base_url())


async def test_probe_warming_up_is_not_ready(http) -> None:
    async with ReplayServer({"/health_generate": cap("health_generate_starting"),
                             "/health": cap("health_generate_ready")}) as base:
        probe = await ENGINE.probe(http, base)
    assert not probe.ready and "503" in probe.reason


async def test_probe_ready(http) -> None:
    server = ReplayServer({"/health_generate": cap("health_generate_ready")})
    async with server as base:
        probe = await ENGINE.probe(http, base)
    assert probe.ready and server.hits == {"/health_generate": 1}


async def test_probe_other_status_is_not_ready(http) -> None:
    async with ReplayServer({}) as base:
        probe = await ENGINE.probe(http, base)
    assert not probe.ready and "404" in probe.reason


async def test_probe_timeout_is_a_transport_failure() -> None:
    async with ReplayServer({"/health_generate": Route(cap("health_generate_ready"), delay_s=1.0)}) as base:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=0.1)) as http:
            with pytest.raises(EngineUnavailable):
                await ENGINE.probe(http, base)


# --- load --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        ("metrics_idle", Load(slots=8, busy=0, waiting=0, ctx_per_slot=32768)),
        ("metrics_busy", Load(slots=8, busy=8, waiting=4, ctx_per_slot=32768)),  # 3 queued + 1 grammar
        ("metrics_tp2_all_schedulers", Load(slots=8, busy=5, waiting=2, ctx_per_slot=32768)),
        ("metrics_dp2", Load(slots=8, busy=7, waiting=1, ctx_per_slot=32768)),
        ("metrics_priority", Load(slots=8, busy=6, waiting=4, ctx_per_slot=32768)),
    ],
)
async def test_load(http, name: str, expected: Load) -> None:
    async with ReplayServer({"/metrics": cap(name)}) as base:
        assert await ENGINE.read_load(http, spec(), base) == expected


async def test_load_before_first_statistics_is_unknown(http) -> None:
    """Constants are published at start; the scheduler gauges only once it logs statistics."""
    async with ReplayServer({"/metrics": cap("metrics_before_first_stats")}) as base:
        with pytest.raises(LoadUnknown, match="sglang:num_running_reqs"):
            await ENGINE.read_load(http, spec(), base)


async def test_load_without_queue_gauge_is_unknown(http) -> None:
    body = b"\n".join(line for line in cap("metrics_busy").body.split(b"\n")
                      if not line.startswith(b"sglang:num_queue_reqs{"))
    async with ReplayServer({"/metrics": Captured(200, (), body)}) as base:
        with pytest.raises(LoadUnknown, match="sglang:num_queue_reqs"):
            await ENGINE.read_load(http, spec(), base)


async def test_load_without_context_gauge_uses_spec(http) -> None:
    body = b"\n".join(line for line in cap("metrics_busy").body.split(b"\n")
                      if not line.startswith(b"sglang:context_len{"))
    async with ReplayServer({"/metrics": Captured(200, (), body)}) as base:
        assert (await ENGINE.read_load(http, spec(ctx_per_slot=4096), base)).ctx_per_slot == 4096


async def test_load_metrics_disabled_is_unknown(http) -> None:
    async with ReplayServer({"/metrics": cap("metrics_disabled")}) as base:
        with pytest.raises(LoadUnknown, match="--enable-metrics"):
            await ENGINE.read_load(http, spec(), base)


async def test_load_refused_is_unavailable(http) -> None:
    with pytest.raises(EngineUnavailable, match="GET /metrics"):
        await ENGINE.read_load(http, spec(), refused_base_url())
