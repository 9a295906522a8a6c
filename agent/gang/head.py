"""The head's side of a gang: bring the parts up in the plan's order, launch the serving engine, watch the whole.

One module (about 620 lines) because the launch, the adoption after a restart and the watch
(:class:`GangHandle`) all read and change the one current gang of a head (its workers,
tunnels and local parts) and its counters: split, each part would reach into the others'
state through private fields.

The gang's model is one backend on its head (docs/mesh.md, "Gangs"). Its backend task
(agent/supervision/backend_task.py) launches it like any other, with two hooks:

- :meth:`GangHead.prepare` before the launch: a new gang id; every worker host must be
  ``alive`` in the mesh (waited for up to :data:`PEER_WAIT_S`); the parts other than the
  serving one start in the gang plan's order (engines/gang_plan.py): the head's own
  (a vLLM head's Ray runtime) through the runner, the workers' by asking their agents over
  the mesh's mutual TLS (agent/gang/wire.py), all at once within a step; for llama.cpp RPC
  the gang's tunnel credential (agent/gang/tunnel_cert.py) and one tunnel process per worker
  on loopback, through the runner (agent/gang/tunnel_process.py). Returns the
  serving engine's command (the adapter's ``gang_command`` with the gang's addresses).
  Any failure stops what was started and raises :class:`GangError`: the backend fails its
  launch and the health ladder backs off and tries again, a whole new gang.
- :meth:`GangHead.watch` wraps the serving engine's handle in a :class:`GangHandle`: its
  ``wait()`` ends when the engine exits **or** any part is lost (a worker no longer
  ``alive`` in the mesh, or publishing ``leaving``; its agent answering that the part is not
  running; :data:`WATCH_MISSES` watches in a row without an answer). Then the serving engine
  is stopped and every part with it: no half-gang serves. The ladder sees an exit and
  restarts the whole gang with backoff. ``stop()`` stops the engine and the parts.

- :meth:`GangHead.adopt` after the head's agent restarted (the serving engine adopted like a
  one-host backend, agent/supervision/supervisor.py): the gang id is read back from the
  engine's labels, every worker must be alive and say its part of that gang runs, and for
  llama.cpp RPC a tunnel process per worker must still run (they are units of their own,
  agent/gang/tunnel_process.py, so the engine's RPC connections outlive the agent). Then the
  gang is current again, watched as before; else :class:`GangError` and a new gang.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

from viiwork.agent.config.gang import shared_digests
from viiwork.agent.config.schema import ModelConfig
from viiwork.agent.gang.parts import (
    TUNNEL_STALE_S,
    PartFailed,
    gang_engine,
    part_firewall_of,
    part_log,
    start_part,
    start_tunnel,
    tunnel_dir,
    tunnel_fresh,
    wait_ready,
)
from viiwork.agent.gang.tunnel import TunnelCounters, TunnelEndView
from viiwork.agent.gang.tunnel_cert import make_credential, pinned_der, write_peer
from viiwork.agent.gang.tunnel_process import read_counters
from viiwork.agent.gang.wire import PARTS_PATH, START_PATH, STOP_PATH, StartRequest
from viiwork.agent.peering.mesh_link import MeshLink, read_bounded
from viiwork.agent.supervision.backend_task import NodeContext
from viiwork.agent.supervision.engine_keys import EngineKeyError
from viiwork.agent.supervision.gang_units import part_of_labels, tunnel_of_labels
from viiwork.agent.supervision.launch import free_loopback_port
from viiwork.agent.supervision.runners.base import ExitInfo, NftTable, RunHandle
from viiwork.engines.contract import BackendSpec, LaunchCommand
from viiwork.engines.gang import GangAddresses, GangPart, LaunchShape, PartRole, is_gang_id, new_gang_id
from viiwork.engines.gang_plan import plan_gang
from viiwork.mesh.dialing import expect_node
from viiwork.mesh.extensions import GangMember
from viiwork.mesh.identity import NodeId, is_node_id
from viiwork.mesh.membership import Liveness, PeerView
from viiwork.mesh.summary import PublishedState

log = logging.getLogger(__name__)

#: How long prepare() waits for every worker host to be alive in the mesh (at most: the
#: entry's startup timeout when shorter). Then the launch fails spending no respawn, and is
#: tried again a few seconds later: a worker away for long is waited for without `viiworkctl
#: up`. Short, because the launch holds this node's load gate meanwhile (other models'
#: launches wait for it).
PEER_WAIT_S = 5.0
#: A worker's start answers once its part is up: rpc-server or a runtime within this.
START_TIMEOUT_S = 90.0
WATCH_INTERVAL_S = 1.0
WATCH_TIMEOUT_S = 2.0
#: Watches in a row without an answer from a worker's agent before its part counts as lost.
WATCH_MISSES = 3
#: How long the serving engine of a gang that lost a part is given to stop before SIGKILL.
LOST_STOP_GRACE_S = 1.0
#: At adoption, how long a worker's agent is asked whether its part of the gang still runs.
ADOPT_ASK_S = 10.0


class GangError(Exception):
    """The gang could not be brought up; the message names the host and the cause."""

    #: Nothing was started (a host is away from the mesh): the backend's launch spends no
    #: respawn and is retried (agent/supervision/backend_task.py).
    nothing_ran = False


class GangWorkerFailed(GangError):
    """A worker's agent refused the start, or could not start its part, or could not be
    reached: nothing of the head's engine ran (the cause is on the worker's host: its config,
    its binaries, its ports), so no respawn is spent and the launch is tried again until the
    worker is fixed, without `viiworkctl up` on the head."""

    nothing_ran = True


class GangHostsAway(GangError):
    """A host of the gang is not alive in the mesh (or leaving, restarting) after
    :data:`PEER_WAIT_S`: nothing was started."""

    nothing_ran = True


@dataclass
class _Worker:
    rank: int
    host: str  # as the entry names it
    node_id: NodeId
    base_url: str
    address: str  # its mesh host, for the engines' rendezvous and the tunnel
    tunnel_port: int | None = None
    tunnel_cert: str | None = None  # its tunnel end's certificate (PEM), from its start answer
    restarting_since: float | None = None  # monotonic: since when it publishes ``restarting``


@dataclass
class _Tunnel:
    """The head's tunnel process to one worker (agent/gang/tunnel_process.py)."""

    rank: int
    port: int
    handle: RunHandle


@dataclass
class _Gang:
    gang: str
    workers: list[_Worker]
    tunnels: list[_Tunnel] = field(default_factory=list)
    local: list[RunHandle] = field(default_factory=list)  # the head's own parts, tunnels included
    adopted: bool = False


class GangHead:
    """One gang model's head on this node (module doc). ``model``: a function giving the
    entry in force (a reload replaces it); ``mesh``: the started mesh link."""

    def __init__(self, node: NodeContext, model: Callable[[], ModelConfig], mesh: MeshLink) -> None:
        self.node = node
        self.model = model
        self.mesh = mesh
        self.current: _Gang | None = None
        self.counters: dict[str, int] = {"starts": 0, "failures": 0, "parts_lost": 0, "adoptions": 0}
        #: The last launch found a host away (GangHostsAway): one not known then is ``away``.
        self.hosts_missing = False
        self.last_failure = ""
        #: The serving engine's own nftables table (agent/gang/firewall.py), set by prepare().
        self.server_firewall: NftTable | None = None
        #: The parts of a gang whose engine ended, being stopped (``GangHandle.wait`` returns
        #: before: the backend leaves service at once); ``abort`` and ``prepare`` wait for it.
        self.ending: asyncio.Future[None] | None = None

    # -- the workers --------------------------------------------------------------------------

    def _view(self, host: str) -> PeerView | None:
        views = [v for v in self.mesh.node.peers() if (v.node_id == host if is_node_id(host) else v.name == host)]
        return views[0] if len(views) == 1 else None

    async def _workers(self, model: ModelConfig) -> list[_Worker]:
        """Every worker host, once alive in the mesh; :class:`GangHostsAway` after
        :data:`PEER_WAIT_S` (or the entry's startup timeout, when shorter)."""
        deadline = time.monotonic() + min(PEER_WAIT_S, model.effective_startup_timeout_s)
        while True:
            missing = []
            workers = []
            for rank, host in enumerate(model.hosts[1:], start=1):
                view = self._view(host)
                if (view is None or view.liveness is not Liveness.ALIVE or not view.mesh or lost(view)
                        or view.state is PublishedState.RESTARTING):
                    missing.append(f"{host} (rank {rank}) "
                                   + ("is not known in the mesh" if view is None else standing(view)))
                    continue
                workers.append(_Worker(rank, view.name or host, view.node_id, f"https://{view.mesh}",
                                       view.mesh.rpartition(":")[0].strip("[]")))
            if not missing:
                return workers
            if time.monotonic() >= deadline:
                raise GangHostsAway(f"gang of {model.name}: not every host is alive in the mesh: {'; '.join(missing)}")
            await asyncio.sleep(0.5)

    def _own_address(self) -> str:
        advertised = self.mesh.node.advertised_mesh or ""
        return advertised.rpartition(":")[0].strip("[]") or "127.0.0.1"

    async def _post(self, worker: _Worker, path: str, doc: dict[str, Any], timeout_s: float) -> dict[str, Any]:
        session = self.mesh.session
        if session is None:
            raise GangError("the mesh is not started")
        try:
            async with session.post(worker.base_url + path, json=doc, headers=expect_node(worker.node_id),
                                    timeout=aiohttp.ClientTimeout(total=timeout_s)) as resp:
                raw = await read_bounded(resp.content, 64 * 1024)
                answer = _json(raw)
                if resp.status != 200:
                    raise GangWorkerFailed(f"{worker.host} (rank {worker.rank}) refused: "
                                           f"{answer.get('reason', resp.status)}: {answer.get('detail', '')}")
                return answer
        except (aiohttp.ClientError, OSError, TimeoutError, RuntimeError) as exc:
            raise GangWorkerFailed(f"{worker.host} (rank {worker.rank}) cannot be reached: "
                                   f"{exc or type(exc).__name__}") from None

    # -- prepare ------------------------------------------------------------------------------

    async def prepare(self, spec: BackendSpec) -> LaunchCommand:
        """Bring up every part but the serving one; returns the serving engine's command
        (module doc). Raises :class:`GangError`."""
        await self.abort()
        self.server_firewall = None
        model = self.model()
        try:
            engine = gang_engine(model)
        except PartFailed as exc:
            raise GangError(str(exc)) from None
        if model.gang_port is None:
            raise GangError(f"gang of {model.name}: no gang_port")
        try:
            workers = await self._workers(model)
        except GangHostsAway as exc:
            self.hosts_missing = True
            self.counters["failures"] += 1
            level = logging.DEBUG if self.last_failure == str(exc) else logging.WARNING  # once per absence
            self.last_failure = str(exc)
            log.log(level, "%s; trying again (no respawn spent)", exc)
            raise
        self.hosts_missing = False
        gang = _Gang(new_gang_id(), workers)
        self.current = gang
        size = len(model.hosts)
        nodes = (self._own_address(), *(w.address for w in workers))
        own = GangAddresses(gang.gang, 0, size, nodes, model.gang_port)
        digests = shared_digests(model)
        self.counters["starts"] += 1
        rpc = engine.launch_shape is LaunchShape.WORKERS_THEN_HEAD
        try:
            cert = self._credential(model, gang.gang) if rpc else None
            for step in plan_gang(engine.launch_shape, size).steps:
                starts = []
                for part in step.parts:
                    if part.rank == 0 and part.role is not PartRole.SERVER:  # the head's own runtime
                        handle = await start_part(self.node, model, spec, part, own)
                        gang.local.append(handle)
                        await wait_ready(handle, step.ready_of(part), engine.gang_listen(part.role, own),
                                         log=part_log(self.node, model, part))
                    elif part.rank > 0:
                        worker = workers[part.rank - 1]
                        request = StartRequest(model.name, gang.gang, part.rank, size, nodes, digests, cert)
                        starts.append(self._start_worker(worker, request))
                await asyncio.gather(*starts)
            if rpc:
                for worker in workers:
                    await self._start_tunnel(model, gang, worker, size)
            endpoints = tuple(f"127.0.0.1:{t.port}" for t in gang.tunnels)
            addresses = GangAddresses(gang.gang, 0, size, nodes, model.gang_port, worker_endpoints=endpoints)
            command = engine.gang_command(spec, PartRole.SERVER, addresses)
            self.server_firewall = part_firewall_of(model, engine, GangPart(0, PartRole.SERVER), addresses)
        except (GangError, PartFailed, OSError, ValueError, EngineKeyError) as exc:
            self.counters["failures"] += 1
            await self.abort()
            failed = GangError(f"gang {gang.gang} of {model.name}: {exc}")
            failed.nothing_ran = getattr(exc, "nothing_ran", False)
            if failed.nothing_ran:  # the ladder says nothing of these: said here, once per cause
                level = logging.DEBUG if self.last_failure == str(exc) else logging.WARNING
                log.log(level, "%s; trying again (no respawn spent)", failed)
            self.last_failure = str(exc)
            raise failed from None
        log.info("gang %s of %s: %d workers up (%s), launching the head", gang.gang, model.name, len(workers),
                 ", ".join(f"{w.host} rank {w.rank}" for w in workers))
        return command

    def tunnel_dir(self, model: ModelConfig) -> Path:
        return tunnel_dir(self.node, model)

    def _credential(self, model: ModelConfig, gang: str) -> str:
        """A new gang's tunnel credential for the head's ends; its certificate PEM."""
        return make_credential(self.tunnel_dir(model), gang, getattr(self.node.runner, "engine_user", None))

    async def _start_tunnel(self, model: ModelConfig, gang: _Gang, worker: _Worker, size: int) -> None:
        """The head's tunnel end to ``worker``'s exit (agent/gang/parts.py ``start_tunnel``),
        listening on a free loopback port. Raises GangError."""
        if worker.tunnel_port is None or worker.tunnel_cert is None:
            raise GangError(f"{worker.host} (rank {worker.rank}) answered no tunnel exit")
        port = free_loopback_port({t.port for t in gang.tunnels})
        directory = self.tunnel_dir(model)
        try:
            peer = write_peer(directory, f"r{worker.rank}", worker.tunnel_cert,
                              getattr(self.node.runner, "engine_user", None))
            handle = await start_tunnel(
                self.node, model, gang.gang, worker.rank, size, worker.node_id,
                ("entry", "--gang", gang.gang, "--rank", str(worker.rank), "--dir", str(directory), "--peer", str(peer),
                 "--worker", worker.node_id, "--connect", f"{worker.address}:{worker.tunnel_port}", "--port", str(port)),
                f"127.0.0.1:{port}")
        except (PartFailed, EngineKeyError) as exc:
            raise GangError(f"{worker.host} (rank {worker.rank}): {exc}") from None
        gang.local.append(handle)
        gang.tunnels.append(_Tunnel(worker.rank, port, handle))

    # -- adoption -----------------------------------------------------------------------------

    def labels(self) -> dict[str, str]:
        """What the serving engine's unit records of its gang (read back by :meth:`adopt`)."""
        return {"gang": self.current.gang} if self.current is not None else {}

    async def adopt(self, labels: dict[str, str], parts: list[RunHandle]) -> None:
        """Take the gang of a serving engine left running by an earlier agent as current
        (module doc). ``labels``: the engine's; ``parts``: this host's running units of that
        gang (tunnels, a head's runtime). Raises :class:`GangError` saying what is missing;
        the caller then stops the engine and ``parts`` and starts a new gang."""
        model = self.model()
        gang_id = labels.get("gang", "")
        if not is_gang_id(gang_id):
            raise GangError(f"gang of {model.name}: the engine left running records no gang id")
        try:
            engine = gang_engine(model)
        except PartFailed as exc:
            raise GangError(str(exc)) from None
        workers = await self._workers(model)
        gang = _Gang(gang_id, workers, adopted=True)
        for worker in workers:
            if not await self._still_running(gang, worker):
                raise GangError(f"gang {gang_id} of {model.name}: the part on {worker.host} (rank {worker.rank}) "
                                "is not running")
        for handle in parts:
            tunnel = tunnel_of_labels(handle.labels)
            if tunnel is not None and tunnel[0] == gang_id:
                gang.tunnels.append(_Tunnel(tunnel[1], tunnel[2], handle))
            elif part_of_labels(handle.labels) is None:
                continue
            gang.local.append(handle)
        if engine.launch_shape is LaunchShape.WORKERS_THEN_HEAD:
            have = {t.rank for t in gang.tunnels if t.handle.running()}
            missing = [w for w in workers if w.rank not in have]
            if missing:
                raise GangError(f"gang {gang_id} of {model.name}: no tunnel runs to "
                                + ", ".join(f"{w.host} (rank {w.rank})" for w in missing))
        gang.tunnels.sort(key=lambda t: t.rank)
        self.current = gang
        self.counters["adoptions"] += 1
        log.info("gang %s of %s: adopted (%s; %d local parts)", gang_id, model.name,
                 ", ".join(f"{w.host} rank {w.rank}" for w in workers), len(gang.local))

    async def _still_running(self, gang: _Gang, worker: _Worker) -> bool:
        deadline = time.monotonic() + ADOPT_ASK_S
        while True:
            running = await self.part_running(gang, worker)
            if running is not None or time.monotonic() >= deadline:
                return running is True
            await asyncio.sleep(0.5)

    async def _start_worker(self, worker: _Worker, request: StartRequest) -> None:
        answer = await self._post(worker, START_PATH, request.to_json(), START_TIMEOUT_S)
        if answer.get("gang") != request.gang:
            raise GangError(f"{worker.host} (rank {worker.rank}) answered for another gang")
        port = answer.get("tunnel_port")
        worker.tunnel_port = port if type(port) is int and 0 < port < 65536 else None
        cert = answer.get("tunnel_cert")
        if request.tunnel_cert is not None:  # llama.cpp RPC: the worker's end of the tunnel
            try:
                pinned_der(cert)  # type: ignore[arg-type]
            except ValueError as exc:
                raise GangError(f"{worker.host} (rank {worker.rank}) answered no usable tunnel certificate: "
                                f"{exc}") from None
            if worker.tunnel_port is None:
                raise GangError(f"{worker.host} (rank {worker.rank}) answered no tunnel port")
            worker.tunnel_cert = cert

    async def abort(self) -> None:
        """Stop every part of the current gang (workers asked, tunnels closed, local parts
        stopped), after the parts of an ended gang still being stopped (:attr:`ending`);
        no-op without either."""
        ending = self.ending
        if ending is not None and not ending.done():
            await asyncio.shield(ending)
        await self.stop_current()

    async def stop_current(self) -> None:
        """Stop every part of the current gang; no-op without one (a worker's agent that does
        not answer is given 5 s + ``stop_timeout_s``)."""
        gang, self.current = self.current, None
        if gang is None:
            return
        model = self.model()
        # The head's own parts stop meanwhile: a worker's agent that does not answer does not
        # keep them running.
        await asyncio.gather(*(self._stop_worker(w, model.name, gang.gang) for w in gang.workers),
                             self._stop_local(gang))

    async def _stop_local(self, gang: _Gang) -> None:
        grace = self.node.config.supervisor.stop_timeout_s
        for handle in reversed(gang.local):
            with contextlib.suppress(Exception):
                await handle.stop(grace)

    async def _stop_worker(self, worker: _Worker, model: str, gang: str) -> None:
        try:
            await self._post(worker, STOP_PATH, {"model": model, "gang": gang}, 5.0 + self.node.config.supervisor.stop_timeout_s)
        except GangError as exc:
            log.info("gang %s of %s: could not ask %s to stop its part: %s", gang, model, worker.host, exc)

    # -- watch --------------------------------------------------------------------------------

    def watch(self, handle: RunHandle) -> GangHandle:
        """The serving engine's ``handle``, ending with any part of the current gang."""
        assert self.current is not None, "watch() after prepare()"
        return GangHandle(self, self.current, handle)

    def restart_grace_s(self) -> float:
        """How long a worker that publishes ``restarting`` is waited for (the mesh's
        ``restart_grace_ms``, docs/mesh.md)."""
        return self.mesh.node.settings.gossip.restart_grace_ms / 1000

    def in_restart_grace(self, worker: _Worker, view: PeerView | None, now: float) -> bool:
        """Whether ``worker`` is restarting within its grace: it published ``restarting`` (its
        agent stops for a restart and comes back; its parts run on, as units) less than
        :meth:`restart_grace_s` ago and is not back yet. Tracks since when on ``worker``."""
        if view is not None and view.state is PublishedState.RESTARTING:
            if worker.restarting_since is None:
                worker.restarting_since = now
                log.info("gang: %s (rank %d) is restarting: waiting up to %.0f s for it", worker.host, worker.rank,
                         self.restart_grace_s())
        elif view is not None and view.liveness is Liveness.ALIVE:
            worker.restarting_since = None  # back (or never away)
        return worker.restarting_since is not None and now - worker.restarting_since < self.restart_grace_s()

    async def part_lost(self, gang: _Gang) -> str | None:
        """Why a part of ``gang`` is lost now, or None while every part runs (a worker
        restarting within its grace counts as running: :meth:`in_restart_grace`)."""
        by_id = {v.node_id: v for v in self.mesh.node.peers()}
        now = time.monotonic()
        for worker in gang.workers:
            view = by_id.get(worker.node_id)
            if self.in_restart_grace(worker, view, now):
                continue
            if worker.restarting_since is not None:
                return (f"{worker.host} (rank {worker.rank}) did not come back within its restart grace "
                        f"({self.restart_grace_s():.0f} s)")
            if view is not None and view.liveness is Liveness.SUSPECT and not lost(view):
                # Suspicion may be refuted (an agent that restarted faster than a watch saw
                # it publish `restarting`, a missed probe): it is `dead` after the suspicion
                # timeout, or its agent misses WATCH_MISSES watches, either of which is lost.
                continue
            if view is None or view.liveness is not Liveness.ALIVE or lost(view):
                return (f"{worker.host} (rank {worker.rank}) "
                        + ("is gone from the mesh" if view is None else standing(view)))
        for handle in gang.local:
            if not handle.running():
                return "the head's own part exited"
        for tunnel in gang.tunnels:
            if not tunnel_fresh(self.tunnel_dir(self.model()), tunnel.rank, TUNNEL_STALE_S):
                return (f"the head's tunnel to rank {tunnel.rank} wrote nothing for {TUNNEL_STALE_S:.0f} s "
                        "(frozen or stuck)")
        return None

    async def part_running(self, gang: _Gang, worker: _Worker) -> bool | None:
        """Whether ``worker``'s agent says its part of ``gang`` runs (None: no answer)."""
        session = self.mesh.session
        if session is None:
            return None
        try:
            async with session.get(worker.base_url + PARTS_PATH, headers=expect_node(worker.node_id),
                                   timeout=aiohttp.ClientTimeout(total=WATCH_TIMEOUT_S)) as resp:
                if resp.status != 200:
                    return None
                parts = _json(await read_bounded(resp.content, 64 * 1024)).get("parts")
        except (aiohttp.ClientError, OSError, TimeoutError, RuntimeError):
            return None
        if not isinstance(parts, list):
            return None
        return any(isinstance(p, dict) and p.get("gang") == gang.gang and p.get("running") is True for p in parts)

    def away(self) -> str | None:
        """Why the gang cannot serve now nor soon: a worker host that is ``dead`` or has
        ``left`` the mesh, or publishes ``leaving`` (a graceful stop), or is not known in the mesh
        after a launch waited for it in vain (a typo in ``hosts``, a host never started); None
        otherwise (a host not known yet at start, ``suspect`` or ``restarting`` may be back
        within seconds). While it is not
        None the model's requests are refused (503) at once instead of waiting in the queue
        for a gang that cannot start (``ModelRuntime.can_ever_serve``)."""
        for rank, host in enumerate(self.model().hosts[1:], start=1):
            view = self._view(host)
            if view is not None and (view.liveness in (Liveness.DEAD, Liveness.LEFT)
                                     or view.state is PublishedState.LEAVING):
                return f"{view.name or host} (rank {rank}) {standing(view)}"
            if view is None and self.hosts_missing:  # a launch already waited for it in vain
                return f"{host} (rank {rank}) is not known in the mesh"
        return None

    def membership(self) -> GangMember | None:
        """This node's place in its gang for the summary's ``gangs`` extension: rank 0 and
        leader while a gang is current (from its start until it is stopped), else None."""
        gang = self.current
        if gang is None:
            return None
        return GangMember(self.model().name, gang.gang, 0, len(gang.workers) + 1, self.mesh.node.node_id)

    def tunnel_counters(self) -> list[tuple[int, TunnelCounters]]:
        """(rank, counters) of the current gang's tunnel processes, as they last wrote them
        (zeros for one that has not written yet)."""
        gang = self.current
        if gang is None:
            return []
        directory = self.tunnel_dir(self.model())
        return [(t.rank, read_counters(directory, t.rank) or TunnelCounters()) for t in gang.tunnels]

    def tunnel_views(self) -> list[TunnelEndView]:
        """The current gang's tunnel ends for ``/metrics`` (agent/gang/tunnel.py ``metric_families``)."""
        gang = self.current
        return [TunnelEndView(gang.gang, "entry", c) for _, c in self.tunnel_counters()] if gang else []

    def status(self) -> dict[str, Any]:
        gang = self.current
        return {"gang": gang.gang if gang else None,
                "adopted": gang.adopted if gang else False,
                "parts": [] if gang is None else [
                    {"rank": w.rank, "host": w.host, "node_id": w.node_id} for w in gang.workers],
                "tunnels": [{"rank": rank, "pid": t.handle.pid, "unit": t.handle.unit, **c.as_dict()}
                            for (rank, c), t in zip(self.tunnel_counters(), gang.tunnels, strict=True)] if gang else [],
                "last_failure": self.last_failure, **self.counters}


def standing(view: PeerView) -> str:
    """How a peer stands, in words for a reason: "has left the mesh", "is dead (no answer)",
    "is leaving", "is suspect, restarting"..."""
    if view.liveness is Liveness.LEFT:
        return "has left the mesh"
    if view.liveness is Liveness.DEAD:
        return "is dead (no answer)"
    if view.state is PublishedState.LEAVING:
        return "is leaving"
    return f"is {view.liveness.value}, {view.state.value}"


def lost(view: PeerView) -> bool:
    """A worker publishing ``leaving`` (a graceful stop) is lost to its gang; one publishing
    ``restarting`` is waited for (:meth:`GangHead.in_restart_grace`), and at a gang's start
    it is not ready (:meth:`GangHead.prepare` waits for it to be back)."""
    return view.state is PublishedState.LEAVING


def _json(raw: bytes) -> dict[str, Any]:
    import json

    try:
        doc = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError):
        return {}
    return doc if isinstance(doc, dict) else {}


class GangHandle:
    """The serving engine's :class:`RunHandle`, ending with the gang (module doc)."""

    def __init__(self, head: GangHead, gang: _Gang, inner: RunHandle) -> None:
        self.head, self.gang, self.inner = head, gang, inner
        self.pid, self.unit, self.labels = inner.pid, inner.unit, inner.labels
        self._lost: asyncio.Future[str] = asyncio.get_running_loop().create_future()
        self._ended: ExitInfo | None = None
        self._ending: asyncio.Future[None] | None = None
        self._watch = asyncio.ensure_future(self._run())

    async def _run(self) -> None:
        misses = {w.rank: 0 for w in self.gang.workers}
        try:
            while self.inner.running():
                why = await self.head.part_lost(self.gang)
                if why is None:
                    for worker in self.gang.workers:
                        if worker.restarting_since is not None:  # in its restart grace: its agent is away
                            misses[worker.rank] = 0
                            continue
                        running = await self.head.part_running(self.gang, worker)
                        misses[worker.rank] = misses[worker.rank] + 1 if running is None else 0
                        if running is False:
                            why = f"the part on {worker.host} (rank {worker.rank}) is not running"
                        elif misses[worker.rank] >= WATCH_MISSES:
                            why = f"{worker.host} (rank {worker.rank}) did not answer {WATCH_MISSES} watches"
                        if why:
                            break
                if why is not None:
                    self.head.counters["parts_lost"] += 1
                    self.head.last_failure = why
                    log.warning("gang %s: %s: stopping the gang (it restarts whole)", self.gang.gang, why)
                    if not self._lost.done():
                        self._lost.set_result(why)
                    return
                await asyncio.sleep(WATCH_INTERVAL_S)
        except asyncio.CancelledError:
            raise

    def running(self) -> bool:
        return self.inner.running() and not self._lost.done()

    async def wait(self) -> ExitInfo:
        if self._ended is not None:
            return self._ended
        exited = asyncio.ensure_future(self.inner.wait())
        waited: set[asyncio.Future[Any]] = {exited, self._lost}
        await asyncio.wait(waited, return_when=asyncio.FIRST_COMPLETED)
        if self._lost.done() and not exited.done():
            # The engine cannot serve without its part: said now, so that its backend leaves
            # service before the engine is stopped (a request sent to an engine being stopped
            # got a 502 for the second that took); the engine is stopped first thing in the
            # gang's end (_finish), which the next launch and a stop wait for.
            exited.cancel()
            info = ExitInfo("gang", detail=f"part lost: {self._lost.result()}")
        else:
            info = exited.result()
        # The engine is gone or going: say so now, so that its backend leaves service, while
        # the engine and the parts are stopped in the background (a frozen worker's agent may
        # take 5 s + stop_timeout_s to give up on); the next launch waits for them (GangHead.abort).
        self._begin_end()
        self._ended = info
        return info

    async def stop(self, grace_s: float) -> ExitInfo:
        info = await self.inner.stop(grace_s)
        await self._end()
        return info

    async def _end(self) -> None:
        """Stop watching and stop the gang's parts, once: ``wait()`` (the engine exited: it
        begins this and does not wait) and ``stop()`` may both get here, and the task running
        ``stop()`` may be cancelled (the agent's stop ends its backend tasks); the parts are
        stopped in a task of their own that such a cancellation does not cut (else the
        worker's part and the tunnels would outlive the head)."""
        await asyncio.shield(self._begin_end())

    def _begin_end(self) -> asyncio.Future[None]:
        if self._ending is None:
            self._ending = self.head.ending = asyncio.ensure_future(self._finish())
        return self._ending

    async def _finish(self) -> None:
        self._watch.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._watch
        if self.inner.running():  # a part was lost: the engine cannot serve without it
            # A short grace: llama-server on a dead RPC device hangs and ignores SIGTERM.
            with contextlib.suppress(Exception):
                await self.inner.stop(min(LOST_STOP_GRACE_S, self.head.node.config.supervisor.stop_timeout_s))
        if self.head.current is self.gang:
            await self.head.stop_current()
