"""SGLang through the engine conformance kit, with replays reconstructed from SGLang 0.5.23's
source (captures/README.md)."""

from __future__ import annotations

from pathlib import Path

from viiwork.engines.conformance import EngineReplays, HttpReplay, assert_conforms, default_spec_shapes
from viiwork.engines.sglang import SglangEngine, SglangOptions

CAPTURES = Path(__file__).resolve().parent / "captures"


def replay(name: str) -> HttpReplay:
    return HttpReplay.from_file(CAPTURES / f"sglang-0.5.23-reconstructed-{name}.txt")


READY = replay("health_generate_ready")
STARTING = replay("health_generate_starting")
REPLAYS = EngineReplays(
    ready={"/health_generate": READY, "/health": READY, "/metrics": replay("metrics_idle")},
    busy={"/health_generate": READY, "/health": READY, "/metrics": replay("metrics_busy")},
    # Bound, warming up: 503 from the health endpoints, constants only in /metrics.
    loading={"/health_generate": STARTING, "/health": STARTING, "/metrics": replay("metrics_before_first_stats")},
    load_unknown=(
        {"/health_generate": READY, "/metrics": replay("metrics_disabled")},
        {"/health_generate": READY, "/metrics": replay("metrics_before_first_stats")},
    ),
)


async def test_sglang_conforms_with_default_options() -> None:
    await assert_conforms(SglangEngine(), REPLAYS, check_registered=True)


async def test_sglang_conforms_with_every_option_set() -> None:
    engine = SglangEngine()
    options = SglangOptions(python="/opt/sglang/bin/python", mem_fraction_static=0.8)
    await assert_conforms(engine, REPLAYS, specs=default_spec_shapes(engine, options))
