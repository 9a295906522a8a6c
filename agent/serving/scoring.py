"""Predicted time to first token of one request on each candidate backend (docs/routing.md,
"Prefix-aware routing"). Pure: the router (agent/serving/router.py) builds the candidates
from its picture and applies the choice.

For a candidate (a local backend, or a peer for its model) with a free slot::

    predicted_ttft_s = rtt_s + busy / slots * service_s + uncached_tokens / prefill_tps

- ``rtt_s``: the round trip to a peer (0 here; an unmeasured RTT counts as :data:`UNKNOWN_RTT_MS`);
- ``busy / slots * service_s``: the wait its running requests impose, ``service_s`` the recent
  mean time a request of the model took on this node (:class:`ServiceTime`): a free slot runs
  at once, but the engine shares its compute with the busy ones;
- ``uncached_tokens``: the prompt's bytes beyond the blocks the candidate holds, at
  :data:`~viiwork.agent.serving.prefixes.BYTES_PER_TOKEN`; ``prefill_tps``: the candidate's
  measured prefill speed (agent/supervision/speeds.py, a peer's from its ``speeds``
  extension), the median of the known ones when it has none, :data:`DEFAULT_PREFILL_TPS`
  when nobody has. A faster engine gets proportionally more of the prompts that miss.

The **balance guard** keeps a hit from piling work onto one backend (the failure reported in
sglang#14305): a candidate is eligible only when its busy slots exceed the least busy
candidate's by at most ``guard_slots``; a candidate with no free slot is never one. A hit
counts when it holds at least ``min_blocks`` blocks. A peer that publishes no digests is
*unknown*: it is scored with no cached blocks (no credit, no penalty) and is never what makes
a request a hit. When no eligible candidate has a hit, :func:`choose` returns None and the
router's least-loaded rule decides.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from viiwork.agent.serving.prefixes import BLOCK_BYTES, BYTES_PER_TOKEN

DEFAULT_PREFILL_TPS = 1000.0  # tokens/s when no candidate has a measured speed (only ratios matter then)
UNKNOWN_RTT_MS = 5.0  # ms: a peer whose RTT is not measured yet
DEFAULT_SERVICE_S = 1.0  # s: a model's service time before one request of it ended here
SERVICE_WEIGHT = 0.2  # EWMA weight of one request's duration


@dataclass(frozen=True, slots=True)
class Candidate:
    """One place a request could run now: ``backend_id`` for a local backend (None: the peer
    ``node``), ``free`` and ``slots`` (busy = slots - free), ``rtt_ms`` (0 here, None
    unmeasured), ``prefill_tps`` (None unknown), ``blocks`` cached (None: the peer publishes no
    digests)."""

    node: str
    backend_id: str | None
    free: int
    slots: int
    rtt_ms: float | None
    prefill_tps: float | None
    blocks: int | None

    @property
    def busy(self) -> int:
        return max(0, self.slots - self.free)


@dataclass(frozen=True, slots=True)
class Guard:
    """The thresholds of the balance guard (``routing.prefix_guard_slots``,
    ``routing.prefix_min_blocks``; module doc)."""

    guard_slots: int = 2
    min_blocks: int = 1


@dataclass(frozen=True, slots=True)
class PrefixQuery:
    """What the router needs to score one request: its digests in wire form (``hex``, block 0
    first), ``prompt_bytes``, the blocks each local backend holds (``local_hits``), the model's
    ``service_s`` here and the ``guard``."""

    hex: tuple[str, ...]
    prompt_bytes: int
    local_hits: Mapping[str, int] = field(default_factory=dict)
    service_s: float = DEFAULT_SERVICE_S
    guard: Guard = Guard()


@dataclass(frozen=True, slots=True)
class Scored:
    candidate: Candidate
    ttft_s: float


def predicted_ttft_s(c: Candidate, prompt_bytes: int, service_s: float, prefill_tps: float) -> float:
    """The module doc's formula for ``c`` (``prefill_tps``: the speed to use when ``c`` has none)."""
    rtt_ms = 0.0 if c.backend_id is not None else (UNKNOWN_RTT_MS if c.rtt_ms is None else c.rtt_ms)
    wait_s = (c.busy / c.slots) * service_s if c.slots > 0 else 0.0
    uncached = max(0, prompt_bytes - (c.blocks or 0) * BLOCK_BYTES) / BYTES_PER_TOKEN
    tps = c.prefill_tps if c.prefill_tps is not None and c.prefill_tps > 0 else prefill_tps
    return rtt_ms / 1000.0 + wait_s + uncached / tps


def choose(candidates: Sequence[Candidate], prompt_bytes: int, service_s: float, guard: Guard) -> Scored | None:
    """The eligible candidate with the smallest predicted TTFT, when an eligible one has a hit
    (at least ``guard.min_blocks``); None otherwise (the router's least-loaded rule decides).
    Ties: local before a peer, then more free slots."""
    free = [(c, c.busy) for c in candidates if c.free > 0]
    if not free:
        return None
    least = min(busy for _, busy in free)
    eligible = [c for c, busy in free if busy - least <= guard.guard_slots]
    if not any((c.blocks or 0) >= guard.min_blocks for c in eligible):
        return None
    known = sorted(c.prefill_tps for c in eligible if c.prefill_tps is not None and c.prefill_tps > 0)
    fallback = _median(known) if known else DEFAULT_PREFILL_TPS
    best: Scored | None = None
    best_key: tuple[float, int, int] = (math.inf, 0, 0)
    for c in eligible:
        t = predicted_ttft_s(c, prompt_bytes, service_s, fallback)
        key = (t, 0 if c.backend_id is not None else 1, -c.free)
        if key < best_key:
            best, best_key = Scored(c, t), key
    return best


def guarded_blocks(candidates: Sequence[Candidate], guard: Guard) -> int:
    """The most blocks a candidate with a free slot holds that the balance guard left out (busier
    than the least busy by more than ``guard_slots``), 0 when none: a hit declined, shown in the
    route (``least-loaded guarded=N``) when nothing within the guard holds one."""
    free = [c for c in candidates if c.free > 0]
    if not free:
        return 0
    least = min(c.busy for c in free)
    return max(((c.blocks or 0) for c in free
                if c.busy - least > guard.guard_slots and (c.blocks or 0) >= guard.min_blocks), default=0)


def _median(ordered: Sequence[float]) -> float:
    mid = len(ordered) // 2
    return ordered[mid] if len(ordered) % 2 else (ordered[mid - 1] + ordered[mid]) / 2


class ServiceTime:
    """A model's recent mean service time on this node (s): an EWMA of the duration of the
    requests that ran here (weight :data:`SERVICE_WEIGHT`), :data:`DEFAULT_SERVICE_S` until one
    ended."""

    def __init__(self) -> None:
        self.mean_s: float | None = None

    def add(self, seconds: float) -> None:
        if seconds < 0 or not math.isfinite(seconds):
            return
        self.mean_s = seconds if self.mean_s is None else self.mean_s + SERVICE_WEIGHT * (seconds - self.mean_s)

    @property
    def value_s(self) -> float:
        return DEFAULT_SERVICE_S if self.mean_s is None else self.mean_s


__all__ = ["Candidate", "Guard", "PrefixQuery", "Scored", "ServiceTime", "choose", "predicted_ttft_s"]
