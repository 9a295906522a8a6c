"""A worker host's side of a gang: start, list and stop its parts when the head asks (docs/mesh.md, "Gangs").

One module (about 500 lines) because the routes, the starting and stopping of parts, the
adoption after a restart and the watch of the heads all guard one map of this host's gangs
under one lock: split, the lock and the map would be shared across modules.

The routes (agent/gang/wire.py) are on the mesh listener, so the sender is a verified mesh
node. A start is refused unless every check of this host's **own** config passes:

1. the config has a gang entry by that name (``no_gang_entry``) that names this host
   (``not_in_gang``) at the rank the head sent, in a gang of the same size (``rank_mismatch``);
2. the sender is the head that entry names (its first host: a node id, or a node name unique
   among the peers this node knows; ``not_the_head``). A head named by name that asks
   before this host knows the sender at all (this agent just started, and the head met it
   first) is waited for, up to :data:`HEAD_WAIT_S`, until the sender's summary arrives;
3. the head's digests of the shared part equal this host's (``config_mismatch``, naming the
   differing keys).

Only then are the parts started (agent/gang/parts.py), from this host's entry and the gang's
addresses: nothing in the request reaches a command line but the gang id, the ranks' hosts
(checked as host names or addresses) and the size. A llama.cpp RPC worker's rpc-server listens
on 127.0.0.1 only; a tunnel exit process on the mesh's address (agent/gang/tunnel_process.py)
admits only the head's tunnel certificate of the gang, which came in the start request, and
delivers to that port; the answer carries the exit's own certificate (agent/gang/tunnel_cert.py).
One gang per model on a host: a start for a new gang id stops the old one's parts first; a
start for the running gang answers what runs.

Every refusal is counted by reason (``refused``) and logged (WARNING once per reason and
sender, then DEBUG); nothing a peer sends raises out of this module. When this agent stops,
its parts stop with it (the head sees the part gone and the host leaving, and takes the
model down). When the head leaves (``leaving``) or is not alive for :data:`HEAD_GONE_S`,
the parts stop too (:meth:`GangWorker.check_heads`); a head that restarts keeps them.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from aiohttp import web

from viiwork.agent.config.gang import (
    GangConfigError,
    differing_keys,
    gang_rank,
    mismatch_message,
    shared_digests,
    shared_hash,
)
from viiwork.agent.config.schema import ModelConfig
from viiwork.agent.gang.parts import (
    TUNNEL_STALE_S,
    PartFailed,
    gang_engine,
    part_log,
    part_spec,
    roles_here,
    start_part,
    start_tunnel,
    tunnel_dir,
    tunnel_fresh,
    wait_ready,
)
from viiwork.agent.gang.tunnel import TunnelCounters, TunnelEndView
from viiwork.agent.gang.tunnel_cert import make_credential, read_tunnel_cert, write_peer
from viiwork.agent.gang.tunnel_process import read_counters
from viiwork.agent.gang.wire import (
    MAX_BODY_BYTES,
    PARTS_PATH,
    START_PATH,
    STATUS,
    STOP_PATH,
    Malformed,
    Reason,
    StartRequest,
    parse_start,
    parse_stop,
)
from viiwork.agent.supervision.backend_task import NodeContext
from viiwork.agent.supervision.gang_units import GANG_UNIT_PREFIX, TUNNEL_ROLE, tunnel_of_labels
from viiwork.agent.supervision.launch import free_port_on
from viiwork.agent.supervision.runners.base import RunHandle, RunnerError
from viiwork.engines.gang import GangAddresses, GangPart, LaunchShape, PartRole, is_gang_id
from viiwork.engines.gang_plan import plan_gang
from viiwork.mesh.extensions import GANGS, GangMember
from viiwork.mesh.identity import NodeId, is_node_id
from viiwork.mesh.membership import Liveness, PeerView
from viiwork.mesh.node import MeshNode
from viiwork.mesh.summary import PublishedState
from viiwork.mesh.transport import peer_of

log = logging.getLogger(__name__)

#: How often a worker looks at its gangs' heads in the mesh.
HEAD_WATCH_S = 1.0
#: A head not alive in the mesh this long has its parts stopped (a restarted head's agent is
#: back well within it and adopts them; docs/mesh.md, "Gangs").
HEAD_GONE_S = 60.0
#: An alive head whose summary does not name the gang this long has its parts stopped (a head
#: publishes its gang from the start of its launch, within a few gossip rounds).
HEAD_UNCLAIMED_S = 15.0


def leads(view: PeerView, gang: _Gang) -> bool:
    """Whether ``view``'s summary names it the leader (rank 0) of ``gang`` (its ``gangs`` extension)."""
    published = view.extensions.get(GANGS)
    return published is not None and any(
        m.model == gang.model and m.gang == gang.gang and m.rank == 0 and m.leader == view.node_id
        for m in published.members)
#: How long a start from a sender this host does not know yet waits for its summary (check 2).
HEAD_WAIT_S = 10.0


@dataclass
class _Gang:
    """This host's parts of one gang."""

    model: str
    gang: str
    rank: int
    size: int
    head: NodeId
    gpus: list[str]  # this host's entry's ``gpus``: what it lends the gang (empty: CPU)
    handles: list[RunHandle] = field(default_factory=list)
    tunnel_port: int | None = None  # its tunnel exit's (llama.cpp RPC), one of ``handles``
    tunnel_cert: str | None = None  # its tunnel exit's certificate (PEM), for the head
    parts: list[dict[str, Any]] = field(default_factory=list)
    head_gone_since: float | None = None  # monotonic: since when the head is not alive in the mesh
    unclaimed_since: float | None = None  # monotonic: since when the alive head does not publish this gang
    tunnel_dir: Path | None = None  # its tunnel exit's directory (counters written every second)

    def running(self) -> bool:
        """Every process runs, and its tunnel exit (if any) wrote its counters lately (a frozen
        exit runs but carries nothing: agent/gang/parts.py ``tunnel_fresh``)."""
        return (bool(self.handles) and all(h.running() for h in self.handles)
                and (self.tunnel_dir is None or tunnel_fresh(self.tunnel_dir, self.rank, TUNNEL_STALE_S)))


class GangWorker:
    """Serves the gang routes of this node (module doc). ``node``: the supervisor's
    :class:`NodeContext` (config, runner, environment); ``mesh``: this node's mesh (its id, its
    peers for finding the head by name, its listener's TLS context and host for a tunnel exit)."""

    def __init__(self, node: NodeContext, mesh: MeshNode) -> None:
        self.node = node
        self.mesh = mesh
        self.gangs: dict[str, _Gang] = {}
        self.refused: Counter[str] = Counter()
        self.counters: Counter[str] = Counter()
        self._warned: set[tuple[str, str]] = set()
        self._lock = asyncio.Lock()
        self._head_hosts: dict[str, str] = {}  # model -> the address its head's last start came from
        #: Set once :meth:`adopt` is over (at once without a gang entry: the agent does not call
        #: it then). A head's start, stop or parts question waits for it: the mesh listener
        #: serves before adoption ends, and a just-started agent that answered ``parts: []``
        #: for a part it was about to adopt made the head take the part for lost.
        self.adoption_over = asyncio.Event()
        if not any(m.hosts for m in node.config.models):
            self.adoption_over.set()

    def add_routes(self, app: web.Application) -> None:
        app.router.add_post(START_PATH, self.handle_start)
        app.router.add_post(STOP_PATH, self.handle_stop)
        app.router.add_get(PARTS_PATH, self.handle_parts)

    # -- the heads ----------------------------------------------------------------------------

    async def run(self) -> None:
        """Watch the heads of this host's gangs every :data:`HEAD_WATCH_S` (:meth:`check_heads`)
        until cancelled."""
        while True:
            await asyncio.sleep(HEAD_WATCH_S)
            await self.check_heads(time.monotonic())

    async def check_heads(self, now: float) -> None:
        """Stop the parts of a gang whose head left: it publishes ``leaving`` (a graceful stop:
        its agent has stopped its engine), or it has not been ``alive`` in the mesh for
        :data:`HEAD_GONE_S` (crashed or cut off, and not back to adopt the gang), or, alive, its
        summary has not named this gang for :data:`HEAD_UNCLAIMED_S` (its agent came back
        with another config, or without the entry, and did not adopt it). A head that
        publishes ``restarting``, or comes back and adopts the gang, keeps its parts
        (agent/gang/head.py)."""
        views = {v.node_id: v for v in self.mesh.peers()}
        for name, gang in list(self.gangs.items()):
            view = views.get(gang.head)
            why = None
            if view is not None and view.state is PublishedState.LEAVING:
                why = "its head left the mesh"
            elif view is None or view.liveness is not Liveness.ALIVE:
                gang.head_gone_since = gang.head_gone_since if gang.head_gone_since is not None else now
                if now - gang.head_gone_since >= HEAD_GONE_S:
                    why = f"its head has not been alive in the mesh for {HEAD_GONE_S:.0f} s"
            else:
                gang.head_gone_since = None
                if view.state is not PublishedState.RESTARTING and not leads(view, gang):
                    gang.unclaimed_since = gang.unclaimed_since if gang.unclaimed_since is not None else now
                    if now - gang.unclaimed_since >= HEAD_UNCLAIMED_S:
                        why = (f"its head, alive, has not led this gang for {HEAD_UNCLAIMED_S:.0f} s (it started "
                               "another, or runs another config)")
                else:
                    gang.unclaimed_since = None
            if why is None:
                continue
            async with self._lock:
                if self.gangs.get(name) is gang:
                    log.warning("gang %s of %s: stopping rank %d: %s", gang.gang, name, gang.rank, why)
                    self.counters["head_gone"] += 1
                    await self._stop(name)

    # -- checks -------------------------------------------------------------------------------

    def _entry(self, name: str) -> ModelConfig | None:
        for model in self.node.config.models:
            if model.name == name and model.hosts:
                return model
        return None

    def head_of(self, model: ModelConfig) -> NodeId | None:
        """The node id of ``model``'s head: its first host, an id or a name unique among the
        peers (None when the name is unknown or not unique)."""
        head = model.hosts[0]
        if is_node_id(head):
            return NodeId(head)
        named = [p.node_id for p in self.mesh.peers() if p.name == head]
        return named[0] if len(named) == 1 else None

    async def _head_once_known(self, model: ModelConfig, sender: NodeId) -> NodeId | None:
        """:meth:`head_of`, waiting up to :data:`HEAD_WAIT_S` while ``sender`` is not among the
        peers yet (its name unknown here); at once when it is known."""
        deadline = time.monotonic() + HEAD_WAIT_S
        while (self.head_of(model) is None and time.monotonic() < deadline
               and not any(p.node_id == sender for p in self.mesh.peers())):
            await asyncio.sleep(0.1)
        return self.head_of(model)

    def _refuse(self, reason: Reason, sender: str, detail: str, **extra: Any) -> web.Response:
        self.refused[reason.value] += 1
        level = logging.WARNING if (reason.value, sender) not in self._warned else logging.DEBUG
        self._warned.add((reason.value, sender))
        log.log(level, "gang request from %s refused (%s): %s", sender, reason.value, detail)
        return web.json_response({"reason": reason.value, "detail": detail, **extra}, status=STATUS[reason])

    async def _body(self, request: web.Request) -> bytes | None:
        if request.content_length is not None and request.content_length > MAX_BODY_BYTES:
            return None
        raw = await request.content.read(MAX_BODY_BYTES + 1)
        return None if len(raw) > MAX_BODY_BYTES else raw

    # -- routes -------------------------------------------------------------------------------

    async def _read(self, request: web.Request) -> tuple[NodeId, str, bytes] | web.Response:
        """The verified sender, its name for logs and the bounded body, or the refusal."""
        peer = peer_of(request)
        sender = str(peer or request.remote)
        raw = await self._body(request)
        if peer is None or raw is None:
            return self._refuse(Reason.MALFORMED, sender, "no verified peer, or a body over the bound")
        return peer, sender, raw

    async def handle_start(self, request: web.Request) -> web.Response:
        await self.adoption_over.wait()
        read = await self._read(request)
        if isinstance(read, web.Response):
            return read
        peer, sender, raw = read
        try:
            start = parse_start(raw)
        except Malformed as exc:
            return self._refuse(Reason.MALFORMED, sender, str(exc))
        model = self._entry(start.model)
        if model is None:
            return self._refuse(Reason.NO_GANG_ENTRY, sender, f"this host's config has no gang entry {start.model!r}")
        try:
            rank = gang_rank(model, str(self.mesh.node_id), self.node.node_name)
        except GangConfigError as exc:  # this host named twice: its own config's fault, said to both sides
            return self._refuse(Reason.NOT_IN_GANG, sender, str(exc))
        if rank is None:
            return self._refuse(Reason.NOT_IN_GANG, sender, (
                f"{start.model!r} does not name this host ({self.node.node_name}, node {self.mesh.node_id}); "
                f"its hosts: {', '.join(model.hosts)}"))
        if rank != start.rank or len(model.hosts) != start.size:
            return self._refuse(Reason.RANK_MISMATCH, sender, (
                f"this host is rank {rank} of {len(model.hosts)} in {start.model!r}, "
                f"the head sent rank {start.rank} of {start.size}"))
        head = self.head_of(model)
        if head is None and not is_node_id(model.hosts[0]):
            head = await self._head_once_known(model, peer)
        if head is None or head != peer:
            return self._refuse(Reason.NOT_THE_HEAD, sender, (
                f"{start.model!r} names {model.hosts[0]!r} as its head"
                + ("" if head is not None else " (not a node id, nor a name unique among the peers)")))
        keys = differing_keys(shared_digests(model), start.digests)
        if keys:
            return self._refuse(Reason.CONFIG_MISMATCH, sender,
                                mismatch_message(model.name, self.node.node_name, keys), keys=list(keys))
        try:  # checked before anything running is touched
            assert model.gang_port is not None  # the schema requires it with hosts
            GangAddresses(start.gang, start.rank, start.size, start.addresses, model.gang_port)
        except ValueError as exc:
            return self._refuse(Reason.MALFORMED, sender, f"addresses: {exc}")
        # Where the head's connections come from, as this host sees them: its exit keeps their
        # slots (agent/gang/tunnel.py); the head's advertised host may be a name.
        self._head_hosts[model.name] = str(request.remote or "")
        async with self._lock:
            # Shielded: the listener cancels a handler whose client went away, and a start cut
            # off half-way must still end whole or stopped (``_start`` cleans up on failure).
            starting = asyncio.ensure_future(self._start(model, start, head))
            try:
                gang = await asyncio.shield(starting)
            except PartFailed as exc:
                return self._refuse(Reason.PART_FAILED, sender, f"{start.model!r} rank {rank}: {exc}")
            except asyncio.CancelledError:
                with contextlib.suppress(Exception, asyncio.CancelledError):
                    await starting  # ends whole (the head will find it) or stopped
                raise
        self.counters["starts"] += 1
        return web.json_response({"gang": gang.gang, "rank": gang.rank, "parts": gang.parts,
                                  "tunnel_port": gang.tunnel_port, "tunnel_cert": gang.tunnel_cert})

    async def handle_stop(self, request: web.Request) -> web.Response:
        await self.adoption_over.wait()
        read = await self._read(request)
        if isinstance(read, web.Response):
            return read
        peer, sender, raw = read
        try:
            name, gang_id = parse_stop(raw)
        except Malformed as exc:
            return self._refuse(Reason.MALFORMED, sender, str(exc))
        model = self._entry(name)
        if model is None:
            return self._refuse(Reason.NO_GANG_ENTRY, sender, f"this host's config has no gang entry {name!r}")
        if self.head_of(model) != peer:
            return self._refuse(Reason.NOT_THE_HEAD, sender, f"{name!r} names {model.hosts[0]!r} as its head")
        async with self._lock:
            gang = self.gangs.get(name)
            stopped = gang is not None and gang.gang == gang_id
            if stopped:
                await self._stop(name)
        return web.json_response({"stopped": stopped})

    async def handle_parts(self, request: web.Request) -> web.Response:
        if peer_of(request) is None:
            return self._refuse(Reason.MALFORMED, str(request.remote), "no verified peer")
        await self.adoption_over.wait()
        return web.json_response({"parts": [
            {"model": g.model, "gang": g.gang, "rank": g.rank, "running": g.running()} for g in self.gangs.values()]})

    # -- parts --------------------------------------------------------------------------------

    async def _start(self, model: ModelConfig, start: StartRequest, head: NodeId) -> _Gang:
        held = self.gangs.get(model.name)
        if held is not None and held.gang == start.gang and held.running():
            return held
        if held is not None:
            await self._stop(model.name)
        engine = gang_engine(model)
        assert model.gang_port is not None  # the schema requires it with hosts
        addresses = GangAddresses(start.gang, start.rank, start.size, start.addresses, model.gang_port)
        plan = plan_gang(engine.launch_shape, start.size)
        gang = _Gang(model.name, start.gang, start.rank, start.size, head, [str(g) for g in model.gpus])
        self.gangs[model.name] = gang
        try:
            spec = part_spec(self.node, model, start.rank)
            for role in roles_here(model, start.rank):
                part = GangPart(start.rank, role)
                handle = await start_part(self.node, model, spec, part, addresses, head)
                gang.handles.append(handle)
                gang.parts.append({"role": role.value, "pid": handle.pid, "unit": handle.unit})
                step = next(s for s in plan.steps if part in s.parts)
                await wait_ready(handle, step.ready_of(part), engine.gang_listen(role, addresses),
                                 log=part_log(self.node, model, part))
            if engine.launch_shape is LaunchShape.WORKERS_THEN_HEAD:
                await self._start_exit(model, start, gang)
        except Exception as exc:  # PartFailed, OSError, EngineKeyError, ...: nothing half-started is left
            await self._stop(model.name)
            raise PartFailed(str(exc) or type(exc).__name__) from None
        log.info("gang %s of %s: rank %d started (%s)", start.gang, model.name, start.rank,
                 ", ".join(f"{p['role']} pid {p['pid']}" for p in gang.parts))
        return gang

    async def _start_exit(self, model: ModelConfig, start: StartRequest, gang: _Gang) -> None:
        """This part's tunnel exit (agent/gang/parts.py ``start_tunnel``): this end's credential,
        the head's certificate from the start request as the only one admitted, a free port on
        the mesh's listen address, delivering to the rpc-server's ``gang_port`` on 127.0.0.1.
        Raises PartFailed or EngineKeyError."""
        if start.tunnel_cert is None:
            raise PartFailed("the head sent no tunnel certificate for a llama.cpp RPC part")
        assert model.gang_port is not None
        user = getattr(self.node.runner, "engine_user", None)
        directory = tunnel_dir(self.node, model)
        gang.tunnel_cert = make_credential(directory, start.gang, user)
        peer = write_peer(directory, "head", start.tunnel_cert, user)
        host = self.mesh.settings.listen.rpartition(":")[0].strip("[]")
        port = free_port_on(host)
        handle = await start_tunnel(
            self.node, model, start.gang, start.rank, start.size, gang.head,
            ("exit", "--gang", start.gang, "--rank", str(start.rank), "--dir", str(directory), "--peer", str(peer),
             "--head", gang.head, "--listen", f"{host}:{port}", "--rpc-port", str(model.gang_port),
             "--head-host", self._head_hosts.get(model.name) or start.addresses[0]),
            f"{'127.0.0.1' if host in ('0.0.0.0', '') else host}:{port}")
        gang.handles.append(handle)
        gang.parts.append({"role": TUNNEL_ROLE, "pid": handle.pid, "unit": handle.unit})
        gang.tunnel_port = port
        gang.tunnel_dir = directory

    async def _stop(self, name: str) -> None:
        gang = self.gangs.pop(name, None)
        if gang is None:
            return
        grace = self.node.config.supervisor.stop_timeout_s
        for handle in reversed(gang.handles):
            with contextlib.suppress(Exception):
                await handle.stop(grace)
        self.counters["stops"] += 1
        log.info("gang %s of %s: rank %d stopped", gang.gang, name, gang.rank)

    async def stop(self, restart: bool = False) -> None:
        """This agent stops: every part with it; for a restart (``restart``: systemd starts the
        agent again) they keep running for the next agent to adopt (:meth:`adopt`)."""
        async with self._lock:
            if restart:
                log.info("restarting: %d gang part(s) keep running for the next agent", len(self.gangs))
                self.gangs.clear()
                return
            for name in list(self.gangs):
                await self._stop(name)

    async def adopt(self) -> set[str]:
        """Take over the parts an earlier agent of this node left running (the systemd runner's
        units outlive it): for each gang entry naming this host at rank r > 0, the units of
        one gang labelled with this node, that rank, the entry's shared hash and a head, every
        role this host runs for it (its tunnel exit included) running. Returns the adopted units'
        names; the supervisor stops every other gang unit (agent/supervision/supervisor.py)."""
        try:
            return await self._adopt()
        finally:
            self.adoption_over.set()

    async def _adopt(self) -> set[str]:
        try:
            handles = await self.node.runner.adoptable(self.node.node_name, GANG_UNIT_PREFIX)
        except RunnerError as exc:
            log.warning("cannot list gang parts left by an earlier agent: %s", exc)
            return set()
        groups: dict[tuple[str, str], list[RunHandle]] = {}
        for handle in handles:
            labels = handle.labels
            model = self._entry(labels.get("model", ""))
            rank = gang_rank(model, str(self.mesh.node_id), self.node.node_name) if model is not None else None
            if (model is None or not rank or labels.get("gang_rank") != str(rank)
                    or labels.get("gang_shared_hash") != shared_hash(model) or not is_gang_id(labels.get("gang"))):
                continue
            groups.setdefault((model.name, labels["gang"]), []).append(handle)
        claimed: set[str] = set()
        for (name, gang_id), group in groups.items():
            model = self._entry(name)
            assert model is not None
            roles = {h.labels.get("gang_role") for h in group if h.running()}
            need = {r.value for r in roles_here(model, int(group[0].labels["gang_rank"]))}
            rpc = gang_engine(model).launch_shape is LaunchShape.WORKERS_THEN_HEAD
            if rpc:
                need.add(TUNNEL_ROLE)
            heads = {h.labels.get("gang_head") or h.labels.get("gang_peer") for h in group}
            size = group[0].labels.get("gang_size", "")
            if name in self.gangs or not need <= roles or len(heads) != 1 or not size.isdigit():
                continue
            head = heads.pop()
            if head is None or not is_node_id(head):
                continue
            gang = _Gang(name, gang_id, int(group[0].labels["gang_rank"]), int(size), NodeId(head),
                         [str(g) for g in model.gpus])
            for handle in sorted(group, key=lambda h: h.labels.get("gang_role") == TUNNEL_ROLE):  # as started
                tunnel = tunnel_of_labels(handle.labels)
                if tunnel is not None:
                    gang.tunnel_port = tunnel[2]
                    gang.tunnel_dir = tunnel_dir(self.node, model)
                    gang.tunnel_cert = read_tunnel_cert(gang.tunnel_dir)
                gang.parts.append({"role": handle.labels.get("gang_role"), "pid": handle.pid, "unit": handle.unit})
                gang.handles.append(handle)
                claimed.add(handle.unit or "")
            self.gangs[name] = gang
            log.info("gang %s of %s: rank %d adopted (%s)", gang_id, name, gang.rank,
                     ", ".join(f"{h.labels.get('gang_role')} pid {h.pid}" for h in group))
        return claimed

    def exits(self) -> list[TunnelEndView]:
        """The tunnel exits of this host's parts, as their processes last wrote their counters
        (for ``/metrics``)."""
        views = []
        for gang in self.gangs.values():
            model = self._entry(gang.model)
            if gang.tunnel_port is not None and model is not None:
                counters = read_counters(tunnel_dir(self.node, model), gang.rank) or TunnelCounters()
                views.append(TunnelEndView(gang.gang, "exit", counters))
        return views

    def memberships(self) -> list[GangMember]:
        """This host's places in gangs for the summary's ``gangs`` extension: one per gang
        whose parts all run here (a part that died is left out until the head restarts the gang)."""
        return [GangMember(g.model, g.gang, g.rank, g.size, g.head) for g in self.gangs.values() if g.running()]

    def status(self) -> dict[str, Any]:
        """For /v1/status and ``viiworkctl status``: the gangs this host lends parts to."""
        return {"parts": [{"model": g.model, "gang": g.gang, "rank": g.rank, "size": g.size, "head": g.head,
                           "gpus": g.gpus, "running": g.running(), "parts": g.parts} for g in self.gangs.values()],
                "refused": dict(self.refused)}


__all__ = ["GangWorker", "PartRole"]
