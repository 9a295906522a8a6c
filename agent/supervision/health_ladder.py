"""The health ladder of one backend as a pure transition function (docs/reliability.md).

``step(ladder, event, now, rules) -> (ladder, actions)``: no I/O, no clock of its own, no
asyncio, no randomness. A backend's task (agent/supervision/backend_task.py) feeds it what
happened to the engine (ready, a probe's answer, an exit or other failure, an outlier report,
the end of a backoff, a command) with the monotonic time, and carries out the actions it
returns (stop the engine, wait, respawn, give up) in order. Tests drive it in virtual time
(tests/unit/test_health_ladder.py).

    starting --Ready--> healthy --max_failures counted ProbeFailed, Reported, or Failed--> unhealthy
       |  Failed (startup timeout, exit, launch error)                               |
       +-------------------------> unhealthy --BackoffOver--> starting (respawn) <---+
                                       | budget spent (checked at the failure; never by Reported)
                                       v
                                     dead  (Revived: a fresh budget; Broken: at once)

The rules, with their settings (``[health]``, docs/configuration.md):

- a probe that timed out while requests run is excused (llama-server may not answer /health
  mid-prefill); any other failed probe counts; ``max_failures`` in a row end health, a
  successful probe resets the count;
- hysteresis: a request that succeeded on the backend (``Backend.note_success``) within
  ``success_counts_as_probe_s`` before a failed probe, and since the backend became healthy,
  counts as a good probe: that failure is not counted and the count resets (0 s: off). So a
  /health blip while completions succeed restarts nothing; an engine that stops answering
  requests too is unhealthy at most ``success_counts_as_probe_s`` later than without it;
- staggering: the probe failure (or outlier report, ``Reported``) that would end health while
  the node has no free respawn slot (``[supervisor] max_concurrent_respawns`` respawns
  already under way, ``respawn_free`` False) keeps the backend healthy, still probed, its
  count at ``max_failures``: the next counted failure that finds a slot ends health, a good
  probe resets it. So one blip on every backend restarts one at a time, and the blip is
  usually over before the second. An exit is never deferred (the engine is gone);
- a failure refills the respawn budget when the backend had been healthy for
  ``healthy_refill_s`` without a break; then, with ``max_respawns`` respawns spent, the
  backend is dead; else it is respawned after ``respawn_backoff_s * 2**spent``, at most
  ``respawn_backoff_max_s``, plus a random share of ``[supervisor] respawn_jitter_s`` (drawn
  by the task: ``Backoff.jitter_s``);
- an outlier report (``Reported``) never spends the last respawn: when the budget (refilled
  as above) has at most one respawn left it keeps the backend healthy (``ReportDeclined``,
  counted in ``declined``), so only an engine's exits, failed launches and failed probes make
  a backend dead. A request path's verdict can be a client's doing (requests that fail every
  backend), and a good backend must not be killed by it;
- a disk fault (a key file the full state dir cannot take) spends nothing: the launch is
  retried after the pending-write interval;
- ``Revived`` (``viiworkctl up``) restores the full budget; ``Parked`` (down, stop) keeps it.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from viiwork.agent.config.schema import HealthConfig, SupervisorConfig
from viiwork.agent.supervision.backends import BackendState

#: Largest exponent of the backoff's doubling: keeps the float finite for any budget.
MAX_DOUBLINGS = 1000


@dataclass(frozen=True, slots=True)
class LadderRules:
    """The ``[health]`` settings the ladder follows, and ``[supervisor] respawn_jitter_s``
    (units: seconds, counts)."""

    max_failures: int = 3
    max_respawns: int = 3
    respawn_backoff_s: float = 1.0
    respawn_backoff_max_s: float = 60.0
    healthy_refill_s: float = 600.0
    success_counts_as_probe_s: float = 10.0
    respawn_jitter_s: float = 1.0

    @classmethod
    def from_config(cls, health: HealthConfig, supervisor: SupervisorConfig | None = None) -> LadderRules:
        """The rules of a config's sections (``supervisor`` None: its defaults)."""
        jitter = (supervisor if supervisor is not None else SupervisorConfig()).respawn_jitter_s
        return cls(max_failures=health.max_failures, max_respawns=health.max_respawns,
                   respawn_backoff_s=health.respawn_backoff_s, respawn_backoff_max_s=health.respawn_backoff_max_s,
                   healthy_refill_s=health.healthy_refill_s,
                   success_counts_as_probe_s=health.success_counts_as_probe_s, respawn_jitter_s=jitter)

    def backoff_s(self, spent: int) -> float:
        """The wait before the respawn that follows ``spent`` respawns in a row."""
        return min(self.respawn_backoff_s * 2.0 ** min(spent, MAX_DOUBLINGS), self.respawn_backoff_max_s)


@dataclass(frozen=True, slots=True)
class Ladder:
    """Where one backend stands. ``state``: starting, healthy, unhealthy, dead or stopped
    (``draining`` is the supervisor's display while it stops an engine, not a rung).
    ``failures``: counted probe failures in a row while healthy (``max_failures`` while a
    respawn is deferred: the module docstring, "staggering"). ``spent``: respawns since
    the budget was last full. ``respawns``: all respawns (never reset; /v1/status).
    ``healthy_since``: monotonic s of the last ``Ready``, None when not healthy.
    ``reason``: why it is unhealthy or dead ("" otherwise). ``backoff_s``: the backoff an
    unhealthy backend waits before its respawn, None when it waits for none (a disk fault).
    ``declined``: outlier reports declined since the backend last became healthy."""

    state: BackendState = BackendState.STARTING
    failures: int = 0
    spent: int = 0
    respawns: int = 0
    healthy_since: float | None = None
    reason: str = ""
    backoff_s: float | None = None
    declined: int = 0


# ----------------------------------------------------------------- events


@dataclass(frozen=True, slots=True)
class Launched:
    """A launch (or the adoption of a running engine) begins."""


@dataclass(frozen=True, slots=True)
class Ready:
    """The engine answered a probe ready."""


@dataclass(frozen=True, slots=True)
class ProbeOk:
    """A healthy backend answered its probe ready."""


@dataclass(frozen=True, slots=True)
class ProbeFailed:
    """A healthy backend's probe failed: ``timed_out`` (no answer within the deadline) while
    ``busy`` (requests running on it) is excused. ``succeeded_at``: monotonic s of the last
    request that succeeded on the backend (``Backend.last_success_at``), None when none did.
    ``respawn_free``: the node has a free respawn slot (``supervisor.max_concurrent_respawns``)."""

    reason: str
    timed_out: bool = False
    busy: bool = False
    succeeded_at: float | None = None
    respawn_free: bool = True


@dataclass(frozen=True, slots=True)
class Reported:
    """The request path's outlier detection reports a healthy backend failing (ejected
    several times in a row): it ends health like ``max_failures`` failed probes, with
    ``reason``, unless that would spend the last respawn (``declines_report``);
    ``respawn_free`` as in ``ProbeFailed``."""

    reason: str
    respawn_free: bool = True


@dataclass(frozen=True, slots=True)
class Failed:
    """A run ended badly: the engine exited, did not get ready in time, or could not be
    launched. ``disk``: nothing ran because a key file could not be written (full disk)."""

    reason: str
    disk: bool = False


@dataclass(frozen=True, slots=True)
class BackoffOver:
    """The backoff of an unhealthy backend has passed: respawn now."""


@dataclass(frozen=True, slots=True)
class Parked:
    """Stopped on purpose (down, stop, reload)."""


@dataclass(frozen=True, slots=True)
class Revived:
    """``up``: a fresh respawn budget (and a dead backend may start again)."""


@dataclass(frozen=True, slots=True)
class Broken:
    """Supervision itself failed (a bug): dead at once, until ``up``."""

    reason: str


Event = Launched | Ready | ProbeOk | ProbeFailed | Reported | Failed | BackoffOver | Parked | Revived | Broken


# ----------------------------------------------------------------- actions


@dataclass(frozen=True, slots=True)
class ProbeExcused:
    """Log only: the failed probe was not counted."""


@dataclass(frozen=True, slots=True)
class ProbeCounted:
    """Log only: the failed probe counted (``failures`` of ``max_failures``)."""

    failures: int


@dataclass(frozen=True, slots=True)
class ProbeContradicted:
    """Log only: the failed probe was not counted, and the count reset, because a request
    succeeded ``ago_s`` seconds before it."""

    ago_s: float


@dataclass(frozen=True, slots=True)
class RespawnDeferred:
    """Log only: health would end (``reason``) but the node has no free respawn slot: the
    backend stays healthy and probed."""

    reason: str


@dataclass(frozen=True, slots=True)
class ReportDeclined:
    """Log only: the outlier report (``reason``) was declined, the backend stays healthy: the
    respawn budget has at most one respawn left, kept for the engine's own failures.
    ``declined``: reports declined since the backend became healthy (log the first)."""

    reason: str
    declined: int


@dataclass(frozen=True, slots=True)
class StopEngine:
    """Stop what is left of the engine, draining its requests first."""


@dataclass(frozen=True, slots=True)
class Backoff:
    """Wait ``delay_s`` plus a random share of ``jitter_s`` (uniform in [0, jitter_s), drawn
    by the caller), then send ``BackoffOver`` (a command may end the wait first)."""

    delay_s: float
    jitter_s: float = 0.0


@dataclass(frozen=True, slots=True)
class RetryDisk:
    """Wait for the disk (the pending-write retry interval), then launch again, spending nothing."""


@dataclass(frozen=True, slots=True)
class Die:
    """Dead: show ``reason`` and wait for a command."""

    reason: str


@dataclass(frozen=True, slots=True)
class Respawn:
    """Launch again: respawn number ``respawns``, ``spent`` of the budget now used."""

    respawns: int
    spent: int


Action = (ProbeExcused | ProbeCounted | ProbeContradicted | RespawnDeferred | ReportDeclined | StopEngine | Backoff
          | RetryDisk | Die | Respawn)


class InvalidTransition(ValueError):
    """``event`` cannot happen in ``state`` (a supervisor bug, never an engine's doing)."""

    def __init__(self, state: BackendState, event: Event) -> None:
        super().__init__(f"{type(event).__name__} while {state}")
        self.state = state
        self.event = event


# ----------------------------------------------------------------- the function


def step(ladder: Ladder, event: Event, now: float, rules: LadderRules) -> tuple[Ladder, tuple[Action, ...]]:
    """The ladder after ``event`` at ``now`` (monotonic s), and what to do, in order.

    Raises InvalidTransition for an event the state cannot receive (a probe result when not
    healthy, a launch of a dead backend, the end of a backoff nobody waited for).
    """
    state = ladder.state
    match event:
        case Launched():
            if state is BackendState.DEAD:
                raise InvalidTransition(state, event)
            return replace(ladder, state=BackendState.STARTING, failures=0, healthy_since=None, reason="",
                           backoff_s=None), ()
        case Ready():
            if state is not BackendState.STARTING:
                raise InvalidTransition(state, event)
            return replace(ladder, state=BackendState.HEALTHY, failures=0, healthy_since=now, reason="",
                           declined=0), ()
        case ProbeOk():
            if state is not BackendState.HEALTHY:
                raise InvalidTransition(state, event)
            return replace(ladder, failures=0), ()
        case ProbeFailed(reason=reason, timed_out=timed_out, busy=busy, succeeded_at=succeeded_at,
                         respawn_free=respawn_free):
            if state is not BackendState.HEALTHY:
                raise InvalidTransition(state, event)
            if _contradicts(ladder, succeeded_at, now, rules):
                assert succeeded_at is not None
                return replace(ladder, failures=0), (ProbeContradicted(now - succeeded_at),)
            if timed_out and busy:
                return ladder, (ProbeExcused(),)
            failures = min(ladder.failures + 1, rules.max_failures)
            counted = ProbeCounted(failures)
            if failures < rules.max_failures:
                return replace(ladder, failures=failures), (counted,)
            why = f"{failures} failed probes in a row, last: {reason}"
            if not respawn_free:
                return replace(ladder, failures=failures), (counted, RespawnDeferred(why))
            after, actions = _fail(ladder, why, now, rules)
            return after, (counted, *actions)
        case Reported(reason=reason, respawn_free=respawn_free):
            if state is not BackendState.HEALTHY:
                raise InvalidTransition(state, event)
            if declines_report(ladder, now, rules):
                declined = ladder.declined + 1
                return replace(ladder, declined=declined), (ReportDeclined(reason, declined),)
            if not respawn_free:
                return ladder, (RespawnDeferred(reason),)
            return _fail(ladder, reason, now, rules)
        case Failed(reason=reason, disk=disk):
            if state not in (BackendState.STARTING, BackendState.HEALTHY):
                raise InvalidTransition(state, event)
            if disk:  # no engine ran: wait for the disk, spending no respawn
                return replace(ladder, state=BackendState.UNHEALTHY, failures=0, healthy_since=None,
                               reason=reason), (RetryDisk(),)
            return _fail(ladder, reason, now, rules)
        case BackoffOver():
            if state is not BackendState.UNHEALTHY or ladder.backoff_s is None:
                raise InvalidTransition(state, event)
            after = replace(ladder, state=BackendState.STARTING, spent=ladder.spent + 1,
                            respawns=ladder.respawns + 1, reason="", backoff_s=None)
            return after, (Respawn(after.respawns, after.spent),)
        case Parked():
            return replace(ladder, state=BackendState.STOPPED, failures=0, healthy_since=None, backoff_s=None,
                           reason=ladder.reason if state is BackendState.DEAD else ""), ()
        case Revived():
            revived = BackendState.STOPPED if state is BackendState.DEAD else state
            return replace(ladder, state=revived, spent=0), ()
        case Broken(reason=reason):
            return replace(ladder, state=BackendState.DEAD, failures=0, healthy_since=None, backoff_s=None,
                           reason=reason), (Die(reason),)
    raise TypeError(f"not a ladder event: {event!r}")


def declines_report(ladder: Ladder, now: float, rules: LadderRules) -> bool:
    """Whether a ``Reported`` at ``now`` is declined: the respawn it would spend is the budget's
    last (or none is left), once refilled by a long enough health."""
    return _spent(ladder, now, rules) + 1 >= rules.max_respawns


def _spent(ladder: Ladder, now: float, rules: LadderRules) -> int:
    """The respawns spent at ``now``: 0 once healthy for ``healthy_refill_s`` (the budget refills)."""
    if ladder.healthy_since is not None and now - ladder.healthy_since >= rules.healthy_refill_s:
        return 0
    return ladder.spent


def _fail(ladder: Ladder, reason: str, now: float, rules: LadderRules) -> tuple[Ladder, tuple[Action, ...]]:
    """Unhealthy with ``reason``: the budget refilled by a long enough health, then dead or a backoff."""
    spent = _spent(ladder, now, rules)
    if spent >= rules.max_respawns:
        return (replace(ladder, state=BackendState.DEAD, failures=0, spent=spent, healthy_since=None, reason=reason),
                (StopEngine(), Die(reason)))
    delay = rules.backoff_s(spent)
    return (replace(ladder, state=BackendState.UNHEALTHY, failures=0, spent=spent, healthy_since=None, reason=reason,
                    backoff_s=delay), (StopEngine(), Backoff(delay, rules.respawn_jitter_s)))


def _contradicts(ladder: Ladder, succeeded_at: float | None, now: float, rules: LadderRules) -> bool:
    """Whether a request that succeeded at ``succeeded_at`` counts as a good probe at ``now``:
    within ``success_counts_as_probe_s`` (0: never) and on this engine (since it became healthy)."""
    window = rules.success_counts_as_probe_s
    return (window > 0 and succeeded_at is not None and ladder.healthy_since is not None
            and succeeded_at >= ladder.healthy_since and now - succeeded_at <= window)


def load_goes_stale(load_at: float | None, healthy_since: float | None, now: float, stale_after_s: float) -> bool:
    """Whether a healthy backend whose load read just failed has gone without a reading for
    ``stale_after_s`` (``supervisor.load_stale_after_s``): counted from its last good reading,
    else from when it became healthy, else from ``now`` (never stale yet)."""
    since = load_at if load_at is not None else healthy_since if healthy_since is not None else now
    return now - since >= stale_after_s
