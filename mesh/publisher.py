"""This node's own summaries: content, (generation, seq), signing, heartbeats.

A :class:`LocalPublisher` republishes with ``seq + 1`` whenever the content changed
(:meth:`LocalPublisher.set_local`) and at every call once 3/4 of ``heartbeat_ms`` passed
(so at least every ``heartbeat_ms`` when called every round; peers judge
liveness by seeing ``(generation, seq)`` increase), in the protocol version the membership
core asks for (:meth:`~viiwork.mesh.membership.Membership.emit_protocol`). When the core
has seen a genuine summary of this node from a previous run at or above the current
generation (``required_generation``), the publisher moves to that generation, stores it
(``store_generation``), and restarts seq at 1.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Iterable

from viiwork.mesh.boot import Boot
from viiwork.mesh.extensions import EMPTY as EMPTY_EXTENSIONS
from viiwork.mesh.extensions import REFUTED, ExtensionError, Extensions
from viiwork.mesh.load_record import LoadRecord, sign_load
from viiwork.mesh.membership import Membership
from viiwork.mesh.signing import Signer
from viiwork.mesh.summary import (
    EXTENSIONS_PROTOCOL,
    GpuCapacity,
    ModelCapacity,
    OversizedSummary,
    PublishedState,
    SignedSummary,
    SummaryPayload,
    sign_payload,
    state_for_protocol,
)

log = logging.getLogger(__name__)

HEARTBEAT_SLACK = 0.75


class LocalPublisher:
    """Builds and signs this node's summaries and hands them to ``membership``.

    ``name``: node name; ``api``/``mesh``: advertised ``host:port`` (``api`` may be "");
    ``version``: software version; ``boot``: this run's generation and nonce;
    ``store_generation(n)``: persists a generation raised by the core (None in simulations).
    """

    def __init__(self, membership: Membership, signer: Signer, name: str, api: str, mesh: str, version: str,
                 boot: Boot, heartbeat_ms: float, store_generation: Callable[[int], None] | None = None):
        self.membership = membership
        self.signer = signer
        self.name, self.api, self.mesh, self.version = name, api, mesh, version
        self.generation = boot.generation
        self.boot_nonce = boot.nonce
        self.heartbeat_ms = heartbeat_ms
        self.store_generation = store_generation
        self.seq = 0
        self.models: tuple[ModelCapacity, ...] = ()
        self.gpus: tuple[GpuCapacity, ...] = ()
        self.state = PublishedState.SERVING
        self.extensions: Extensions = EMPTY_EXTENSIONS  # published from protocol 4 on
        self.refuted: int | None = None  # REFUTED's value, within this generation (probe mode)
        self._changed = True
        self._last_protocol = 0
        self.last: SignedSummary | None = None
        self.last_load: LoadRecord | None = None  # the newest load record, while newer than ``last``

    def set_local(self, models: Iterable[ModelCapacity], state: PublishedState | str = PublishedState.SERVING,
                  gpus: Iterable[GpuCapacity] | None = None) -> None:
        """New content: published at the next :meth:`maybe_publish`. ``models`` are sorted by
        name; ``gpus`` None keeps the GPUs published so far."""
        models = tuple(sorted(models, key=lambda m: m.name))
        state = PublishedState(state)
        new_gpus = self.gpus if gpus is None else tuple(sorted(gpus, key=lambda g: g.index))
        if models != self.models or state is not self.state or new_gpus != self.gpus:
            self.models, self.state, self.gpus = models, state, new_gpus
            self._changed = True

    @property
    def pending(self) -> bool:
        """Content set since the last summary that only a new summary can carry."""
        return self._changed

    def publish_load(self, models: Iterable[ModelCapacity]) -> LoadRecord | None:
        """Publish a change of ``busy``/``waiting`` alone as a signed load record
        (:mod:`viiwork.mesh.load_record`) at ``seq + 1``, amending the last summary; the
        models are kept as the content of the next summary, which carries them in any case.
        None (nothing published) when only a summary can carry the change: none published
        yet, content pending, another generation or protocol due, or ``models`` differ from
        the last summary's in more than ``busy``/``waiting``."""
        models = tuple(sorted(models, key=lambda m: m.name))
        last, m = self.last, self.membership
        if (last is None or self._changed or m.required_generation > self.generation
                or m.emit_protocol() != self._last_protocol or len(models) != len(last.payload.models)
                or any(dataclasses.replace(a, busy=b.busy, waiting=b.waiting) != b
                       for a, b in zip(last.payload.models, models, strict=True))):
            return None
        self.seq += 1
        record = sign_load(m.mesh_id, self.signer.node_id, self.generation, self.seq, last.payload.seq, models,
                           self.signer.sign)
        self.models = models
        self.last_load = record
        return record

    def set_extensions(self, extensions: Extensions) -> None:
        """New ``ext`` fields (mesh/extensions.py: ``Extensions.of({SPEC: value})``), published
        at the next :meth:`maybe_publish` in protocol 4 and later; a summary in an older
        version (a peer speaks only that) leaves them out: its decoder would refuse ``ext``."""
        if extensions != self.extensions:
            self.extensions = extensions
            self._changed = True

    def refute(self) -> None:
        """Claims about this node at its current ``(generation, seq)`` or below are refuted:
        the next summary carries the ``refuted`` extension with this seq (mesh/extensions.py
        ``REFUTED``; docs/mesh.md, "Probe mode"), so a claim about an older version that
        arrives after it is taken for what it is, stale. Publish with ``force`` after it."""
        self.refuted = self.seq

    def _sign_refuting(self, payload: SummaryPayload) -> SignedSummary | None:
        """``payload`` signed with ``refuted`` added to its extensions, or None (counted
        ``refuted_left_out``) when that does not fit: the agent's extensions already fill
        MAX_EXTENSION_BYTES (the caps of those it publishes sum to more), or ``refuted`` tips
        the summary over MAX_SUMMARY_BYTES (the config's check bounds the models, not the
        extensions beside them). The caller then publishes without it: a newer version still
        refutes, only a claim made before it may be taken again. Raising, or publishing
        nothing, stopped every later summary of the generation and the node was declared dead
        (found by the attacker pass)."""
        assert self.refuted is not None
        try:
            extensions = payload.extensions.with_value(REFUTED, self.refuted)
            return sign_payload(dataclasses.replace(payload, extensions=extensions), self.signer.sign,
                                self.signer.certificate_der)
        except (ExtensionError, OversizedSummary):
            self.membership.counters.transport["refuted_left_out"] += 1
            return None

    def _sign(self, payload: SummaryPayload) -> SignedSummary | None:
        """The signed summary, or None (counted, logged once at WARNING, then DEBUG: it
        repeats every round while the content stays) when it is over MAX_SUMMARY_BYTES."""
        try:
            return sign_payload(payload, self.signer.sign, self.signer.certificate_der)
        except OversizedSummary as exc:
            counters = self.membership.counters.transport
            counters["summary_oversized"] += 1
            level = logging.WARNING if counters["summary_oversized"] == 1 else logging.DEBUG
            log.log(level, "mesh: %s (%d GPUs): not published%s", exc, len(payload.gpus),
                    "; retrying without the GPU list" if payload.gpus else "; peers keep the last summary")
            return None

    def maybe_publish(self, force: bool = False) -> SignedSummary | None:
        """Publish when the content changed, the heartbeat is due, the protocol version to
        speak changed, or the core demands a higher generation; returns the new summary or None."""
        m = self.membership
        protocol = m.emit_protocol()
        # A round that fires a little early (timers jitter) still heartbeats; otherwise every
        # early round would halve the heartbeat rate.
        due = self.last is None or m.clock() - m.self_published_at >= HEARTBEAT_SLACK * self.heartbeat_ms
        if m.required_generation > self.generation:
            self.generation = m.required_generation
            self.seq = 0
            self.refuted = None  # a new generation: claims about the old one are ignored anyway
            if self.store_generation is not None:
                self.store_generation(self.generation)
            due = True
        if not (force or due or self._changed or protocol != self._last_protocol):
            return None
        self.seq += 1
        models = self.models
        if protocol < 2:  # protocol 1 has no fingerprints
            models = tuple(dataclasses.replace(mdl, fingerprint=None) for mdl in models)
        payload = SummaryPayload(
            protocol=protocol, speaks=m.protocol, mesh_id=m.mesh_id, node_id=self.signer.node_id, name=self.name, api=self.api,
            mesh=self.mesh, version=self.version, generation=self.generation, boot=self.boot_nonce, seq=self.seq,
            state=state_for_protocol(self.state, protocol), models=models, gpus=self.gpus if protocol >= 2 else (),
            extensions=self.extensions if protocol >= EXTENSIONS_PROTOCOL else EMPTY_EXTENSIONS,
        )
        summary = None
        if self.refuted is not None and protocol >= EXTENSIONS_PROTOCOL:
            summary = self._sign_refuting(payload)
        if summary is None:
            summary = self._sign(payload)
        if summary is None and payload.gpus:
            # The config's models fit (agent/config/schema.py checks the largest summary they can
            # make); the host's GPUs are not in that bound: publish without them.
            summary = self._sign(dataclasses.replace(payload, gpus=()))
        if summary is None:  # peers keep the last summary; it is dead after dead_after_ms
            self.seq -= 1
            return None
        m.publish(summary)
        self.last_load = None
        self._changed = False
        self._last_protocol = protocol
        self.last = summary
        return summary
