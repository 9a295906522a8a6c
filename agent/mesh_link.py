"""The agent's side of the mesh: publish this node's capacity, route over peers, forward.

``MeshLink`` wires ``viiwork.mesh.MeshNode`` (identity, trust, discovery, gossip) to the
supervisor's models and to the pure router (``viiwork.agent.router``):

- the capacity summary is built from the local ``ModelRuntime``s on every gossip round;
- ``route`` gives the router a fresh picture of local backends and peers;
- forwarded requests travel over the mesh listener's mutual TLS (``session``), so the
  receiver knows the origin from its certificate;
- ``MeshWaitQueue`` is the origin's per-model FIFO: woken when a local slot frees, a
  forwarded request ends, or a fresher summary arrives (DESIGN §6).
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import os
import random
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import aiohttp

from viiwork import __version__
from viiwork.agent.backends import ModelRuntime
from viiwork.agent.config import Config
from viiwork.agent.gpus import GpuInventory
from viiwork.agent.router import Decision, LocalModel, PeerSnapshot, Reservations, Router, mesh_models
from viiwork.mesh.identity import NodeId
from viiwork.mesh.node import MeshNode, MeshSettings
from viiwork.mesh.summary import GpuCapacity, ModelCapacity, PublishedState

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class PeerTarget:
    """A peer's mesh listener as a forwarding target (``id`` for messages, ``base_url``)."""

    id: str
    base_url: str
    node_id: NodeId


class MeshWaitQueue:
    """The origin's FIFO of requests waiting for capacity anywhere, for one model.

    A waiter enters once and leaves when served, refused or timed out. ``wake`` lets every
    waiter route again; they resume in arrival order (the event loop runs woken tasks in
    the order they were woken), and a new arrival never overtakes a waiter.
    """

    def __init__(self) -> None:
        self._waiters: deque[asyncio.Event] = deque()

    def __len__(self) -> int:
        return len(self._waiters)

    def enter(self) -> asyncio.Event:
        event = asyncio.Event()
        self._waiters.append(event)
        return event

    def leave(self, event: asyncio.Event) -> None:
        try:
            self._waiters.remove(event)
        except ValueError:
            pass

    def wake(self) -> None:
        for event in self._waiters:
            event.set()


def gpu_capacities(inventory: GpuInventory) -> list[GpuCapacity]:
    """The GPUs to publish: index, name and memory in MiB (rounded down to 64 MiB so small
    fluctuations do not force a new summary); unknown stays None, never 0."""
    def mib(value: int | None) -> int | None:
        return None if value is None else (value // (1 << 20)) // 64 * 64
    return [GpuCapacity(index=g.index, name=(g.name or f"{g.vendor.value} GPU")[:128],
                        memory_total_mib=mib(g.memory_total_bytes), memory_free_mib=mib(g.memory_free_bytes))
            for g in inventory.gpus if not g.lost]


def model_fingerprint(path: str) -> str | None:
    """Identifies the weights across nodes: sha256 of the file name and size (paths differ
    between hosts; a different quantisation or revision differs in size); None if unknown."""
    try:
        size = os.stat(path).st_size
    except OSError:
        return None
    return hashlib.sha256(f"{os.path.basename(path)}:{size}".encode()).hexdigest()[:16]


class MeshLink:
    """This node in the mesh, seen from the agent (``start``/``stop`` around the API's life)."""

    def __init__(self, config: Config, runtimes: dict[str, ModelRuntime], *, draining: Any,
                 gpus: Callable[[], GpuInventory] | None = None, rng: random.Random | None = None) -> None:
        assert config.mesh is not None
        self.config = config
        self.runtimes = runtimes
        self.draining = draining  # callable: is the node draining?
        self.gpus = gpus  # callable: the latest GPU inventory (published with the capacity)
        self.rng = rng or random.Random()
        self.node = MeshNode(MeshSettings.from_config(config.mesh, config.node, config.api.listen, __version__),
                             provider=self._capacity, rng=random.Random(self.rng.random()))
        self.reservations = Reservations(clock=lambda: time.monotonic() * 1000.0)
        self.router: Router | None = None
        self.session: aiohttp.ClientSession | None = None
        self.queues: dict[str, MeshWaitQueue] = {}
        self._fingerprints: dict[str, str | None] = {}
        self.forwards_out = 0
        self.forwards_in = 0
        self.refusals_in = 0
        self.refusals_out = 0
        self._stopped = False

    async def start(self) -> None:
        """Start the mesh node (raises viiwork.mesh.node.MeshStartError naming the fix)."""
        await self.node.start()
        self.router = Router(self.node.node_id, self.config.node.name,
                             stale_after_ms=self.config.routing.stale_after_ms,
                             reservations=self.reservations, rng=random.Random(self.rng.random()))
        self.session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(ssl=self.node.client_ssl_context, limit=0, keepalive_timeout=30),
            auto_decompress=False,
            skip_auto_headers=("User-Agent", "Accept-Encoding"),
            timeout=aiohttp.ClientTimeout(total=None, sock_connect=2.0,
                                          sock_read=self.config.api.stream_idle_timeout_s),
        )
        self.node.subscribe(lambda _peer: self.wake_all())

    async def stop(self) -> None:
        """Publish ``leaving`` and stop; peers stop routing here at once. Idempotent."""
        if self._stopped:
            return
        self._stopped = True
        await self.node.stop()
        if self.session is not None:
            await self.session.close()

    # -- capacity --------------------------------------------------------------------------

    def _fingerprint(self, runtime: ModelRuntime) -> str | None:
        if runtime.name not in self._fingerprints:
            self._fingerprints[runtime.name] = model_fingerprint(runtime.config.path)
        return self._fingerprints[runtime.name]

    def _capacity(self) -> tuple[list[ModelCapacity], PublishedState, list[GpuCapacity] | None]:
        models = []
        for rt in self.runtimes.values():
            healthy = rt.healthy_backends
            waiting: int | None = None
            if healthy and all(b.load is not None and b.load.waiting is not None for b in healthy):
                waiting = sum(b.load.waiting for b in healthy if b.load is not None and b.load.waiting is not None)
            models.append(ModelCapacity(
                name=rt.name, engine=rt.config.engine, kind=rt.config.kind.value,
                slots=sum(b.slots for b in healthy), busy=sum(b.busy for b in healthy), waiting=waiting,
                ctx_per_slot=rt.ctx_per_slot, healthy=len(healthy), total=len(rt.backends),
                fingerprint=self._fingerprint(rt)))
        state = PublishedState.DRAINING if self.draining() else PublishedState.SERVING
        return models, state, None if self.gpus is None else gpu_capacities(self.gpus())

    # -- routing ---------------------------------------------------------------------------

    def local_models(self) -> dict[str, LocalModel]:
        return {name: LocalModel.from_runtime(rt) for name, rt in self.runtimes.items()}

    def peers(self) -> list[PeerSnapshot]:
        return [PeerSnapshot.from_view(v) for v in self.node.peers()]

    def route(self, model: str, *, host: str | None, affinity: str | None, exclude: set[NodeId]) -> Decision:
        assert self.router is not None, "MeshLink.start() first"
        return self.router.route(model, self.local_models(), self.peers(), affinity=affinity, host=host,
                                 exclude=exclude)

    def models(self) -> list[dict[str, Any]]:
        """The mesh-wide /v1/models list (every model once, the fleet's smallest context)."""
        return mesh_models(self.local_models(), self.peers())

    def peer_target(self, node_id: NodeId) -> PeerTarget | None:
        for view in self.node.peers():
            if view.node_id == node_id and view.mesh:
                return PeerTarget(id=view.name, base_url=f"https://{view.mesh}", node_id=view.node_id)
        return None

    def peer_name(self, node_id: NodeId | None) -> str:
        if node_id is None:
            return "?"
        for view in self.node.peers():
            if view.node_id == node_id:
                return view.name
        return str(node_id)

    def queue(self, model: str) -> MeshWaitQueue:
        q = self.queues.get(model)
        if q is None:
            q = self.queues[model] = MeshWaitQueue()
        return q

    def wake(self, model: str) -> None:
        q = self.queues.get(model)
        if q is not None:
            q.wake()

    def wake_all(self) -> None:
        for q in self.queues.values():
            q.wake()

    def status(self) -> dict[str, Any]:
        """The ``mesh`` section of /v1/status: identity, peers by liveness, counters."""
        view = self.node.view()
        peers: dict[str, int] = {}
        for n in view.get("nodes", []):
            peers[n["liveness"]] = peers.get(n["liveness"], 0) + 1
        return {
            "self": {k: (view.get("self") or {}).get(k) for k in ("id", "name", "mesh", "mesh_id", "trust", "state")},
            "peers": peers,
            "forwards": {"out": self.forwards_out, "in": self.forwards_in, "refused_in": self.refusals_in,
                         "refused_out": self.refusals_out},
            "queued": {m: len(q) for m, q in self.queues.items() if len(q)},
            "counters": view.get("counters", {}),
        }
