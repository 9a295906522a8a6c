"""Outlier detection: the targets a node stops sending requests to for a while (issue 22).

A pure state machine: no I/O, no clock of its own, no asyncio. Every method takes ``now``,
monotonic seconds (``time.monotonic()`` in the agent, a made-up clock in
tests/unit/test_outliers.py). A *target* is any hashable key: a local backend id, or a
``(peer node id, model)`` pair for requests forwarded to a peer. The caller classifies each
answer and calls ``record(key, ok, now)``: a failure (``ok=False``) is an engine 5xx, a
connection reset or refusal, or a timeout before an answer; a 2xx or 3xx is a success; a
client's 4xx, or a failure that was the request's fault (agent/serving/pipeline.py), is not
recorded: it says nothing of the target's health.

The rules (settings: ``OutlierSettings``; defaults in brackets):

- a target is **ejected** after ``consecutive_failures`` [5] failures in a row, or when,
  among the outcomes of the last ``window_s`` [10 s], at least ``min_requests`` [10], the share
  of failures is at least ``failure_rate`` [0.5]. Both rules are checked at every outcome. The
  window slides in tenths of ``window_s``: it holds between 0.9 and 1.0 ``window_s`` of outcomes;
- its k-th ejection in a row lasts ``base_ejection_s`` [5 s] * 2**(k-1), at most
  ``max_ejection_s`` [120 s], then plus a jitter of less than ``jitter`` [0.1] of it (so
  targets ejected together do not all come back at once); outcomes recorded while ejected
  (requests sent before the ejection) change nothing;
- when the ejection has passed the target is **half-open**: ``allow`` lets exactly one request
  through (the probe), then refuses until an outcome is recorded, or until ``probe_timeout_s``
  [30 s] have passed without one (the probe's caller went away) or the caller ``release``-d
  it (its answer said nothing of the target), when another probe may go.
  The first outcome recorded while half-open decides: a success **restores** the target
  (consecutive and window counts cleared), a failure ejects it again with k+1;
- k is kept after a restore, so the next ejection is longer, until the target has answered
  ``reset_after_successes`` [20] successes in a row; then k is 0 again;
- the caller reports a local backend to the supervisor as unhealthy when k reaches
  ``report_after_ejections`` [3] (``Ejected.report_unhealthy``).

The source is Envoy's outlier detection (consecutive_5xx, default 5; an analysis interval of
10 s; base_ejection_time, default 30 s, multiplied by the number of ejections, up to
max_ejection_time, 300 s; max_ejection_percent, default 10 %, ejects at least one host) and the
closed / open / half-open circuit breakers of the SGLang model gateway. We chose shorter
ejections that double: an inference engine that fails fast (an out-of-memory loop, a crashed
CUDA context) answers every request with an error in milliseconds, so a least-loaded router
feeds it most of the traffic; 5 s is long enough to move that traffic away and short enough
that a backend that recovered (a request of death passed) is back before clients notice, while
doubling reaches the 120 s cap in six ejections for a backend that stays broken.

Not here: Envoy's max_ejection_percent. "An ejection never removes the last backend of a model
everywhere" is the router's rule (agent/serving/router.py): when every candidate for a model is
ejected it ignores the ejections and routes as if none were (``usable`` tells it which are).

Memory is bounded: a target that is ok, has k == 0 and no outcome in the last ``window_s``
holds no state (dropped lazily, in a sweep at most once per ``window_s``); the table holds at
most ``max_targets`` [4096] keys, and a new key past that drops the least recently recorded ok
target (k == 0 first), or the least recently recorded target when none is ok.
"""

from __future__ import annotations

import math
import random
from collections.abc import Hashable
from dataclasses import dataclass

#: The failure-rate window's slices: it slides in steps of ``window_s / WINDOW_SLICES``.
WINDOW_SLICES = 10
#: Largest exponent of the ejection time's doubling: keeps the float finite for any k.
MAX_DOUBLINGS = 64
#: Largest ``jitter`` setting: an ejection lasts less than 10 % longer than its doubled time.
MAX_JITTER = 0.1

OK = "ok"
EJECTED = "ejected"
HALF_OPEN = "half-open"

#: The number of a slice that holds nothing yet (its counts are 0 anyway).
_NO_SLICE = -(1 << 62)
_COUNTS = ("consecutive_failures", "min_requests", "reset_after_successes", "report_after_ejections",
           "max_targets")
_DURATIONS = ("window_s", "base_ejection_s", "max_ejection_s", "probe_timeout_s")


@dataclass(frozen=True, slots=True)
class OutlierSettings:
    """The rules' settings (module docstring). Units: counts, seconds, shares in [0, 1].

    Raises ValueError naming the field: a count below 1 (or not an int), a duration not finite
    and positive, ``max_ejection_s`` below ``base_ejection_s``, ``failure_rate`` outside
    (0, 1], ``jitter`` outside [0, MAX_JITTER]."""

    consecutive_failures: int = 5
    failure_rate: float = 0.5
    min_requests: int = 10
    window_s: float = 10.0
    base_ejection_s: float = 5.0
    max_ejection_s: float = 120.0
    jitter: float = 0.1
    probe_timeout_s: float = 30.0
    reset_after_successes: int = 20
    report_after_ejections: int = 3
    max_targets: int = 4096

    def __post_init__(self) -> None:
        for name in _COUNTS:
            count = getattr(self, name)
            if isinstance(count, bool) or not isinstance(count, int) or count < 1:
                raise ValueError(f"{name} must be an integer of at least 1, not {count!r}")
        for name in _DURATIONS:
            _check_real(name, getattr(self, name))
            if not 0 < getattr(self, name) < math.inf:
                raise ValueError(f"{name} must be a finite number of seconds above 0, not {getattr(self, name)!r}")
        if self.max_ejection_s < self.base_ejection_s:
            raise ValueError(f"max_ejection_s ({self.max_ejection_s}) must be at least base_ejection_s "
                             f"({self.base_ejection_s})")
        _check_real("failure_rate", self.failure_rate)
        if not 0 < self.failure_rate <= 1:
            raise ValueError(f"failure_rate must be a share in (0, 1], not {self.failure_rate!r}")
        _check_real("jitter", self.jitter)
        if not 0 <= self.jitter <= MAX_JITTER:
            raise ValueError(f"jitter must be in [0, {MAX_JITTER}], not {self.jitter!r}")

    def ejection_s(self, in_row: int, draw: float) -> float:
        """The length in s of the ``in_row``-th ejection in a row (1, 2, ...); ``draw`` in [0, 1)
        picks the jitter."""
        doubled = self.base_ejection_s * 2.0 ** min(max(in_row - 1, 0), MAX_DOUBLINGS)
        return min(doubled, self.max_ejection_s) * (1.0 + self.jitter * draw)


def _check_real(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int | float) or math.isnan(value):
        raise ValueError(f"{name} must be a number, not {value!r}")


def key_text(key: Hashable) -> str:
    """A target's key as text: the parts of a tuple joined by "/" ("node-b/qwen"), else str()."""
    if isinstance(key, tuple):
        return "/".join(str(part) for part in key)
    return str(key)


@dataclass(frozen=True, slots=True)
class Ejected:
    """``record`` ejected ``key`` for ``ejection_s`` s: its ``in_row``-th ejection in a row (k).
    ``report_unhealthy``: k has reached ``report_after_ejections`` (a local backend is then
    reported to the supervisor)."""

    key: Hashable
    reason: str
    ejection_s: float
    in_row: int
    report_unhealthy: bool

    @property
    def message(self) -> str:
        """One log line: "<key> ejected for 5.2 s (ejection 1 in a row): 5 consecutive failures"."""
        return f"{key_text(self.key)} ejected for {self.ejection_s:.1f} s (ejection {self.in_row} in a row): {self.reason}"


@dataclass(frozen=True, slots=True)
class Restored:
    """``record`` restored ``key`` after a successful probe; ``in_row`` (k) is kept until
    ``reset_after_successes`` successes in a row."""

    key: Hashable
    in_row: int

    @property
    def message(self) -> str:
        return f"{key_text(self.key)} restored after a successful probe (ejections in a row: {self.in_row})"


class _Target:
    """What is known of one target. The window: per slice, its number (``floor(now /
    slice_s)``) and its successes and failures; a slice whose number is stale counts nothing."""

    __slots__ = ("slice_ids", "successes", "failures", "last_at", "consecutive", "in_row", "streak",
                 "ejected_until", "probe_at", "reason")

    def __init__(self) -> None:
        self.slice_ids = [_NO_SLICE] * WINDOW_SLICES
        self.successes = [0] * WINDOW_SLICES
        self.failures = [0] * WINDOW_SLICES
        self.last_at = -math.inf      # monotonic s of the last outcome recorded
        self.consecutive = 0          # failures in a row
        self.in_row = 0               # k: ejections in a row
        self.streak = 0               # successes in a row since the last restore (while k > 0)
        self.ejected_until: float | None = None   # None: ok; else ejected until then, half-open after
        self.probe_at: float | None = None        # when the half-open probe was let through
        self.reason = ""              # why it was last ejected

    def count(self, ok: bool, now: float, slice_s: float) -> None:
        number = math.floor(now / slice_s)
        index = number % WINDOW_SLICES
        if self.slice_ids[index] != number:
            self.slice_ids[index] = number
            self.successes[index] = 0
            self.failures[index] = 0
        if ok:
            self.successes[index] += 1
        else:
            self.failures[index] += 1

    def totals(self, now: float, slice_s: float) -> tuple[int, int]:
        """(failures, outcomes) in the window that ends at ``now``."""
        number = math.floor(now / slice_s)
        failed = total = 0
        for index, slice_id in enumerate(self.slice_ids):
            if number - WINDOW_SLICES < slice_id <= number:
                failed += self.failures[index]
                total += self.failures[index] + self.successes[index]
        return failed, total

    def clear_counts(self) -> None:
        """Forget the window and the failures in a row (a restore)."""
        self.slice_ids = [_NO_SLICE] * WINDOW_SLICES
        self.successes = [0] * WINDOW_SLICES
        self.failures = [0] * WINDOW_SLICES
        self.consecutive = 0

    def state(self, now: float) -> str:
        if self.ejected_until is None:
            return OK
        return EJECTED if now < self.ejected_until else HALF_OPEN


class OutlierDetector:
    """The targets of one node and their outcomes (module docstring). Not thread-safe: one
    event loop calls it. ``rng`` draws the jitter (default: a ``random.Random`` seeded by the
    OS; tests pass a seeded one).

    Counters for /metrics (monotonic): ``ejections_total``, ``restores_total``,
    ``probes_total`` (probes let through by ``allow``), ``dropped_total`` (targets dropped to
    keep the table within ``max_targets``)."""

    def __init__(self, settings: OutlierSettings | None = None, rng: random.Random | None = None) -> None:
        self.settings = settings if settings is not None else OutlierSettings()
        self._rng = rng if rng is not None else random.Random()
        self._slice_s = self.settings.window_s / WINDOW_SLICES
        #: Ordered by the last outcome recorded, oldest first (``record`` moves a key to the end).
        self._targets: dict[Hashable, _Target] = {}
        self._next_sweep = -math.inf
        self.ejections_total = 0
        self.restores_total = 0
        self.probes_total = 0
        self.dropped_total = 0

    def __len__(self) -> int:
        """How many targets hold state."""
        return len(self._targets)

    def allow(self, key: Hashable, now: float) -> bool:
        """May a request go to ``key`` now? True for an unknown or ok target (one dict lookup, no
        allocation); False while ejected; half-open: True for the one probe (then False until an
        outcome is recorded or ``probe_timeout_s`` passed). Call it for the candidate the request
        is sent to: a True while half-open takes the probe. To filter candidates, use ``usable``."""
        target = self._targets.get(key)
        if target is None or target.ejected_until is None:
            return True
        if now < target.ejected_until:
            return False
        if target.probe_at is not None and now < target.probe_at + self.settings.probe_timeout_s:
            return False
        target.probe_at = now
        self.probes_total += 1
        return True

    def usable(self, key: Hashable, now: float) -> bool:
        """What ``allow`` would answer, without taking a half-open target's probe."""
        target = self._targets.get(key)
        if target is None or target.ejected_until is None:
            return True
        if now < target.ejected_until:
            return False
        return target.probe_at is None or now >= target.probe_at + self.settings.probe_timeout_s

    def state(self, key: Hashable, now: float) -> str:
        """"ok" (also for an unknown key), "ejected" or "half-open"."""
        target = self._targets.get(key)
        return OK if target is None else target.state(now)

    def ejected_in_row(self, key: Hashable) -> int:
        """k: the target's ejections in a row (0 for an unknown key)."""
        target = self._targets.get(key)
        return 0 if target is None else target.in_row

    def end_ejection(self, key: Hashable, now: float) -> None:
        """End ``key``'s ejection now: it is half-open (its next request is the probe), and its
        count of ejections in a row is kept. For a backend whose engine is being replaced (the
        respawn repeated ejections asked for): the new engine is tried once it is healthy, not
        after the rest of an ejection earned by the old one. Not ejected or unknown: nothing."""
        target = self._targets.get(key)
        if target is not None and target.ejected_until is not None and now < target.ejected_until:
            target.ejected_until = now
            target.probe_at = None

    def release(self, key: Hashable, now: float) -> None:
        """Half-open ``key``'s probe ended with no outcome to record (a client's 4xx): another
        may go at once, not after ``probe_timeout_s``. Otherwise nothing."""
        target = self._targets.get(key)
        if target is not None and target.ejected_until is not None and now >= target.ejected_until:
            target.probe_at = None

    def forget(self, key: Hashable) -> None:
        """Drop what is known of ``key`` (a backend removed, a peer gone); unknown keys are fine."""
        self._targets.pop(key, None)

    def record(self, key: Hashable, ok: bool, now: float) -> Ejected | Restored | None:
        """Count one outcome of a request sent to ``key``; the event when it changed the target's
        state (so the caller logs once per ejection), else None."""
        self._sweep(now)
        target = self._targets.pop(key, None)
        if target is None:
            target = self._make_room()
        self._targets[key] = target
        now = max(now, target.last_at)   # a clock that steps back must not reorder the window
        target.last_at = now
        settings = self.settings
        if target.ejected_until is not None:
            if now < target.ejected_until:
                target.count(ok, now, self._slice_s)
                return None
            target.probe_at = None
            if ok:
                target.ejected_until = None
                target.clear_counts()
                target.streak = 0
                self.restores_total += 1
                return Restored(key=key, in_row=target.in_row)
            target.count(False, now, self._slice_s)
            return self._eject(key, target, now, "probe failed")
        target.count(ok, now, self._slice_s)
        if ok:
            target.consecutive = 0
            if target.in_row:
                target.streak += 1
                if target.streak >= settings.reset_after_successes:
                    target.in_row = 0
                    target.streak = 0
        else:
            target.consecutive += 1
            target.streak = 0
            if target.consecutive >= settings.consecutive_failures:
                return self._eject(key, target, now, f"{target.consecutive} consecutive failures")
        if ok and not any(target.failures):  # no failure in the window: no rate to judge (failure_rate > 0)
            return None
        failed, total = target.totals(now, self._slice_s)
        if total >= settings.min_requests and failed >= settings.failure_rate * total:
            return self._eject(key, target, now, f"{failed} of {total} requests failed in {settings.window_s:g} s")
        return None

    def snapshot(self, now: float) -> list[dict[str, object]]:
        """The targets that hold state, for /v1/status, sorted by key: ``key`` (text),
        ``state``, ``ejected_in_row`` (k), ``ejected_remaining_s`` (0.0 unless ejected),
        ``reason`` (of the last ejection, "" if none), ``failures``, ``successes`` (in the window),
        ``consecutive_failures``."""
        self._sweep(now)
        rows: list[tuple[str, dict[str, object]]] = []
        for key, target in self._targets.items():
            failed, total = target.totals(now, self._slice_s)
            remaining = 0.0 if target.ejected_until is None else max(0.0, target.ejected_until - now)
            text = key_text(key)
            rows.append((text, {"key": text, "state": target.state(now), "ejected_in_row": target.in_row,
                                "ejected_remaining_s": round(remaining, 3), "reason": target.reason,
                                "failures": failed, "successes": total - failed,
                                "consecutive_failures": target.consecutive}))
        rows.sort(key=lambda row: row[0])
        return [row for _, row in rows]

    def counters(self) -> dict[str, int]:
        """The counters for /metrics, by name."""
        return {"ejections_total": self.ejections_total, "restores_total": self.restores_total,
                "probes_total": self.probes_total, "dropped_total": self.dropped_total}

    def _eject(self, key: Hashable, target: _Target, now: float, reason: str) -> Ejected:
        target.in_row += 1
        target.streak = 0
        target.consecutive = 0
        duration = self.settings.ejection_s(target.in_row, self._rng.random())
        target.ejected_until = now + duration
        target.probe_at = None
        target.reason = reason
        self.ejections_total += 1
        return Ejected(key=key, reason=reason, ejection_s=duration, in_row=target.in_row,
                       report_unhealthy=target.in_row >= self.settings.report_after_ejections)

    def _sweep(self, now: float) -> None:
        """Drop, at most once per ``window_s``, the targets that hold nothing worth keeping."""
        if now < self._next_sweep:
            return
        self._next_sweep = now + self.settings.window_s
        horizon = now - self.settings.window_s
        idle = [key for key, target in self._targets.items()
                if target.ejected_until is None and target.in_row == 0 and target.last_at <= horizon]
        for key in idle:
            del self._targets[key]

    def _make_room(self) -> _Target:
        """A fresh target, after dropping one when the table is full."""
        if len(self._targets) >= self.settings.max_targets:
            victim, rank = next(iter(self._targets)), 2    # rank 1: ok with k > 0; 2: not ok
            for key, target in self._targets.items():   # oldest first
                if target.ejected_until is None:
                    if target.in_row == 0:
                        victim = key
                        break
                    if rank == 2:
                        victim, rank = key, 1
            del self._targets[victim]
            self.dropped_total += 1
        return _Target()
