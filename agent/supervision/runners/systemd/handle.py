"""SystemdHandle: one engine unit as a ``RunHandle``: its state from systemd's signals, how it ended, stopping it.

The runner (runner.py) routes each unit's ``PropertiesChanged`` signals to its handle;
the handle ends when ``ActiveState`` turns ``inactive`` or ``failed`` after it was seen
running. On cgroup v1 an OOM kill reads as SIGKILL: the handle says so in the detail when
the unit had a ``MemoryMax`` (runner.py's docstring, "Limits").
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Protocol

from dbus_fast.aio import MessageBus
from dbus_fast.errors import DBusError

from viiwork.agent.supervision.runners.base import ExitInfo, RunnerError
from viiwork.agent.supervision.runners.systemd.bus import (
    MANAGER_IFACE,
    SERVICE_IFACE,
    SYSTEMD_BUS_NAME,
    SYSTEMD_PATH,
    UNIT_IFACE,
    call,
)
from viiwork.agent.supervision.runners.systemd.units import exit_info, unit_object_path

log = logging.getLogger(__name__)

#: After SIGKILL a unit is inactive within milliseconds unless stuck in the kernel.
KILL_WAIT_S = 10.0


class UnitWatcher(Protocol):
    """What a handle needs of the runner that watches its unit (SystemdRunner)."""

    @property
    def bus(self) -> MessageBus: ...

    async def _resync(self, handle: SystemdHandle) -> None: ...

    def _forget(self, handle: SystemdHandle) -> None: ...


def _pure_cgroup_v2() -> bool:
    return Path("/sys/fs/cgroup/cgroup.controllers").exists()


class SystemdHandle:
    """One engine unit (a ``RunHandle``). State arrives through the runner's signal handler.

    ``pid``: the unit's MainPID as systemd reports it (a PID in systemd's PID namespace),
    kept after the exit; ``unit``: the unit name; ``labels``: from the unit's environment.
    """

    def __init__(self, runner: UnitWatcher, unit: str, labels: Mapping[str, str]) -> None:
        self._runner = runner
        self.unit: str | None = unit
        self.path = unit_object_path(unit)
        self.labels: Mapping[str, str] = dict(labels)
        self.pid: int | None = None
        self.active_state = ""
        self.sub_state = ""
        self.memory_max_bytes: int | None = None
        self._seen_running = False
        self._stopping = False
        self._service: dict[str, Any] = {}
        self._exit: asyncio.Future[ExitInfo] = asyncio.get_running_loop().create_future()

    def __repr__(self) -> str:
        return f"<SystemdHandle {self.unit} pid={self.pid} {self.active_state}/{self.sub_state}>"

    # Called from the runner's message handler (synchronously, on the loop).
    def _apply(self, interface: str, changed: Mapping[str, Any]) -> None:
        if self._exit.done():
            return
        if interface == SERVICE_IFACE:
            self._service.update(changed)
            main_pid = changed.get("MainPID")
            if main_pid:
                self.pid = int(main_pid)
        elif interface == UNIT_IFACE:
            if "ActiveState" in changed:
                self.active_state = changed["ActiveState"]
            if "SubState" in changed:
                self.sub_state = changed["SubState"]
            if self.active_state in ("activating", "active", "reloading", "deactivating"):
                self._seen_running = True
            elif self.active_state in ("inactive", "failed") and self._seen_running:
                self._finish()

    def _finish(self, info: ExitInfo | None = None) -> None:
        if self._exit.done():
            return
        if info is None:
            info = exit_info(
                self._service.get("Result", ""),
                int(self._service.get("ExecMainCode", 0)),
                int(self._service.get("ExecMainStatus", 0)),
                self.unit or "",
            )
            if (info.signal == signal.SIGKILL and self.memory_max_bytes is not None
                    and info.result == "signal" and not self._stopping and not _pure_cgroup_v2()):
                info = ExitInfo(info.result, info.returncode, info.signal,
                                f"unit {self.unit}: SIGKILL, perhaps by the kernel at MemoryMax="
                                f"{self.memory_max_bytes}: on cgroup v1 systemd cannot tell an OOM kill "
                                "from another SIGKILL (Result=oom-kill needs cgroup v2)")
        self._exit.set_result(info)
        self._runner._forget(self)
        log.info("engine unit %s (pid %s) ended: %s", self.unit, self.pid, info.describe())

    def running(self) -> bool:
        return not self._exit.done()

    async def wait(self) -> ExitInfo:
        """How the unit ended; waits for it. Safe to call many times, and to cancel."""
        return await asyncio.shield(self._exit)

    async def stop(self, grace_s: float) -> ExitInfo:
        """``StopUnit`` (SIGTERM to the cgroup), ``KillUnit`` SIGKILL to the cgroup after
        ``grace_s``; returns how it ended. Raises RunnerError when the unit is still not
        inactive 10 s after SIGKILL, or systemd cannot be reached."""
        if self._exit.done():
            return self._exit.result()
        self._stopping = True
        conn = self._runner.bus
        try:
            await call(conn, SYSTEMD_BUS_NAME, SYSTEMD_PATH, MANAGER_IFACE, "StopUnit", "ss", [self.unit, "replace"])
        except DBusError as exc:
            if exc.type != "org.freedesktop.systemd1.NoSuchUnit":
                raise RunnerError(f"StopUnit {self.unit}: {exc.text}") from exc
            await self._runner._resync(self)
        try:
            async with asyncio.timeout(grace_s):
                return await self.wait()
        except TimeoutError:
            log.warning("engine unit %s ignored SIGTERM for %.1f s: SIGKILL to its cgroup", self.unit, grace_s)
        with contextlib.suppress(DBusError):
            await call(conn, SYSTEMD_BUS_NAME, SYSTEMD_PATH, MANAGER_IFACE, "KillUnit", "ssi",
                       [self.unit, "all", int(signal.SIGKILL)])
        try:
            async with asyncio.timeout(KILL_WAIT_S):
                return await self.wait()
        except TimeoutError:
            await self._runner._resync(self)
            if self._exit.done():
                return self._exit.result()
            raise RunnerError(f"engine unit {self.unit} still {self.active_state} {KILL_WAIT_S:.0f} s after SIGKILL") from None
