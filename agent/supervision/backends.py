"""The runtime picture of a node's models and backends, shared by supervisor and routing.

The supervisor writes these objects (state, load, pid); routing reads them and counts its
own in-flight requests. Single-threaded (the agent's event loop): no locks.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Collection
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any, NewType, Protocol

from viiwork.agent.config.schema import ModelConfig
from viiwork.agent.supervision.runners.base import NftTable, RunHandle
from viiwork.agent.supervision.speeds import ModelSpeed, SpeedEstimate, model_speed
from viiwork.engines.contract import BackendSpec, Engine, LaunchCommand, Load, served_endpoints
from viiwork.mesh.extensions import GangMember

BackendId = NewType("BackendId", str)


class BackendState(StrEnum):
    """The health ladder of docs/architecture.md, "A backend's life"."""

    STARTING = "starting"      # launched, probes expected to fail until ready
    HEALTHY = "healthy"        # ready and admitting
    DRAINING = "draining"      # ready but admitting nothing new (respawn, down, shutdown)
    UNHEALTHY = "unhealthy"    # failed probes or exited; respawn pending
    STOPPED = "stopped"        # stopped on purpose (down, shutdown)
    DEAD = "dead"              # respawn budget spent; `viiworkctl up` revives


class ModelState(StrEnum):
    RUNNING = "running"   # backends are started or starting
    DOWN = "down"         # parked by the operator
    DEAD = "dead"         # every backend is dead


@dataclass(eq=False)
class Backend:
    """One engine process serving one model on this node.

    ``in_flight`` is routing's own count of requests it sent and has not finished; the
    engine's ``load`` lags behind it. ``load`` is None until the first successful read.
    Times are ``time.monotonic()`` seconds; ``None`` means never.
    """

    id: BackendId
    model: str
    index: int
    gpus: tuple[str, ...] = ()
    state: BackendState = BackendState.STARTING
    phase: str = ""
    progress: float = -1.0
    reason: str = ""
    port: int | None = None
    pid: int | None = None
    unit: str | None = None
    respawns: int = 0
    exit_result: str | None = None
    exit_status: int | None = None
    load: Load | None = None
    load_at: float | None = None
    load_stale: bool = False
    in_flight: int = 0
    released_at: float | None = None  # when routing last finished a request here
    last_success_at: float | None = None  # when a request here last ended well (note_success)
    started_at: float | None = None
    healthy_since: float | None = None
    parallel: int = 1
    # The engine's per-backend key (agent/supervision/engine_keys.py): sent only to this backend, never
    # shown (repr, /v1/status, logs).
    api_key: str | None = field(default=None, repr=False)
    # The Unix socket the engine listens on instead of ``port`` (engines that bind one).
    socket_path: str | None = None
    # Outlier ejection (agent/serving/ejections.py): routing sends it no new request while
    # set (ejected, or its half-open probe in flight); the health ladder does not read it.
    ejected: bool = False
    # Prefill/decode speed from the engine's token counters (agent/supervision/speeds.py).
    speed: SpeedEstimate = field(default_factory=SpeedEstimate)

    @property
    def base_url(self) -> str:
        # A socket backend is reached through an aiohttp.UnixConnector: the host is a label.
        return "http://localhost" if self.socket_path else f"http://127.0.0.1:{self.port}"

    @property
    def admitting(self) -> bool:
        return self.state is BackendState.HEALTHY and (self.port is not None or self.socket_path is not None)

    @property
    def slots(self) -> int:
        """Sequences this backend admits: what the engine reports, else ``parallel``."""
        if self.load is not None and not self.load_stale:
            return self.load.slots
        return self.parallel

    @property
    def free_slots(self) -> int:
        """Slots a new request may take now: 0 unless admitting and not ``ejected``."""
        if not self.admitting or self.ejected:
            return 0
        return max(0, self.slots - self.in_flight)

    @property
    def spare_slots(self) -> int:
        """``free_slots`` as if the backend were not ejected (the router's fallback when every
        backend of a model is ejected: agent/serving/router.py)."""
        if not self.admitting:
            return 0
        return max(0, self.slots - self.in_flight)

    def end_request(self) -> None:
        """A request routing sent here ended (or a slot kept for an offer was freed)."""
        self.in_flight -= 1
        self.released_at = time.monotonic()

    def note_success(self, now: float | None = None) -> None:
        """A request routing sent here was answered well (a 2xx or 3xx; a client's 4xx is not):
        ``last_success_at`` becomes ``now`` (monotonic s; None: the clock now). The health
        ladder counts it as a good probe (``health.success_counts_as_probe_s``)."""
        self.last_success_at = time.monotonic() if now is None else now

    @property
    def waiting(self) -> int | None:
        """Requests queued inside the engine, or None when unknown (not published, never
        read, or the reading is stale: an old figure would be gossiped as fact)."""
        if self.load is not None and not self.load_stale:
            return self.load.waiting
        return None

    @property
    def busy(self) -> int:
        """Busy sequences: the larger of the engine's count and our own in-flight count, but
        only our own once a request ended after the engine's count was read: that figure
        (read every ``supervisor.load_poll_interval_s``) still counts the ended request, and
        published as is it would show the freed slot busy to every peer until the next read."""
        if self.load is not None and not self.load_stale:
            if self.released_at is not None and self.load_at is not None and self.released_at > self.load_at:
                return self.in_flight
            return max(self.load.busy, self.in_flight)
        return self.in_flight


@dataclass(frozen=True, slots=True)
class Capacity:
    """One model's capacity on this node now, summed over its backends (``ModelRuntime.capacity``).

    ``slots``, ``busy``, ``free``: sums over the admitting (healthy, addressed) backends that
    are not ejected (outlier ejection, agent/serving/ejections.py), each
    backend's figures as ``Backend.slots``/``busy``/``free_slots`` give them (a stale load
    reading falls back to ``parallel`` and routing's in-flight count). ``waiting``: the sum of
    the engines' queues, or None when no backend admits or any admitting backend's queue is
    unknown (never published, or the reading is stale). ``in_flight``: routing's requests
    running on any backend (a draining one too). ``healthy``/``total``: admitting backends
    not ejected / all backends. ``free_by_backend``: (backend id, free slots) for every
    backend, in order (0 for an ejected one). ``ejected``: (backend id, ``spare_slots``) for
    each admitting backend that is ejected, in order (usually empty).
    """

    slots: int
    busy: int
    free: int
    waiting: int | None
    in_flight: int
    healthy: int
    total: int
    free_by_backend: tuple[tuple[BackendId, int], ...]
    ejected: tuple[tuple[BackendId, int], ...] = ()


class GangLauncher(Protocol):
    """What a backend's launch asks of its gang (agent/gang/head.py ``GangHead``): ``prepare``
    brings the other parts up and returns the serving engine's command (raises on failure),
    ``watch`` wraps the engine's handle so it ends with the gang, ``abort`` stops the parts; ``labels``
    are what the engine's unit records of its gang, ``adopt`` takes the gang of an engine left running
    by an earlier agent (raises when it cannot); ``membership`` is this head's entry of the
    summary's ``gangs`` extension (None without a current gang); ``away`` says why the gang
    cannot serve now nor soon (a worker host gone), else None. ``server_firewall``: after
    ``prepare``, the nftables table the serving engine's unit owns (an SGLang head's rendezvous
    ports: agent/gang/firewall.py), or None."""

    server_firewall: NftTable | None

    async def prepare(self, spec: BackendSpec) -> LaunchCommand: ...

    def watch(self, handle: RunHandle) -> RunHandle: ...

    async def abort(self) -> None: ...

    def labels(self) -> dict[str, str]: ...

    async def adopt(self, labels: dict[str, str], parts: list[RunHandle]) -> None: ...

    def status(self) -> dict[str, Any]: ...

    def membership(self) -> GangMember | None: ...

    def away(self) -> str | None: ...


@dataclass(eq=False)
class ModelRuntime:
    """One configured model on this node: its config, engine and backends.

    ``listeners`` are called (synchronously, must not block) whenever a backend's state or
    capacity changes, so routing can dispatch queued requests at once.
    """

    config: ModelConfig
    engine: Engine
    backends: list[Backend] = field(default_factory=list)
    state: ModelState = ModelState.RUNNING
    listeners: list[Callable[[ModelRuntime], None]] = field(default_factory=list)
    # A gang's head (agent/gang/head.py): its parts come up before the backend's launch.
    gang: GangLauncher | None = None
    _endpoints: tuple[ModelConfig, Engine, frozenset[str]] | None = field(default=None, init=False, repr=False)

    @property
    def name(self) -> str:
        return self.config.name

    @property
    def endpoints(self) -> frozenset[str]:
        """The endpoint names its backends serve (``served_endpoints`` of its engine, kind and
        args: engines/contract.py), read per request by the router."""
        cached = self._endpoints
        if cached is None or cached[0] is not self.config or cached[1] is not self.engine:  # a reload
            served = served_endpoints(self.engine, self.config.kind, tuple(self.config.args))
            cached = self._endpoints = (self.config, self.engine, frozenset(e.value for e in served))
        return cached[2]

    def notify(self) -> None:
        for listener in list(self.listeners):
            listener(self)

    @property
    def healthy_backends(self) -> list[Backend]:
        return [b for b in self.backends if b.admitting]

    def most_free(self) -> Backend | None:
        """The backend with the most free slots (``Backend.free_slots``; the first of equals
        in ``backends`` order), or None when no backend has a free slot. Runs per request:
        one pass, nothing allocated."""
        best: Backend | None = None
        best_free = 0
        for b in self.backends:
            free = b.free_slots
            if free > best_free:
                best, best_free = b, free
        return best

    def most_free_outside(self, avoid: Collection[str]) -> Backend | None:
        """``most_free`` among the backends whose id is not in ``avoid`` (those a request
        already failed on); when none of them is admitting and not ejected, the ejected one
        with the most spare slots (an ejection never takes a model's last backends away:
        docs/routing.md, "Outlier ejection"); else None. Off the hot path: called when
        ``most_free`` found nothing, or found a backend in ``avoid``."""
        best: Backend | None = None
        best_free = 0
        usable = False
        for b in self.backends:
            if b.id in avoid or not b.admitting:
                continue
            usable = usable or not b.ejected
            free = b.free_slots
            if free > best_free:
                best, best_free = b, free
        if best is not None or usable:
            return best
        for b in self.backends:
            if b.id not in avoid and b.spare_slots > best_free:
                best, best_free = b, b.spare_slots
        return best

    def healthy_outside(self, avoid: Collection[str]) -> bool:
        """Is a backend whose id is not in ``avoid`` admitting (ejected or not)?"""
        return any(b.admitting and b.id not in avoid for b in self.backends)

    def capacity(self, with_ejected: bool = False) -> Capacity:
        """The one sum of this model's backends, read by /v1/status, /metrics, routing's
        local view and the gossiped summary alike (docs/architecture.md, "A backend's life").
        ``with_ejected``: count ejected backends as if they were not (the summary of a node
        whose model no peer offers otherwise: agent/peering/mesh_link.py)."""
        admitting = [b for b in self.backends if b.admitting and (with_ejected or not b.ejected)]
        queues = [b.waiting for b in admitting]
        known = [q for q in queues if q is not None]
        return Capacity(
            slots=sum(b.slots for b in admitting),
            busy=sum(b.busy for b in admitting),
            free=sum(b.spare_slots if with_ejected else b.free_slots for b in admitting),
            waiting=sum(known) if admitting and len(known) == len(queues) else None,
            in_flight=sum(b.in_flight for b in self.backends),
            healthy=len(admitting),
            total=len(self.backends),
            free_by_backend=tuple((b.id, b.free_slots) for b in self.backends),
            ejected=tuple((b.id, b.spare_slots) for b in self.backends if b.ejected and b.admitting),
        )

    def speed(self) -> ModelSpeed | None:
        """Prefill and decode speed (tokens/s): the mean over the healthy backends that have
        measured one (agent/supervision/speeds.py); None when none has."""
        return model_speed(b.speed for b in self.healthy_backends)

    def status_doc(self) -> dict[str, Any]:
        """This model in /v1/status. Keys: name, engine, kind, state, slots, busy and waiting
        (``capacity()``), ctx_per_slot, speed (``{"prefill_tps", "decode_tps"}``, integers or
        null each, or null when unknown: :meth:`speed`), backends (id, state, phase, progress (0..1 or -1),
        reason, pid, port (None for a socket backend), socket (its Unix socket path, else
        None), unit, respawns, gpus, exit_result, exit_status, load_stale, slots, busy,
        in_flight: routing's own count of requests running there, ejected: routing sends it
        nothing new (outlier ejection; details in /v1/status "outliers"))."""
        cap = self.capacity()
        return {
            "name": self.name,
            "engine": self.config.engine,
            "kind": str(self.config.kind),
            "state": str(self.state),
            "slots": cap.slots,
            "busy": cap.busy,
            "waiting": cap.waiting,
            "ctx_per_slot": self.ctx_per_slot,
            "speed": None if (speed := self.speed()) is None else speed.doc(),
            "backends": [
                {
                    "id": b.id,
                    "state": str(b.state),
                    "phase": b.phase,
                    "progress": b.progress,
                    "reason": b.reason,
                    "pid": b.pid,
                    "port": b.port,
                    "socket": b.socket_path,
                    "unit": b.unit,
                    "respawns": b.respawns,
                    "gpus": list(b.gpus),
                    "exit_result": b.exit_result,
                    "exit_status": b.exit_status,
                    "load_stale": b.load_stale,
                    "slots": b.slots,
                    "busy": b.busy,
                    "in_flight": b.in_flight,
                    "ejected": b.ejected,
                }
                for b in self.backends
            ],
        }

    @property
    def can_ever_serve(self) -> bool:
        """False when nothing on this node can serve now or later (down, all dead, or a gang
        whose worker host is gone: ``GangLauncher.away``)."""
        if self.state is not ModelState.RUNNING:
            return False
        if self.gang is not None and self.gang.away() is not None:
            return False
        return any(b.state is not BackendState.DEAD and b.state is not BackendState.STOPPED for b in self.backends)

    @property
    def ctx_per_slot(self) -> int:
        for b in self.backends:
            if b.load is not None:
                return b.load.ctx_per_slot
        return self.config.ctx_per_slot


def monotonic() -> float:
    return time.monotonic()
