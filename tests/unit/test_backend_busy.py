"""Backend.busy: what a node publishes as busy slots, and ModelRuntime.capacity, the one sum
over a model's backends that status, /metrics, routing and the gossiped summary read
(viiwork.agent.supervision.backends)."""

from __future__ import annotations

import time

from viiwork.agent.config.schema import ModelConfig
from viiwork.agent.supervision.backends import Backend, BackendId, BackendState, ModelRuntime
from viiwork.engines.contract import Load
from viiwork.engines.registry import get_engine


def backend(engine_busy: int, in_flight: int, read_ago_s: float = 0.0) -> Backend:
    b = Backend(BackendId("m-0"), "m", 0, parallel=4, in_flight=in_flight)
    b.load = Load(slots=4, busy=engine_busy, waiting=0, ctx_per_slot=512)
    b.load_at = time.monotonic() - read_ago_s
    return b


def test_the_larger_of_the_engines_count_and_routings_own() -> None:
    assert backend(3, 1).busy == 3  # requests the agent does not track (e.g. before a restart)
    assert backend(1, 3).busy == 3  # the engine's count lags behind routing's
    assert backend(2, 2).busy == 2


def test_a_request_that_ended_after_the_engines_read_frees_its_slot_at_once() -> None:
    b = backend(3, 3, read_ago_s=0.5)
    b.end_request()
    assert (b.in_flight, b.busy) == (2, 2)  # the engine's 3 still counts the ended request
    b.load = Load(slots=4, busy=2, waiting=0, ctx_per_slot=512)
    b.load_at = time.monotonic() + 1e-6  # the next read: the engine's count is newer again
    assert b.busy == 2
    b.load = Load(slots=4, busy=3, waiting=0, ctx_per_slot=512)
    assert b.busy == 3


def test_without_a_current_engine_count_routings_own_count() -> None:
    b = backend(3, 1)
    b.load_stale = True
    assert b.busy == 1
    b.load = None
    assert b.busy == 1


# ----------------------------------------------------------------- ModelRuntime.capacity


def runtime(*backends: Backend) -> ModelRuntime:
    cfg = ModelConfig.model_validate({"name": "m", "engine": "llamacpp", "path": "/m.gguf", "parallel": 4})
    return ModelRuntime(config=cfg, engine=get_engine("llamacpp"), backends=list(backends))


def admitting(index: int, engine_busy: int, in_flight: int, waiting: int | None = 0) -> Backend:
    b = Backend(BackendId(f"m-{index}"), "m", index, parallel=4, in_flight=in_flight,
                state=BackendState.HEALTHY, port=9000 + index)
    b.load = Load(slots=3, busy=engine_busy, waiting=waiting, ctx_per_slot=512)
    b.load_at = time.monotonic()
    return b


def test_capacity_sums_admitting_backends_only() -> None:
    starting = Backend(BackendId("m-2"), "m", 2, parallel=4, in_flight=1)  # not admitting, a request draining
    cap = runtime(admitting(0, 2, 1, waiting=1), admitting(1, 0, 0, waiting=2), starting).capacity()
    assert (cap.slots, cap.busy, cap.free, cap.waiting) == (6, 2, 5, 3)
    assert (cap.in_flight, cap.healthy, cap.total) == (2, 2, 3)
    assert cap.free_by_backend == (("m-0", 2), ("m-1", 3), ("m-2", 0))


def test_a_stale_reading_leaves_the_engines_figures_out_of_capacity() -> None:
    stale = admitting(1, 3, 1, waiting=5)
    stale.load_stale = True
    cap = runtime(admitting(0, 0, 0, waiting=0), stale).capacity()
    # slots back to parallel (4), busy to routing's own count, the engine's queue unknown
    assert (cap.slots, cap.busy, cap.waiting) == (3 + 4, 1, None)
    assert stale.waiting is None


def test_waiting_is_unknown_when_any_queue_is_or_nothing_admits() -> None:
    assert runtime(admitting(0, 0, 0, waiting=None), admitting(1, 0, 0)).capacity().waiting is None
    assert runtime().capacity().waiting is None
    assert runtime().capacity() == runtime().capacity()  # a value: frozen, comparable
