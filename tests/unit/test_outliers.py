"""Outlier detection as a pure state machine (viiwork.agent.serving.outliers), in virtual time.

No clock, no sleeps: every call gets a made-up monotonic ``now``. Jitter is 0 unless a test
is about it, so ejection times are exact.
"""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from viiwork.agent.serving import outliers as ol

EXACT = ol.OutlierSettings(jitter=0.0)


def detector(**fields: object) -> ol.OutlierDetector:
    return ol.OutlierDetector(ol.OutlierSettings(**{"jitter": 0.0, **fields}))  # type: ignore[arg-type]


def fail(d: ol.OutlierDetector, key: object, times: int, now: float = 0.0) -> list[ol.Ejected | ol.Restored | None]:
    return [d.record(key, False, now) for _ in range(times)]


class Draw(random.Random):
    """A random source whose every draw is ``value``."""

    def __init__(self, value: float) -> None:
        super().__init__(0)
        self.value = value

    def random(self) -> float:
        return self.value


# ----------------------------------------------------------------- ejection


def test_consecutive_failures_eject() -> None:
    d = ol.OutlierDetector(EXACT)
    assert fail(d, "b0", 4) == [None] * 4
    assert d.allow("b0", 0.0) and d.state("b0", 0.0) == "ok"
    event = d.record("b0", False, 0.0)
    assert isinstance(event, ol.Ejected)
    assert (event.key, event.reason, event.ejection_s, event.in_row) == ("b0", "5 consecutive failures", 5.0, 1)
    assert not event.report_unhealthy
    assert event.message == "b0 ejected for 5.0 s (ejection 1 in a row): 5 consecutive failures"
    assert not d.allow("b0", 0.1) and d.state("b0", 4.9) == "ejected"
    assert d.ejected_in_row("b0") == 1 and d.ejections_total == 1
    assert d.allow("other", 0.1)


def test_a_success_in_between_resets_the_consecutive_count() -> None:
    d = ol.OutlierDetector(EXACT)
    events = fail(d, "b0", 4) + [d.record("b0", True, 0.0)] + fail(d, "b0", 4)
    assert events == [None] * 9
    assert d.state("b0", 0.0) == "ok"
    assert isinstance(d.record("b0", False, 0.0), ol.Ejected)


def test_failure_rate_over_the_window_ejects() -> None:
    d = ol.OutlierDetector(EXACT)
    pattern = "SFFSFFSFSF"   # 6 of 10 failed, never more than 2 in a row
    events = [d.record("b0", c == "S", float(t)) for t, c in enumerate(pattern)]
    assert events[:-1] == [None] * 9
    last = events[-1]
    assert isinstance(last, ol.Ejected) and last.reason == "6 of 10 requests failed in 10 s"
    assert not d.allow("b0", 9.5)


def test_outcomes_older_than_the_window_do_not_count() -> None:
    d = ol.OutlierDetector(EXACT)
    # The same 6 of 10, spread over 20 s: the window never holds 10 outcomes.
    events = [d.record("b0", c == "S", 2.0 * t) for t, c in enumerate("SFFSFFSFSF" * 3)]
    assert events == [None] * 30


def test_a_share_below_the_rate_does_not_eject() -> None:
    d = ol.OutlierDetector(EXACT)
    events = [d.record("b0", c == "S", 0.0) for c in "SFSFSFSFSSSF" * 5]   # 5 of 12 failed
    assert events == [None] * 60


def test_fewer_than_min_requests_never_eject_by_rate() -> None:
    d = detector(consecutive_failures=100, min_requests=10)
    assert fail(d, "b0", 9) == [None] * 9
    assert d.state("b0", 0.0) == "ok"
    event = d.record("b0", False, 0.0)
    assert isinstance(event, ol.Ejected) and event.reason == "10 of 10 requests failed in 10 s"


@given(st.lists(st.booleans(), max_size=9))
def test_any_outcomes_below_min_requests_never_eject_by_rate(outcomes: list[bool]) -> None:
    d = detector(consecutive_failures=100, min_requests=10)
    assert [d.record("b0", ok, 1.0) for ok in outcomes] == [None] * len(outcomes)


def test_outcomes_while_ejected_change_nothing() -> None:
    d = ol.OutlierDetector(EXACT)
    fail(d, "b0", 5)
    assert [d.record("b0", ok, 1.0) for ok in (True, False, True)] == [None] * 3
    assert d.state("b0", 1.0) == "ejected" and d.ejected_in_row("b0") == 1


# ----------------------------------------------------------------- ejection time


def eject_again(d: ol.OutlierDetector, key: object, now: float) -> ol.Ejected:
    assert d.allow(key, now)
    event = d.record(key, False, now)
    assert isinstance(event, ol.Ejected)
    return event


def test_ejection_time_doubles_and_caps() -> None:
    d = detector(consecutive_failures=1, base_ejection_s=5.0, max_ejection_s=120.0)
    first = d.record("b0", False, 0.0)
    assert isinstance(first, ol.Ejected)
    times, now = [first.ejection_s], first.ejection_s
    for _ in range(7):
        event = eject_again(d, "b0", now)
        times.append(event.ejection_s)
        now += event.ejection_s
    assert times == [5.0, 10.0, 20.0, 40.0, 80.0, 120.0, 120.0, 120.0]
    assert d.ejected_in_row("b0") == 8


def test_the_doubling_stays_finite_for_any_k() -> None:
    assert EXACT.ejection_s(10_000, 0.0) == 120.0
    assert EXACT.ejection_s(1, 0.0) == 5.0


def test_jitter_adds_less_than_a_tenth() -> None:
    d = ol.OutlierDetector(ol.OutlierSettings(consecutive_failures=1), rng=Draw(0.999))
    event = d.record("b0", False, 0.0)
    assert isinstance(event, ol.Ejected) and 5.0 < event.ejection_s < 5.5
    assert d.state("b0", 5.49) == "ejected" and d.state("b0", 5.5) == "half-open"
    seeded = ol.OutlierDetector(ol.OutlierSettings(consecutive_failures=1), rng=random.Random(7))
    lengths = []
    for n in range(50):
        event = seeded.record(n, False, 0.0)
        assert isinstance(event, ol.Ejected)
        lengths.append(event.ejection_s)
    assert all(5.0 <= x < 5.5 for x in lengths) and len(set(lengths)) > 1


# ----------------------------------------------------------------- half-open


def test_half_open_lets_exactly_one_probe_through() -> None:
    d = ol.OutlierDetector(EXACT)
    fail(d, "b0", 5)
    assert not d.allow("b0", 4.99)
    assert d.state("b0", 5.0) == "half-open"
    assert d.usable("b0", 5.0) and d.usable("b0", 5.0)   # looking takes nothing
    assert d.allow("b0", 5.0)
    assert [d.allow("b0", 5.0 + t) for t in (0.0, 0.1, 10.0, 29.9)] == [False] * 4
    assert not d.usable("b0", 6.0)
    assert d.probes_total == 1


def test_a_successful_probe_restores_and_keeps_k() -> None:
    d = ol.OutlierDetector(EXACT)
    fail(d, "b0", 5)
    assert d.allow("b0", 5.0)
    event = d.record("b0", True, 5.5)
    assert event == ol.Restored(key="b0", in_row=1)
    assert d.state("b0", 5.5) == "ok" and d.allow("b0", 5.5) and d.allow("b0", 5.5)
    assert d.ejected_in_row("b0") == 1 and d.restores_total == 1
    # The failure count was cleared: four more do not eject, the fifth does, for twice as long.
    assert fail(d, "b0", 4, 6.0) == [None] * 4
    again = d.record("b0", False, 6.0)
    assert isinstance(again, ol.Ejected) and again.in_row == 2 and again.ejection_s == 10.0


def test_a_failed_probe_ejects_again_with_k_plus_one() -> None:
    d = ol.OutlierDetector(EXACT)
    fail(d, "b0", 5)
    event = eject_again(d, "b0", 5.0)
    assert (event.reason, event.in_row, event.ejection_s) == ("probe failed", 2, 10.0)
    assert d.state("b0", 14.9) == "ejected" and d.state("b0", 15.0) == "half-open"


def test_report_unhealthy_when_k_reaches_report_after_ejections() -> None:
    d = ol.OutlierDetector(EXACT)
    fail(d, "b0", 5)
    second = eject_again(d, "b0", 5.0)
    third = eject_again(d, "b0", 15.0)
    assert (second.report_unhealthy, third.report_unhealthy) == (False, True)
    assert d.ejected_in_row("b0") == EXACT.report_after_ejections


def test_k_resets_after_reset_after_successes_in_a_row() -> None:
    d = ol.OutlierDetector(EXACT)
    fail(d, "b0", 5)
    assert d.allow("b0", 5.0)
    assert isinstance(d.record("b0", True, 5.0), ol.Restored)
    for _ in range(10):
        d.record("b0", True, 6.0)
    d.record("b0", False, 6.0)   # breaks the run
    for _ in range(19):
        d.record("b0", True, 6.0)
    assert d.ejected_in_row("b0") == 1
    d.record("b0", True, 6.0)
    assert d.ejected_in_row("b0") == 0
    event = fail(d, "b0", 5, 7.0)[-1]
    assert isinstance(event, ol.Ejected) and event.in_row == 1 and event.ejection_s == 5.0


def test_a_probe_timeout_lets_another_probe_go() -> None:
    d = ol.OutlierDetector(EXACT)
    fail(d, "b0", 5)
    assert d.allow("b0", 5.0)
    assert not d.allow("b0", 34.9)
    assert d.allow("b0", 35.0)
    assert not d.allow("b0", 35.0)
    assert d.probes_total == 2
    assert isinstance(d.record("b0", True, 36.0), ol.Restored)


def test_a_released_probe_lets_another_go_at_once_and_release_changes_nothing_else() -> None:
    d = ol.OutlierDetector(EXACT)
    fail(d, "b0", 5)
    d.release("b0", 1.0)  # ejected: nothing to release, still ejected
    d.release("nobody", 1.0)
    assert not d.allow("b0", 4.9) and len(d) == 1
    assert d.allow("b0", 5.0)
    d.release("b0", 5.5)  # the probe's answer said nothing (a client's 4xx)
    assert d.usable("b0", 5.5) and d.allow("b0", 5.5) and not d.allow("b0", 5.6)
    assert d.state("b0", 5.6) == "half-open" and d.ejected_in_row("b0") == 1 and d.probes_total == 2
    assert isinstance(d.record("b0", False, 6.0), ol.Ejected)  # the next outcome still decides


# ----------------------------------------------------------------- table


def test_forget() -> None:
    d = ol.OutlierDetector(EXACT)
    fail(d, ("node-b", "qwen"), 5)
    assert not d.allow(("node-b", "qwen"), 1.0)
    d.forget(("node-b", "qwen"))
    d.forget("never-seen")
    assert d.allow(("node-b", "qwen"), 1.0) and d.state(("node-b", "qwen"), 1.0) == "ok"
    assert d.ejected_in_row(("node-b", "qwen")) == 0 and len(d) == 0


def test_idle_healthy_targets_hold_no_state_after_their_window() -> None:
    d = ol.OutlierDetector(EXACT)
    d.record("quiet", True, 0.0)
    d.record("flaky", False, 0.0)
    fail(d, "broken", 5)
    assert len(d) == 3
    d.record("busy", True, 10.0)
    assert len(d) == 2 and d.state("broken", 10.0) == "half-open"
    assert [row["key"] for row in d.snapshot(10.0)] == ["broken", "busy"]


def test_the_table_is_bounded_under_a_flood_of_keys() -> None:
    d = ol.OutlierDetector(EXACT)
    fail(d, "broken", 5)
    for n in range(10_000):
        d.record(("peer", n), n % 3 == 0, 1.0)
    assert len(d) == EXACT.max_targets
    assert d.dropped_total == 10_001 - EXACT.max_targets
    assert d.state("broken", 1.0) == "ejected"   # the ok targets went first
    assert d.state(("peer", 9_999), 1.0) == "ok" and d.allow(("peer", 0), 1.0)


def test_a_full_table_of_ejected_targets_still_takes_a_new_key() -> None:
    d = detector(consecutive_failures=1, max_targets=3)
    for key in "abc":
        d.record(key, False, 0.0)
    d.record("d", False, 0.0)
    assert len(d) == 3 and d.state("a", 0.0) == "ok" and d.state("d", 0.0) == "ejected"


def test_snapshot_and_counters() -> None:
    d = ol.OutlierDetector(EXACT)
    d.record("b1", True, 0.0)
    d.record("b1", False, 0.0)
    fail(d, ("node-b", "qwen"), 5, 1.0)
    assert d.snapshot(2.0) == [
        {"key": "b1", "state": "ok", "ejected_in_row": 0, "ejected_remaining_s": 0.0, "reason": "",
         "failures": 1, "successes": 1, "consecutive_failures": 1},
        {"key": "node-b/qwen", "state": "ejected", "ejected_in_row": 1, "ejected_remaining_s": 4.0,
         "reason": "5 consecutive failures", "failures": 5, "successes": 0, "consecutive_failures": 0},
    ]
    assert d.counters() == {"ejections_total": 1, "restores_total": 0, "probes_total": 0, "dropped_total": 0}
    assert ol.key_text(("node-b", "qwen")) == "node-b/qwen" and ol.key_text(3) == "3"


@settings(max_examples=200)
@given(st.lists(st.tuples(st.sampled_from(["good-1", "good-2", "bad-1", "bad-2", ("peer", "m")]),
                          st.sampled_from(["ok", "fail", "allow"]),
                          st.floats(min_value=0.0, max_value=20.0)), max_size=200))
def test_allow_is_true_for_any_key_never_recorded_failing(steps: list[tuple[object, str, float]]) -> None:
    d = detector(max_targets=3)
    now, failed = 0.0, set()
    for key, kind, dt in steps:
        now += dt
        if kind == "fail" and str(key).startswith("bad"):
            failed.add(key)
            d.record(key, False, now)
        elif kind == "ok":
            d.record(key, True, now)
        else:
            d.allow(key, now)
        for probe in ("good-1", "good-2", ("peer", "m"), "bad-1", "bad-2"):
            if probe not in failed:
                assert d.allow(probe, now) and d.state(probe, now) == "ok"


# ----------------------------------------------------------------- settings


@pytest.mark.parametrize(("field", "value"), [
    ("consecutive_failures", 0), ("consecutive_failures", 2.5), ("consecutive_failures", True),
    ("min_requests", 0), ("reset_after_successes", -1), ("report_after_ejections", 0), ("max_targets", 0),
    ("window_s", 0.0), ("window_s", float("inf")), ("window_s", float("nan")), ("base_ejection_s", -1.0),
    ("probe_timeout_s", 0), ("max_ejection_s", 4.0), ("failure_rate", 0.0), ("failure_rate", 1.5),
    ("failure_rate", float("nan")), ("jitter", -0.01), ("jitter", 0.2), ("jitter", "0.1"),
])
def test_settings_out_of_range_name_the_field(field: str, value: object) -> None:
    with pytest.raises(ValueError, match=field):
        ol.OutlierSettings(**{field: value})  # type: ignore[arg-type]


def test_default_settings_are_valid() -> None:
    s = ol.OutlierSettings()
    assert (s.consecutive_failures, s.window_s, s.min_requests, s.failure_rate) == (5, 10.0, 10, 0.5)
    assert (s.base_ejection_s, s.max_ejection_s, s.probe_timeout_s) == (5.0, 120.0, 30.0)
    assert (s.reset_after_successes, s.report_after_ejections, s.max_targets) == (20, 3, 4096)
    ol.OutlierSettings(failure_rate=1.0, jitter=0.0, max_ejection_s=5.0)
