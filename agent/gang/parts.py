"""Starting one part of a gang on this host, and waiting until the gang plan's level says it is up.

A worker's parts (agent/gang/worker.py) and the head's own parts other than the serving one
(a vLLM head's Ray runtime: agent/gang/head.py) are started here, through the node's runner
like any backend: a transient unit ``viiwork-gang-<model>-<gang>-r<rank>-<role>``
(agent/supervision/gang_units.py) in the engines' slice, pinned to this host's ``gpus`` of
the entry, with the entry's limits and sandbox, labelled with the gang id, rank, role and
the shared part's hash. The command is the adapter's (``gang_command``: engines/gang.py),
built from this host's own entry and the gang's addresses only. The ports the adapter says the
part binds (``gang_ports``) come with nftables rules the unit owns, admitting only the gang's
hosts (agent/gang/firewall.py), unless the entry sets ``gang_firewall = false``.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import sys
import time
from pathlib import Path

from viiwork.agent.config.gang import shared_hash
from viiwork.agent.config.schema import ModelConfig
from viiwork.agent.gang.firewall import FirewallError, part_firewall
from viiwork.agent.gang.tunnel_process import counters_path
from viiwork.agent.supervision.backend_task import NodeContext
from viiwork.agent.supervision.backends import Backend, BackendId
from viiwork.agent.supervision.gang_units import gang_labels, gang_unit_stem, tunnel_labels, tunnel_unit_stem
from viiwork.agent.supervision.launch import backend_spec, escape_name, free_loopback_port
from viiwork.agent.supervision.pinning import engine_environment
from viiwork.agent.supervision.runners.base import LaunchRequest, NftTable, RunHandle, RunnerError
from viiwork.engines.contract import BackendSpec
from viiwork.engines.gang import GangAddresses, GangEngine, GangPart, PartRole
from viiwork.engines.gang_plan import Ready
from viiwork.engines.registry import ENGINES

#: How long a part may take to reach its level (a port listening, a process running).
PART_READY_TIMEOUT_S = 60.0
#: A process counts as running once it has lived this long (it did not die on its arguments).
PROCESS_SETTLE_S = 0.5
#: A tunnel end that has not written its counters (every second) for this long is stuck.
TUNNEL_STALE_S = 10.0
#: A tunnel end's memory limit (it holds at most 16 connections of 64 KiB records).
TUNNEL_MEMORY_MAX_BYTES = 256 * 1024 * 1024


class PartFailed(Exception):
    """A part did not start or did not reach its level; the message says why."""


def gang_engine(model: ModelConfig) -> GangEngine:
    engine = ENGINES[model.engine]
    if not isinstance(engine, GangEngine):
        raise PartFailed(f"engine {model.engine!r} cannot serve a model across hosts")
    return engine


def part_spec(node: NodeContext, model: ModelConfig, rank: int) -> BackendSpec:
    """This host's spec for its part of ``model``'s gang: its own ``gpus``, a free loopback port
    (for a part that serves HTTP on this host), the key file of a gang part's private dir."""
    backend = Backend(id=BackendId(f"{model.name}-gang-r{rank}"), model=model.name, index=0,
                      gpus=model.backend_gpus(0), parallel=model.parallel)
    vendors = {node.vendor_of(g) for g in backend.gpus}
    return backend_spec(model, backend, port=free_loopback_port(), socket_path="", key_dir=part_dir(node, model),
                        vendor=vendors.pop() if len(vendors) == 1 else "unknown", host_cpus=node.host_cpus)


def part_dir(node: NodeContext, model: ModelConfig) -> Path:
    return node.engine_dir / f"{escape_name(model.name)}-gang"


async def start_part(node: NodeContext, model: ModelConfig, spec: BackendSpec, part: GangPart,
                     addresses: GangAddresses, head: str = "") -> RunHandle:
    """Start ``part`` (this host's, ``addresses.rank``) through the node's runner; ``head``: the
    head's node id, on a worker (a label for adoption). Raises :class:`PartFailed` when the
    runner cannot start it."""
    engine = gang_engine(model)
    command = engine.gang_command(spec, part.role, addresses)
    firewall = part_firewall_of(model, engine, part, addresses)
    environ = os.environ if node.environ is None else node.environ
    env = engine_environment(environ, vendor=spec.vendor, gpus=spec.gpus, model_env=model.env,
                             engine_env=command.env)
    request = LaunchRequest(
        name=gang_unit_stem(model.name, addresses.gang_id, part),
        argv=command.argv,
        env=env,
        description=f"viiwork gang {addresses.gang_id} of {model.name}: rank {part.rank} {part.role.value}",
        labels=gang_labels(node.node_name, model.name, addresses.gang_id, part, addresses.size, shared_hash(model),
                           head),
        log_path=str(part_log(node, model, part)),
        stop_timeout_s=node.config.supervisor.stop_timeout_s,
        memory_max_bytes=model.memory_max_bytes,
        cpu_weight=model.cpu_weight,
        tasks_max=model.tasks_max,
        sandbox=model.sandbox,
        private_dir=str(part_dir(node, model)),
        firewall=firewall,
    )
    with contextlib.suppress(OSError):
        Path(request.private_dir or "").mkdir(parents=True, exist_ok=True)
    try:
        return await node.runner.start(request)
    except RunnerError as exc:
        raise PartFailed(f"{part} of gang {addresses.gang_id}: {exc}") from None


def part_log(node: NodeContext, model: ModelConfig, part: GangPart) -> Path:
    """Where the process runner (and the systemd runner with file output) writes ``part``'s output."""
    log_dir = Path(node.config.supervisor.log_dir or (node.config.node.state_dir / "logs"))
    return log_dir / f"{escape_name(model.name)}-gang-r{part.rank}-{part.role.value}.log"


def log_tail(path: Path | None, lines: int = 2, limit: int = 400) -> str:
    """The last ``lines`` non-empty lines of the log at ``path`` (its last 16 KiB read), at
    most ``limit`` characters, for an error that says why a part exited; "" when unreadable."""
    if path is None:
        return ""
    try:
        with path.open("rb") as f:
            f.seek(max(0, f.seek(0, os.SEEK_END) - 16384))
            text = f.read().decode("utf-8", "replace")
    except OSError:
        return ""
    kept = [line.strip() for line in text.splitlines() if line.strip()][-lines:]
    tail = " | ".join(kept)
    return tail[-limit:]


def tunnel_dir(node: NodeContext, model: ModelConfig) -> Path:
    """This host's tunnel directory for ``model``'s gang: its end's credential, the other
    end's certificate, its counters (agent/gang/tunnel_process.py)."""
    return node.engine_dir / f"{escape_name(model.name)}-gang-tunnel"


async def start_tunnel(node: NodeContext, model: ModelConfig, gang_id: str, rank: int, size: int, peer: str,
                       args: tuple[str, ...], listen: str) -> RunHandle:
    """Start a tunnel end (``args``: tunnel_process's, from its ``entry``/``exit`` on) for
    worker rank ``rank`` through the runner, as the engine's user in the entry's sandbox;
    returns once it accepts on ``listen`` ("host:port"). ``peer``: the node at the other end.
    Raises :class:`PartFailed` (the end stopped)."""
    environ = os.environ if node.environ is None else node.environ
    log_dir = Path(node.config.supervisor.log_dir or (node.config.node.state_dir / "logs"))
    directory = str(tunnel_dir(node, model))
    port = int(listen.rpartition(":")[2])
    request = LaunchRequest(
        name=tunnel_unit_stem(model.name, gang_id, rank, args[0]),
        argv=(sys.executable, "-m", "viiwork.agent.gang.tunnel_process", *args),
        env={k: environ[k] for k in ("PATH", "LANG", "PYTHONPATH") if k in environ},
        description=f"viiwork gang {gang_id} of {model.name}: tunnel {args[0]} of rank {rank}",
        labels=tunnel_labels(node.node_name, model.name, gang_id, rank, size, shared_hash(model), port, peer),
        log_path=str(log_dir / f"{escape_name(model.name)}-gang-r{rank}-tunnel.log"),
        stop_timeout_s=node.config.supervisor.stop_timeout_s,
        memory_max_bytes=TUNNEL_MEMORY_MAX_BYTES,
        sandbox=model.sandbox,
        private_dir=directory,
    )
    counters = counters_path(Path(directory), rank)
    with contextlib.suppress(OSError):
        counters.unlink()  # an earlier gang's: the new end writes its own once it listens
    try:
        handle = await node.runner.start(request)
    except RunnerError as exc:
        raise PartFailed(f"the tunnel {args[0]} of rank {rank}: {exc}") from None
    try:
        # Up once it wrote its first counters (right after binding): no probe connection,
        # which an exit would count as a refused handshake.
        deadline = time.monotonic() + PART_READY_TIMEOUT_S
        while not tunnel_fresh(Path(directory), rank, TUNNEL_STALE_S):
            if not handle.running():
                info = await handle.wait()
                said = log_tail(Path(request.log_path or ""))
                raise PartFailed(f"it exited: {info.describe()}" + (f"; its log ends: {said}" if said else ""))
            if time.monotonic() >= deadline:
                raise PartFailed(f"not listening on {listen} within {PART_READY_TIMEOUT_S:.0f} s")
            await asyncio.sleep(0.1)
    except PartFailed as exc:
        with contextlib.suppress(Exception):
            await handle.stop(node.config.supervisor.stop_timeout_s)
        raise PartFailed(f"the tunnel {args[0]} of rank {rank}: {exc}") from None
    return handle


def tunnel_fresh(directory: Path, rank: int, max_age_s: float) -> bool:
    """Whether the tunnel end of ``rank`` wrote its counters less than ``max_age_s`` ago: it
    writes them every second (agent/gang/tunnel_process.py), so an older file means a frozen
    (SIGSTOP, a frozen cgroup) or wedged end, which no process check notices."""
    try:
        age = time.time() - counters_path(directory, rank).lstat().st_mtime
    except OSError:
        return False
    return age < max_age_s


def part_firewall_of(model: ModelConfig, engine: GangEngine, part: GangPart, addresses: GangAddresses) -> NftTable | None:
    """The nftables table ``part`` owns (agent/gang/firewall.py): the adapter's ``gang_ports``
    confined to the gang's hosts; None with ``gang_firewall = false`` or no ports. Raises
    :class:`PartFailed` when the rules cannot be made (a gang address that is not an IP)."""
    if not model.gang_firewall:
        return None
    try:
        return part_firewall(part, addresses, engine.gang_ports(part.role, addresses))
    except FirewallError as exc:
        raise PartFailed(f"{part} of gang {addresses.gang_id}: its nftables rules: {exc} "
                         "(or set gang_firewall = false)") from None


async def wait_ready(handle: RunHandle, level: Ready, listen: str | None,
                     timeout_s: float = PART_READY_TIMEOUT_S, log: Path | None = None) -> None:
    """Return once ``handle``'s part reached ``level``: ``PROCESS`` running for
    :data:`PROCESS_SETTLE_S`, ``PORT`` its ``listen`` ("host:port") accepting TCP. Raises
    :class:`PartFailed` when it exits first (with the end of its ``log``, where it wrote why)
    or ``timeout_s`` passes. ``PROBE`` is the serving
    part's, which the backend's own task probes: not waited for here."""
    deadline = time.monotonic() + timeout_s
    settled = time.monotonic() + PROCESS_SETTLE_S
    while True:
        if not handle.running():
            info = await handle.wait()
            said = log_tail(log)
            raise PartFailed(f"it exited: {info.describe()}" + (f"; its log ({log}) ends: {said}" if said else ""))
        now = time.monotonic()
        if level is Ready.PROCESS and now >= settled:
            return
        if level is Ready.PORT and listen is not None and now >= settled and await _accepts(listen):
            return
        if level is Ready.PROBE or (level is Ready.PORT and listen is None):
            return
        if now >= deadline:
            raise PartFailed(f"not {level.value} within {timeout_s:.0f} s")
        await asyncio.sleep(0.2)


async def _accepts(listen: str) -> bool:
    host, _, port = listen.rpartition(":")
    try:
        async with asyncio.timeout(1.0):
            _, writer = await asyncio.open_connection(host.strip("[]"), int(port))
    except (OSError, TimeoutError, ValueError):
        return False
    writer.close()
    with contextlib.suppress(OSError):
        await writer.wait_closed()
    return True


def roles_here(model: ModelConfig, rank: int) -> tuple[PartRole, ...]:
    """The parts this host of ``rank`` runs, but the serving one (its backend's own launch)."""
    from viiwork.engines.gang import roles_at

    shape = gang_engine(model).launch_shape
    return tuple(r for r in roles_at(shape, rank) if r is not PartRole.SERVER)
