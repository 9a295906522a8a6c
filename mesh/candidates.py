"""Discovered addresses (seeds, mDNS) and when to dial each one: per-address backoff.

Pure (no I/O, no clock of its own): :class:`~viiwork.mesh.membership.Membership` keeps one
:class:`Candidate` per address that discovery produced (``mesh.seeds``, mDNS) and decides
each round which of them to dial (docs/mesh.md, "Seeds"):

- while **no peer is alive** (none alive or suspect), every candidate that is *due* is dialed
  in the same round, so the first round dials every seed at once: a live seed listed after
  hundreds of dead ones is reached in the first round, not after the dead ones;
- once a peer is alive, due candidates only fill the places the live peers leave free
  (``fanout``), and one due candidate is retried every ``reseed_every_rounds`` rounds.

A candidate is **due** when its backoff has elapsed. Each dial counts as a failure until
an answer comes (:meth:`Candidate.answered`, which resets the backoff); after ``n``
consecutive failures the next dial waits a random time in ``[d/2, d]`` with
``d = min(max_ms, min_ms * 2**(n-1))`` (1 s doubling to 60 s by default: :func:`backoff_ms`),
so 200 dead seeds cost about 200 / 45 s, 4-5 dials a second, once backed off. The caller
(the transport) dials concurrently with a bound and a short deadline, and reports each
outcome (:meth:`Candidate.failed`): the backoff then runs from the end of the dial.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass
from typing import Any

from viiwork.mesh.identity import NodeId

#: The longest ``last_error`` kept (characters).
MAX_ERROR_CHARS = 200
#: What ``last_error`` says when an address completed an exchange whose reply was dropped.
DROPPED_REPLY = "answered, but its reply was dropped (another mesh id or protocol: see counters.drops)"


def backoff_ms(failures: int, min_ms: float, max_ms: float, rng: random.Random) -> float:
    """Milliseconds to wait before the next dial after ``failures`` consecutive failures
    (0 for none): a random value in ``[d/2, d]``, ``d = min(max_ms, min_ms * 2**(failures-1))``."""
    if failures <= 0:
        return 0.0
    d = min(float(max_ms), float(min_ms) * 2.0 ** min(failures - 1, 40))
    return d * rng.uniform(0.5, 1.0)


@dataclass(slots=True)
class Candidate:
    """One discovered address. ``source``: "seed" or "mdns"; ``node_id``: the node there when
    known (an mDNS advertisement names it; a seed's is learned from its first answer).
    Times are the membership clock's milliseconds. ``attempts``: dials started;
    ``failures``: consecutive dials without an answer (the dial in flight included);
    ``next_try_at``: when it is due again; ``answered_at``: its last answer (None: never);
    ``last_error``: what the last failed dial met (None after an answer)."""

    node_id: NodeId | None
    source: str
    attempts: int = 0
    failures: int = 0
    next_try_at: float = -math.inf  # due at once (a clock may be negative: mesh/sim.py's skew)
    tried_at: float | None = None
    answered_at: float | None = None
    last_error: str | None = None

    def due(self, now: float) -> bool:
        return self.next_try_at <= now

    def dialed(self, now: float, wait_ms: float) -> None:
        """A dial starts now; until an answer it counts as a failure, due again after ``wait_ms``."""
        self.attempts += 1
        self.failures += 1
        self.tried_at = now
        self.next_try_at = now + wait_ms

    def answered(self, now: float) -> None:
        """The address answered an exchange: the backoff is reset."""
        self.failures = 0
        self.answered_at = now
        self.last_error = None
        self.next_try_at = now

    def answered_last_dial(self) -> bool:
        return self.answered_at is not None and self.tried_at is not None and self.answered_at >= self.tried_at

    def failed(self, now: float, error: str, wait_ms: float) -> None:
        """The dial ended without an answer (``error``: what it met): due again ``wait_ms`` from now."""
        self.last_error = error[:MAX_ERROR_CHARS]
        self.next_try_at = now + wait_ms

    def view(self, address: str, now: float) -> CandidateView:
        return CandidateView(address=address, source=self.source, node_id=self.node_id, attempts=self.attempts,
                             failures=self.failures, answered=self.answered_at is not None,
                             last_error=self.last_error, retry_in_ms=int(max(0.0, self.next_try_at - now)))


@dataclass(frozen=True)
class CandidateView:
    """One discovered address as :meth:`~viiwork.mesh.membership.Membership.candidate_views`
    shows it. ``answered``: ever completed an exchange; ``retry_in_ms``: until it is due
    (0: due now, or dialed only while no peer is alive or a place is free)."""

    address: str
    source: str
    node_id: NodeId | None
    attempts: int
    failures: int
    answered: bool
    last_error: str | None
    retry_in_ms: int

    def doc(self) -> dict[str, Any]:
        """The JSON form (``GET /v1/mesh`` ``seeds``): ``{"address", "node_id", "attempts",
        "failures", "answered", "last_error", "retry_in_ms"}``."""
        return {"address": self.address, "node_id": self.node_id, "attempts": self.attempts,
                "failures": self.failures, "answered": self.answered, "last_error": self.last_error,
                "retry_in_ms": self.retry_in_ms}


def unreachable_line(views: list[CandidateView], total: int, min_ms: float, max_ms: float,
                     shown: int = 3) -> str | None:
    """The one log line about seeds that did not answer their first dial (``views``: those
    seeds, ``total``: the seeds dialed; ``min_ms``/``max_ms``: the backoff), or None when
    every seed answered."""
    if not views:
        return None
    examples = ", ".join(f"{v.address} ({v.last_error or 'no answer'})" for v in views[:shown])
    more = f" and {len(views) - shown} more" if len(views) > shown else ""
    return (f"mesh: {len(views)} of {total} seeds did not answer: {examples}{more}; each is retried with "
            f"backoff ({min_ms / 1000:g} s doubling to {max_ms / 1000:g} s); GET /v1/mesh lists them under "
            "\"seeds\" (docs/mesh.md, \"Seeds\")")


__all__ = ["Candidate", "CandidateView", "backoff_ms", "unreachable_line"]
