"""SystemdRunner: each backend is a transient systemd service, driven over D-Bus (docs/architecture.md, "A backend's life").

One module (over 400 lines) because ``SystemdRunner`` is one conversation with systemd: the
unit's start, the signals that follow it, adoption after a restart and the stop share one bus
connection and one table of watched units. The parts that stand alone are beside it: D-Bus
calls (bus.py), unit names and properties (units.py), one unit's handle (handle.py).

The runner talks to ``org.freedesktop.systemd1`` with dbus-fast (asyncio), on the system bus
in production and the user bus in development and tests:

- ``StartTransientUnit`` creates ``viiwork-engine-<node>-<model>-<n>.service`` in
  ``viiwork-engines.slice`` (its properties, and why each: units.py).
- The unit's environment carries its labels (``VIIWORK_OWNER``, ``VIIWORK_MODEL``,
  ``VIIWORK_INDEX``, ``VIIWORK_CONFIG_HASH`` ..., listed in ``VIIWORK_LABELS``), so a later
  agent lists its own running units with ``adoptable(owner)`` and adopts them.
- State comes from D-Bus signals, never from polling: ``Subscribe`` makes systemd emit them;
  ``PropertiesChanged`` on the unit's object path carries ``ActiveState``/``SubState`` and
  the service's ``MainPID``, ``Result``, ``ExecMainCode``, ``ExecMainStatus``; ``JobRemoved``
  ends start and stop jobs. systemd sends the service interface's changes before the unit
  interface's (``bus_unit_send_change_signal``), so when ``ActiveState`` turns ``inactive``
  or ``failed`` the result and exit status are already known.

Limits (measured on systemd 252): on cgroup v1 systemd accepts ``MemoryMax`` (as
``memory.limit_in_bytes``) and the kernel enforces it, but systemd learns of OOM kills only
from cgroup v2's ``memory.events``; on v1 an OOM-killed engine ends with ``Result=signal``,
SIGKILL, and this runner says in the detail that this may be the memory limit. A user
manager without delegated controllers accepts limits and enforces none. A lost D-Bus
connection (dbus restarted) is not re-established: handles stop hearing of their units and
calls raise RunnerError; a re-executed systemd (``daemon-reexec``) is followed.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from collections import OrderedDict
from collections.abc import Iterable
from pathlib import Path
from typing import Literal

from dbus_fast import Message, MessageType, Variant
from dbus_fast.aio import MessageBus
from dbus_fast.errors import DBusError

from viiwork.agent.config.schema import Config
from viiwork.agent.supervision.runners.base import LaunchRequest, RunnerError
from viiwork.agent.supervision.runners.nft import nft_binary
from viiwork.agent.supervision.runners.systemd.bus import (
    DBUS_NAME,
    DBUS_PATH,
    MANAGER_IFACE,
    PROPERTIES_IFACE,
    SERVICE_IFACE,
    SYSTEMD_BUS_NAME,
    SYSTEMD_PATH,
    UNIT_IFACE,
    bus_address,
    call,
    detect_runner,
    get_property,
    has_systemd,
    open_bus,
)
from viiwork.agent.supervision.runners.systemd.handle import SystemdHandle
from viiwork.agent.supervision.runners.systemd.units import (
    ENGINE_SLICE,
    ENGINE_USER,
    UNIT_PREFIX,
    engine_unit_properties,
    exit_info,
    gpu_device_groups,
    labels_from_environment,
    resolve_binary,
    unit_name,
    unit_object_path,
    user_exists,
)

log = logging.getLogger(__name__)

#: Seconds for a start job (exec, plus creating/chowning the cache directory).
START_JOB_TIMEOUT_S = 60.0
#: Seconds ``auto`` waits for PID 1 to join the system bus on a host booted with systemd.
SYSTEMD_JOIN_WAIT_S = 15.0
#: How many finished jobs are remembered for waiters that registered late.
_FINISHED_JOBS_KEPT = 512


async def create_runner(config: Config, *, required: bool) -> SystemdRunner | None:
    """The SystemdRunner for ``config.supervisor`` (runner, bus, bus_address).

    ``required`` (runner = "systemd"): RunnerError when systemd does not answer.
    Otherwise (auto): None then, and the caller uses the process runner.
    """
    sup = config.supervisor
    # Booted with systemd (sd_booted(3): /run/systemd/system exists) and asking the system
    # bus: systemd will be on it, give it time to join (early boot).
    booted = sup.bus == "system" and sup.bus_address is None and Path("/run/systemd/system").is_dir()
    choice = await detect_runner(sup.bus, sup.bus_address, wait_s=SYSTEMD_JOIN_WAIT_S if booted else 0.0)
    if choice.kind != "systemd":
        if required:
            raise RunnerError(f'supervisor.runner = "systemd", but {choice.reason}')
        log.info("runner: process (%s)", choice.reason)
        return None
    log.info("runner: systemd (%s)", choice.reason)
    return await SystemdRunner.connect(sup.bus, sup.bus_address)


class SystemdRunner:
    """Runs backends as transient systemd units (see the module docstring). Implements ``Runner``.

    Make one with ``await SystemdRunner.connect(bus, address)``. ``engine_user``: "auto"
    (``viiwork`` on the system bus when that user exists, else the manager's own user), a
    user name, or None. ``output``: "journal" (the unit's default) or "file" (append to the
    request's ``log_path``; for managers without journald, as in tests).
    """

    name = "systemd"

    def __init__(self, conn: MessageBus, *, system: bool, cache_root: str, systemd_owner: str,
                 engine_user: str | None = None, supplementary_groups: Iterable[str] = (),
                 output: Literal["journal", "file"] = "journal", slice_name: str = ENGINE_SLICE) -> None:
        self._conn = conn
        self.system = system
        self.cache_root = cache_root
        self.engine_user = engine_user
        self.supplementary_groups = list(supplementary_groups)
        self.output = output
        self.slice_name = slice_name
        self._systemd_owner = systemd_owner
        self._handles: dict[str, SystemdHandle] = {}
        self._jobs: dict[str, asyncio.Future[str]] = {}
        self._finished_jobs: OrderedDict[str, str] = OrderedDict()
        self._removed: dict[str, asyncio.Event] = {}
        self._closed = False
        self._tasks: set[asyncio.Task[None]] = set()
        conn.add_message_handler(self._on_message)

    @property
    def bus(self) -> MessageBus:
        """The runner's D-Bus connection (for asking systemd about the agent's own unit)."""
        return self._conn

    @classmethod
    async def connect(cls, bus: Literal["system", "user"] = "system", address: str | None = None, *,
                      engine_user: str | None | Literal["auto"] = "auto",
                      output: Literal["journal", "file"] = "journal") -> SystemdRunner:
        """Connect, check systemd answers, subscribe to its signals.

        Raises RunnerError naming the bus when it cannot connect or systemd is not on it.
        """
        conn = await open_bus(bus, address)
        try:
            ok, reason = await has_systemd(conn)
            if not ok:
                raise RunnerError(f"{bus} bus at {bus_address(bus, address)}: {reason}")
            owner = (await call(conn, DBUS_NAME, DBUS_PATH, DBUS_NAME, "GetNameOwner", "s", [SYSTEMD_BUS_NAME]))[0]
            system = bus == "system"
            cache_root = "/var/cache"
            if not system:
                env = dict(e.split("=", 1) for e in await get_property(conn, SYSTEMD_PATH, MANAGER_IFACE, "Environment")
                           if "=" in e)
                cache_root = env.get("XDG_CACHE_HOME") or f"{env.get('HOME', os.path.expanduser('~'))}/.cache"
            if engine_user == "auto":
                engine_user = ENGINE_USER if system and user_exists(ENGINE_USER) else None
            groups = gpu_device_groups() if engine_user else []
            runner = cls(conn, system=system, cache_root=cache_root, systemd_owner=owner,
                         engine_user=engine_user, supplementary_groups=groups, output=output)
            await runner._subscribe()
        except DBusError as exc:
            conn.disconnect()
            raise RunnerError(f"systemd on the {bus} bus: {exc.text}") from exc
        except BaseException:
            conn.disconnect()
            raise
        log.info("systemd runner on the %s bus (%s); engines run as %s", bus, reason, engine_user or "the manager's user")
        return runner

    async def _subscribe(self) -> None:
        rules = [
            f"type='signal',sender='{SYSTEMD_BUS_NAME}',interface='{MANAGER_IFACE}',member='JobRemoved'",
            f"type='signal',sender='{SYSTEMD_BUS_NAME}',interface='{MANAGER_IFACE}',member='UnitRemoved'",
            f"type='signal',sender='{SYSTEMD_BUS_NAME}',interface='{PROPERTIES_IFACE}',member='PropertiesChanged',"
            f"path_namespace='{SYSTEMD_PATH}/unit'",
            f"type='signal',sender='{DBUS_NAME}',interface='{DBUS_NAME}',member='NameOwnerChanged',"
            f"arg0='{SYSTEMD_BUS_NAME}'",
        ]
        for rule in rules:
            await call(self._conn, DBUS_NAME, DBUS_PATH, DBUS_NAME, "AddMatch", "s", [rule])
        # Without Subscribe systemd emits no unit or job signals to this client.
        await call(self._conn, SYSTEMD_BUS_NAME, SYSTEMD_PATH, MANAGER_IFACE, "Subscribe")

    # --- signals -------------------------------------------------------------------------

    def _on_message(self, msg: Message) -> None:
        """dbus-fast message handler: route systemd's signals. Never claims a message."""
        if msg.message_type is not MessageType.SIGNAL:
            return None
        if msg.member == "NameOwnerChanged" and msg.sender == DBUS_NAME:
            self._on_owner_changed(msg.body[2])
            return None
        if msg.sender != self._systemd_owner:
            return None
        if msg.member == "PropertiesChanged":
            handle = self._handles.get(msg.path) if msg.path is not None else None
            if handle is not None:
                interface, changed, _invalidated = msg.body
                handle._apply(interface, {k: v.value for k, v in changed.items()})
        elif msg.member == "JobRemoved":
            _job_id, job_path, _unit, result = msg.body
            waiter = self._jobs.pop(job_path, None)
            if waiter is not None:
                if not waiter.done():
                    waiter.set_result(result)
            else:
                # The reply to StartUnit resolves a future whose waiter runs later; this signal
                # may be handled first. Keep the result for it.
                self._finished_jobs[job_path] = result
                while len(self._finished_jobs) > _FINISHED_JOBS_KEPT:
                    self._finished_jobs.popitem(last=False)
        elif msg.member == "UnitRemoved":
            _unit, path = msg.body
            event = self._removed.get(path)
            if event is not None:
                event.set()
        return None

    def _on_owner_changed(self, new_owner: str) -> None:
        # systemd re-executed (daemon-reexec, package upgrade) or the bus restarted it. It
        # keeps its subscribers across a re-exec, but signals sent meanwhile are lost: read
        # every tracked unit's state again.
        if not new_owner:
            log.warning("systemd left the bus; waiting for it to return")
            return
        log.info("systemd is back on the bus as %s: resynchronising %d units", new_owner, len(self._handles))
        self._systemd_owner = new_owner
        task = asyncio.get_running_loop().create_task(self._after_reexec(), name="systemd resync")
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _after_reexec(self) -> None:
        with contextlib.suppress(DBusError, RunnerError):
            await call(self._conn, SYSTEMD_BUS_NAME, SYSTEMD_PATH, MANAGER_IFACE, "Subscribe")
        for handle in list(self._handles.values()):
            with contextlib.suppress(RunnerError):
                await self._resync(handle)

    async def _resync(self, handle: SystemdHandle) -> None:
        """Read a unit's state now (after missed signals); a unit that is gone has ended."""
        try:
            service = (await call(self._conn, SYSTEMD_BUS_NAME, handle.path, PROPERTIES_IFACE, "GetAll", "s",
                                  [SERVICE_IFACE]))[0]
            unit = (await call(self._conn, SYSTEMD_BUS_NAME, handle.path, PROPERTIES_IFACE, "GetAll", "s",
                               [UNIT_IFACE]))[0]
        except DBusError:
            handle._finish(exit_info(handle._service.get("Result", "") or "unknown",
                                     int(handle._service.get("ExecMainCode", 0)),
                                     int(handle._service.get("ExecMainStatus", 0)), handle.unit or ""))
            return
        handle._apply(SERVICE_IFACE, {k: v.value for k, v in service.items()})
        handle._apply(UNIT_IFACE, {"ActiveState": unit["ActiveState"].value, "SubState": unit["SubState"].value})

    def _forget(self, handle: SystemdHandle) -> None:
        if self._handles.get(handle.path) is handle:
            del self._handles[handle.path]

    async def _wait_job(self, job_path: str, timeout_s: float) -> str:
        result = self._finished_jobs.pop(job_path, None)
        if result is not None:
            return result
        waiter = asyncio.get_running_loop().create_future()
        self._jobs[job_path] = waiter
        try:
            async with asyncio.timeout(timeout_s):
                return await waiter
        finally:
            self._jobs.pop(job_path, None)

    # --- Runner --------------------------------------------------------------------------

    def unit_properties(self, request: LaunchRequest, argv0: str, nft: str | None = None) -> list[tuple[str, Variant]]:
        """The ``a(sv)`` properties of the transient unit for ``request`` (pure; units.engine_unit_properties)."""
        return engine_unit_properties(request, argv0, cache_root=self.cache_root, slice_name=self.slice_name,
                                      engine_user=self.engine_user, supplementary_groups=self.supplementary_groups,
                                      output=self.output, nft=nft)

    async def start(self, request: LaunchRequest) -> SystemdHandle:
        """Create and start the unit; returns once systemd has exec'd the engine.

        Raises RunnerError when the binary is missing or not executable, the unit exists and
        is running (adopt or stop it first), systemd refuses the unit, or the start job
        fails (the message carries systemd's result and exit status).
        """
        if self._closed:
            raise RunnerError("systemd runner is closed")
        if not request.argv:
            raise RunnerError(f"{request.name}: empty command line")
        argv0 = resolve_binary(request.argv[0], request.env)
        name = unit_name(request.name)
        nft = nft_binary() if request.firewall is not None else None
        props = self.unit_properties(request, argv0, nft)
        handle = SystemdHandle(self, name, request.labels)
        handle.memory_max_bytes = request.memory_max_bytes
        if handle.path in self._handles and self._handles[handle.path].running():
            raise RunnerError(f"unit {name} is already running under this runner")
        # Registered before the call: the unit may change state before the reply arrives.
        self._handles[handle.path] = handle
        try:
            job = await self._start_transient(name, props)
            result = await self._wait_job(job, START_JOB_TIMEOUT_S)
        except TimeoutError:
            self._forget(handle)
            raise RunnerError(f"systemd did not finish starting {name} within {START_JOB_TIMEOUT_S:.0f} s") from None
        except DBusError as exc:
            self._forget(handle)
            raise RunnerError(f"systemd could not start {name}: {exc.text}") from exc
        except BaseException:
            self._forget(handle)
            raise
        if result != "done":
            info = handle._exit.result() if handle._exit.done() else None
            self._forget(handle)
            why = info.describe() if info else "no exit status"
            raise RunnerError(f"systemd could not start {name} ({argv0}): job {result}, {why}")
        handle._seen_running = True
        if handle.running() and handle.pid is None:
            await self._resync(handle)
        log.info("started engine unit %s: pid %s", name, handle.pid)
        return handle

    async def _start_transient(self, name: str, props: list[tuple[str, Variant]]) -> str:
        for attempt in (1, 2):
            try:
                body = await call(self._conn, SYSTEMD_BUS_NAME, SYSTEMD_PATH, MANAGER_IFACE, "StartTransientUnit",
                                  "ssa(sv)a(sa(sv))", [name, "fail", props, []])
                return body[0]
            except DBusError as exc:
                if exc.type != "org.freedesktop.systemd1.UnitExists" or attempt == 2:
                    raise RunnerError(f"systemd refused unit {name}: {exc.text}") from exc
            # A unit of that name is still loaded: a dead one waiting for garbage collection
            # (reset it and wait for UnitRemoved), or a running one we must not touch.
            path = unit_object_path(name)
            state = await get_property(self._conn, path, UNIT_IFACE, "ActiveState")
            if state not in ("inactive", "failed"):
                raise RunnerError(f"unit {name} already exists and is {state}: adopt it or stop it first")
            removed = self._removed.setdefault(path, asyncio.Event())
            try:
                with contextlib.suppress(DBusError):
                    await call(self._conn, SYSTEMD_BUS_NAME, SYSTEMD_PATH, MANAGER_IFACE, "ResetFailedUnit", "s", [name])
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(5.0):
                        await removed.wait()
            finally:
                self._removed.pop(path, None)
        raise AssertionError("unreachable")

    async def adoptable(self, owner: str, prefix: str = UNIT_PREFIX) -> list[SystemdHandle]:
        """Running engine units labelled ``owner=<owner>``, as handles watched from now on.

        Lists ``<prefix>*.service`` units (``viiwork-engine-*``; a gang's parts are
        ``viiwork-gang-*``: agent/supervision/gang_units.py) that are active, activating or reloading
        (``ListUnitsByPatterns``) and reads each one's Environment for its labels. Units
        that are being stopped are left alone. Raises RunnerError when systemd cannot list.
        """
        try:
            units = (await call(self._conn, SYSTEMD_BUS_NAME, SYSTEMD_PATH, MANAGER_IFACE, "ListUnitsByPatterns",
                                "asas", [["active", "activating", "reloading"], [f"{prefix}*.service"]]))[0]
        except DBusError as exc:
            raise RunnerError(f"cannot list engine units: {exc.text}") from exc
        found = []
        for entry in units:
            name, path = entry[0], entry[6]
            existing = self._handles.get(path)
            if existing is not None and existing.running():
                if existing.labels.get("owner") == owner:
                    found.append(existing)
                continue
            handle = SystemdHandle(self, name, {})
            handle._seen_running = True
            self._handles[path] = handle
            try:
                service = (await call(self._conn, SYSTEMD_BUS_NAME, path, PROPERTIES_IFACE, "GetAll", "s",
                                      [SERVICE_IFACE]))[0]
            except DBusError:
                self._forget(handle)  # gone since the listing
                continue
            labels = labels_from_environment(service["Environment"].value)
            if labels is None or labels.get("owner") != owner:
                self._forget(handle)
                continue
            handle.labels = labels
            limit = service.get("MemoryMax")
            if limit is not None and limit.value != 2**64 - 1:
                handle.memory_max_bytes = int(limit.value)
            handle._apply(SERVICE_IFACE, {k: v.value for k, v in service.items()})
            await self._resync(handle)
            if handle.running():
                found.append(handle)
        log.info("adoptable engine units of %s: %s", owner, [h.unit for h in found] or "none")
        return found

    async def close(self) -> None:
        """Disconnect from the bus. The units keep running (they belong to systemd)."""
        if self._closed:
            return
        self._closed = True
        for task in list(self._tasks):
            task.cancel()
        self._conn.remove_message_handler(self._on_message)
        self._conn.disconnect()
        with contextlib.suppress(Exception):
            async with asyncio.timeout(2.0):
                await self._conn.wait_for_disconnect()
