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
after a few :data:`WINDOW_S`. A counter that goes back (the engine restarted) starts over.
A model's speed is the mean over its healthy backends that have an estimate, per figure;
None when none has.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

from viiwork.engines.contract import TokenCounters

#: Time constant (s) of the exponentially weighted mean.
WINDOW_S = 60.0


@dataclass(slots=True)
class SpeedEstimate:
    """One backend's speeds (tokens/s, None until measured) and its last counters."""

    prefill_tps: float | None = None
    decode_tps: float | None = None
    _last: TokenCounters | None = None
    _last_at: float | None = None

    def update(self, tokens: TokenCounters | None, now: float) -> None:
        """Fold the reading ``tokens`` taken at ``now`` (monotonic s) into the means; None
        (the engine publishes none) keeps them as they are."""
        if tokens is None:
            return
        last, last_at = self._last, self._last_at
        self._last, self._last_at = tokens, now
        if last is None or last_at is None:
            return
        if tokens.prompt_tokens < last.prompt_tokens or tokens.decode_tokens < last.decode_tokens:
            return  # the engine restarted: this reading is the new baseline
        weight = 1.0 - math.exp(-max(0.0, now - last_at) / WINDOW_S)
        self.prefill_tps = _fold(self.prefill_tps, tokens.prompt_tokens - last.prompt_tokens,
                                 tokens.prompt_seconds - last.prompt_seconds, weight)
        self.decode_tps = _fold(self.decode_tps, tokens.decode_tokens - last.decode_tokens,
                                tokens.decode_seconds - last.decode_seconds, weight)

    def reset(self) -> None:
        """Forget everything (a new engine process)."""
        self.prefill_tps = self.decode_tps = None
        self._last = self._last_at = None


def _fold(mean: float | None, tokens: float, seconds: float, weight: float) -> float | None:
    if tokens <= 0 or seconds <= 0:
        return mean  # nothing measured in this interval
    speed = tokens / seconds
    return speed if mean is None else mean + weight * (speed - mean)


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
