"""systemd's D-Bus plumbing: bus addresses, connecting, method calls, and whether systemd is on a bus.

dbus-fast (asyncio) on the system bus in production and the user bus in development and
tests. Every failure to reach the bus or to get a reply is a RunnerError; an error reply
from systemd is a DBusError (its ``type`` names systemd's error).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from dataclasses import dataclass
from typing import Any, Literal

from dbus_fast import BusType, Message, MessageType
from dbus_fast.aio import MessageBus
from dbus_fast.errors import DBusError

from viiwork.agent.supervision.runners.base import RunnerError

SYSTEMD_BUS_NAME = "org.freedesktop.systemd1"
SYSTEMD_PATH = "/org/freedesktop/systemd1"
MANAGER_IFACE = "org.freedesktop.systemd1.Manager"
UNIT_IFACE = "org.freedesktop.systemd1.Unit"
SERVICE_IFACE = "org.freedesktop.systemd1.Service"
JOB_IFACE = "org.freedesktop.systemd1.Job"
PROPERTIES_IFACE = "org.freedesktop.DBus.Properties"
DBUS_NAME = "org.freedesktop.DBus"
DBUS_PATH = "/org/freedesktop/DBus"

#: Seconds to wait for one D-Bus method reply from systemd.
CALL_TIMEOUT_S = 10.0


def bus_address(bus: Literal["system", "user"], address: str | None = None) -> str:
    """The D-Bus address to use: ``address`` if given, else the environment's, else the default.

    system: ``$DBUS_SYSTEM_BUS_ADDRESS`` or ``unix:path=/run/dbus/system_bus_socket``.
    user: ``$DBUS_SESSION_BUS_ADDRESS`` or ``unix:path=$XDG_RUNTIME_DIR/bus``.
    Raises RunnerError when no user bus can be named.
    """
    if address:
        return address
    if bus == "system":
        return os.environ.get("DBUS_SYSTEM_BUS_ADDRESS") or "unix:path=/run/dbus/system_bus_socket"
    env = os.environ.get("DBUS_SESSION_BUS_ADDRESS")
    if env:
        return env
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    if runtime:
        return f"unix:path={runtime}/bus"
    raise RunnerError(
        'supervisor.bus = "user" but neither DBUS_SESSION_BUS_ADDRESS nor XDG_RUNTIME_DIR is set '
        "(set supervisor.bus_address)"
    )


async def open_bus(bus: Literal["system", "user"], address: str | None = None,
                   timeout_s: float = CALL_TIMEOUT_S) -> MessageBus:
    """Connect to the bus; RunnerError naming the address when it cannot."""
    where = bus_address(bus, address)
    conn = MessageBus(bus_address=where, bus_type=BusType.SYSTEM if bus == "system" else BusType.SESSION)
    try:
        async with asyncio.timeout(timeout_s):
            await conn.connect()
    except (OSError, TimeoutError, DBusError, EOFError, ValueError) as exc:
        with contextlib.suppress(Exception):
            conn.disconnect()
        raise RunnerError(f"cannot connect to the D-Bus {bus} bus at {where}: {exc or type(exc).__name__}") from exc
    return conn


async def call(conn: MessageBus, destination: str, path: str, interface: str, member: str,
               signature: str = "", body: list[Any] | None = None,
               timeout_s: float = CALL_TIMEOUT_S) -> list[Any]:
    """One method call; returns the reply body. Raises DBusError (systemd's error) or
    RunnerError (no reply within ``timeout_s``, or the connection is gone)."""
    msg = Message(destination=destination, path=path, interface=interface, member=member,
                  signature=signature, body=body or [])
    try:
        async with asyncio.timeout(timeout_s):
            reply = await conn.call(msg)
    except TimeoutError:
        raise RunnerError(f"D-Bus call {interface}.{member} got no reply within {timeout_s:.0f} s") from None
    except (OSError, EOFError) as exc:
        raise RunnerError(f"D-Bus connection lost during {member}: {exc}") from exc
    if reply is None:
        raise RunnerError(f"D-Bus connection closed during {member}")
    if reply.message_type is MessageType.ERROR:
        # An ERROR message always names its error (D-Bus specification); Failed if a peer did not.
        raise DBusError(reply.error_name or "org.freedesktop.DBus.Error.Failed", reply.body[0] if reply.body else "")
    return reply.body


async def get_property(conn: MessageBus, path: str, interface: str, name: str) -> Any:
    """One property of a systemd object (its value, unwrapped)."""
    body = await call(conn, SYSTEMD_BUS_NAME, path, PROPERTIES_IFACE, "Get", "ss", [interface, name])
    return body[0].value


async def has_systemd(conn: MessageBus, wait_s: float = 0.0) -> tuple[bool, str]:
    """Whether ``org.freedesktop.systemd1`` answers on ``conn``: (yes, its version or the reason).

    Owned names only: a bus that could activate systemd1 but where nobody owns it is not
    enough, and neither is a bus whose owner does not answer ``Manager.Version``. ``wait_s``:
    how long to wait for systemd to join the bus (PID 1 connects once dbus.service is up,
    which at boot can be after a service ordered only after dbus.socket has started).
    """
    joined = asyncio.Event()

    def on_owner(msg: Message) -> None:
        if (msg.message_type is MessageType.SIGNAL and msg.member == "NameOwnerChanged"
                and msg.body and msg.body[0] == SYSTEMD_BUS_NAME and msg.body[2]):
            joined.set()

    conn.add_message_handler(on_owner)
    try:
        if wait_s > 0:
            await call(conn, DBUS_NAME, DBUS_PATH, DBUS_NAME, "AddMatch", "s",
                       [f"type='signal',sender='{DBUS_NAME}',member='NameOwnerChanged',arg0='{SYSTEMD_BUS_NAME}'"])
        owned = (await call(conn, DBUS_NAME, DBUS_PATH, DBUS_NAME, "NameHasOwner", "s", [SYSTEMD_BUS_NAME]))[0]
        if not owned and wait_s > 0:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(wait_s):
                    await joined.wait()
                    owned = True
    except (DBusError, RunnerError) as exc:
        return False, f"NameHasOwner failed: {exc}"
    finally:
        conn.remove_message_handler(on_owner)
    if not owned:
        waited = f" (waited {wait_s:g} s)" if wait_s > 0 else ""
        return False, f"no {SYSTEMD_BUS_NAME} on this bus{waited}"
    try:
        version = await get_property(conn, SYSTEMD_PATH, MANAGER_IFACE, "Version")
    except (DBusError, RunnerError) as exc:
        return False, f"{SYSTEMD_BUS_NAME} does not answer Manager.Version: {exc}"
    return True, f"systemd {version}"


@dataclass(frozen=True)
class RunnerChoice:
    """What ``supervisor.runner = "auto"`` resolves to: ``kind`` and why (for the log)."""

    kind: Literal["systemd", "process"]
    reason: str


async def detect_runner(bus: Literal["system", "user"] = "system", address: str | None = None,
                        timeout_s: float = 3.0, wait_s: float = 0.0) -> RunnerChoice:
    """``systemd`` when the chosen bus has a live ``org.freedesktop.systemd1``, else ``process``.

    ``wait_s``: how long to wait for systemd to join a bus where it is missing (has_systemd).
    Never raises: an unreachable bus is a reason to pick the process runner.
    """
    try:
        conn = await open_bus(bus, address, timeout_s)
    except RunnerError as exc:
        return RunnerChoice("process", str(exc))
    try:
        ok, reason = await has_systemd(conn, wait_s)
    finally:
        conn.disconnect()
    return RunnerChoice("systemd" if ok else "process", f"{bus} bus: {reason}")
