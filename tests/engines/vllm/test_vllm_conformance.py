"""vLLM through the engine conformance kit, with replays of vLLM 0.32.0 (CPU build) captures."""

from __future__ import annotations

from pathlib import Path

from viiwork.engines.conformance import EngineReplays, HttpReplay, assert_conforms, default_spec_shapes
from viiwork.engines.vllm import VllmEngine, VllmOptions

CAPTURES = Path(__file__).resolve().parent / "captures"


def replay(name: str) -> HttpReplay:
    return HttpReplay.from_file(CAPTURES / f"vllm-0.32.0-cpu-{name}.txt")


# vLLM refuses connections while it loads (captured: startup_poll), so there is no loading
# replay: the kit's refused-port check is that state.
REPLAYS = EngineReplays(
    ready={"/health": replay("health_ready"), "/metrics": replay("metrics_fresh"), "/v1/models": replay("v1_models")},
    busy={"/health": replay("health_busy"), "/metrics": replay("metrics_busy"), "/v1/models": replay("v1_models")},
    loading=None,
    load_unknown=(
        {"/health": replay("health_ready"), "/metrics": replay("disable_log_stats-metrics"),
         "/v1/models": replay("disable_log_stats-v1_models")},
    ),
)


async def test_vllm_conforms_with_default_options() -> None:
    await assert_conforms(VllmEngine(), REPLAYS, check_registered=True)


async def test_vllm_conforms_with_every_option_set() -> None:
    engine = VllmEngine()
    for options in (VllmOptions(python="/opt/vllm/bin/python", cpu_kv_cache_gib=4),
                    VllmOptions(binary="/opt/vllm/bin/vllm", gpu_memory_utilization=0.9)):
        await assert_conforms(engine, REPLAYS, specs=default_spec_shapes(engine, options))
