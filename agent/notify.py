"""The agent's side of systemd's service protocol: readiness, watchdog, status, stop intent.

Notifications follow sd_notify(3): one datagram of ``KEY=value`` lines to the Unix socket
named by ``$NOTIFY_SOCKET`` (a leading ``@`` means the abstract namespace). Without that
variable (not started by systemd, or ``Type=`` other than notify) every call is a no-op.
The variables are removed from ``os.environ`` when read (as sd_notify's ``unset_environment``
does), so no engine the agent starts inherits the agent's notify socket or watchdog.

Watchdog: systemd sets ``WATCHDOG_USEC`` (and ``WATCHDOG_PID``) from ``WatchdogSec=``; the
service must send ``WATCHDOG=1`` more often than that, and sd_watchdog_enabled(3) advises
every half period. ``run_watchdog`` sends it from the event loop itself, so a blocked loop
misses the deadline and systemd kills (SIGABRT) and restarts the agent.

Stop intent (``stop_intent``): when the agent is asked to exit (SIGTERM), it must tell a
restart from a stop, because a restart keeps the engine units (the next agent adopts them)
and a stop drains and stops them. The rule, from systemd's job model
(org.freedesktop.systemd1(5), "Job objects"; systemctl(1)): systemd carries out every
state change of a unit as a job, and the job is installed on the unit before its stop
command (SIGTERM) is sent. ``systemctl restart`` (and ``try-restart``, ``reload-or-restart``,
and a package upgrade, whose maintainer scripts call ``deb-systemd-invoke restart``)
installs a job of type ``restart``, which keeps that type while it stops the unit and turns
into a start afterwards. ``systemctl stop``, package removal, shutdown and isolate install a
``stop`` job. So: the agent finds its own unit (``GetUnitByPID``), reads the unit's ``Job``
and that job's ``JobType``: ``restart`` (or ``try-restart``/``reload-or-restart``) means
RESTART; anything else, including no job (a bare ``kill``: the process ends without systemd
scheduling a start) and any failure to ask, means STOP, the safe side: engines never hold
GPUs with no agent coming back. An agent that crashes or misses its watchdog never runs this
code; its engines keep running and the restarted agent adopts them (``Restart=on-failure``).
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
from collections.abc import Callable, Mapping, MutableMapping
from dataclasses import dataclass
from enum import StrEnum

from dbus_fast.aio import MessageBus
from dbus_fast.errors import DBusError

from viiwork.agent.supervision.backends import ModelRuntime
from viiwork.agent.supervision.runners.base import Runner, RunnerError
from viiwork.agent.supervision.runners.systemd.bus import (
    JOB_IFACE,
    MANAGER_IFACE,
    SYSTEMD_BUS_NAME,
    SYSTEMD_PATH,
    UNIT_IFACE,
    call,
    get_property,
)
from viiwork.agent.supervision.supervisor import Supervisor

log = logging.getLogger(__name__)

#: Job types that mean "systemd will start this unit again once it has stopped".
RESTART_JOB_TYPES = frozenset({"restart", "try-restart", "reload-or-restart", "reload-or-try-restart"})
#: One STATUS= line at most this long (systemctl status shows one line).
STATUS_MAX_CHARS = 200


class Notifier:
    """Sends sd_notify messages for this process (see the module docstring).

    ``environ``: where to read (and remove) NOTIFY_SOCKET, WATCHDOG_USEC, WATCHDOG_PID;
    ``os.environ`` by default. ``pid``: this process, for the WATCHDOG_PID check.
    """

    def __init__(self, environ: MutableMapping[str, str] | None = None, pid: int | None = None) -> None:
        env = os.environ if environ is None else environ
        self.address = env.pop("NOTIFY_SOCKET", None) or None
        usec = env.pop("WATCHDOG_USEC", None)
        watchdog_pid = env.pop("WATCHDOG_PID", None)
        me = os.getpid() if pid is None else pid
        self.watchdog_interval_s: float | None = None
        if usec and (watchdog_pid is None or watchdog_pid == str(me)):
            try:
                period = int(usec)
            except ValueError:
                log.warning("ignoring WATCHDOG_USEC=%r: not an integer", usec)
            else:
                if period > 0:
                    # sd_watchdog_enabled(3): notify at half the period.
                    self.watchdog_interval_s = period / 2 / 1_000_000
        self._sock: socket.socket | None = None
        self._failed = False

    @property
    def enabled(self) -> bool:
        """True when systemd listens (NOTIFY_SOCKET was set)."""
        return self.address is not None

    def send(self, **fields: str) -> bool:
        """Send ``KEY=value`` lines (keys upper-cased); True if sent, False if disabled or failed.

        Never raises: a failure is logged once at WARNING, then at DEBUG.
        """
        if self.address is None:
            return False
        lines = []
        for key, value in fields.items():
            if "\n" in value:
                raise ValueError(f"sd_notify {key} value must be one line")
            lines.append(f"{key.upper()}={value}")
        target = "\0" + self.address[1:] if self.address.startswith("@") else self.address
        try:
            if self._sock is None:
                self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
                self._sock.setblocking(False)
            self._sock.sendto("\n".join(lines).encode(), target)
        except OSError as exc:
            (log.debug if self._failed else log.warning)("sd_notify to %s failed: %s", self.address, exc)
            self._failed = True
            return False
        return True

    def ready(self, status: str | None = None) -> bool:
        """READY=1 (once the API is bound and the mesh started), with an optional STATUS."""
        fields = {"READY": "1"}
        if status is not None:
            fields["STATUS"] = one_line(status)
        return self.send(**fields)

    def status(self, text: str) -> bool:
        """STATUS=<one line>, shown by ``systemctl status viiwork``."""
        return self.send(STATUS=one_line(text))

    def reloading(self) -> bool:
        """RELOADING=1 while a config reload runs; send ready() when it is done."""
        return self.send(RELOADING="1")

    def stopping(self, status: str | None = None) -> bool:
        """STOPPING=1 when shutdown begins."""
        fields = {"STOPPING": "1"}
        if status is not None:
            fields["STATUS"] = one_line(status)
        return self.send(**fields)

    def watchdog(self) -> bool:
        return self.send(WATCHDOG="1")

    async def run_watchdog(self, alive: Callable[[], bool] | None = None) -> None:
        """Send WATCHDOG=1 every half period until cancelled; returns at once when disabled.

        ``alive`` (optional, must not block): when it returns False the ping is skipped, so
        a wedged subsystem gets the agent restarted too.
        """
        if self.watchdog_interval_s is None or self.address is None:
            return
        log.info("systemd watchdog: pinging every %.1f s", self.watchdog_interval_s)
        while True:
            if alive is None or alive():
                self.watchdog()
            else:
                log.warning("watchdog ping skipped: the agent reports itself not alive")
            await asyncio.sleep(self.watchdog_interval_s)

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None


async def run_status(notifier: Notifier, line: Callable[[], str], interval_s: float = 5.0) -> None:
    """Send STATUS=<line()> whenever it changed, checking every ``interval_s``; until cancelled.

    ``line`` must not block (it reads the agent's in-memory picture).
    """
    if not notifier.enabled:
        return
    last = None
    while True:
        text = one_line(line())
        if text != last:
            notifier.status(text)
            last = text
        await asyncio.sleep(interval_s)


def status_line(models: Mapping[str, ModelRuntime], peers: int | None = None) -> str:
    """The agent's one-line summary: ``"2 models, 3/4 backends healthy, 5/8 slots busy"``
    (``", 4 peers"`` appended when the mesh runs), from ``ModelRuntime.capacity``."""
    caps = [rt.capacity() for rt in models.values()]
    text = (f"{len(models)} model{'' if len(models) == 1 else 's'}, "
            f"{sum(c.healthy for c in caps)}/{sum(c.total for c in caps)} backends healthy, "
            f"{sum(c.busy for c in caps)}/{sum(c.slots for c in caps)} slots busy")
    if peers is not None:
        text += f", {peers} peer{'' if peers == 1 else 's'}"
    return text


def one_line(text: str) -> str:
    """``text`` as one line of at most STATUS_MAX_CHARS characters."""
    flat = " ".join(text.split())
    return flat if len(flat) <= STATUS_MAX_CHARS else flat[: STATUS_MAX_CHARS - 1] + "…"


class StopIntent(StrEnum):
    RESTART = "restart"   # systemd starts the agent again: keep engine units for adoption
    STOP = "stop"         # nothing restarts the agent: drain and stop engine units


@dataclass(frozen=True)
class StopDecision:
    """The answer of ``stop_intent``: ``intent``, the agent's ``unit`` and ``job_type`` as
    systemd reported them (None when unknown), and ``reason`` for the log."""

    intent: StopIntent
    reason: str
    unit: str | None = None
    job_type: str | None = None


async def stop_intent(conn: MessageBus, pid: int | None = None, timeout_s: float = 3.0) -> StopDecision:
    """Whether systemd is restarting this process's unit or stopping it (module docstring).

    ``conn``: a connection to the bus of the systemd that manages the agent (the system bus
    in production). Never raises; failures decide STOP with the reason.
    """
    me = os.getpid() if pid is None else pid
    try:
        async with asyncio.timeout(timeout_s):
            path = (await call(conn, SYSTEMD_BUS_NAME, SYSTEMD_PATH, MANAGER_IFACE, "GetUnitByPID", "u", [me]))[0]
            unit = await get_property(conn, path, UNIT_IFACE, "Id")
            job_id, job_path = await get_property(conn, path, UNIT_IFACE, "Job")
            if not job_id:
                return StopDecision(StopIntent.STOP, f"no job queued for {unit}: not a restart", unit)
            job_type = await get_property(conn, job_path, JOB_IFACE, "JobType")
    except (DBusError, RunnerError, TimeoutError, OSError) as exc:
        text = getattr(exc, "text", None) or str(exc) or type(exc).__name__
        return StopDecision(StopIntent.STOP, f"could not ask systemd about pid {me}: {text}")
    if job_type in RESTART_JOB_TYPES:
        return StopDecision(StopIntent.RESTART, f"{unit} has a {job_type} job queued", unit, job_type)
    return StopDecision(StopIntent.STOP, f"{unit} has a {job_type} job queued", unit, job_type)


async def runner_stop_intent(runner: Runner) -> StopDecision:
    """What to do with ``runner``'s engines on the way out.

    The systemd runner: ask systemd over the runner's own bus (stop_intent); its engines
    survive the agent only when a restart is coming. Any other runner: STOP (its engines
    die with the agent anyway, so they are drained and stopped in order).
    """
    bus = getattr(runner, "bus", None)
    if runner.name != "systemd" or not isinstance(bus, MessageBus):
        return StopDecision(StopIntent.STOP, f"the {runner.name} runner's engines do not outlive the agent")
    return await stop_intent(bus)


async def finish_supervision(supervisor: Supervisor, runner: Runner, notifier: Notifier,
                             decision: StopDecision | None = None) -> StopDecision:
    """The agent's way out: STOPPING=1, then stop the engines or leave them for the next agent.

    RESTART (runner_stop_intent): ``supervisor.detach()``, engine units keep running and the
    restarted agent adopts them. STOP: ``supervisor.stop()``, drain and stop every engine.
    ``decision``: the intent already asked at the start of the stop (the agent publishes it
    to the mesh as ``restarting`` or ``leaving`` before its requests drain); asked here
    when None.
    """
    if decision is None:
        decision = await runner_stop_intent(runner)
    if decision.intent is StopIntent.RESTART:
        log.info("stopping for a restart (%s): engines keep running for the next agent", decision.reason)
        notifier.stopping("restarting: engines keep running")
        await supervisor.detach()
    else:
        log.info("stopping (%s): draining and stopping engines", decision.reason)
        notifier.stopping("stopping: draining and stopping engines")
        await supervisor.stop()
    return decision
