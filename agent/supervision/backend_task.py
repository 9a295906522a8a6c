"""One backend's long-lived task: it launches the engine, probes it and carries out the health ladder.

The ladder's decisions (agent/supervision/health_ladder.py) are a pure function; this task
feeds it what happened and does what it returns (docs/architecture.md, "A backend's life";
the rungs and timings are in agent/supervision/supervisor.py's docstring): launch (the
parts in agent/supervision/launch.py) and probe until ready, probe and read load while
healthy, drain and stop the engine, back off, respawn, or park on a command. Every wait
also ends on a command or the engine's exit (agent/supervision/waits.py).

One module over 400 lines: ``BackendTask`` is one state machine whose rungs share the
engine's handle, its exit watch, the command events and the ladder; split across modules
they would hand the whole object around. What stands alone is elsewhere: the decisions
(health_ladder.py), the waits (waits.py), the launch's parts (launch.py), load (load.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import random
import time
from collections.abc import Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass, field, replace
from enum import Enum
from pathlib import Path
from typing import Any, Literal, TypeVar

import aiohttp

from viiwork.agent.config.schema import Config
from viiwork.agent.supervision import health_ladder as hl
from viiwork.agent.supervision.backends import Backend, BackendState, ModelRuntime, ModelState
from viiwork.agent.supervision.engine_keys import EngineKeyError, auth_headers, write_env_file, write_key
from viiwork.agent.supervision.launch import (
    backend_key_dir,
    backend_socket_path,
    backend_spec,
    free_loopback_port,
    launch_request,
)
from viiwork.agent.supervision.load import LOAD_READ_TIMEOUT_S, record_load
from viiwork.agent.supervision.runners.base import ExitInfo, RunHandle, Runner, RunnerError
from viiwork.agent.supervision.waits import (
    Outcome,
    Wake,
    acquire_gate,
    adapter_bug,
    probe_error,
    timed,
    timed_out,
    until,
)
from viiwork.engines.contract import BackendSpec, Load, Probe
from viiwork.mesh.persist import DISK_ERRNOS, PendingWrites

T = TypeVar("T")

# One logger for all of the supervisor's messages, whichever module logs them.
log = logging.getLogger("viiwork.agent.supervision.supervisor")

#: An engine that exits this soon after launch may have lost a race for its port.
QUICK_EXIT_S = 2.0
#: The longest pause between probes while a backend starts (docs/architecture.md, "A backend's life": every 1 s).
START_PROBE_INTERVAL_S = 1.0
#: How often a drain looks at routing's in-flight count (routing changes it without notifying).
DRAIN_POLL_S = 0.05
#: Bound on a runner's start() (a D-Bus round trip for systemd, a fork for processes).
RUNNER_START_TIMEOUT_S = 30.0


@dataclass(eq=False)
class NodeContext:
    """What the backend tasks of one node share with the supervisor.

    ``config``: the current config (a reload replaces it: health settings apply from then
    on). ``gate``: the load gate (``supervisor.max_parallel_loads`` backends load at once).
    ``vendor_of``: a configured GPU -> "nvidia", "amd" or "unknown". ``environ``: what
    engines inherit (None: ``os.environ``). ``writes``: key files a launch could not write
    (a full disk): shown with the state dir's pending writes in /v1/status and doctor,
    retried by the backend's own task. ``tasks``: every backend's task (the ports in use, the
    respawns under way). ``respawn_cap``: ``supervisor.max_concurrent_respawns`` (read at
    start, like the load gate): how many backends may be down for a respawn before a probe
    failure's respawn is deferred; ``respawn_gate`` holds as many relaunch slots (a relaunch
    after a failure holds one until the new engine is ready or fails).
    """

    config: Config
    runner: Runner
    http: aiohttp.ClientSession
    node_name: str
    vendor_of: Callable[[str], str]
    environ: Mapping[str, str] | None
    gate: asyncio.Semaphore
    engine_dir: Path
    host_cpus: int
    writes: PendingWrites = field(default_factory=PendingWrites)
    tasks: list[BackendTask] = field(default_factory=list)
    respawn_cap: int = 1
    respawn_gate: asyncio.Semaphore = field(init=False)

    def __post_init__(self) -> None:
        self.respawn_gate = asyncio.Semaphore(self.respawn_cap)

    def respawn_free(self) -> bool:
        """Whether fewer than ``respawn_cap`` backends are down for a respawn (docs/reliability.md)."""
        return sum(1 for t in self.tasks if t.respawning) < self.respawn_cap


class _Stop(Enum):
    COMMAND = "command"    # asked to stop (down, stop)


@dataclass
class _Failure:
    """Why one run of a backend ended badly; ``exited`` when the process is gone."""

    reason: str
    exit: ExitInfo | None = None
    quick_exit: bool = False
    # The backend's key file could not be written (a full or read-only disk): not the engine's
    # fault, so no respawn is spent; the launch is retried every PendingWrites.retry_s.
    disk: bool = False
    # A gang that lost a part because a worker host is away (dead, left, leaving: GangLauncher
    # ``away``): not the engine's fault either, so no respawn is spent and the launch is
    # retried as a disk fault's (it waits for the host: docs/mesh.md, "Gangs"); logged.
    host_away: bool = False
    # What the ladder decided already (the probe failure that ended health), else None.
    planned: tuple[hl.Action, ...] | None = None


@dataclass(eq=False)
class BackendTask:
    """One backend's task and the supervisor's private bookkeeping for it (the Backend is the
    public view). The supervisor sets ``want_running`` through ``command`` and waits for
    ``settled``; ``changed`` wakes the task."""

    node: NodeContext
    runtime: ModelRuntime
    backend: Backend
    config_hash: str
    want_running: bool = True
    changed: asyncio.Event = field(default_factory=asyncio.Event)
    settled: asyncio.Event = field(default_factory=asyncio.Event)
    handle: RunHandle | None = None
    exit_task: asyncio.Future[ExitInfo] | None = None
    spec: BackendSpec | None = None
    ladder: hl.Ladder = field(default_factory=hl.Ladder)
    # The asyncio task running run(), None until started.
    task: asyncio.Task[None] | None = None
    # An engine left running by an earlier agent, taken over at start: (handle, port, key,
    # socket path or "").
    adopted: tuple[RunHandle, int, str, str] | None = None
    # A gang head's units of the adopted engine's gang (tunnels, a runtime): agent/gang/head.py adopt.
    adopted_parts: list[RunHandle] = field(default_factory=list)
    # Probes and load reads of the current launch: the agent's session plus the key.
    http: aiohttp.ClientSession | None = None
    # Down for a respawn: from the failure until the new engine is ready (or parked, dead).
    respawning: bool = False
    # Holds one of node.respawn_gate's relaunch slots.
    relaunch_slot: bool = False
    # An outlier report (Supervisor.report_outlier) the healthy watch has not seen yet.
    reported: asyncio.Event = field(default_factory=asyncio.Event)
    report_reason: str = ""

    @property
    def key_dir(self) -> Path:
        """The backend's private directory (its key file): agent/supervision/engine_keys.py."""
        return backend_key_dir(self.node.engine_dir, self.runtime.name, self.backend.index)

    # ----------------------------------------------------------------- what the supervisor calls

    def start(self) -> None:
        """Start the long-lived task (run)."""
        self.task = asyncio.create_task(self.run(), name=f"backend {self.backend.id}")

    def command(self, *, want_running: bool) -> None:
        """Ask the task to run the backend or to stop it; clears ``settled`` until it has."""
        if self.task is not None and want_running == self.want_running and not (
            want_running and self.backend.state is BackendState.DEAD
        ):
            return  # already running (or already stopping): nothing to restart
        self.want_running = want_running
        self.settled.clear()
        self.changed.set()
        if self.task is None:
            # Not started: nothing runs; the picture simply says what was asked.
            self.settled.set()

    def report(self, reason: str) -> bool:
        """The request path's outlier detection says this backend fails (``reason``): a healthy
        backend's watch ends its health as a failed probe streak would (``hl.Reported``).
        False (nothing done) when the backend is not healthy, or when the ladder declines the
        report (it would spend the last respawn: ``hl.ReportDeclined``, logged once)."""
        if self.backend.state is not BackendState.HEALTHY or self.task is None:
            return False
        config = self.node.config
        rules = hl.LadderRules.from_config(config.health, config.supervisor)
        if self.ladder.state is BackendState.HEALTHY and hl.declines_report(self.ladder, time.monotonic(), rules):
            for action in self.step(hl.Reported(reason)):
                if isinstance(action, hl.ReportDeclined):
                    self._declined(action)
            return False
        self.report_reason = reason
        self.reported.set()
        return True

    def _declined(self, action: hl.ReportDeclined) -> None:
        """Log a declined outlier report: the first since the backend became healthy at WARNING."""
        log.log(logging.WARNING if action.declined == 1 else logging.DEBUG,
                "backend %s kept in service: %s, but outlier reports never spend the last respawn "
                "(%d of health.max_respawns %d spent; %d report(s) declined)", self.backend.id, action.reason,
                self.ladder.spent, self.node.config.health.max_respawns, action.declined)

    def step(self, event: hl.Event) -> tuple[hl.Action, ...]:
        """Move the ladder by ``event`` now; the backend shows its health figures."""
        config = self.node.config
        self.ladder, actions = hl.step(self.ladder, event, time.monotonic(),
                                       hl.LadderRules.from_config(config.health, config.supervisor))
        self.backend.healthy_since = self.ladder.healthy_since
        self.backend.respawns = self.ladder.respawns
        return actions

    async def terminate(self, drain: bool) -> None:
        """Drain (optionally) and stop the running engine, if any; SIGKILL after the grace."""
        backend = self.backend
        handle = self.handle
        if handle is None:
            if self.runtime.gang is not None:  # the parts of a gang whose engine ended, if any
                await self.runtime.gang.abort()
            return
        if drain and backend.in_flight > 0 and handle.running():
            previous = backend.state
            self._set(BackendState.DRAINING)
            await self._drain()
            if backend.state is BackendState.DRAINING:
                self._set(previous)
        grace = self.node.config.supervisor.stop_timeout_s
        try:
            info = await handle.stop(grace)
        except RunnerError as exc:
            log.error("backend %s: %s", backend.id, exc)
            info = ExitInfo(result="unknown", detail=str(exc))
        backend.exit_result = info.result
        backend.exit_status = info.returncode if info.signal is None else info.signal
        backend.pid = None
        self.handle = None
        self.discard_exit_task()

    def discard_exit_task(self) -> None:
        if self.exit_task is not None and not self.exit_task.done():
            self.exit_task.cancel()
        self.exit_task = None

    async def close_http(self) -> None:
        if self.http is not None:
            session, self.http = self.http, None
            await session.close()

    # ----------------------------------------------------------------- the ladder

    async def run(self) -> None:
        """The backend's long-lived task: the ladder, forever, until cancelled by the supervisor."""
        try:
            await self._run_forever()
        finally:
            self._respawn_over()

    async def _run_forever(self) -> None:
        backend = self.backend
        while True:
            self.changed.clear()
            try:
                if not self.want_running:
                    keep = backend.reason if backend.state is BackendState.DEAD else ""
                    await self._park(BackendState.STOPPED, keep)
                    continue
                result = await self._run_once()
                if isinstance(result, _Failure):
                    await self._after_failure(result)
            except Exception as exc:  # a bug here must not silently end supervision
                log.exception("supervision of backend %s failed", backend.id)
                try:
                    await self.terminate(drain=False)
                except Exception:
                    log.exception("backend %s: stopping after the failure failed too", backend.id)
                self.step(hl.Broken(f"supervisor error: {exc!r}"))
                self._respawn_over()
                self._set(BackendState.DEAD, reason=self.ladder.reason)
                self._update_model_state()
                self.settled.set()
                await self.changed.wait()  # `up` (or stop) decides what happens next

    async def _park(self, state: BackendState, reason: str) -> None:
        """Stop the engine (draining first), show ``state``, and wait for a command."""
        await self.terminate(drain=True)
        self._respawn_over()
        self.step(hl.Parked())
        self._set(state, reason=reason, phase="", progress=-1.0, port=None, socket_path=None)
        self._update_model_state()
        self.settled.set()
        await self.changed.wait()

    async def _run_once(self) -> _Stop | _Failure:
        """One launch (with the free retry) until a failure or a command."""
        backend = self.backend
        self.step(hl.Launched())
        self._set(BackendState.STARTING, phase="waiting for a load slot", progress=-1.0, reason="")
        self._update_model_state()
        self.settled.set()
        # An adopted engine has its model loaded already: it does not wait for the gate.
        gated = self.adopted is None
        if gated and not await acquire_gate(self.node.gate, self.changed):
            self._release_relaunch_slot()
            return _Stop.COMMAND
        try:
            result = await self._launch_until_ready()
            if isinstance(result, _Failure) and result.quick_exit and self.want_running:
                log.info("backend %s exited within %.0f s of launch (%s): retrying once on a new port",
                         backend.id, QUICK_EXIT_S, result.reason)
                result = await self._launch_until_ready()
        finally:
            if gated:
                self.node.gate.release()
            self._release_relaunch_slot()
        if result is not True:
            return result
        return await self._watch_healthy()

    async def _launch_until_ready(self) -> Literal[True] | _Stop | _Failure:
        """Launch the engine and probe it until ready; True when ready."""
        started = await self._launch()
        if isinstance(started, _Failure):
            return started
        return await self._probe_until_ready(started)

    async def _launch(self) -> float | _Failure:
        """Stop what runs, write the key, build the command and start (or adopt) the engine;
        returns the monotonic time it started."""
        node = self.node
        backend = self.backend
        model = self.runtime.config
        adopted, self.adopted = self.adopted, None
        parts, self.adopted_parts = self.adopted_parts, []
        await self.terminate(drain=False)
        gang = self.runtime.gang
        if gang is not None and adopted is not None:  # the gang of the engine left running, or a new one
            try:
                await gang.adopt(dict(adopted[0].labels), parts)
            except Exception as exc:  # GangError: stop what was left, start a new gang
                log.warning("backend %s: not adopting %s: %s; starting a new gang", backend.id,
                            adopted[0].unit or adopted[0].pid, exc)
                grace = node.config.supervisor.stop_timeout_s
                await asyncio.gather(*(h.stop(grace) for h in (adopted[0], *parts)), return_exceptions=True)
                adopted = None
        used = {t.backend.port for t in node.tasks if t is not self and t.backend.port is not None}
        key_dir = self.key_dir
        if adopted is not None:
            _, port, key, sock = adopted
        else:
            sock = backend_socket_path(self.runtime.engine, key_dir, backend)
            port = 0 if sock else free_loopback_port(used)
            try:
                key, _ = write_key(key_dir, getattr(node.runner, "engine_user", None))
                node.writes.succeeded(f"engine key of {backend.id}", key_dir / "key")
                if sock:  # a socket file left by an engine that died: the new one binds afresh
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(sock)
            except EngineKeyError as exc:
                return self._key_failure(f"engine key of {backend.id}", exc)
            except OSError as exc:
                return _Failure(reason=str(exc))
        spec = backend_spec(model, backend, port=port, socket_path=sock, key_dir=key_dir,
                            vendor=self._vendor(backend.gpus), host_cpus=node.host_cpus)
        if gang is not None and adopted is None:  # a gang's head: its parts first (agent/gang/head.py)
            self._set(BackendState.STARTING, phase="starting the gang's parts on its hosts", progress=-1.0, reason="")
            try:
                command = await gang.prepare(spec)
            except Exception as exc:  # GangError: the launch fails, the ladder backs off
                # Hosts away from the mesh (``nothing_ran``): no engine ran, so no respawn is
                # spent and the launch is retried like a disk fault's: a gang whose worker is
                # down for a while comes back when it returns, without `viiworkctl up`.
                return _Failure(reason=str(exc), disk=bool(getattr(exc, "nothing_ran", False)))
        else:
            command = self.runtime.engine.build_command(spec)
        env_file = None
        if command.key_env and adopted is None:  # an engine that reads its key from the environment (vLLM)
            try:
                env_file = str(write_env_file(key_dir, command.key_env, key))
                node.writes.succeeded(f"engine environment file of {backend.id}", Path(env_file))
            except EngineKeyError as exc:
                return self._key_failure(f"engine environment file of {backend.id}", exc)
        request = launch_request(node.config, node.node_name, model, backend, digest=self.config_hash, spec=spec,
                                 command=command, environ=os.environ if node.environ is None else node.environ,
                                 key_dir=key_dir, env_file=env_file)
        if gang is not None:  # the gang id, for adoption by the next agent
            request = replace(request, labels={**request.labels, **gang.labels()})
        if gang is not None and adopted is None and gang.server_firewall is not None:
            request = replace(request, firewall=gang.server_firewall)  # an SGLang head's ports
        self.spec = spec
        backend.port = port or None
        backend.socket_path = sock or None
        backend.api_key = key
        await self.close_http()
        # The agent's timeouts, plus this launch's key on every probe and load read; the
        # agent's pool for a port, a connector of its own for a socket.
        if sock:
            self.http = aiohttp.ClientSession(connector=aiohttp.UnixConnector(path=sock),
                                              timeout=node.http.timeout, headers=auth_headers(key))
        else:
            self.http = aiohttp.ClientSession(connector=node.http.connector, connector_owner=False,
                                              timeout=node.http.timeout, headers=auth_headers(key))
        backend.load = None
        backend.speed.reset()  # a new engine process: its counters start at 0
        backend.load_at = None
        backend.load_stale = False
        backend.last_success_at = None  # a success of the engine before counts for nothing now
        self._set(BackendState.STARTING, phase="adopting" if adopted else "launching", progress=-1.0, reason="")
        if adopted is not None:
            handle = adopted[0]
        else:
            try:
                async with asyncio.timeout(RUNNER_START_TIMEOUT_S):
                    handle = await node.runner.start(request)
            except RunnerError as exc:
                if gang is not None:
                    await gang.abort()
                return _Failure(reason=str(exc))
            except TimeoutError:
                if gang is not None:
                    await gang.abort()
                return _Failure(reason=f"runner did not start the engine within {RUNNER_START_TIMEOUT_S:.0f} s")
        if gang is not None:
            handle = gang.watch(handle)
        started = time.monotonic()
        self.handle = handle
        self.exit_task = asyncio.ensure_future(handle.wait())
        backend.pid = handle.pid
        backend.unit = handle.unit
        backend.started_at = started
        log.info("backend %s %s: pid %s, %s", backend.id, "adopted" if adopted else "launched", handle.pid,
                 spec.address)
        return started

    async def _probe_until_ready(self, started: float) -> Literal[True] | _Stop | _Failure:
        """Probe the engine launched at ``started`` until ready (True), its exit, a command or
        the startup timeout; shows its phase and progress meanwhile."""
        backend = self.backend
        timeout_s = self.runtime.config.effective_startup_timeout_s
        deadline = started + timeout_s
        interval = min(START_PROBE_INTERVAL_S, self.node.config.health.interval_s)
        while True:
            remaining = deadline - time.monotonic()
            got = await self._until(self.runtime.engine.probe(self._http(), backend.base_url),
                                    timeout=max(0.0, min(self.node.config.health.timeout_s, remaining)))
            if got.wake is Wake.EXITED:
                return self._exited(quick_ok=True)
            if got.wake is Wake.COMMAND:
                return _Stop.COMMAND
            if got.wake is Wake.DONE and got.error is None:
                probe = got.result
                assert probe is not None  # the contract: probe() returns a Probe or raises
                if probe.ready:
                    self.step(hl.Ready())
                    self.respawning = False
                    self._set(BackendState.HEALTHY, phase="", progress=-1.0, reason="")
                    self._update_model_state()
                    log.info("backend %s healthy after %.1f s", backend.id, time.monotonic() - started)
                    return True
                if probe.phase != backend.phase or probe.progress != backend.progress:
                    self._set(BackendState.STARTING, phase=probe.phase, progress=probe.progress)
            elif got.wake is Wake.DONE:
                adapter_bug(self.runtime.config.engine, "probe", got.error)
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                phase = f" (phase: {backend.phase})" if backend.phase else ""
                return _Failure(reason=f"startup timeout: not ready after {timeout_s:g} s{phase}")
            wait: Outcome[None] = await self._until(None, timeout=min(interval, remaining))
            if wait.wake is Wake.EXITED:
                return self._exited(quick_ok=True)
            if wait.wake is Wake.COMMAND:
                return _Stop.COMMAND

    async def _watch_healthy(self) -> _Stop | _Failure:
        """Probe and read load while healthy; returns on a command, an exit, max_failures or an
        outlier report (``report``).

        Probes and load reads run on their own schedules, each under its own deadline, so a
        hung engine's load read never delays the probe that will notice it.
        """
        backend = self.backend
        engine = self.runtime.engine
        health = self.node.config.health
        sup = self.node.config.supervisor
        assert self.spec is not None
        now = time.monotonic()
        next_probe = now + health.interval_s
        next_load = now
        probe_task: asyncio.Future[Outcome[Probe]] | None = None
        load_task: asyncio.Future[Outcome[Load]] | None = None
        report_task: asyncio.Future[Any] | None = None
        self.reported.clear()  # a report of an earlier run (there is no await since Ready)
        deferred = False  # a respawn deferred (logged once per streak)
        last_error = ""
        try:
            while True:
                if report_task is None:
                    report_task = asyncio.ensure_future(self.reported.wait())
                now = time.monotonic()
                if load_task is None and now >= next_load:
                    load_task = asyncio.ensure_future(timed(
                        engine.read_load(self._http(), self.spec, backend.base_url), LOAD_READ_TIMEOUT_S))
                if probe_task is None and now >= next_probe:
                    probe_task = asyncio.ensure_future(timed(
                        engine.probe(self._http(), backend.base_url), health.timeout_s))
                due = [at for at, task in ((next_load, load_task), (next_probe, probe_task)) if task is None]
                running = [task for task in (load_task, probe_task, report_task) if task is not None]
                got: Outcome[None] = await self._until(None, timeout=max(0.0, min(due) - now) if due else None,
                                                       also=running)
                if got.wake is Wake.EXITED:
                    return self._exited(quick_ok=False)
                if got.wake is Wake.COMMAND:
                    return _Stop.COMMAND
                if load_task is not None and load_task.done():
                    record_load(self.runtime, backend, load_task.result(),
                                self.node.config.supervisor.load_stale_after_s)
                    load_task = None
                    next_load = time.monotonic() + sup.load_poll_interval_s
                actions: tuple[hl.Action, ...] = ()
                if report_task.done():
                    report_task = None
                    self.reported.clear()
                    actions = self.step(hl.Reported(self.report_reason, respawn_free=self.node.respawn_free()))
                elif probe_task is not None and probe_task.done():
                    probe = probe_task.result()
                    probe_task = None
                    next_probe = time.monotonic() + health.interval_s
                    if probe.wake is Wake.DONE and probe.error is None:
                        assert probe.result is not None  # the contract: probe() returns a Probe or raises
                        if probe.result.ready:
                            self.step(hl.ProbeOk())
                            deferred = False
                            continue
                    adapter_bug(self.runtime.config.engine, "probe", probe.error)
                    last_error = probe_error(probe, health.timeout_s)
                    actions = self.step(hl.ProbeFailed(last_error, timed_out=timed_out(probe), busy=self._busy(),
                                                       succeeded_at=backend.last_success_at,
                                                       respawn_free=self.node.respawn_free()))
                for action in actions:
                    if isinstance(action, hl.ProbeExcused):
                        log.debug("backend %s: probe timed out while busy; not counted", backend.id)
                    elif isinstance(action, hl.ProbeContradicted):
                        deferred = False
                        log.debug("backend %s: probe failed but a request succeeded %.1f s before; not counted",
                                  backend.id, action.ago_s)
                    elif isinstance(action, hl.ProbeCounted):
                        log.warning("backend %s: probe failed (%d/%d): %s",
                                    backend.id, action.failures, health.max_failures, last_error)
                    elif isinstance(action, hl.ReportDeclined):
                        self._declined(action)
                    elif isinstance(action, hl.RespawnDeferred) and not deferred:
                        deferred = True
                        log.warning("backend %s kept in service: %s, but %d backend(s) of this node are down "
                                    "for a respawn already (supervisor.max_concurrent_respawns)",
                                    backend.id, action.reason, self.node.respawn_cap)
                if self.ladder.state is not BackendState.HEALTHY:
                    # Counted at once: another backend's probe may be judged before this one stops.
                    self.respawning = any(isinstance(a, hl.Backoff) for a in actions)
                    return _Failure(reason=self.ladder.reason, planned=actions)
        finally:
            pending = [t for t in (probe_task, load_task, report_task) if t is not None]
            for task in pending:
                task.cancel()
            await asyncio.gather(*pending, return_exceptions=True)

    async def _after_failure(self, failure: _Failure) -> None:
        """Unhealthy: carry out what the ladder decides (agent/supervision/health_ladder.py): stop what is
        left, then respawn after a backoff, wait for the disk, or die."""
        backend = self.backend
        actions = failure.planned
        if actions is None:
            actions = self.step(hl.Failed(failure.reason, disk=failure.disk or failure.host_away))
        self.respawning = not any(isinstance(a, hl.Die) for a in actions)
        self._set(BackendState.UNHEALTHY, reason=failure.reason, phase="", progress=-1.0)
        if not failure.disk:
            log.warning("backend %s unhealthy: %s%s", backend.id, failure.reason,
                        "; its gang's worker host is away: no respawn spent" if failure.host_away else "")
        for action in actions:
            if isinstance(action, hl.RetryDisk):
                self._update_model_state()
                await self._until(None, timeout=self.node.writes.retry_s)
            elif isinstance(action, hl.StopEngine):
                await self.terminate(drain=True)
                self._set(BackendState.UNHEALTHY)
            elif isinstance(action, hl.Die):
                self._respawn_over()
                log.error("backend %s dead after %d respawn(s): %s", backend.id, self.ladder.spent, action.reason)
                self._set(BackendState.DEAD, reason=action.reason)
                self._update_model_state()
                self.settled.set()
                await self.changed.wait()
            elif isinstance(action, hl.Backoff):
                self._update_model_state()
                delay = action.delay_s + random.uniform(0.0, action.jitter_s)
                got: Outcome[None] = await self._until(None, timeout=delay)
                if got.wake is Wake.COMMAND:
                    return
                if not await self._take_relaunch_slot():
                    return
                for then in self.step(hl.BackoffOver()):
                    if isinstance(then, hl.Respawn):
                        log.info("backend %s: respawn %d (budget %d/%d)", backend.id, then.respawns,
                                 then.spent, self.node.config.health.max_respawns)

    # ----------------------------------------------------------------- respawn slots

    async def _take_relaunch_slot(self) -> bool:
        """Wait for one of the node's relaunch slots (``supervisor.max_concurrent_respawns``
        relaunches at once); False on a command (nothing held then)."""
        if self.relaunch_slot:
            return True
        gate = self.node.respawn_gate
        if not gate.locked():
            await gate.acquire()  # free: taken at once, without yielding to another backend
        else:
            log.info("backend %s waits for a respawn slot (%d relaunch(es) at once on this node)",
                     self.backend.id, self.node.respawn_cap)
            self._set(BackendState.UNHEALTHY, phase="waiting for a respawn slot")
            if not await acquire_gate(gate, self.changed):
                return False
        self.relaunch_slot = True
        self._set(BackendState.UNHEALTHY, phase="")
        return True

    def _release_relaunch_slot(self) -> None:
        if self.relaunch_slot:
            self.relaunch_slot = False
            self.node.respawn_gate.release()

    def _respawn_over(self) -> None:
        """No respawn under way any more (ready, parked, dead or the task's end)."""
        self.respawning = False
        self._release_relaunch_slot()

    # ----------------------------------------------------------------- helpers

    def _key_failure(self, what: str, exc: EngineKeyError) -> _Failure:
        """A key file that could not be written: a disk fault is a pending write, retried
        without spending a respawn (docs/reliability.md, "The state dir"); anything else fails
        the launch like an engine would."""
        writes = self.node.writes
        if exc.errno is None or exc.errno not in DISK_ERRNOS or exc.path is None:
            return _Failure(reason=str(exc))
        writes.failed(what, exc.path, OSError(exc.errno, os.strerror(exc.errno)),
                      kept=f"backend {self.backend.id} waits")
        return _Failure(reason=f"{exc}; retried every {writes.retry_s:g} s", disk=True)

    def _http(self) -> aiohttp.ClientSession:
        return self.http if self.http is not None else self.node.http

    async def _until(self, work: Awaitable[T] | None, timeout: float | None,
                     also: Iterable[asyncio.Future[Any]] = ()) -> Outcome[T]:
        """``waits.until`` on this backend's command event and engine exit."""
        return await until(self.changed, self.exit_task, work, timeout, also)

    def _exited(self, quick_ok: bool) -> _Failure:
        backend = self.backend
        assert self.exit_task is not None
        task = self.exit_task
        if task.cancelled():
            info = ExitInfo(result="unknown")
        elif task.exception() is not None:
            info = ExitInfo(result="unknown", detail=f"runner lost track of it: {task.exception()!r}")
        else:
            info = task.result()
        lived = time.monotonic() - (backend.started_at or 0.0)
        backend.exit_result = info.result
        backend.exit_status = info.returncode if info.signal is None else info.signal
        backend.pid = None
        self.handle = None
        self.discard_exit_task()
        gang = self.runtime.gang
        away = gang is not None and gang.away() is not None  # the part lost, or the engine died of it
        return _Failure(reason=f"exited: {info.describe()}", exit=info, quick_exit=quick_ok and lived < QUICK_EXIT_S,
                        host_away=away)

    async def _drain(self) -> None:
        backend = self.backend
        deadline = time.monotonic() + self.node.config.health.drain_timeout_s
        log.info("backend %s: draining %d request(s)", backend.id, backend.in_flight)
        while backend.in_flight > 0 and time.monotonic() < deadline:
            if self.exit_task is not None and self.exit_task.done():
                return
            await asyncio.sleep(min(DRAIN_POLL_S, max(0.0, deadline - time.monotonic())))
        if backend.in_flight > 0:
            log.warning("backend %s: %d request(s) still running after the %.0f s drain timeout",
                        backend.id, backend.in_flight, self.node.config.health.drain_timeout_s)

    def _set(self, state: BackendState, **fields: object) -> None:
        backend = self.backend
        changed = backend.state is not state
        backend.state = state
        for name, value in fields.items():
            if getattr(backend, name) != value:
                setattr(backend, name, value)
                changed = True
        if changed:
            self.runtime.notify()

    def _update_model_state(self) -> None:
        runtime = self.runtime
        if runtime.state is ModelState.DOWN:
            return
        dead = bool(runtime.backends) and all(b.state is BackendState.DEAD for b in runtime.backends)
        new = ModelState.DEAD if dead else ModelState.RUNNING
        if new is not runtime.state:
            runtime.state = new
            runtime.notify()

    def _vendor(self, gpus: tuple[str, ...]) -> str:
        if not gpus:
            return "cpu"
        vendors = {self.node.vendor_of(g) for g in gpus}
        return vendors.pop() if len(vendors) == 1 else "unknown"

    def _busy(self) -> bool:
        backend = self.backend
        return backend.in_flight > 0 or (backend.load is not None and not backend.load_stale and backend.load.busy > 0)
