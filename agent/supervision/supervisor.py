"""The supervisor: launches each model's backends through a runner and walks the health ladder.

docs/architecture.md, "A backend's life". One long-lived task per backend runs the ladder of
``viiwork.agent.supervision.health_ladder``
(starting -> healthy -> unhealthy -> respawn after a backoff -> dead; docs/reliability.md):
that module decides (which probe failures count, when the respawn budget refills, how long
the backoff, when a backend is dead) as a pure function; the supervisor runs the engines, waits,
and carries out what it returns:

- starting: waits for the node-wide load gate (``supervisor.max_parallel_loads`` backends
  load at once), takes a free loopback port, launches, and probes every second (or every
  ``health.interval_s`` when that is shorter) showing the engine's phase and progress. Only
  the startup timeout or an exit ends patience. An exit within 2 s of the launch is retried
  once at once on a new port (another process may have taken the port between our bind
  test and the engine's bind) without spending the respawn budget.
- healthy: probes every ``health.interval_s`` with a ``health.timeout_s`` deadline; a request
  that succeeded within ``health.success_counts_as_probe_s`` counts as a good probe. Load is
  read every ``supervisor.load_poll_interval_s`` (1 s deadline); a failed read keeps the last
  value until it is ``supervisor.load_stale_after_s`` old, then the backend is marked
  ``load_stale`` (slots fall back to ``parallel``, busy to routing's in-flight count). The
  request path's outlier detection may end health too (``report_outlier``).
- unhealthy: a still-running engine is drained (up to ``health.drain_timeout_s``) and stopped
  (SIGTERM, then SIGKILL after ``supervisor.stop_timeout_s``) before the backoff (plus up to
  ``supervisor.respawn_jitter_s``). At most ``supervisor.max_concurrent_respawns`` backends
  relaunch at once; while that many are down for a respawn, a failing probe streak keeps its
  backend in service (docs/reliability.md, "Health blips").

``down``/``stop`` drain (state DRAINING admits nothing), stop the engines and park the
backends as STOPPED; ``up`` restarts them and revives dead ones with a fresh budget.

This module holds the node-wide part (start, adoption, reload, down/up, stop); one
backend's task is agent/supervision/backend_task.py, its waits agent/supervision/waits.py,
its launch's parts agent/supervision/launch.py, its load readings agent/supervision/load.py.

Every change of a backend's state or capacity calls ``ModelRuntime.notify()`` so routing
can dispatch queued requests at once. Single-threaded: everything runs on the agent's loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import aiohttp

from viiwork.agent.config.gang import GangConfigError, gang_rank
from viiwork.agent.config.schema import Config, ModelConfig
from viiwork.agent.supervision import health_ladder as hl
from viiwork.agent.supervision.backend_task import BackendTask, NodeContext
from viiwork.agent.supervision.backends import Backend, BackendId, GangLauncher, ModelRuntime, ModelState
from viiwork.agent.supervision.engine_keys import engine_dir, read_key
from viiwork.agent.supervision.gang_units import GANG_UNIT_PREFIX
from viiwork.agent.supervision.launch import config_hash
from viiwork.agent.supervision.runners.base import RunHandle, Runner, RunnerError
from viiwork.engines.gang import is_gang_id
from viiwork.engines.registry import ENGINES

log = logging.getLogger(__name__)

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


class Supervisor:
    """Runs every configured model's backends through ``runner`` (module docstring), one
    ``BackendTask`` per backend (agent/supervision/backend_task.py).

    ``models``: one ``ModelRuntime`` per ``[[models]]`` entry, by name, built at once (the
    API can read them before ``start``). ``vendor_of`` maps a configured GPU (index or
    UUID, as a string) to "nvidia", "amd" or "unknown" (GPU inventory); it picks the pinning
    variables. ``http`` is used for probes and load reads; its own timeouts may be longer
    than the supervisor's deadlines, which are applied here. ``writes``: the engine key
    files a launch could not write (``NodeContext``).
    """

    def __init__(
        self,
        config: Config,
        runner: Runner,
        http: aiohttp.ClientSession,
        node_name: str,
        vendor_of: Callable[[str], str] = lambda gpu: "unknown",
        environ: Mapping[str, str] | None = None,
        node_id: str | None = None,
    ) -> None:
        self.node = NodeContext(
            config=config,
            runner=runner,
            http=http,
            node_name=node_name,
            vendor_of=vendor_of,
            environ=environ,
            gate=asyncio.Semaphore(config.supervisor.max_parallel_loads),
            engine_dir=engine_dir(config.node.state_dir, environ),
            host_cpus=max(1, len(os.sched_getaffinity(0))),
            respawn_cap=config.supervisor.max_concurrent_respawns,
        )
        self.writes = self.node.writes
        self.models: dict[str, ModelRuntime] = {}
        # Every backend's task: the same list as node.tasks (a launch avoids their ports).
        self._tasks = self.node.tasks
        self._started = False
        self.node_id = node_id
        # The units of gang parts this node's gang worker adopted (agent/gang/worker.py adopt):
        # left running by _adopt.
        self.gang_parts_claimed: set[str] = set()
        # A gang's head builds its parts' launcher once the mesh is up (attach_gangs).
        self.gang_factory: Callable[[ModelRuntime], GangLauncher] | None = None
        for model in self._served(config):
            runtime = ModelRuntime(config=model, engine=ENGINES[model.engine])
            self._tasks += self._build_backends(runtime)
            self.models[model.name] = runtime

    def _served(self, config: Config) -> list[ModelConfig]:
        """The entries whose backends run here: every one-host entry, and a gang's entry only on
        its head (rank 0). A worker's parts start when its head asks (agent/gang/worker.py); a
        host the entry does not name ignores it (agent/config/gang.py)."""
        served = []
        for model in config.models:
            if model.hosts:
                try:
                    rank = gang_rank(model, self.node_id, self.node.node_name)
                except GangConfigError as exc:
                    log.error("model %s: %s: not served here", model.name, exc)
                    continue
                if rank != 0:
                    continue
            served.append(model)
        return served

    def set_node_id(self, node_id: str) -> None:
        """This node's mesh id, once known (a first start creates the key with the mesh): the
        gang entries naming this host by id are served from now on. Before :meth:`start` only."""
        if node_id == self.node_id:
            return
        if self._started:
            raise RuntimeError("set_node_id() after start()")
        self.node_id = node_id
        self._tasks.clear()
        served = {m.name for m in self._served(self.config)}
        for name in [n for n in self.models if n not in served]:
            del self.models[name]
        for model in self._served(self.config):
            runtime = self.models.get(model.name) or ModelRuntime(config=model, engine=ENGINES[model.engine])
            self.models[model.name] = runtime
            self._tasks += self._build_backends(runtime)

    def attach_gangs(self, factory: Callable[[ModelRuntime], GangLauncher]) -> None:
        """Give every gang head's runtime its launcher (``factory``), now and after reloads."""
        self.gang_factory = factory
        for runtime in self.models.values():
            if runtime.config.hosts:
                runtime.gang = factory(runtime)

    @property
    def config(self) -> Config:
        """The config in force (``reload`` replaces it)."""
        return self.node.config

    def _build_backends(self, runtime: ModelRuntime) -> list[BackendTask]:
        """Fill ``runtime.backends`` from its config; returns their (unstarted) tasks."""
        model = runtime.config
        digest = config_hash(model)
        runtime.backends = []
        tasks = []
        for index in range(model.backend_count):
            backend = Backend(
                id=BackendId(f"{model.name}-{index}"),
                model=model.name,
                index=index,
                gpus=model.backend_gpus(index),
                parallel=model.parallel,
            )
            runtime.backends.append(backend)
            tasks.append(BackendTask(node=self.node, runtime=runtime, backend=backend, config_hash=digest))
        return tasks

    # ----------------------------------------------------------------- lifecycle

    async def start(self) -> None:
        """Start one task per backend; returns at once (backends load in the background)."""
        if self._started:
            raise RuntimeError("Supervisor.start() called twice")
        self._started = True
        await self._adopt()
        for task in self._tasks:
            task.start()

    async def _adopt(self) -> None:
        """Take over the engines an earlier agent of this node left running (docs/architecture.md, "A backend's life").

        The runner lists them (``adoptable``: only the systemd runner's outlive an agent). One
        whose labels name a configured backend with the same config hash is adopted: it is
        probed like a fresh launch, without the load gate and without a reload. Any other
        (entry changed, model or backend no longer configured) is stopped.
        """
        try:
            handles = await self.node.runner.adoptable(self.node.node_name)
            gang_parts = list(await self.node.runner.adoptable(self.node.node_name, GANG_UNIT_PREFIX))
        except RunnerError as exc:
            log.warning("cannot list engines left by an earlier agent: %s", exc)
            return
        by_key = {(t.runtime.name, str(t.backend.index)): t for t in self._tasks}
        stale: list[tuple[RunHandle, str]] = []
        for handle in handles:
            labels = handle.labels
            task = by_key.get((labels.get("model", ""), labels.get("index", "")))
            port = labels.get("port", "")
            sock = labels.get("socket", "")
            key = read_key(task.key_dir) if task is not None else None
            if task is None:
                stale.append((handle, "its model or backend is no longer configured"))
            elif task.runtime.gang is not None and not is_gang_id(labels.get("gang", "")):
                stale.append((handle, "a gang's head that records no gang id"))
            elif labels.get("config_hash") != task.config_hash:
                stale.append((handle, "its config entry changed"))
            elif not port.isdigit() or task.adopted is not None:
                stale.append((handle, "it records no usable port"))
            elif key is None:
                stale.append((handle, f"its key file in {task.key_dir} is gone"))
            elif sock and not Path(sock).is_socket():
                stale.append((handle, f"its socket {sock} is gone"))
            else:
                task.adopted = (handle, int(port), key, sock)
                if task.runtime.gang is not None:  # its gang's units here: checked by the gang head's adopt
                    task.adopted_parts = [p for p in gang_parts if p.labels.get("gang") == labels["gang"]
                                          and p.labels.get("model") == task.runtime.name]
                log.info("backend %s: adopting %s (pid %s, %s)", task.backend.id,
                         handle.unit or "engine", handle.pid, f"socket {sock}" if sock else f"port {port}")
        # A gang unit no adopted head claims: a head's part of a gang over, or a worker's part
        # left by its agent (a worker's agent does not adopt its parts: the head starts a new gang).
        claimed = {id(p) for t in self._tasks for p in t.adopted_parts}
        stale += [(p, "a gang part no adopted gang head or worker here claims") for p in gang_parts
                  if id(p) not in claimed and p.unit not in self.gang_parts_claimed]
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
        await self._end_tasks(self._tasks)
        for task in self._tasks:
            task.discard_exit_task()
            task.handle = None
            await task.close_http()

    async def stop(self) -> None:
        """Drain and stop every backend, then end the backend tasks (none is left running)."""
        await self._stop_tasks(self._tasks)

    async def _end_tasks(self, tasks: list[BackendTask]) -> None:
        running = [t.task for t in tasks if t.task is not None]
        for task in running:
            task.cancel()
        # Tasks end at their next await; each cancelled task is awaited so none leaks.
        for task in running:
            with contextlib.suppress(asyncio.CancelledError):
                await task

    async def _stop_tasks(self, tasks: list[BackendTask]) -> None:
        """Drain and stop ``tasks``' backends and end the tasks."""
        for task in tasks:
            task.command(want_running=False)
        await self._settle(tasks)
        await self._end_tasks(tasks)
        # A backend that did not settle in time (engine stuck) is stopped here directly.
        for task in tasks:
            await task.terminate(drain=False)
            task.discard_exit_task()
            await task.close_http()

    async def reload(self, config: Config) -> dict[str, list[str]]:
        """Apply a new config's ``[[models]]``, diffed by name (docs/architecture.md, "A backend's life").

        Only models whose entry changed (``config_hash``) restart: their backends are drained
        and stopped, then started from the new entry; removed models are drained and
        stopped; added ones start; unchanged ones are not touched. Health settings apply
        from now on. Returns ``{"added", "changed", "removed", "unchanged"}`` model names.
        """
        old = {m.name: m for m in self._served(self.config)}
        new = {m.name: m for m in self._served(config)}
        added = [n for n in new if n not in old]
        removed = [n for n in old if n not in new]
        changed = [n for n in new if n in old and config_hash(new[n]) != config_hash(old[n])]
        unchanged = [n for n in new if n in old and n not in changed]
        retiring = [t for t in self._tasks if t.runtime.name in removed or t.runtime.name in changed]
        await self._retire(retiring)
        self.node.config = config
        for name in removed:
            gone = self.models.pop(name)
            gone.state = ModelState.DOWN
            gone.notify()  # queued requests for it end with 503 now
        starting: list[BackendTask] = []
        for name in changed + added:
            runtime = self.models.get(name)
            if runtime is None:
                runtime = self.models[name] = ModelRuntime(config=new[name], engine=ENGINES[new[name].engine])
            else:
                runtime.config, runtime.engine = new[name], ENGINES[new[name].engine]
                runtime.state = ModelState.RUNNING
            runtime.gang = self.gang_factory(runtime) if runtime.config.hosts and self.gang_factory else None
            starting += self._build_backends(runtime)
        self._tasks += starting
        if self._started:
            for task in starting:
                task.start()
        for name in changed + added:
            self.models[name].notify()
        log.info("reload: added %s, changed %s, removed %s, unchanged %s",
                 added or "-", changed or "-", removed or "-", unchanged or "-")
        return {"added": added, "changed": changed, "removed": removed, "unchanged": unchanged}

    async def _retire(self, tasks: list[BackendTask]) -> None:
        """Drain and stop ``tasks``' backends, end the tasks and forget them."""
        await self._stop_tasks(tasks)
        for task in tasks:
            self._tasks.remove(task)
            for what in ("engine key", "engine environment file"):
                self.writes.discard(f"{what} of {task.backend.id}")

    async def down(self, model: str) -> None:
        """Drain and stop ``model``'s backends and keep them stopped until ``up``.

        Raises UnknownModel. Returns when every backend is STOPPED (or after the drain and
        stop deadlines plus a margin).
        """
        runtime = self._runtime(model)
        tasks = [t for t in self._tasks if t.runtime is runtime]
        runtime.state = ModelState.DOWN
        for task in tasks:
            task.command(want_running=False)
        await self._settle(tasks)
        runtime.notify()

    async def up(self, model: str) -> None:
        """Start ``model``'s stopped backends and revive dead ones with a fresh respawn budget.

        Raises UnknownModel. Returns once the backends have left STOPPED/DEAD (they may
        still be waiting for the load gate).
        """
        runtime = self._runtime(model)
        tasks = [t for t in self._tasks if t.runtime is runtime]
        runtime.state = ModelState.RUNNING
        for task in tasks:
            task.step(hl.Revived())
            task.command(want_running=True)
        await self._settle(tasks)
        runtime.notify()

    def _runtime(self, model: str) -> ModelRuntime:
        try:
            return self.models[model]
        except KeyError:
            raise UnknownModel(model, sorted(self.models)) from None

    async def _settle(self, tasks: list[BackendTask]) -> None:
        limit = self.config.health.drain_timeout_s + self.config.supervisor.stop_timeout_s + SETTLE_MARGIN_S
        waits = [asyncio.ensure_future(t.settled.wait()) for t in tasks]
        try:
            if waits:
                _, pending = await asyncio.wait(waits, timeout=limit)
                if pending:
                    log.warning("%d backend(s) did not settle within %.0f s", len(pending), limit)
        finally:
            for w in waits:
                w.cancel()
            await asyncio.gather(*waits, return_exceptions=True)

    def report_outlier(self, model: str, backend_id: BackendId, reason: str) -> bool:
        """The request path's outlier detection (agent/serving/outliers.py) ejected local backend
        ``backend_id`` of ``model`` several times in a row: a healthy backend becomes unhealthy
        with ``reason``, as a failed probe streak would, and is respawned by the ladder's rules
        (budget, backoff, ``supervisor.max_concurrent_respawns``), but a report never spends its
        last respawn: then it stays healthy (agent/supervision/health_ladder.py, logged once). An
        unknown model or backend, or one that is not healthy (already respawning, stopped,
        dead), is ignored (logged at debug). Returns at once (the backend's task acts on it):
        True when the backend is to be respawned, False when the report was ignored or declined."""
        task = next((t for t in self._tasks if t.runtime.name == model and t.backend.id == backend_id), None)
        if task is None:
            log.debug("outlier report for unknown backend %s of model %r ignored", backend_id, model)
            return False
        if not task.report(reason):
            log.debug("outlier report for backend %s not acted on: it is %s", backend_id, task.backend.state)
            return False
        log.warning("backend %s reported failing by outlier detection: %s", backend_id, reason)
        return True

    # ----------------------------------------------------------------- status

    def status(self) -> list[dict[str, Any]]:
        """This node's models for /v1/status: one ``ModelRuntime.status_doc()`` per model."""
        return [runtime.status_doc() for runtime in self.models.values()]
