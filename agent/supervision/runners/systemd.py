"""SystemdRunner: each backend is a transient systemd service, driven over D-Bus (docs/architecture.md, "A backend's life").

The runner talks to ``org.freedesktop.systemd1`` with dbus-fast (asyncio), on the system bus
in production and the user bus in development and tests:

- ``StartTransientUnit`` creates ``viiwork-engine-<node>-<model>-<n>.service`` in
  ``viiwork-engines.slice`` with ``Type=exec`` (the start job finishes once ``execve``
  succeeded, so a missing binary fails the start instead of a later exit),
  ``KillMode=control-group`` (the engine's whole tree dies: vLLM leaves orphan workers that
  hold GPU memory otherwise), ``TimeoutStopUSec`` (then SIGKILL: llama-server hangs on
  SIGTERM with a request in flight), ``CollectMode=inactive-or-failed`` (no failed units
  pile up), a ``CacheDirectory`` with ``HOME`` and ``XDG_CACHE_HOME`` pointing into it (for
  engines that JIT or cache), and optional limits and a sandbox profile.
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
import grp
import hashlib
import logging
import os
import pwd
import re
import shutil
import signal
import stat
from collections import OrderedDict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from dbus_fast import BusType, Message, MessageType, Variant
from dbus_fast.aio import MessageBus
from dbus_fast.errors import DBusError

from viiwork.agent.supervision.runners.base import ExitInfo, LaunchRequest, RunnerError

if TYPE_CHECKING:
    from viiwork.agent.config.schema import Config

log = logging.getLogger(__name__)

SYSTEMD_BUS_NAME = "org.freedesktop.systemd1"
SYSTEMD_PATH = "/org/freedesktop/systemd1"
MANAGER_IFACE = "org.freedesktop.systemd1.Manager"
UNIT_IFACE = "org.freedesktop.systemd1.Unit"
SERVICE_IFACE = "org.freedesktop.systemd1.Service"
JOB_IFACE = "org.freedesktop.systemd1.Job"
PROPERTIES_IFACE = "org.freedesktop.DBus.Properties"
DBUS_NAME = "org.freedesktop.DBus"
DBUS_PATH = "/org/freedesktop/DBus"

#: Every engine unit lives in this slice; ``viiwork-engines-stop.service`` stops it.
ENGINE_SLICE = "viiwork-engines.slice"
#: Unit names of engines start with this; adoption lists units matching it.
UNIT_PREFIX = "viiwork-engine-"
#: Relative to the manager's cache root (``/var/cache`` for the system manager).
CACHE_DIRECTORY = "viiwork/engines"
#: The unprivileged user engines run as on the system bus, when it exists (sysusers.d).
ENGINE_USER = "viiwork"
#: Label keys are stored as ``VIIWORK_<KEY>`` in the unit's environment, listed here.
LABELS_VARIABLE = "VIIWORK_LABELS"

#: systemd's UNIT_NAME_MAX is 256 bytes including the terminating NUL.
UNIT_NAME_MAX = 255
#: Seconds to wait for one D-Bus method reply from systemd.
CALL_TIMEOUT_S = 10.0
#: Seconds for a start job (exec, plus creating/chowning the cache directory).
START_JOB_TIMEOUT_S = 60.0
#: After SIGKILL a unit is inactive within milliseconds unless stuck in the kernel.
KILL_WAIT_S = 10.0
#: Seconds ``auto`` waits for PID 1 to join the system bus on a host booted with systemd.
SYSTEMD_JOIN_WAIT_S = 15.0
#: How many finished jobs are remembered for waiters that registered late.
_FINISHED_JOBS_KEPT = 512

# siginfo codes in ExecMainCode (waitid(2)).
_CLD_EXITED, _CLD_KILLED, _CLD_DUMPED = 1, 2, 3

#: systemd's own exit statuses (systemd.exec(5), "Process exit codes"): the engine never ran.
_SYSTEMD_EXIT_STATUS = {
    200: "CHDIR", 203: "EXEC (the binary could not be executed)", 204: "MEMORY", 205: "LIMITS",
    209: "STDOUT (the output file could not be opened)", 210: "CHROOT",
    216: "GROUP (a SupplementaryGroups= group does not exist)", 217: "USER (the engine user does not exist)",
    218: "CAPABILITIES", 219: "CGROUP", 226: "NAMESPACE (the sandbox could not be set up; try sandbox = \"none\")",
    227: "NO_NEW_PRIVILEGES", 228: "SECCOMP", 232: "ADDRESS_FAMILIES", 235: "CHOWN",
    239: "CACHE_DIRECTORY (the cache directory could not be created)", 245: "BPF",
}

_LABEL_KEY = re.compile(r"^[a-z][a-z0-9_]*$")
_UNIT_CHARS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789:_.-\\")
_COMPONENT_CHARS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789:_.")

#: Variables that describe the agent's own service or session and would be wrong for an
#: engine unit (systemd sets the right ones itself); removed from a request's environment.
_UNIT_OWN_VARIABLES = frozenset({
    "HOME", "XDG_CACHE_HOME", "USER", "LOGNAME", "SHELL", "XDG_RUNTIME_DIR",
    "DBUS_SESSION_BUS_ADDRESS", "NOTIFY_SOCKET", "WATCHDOG_USEC", "WATCHDOG_PID",
    "INVOCATION_ID", "JOURNAL_STREAM", "LISTEN_FDS", "LISTEN_PID", "LISTEN_FDNAMES",
    "RUNTIME_DIRECTORY", "STATE_DIRECTORY", "CACHE_DIRECTORY", "LOGS_DIRECTORY",
    "CONFIGURATION_DIRECTORY", "CREDENTIALS_DIRECTORY", "MANAGERPID", "SYSTEMD_EXEC_PID",
})

#: Device nodes whose group an engine needs (NVIDIA, DRM render nodes, AMD KFD).
_GPU_DEVICE_GLOBS = ("nvidia*", "dri/card*", "dri/renderD*", "kfd")
_GPU_GROUP_NAMES = ("video", "render")

# Sandbox profiles (``models[].sandbox``). None blocks a GPU: no PrivateDevices, no
# DeviceAllow (ProtectClock would imply one), no MemoryDenyWriteExecute (engines JIT).
_BASIC: tuple[tuple[str, str, Any], ...] = (
    ("NoNewPrivileges", "b", True),
    ("PrivateTmp", "b", True),
    ("ProtectSystem", "s", "full"),
    ("ProtectHome", "s", "read-only"),
    ("ProtectKernelTunables", "b", True),
    ("ProtectKernelModules", "b", True),
    ("ProtectControlGroups", "b", True),
    ("RestrictSUIDSGID", "b", True),
    ("RestrictRealtime", "b", True),
    ("LockPersonality", "b", True),
)
_STRICT: tuple[tuple[str, str, Any], ...] = (
    *(p for p in _BASIC if p[0] != "ProtectSystem"),
    ("ProtectSystem", "s", "strict"),
    ("ProtectKernelLogs", "b", True),
    ("ProtectHostname", "b", True),
    # The D-Bus value is the set of namespace types still allowed: 0 = none ("yes").
    ("RestrictNamespaces", "t", 0),
    ("SystemCallArchitectures", "as", ["native"]),
    ("RestrictAddressFamilies", "(bas)", [True, ["AF_UNIX", "AF_INET", "AF_INET6", "AF_NETLINK"]]),
    # Loopback only: enforced with cgroup v2 BPF; systemd warns and ignores it on cgroup v1.
    ("IPAddressDeny", "a(iayu)", [[2, bytes(4), 0], [10, bytes(16), 0]]),
    ("IPAddressAllow", "a(iayu)", [[2, bytes([127, 0, 0, 0]), 8], [10, bytes(15) + b"\x01", 128]]),
)
SANDBOX_PROFILES: dict[str, tuple[tuple[str, str, Any], ...]] = {
    "none": (),
    "basic": _BASIC,
    "strict": _STRICT,
}


# --- names -------------------------------------------------------------------------------


def _escape_bytes(ch: str) -> str:
    return "".join(f"\\x{b:02x}" for b in ch.encode())


def escape_unit_component(text: str) -> str:
    """One part of a unit name (node or model), unambiguous inside a dashed name.

    Keeps ``[A-Za-z0-9:_.]`` and writes every other byte (``-`` and ``/`` included) as
    ``\\xNN``, systemd-escape's notation; a leading ``.`` is escaped too, as systemd-escape
    does. ``"Qwen/Qwen3-8B:Q4"`` -> ``"Qwen\\x2fQwen3\\x2d8B:Q4"``.
    """
    out = []
    for i, ch in enumerate(text):
        if ch in _COMPONENT_CHARS and not (i == 0 and ch == "."):
            out.append(ch)
        else:
            out.append(_escape_bytes(ch))
    return "".join(out) or "\\x00"


def engine_unit_stem(node: str, model: str, index: int) -> str:
    """``viiwork-engine-<node>-<model>-<n>`` with node and model escaped (escape_unit_component),
    so that node ``a-b`` with model ``c`` and node ``a`` with model ``b-c`` never collide."""
    return f"{UNIT_PREFIX}{escape_unit_component(node)}-{escape_unit_component(model)}-{index}"


def unit_name(stem: str) -> str:
    """The ``.service`` name systemd accepts for ``stem``.

    Characters systemd allows in names (``[A-Za-z0-9:_.-\\]``) are kept, every other byte
    is written ``\\xNN``. A name past UNIT_NAME_MAX (255) is cut and ends with 10 hex digits
    of the stem's sha256, so distinct long stems stay distinct. Raises ValueError on an
    empty stem.
    """
    if not stem:
        raise ValueError("unit name stem is empty")
    escaped = "".join(ch if ch in _UNIT_CHARS else _escape_bytes(ch) for ch in stem)
    suffix = ".service"
    if len(escaped) + len(suffix) > UNIT_NAME_MAX:
        digest = hashlib.sha256(stem.encode()).hexdigest()[:10]
        escaped = escaped[: UNIT_NAME_MAX - len(suffix) - 11] + "-" + digest
    return escaped + suffix


def unit_object_path(name: str) -> str:
    """The D-Bus object path of unit ``name`` (systemd's bus_label_escape).

    Every byte that is not an ASCII letter, or a digit after the first position, is written
    ``_xx`` (lower-case hex): ``vw-x.service`` -> ``.../unit/vw_2dx_2eservice``.
    """
    out = []
    for i, b in enumerate(name.encode()):
        c = chr(b)
        if (c.isascii() and c.isalpha()) or (i > 0 and c.isascii() and c.isdigit()):
            out.append(c)
        else:
            out.append(f"_{b:02x}")
    return f"{SYSTEMD_PATH}/unit/{''.join(out) or '_'}"


def labels_environment(labels: Mapping[str, str]) -> list[str]:
    """``KEY=value`` entries recording ``labels`` in a unit's environment.

    Keys must match ``[a-z][a-z0-9_]*`` (ValueError otherwise); ``owner`` becomes
    ``VIIWORK_OWNER``, and ``VIIWORK_LABELS`` lists the keys so they can be read back.
    """
    entries = []
    for key, value in labels.items():
        if not _LABEL_KEY.match(key):
            raise ValueError(f"label key {key!r} must match [a-z][a-z0-9_]*")
        if "\0" in value:
            raise ValueError(f"label {key!r} contains a NUL byte")
        entries.append(f"VIIWORK_{key.upper()}={value}")
    entries.append(f"{LABELS_VARIABLE}={','.join(labels)}")
    return entries


def labels_from_environment(environment: Iterable[str]) -> dict[str, str] | None:
    """The labels recorded by labels_environment, or None when the unit has none."""
    env = dict(e.split("=", 1) for e in environment if "=" in e)
    keys = env.get(LABELS_VARIABLE)
    if keys is None:
        return None
    labels = {}
    for key in filter(None, keys.split(",")):
        value = env.get(f"VIIWORK_{key.upper()}")
        if value is not None:
            labels[key] = value
    return labels


def exit_info(result: str, code: int, status: int, unit: str = "") -> ExitInfo:
    """systemd's ``Result`` + ``ExecMainCode``/``ExecMainStatus`` as an ExitInfo.

    ``code`` is the siginfo code (1 exited, 2 killed, 3 dumped, 0 never ran); ``status`` the
    exit status or the signal number accordingly.
    """
    returncode = status if code == _CLD_EXITED else None
    sig = status if code in (_CLD_KILLED, _CLD_DUMPED) else None
    detail = f"unit {unit}" if unit else ""
    if returncode in _SYSTEMD_EXIT_STATUS:
        detail += f"{': ' if detail else ''}systemd could not start it: {_SYSTEMD_EXIT_STATUS[returncode]}"
    return ExitInfo(result=result or "unknown", returncode=returncode, signal=sig, detail=detail)


# --- bus addresses -----------------------------------------------------------------------


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


# --- the runner ----------------------------------------------------------------------------


def gpu_device_groups(dev: Path = Path("/dev")) -> list[str]:
    """Groups that own GPU device nodes here (plus ``video``/``render`` where they exist).

    An engine running as the ``viiwork`` user needs them to open /dev/nvidia*, /dev/dri/*
    and /dev/kfd; root-owned groups are skipped (mode 0666 nodes need none).
    """
    names: set[str] = set()
    for pattern in _GPU_DEVICE_GLOBS:
        for node in dev.glob(pattern):
            with contextlib.suppress(OSError, KeyError):
                st = node.stat()
                if stat.S_ISCHR(st.st_mode) and st.st_gid != 0:
                    names.add(grp.getgrgid(st.st_gid).gr_name)
    for name in _GPU_GROUP_NAMES:
        with contextlib.suppress(KeyError):
            grp.getgrnam(name)
            names.add(name)
    return sorted(names)


def _pure_cgroup_v2() -> bool:
    return Path("/sys/fs/cgroup/cgroup.controllers").exists()


def _user_exists(name: str) -> bool:
    try:
        pwd.getpwnam(name)
    except KeyError:
        return False
    return True


class SystemdHandle:
    """One engine unit (a ``RunHandle``). State arrives through the runner's signal handler.

    ``pid``: the unit's MainPID as systemd reports it (a PID in systemd's PID namespace),
    kept after the exit; ``unit``: the unit name; ``labels``: from the unit's environment.
    """

    def __init__(self, runner: SystemdRunner, unit: str, labels: Mapping[str, str]) -> None:
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
        conn = self._runner._conn
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
                engine_user = ENGINE_USER if system and _user_exists(ENGINE_USER) else None
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

    def unit_properties(self, request: LaunchRequest, argv0: str) -> list[tuple[str, Variant]]:
        """The ``a(sv)`` properties of the transient unit for ``request`` (pure)."""
        name = unit_name(request.name)
        cache_dir = f"{self.cache_root}/{CACHE_DIRECTORY}"
        env = {k: v for k, v in request.env.items() if k not in _UNIT_OWN_VARIABLES}
        env["HOME"] = cache_dir
        env["XDG_CACHE_HOME"] = cache_dir
        environment = [f"{k}={v}" for k, v in env.items()] + labels_environment(request.labels)
        description = request.description or f"viiwork engine {name}"
        props: list[tuple[str, str, Any]] = [
            ("Description", "s", description),
            ("Slice", "s", self.slice_name),
            ("Type", "s", "exec"),
            ("ExecStart", "a(sasb)", [[argv0, list(request.argv), False]]),
            ("Environment", "as", environment),
            # NAME=value lines read by the manager at start (the key of an engine that reads
            # it from the environment): not in Environment=, which `systemctl show` prints.
            *([("EnvironmentFiles", "a(sb)", [[request.environment_file, False]])]
              if request.environment_file else []),
            ("KillMode", "s", "control-group"),
            ("TimeoutStopUSec", "t", max(1, int(request.stop_timeout_s * 1_000_000))),
            ("SyslogIdentifier", "s", name.removesuffix(".service")),
            ("CollectMode", "s", "inactive-or-failed"),
            ("CacheDirectory", "as", [CACHE_DIRECTORY]),
            ("WorkingDirectory", "s", "/"),
            # The agent reads engines' health itself; a failed unit must not pull anything.
            ("Restart", "s", "no"),
        ]
        if self.engine_user:
            props.append(("User", "s", self.engine_user))
            if self.supplementary_groups:
                props.append(("SupplementaryGroups", "as", self.supplementary_groups))
        if self.output == "file" and request.log_path:
            props.append(("StandardOutputFileToAppend", "s", request.log_path))
            props.append(("StandardErrorFileToAppend", "s", request.log_path))
        if request.memory_max_bytes is not None:
            props.append(("MemoryMax", "t", int(request.memory_max_bytes)))
        if request.cpu_weight is not None:
            props.append(("CPUWeight", "t", int(request.cpu_weight)))
        if request.tasks_max is not None:
            props.append(("TasksMax", "t", int(request.tasks_max)))
        sandbox = request.sandbox or "none"
        if sandbox not in SANDBOX_PROFILES:
            raise RunnerError(f"unknown sandbox profile {sandbox!r}; known: {', '.join(SANDBOX_PROFILES)}")
        props.extend(SANDBOX_PROFILES[sandbox])
        if sandbox != "none" and request.private_dir:
            # ProtectSystem makes /run and /var read-only: the engine binds its socket here.
            props.append(("ReadWritePaths", "as", [request.private_dir]))
        return [(key, Variant(sig, value)) for key, sig, value in props]

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
        argv0 = _resolve_binary(request.argv[0], request.env)
        name = unit_name(request.name)
        props = self.unit_properties(request, argv0)
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

    async def adoptable(self, owner: str) -> list[SystemdHandle]:
        """Running engine units labelled ``owner=<owner>``, as handles watched from now on.

        Lists ``viiwork-engine-*.service`` units that are active, activating or reloading
        (``ListUnitsByPatterns``) and reads each one's Environment for its labels. Units
        that are being stopped are left alone. Raises RunnerError when systemd cannot list.
        """
        try:
            units = (await call(self._conn, SYSTEMD_BUS_NAME, SYSTEMD_PATH, MANAGER_IFACE, "ListUnitsByPatterns",
                                "asas", [["active", "activating", "reloading"], [f"{UNIT_PREFIX}*.service"]]))[0]
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


def _resolve_binary(argv0: str, env: Mapping[str, str]) -> str:
    """Absolute path of the engine binary (systemd needs one); RunnerError naming the fix."""
    if "/" in argv0:
        path = Path(argv0).absolute()
        if not path.exists():
            raise RunnerError(f"binary not found: {argv0} (check the engine's `binary` option)")
        if path.is_dir() or not os.access(path, os.X_OK):
            raise RunnerError(f"binary not executable: {argv0} (check its permissions)")
        return str(path)
    found = shutil.which(argv0, path=env.get("PATH", os.defpath))
    if found is None:
        raise RunnerError(
            f"binary not found: {argv0} is not on PATH (install it, or set the engine's "
            "`binary` option to its full path)"
        )
    return str(Path(found).absolute())
