"""llama-server's captured responses (tests/engines/llamacpp/captures/) as conformance replays.

Every capture is verbatim ``curl -i`` output from llama-server build b1, commit 7e4c0a9 (the
prefix of each file name); ``captures/README.md`` says how each was made.
"""

from __future__ import annotations

from pathlib import Path

from viiwork.engines.conformance import EngineReplays, HttpReplay, ReplaySet

CAPTURES = Path(__file__).resolve().parent.parent / "engines" / "llamacpp" / "captures"
BUILD = "7e4c0a9"


def capture(name: str) -> HttpReplay:
    """The capture ``<BUILD>-<name>.txt``, e.g. ``capture("smollm2-health_ready")``."""
    return HttpReplay.from_file(CAPTURES / f"{BUILD}-{name}.txt")


def replay_set(health: str, slots: str, metrics: str) -> ReplaySet:
    """/health, /slots and /metrics answered from the named captures."""
    return {"/health": capture(health), "/slots": capture(slots), "/metrics": capture(metrics)}


def llamacpp_replays() -> EngineReplays:
    """Ready (idle, 2 slots), busy (1 of 2 slots), loading (every endpoint 503 "Loading
    model"), load-unknown (/slots disabled with --no-slots: 501), and an --embedding
    server's /v1/embeddings answer."""
    return EngineReplays(
        ready=replay_set("smollm2-health_ready", "smollm2-slots_idle", "smollm2-metrics"),
        busy=replay_set("smollm2-health_busy", "smollm2-slots_busy", "smollm2-metrics_busy"),
        loading=replay_set("smollm2-health_loading", "smollm2-slots_loading", "smollm2-metrics_loading"),
        load_unknown=(replay_set("smollm2-health_ready", "tiny-slots_disabled", "smollm2-metrics"),),
        embeddings=capture("tiny-embeddings"),
    )
