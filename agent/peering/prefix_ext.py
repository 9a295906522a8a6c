"""This node's recent prompt prefixes as the ``prefixes`` v1 extension of its capacity summary
(docs/mesh.md, "Extensions"; docs/routing.md, "Prefix-aware routing").

What is published: per model, the digests of :meth:`PrefixRouting.published`
(agent/serving/prefix_routing.py): blocks 0, 1, 3, 7, ... and the last of each prompt served
here, the most recent kept, at most :data:`~viiwork.mesh.extensions.MAX_PREFIXES_PER_MODEL`
(64) a model and at most :func:`per_model_limit` so that every model fits the extension's cap
(4 KiB: 19 bytes a digest with its quotes and comma), fewer when long model names take more
of the cap (the encoded value is checked against it). When: when they changed, and at most
once every :data:`PUBLISH_MIN_S` seconds, since ``MeshNode.set_local_extensions`` signs and
gossips a new summary at once: a node serving ten requests a second publishes one change
every few seconds, not ten a second.
"""

from __future__ import annotations

from collections.abc import Callable

from viiwork.agent.serving.prefix_routing import PrefixRouting
from viiwork.mesh.extensions import MAX_PREFIXES_PER_MODEL, PREFIXES, ModelPrefixes, Prefixes, fits

PUBLISH_MIN_S = 3.0
DIGEST_WIRE_BYTES = 19  # '"0123456789abcdef",'
MODEL_OVERHEAD_BYTES = 8 + 64  # '"name":[]' and a model name up to 64 characters


def per_model_limit(models: int, cap_bytes: int = PREFIXES.cap_bytes) -> int:
    """Digests a model may publish when ``models`` models publish: at most 64, and all of them
    within ``cap_bytes``."""
    if models <= 0:
        return MAX_PREFIXES_PER_MODEL
    return max(0, min(MAX_PREFIXES_PER_MODEL, (cap_bytes // models - MODEL_OVERHEAD_BYTES) // DIGEST_WIRE_BYTES))


class PrefixPublisher:
    """Decides when to publish: :meth:`update` returns the new value (an empty ``Prefixes``
    when nothing is left to publish) or None (nothing changed, or too soon). ``clock``:
    monotonic seconds."""

    def __init__(self, prefixes: PrefixRouting, clock: Callable[[], float]) -> None:
        self.prefixes = prefixes
        self.clock = clock
        self._version: object = None
        self._at: float | None = None
        self.published = Prefixes(())

    def update(self) -> Prefixes | None:
        version = self.prefixes.version()
        if version == self._version:
            return None
        now = self.clock()
        if self._at is not None and now - self._at < PUBLISH_MIN_S:
            return None
        self._version = version
        digests = self.prefixes.published()
        limit = per_model_limit(len(digests))
        while True:  # long model names take more of the cap than the estimate allows for
            value = Prefixes(tuple(ModelPrefixes(model, d[-limit:]) for model, d in sorted(digests.items()) if limit))
            if limit == 0 or fits(PREFIXES, value):
                break
            limit -= 1
        if value == self.published:
            return None
        self.published, self._at = value, now
        return value


__all__ = ["PUBLISH_MIN_S", "PrefixPublisher", "per_model_limit"]
