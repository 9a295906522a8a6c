"""Backend.busy: what a node publishes as busy slots (viiwork.agent.backends)."""

from __future__ import annotations

import time

from viiwork.agent.backends import Backend, BackendId
from viiwork.engines.contract import Load


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
