"""This node's endpoints as the ``endpoints`` v1 extension of its capacity summary (docs/mesh.md, "Extensions").

Each model's endpoints come from its engine's declaration (``ModelRuntime.endpoints``:
engines/contract.py ``served_endpoints``); peers route a request only to a node whose model
serves its endpoint (agent/serving/router.py). The value must stay within the extension's cap
(1 KiB, what a node from before the extension accepts): models whose engine and kind are alike
share one group, so this is a few hundred bytes on an ordinary node. When many long model names
do not fit, the models that do not fit are left out (their peers then assume the classic
endpoints for them: chat, completions, embeddings) and a WARNING says so once.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

from viiwork.agent.supervision.backends import ModelRuntime
from viiwork.mesh.extensions import ENDPOINTS, Endpoints, Extensions, ModelEndpoints

log = logging.getLogger(__name__)

_warned: set[tuple[str, ...]] = set()


def endpoints_of(runtimes: Iterable[ModelRuntime]) -> Endpoints | None:
    """The ``endpoints`` value for ``runtimes`` (sorted by model), without the models that would
    take it over its cap; None when there is no model."""
    models = [ModelEndpoints(rt.name, rt.endpoints) for rt in sorted(runtimes, key=lambda r: r.name)]
    left_out: list[str] = []
    while models:
        value = Endpoints(tuple(models))
        try:
            Extensions.of({ENDPOINTS: value})
        except ValueError:  # over the cap, or more groups than allowed: leave the last model out
            left_out.append(models.pop().model)
            continue
        if left_out and tuple(left_out) not in _warned:
            _warned.add(tuple(left_out))
            log.warning("the endpoints of %d model(s) do not fit in the capacity summary (%s); peers assume "
                        "the classic endpoints for them", len(left_out), ", ".join(sorted(left_out)))
        return value
    return None
