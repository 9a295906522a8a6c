"""This node's prefill and decode speed per model, tokens/s, from the engines' token counters.

Source: each load read (agent/supervision/load.py) may carry the engine's cumulative
:class:`~viiwork.engines.contract.TokenCounters` (llama.cpp and vLLM publish them; SGLang's
adapter reads none, so its speed stays unknown). Two readings give a backend's speed over
the interval: ``Δprompt_tokens / Δprompt_seconds`` and ``Δdecode_tokens / Δdecode_seconds``,
seconds the engine itself spent on that work, so an idle interval says nothing (no tokens:
the estimate stays) and the agent's own timing never enters. Why the engines' counters and
not the answers the agent sees: the counters split prefill from decode the way the engine
measured them, and they cover requests a peer forwarded here as well.

Each backend keeps an exponentially weighted mean of those interval speeds, the weight of a
new interval ``1 - exp(-Δt / WINDOW_S)`` (Δt the wall time between the readings, so a reading
every second and one every ten weigh the same per minute): a change of speed shows fully
after a few :data:`WINDOW_S`. A counter that goes back (the engine restarted) starts over. An interval in which only the
tokens or only the seconds moved goes on until both have (vLLM adds a request's prefill and
decode seconds when the request ends, its tokens as they are made).

The figures are per sequence (what one request sees): both engines sum the time each
sequence spent, so two sequences decoding at once count twice the seconds.
A model's speed is the mean over its healthy backends that have an estimate, per figure;
None when none has.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, field

from viiwork.engines.contract import TokenCounters

#: Time constant (s) of the exponentially weighted mean.
WINDOW_S = 60.0


@dataclass(slots=True)
class _Figure:
    """One figure's mean (tokens/s, None until measured) and the reading its next interval
    starts from: ``(tokens, seconds, at)``."""

    mean: float | None = None
    base: tuple[float, float, float] | None = None

    def update(self, tokens: float, seconds: float, at: float) -> None:
        base = self.base
        if base is None or tokens < base[0] or seconds < base[1]:
            self.base = (tokens, seconds, at)  # the first reading, or the engine restarted: a new baseline
            return
        d_tokens, d_seconds = tokens - base[0], seconds - base[1]
        if d_tokens > 0 and d_seconds > 0:
            speed = d_tokens / d_seconds
            weight = 1.0 - math.exp(-max(0.0, at - base[2]) / WINDOW_S)
            self.mean = speed if self.mean is None else self.mean + weight * (speed - self.mean)
            self.base = (tokens, seconds, at)
        elif d_tokens <= 0 and d_seconds <= 0:
            self.base = (tokens, seconds, at)  # idle: nothing measured, nothing pending
        # else only one of them moved (vLLM adds a request's seconds when it ends, its tokens
        # as they are made): the interval goes on until both have.


@dataclass(slots=True)
class SpeedEstimate:
    """One backend's speeds: ``prefill_tps`` and ``decode_tps`` (tokens/s, None until
    measured), each from its own pair of counters."""

    _prefill: _Figure = field(default_factory=_Figure)
    _decode: _Figure = field(default_factory=_Figure)

    @classmethod
    def of(cls, prefill_tps: float | None, decode_tps: float | None) -> SpeedEstimate:
        """An estimate holding these means (tests, and a node that knows them already)."""
        return cls(_Figure(prefill_tps), _Figure(decode_tps))

    @property
    def prefill_tps(self) -> float | None:
        return self._prefill.mean

    @property
    def decode_tps(self) -> float | None:
        return self._decode.mean

    def update(self, tokens: TokenCounters | None, now: float) -> None:
        """Fold the reading ``tokens`` taken at ``now`` (monotonic s) into the means; None
        (the engine publishes none) keeps them as they are."""
        if tokens is None:
            return
        self._prefill.update(tokens.prompt_tokens, tokens.prompt_seconds, now)
        self._decode.update(tokens.decode_tokens, tokens.decode_seconds, now)

    def reset(self) -> None:
        """Forget everything (a new engine process)."""
        self._prefill, self._decode = _Figure(), _Figure()


@dataclass(frozen=True, slots=True)
class ModelSpeed:
    """A model's speeds on this node, tokens/s rounded to integers; None when unknown."""

    prefill_tps: int | None
    decode_tps: int | None

    def doc(self) -> dict[str, int | None]:
        return {"prefill_tps": self.prefill_tps, "decode_tps": self.decode_tps}


def model_speed(estimates: Iterable[SpeedEstimate]) -> ModelSpeed | None:
    """The mean over ``estimates`` (a model's healthy backends), per figure; None when no
    backend has either figure."""
    estimates = list(estimates)
    prefill = [e.prefill_tps for e in estimates if e.prefill_tps is not None]
    decode = [e.decode_tps for e in estimates if e.decode_tps is not None]
    if not prefill and not decode:
        return None
    return ModelSpeed(round(sum(prefill) / len(prefill)) if prefill else None,
                      round(sum(decode) / len(decode)) if decode else None)
