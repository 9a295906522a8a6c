"""The health ladder as a pure transition function (viiwork.agent.supervision.health_ladder), in virtual time.

No processes, no sleeps: ``step`` is fed events with a made-up monotonic clock. The same
rules run the real supervisor (tests/unit/test_supervisor.py drives them with real fake-engine
processes and wall-clock waits).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from viiwork.agent.config.schema import HealthConfig, SupervisorConfig
from viiwork.agent.supervision import health_ladder as hl
from viiwork.agent.supervision.backends import BackendState as S

RULES = hl.LadderRules(max_failures=3, max_respawns=3, respawn_backoff_s=1.0, respawn_backoff_max_s=5.0,
                       healthy_refill_s=600.0, success_counts_as_probe_s=10.0, respawn_jitter_s=0.0)


def at(state: S, **fields: object) -> hl.Ladder:
    return hl.Ladder(state=state, **fields)  # type: ignore[arg-type]


def kinds(actions: tuple[hl.Action, ...]) -> list[str]:
    return [type(a).__name__ for a in actions]


# ----------------------------------------------------------------- every transition


TRANSITIONS = [
    (at(S.STARTING), hl.Launched(), S.STARTING, []),
    (at(S.UNHEALTHY, reason="x"), hl.Launched(), S.STARTING, []),
    (at(S.STOPPED), hl.Launched(), S.STARTING, []),
    (at(S.STARTING), hl.Ready(), S.HEALTHY, []),
    (at(S.HEALTHY, healthy_since=0.0, failures=2), hl.ProbeOk(), S.HEALTHY, []),
    (at(S.HEALTHY, healthy_since=0.0), hl.ProbeFailed("500"), S.HEALTHY, ["ProbeCounted"]),
    (at(S.HEALTHY, healthy_since=0.0), hl.ProbeFailed("t", timed_out=True, busy=True), S.HEALTHY,
     ["ProbeExcused"]),
    (at(S.HEALTHY, healthy_since=0.0, failures=2), hl.ProbeFailed("500"), S.UNHEALTHY,
     ["ProbeCounted", "StopEngine", "Backoff"]),
    (at(S.HEALTHY, healthy_since=0.0, failures=2), hl.ProbeFailed("500", succeeded_at=9.0), S.HEALTHY,
     ["ProbeContradicted"]),
    (at(S.HEALTHY, healthy_since=0.0, failures=2), hl.ProbeFailed("500", respawn_free=False), S.HEALTHY,
     ["ProbeCounted", "RespawnDeferred"]),
    (at(S.HEALTHY, healthy_since=0.0), hl.Reported("ejected 3 times"), S.UNHEALTHY, ["StopEngine", "Backoff"]),
    (at(S.HEALTHY, healthy_since=0.0), hl.Reported("ejected 3 times", respawn_free=False), S.HEALTHY,
     ["RespawnDeferred"]),
    (at(S.HEALTHY, healthy_since=0.0, spent=1), hl.Reported("ejected 3 times"), S.UNHEALTHY,
     ["StopEngine", "Backoff"]),
    # A report never spends the last respawn (max_respawns 3), nor kills: only the engine's own failures do.
    (at(S.HEALTHY, healthy_since=0.0, spent=2), hl.Reported("ejected 3 times"), S.HEALTHY, ["ReportDeclined"]),
    (at(S.HEALTHY, healthy_since=0.0, spent=3), hl.Reported("ejected 3 times"), S.HEALTHY, ["ReportDeclined"]),
    (at(S.HEALTHY, healthy_since=0.0, spent=2), hl.Reported("ejected", respawn_free=False), S.HEALTHY,
     ["ReportDeclined"]),
    (at(S.STARTING), hl.Failed("startup timeout"), S.UNHEALTHY, ["StopEngine", "Backoff"]),
    (at(S.HEALTHY, healthy_since=0.0), hl.Failed("exited"), S.UNHEALTHY, ["StopEngine", "Backoff"]),
    (at(S.STARTING, spent=3), hl.Failed("exited"), S.DEAD, ["StopEngine", "Die"]),
    (at(S.STARTING, spent=3), hl.Failed("disk full", disk=True), S.UNHEALTHY, ["RetryDisk"]),
    (at(S.UNHEALTHY, backoff_s=1.0), hl.BackoffOver(), S.STARTING, ["Respawn"]),
    (at(S.HEALTHY, healthy_since=0.0), hl.Parked(), S.STOPPED, []),
    (at(S.DEAD, spent=3, reason="gone"), hl.Parked(), S.STOPPED, []),
    (at(S.DEAD, spent=3), hl.Revived(), S.STOPPED, []),
    (at(S.HEALTHY, spent=2, healthy_since=0.0), hl.Revived(), S.HEALTHY, []),
    (at(S.HEALTHY, healthy_since=0.0), hl.Broken("bug"), S.DEAD, ["Die"]),
]


@pytest.mark.parametrize(("before", "event", "state", "actions"), TRANSITIONS,
                         ids=[f"{b.state}-{type(e).__name__}{'-' + '-'.join(a) if a else ''}"
                              for b, e, _, a in TRANSITIONS])
def test_every_transition(before: hl.Ladder, event: hl.Event, state: S, actions: list[str]) -> None:
    after, did = hl.step(before, event, 10.0, RULES)
    assert after.state is state
    assert kinds(did) == actions
    assert (after.healthy_since is not None) == (state is S.HEALTHY)


@pytest.mark.parametrize(
    ("state", "event"),
    [
        (S.DEAD, hl.Launched()),
        (S.HEALTHY, hl.Ready()),
        (S.STARTING, hl.ProbeOk()),
        (S.UNHEALTHY, hl.ProbeFailed("x")),
        (S.STARTING, hl.Reported("x")),
        (S.UNHEALTHY, hl.Reported("x")),
        (S.UNHEALTHY, hl.Failed("x")),
        (S.DEAD, hl.Failed("x")),
        (S.HEALTHY, hl.BackoffOver()),
        (S.UNHEALTHY, hl.BackoffOver()),  # no backoff waited: after a disk fault
        (S.DEAD, hl.BackoffOver()),
    ],
    ids=lambda v: str(v) if isinstance(v, S) else type(v).__name__,
)
def test_events_a_state_cannot_receive_are_refused(state: S, event: hl.Event) -> None:
    with pytest.raises(hl.InvalidTransition, match=type(event).__name__):
        hl.step(at(state), event, 0.0, RULES)


def test_rules_come_from_the_health_section_and_the_supervisors_jitter() -> None:
    health = HealthConfig(max_failures=5, max_respawns=7, respawn_backoff_s=2.0, respawn_backoff_max_s=30.0,
                          healthy_refill_s=60.0, success_counts_as_probe_s=4.0)
    supervisor = SupervisorConfig(respawn_jitter_s=0.5)
    assert hl.LadderRules.from_config(health, supervisor) == hl.LadderRules(5, 7, 2.0, 30.0, 60.0, 4.0, 0.5)
    assert hl.LadderRules.from_config(HealthConfig()) == hl.LadderRules()
    assert hl.LadderRules.from_config(HealthConfig(), SupervisorConfig()) == hl.LadderRules()


# ----------------------------------------------------------------- probes


def healthy(now: float = 0.0, **fields: object) -> hl.Ladder:
    return hl.step(at(S.STARTING, **fields), hl.Ready(), now, RULES)[0]


def test_max_failures_in_a_row_end_health_and_a_good_probe_resets_the_count() -> None:
    ladder = healthy()
    for n in (1, 2):
        ladder, did = hl.step(ladder, hl.ProbeFailed("503"), float(n), RULES)
        assert (ladder.state, did) == (S.HEALTHY, (hl.ProbeCounted(n),))
    ladder, _ = hl.step(ladder, hl.ProbeOk(), 3.0, RULES)
    assert ladder.failures == 0
    for n in (1, 2):
        ladder, _ = hl.step(ladder, hl.ProbeFailed("503"), 3.0 + n, RULES)
    ladder, did = hl.step(ladder, hl.ProbeFailed("no answer within 5 s"), 6.0, RULES)
    assert ladder.state is S.UNHEALTHY
    assert ladder.reason == "3 failed probes in a row, last: no answer within 5 s"
    assert did == (hl.ProbeCounted(3), hl.StopEngine(), hl.Backoff(1.0))


@pytest.mark.parametrize(("timed_out", "busy", "counted"),
                         [(True, True, False), (True, False, True), (False, True, True), (False, False, True)],
                         ids=["timeout-while-busy", "timeout-idle", "error-while-busy", "error-idle"])
def test_only_a_timeout_while_busy_is_excused(timed_out: bool, busy: bool, counted: bool) -> None:
    ladder, _ = hl.step(healthy(), hl.ProbeFailed("x", timed_out=timed_out, busy=busy), 1.0, RULES)
    assert ladder.failures == (1 if counted else 0)


# ----------------------------------------------------------------- hysteresis: requests that succeeded


def blip(rules: hl.LadderRules, requests_every_s: float | None, horizon_s: float = 30.0) -> list[tuple[float, str]]:
    """The issue's blip in virtual time: ``health.interval_s`` 1, ``max_failures`` 3; /health
    answers 503 from t=10 to t=13; requests succeed every ``requests_every_s`` (None: no
    traffic). Returns (time, action) for every action but ProbeCounted."""
    ladder = healthy(0.0)
    now, done = 0.0, []
    while now < horizon_s:
        now += 1.0  # the interval
        failing = 10.0 <= now < 13.0
        succeeded_at = None if requests_every_s is None else now - 0.1 - (now % requests_every_s)
        event: hl.Event = hl.ProbeFailed("/health answered 503", succeeded_at=succeeded_at) \
            if failing else hl.ProbeOk()
        if ladder.state is not S.HEALTHY:
            break
        ladder, actions = hl.step(ladder, event, now, rules)
        done += [(now, type(a).__name__) for a in actions if not isinstance(a, hl.ProbeCounted)]
    return done


def test_a_health_blip_while_requests_succeed_restarts_nothing() -> None:
    done = blip(RULES, requests_every_s=0.25)
    assert done and {a for _, a in done} == {"ProbeContradicted"}
    # Without the rule (0 s) the same blip ends health: what every backend of every node did.
    assert [a for _, a in blip(replace(RULES, success_counts_as_probe_s=0.0), requests_every_s=0.25)] \
        == ["StopEngine", "Backoff"]
    # Without traffic nothing contradicts the probes.
    assert [a for _, a in blip(RULES, requests_every_s=None)] == ["StopEngine", "Backoff"]


@pytest.mark.parametrize(
    ("healthy_since", "succeeded_at", "window", "counted"),
    [(0.0, 90.0, 10.0, False), (0.0, 89.999, 10.0, True), (0.0, 99.5, 0.0, True), (95.0, 94.0, 10.0, True),
     (95.0, 95.0, 10.0, False), (0.0, None, 10.0, True)],
    ids=["at-the-window's-edge", "just-older", "rule-off", "before-this-engine-was-healthy",
         "since-healthy", "no-request-succeeded"],
)
def test_a_success_counts_as_a_good_probe_only_within_the_window_and_on_this_engine(
        healthy_since: float, succeeded_at: float | None, window: float, counted: bool) -> None:
    rules = replace(RULES, success_counts_as_probe_s=window)
    ladder, did = hl.step(healthy(healthy_since, failures=0), hl.ProbeFailed("503", succeeded_at=succeeded_at),
                          100.0, rules)
    if counted:
        assert did == (hl.ProbeCounted(1),)
    else:
        assert did == (hl.ProbeContradicted(100.0 - (succeeded_at or 0.0)),) and ladder.failures == 0


def test_a_contradicted_probe_resets_the_count_like_a_good_one() -> None:
    ladder = healthy()
    for n in (1.0, 2.0):
        ladder, _ = hl.step(ladder, hl.ProbeFailed("503"), n, RULES)
    assert ladder.failures == 2
    ladder, did = hl.step(ladder, hl.ProbeFailed("503", timed_out=True, busy=True, succeeded_at=2.5), 3.0, RULES)
    assert did == (hl.ProbeContradicted(0.5),) and ladder.failures == 0


def test_an_engine_that_stops_answering_requests_too_is_unhealthy_at_most_the_window_later() -> None:
    # The last request succeeded at t=100; from then on every probe (1 s apart) fails.
    ladder, now, actions = healthy(), 100.0, ()
    while ladder.state is S.HEALTHY:
        now += 1.0
        ladder, actions = hl.step(ladder, hl.ProbeFailed("503", succeeded_at=100.0), now, RULES)
    # contradicted up to 100 + success_counts_as_probe_s, then max_failures counted probes
    assert now == 100.0 + 10.0 + 3 * 1.0
    assert actions == (hl.ProbeCounted(3), hl.StopEngine(), hl.Backoff(1.0))


# ----------------------------------------------------------------- staggering: the node's respawn cap


def test_no_free_respawn_slot_keeps_a_failing_backend_healthy_until_one_frees() -> None:
    ladder = healthy()
    for n in (1.0, 2.0):
        ladder, _ = hl.step(ladder, hl.ProbeFailed("503", respawn_free=False), n, RULES)
    for n in (3.0, 4.0, 5.0):  # the streak would end health: deferred, still probed
        ladder, did = hl.step(ladder, hl.ProbeFailed("503", respawn_free=False), n, RULES)
        assert did == (hl.ProbeCounted(3), hl.RespawnDeferred("3 failed probes in a row, last: 503"))
        assert (ladder.state, ladder.failures) == (S.HEALTHY, 3)
    # a slot frees: the next counted failure ends health at once
    after, did = hl.step(ladder, hl.ProbeFailed("503"), 6.0, RULES)
    assert after.state is S.UNHEALTHY and did == (hl.ProbeCounted(3), hl.StopEngine(), hl.Backoff(1.0))
    # or the blip ends first: a good probe (or a request that succeeded) clears the streak
    cleared, _ = hl.step(ladder, hl.ProbeOk(), 6.0, RULES)
    assert (cleared.state, cleared.failures) == (S.HEALTHY, 0)
    cleared, _ = hl.step(ladder, hl.ProbeFailed("503", succeeded_at=5.9, respawn_free=False), 6.0, RULES)
    assert (cleared.state, cleared.failures) == (S.HEALTHY, 0)


def test_an_outlier_report_ends_health_by_the_usual_rules() -> None:
    ladder = healthy()
    after, did = hl.step(ladder, hl.Reported("ejected 3 times in a row"), 1.0, RULES)
    assert (after.state, after.reason, did) == (S.UNHEALTHY, "ejected 3 times in a row",
                                                (hl.StopEngine(), hl.Backoff(1.0)))
    deferred, did = hl.step(ladder, hl.Reported("ejected", respawn_free=False), 1.0, RULES)
    assert deferred == ladder and did == (hl.RespawnDeferred("ejected"),)
    spent, did = hl.step(healthy(spent=3), hl.Reported("ejected"), 1.0, RULES)
    assert spent == replace(healthy(spent=3), declined=1) and did == (hl.ReportDeclined("ejected", 1),)


def test_outlier_reports_never_make_a_backend_dead() -> None:
    """Issue 22: a client whose requests fail every backend got good backends reported every
    ~20 s; each report spent a respawn, and the backends went dead at ~180 s. Now reports
    spend all but the last respawn, then change nothing; the engine's own failures still do."""
    rules = hl.LadderRules(max_respawns=3, respawn_backoff_s=1.0, respawn_backoff_max_s=60.0, healthy_refill_s=600.0,
                           respawn_jitter_s=0.0)
    ladder, now, declined = healthy(), 0.0, []
    for i in range(250):  # a report every 20 s, for over an hour
        if i == 25:  # within healthy_refill_s of the last respawn
            assert (ladder.respawns, ladder.spent) == (2, 2)  # the last respawn is kept
            assert declined == list(range(1, 24))  # counted; the task logs the first
        now += 20.0
        ladder, did = hl.step(ladder, hl.Reported("ejected 3 times in a row: 5 consecutive failures"), now, rules)
        if ladder.state is S.UNHEALTHY:  # respawned by the usual rules
            (backoff,) = [a for a in did if isinstance(a, hl.Backoff)]
            now += backoff.delay_s
            ladder, _ = hl.step(ladder, hl.BackoffOver(), now, rules)
            now += 2.0
            ladder, _ = hl.step(ladder, hl.Ready(), now, rules)
        else:
            (action,) = did
            assert isinstance(action, hl.ReportDeclined)
            declined.append(action.declined)
        assert ladder.state is S.HEALTHY
    # Healthy for healthy_refill_s (600 s) in between, the budget refills (by the usual rule):
    # reports spend all but its last respawn again.
    assert ladder.spent == 2 and ladder.respawns > 2
    # The engine exits: the kept respawn is used, and the next exit is the end.
    ladder, did = hl.step(ladder, hl.Failed("exited: status 1"), now + 1.0, rules)
    assert ladder.state is S.UNHEALTHY and hl.Backoff(4.0) in did
    ladder, _ = hl.step(ladder, hl.BackoffOver(), now + 5.0, rules)
    ladder, _ = hl.step(ladder, hl.Ready(), now + 7.0, rules)
    assert ladder.declined == 0  # a new engine: its first declined report is logged again
    ladder, did = hl.step(ladder, hl.Failed("exited: status 1"), now + 8.0, rules)
    assert ladder.state is S.DEAD and hl.Die("exited: status 1") in did


def test_a_report_after_a_long_health_finds_the_budget_refilled() -> None:
    ladder = healthy(spent=2)  # max_respawns 3: declined now ...
    assert hl.declines_report(ladder, 599.0, RULES) and not hl.declines_report(ladder, 600.0, RULES)
    after, did = hl.step(ladder, hl.Reported("ejected"), 600.0, RULES)  # ... not after healthy_refill_s
    assert (after.state, after.spent) == (S.UNHEALTHY, 0) and hl.Backoff(1.0) in did
    for budget in (0, 1):  # no respawn a report may spend: declined from the first
        rules = replace(RULES, max_respawns=budget)
        assert hl.step(healthy(), hl.Reported("x"), 1e6, rules)[0].state is S.HEALTHY


def test_the_backoff_carries_the_jitter_for_the_task_to_draw() -> None:
    rules = replace(RULES, respawn_jitter_s=2.5)
    _, did = hl.step(healthy(), hl.Failed("exited"), 1.0, rules)
    assert did == (hl.StopEngine(), hl.Backoff(1.0, 2.5))


# ----------------------------------------------------------------- backoff, refill, dead


@dataclass
class Sim:
    """A backend in virtual time whose engine loads in ``load_s`` and fails ``crash_after_s``
    after each ready, until dead or ``horizon_s``: what the supervisor would do, minus I/O."""

    rules: hl.LadderRules
    load_s: float = 2.0
    crash_after_s: float = 1.0
    now: float = 0.0
    ladder: hl.Ladder = field(default_factory=hl.Ladder)
    backoffs: list[float] = field(default_factory=list)

    def step(self, event: hl.Event) -> tuple[hl.Action, ...]:
        self.ladder, actions = hl.step(self.ladder, event, self.now, self.rules)
        return actions

    def run(self, horizon_s: float = 1e6) -> hl.Ladder:
        while self.now < horizon_s:
            self.step(hl.Launched())
            self.now += self.load_s
            self.step(hl.Ready())
            self.now += self.crash_after_s
            actions = self.step(hl.Failed("exited: status 1"))
            if any(isinstance(a, hl.Die) for a in actions):
                return self.ladder
            (backoff,) = [a for a in actions if isinstance(a, hl.Backoff)]
            self.backoffs.append(backoff.delay_s)
            self.now += backoff.delay_s
            self.step(hl.BackoffOver())
        return self.ladder


def test_backoff_doubles_up_to_its_cap_and_dead_after_max_respawns() -> None:
    rules = hl.LadderRules(max_respawns=6, respawn_backoff_s=0.5, respawn_backoff_max_s=5.0, healthy_refill_s=600)
    sim = Sim(rules)
    end = sim.run()
    assert sim.backoffs == [0.5, 1.0, 2.0, 4.0, 5.0, 5.0]
    assert (end.state, end.respawns, end.spent, end.reason) == (S.DEAD, 6, 6, "exited: status 1")
    assert sim.now == pytest.approx(7 * 3.0 + sum(sim.backoffs))


def test_no_respawn_budget_is_dead_at_the_first_failure() -> None:
    end = Sim(hl.LadderRules(max_respawns=0)).run()
    assert (end.state, end.respawns) == (S.DEAD, 0)


def test_healthy_for_refill_s_restores_the_budget_so_a_slow_crasher_lives_on() -> None:
    rules = hl.LadderRules(max_respawns=2, respawn_backoff_s=1.0, healthy_refill_s=600.0)
    # healthy for exactly healthy_refill_s each time: every failure finds a full budget
    sim = Sim(rules, crash_after_s=600.0)
    end = sim.run(horizon_s=100 * 600.0)
    assert end.state is S.UNHEALTHY or end.state is S.STARTING
    assert end.respawns >= 99 and set(sim.backoffs) == {1.0}
    # a hair less: the budget is never refilled, dead after max_respawns
    end = Sim(rules, crash_after_s=599.999).run(horizon_s=100 * 600.0)
    assert (end.state, end.respawns) == (S.DEAD, 2)


def test_a_disk_fault_spends_no_respawn() -> None:
    ladder = at(S.STARTING, spent=3)
    for _ in range(50):
        ladder, did = hl.step(ladder, hl.Failed("engine key: no space left", disk=True), 0.0, RULES)
        assert did == (hl.RetryDisk(),) and ladder.state is S.UNHEALTHY
        ladder, _ = hl.step(ladder, hl.Launched(), 0.0, RULES)
    assert (ladder.spent, ladder.respawns) == (3, 0)


def test_up_revives_with_a_full_budget_and_down_keeps_it() -> None:
    dead = Sim(RULES).run()
    assert dead.state is S.DEAD
    parked, _ = hl.step(dead, hl.Parked(), 0.0, RULES)
    assert (parked.state, parked.spent, parked.reason) == (S.STOPPED, 3, "exited: status 1")
    revived, _ = hl.step(parked, hl.Revived(), 0.0, RULES)
    assert (revived.spent, revived.respawns) == (0, 3)  # respawns counts on (a counter)
    again, did = hl.step(hl.step(revived, hl.Launched(), 0.0, RULES)[0], hl.Failed("exited"), 1.0, RULES)
    assert again.state is S.UNHEALTHY and did[-1] == hl.Backoff(1.0)


def test_backoff_stays_finite_for_any_budget() -> None:
    rules = hl.LadderRules(respawn_backoff_s=86400.0, respawn_backoff_max_s=86400.0)
    assert rules.backoff_s(10**6) == 86400.0


@pytest.mark.parametrize(
    ("load_at", "healthy_since", "now", "stale"),
    [(10.0, 0.0, 12.9, False), (10.0, 0.0, 13.0, True), (None, 5.0, 7.9, False), (None, 5.0, 8.0, True),
     (None, None, 100.0, False)],
    ids=["read-recently", "read-long-ago", "healthy-recently", "healthy-long-ago", "never-healthy"],
)
def test_load_goes_stale_from_the_last_reading_else_from_health(load_at, healthy_since, now, stale) -> None:
    assert hl.load_goes_stale(load_at, healthy_since, now, 3.0) is stale


# ----------------------------------------------------------------- properties


EVENTS = st.one_of(
    st.just(hl.Launched()), st.just(hl.Ready()), st.just(hl.ProbeOk()),
    st.builds(hl.ProbeFailed, st.just("x"), st.booleans(), st.booleans(), st.none(), st.booleans()),
    st.builds(hl.Reported, st.just("x"), st.booleans()),
    st.builds(hl.Failed, st.just("x"), st.booleans()),
    st.just(hl.BackoffOver()), st.just(hl.Parked()), st.just(hl.Revived()),
)
# How long before a ProbeFailed a request succeeded (None: none did).
AGO = st.one_of(st.none(), st.floats(min_value=0.0, max_value=30.0))


@settings(max_examples=300, deadline=None)
@given(
    events=st.lists(st.tuples(EVENTS, st.floats(min_value=0.0, max_value=900.0), AGO), max_size=80),
    max_failures=st.integers(1, 5), max_respawns=st.integers(0, 5),
    base=st.floats(0.01, 10.0), cap=st.floats(0.01, 100.0),
)
def test_ladder_invariants_hold_for_any_event_sequence(events, max_failures, max_respawns, base, cap) -> None:
    rules = hl.LadderRules(max_failures=max_failures, max_respawns=max_respawns, respawn_backoff_s=base,
                           respawn_backoff_max_s=cap, healthy_refill_s=600.0, success_counts_as_probe_s=10.0)
    ladder, now, respawns = hl.Ladder(), 0.0, 0
    for event, dt, ago in events:
        now += dt
        if isinstance(event, hl.ProbeFailed) and ago is not None:
            event = replace(event, succeeded_at=now - ago)
        try:
            after, actions = hl.step(ladder, event, now, rules)
        except hl.InvalidTransition:
            continue
        if isinstance(event, hl.BackoffOver):
            respawns += 1
        assert after.respawns == respawns
        assert 0 <= after.spent <= max_respawns  # never more respawns in a row than the budget
        assert (after.healthy_since is not None) == (after.state is S.HEALTHY)
        if after.state is S.HEALTHY:
            # max_failures only once a respawn was deferred (no free slot on the node)
            assert after.failures <= max_failures
            if after.failures == max_failures and ladder.failures < max_failures:
                assert any(isinstance(a, hl.RespawnDeferred) for a in actions)
        recent = (isinstance(event, hl.ProbeFailed) and event.succeeded_at is not None
                  and ladder.healthy_since is not None and event.succeeded_at >= ladder.healthy_since
                  and now - event.succeeded_at <= 10.0)
        if recent:  # a request that succeeded meanwhile: never unhealthy, the count reset
            assert after.state is S.HEALTHY and after.failures == 0
        if not getattr(event, "respawn_free", True):
            assert after.state is ladder.state  # no free respawn slot: health never ends
        for action in actions:
            if isinstance(action, hl.Backoff):
                assert action.delay_s == min(base * 2 ** after.spent, cap) and action.delay_s <= cap
            if isinstance(action, hl.Die):
                assert after.state is S.DEAD and after.spent >= max_respawns
        if after.state is S.DEAD:
            assert ladder.state is S.DEAD or any(isinstance(a, hl.Die) for a in actions)
        if isinstance(event, hl.Failed) and event.disk:
            assert (after.spent, after.respawns) == (ladder.spent, ladder.respawns)
        if isinstance(event, hl.Reported):  # an outlier report never kills, nor spends the last respawn
            assert after.state is not S.DEAD and not any(isinstance(a, hl.Die) for a in actions)
            if after.state is S.UNHEALTHY:
                assert after.spent + 1 < max_respawns
        ladder = after


@settings(max_examples=200, deadline=None)
@given(load_s=st.floats(0.0, 100.0), crash_after_s=st.floats(0.0, 599.0), max_respawns=st.integers(0, 8))
def test_a_backend_that_never_stays_healthy_long_is_dead_after_exactly_max_respawns(
        load_s: float, crash_after_s: float, max_respawns: int) -> None:
    end = Sim(hl.LadderRules(max_respawns=max_respawns), load_s=load_s, crash_after_s=crash_after_s).run()
    assert (end.state, end.respawns) == (S.DEAD, max_respawns)
