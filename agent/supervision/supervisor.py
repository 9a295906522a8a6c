"""The supervisor: launches each model's backends through a runner and walks the health ladder.

docs/architecture.md, "A backend's life". One long-lived task per backend runs the ladder of
``viiwork.agent.supervision.health_ladder``
(starting -> healthy -> unhealthy -> respawn after a backoff -> dead; docs/reliability.md):
that module decides (which probe failures count, when the respawn budget refills, how long
the backoff, when a backend is dead) as a pure function; this one runs the engines, waits,
and carries out what it returns:

- starting: waits for the node-wide load gate (``supervisor.max_parallel_loads`` backends
  load at once), takes a free loopback port, launches, and probes every second (or every
  ``health.interval_s`` when that is shorter) showing the engine's phase and progress. Only
  the startup timeout or an exit ends patience. An exit within 2 s of the launch is retried
  once at once on a new port (another process may have taken the port between our bind
  test and the engine's bind) without spending the respawn budget.
- healthy: probes every ``health.interval_s`` with a ``health.timeout_s`` deadline. Load is
  read every ``supervisor.load_poll_interval_s`` (1 s deadline); a failed read keeps the last
  value until it is ``supervisor.load_stale_after_s`` old, then the backend is marked
  ``load_stale`` (slots fall back to ``parallel``, busy to routing's in-flight count).
- unhealthy: a still-running engine is drained (up to ``health.drain_timeout_s``) and stopped
  (SIGTERM, then SIGKILL after ``supervisor.stop_timeout_s``) before the backoff.

``down``/``stop`` drain (state DRAINING admits nothing), stop the engines and park the
backends as STOPPED; ``up`` restarts them and revives dead ones with a fresh budget.

Every change of a backend's state or capacity calls ``ModelRuntime.notify()`` so routing
can dispatch queued requests at once. Single-threaded: everything runs on the agent's loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import logging
import os
import socket
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import aiohttp

from viiwork.agent.supervision import health_ladder as hl
from viiwork.agent.supervision.backends import Backend, BackendId, BackendState, ModelRuntime, ModelState
from viiwork.agent.supervision.engine_keys import (
    EngineKeyError,
    auth_headers,
    engine_dir,
    read_key,
    write_env_file,
    write_key,
)
from viiwork.agent.supervision.pinning import engine_environment
from viiwork.agent.supervision.runners.base import ExitInfo, LaunchRequest, RunHandle, Runner, RunnerError
from viiwork.engines.contract import (
    BackendSpec,
    EngineError,
    EngineUnavailable,
    Load,
    Probe,
    binds_unix_socket,
    socket_path_problem,
)
from viiwork.engines.registry import ENGINES
from viiwork.mesh.persist import DISK_ERRNOS, PendingWrites

if TYPE_CHECKING:
    from viiwork.agent.config.schema import Config, ModelConfig

log = logging.getLogger(__name__)

#: An engine that exits this soon after launch may have lost a race for its port.
QUICK_EXIT_S = 2.0
#: The longest pause between probes while a backend starts (docs/architecture.md, "A backend's life": every 1 s).
START_PROBE_INTERVAL_S = 1.0
#: Deadline of one load read (docs/architecture.md, "A backend's life").
LOAD_READ_TIMEOUT_S = 1.0
#: How often a drain looks at routing's in-flight count (routing changes it without notifying).
DRAIN_POLL_S = 0.05
#: Bound on a runner's start() (a D-Bus round trip for systemd, a fork for processes).
RUNNER_START_TIMEOUT_S = 30.0
#: Extra time over drain + stop deadlines that down()/stop() wait for backends to settle.
SETTLE_MARGIN_S = 15.0


class UnknownModel(KeyError):
    """down/up named a model this node does not serve."""

    def __init__(self, name: str, known: list[str]) -> None:
        super().__init__(name)
        self.name = name
        self.known = known

    def __str__(self) -> str:
        return f"unknown model {self.name!r}; this node serves: {', '.join(self.known) or 'none'}"


def config_hash(model: ModelConfig) -> str:
    """sha256 (hex) of a model entry, normalised, plus its engine's name and command_version.

    Normalised: the entry as JSON with sorted keys, GPUs as strings, the engine's options
    with their defaults filled in. Two configs that launch the same command hash the same,
    and an adapter that changes its command (bumps ``command_version``) changes every hash,
    so an adopted backend is kept exactly when a fresh launch would run the same thing.
    """
    data = model.model_dump(mode="json", exclude={"options"})
    data["gpus"] = [str(g) for g in model.gpus]
    options = model.options
    data["options"] = options.model_dump(mode="json") if options is not None else None
    engine = ENGINES[model.engine]
    payload = {"model": data, "engine": engine.name, "command_version": engine.command_version}
    text = json.dumps(payload, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()


def escape_name(text: str) -> str:
    """``text`` safe for a file name or unit name: [A-Za-z0-9._-] kept, others as _xx hex."""
    out = []
    for ch in text:
        if ch.isascii() and (ch.isalnum() or ch in "._-"):
            out.append(ch)
        else:
            out.extend(f"_{b:02x}" for b in ch.encode())
    return "".join(out)


def backend_log_path(config: Config, model: str, index: int) -> Path:
    """Where the process runner writes backend ``index`` of ``model``'s output."""
    log_dir = config.supervisor.log_dir or (config.node.state_dir / "logs")
    return Path(log_dir) / f"{escape_name(model)}-{index}.log"


def free_loopback_port(avoid: set[int] | frozenset[int] = frozenset()) -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (bind to port 0), not in ``avoid``."""
    for _ in range(64):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        if port not in avoid:
            return port
    raise RuntimeError("no free loopback port found in 64 tries")


class _Wake(Enum):
    """What ended a wait of a backend's task."""

    DONE = "done"          # the awaited work finished (result or exception in the outcome)
    EXITED = "exited"      # the engine process ended
    COMMAND = "command"    # down/up/stop changed what the backend should do
    TIMEOUT = "timeout"


@dataclass
class _Outcome:
    wake: _Wake
    result: Any = None
    error: BaseException | None = None


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
    # What the ladder decided already (the probe failure that ended health), else None.
    planned: tuple[hl.Action, ...] | None = None


@dataclass(eq=False)
class _Control:
    """The supervisor's private bookkeeping for one backend (the Backend is the public view)."""

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
    task: asyncio.Task[None] | None = None
    # An engine left running by an earlier agent, taken over at start: (handle, port, key,
    # socket path or "").
    adopted: tuple[RunHandle, int, str, str] | None = None
    # Probes and load reads of the current launch: the agent's session plus the key.
    http: aiohttp.ClientSession | None = None


class Supervisor:
    """Runs every configured model's backends through ``runner`` (module docstring).

    ``models``: one ``ModelRuntime`` per ``[[models]]`` entry, by name, built at once (the
    API can read them before ``start``). ``vendor_of`` maps a configured GPU (index or
    UUID, as a string) to "nvidia", "amd" or "unknown" (GPU inventory); it picks the pinning
    variables. ``http`` is used for probes and load reads; its own timeouts may be longer
    than the supervisor's deadlines, which are applied here.
    """

    def __init__(
        self,
        config: Config,
        runner: Runner,
        http: aiohttp.ClientSession,
        node_name: str,
        vendor_of: Callable[[str], str] = lambda gpu: "unknown",
        environ: Mapping[str, str] | None = None,
    ) -> None:
        self.config = config
        self.runner = runner
        self.http = http
        self.node_name = node_name
        self.vendor_of = vendor_of
        self._environ = environ
        self.max_parallel_loads = config.supervisor.max_parallel_loads
        self._gate = asyncio.Semaphore(self.max_parallel_loads)
        self.log_dir = config.supervisor.log_dir or (config.node.state_dir / "logs")
        self.engine_dir = engine_dir(config.node.state_dir, environ)
        # Key files a launch could not write (a full disk): shown with the state dir's pending
        # writes in /v1/status and doctor, retried by the backend's own task.
        self.writes = PendingWrites()
        self.host_cpus = max(1, len(os.sched_getaffinity(0)))
        self.models: dict[str, ModelRuntime] = {}
        self._controls: list[_Control] = []
        self._started = False
        for model in config.models:
            runtime = ModelRuntime(config=model, engine=ENGINES[model.engine])
            self._controls += self._build_backends(runtime)
            self.models[model.name] = runtime

    def _build_backends(self, runtime: ModelRuntime) -> list[_Control]:
        """Fill ``runtime.backends`` from its config; returns their (unstarted) controls."""
        model = runtime.config
        digest = config_hash(model)
        runtime.backends = []
        controls = []
        for index in range(model.backend_count):
            backend = Backend(
                id=BackendId(f"{model.name}-{index}"),
                model=model.name,
                index=index,
                gpus=model.backend_gpus(index),
                parallel=model.parallel,
            )
            runtime.backends.append(backend)
            controls.append(_Control(runtime=runtime, backend=backend, config_hash=digest))
        return controls

    # ----------------------------------------------------------------- lifecycle

    async def start(self) -> None:
        """Start one task per backend; returns at once (backends load in the background)."""
        if self._started:
            raise RuntimeError("Supervisor.start() called twice")
        self._started = True
        await self._adopt()
        for ctrl in self._controls:
            ctrl.task = asyncio.create_task(self._backend_main(ctrl), name=f"backend {ctrl.backend.id}")

    async def _adopt(self) -> None:
        """Take over the engines an earlier agent of this node left running (docs/architecture.md, "A backend's life").

        The runner lists them (``adoptable``: only the systemd runner's outlive an agent). One
        whose labels name a configured backend with the same config hash is adopted: it is
        probed like a fresh launch, without the load gate and without a reload. Any other
        (entry changed, model or backend no longer configured) is stopped.
        """
        try:
            handles = await self.runner.adoptable(self.node_name)
        except RunnerError as exc:
            log.warning("cannot list engines left by an earlier agent: %s", exc)
            return
        by_key = {(c.runtime.name, str(c.backend.index)): c for c in self._controls}
        stale: list[tuple[RunHandle, str]] = []
        for handle in handles:
            labels = handle.labels
            ctrl = by_key.get((labels.get("model", ""), labels.get("index", "")))
            port = labels.get("port", "")
            sock = labels.get("socket", "")
            key = read_key(self._key_dir(ctrl)) if ctrl is not None else None
            if ctrl is None:
                stale.append((handle, "its model or backend is no longer configured"))
            elif labels.get("config_hash") != ctrl.config_hash:
                stale.append((handle, "its config entry changed"))
            elif not port.isdigit() or ctrl.adopted is not None:
                stale.append((handle, "it records no usable port"))
            elif key is None:
                stale.append((handle, f"its key file in {self._key_dir(ctrl)} is gone"))
            elif sock and not Path(sock).is_socket():
                stale.append((handle, f"its socket {sock} is gone"))
            else:
                ctrl.adopted = (handle, int(port), key, sock)
                log.info("backend %s: adopting %s (pid %s, %s)", ctrl.backend.id,
                         handle.unit or "engine", handle.pid, f"socket {sock}" if sock else f"port {port}")
        for handle, why in stale:
            log.info("stopping engine %s left by an earlier agent: %s", handle.unit or handle.pid, why)
        results = await asyncio.gather(*(h.stop(self.config.supervisor.stop_timeout_s) for h, _ in stale),
                                       return_exceptions=True)
        for (handle, _), result in zip(stale, results, strict=True):
            if isinstance(result, BaseException):
                log.error("could not stop engine %s: %s", handle.unit or handle.pid, result)

    async def detach(self) -> None:
        """End supervision and leave every engine running, for the next agent to adopt.

        For a restart of the agent by systemd (``viiwork.agent.notify.stop_intent``); the
        engines of a runner whose engines die with the agent are better stopped with stop().
        """
        await self._end_tasks(self._controls)
        for ctrl in self._controls:
            self._discard_exit_task(ctrl)
            ctrl.handle = None
            await self._close_http(ctrl)

    async def stop(self) -> None:
        """Drain and stop every backend, then end the backend tasks (none is left running)."""
        await self._stop_controls(self._controls)

    async def _end_tasks(self, controls: list[_Control]) -> None:
        tasks = [c.task for c in controls if c.task is not None]
        for task in tasks:
            task.cancel()
        # Tasks end at their next await; each cancelled task is awaited so none leaks.
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task

    async def _stop_controls(self, controls: list[_Control]) -> None:
        """Drain and stop ``controls``' backends and end their tasks."""
        for ctrl in controls:
            self._command(ctrl, want_running=False)
        await self._settle(controls)
        await self._end_tasks(controls)
        # A backend that did not settle in time (engine stuck) is stopped here directly.
        for ctrl in controls:
            await self._terminate(ctrl, drain=False)
            self._discard_exit_task(ctrl)
            await self._close_http(ctrl)

    async def reload(self, config: Config) -> dict[str, list[str]]:
        """Apply a new config's ``[[models]]``, diffed by name (docs/architecture.md, "A backend's life").

        Only models whose entry changed (``config_hash``) restart: their backends are drained
        and stopped, then started from the new entry; removed models are drained and
        stopped; added ones start; unchanged ones are not touched. Health settings apply
        from now on. Returns ``{"added", "changed", "removed", "unchanged"}`` model names.
        """
        old = {m.name: m for m in self.config.models}
        new = {m.name: m for m in config.models}
        added = [n for n in new if n not in old]
        removed = [n for n in old if n not in new]
        changed = [n for n in new if n in old and config_hash(new[n]) != config_hash(old[n])]
        unchanged = [n for n in new if n in old and n not in changed]
        retiring = [c for c in self._controls if c.runtime.name in removed or c.runtime.name in changed]
        await self._retire(retiring)
        self.config = config
        for name in removed:
            gone = self.models.pop(name)
            gone.state = ModelState.DOWN
            gone.notify()  # queued requests for it end with 503 now
        starting: list[_Control] = []
        for name in changed + added:
            runtime = self.models.get(name)
            if runtime is None:
                runtime = self.models[name] = ModelRuntime(config=new[name], engine=ENGINES[new[name].engine])
            else:
                runtime.config, runtime.engine = new[name], ENGINES[new[name].engine]
                runtime.state = ModelState.RUNNING
            starting += self._build_backends(runtime)
        self._controls += starting
        if self._started:
            for ctrl in starting:
                ctrl.task = asyncio.create_task(self._backend_main(ctrl), name=f"backend {ctrl.backend.id}")
        for name in changed + added:
            self.models[name].notify()
        log.info("reload: added %s, changed %s, removed %s, unchanged %s",
                 added or "-", changed or "-", removed or "-", unchanged or "-")
        return {"added": added, "changed": changed, "removed": removed, "unchanged": unchanged}

    async def _retire(self, controls: list[_Control]) -> None:
        """Drain and stop ``controls``' backends, end their tasks and forget them."""
        await self._stop_controls(controls)
        for ctrl in controls:
            self._controls.remove(ctrl)
            for what in ("engine key", "engine environment file"):
                self.writes.discard(f"{what} of {ctrl.backend.id}")

    async def down(self, model: str) -> None:
        """Drain and stop ``model``'s backends and keep them stopped until ``up``.

        Raises UnknownModel. Returns when every backend is STOPPED (or after the drain and
        stop deadlines plus a margin).
        """
        runtime = self._runtime(model)
        controls = [c for c in self._controls if c.runtime is runtime]
        runtime.state = ModelState.DOWN
        for ctrl in controls:
            self._command(ctrl, want_running=False)
        await self._settle(controls)
        runtime.notify()

    async def up(self, model: str) -> None:
        """Start ``model``'s stopped backends and revive dead ones with a fresh respawn budget.

        Raises UnknownModel. Returns once the backends have left STOPPED/DEAD (they may
        still be waiting for the load gate).
        """
        runtime = self._runtime(model)
        controls = [c for c in self._controls if c.runtime is runtime]
        runtime.state = ModelState.RUNNING
        for ctrl in controls:
            self._step(ctrl, hl.Revived())
            self._command(ctrl, want_running=True)
        await self._settle(controls)
        runtime.notify()

    def _runtime(self, model: str) -> ModelRuntime:
        try:
            return self.models[model]
        except KeyError:
            raise UnknownModel(model, sorted(self.models)) from None

    def _command(self, ctrl: _Control, *, want_running: bool) -> None:
        if ctrl.task is not None and want_running == ctrl.want_running and not (
            want_running and ctrl.backend.state is BackendState.DEAD
        ):
            return  # already running (or already stopping): nothing to restart
        ctrl.want_running = want_running
        ctrl.settled.clear()
        ctrl.changed.set()
        if ctrl.task is None:
            # Not started: nothing runs; the picture simply says what was asked.
            ctrl.settled.set()

    async def _settle(self, controls: list[_Control]) -> None:
        limit = self.config.health.drain_timeout_s + self.config.supervisor.stop_timeout_s + SETTLE_MARGIN_S
        waits = [asyncio.ensure_future(c.settled.wait()) for c in controls]
        try:
            if waits:
                _, pending = await asyncio.wait(waits, timeout=limit)
                if pending:
                    log.warning("%d backend(s) did not settle within %.0f s", len(pending), limit)
        finally:
            for w in waits:
                w.cancel()
            await asyncio.gather(*waits, return_exceptions=True)

    # ----------------------------------------------------------------- status

    def status(self) -> list[dict[str, Any]]:
        """This node's models for /v1/status: one ``ModelRuntime.status_doc()`` per model."""
        return [runtime.status_doc() for runtime in self.models.values()]

    # ----------------------------------------------------------------- the ladder

    async def _backend_main(self, ctrl: _Control) -> None:
        """The backend's long-lived task: the ladder, forever, until cancelled by stop()."""
        backend = ctrl.backend
        while True:
            ctrl.changed.clear()
            try:
                if not ctrl.want_running:
                    keep = backend.reason if backend.state is BackendState.DEAD else ""
                    await self._park(ctrl, BackendState.STOPPED, keep)
                    continue
                result = await self._run_once(ctrl)
                if isinstance(result, _Failure):
                    await self._after_failure(ctrl, result)
            except Exception as exc:  # a bug here must not silently end supervision
                log.exception("supervision of backend %s failed", backend.id)
                try:
                    await self._terminate(ctrl, drain=False)
                except Exception:
                    log.exception("backend %s: stopping after the failure failed too", backend.id)
                self._step(ctrl, hl.Broken(f"supervisor error: {exc!r}"))
                self._set(ctrl, BackendState.DEAD, reason=ctrl.ladder.reason)
                self._update_model_state(ctrl.runtime)
                ctrl.settled.set()
                await ctrl.changed.wait()  # `up` (or stop) decides what happens next

    async def _park(self, ctrl: _Control, state: BackendState, reason: str) -> None:
        """Stop the engine (draining first), show ``state``, and wait for a command."""
        await self._terminate(ctrl, drain=True)
        self._step(ctrl, hl.Parked())
        self._set(ctrl, state, reason=reason, phase="", progress=-1.0, port=None, socket_path=None)
        self._update_model_state(ctrl.runtime)
        ctrl.settled.set()
        await ctrl.changed.wait()

    async def _run_once(self, ctrl: _Control) -> _Stop | _Failure:
        """One launch (with the free retry) until a failure or a command."""
        backend = ctrl.backend
        self._step(ctrl, hl.Launched())
        self._set(ctrl, BackendState.STARTING, phase="waiting for a load slot", progress=-1.0, reason="")
        self._update_model_state(ctrl.runtime)
        ctrl.settled.set()
        # An adopted engine has its model loaded already: it does not wait for the gate.
        gated = ctrl.adopted is None
        if gated and not await self._acquire_gate(ctrl):
            return _Stop.COMMAND
        try:
            result = await self._launch_until_ready(ctrl)
            if isinstance(result, _Failure) and result.quick_exit and ctrl.want_running:
                log.info("backend %s exited within %.0f s of launch (%s): retrying once on a new port",
                         backend.id, QUICK_EXIT_S, result.reason)
                result = await self._launch_until_ready(ctrl)
        finally:
            if gated:
                self._gate.release()
        if result is not True:
            return result
        return await self._watch_healthy(ctrl)

    async def _launch_until_ready(self, ctrl: _Control) -> Literal[True] | _Stop | _Failure:
        """Launch the engine and probe it until ready; True when ready."""
        backend = ctrl.backend
        model = ctrl.runtime.config
        adopted, ctrl.adopted = ctrl.adopted, None
        await self._terminate(ctrl, drain=False)
        used = {c.backend.port for c in self._controls if c is not ctrl and c.backend.port is not None}
        key_dir = self._key_dir(ctrl)
        if adopted is not None:
            _, port, key, sock = adopted
        else:
            sock = self._socket_path(ctrl)
            port = 0 if sock else free_loopback_port(used)
            try:
                key, _ = write_key(key_dir, getattr(self.runner, "engine_user", None))
                self.writes.succeeded(f"engine key of {backend.id}", key_dir / "key")
                if sock:  # a socket file left by an engine that died: the new one binds afresh
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(sock)
            except EngineKeyError as exc:
                return self._key_failure(ctrl, f"engine key of {backend.id}", exc)
            except OSError as exc:
                return _Failure(reason=str(exc))
        spec = BackendSpec(
            model=model.name,
            kind=model.kind,
            path=model.path,
            port=port,
            ctx_per_slot=model.ctx_per_slot,
            parallel=model.parallel,
            options=model.options,
            gpus=backend.gpus,
            vendor=self._vendor(backend.gpus),
            backends_on_node=model.backend_count,
            host_cpus=self.host_cpus,
            args=tuple(model.args),
            api_key_file=str(key_dir / "key"),
            socket_path=sock or None,
        )
        command = ctrl.runtime.engine.build_command(spec)
        env_file = None
        if command.key_env and adopted is None:  # an engine that reads its key from the environment (vLLM)
            try:
                env_file = str(write_env_file(key_dir, command.key_env, key))
                self.writes.succeeded(f"engine environment file of {backend.id}", Path(env_file))
            except EngineKeyError as exc:
                return self._key_failure(ctrl, f"engine environment file of {backend.id}", exc)
        env = engine_environment(
            os.environ if self._environ is None else self._environ,
            vendor=spec.vendor, gpus=spec.gpus, model_env=model.env, engine_env=command.env,
        )
        request = LaunchRequest(
            name=f"viiwork-engine-{self.node_name}-{model.name}-{backend.index}",
            argv=command.argv,
            env=env,
            description=f"viiwork engine {model.engine} for {model.name} #{backend.index}",
            labels={
                "owner": self.node_name,
                "model": model.name,
                "index": str(backend.index),
                "config_hash": ctrl.config_hash,
                "port": str(port),
                "socket": sock,
            },
            log_path=str(backend_log_path(self.config, model.name, backend.index)),
            stop_timeout_s=self.config.supervisor.stop_timeout_s,
            memory_max_bytes=model.memory_max_bytes,
            cpu_weight=model.cpu_weight,
            tasks_max=model.tasks_max,
            sandbox=model.sandbox,
            private_dir=str(key_dir),
            environment_file=env_file,
        )
        ctrl.spec = spec
        backend.port = port or None
        backend.socket_path = sock or None
        backend.api_key = key
        await self._close_http(ctrl)
        # The agent's timeouts, plus this launch's key on every probe and load read; the
        # agent's pool for a port, a connector of its own for a socket.
        if sock:
            ctrl.http = aiohttp.ClientSession(connector=aiohttp.UnixConnector(path=sock),
                                              timeout=self.http.timeout, headers=auth_headers(key))
        else:
            ctrl.http = aiohttp.ClientSession(connector=self.http.connector, connector_owner=False,
                                              timeout=self.http.timeout, headers=auth_headers(key))
        backend.load = None
        backend.load_at = None
        backend.load_stale = False
        self._set(ctrl, BackendState.STARTING, phase="adopting" if adopted else "launching", progress=-1.0, reason="")
        if adopted is not None:
            handle = adopted[0]
        else:
            try:
                async with asyncio.timeout(RUNNER_START_TIMEOUT_S):
                    handle = await self.runner.start(request)
            except RunnerError as exc:
                return _Failure(reason=str(exc))
            except TimeoutError:
                return _Failure(reason=f"runner did not start the engine within {RUNNER_START_TIMEOUT_S:.0f} s")
        started = time.monotonic()
        ctrl.handle = handle
        ctrl.exit_task = asyncio.ensure_future(handle.wait())
        backend.pid = handle.pid
        backend.unit = handle.unit
        backend.started_at = started
        log.info("backend %s %s: pid %s, %s", backend.id, "adopted" if adopted else "launched", handle.pid,
                 spec.address)

        timeout_s = model.effective_startup_timeout_s
        deadline = started + timeout_s
        interval = min(START_PROBE_INTERVAL_S, self.config.health.interval_s)
        while True:
            remaining = deadline - time.monotonic()
            got = await self._until(
                ctrl, ctrl.runtime.engine.probe(self._http(ctrl), backend.base_url),
                timeout=max(0.0, min(self.config.health.timeout_s, remaining)),
            )
            if got.wake is _Wake.EXITED:
                return self._exited(ctrl, quick_ok=True)
            if got.wake is _Wake.COMMAND:
                return _Stop.COMMAND
            if got.wake is _Wake.DONE and got.error is None:
                probe: Probe = got.result
                if probe.ready:
                    self._step(ctrl, hl.Ready())
                    self._set(ctrl, BackendState.HEALTHY, phase="", progress=-1.0, reason="")
                    self._update_model_state(ctrl.runtime)
                    log.info("backend %s healthy after %.1f s", backend.id, time.monotonic() - started)
                    return True
                if probe.phase != backend.phase or probe.progress != backend.progress:
                    self._set(ctrl, BackendState.STARTING, phase=probe.phase, progress=probe.progress)
            elif got.wake is _Wake.DONE:
                self._adapter_bug(ctrl, "probe", got.error)
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                phase = f" (phase: {backend.phase})" if backend.phase else ""
                return _Failure(reason=f"startup timeout: not ready after {timeout_s:g} s{phase}")
            got = await self._until(ctrl, None, timeout=min(interval, remaining))
            if got.wake is _Wake.EXITED:
                return self._exited(ctrl, quick_ok=True)
            if got.wake is _Wake.COMMAND:
                return _Stop.COMMAND

    async def _watch_healthy(self, ctrl: _Control) -> _Stop | _Failure:
        """Probe and read load while healthy; returns on a command, an exit or max_failures.

        Probes and load reads run on their own schedules, each under its own deadline, so a
        hung engine's load read never delays the probe that will notice it.
        """
        backend = ctrl.backend
        engine = ctrl.runtime.engine
        health = self.config.health
        sup = self.config.supervisor
        assert ctrl.spec is not None
        now = time.monotonic()
        next_probe = now + health.interval_s
        next_load = now
        probe_task: asyncio.Future[_Outcome] | None = None
        load_task: asyncio.Future[_Outcome] | None = None
        try:
            while True:
                now = time.monotonic()
                if load_task is None and now >= next_load:
                    load_task = asyncio.ensure_future(self._timed(
                        engine.read_load(self._http(ctrl), ctrl.spec, backend.base_url), LOAD_READ_TIMEOUT_S))
                if probe_task is None and now >= next_probe:
                    probe_task = asyncio.ensure_future(self._timed(
                        engine.probe(self._http(ctrl), backend.base_url), health.timeout_s))
                due = [at for at, task in ((next_load, load_task), (next_probe, probe_task)) if task is None]
                running = [task for task in (load_task, probe_task) if task is not None]
                got = await self._until(ctrl, None, timeout=max(0.0, min(due) - now) if due else None,
                                        also=running)
                if got.wake is _Wake.EXITED:
                    return self._exited(ctrl, quick_ok=False)
                if got.wake is _Wake.COMMAND:
                    return _Stop.COMMAND
                if load_task is not None and load_task.done():
                    self._record_load(ctrl, load_task.result())
                    load_task = None
                    next_load = time.monotonic() + sup.load_poll_interval_s
                if probe_task is not None and probe_task.done():
                    probe = probe_task.result()
                    probe_task = None
                    next_probe = time.monotonic() + health.interval_s
                    if probe.wake is _Wake.DONE and probe.error is None and probe.result.ready:
                        self._step(ctrl, hl.ProbeOk())
                        continue
                    self._adapter_bug(ctrl, "probe", probe.error)
                    last_error = self._probe_error(probe, health.timeout_s)
                    actions = self._step(ctrl, hl.ProbeFailed(last_error, timed_out=self._timed_out(probe),
                                                              busy=self._busy(backend)))
                    for action in actions:
                        if isinstance(action, hl.ProbeExcused):
                            log.debug("backend %s: probe timed out while busy; not counted", backend.id)
                        elif isinstance(action, hl.ProbeCounted):
                            log.warning("backend %s: probe failed (%d/%d): %s",
                                        backend.id, action.failures, health.max_failures, last_error)
                    if ctrl.ladder.state is not BackendState.HEALTHY:
                        return _Failure(reason=ctrl.ladder.reason, planned=actions)
        finally:
            pending = [t for t in (probe_task, load_task) if t is not None]
            for task in pending:
                task.cancel()
            await asyncio.gather(*pending, return_exceptions=True)

    @staticmethod
    async def _timed(work: Awaitable[Any], timeout_s: float) -> _Outcome:
        """``work`` under a deadline, its result or error captured (never raised)."""
        try:
            async with asyncio.timeout(timeout_s):
                return _Outcome(_Wake.DONE, result=await work)
        except TimeoutError:
            return _Outcome(_Wake.TIMEOUT)
        except Exception as exc:  # noqa: BLE001 - captured for the caller to judge
            return _Outcome(_Wake.DONE, error=exc)

    def _record_load(self, ctrl: _Control, got: _Outcome) -> None:
        backend = ctrl.backend
        before = (backend.slots, backend.load_stale)
        now = time.monotonic()
        if got.wake is _Wake.DONE and got.error is None:
            load: Load = got.result
            backend.load = load
            backend.load_at = now
            backend.load_stale = False
        else:
            self._adapter_bug(ctrl, "read_load", got.error)
            stale_after_s = self.config.supervisor.load_stale_after_s
            if not backend.load_stale and hl.load_goes_stale(backend.load_at, backend.healthy_since, now, stale_after_s):
                log.warning("backend %s: load unread for %g s or more (%s): falling back to parallel/in-flight",
                            backend.id, stale_after_s, self._probe_error(got, LOAD_READ_TIMEOUT_S))
                backend.load_stale = True
        if (backend.slots, backend.load_stale) != before:
            ctrl.runtime.notify()

    async def _after_failure(self, ctrl: _Control, failure: _Failure) -> None:
        """Unhealthy: carry out what the ladder decides (agent/supervision/health_ladder.py): stop what is
        left, then respawn after a backoff, wait for the disk, or die."""
        backend = ctrl.backend
        actions = failure.planned
        if actions is None:
            actions = self._step(ctrl, hl.Failed(failure.reason, disk=failure.disk))
        self._set(ctrl, BackendState.UNHEALTHY, reason=failure.reason, phase="", progress=-1.0)
        if not failure.disk:
            log.warning("backend %s unhealthy: %s", backend.id, failure.reason)
        for action in actions:
            if isinstance(action, hl.RetryDisk):
                self._update_model_state(ctrl.runtime)
                await self._until(ctrl, None, timeout=self.writes.retry_s)
            elif isinstance(action, hl.StopEngine):
                await self._terminate(ctrl, drain=True)
                self._set(ctrl, BackendState.UNHEALTHY)
            elif isinstance(action, hl.Die):
                log.error("backend %s dead after %d respawn(s): %s", backend.id, ctrl.ladder.spent, action.reason)
                self._set(ctrl, BackendState.DEAD, reason=action.reason)
                self._update_model_state(ctrl.runtime)
                ctrl.settled.set()
                await ctrl.changed.wait()
            elif isinstance(action, hl.Backoff):
                self._update_model_state(ctrl.runtime)
                got = await self._until(ctrl, None, timeout=action.delay_s)
                if got.wake is _Wake.COMMAND:
                    return
                for then in self._step(ctrl, hl.BackoffOver()):
                    if isinstance(then, hl.Respawn):
                        log.info("backend %s: respawn %d (budget %d/%d)", backend.id, then.respawns,
                                 then.spent, self.config.health.max_respawns)

    def _step(self, ctrl: _Control, event: hl.Event) -> tuple[hl.Action, ...]:
        """Move ``ctrl``'s ladder by ``event`` now; the backend shows its health figures."""
        ctrl.ladder, actions = hl.step(ctrl.ladder, event, time.monotonic(), hl.LadderRules.from_config(self.config.health))
        ctrl.backend.healthy_since = ctrl.ladder.healthy_since
        ctrl.backend.respawns = ctrl.ladder.respawns
        return actions

    # ----------------------------------------------------------------- helpers

    def _key_failure(self, ctrl: _Control, what: str, exc: EngineKeyError) -> _Failure:
        """A key file that could not be written: a disk fault is a pending write, retried
        without spending a respawn (docs/reliability.md, "The state dir"); anything else fails
        the launch like an engine would."""
        if exc.errno is None or exc.errno not in DISK_ERRNOS or exc.path is None:
            return _Failure(reason=str(exc))
        self.writes.failed(what, exc.path, OSError(exc.errno, os.strerror(exc.errno)),
                           kept=f"backend {ctrl.backend.id} waits")
        return _Failure(reason=f"{exc}; retried every {self.writes.retry_s:g} s", disk=True)

    def _key_dir(self, ctrl: _Control) -> Path:
        """The backend's private directory (its key file): agent/supervision/engine_keys.py."""
        return self.engine_dir / f"{escape_name(ctrl.runtime.name)}-{ctrl.backend.index}"

    def _socket_path(self, ctrl: _Control) -> str:
        """The backend's socket in its private directory, or "" for an engine that binds a
        port only, or when the path would be too long (then a port, with a warning)."""
        if not binds_unix_socket(ctrl.runtime.engine):
            return ""
        path = str(self._key_dir(ctrl) / "engine.sock")
        problem = socket_path_problem(path)
        if problem:
            log.warning("backend %s: no Unix socket (%s): listening on a loopback port, with its key",
                        ctrl.backend.id, problem)
            return ""
        return path

    def _http(self, ctrl: _Control) -> aiohttp.ClientSession:
        return ctrl.http if ctrl.http is not None else self.http

    @staticmethod
    async def _close_http(ctrl: _Control) -> None:
        if ctrl.http is not None:
            session, ctrl.http = ctrl.http, None
            await session.close()

    async def _acquire_gate(self, ctrl: _Control) -> bool:
        """Take a load slot (True), or give up on a command (False); never leaks a slot,
        also when cancelled in the instant the slot came free."""
        acquire = asyncio.ensure_future(self._gate.acquire())
        command = asyncio.ensure_future(ctrl.changed.wait())
        keep = False
        try:
            await asyncio.wait({acquire, command}, return_when=asyncio.FIRST_COMPLETED)
            keep = not ctrl.changed.is_set()
        finally:
            command.cancel()
            if not acquire.done():
                acquire.cancel()
            await asyncio.gather(acquire, command, return_exceptions=True)
            acquired = acquire.done() and not acquire.cancelled() and acquire.exception() is None
            if acquired and not keep:
                self._gate.release()
        return keep and acquired

    async def _until(
        self,
        ctrl: _Control,
        work: Awaitable[Any] | None,
        timeout: float | None,
        also: list[asyncio.Future[Any]] | None = None,
    ) -> _Outcome:
        """Wait for ``work``, the engine's exit, a command, or ``timeout`` s, whichever first.

        An exit wins over a finished probe (its reason is the better one); a command wins
        over work. Unfinished ``work`` is cancelled before returning; futures in ``also``
        only wake the wait (TIMEOUT is returned then: the caller looks at them itself) and
        are left running.
        """
        work_task = asyncio.ensure_future(work) if work is not None else None
        cmd_task = asyncio.ensure_future(ctrl.changed.wait())
        waits: set[asyncio.Future[Any]] = {cmd_task, *(also or ())}
        if work_task is not None:
            waits.add(work_task)
        if ctrl.exit_task is not None:
            waits.add(ctrl.exit_task)
        try:
            await asyncio.wait(waits, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (work_task, cmd_task):
                if task is not None and not task.done():
                    task.cancel()
            # Awaiting the cancelled tasks keeps none pending; our own cancellation still
            # propagates because gather re-raises it here.
            await asyncio.gather(*(t for t in (work_task, cmd_task) if t is not None), return_exceptions=True)
        if ctrl.exit_task is not None and ctrl.exit_task.done():
            return _Outcome(_Wake.EXITED)
        if cmd_task.done() and not cmd_task.cancelled():
            return _Outcome(_Wake.COMMAND)
        if work_task is not None and work_task.done() and not work_task.cancelled():
            if work_task.exception() is not None:
                return _Outcome(_Wake.DONE, error=work_task.exception())
            return _Outcome(_Wake.DONE, result=work_task.result())
        return _Outcome(_Wake.TIMEOUT)

    def _exited(self, ctrl: _Control, quick_ok: bool) -> _Failure:
        backend = ctrl.backend
        assert ctrl.exit_task is not None
        task = ctrl.exit_task
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
        ctrl.handle = None
        self._discard_exit_task(ctrl)
        return _Failure(reason=f"exited: {info.describe()}", exit=info, quick_exit=quick_ok and lived < QUICK_EXIT_S)

    async def _terminate(self, ctrl: _Control, drain: bool) -> None:
        """Drain (optionally) and stop the running engine, if any; SIGKILL after the grace."""
        backend = ctrl.backend
        handle = ctrl.handle
        if handle is None:
            return
        if drain and backend.in_flight > 0 and handle.running():
            previous = backend.state
            self._set(ctrl, BackendState.DRAINING)
            await self._drain(ctrl)
            if backend.state is BackendState.DRAINING:
                self._set(ctrl, previous)
        grace = self.config.supervisor.stop_timeout_s
        try:
            info = await handle.stop(grace)
        except RunnerError as exc:
            log.error("backend %s: %s", backend.id, exc)
            info = ExitInfo(result="unknown", detail=str(exc))
        backend.exit_result = info.result
        backend.exit_status = info.returncode if info.signal is None else info.signal
        backend.pid = None
        ctrl.handle = None
        self._discard_exit_task(ctrl)

    async def _drain(self, ctrl: _Control) -> None:
        backend = ctrl.backend
        deadline = time.monotonic() + self.config.health.drain_timeout_s
        log.info("backend %s: draining %d request(s)", backend.id, backend.in_flight)
        while backend.in_flight > 0 and time.monotonic() < deadline:
            if ctrl.exit_task is not None and ctrl.exit_task.done():
                return
            await asyncio.sleep(min(DRAIN_POLL_S, max(0.0, deadline - time.monotonic())))
        if backend.in_flight > 0:
            log.warning("backend %s: %d request(s) still running after the %.0f s drain timeout",
                        backend.id, backend.in_flight, self.config.health.drain_timeout_s)

    @staticmethod
    def _adapter_bug(ctrl: _Control, what: str, error: BaseException | None) -> None:
        """The contract lets adapters raise only EngineError: anything else is a bug in the
        adapter, logged with its traceback and then treated like a failed call."""
        if error is not None and not isinstance(error, EngineError):
            log.error("engine %s: %s raised %r (adapter bug; counted as a failure)",
                      ctrl.runtime.config.engine, what, error, exc_info=error)

    def _discard_exit_task(self, ctrl: _Control) -> None:
        if ctrl.exit_task is not None and not ctrl.exit_task.done():
            ctrl.exit_task.cancel()
        ctrl.exit_task = None

    def _set(self, ctrl: _Control, state: BackendState, **fields: Any) -> None:
        backend = ctrl.backend
        changed = backend.state is not state
        backend.state = state
        for name, value in fields.items():
            if getattr(backend, name) != value:
                setattr(backend, name, value)
                changed = True
        if changed:
            ctrl.runtime.notify()

    def _update_model_state(self, runtime: ModelRuntime) -> None:
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
        vendors = {self.vendor_of(g) for g in gpus}
        return vendors.pop() if len(vendors) == 1 else "unknown"

    @staticmethod
    def _busy(backend: Backend) -> bool:
        return backend.in_flight > 0 or (backend.load is not None and not backend.load_stale and backend.load.busy > 0)

    @staticmethod
    def _timed_out(got: _Outcome) -> bool:
        if got.wake is _Wake.TIMEOUT:
            return True
        err = got.error
        return isinstance(err, EngineUnavailable) and isinstance(err.__cause__, TimeoutError)

    @staticmethod
    def _probe_error(got: _Outcome, timeout_s: float) -> str:
        if got.wake is _Wake.TIMEOUT:
            return f"no answer within {timeout_s:g} s"
        if got.error is not None:
            return str(got.error)
        if got.result is not None and isinstance(got.result, Probe):
            return got.result.reason or got.result.phase or "not ready"
        return "unknown"
