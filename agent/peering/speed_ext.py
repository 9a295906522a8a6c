"""This node's speeds as the ``speeds`` v1 extension of its capacity summary (docs/mesh.md, "Extensions").

:class:`SpeedPublisher` turns the models' measured speeds (``ModelRuntime.speed``:
agent/supervision/speeds.py) into ``Extensions.of({SPEEDS: ...})`` and says when they should
be published again: when a model's speeds appear or go, or when a figure moves by more than
:data:`STEP_FRACTION` of the published value and at least :data:`STEP_MIN_TPS` tokens/s. Small
moves are not worth a new summary: ``MeshNode.set_local_extensions`` publishes at once (a new
``seq``, gossiped to every peer), and a measured speed wobbles by a few percent.

Wire values: a measured figure is at least 1 (a speed that rounds to 0 is published as 1);
0 means "not measured" (an embedding model generates nothing, so its ``decode_tps`` is 0).
A model without either figure is left out; no model at all: no extension.
"""

from __future__ import annotations

from collections.abc import Iterable

from viiwork.agent.supervision.backends import ModelRuntime
from viiwork.mesh.extensions import EMPTY, SPEEDS, Extensions, ModelSpeed, Speeds, fits

STEP_FRACTION = 0.10
STEP_MIN_TPS = 2


def _wire(value: int | None) -> int:
    return 0 if value is None else max(1, value)


def speeds_of(runtimes: Iterable[ModelRuntime]) -> Speeds:
    """The ``speeds`` value for ``runtimes`` (models without a measured figure left out; the
    models last by name left out too when all of them do not fit the extension's cap: peers
    then score those on load alone, as a peer that publishes no speed)."""
    out = []
    for rt in sorted(runtimes, key=lambda r: r.name):
        speed = rt.speed()
        if speed is not None:
            out.append(ModelSpeed(rt.name, _wire(speed.prefill_tps), _wire(speed.decode_tps)))
    while out and not fits(SPEEDS, Speeds(tuple(out))):
        out.pop()
    return Speeds(tuple(out))


def moved(published: Speeds, new: Speeds) -> bool:
    """Is ``new`` worth publishing over ``published``? (module doc: the step)"""
    if [s.model for s in published.models] != [s.model for s in new.models]:
        return True
    for old, cur in zip(published.models, new.models, strict=True):
        for a, b in ((old.prefill_tps, cur.prefill_tps), (old.decode_tps, cur.decode_tps)):
            if (a == 0) != (b == 0):
                return True
            if abs(b - a) > max(STEP_MIN_TPS, STEP_FRACTION * a):
                return True
    return False


class SpeedPublisher:
    """The speeds published last; :meth:`update` returns the extensions to publish, or None
    when the change is below the step."""

    def __init__(self) -> None:
        self.published = Speeds(())

    def update(self, runtimes: Iterable[ModelRuntime]) -> Extensions | None:
        new = speeds_of(runtimes)
        if not moved(self.published, new):
            return None
        self.published = new
        return Extensions.of({SPEEDS: new}) if new.models else EMPTY
