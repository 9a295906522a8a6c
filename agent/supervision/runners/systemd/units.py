"""Engine units as systemd sees them: names, labels, exit statuses, and a transient unit's properties.

Pure functions (no bus): a unit name and its D-Bus object path from a backend's name, the
labels a unit's environment records (read back on adoption), systemd's ``Result`` and exit
status as an ExitInfo, and the ``a(sv)`` properties of ``StartTransientUnit`` with the
sandbox profiles (``models[].sandbox``), the engine user's checks and its GPU device groups.
The runner's use of them: runner.py's docstring.

A transient engine unit has ``Type=exec`` (the start job finishes once ``execve``
succeeded, so a missing binary fails the start instead of a later exit),
``KillMode=control-group`` (the engine's whole tree dies: vLLM leaves orphan workers that
hold GPU memory otherwise), ``TimeoutStopUSec`` (then SIGKILL: llama-server hangs on
SIGTERM with a request in flight), ``CollectMode=inactive-or-failed`` (no failed units
pile up), a ``CacheDirectory`` with ``HOME`` and ``XDG_CACHE_HOME`` pointing into it (for
engines that JIT or cache), and optional limits and a sandbox profile.
"""

from __future__ import annotations

import contextlib
import grp
import hashlib
import os
import pwd
import re
import shutil
import stat
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any, Literal

from dbus_fast import Variant

from viiwork.agent.supervision.runners.base import BINARY_OPTIONS, ExitInfo, LaunchRequest, RunnerError
from viiwork.agent.supervision.runners.systemd.bus import SYSTEMD_PATH

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

#: One unit property before it is wrapped in a Variant: (name, D-Bus signature, value).
UnitProperty = tuple[str, str, Any]

# Sandbox profiles (``models[].sandbox``). None blocks a GPU: no PrivateDevices, no
# DeviceAllow (ProtectClock would imply one), no MemoryDenyWriteExecute (engines JIT).
_BASIC: tuple[UnitProperty, ...] = (
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
_STRICT: tuple[UnitProperty, ...] = (
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
SANDBOX_PROFILES: dict[str, tuple[UnitProperty, ...]] = {
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


# --- the transient unit ------------------------------------------------------------------


def engine_unit_properties(request: LaunchRequest, argv0: str, *, cache_root: str, slice_name: str,
                           engine_user: str | None, supplementary_groups: list[str],
                           output: Literal["journal", "file"], nft: str | None = None) -> list[tuple[str, Variant]]:
    """The ``a(sv)`` properties of the transient unit for ``request`` (pure).

    ``argv0``: the engine binary's absolute path (resolve_binary); ``cache_root``: the
    manager's cache root (the unit's ``CacheDirectory`` lies under it); ``engine_user``
    None: the manager's own user. ``nft``: nft's absolute path, for a request with a
    ``firewall``: the unit creates its table in ``ExecStartPre=`` and deletes it in
    ``ExecStopPost=``, which runs however the unit stops (also when the start fails), both
    privileged (``+``: outside ``User=`` and the sandbox) and without ``$`` expansion
    (systemd.service(5), "Command lines"; the ``Ex`` properties carry those flags).
    Raises RunnerError on an unknown sandbox profile or a firewall without ``nft``, and
    ValueError on a bad label (labels_environment).
    """
    name = unit_name(request.name)
    cache_dir = f"{cache_root}/{CACHE_DIRECTORY}"
    env = {k: v for k, v in request.env.items() if k not in _UNIT_OWN_VARIABLES}
    env["HOME"] = cache_dir
    env["XDG_CACHE_HOME"] = cache_dir
    environment = [f"{k}={v}" for k, v in env.items()] + labels_environment(request.labels)
    description = request.description or f"viiwork engine {name}"
    props: list[UnitProperty] = [
        ("Description", "s", description),
        ("Slice", "s", slice_name),
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
    if request.firewall is not None:
        if nft is None:
            raise RunnerError(f"{request.name}: a unit with nftables rules needs nft's path")
        props.append(("ExecStartPreEx", "a(sasas)",
                      [[nft, list(request.firewall.apply_argv(nft)), ["privileged", "no-env-expand"]]]))
        # A table already gone (deleted by hand) is no failure of the unit.
        props.append(("ExecStopPostEx", "a(sasas)",
                      [[nft, list(request.firewall.delete_argv(nft)), ["privileged", "ignore-failure"]]]))
    if engine_user:
        props.append(("User", "s", engine_user))
        if supplementary_groups:
            props.append(("SupplementaryGroups", "as", supplementary_groups))
    if output == "file" and request.log_path:
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


def resolve_binary(argv0: str, env: Mapping[str, str]) -> str:
    """Absolute path of the engine binary (systemd needs one); RunnerError naming the fix."""
    if "/" in argv0:
        path = Path(argv0).absolute()
        if not path.exists():
            raise RunnerError(f"binary not found: {argv0} ({BINARY_OPTIONS})")
        if path.is_dir() or not os.access(path, os.X_OK):
            raise RunnerError(f"binary not executable: {argv0} (check its permissions)")
        return str(path)
    found = shutil.which(argv0, path=env.get("PATH", os.defpath))
    if found is None:
        raise RunnerError(
            f"binary not found: {argv0} is not on PATH (install it, or give its full path: {BINARY_OPTIONS})"
        )
    return str(Path(found).absolute())


# --- the engine user ---------------------------------------------------------------------


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


def user_exists(name: str) -> bool:
    """Whether the user ``name`` exists here (the passwd database)."""
    try:
        pwd.getpwnam(name)
    except KeyError:
        return False
    return True
