"""A real systemd for tests, in two tiers (both systemd 252 or newer, never on the host's root).

- ``user_manager(dir)``: ``systemd --user`` in a private mount namespace (its own tmpfs on
  /run/systemd holds the ``/run/systemd/system`` marker it needs; the host's /run/systemd is
  never touched) and cgroups of its own. Its D-Bus session bus is ``dir/xdg/bus``. Up in
  ~0.1 s. Units, signals, Result/exit status and Type=notify work; limits are accepted but
  not enforced (no delegated controllers), there is no journald and no ``User=``.
- ``pid1_system(dir)``: systemd as PID 1 of new pid/mount/cgroup/uts/ipc(/net) namespaces
  on an overlay of the host's root (tmpfs upper layer), with dbus and journald, booted to a
  minimal target (scripts in ``systemd_pid1/``). Its system bus is ``dir/run/dbus/
  system_bus_socket``; v1 memory/pids/cpu controllers are handed over, so MemoryMax and
  TasksMax are enforced. Up in ~0.5 s, down in ~2 s. PIDs it reports are container PIDs; run
  its CLI with ``system.systemctl(...)`` (nsenter). ``share`` is a host directory bound at
  ``/srv/viiwork-test`` inside (``system.inside(path)``).

Both tear everything down in their finalizers: the manager, every process left in their
cgroups (all started by the test), the cgroups (depth-first). ``missing_user_manager()`` and
``missing_pid1()`` return why a tier cannot run here (or None) for ``require``;
``checkout_hidden_by_private_tmp()`` why units cannot see this checkout (or None): every
test of these tiers checks both.
"""

from __future__ import annotations

import itertools
import os
import shutil
import signal
import subprocess
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

SYSTEMD = Path("/usr/lib/systemd/systemd")
CGROUP = Path("/sys/fs/cgroup")
PID1_SCRIPTS = Path(__file__).resolve().parent / "systemd_pid1"
#: The checkout these tests run from (units and the PID-1 container must see it).
REPO = Path(__file__).resolve().parents[2]
#: Paths a unit with PrivateTmp=yes and the PID-1 container get a fresh copy of.
PRIVATE_TMP_PATHS = ("/tmp", "/var/tmp", "/dev/shm")
#: The container path of the PID 1 tier's shared directory.
SHARE_INSIDE = "/srv/viiwork-test"
#: v1 controllers handed to the PID 1 tier on hybrid hosts (MemoryMax, TasksMax).
PID1_V1_CONTROLLERS = ("memory", "pids")

_counter = itertools.count()


def _unique(prefix: str) -> str:
    return f"{prefix}-{os.getpid()}-{next(_counter)}"


def _cgroup_layout() -> str | None:
    """"hybrid" (v1 + unified mount), "unified" (pure v2), or None when neither is usable."""
    if (CGROUP / "cgroup.controllers").exists():
        return "unified"
    if (CGROUP / "unified" / "cgroup.procs").exists() and (CGROUP / "systemd" / "cgroup.procs").exists():
        return "hybrid"
    return None


def _common_missing() -> str | None:
    if os.geteuid() != 0:
        return "needs root (namespaces, mounts and cgroups)"
    for tool in ("unshare", "nsenter", "systemctl"):
        if shutil.which(tool) is None:
            return f"{tool} not installed (util-linux / systemd)"
    if not SYSTEMD.exists():
        return f"systemd not installed ({SYSTEMD} missing)"
    if _cgroup_layout() is None:
        return "no usable cgroup hierarchy under /sys/fs/cgroup"
    return None


def missing_user_manager() -> str | None:
    """Why ``user_manager`` cannot run here, or None."""
    reason = _common_missing()
    if reason:
        return reason
    if not Path("/usr/lib/systemd/user/dbus.socket").exists() and not Path("/etc/systemd/user/dbus.socket").exists():
        return "no user D-Bus (dbus.socket user unit; install dbus-user-session)"
    return None


def checkout_hidden_by_private_tmp(repo: Path = REPO) -> str | None:
    """Why units cannot see the checkout ``repo`` (it lives under a private-tmp path), or None."""
    for hidden in PRIVATE_TMP_PATHS:
        if repo == Path(hidden) or Path(hidden) in repo.parents:
            return (f"the checkout {repo} is under {hidden}, which units with PrivateTmp=yes and the PID-1 "
                    "container do not see; clone it elsewhere (.ci/run and `make test` under CI=true "
                    "copy the checkout out of it)")
    return None


def missing_pid1() -> str | None:
    """Why ``pid1_system`` cannot run here, or None."""
    reason = _common_missing()
    if reason:
        return reason
    if shutil.which("dbus-daemon") is None and shutil.which("dbus-broker") is None:
        return "no D-Bus daemon installed (dbus)"
    if "overlay" not in Path("/proc/filesystems").read_text():
        return "the kernel has no overlay filesystem (the PID 1 tier boots on an overlay of /)"
    return None


# --- cgroups ----------------------------------------------------------------------------


def _own_cgroup_dirs(name: str) -> list[Path]:
    """Every cgroup directory called ``name`` (ours: unique per fixture) in any hierarchy."""
    found = []
    for hierarchy in [CGROUP, *CGROUP.iterdir()] if CGROUP.exists() else []:
        if not hierarchy.is_dir():
            continue
        direct = hierarchy / name
        if direct.is_dir():
            found.append(direct)
            continue
        # v1 controllers: boot.sh nests NAME under the test's own cgroup in that hierarchy.
        with _suppress_os():
            for line in Path("/proc/self/cgroup").read_text().splitlines():
                _, controllers, path = line.split(":", 2)
                if hierarchy.name in controllers.split(","):
                    nested = hierarchy / path.lstrip("/") / name
                    if nested.is_dir():
                        found.append(nested)
    return found


@contextmanager
def _suppress_os() -> Iterator[None]:
    try:
        yield
    except OSError:
        pass


def _remove_cgroup_tree(top: Path, deadline_s: float = 10.0) -> None:
    """SIGKILL every process left in ``top`` and below, then rmdir depth-first.

    Only for cgroups a fixture created: whatever is in them was started by the test.
    Raises RuntimeError when the tree cannot be removed within ``deadline_s``.
    """
    deadline = time.monotonic() + deadline_s
    while top.exists():
        dirs = sorted((p for p in top.rglob("*") if p.is_dir()), key=lambda p: len(p.parts), reverse=True)
        for d in [*dirs, top]:
            with _suppress_os():
                for pid in (d / "cgroup.procs").read_text().split():
                    with _suppress_os():
                        os.kill(int(pid), signal.SIGKILL)
            with _suppress_os():
                d.rmdir()
        if not top.exists():
            return
        if time.monotonic() > deadline:
            raise RuntimeError(f"cannot remove cgroup {top}: processes left in it")
        time.sleep(0.05)


def _move_self_into(dirs: Sequence[Path]):
    """preexec_fn: put the child process into each cgroup of ``dirs``."""
    procs = [str(d / "cgroup.procs") for d in dirs]

    def preexec() -> None:
        for path in procs:
            with open(path, "w") as f:
                f.write(str(os.getpid()))

    return preexec


def _wait_path(path: Path, timeout_s: float, proc: subprocess.Popen, log: Path) -> None:
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        if proc.poll() is not None:
            raise RuntimeError(f"systemd exited ({proc.returncode}) before {path} appeared:\n{_tail(log)}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"{path} did not appear within {timeout_s} s:\n{_tail(log)}")
        time.sleep(0.02)


def _tail(path: Path, n: int = 4000) -> str:
    try:
        return path.read_text(errors="replace")[-n:]
    except OSError:
        return "(no log)"


def unit_show(manager: UserManager | Pid1System, unit: str, prop: str) -> str:
    """One property of ``unit`` as ``systemctl show -p PROP --value`` prints it ("" if unset)."""
    return manager.systemctl("show", "-p", prop, "--value", unit).stdout.strip()


def unit_main_pid(manager: UserManager | Pid1System, unit: str) -> int:
    """MainPID of ``unit`` in the manager's PID namespace (0 when not running)."""
    return int(unit_show(manager, unit, "MainPID") or 0)


def process_gone(pid: int) -> bool:
    """True when no process ``pid`` exists (zombies count as existing)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


# --- user manager -------------------------------------------------------------------------


@dataclass
class UserManager:
    """A running ``systemd --user``: its bus, runtime dir, PID (host PID) and cgroups."""

    root: Path
    runtime_dir: Path
    home: Path
    pid: int
    cgroups: list[Path] = field(default_factory=list)

    @property
    def bus_address(self) -> str:
        return f"unix:path={self.runtime_dir / 'bus'}"

    @property
    def cache_dir(self) -> Path:
        return self.home / ".cache"

    def env(self) -> dict[str, str]:
        """Environment for ``systemctl --user`` and friends talking to this manager."""
        return {"PATH": os.environ.get("PATH", os.defpath), "XDG_RUNTIME_DIR": str(self.runtime_dir),
                "DBUS_SESSION_BUS_ADDRESS": self.bus_address, "HOME": str(self.home), "LANG": "C.UTF-8"}

    def systemctl(self, *args: str, check: bool = True, timeout_s: float = 20.0) -> subprocess.CompletedProcess[str]:
        return subprocess.run(["systemctl", "--user", *args], env=self.env(), capture_output=True, text=True,
                              check=check, timeout=timeout_s)


def _cgroup_dirs_for(name: str) -> list[Path]:
    if _cgroup_layout() == "unified":
        return [CGROUP / name]
    return [CGROUP / "unified" / name, CGROUP / "systemd" / name]


def _wait_user_manager_running(manager: UserManager, timeout_s: float, proc: subprocess.Popen, log: Path) -> None:
    # `systemctl is-system-running` answers "offline" from the host (no /run/systemd/system
    # here), so ask the manager's SystemState over its bus.
    deadline = time.monotonic() + timeout_s
    state = ""
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"user manager exited ({proc.returncode}):\n{_tail(log)}")
        got = subprocess.run(["busctl", "--user", "get-property", "org.freedesktop.systemd1", "/org/freedesktop/systemd1",
                              "org.freedesktop.systemd1.Manager", "SystemState"],
                             env=manager.env(), capture_output=True, text=True, timeout=5, check=False)
        state = got.stdout.strip().removeprefix("s ").strip('"')
        if state in ("running", "degraded"):
            return
        time.sleep(0.02)
    raise TimeoutError(f"user manager not running within {timeout_s} s (state {state!r}):\n{_tail(log)}")


@contextmanager
def user_manager(directory: Path, timeout_s: float = 20.0) -> Iterator[UserManager]:
    """Run ``systemd --user`` for the duration of the block (see the module docstring).

    Raises RuntimeError/TimeoutError with the manager's log when it does not come up.
    """
    name = _unique("viiwork-test-um")
    runtime = directory / "xdg"
    home = directory / "home"
    for d in (runtime, home / ".cache", home / ".config", home / ".local" / "share"):
        d.mkdir(parents=True, exist_ok=True)
    runtime.chmod(0o700)
    log = directory / "user-manager.log"
    cgroups = _cgroup_dirs_for(name)
    for d in cgroups:
        d.mkdir(parents=True, exist_ok=True)
    # A clean environment: nothing of the test's (bus addresses, notify sockets) leaks in;
    # XDG_CONFIG_HOME keeps the invoking user's own user units out.
    env = {
        "PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
        "HOME": str(home), "LANG": "C.UTF-8",
        "XDG_RUNTIME_DIR": str(runtime), "XDG_CACHE_HOME": str(home / ".cache"),
        "XDG_CONFIG_HOME": str(home / ".config"), "XDG_DATA_HOME": str(home / ".local" / "share"),
    }
    # The private mount namespace gets its own /run/systemd (tmpfs) holding the
    # /run/systemd/system marker; the host's /run/systemd is never written.
    # Sandboxing options (ProtectKernelTunables=, InaccessiblePaths=...) mount the nodes in
    # /run/systemd/inaccessible over what they hide; PID 1 makes them at boot, so we do here.
    script = ("[ -d /run/systemd ] || mkdir /run/systemd; mount -n -t tmpfs tmpfs /run/systemd "
              "&& mkdir /run/systemd/system /run/systemd/inaccessible && cd /run/systemd/inaccessible "
              "&& mkdir -m 0 dir && touch reg && chmod 0 reg && mkfifo -m 0 fifo && mknod -m 0 chr c 0 0 "
              "&& mknod -m 0 blk b 0 0 && cd / "
              f"&& exec {SYSTEMD} --user")
    proc = None
    try:
        with open(log, "wb") as out:
            proc = subprocess.Popen(
                ["unshare", "--mount", "--propagation", "private", "sh", "-c", script],
                env=env, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                start_new_session=True, preexec_fn=_move_self_into(cgroups),
            )
        _wait_path(runtime / "bus", timeout_s, proc, log)
        manager = UserManager(root=directory, runtime_dir=runtime, home=home, pid=proc.pid, cgroups=cgroups)
        _wait_user_manager_running(manager, timeout_s, proc, log)
        yield manager
    finally:
        if proc is not None and proc.poll() is None:
            subprocess.run(["systemctl", "--user", "exit"], env={**env, "DBUS_SESSION_BUS_ADDRESS": ""},
                           capture_output=True, timeout=10, check=False)
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(5)
        for d in cgroups:
            _remove_cgroup_tree(d)


# --- PID 1 in namespaces ------------------------------------------------------------------


@dataclass
class Pid1System:
    """A booted systemd PID 1 in namespaces: host PID of its systemd, its /run on the host."""

    root: Path
    pid: int
    share: Path
    name: str

    #: Where ``share`` appears inside the container (outside /tmp and /var/tmp, which
    #: PrivateTmp= replaces, so sandboxed units see it too).
    share_inside = Path(SHARE_INSIDE)

    def inside(self, host_path: Path) -> Path:
        """The container's path of ``host_path`` (a path under ``share``)."""
        return self.share_inside / Path(host_path).relative_to(self.share)

    @property
    def run_dir(self) -> Path:
        return self.root / "run"

    @property
    def bus_address(self) -> str:
        return f"unix:path={self.run_dir / 'dbus' / 'system_bus_socket'}"

    def nsenter(self, *argv: str, check: bool = True, timeout_s: float = 30.0,
                input: str | None = None) -> subprocess.CompletedProcess[str]:
        """Run ``argv`` inside the container (all its namespaces, its root and cwd).

        ``check``: raise RuntimeError carrying the command's output when it fails.
        """
        done = subprocess.run(["nsenter", "-t", str(self.pid), "-m", "-p", "-u", "-i", "-n", "-C", "-r", "-w",
                               *argv], capture_output=True, text=True, timeout=timeout_s, input=input,
                              env={"PATH": "/usr/sbin:/usr/bin:/sbin:/bin", "LANG": "C.UTF-8"})
        if check and done.returncode != 0:
            raise RuntimeError(f"{' '.join(argv)} exited {done.returncode}:\n{done.stdout}{done.stderr}")
        return done

    def systemctl(self, *args: str, check: bool = True, timeout_s: float = 30.0) -> subprocess.CompletedProcess[str]:
        return self.nsenter("systemctl", "--no-pager", *args, check=check, timeout_s=timeout_s)

    def journal(self, unit: str) -> str:
        return self.nsenter("journalctl", "--no-pager", "-o", "cat", "-u", unit, check=False).stdout


def _systemd_child(pid: int) -> int | None:
    """The child of ``pid`` that is running systemd already, or None."""
    try:
        children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    except OSError:
        return None
    for child in children:
        try:
            if Path(f"/proc/{child}/comm").read_text().strip() == "systemd":
                return int(child)
        except OSError:
            continue
    return None


@contextmanager
def pid1_system(directory: Path, *, v1: Sequence[str] = PID1_V1_CONTROLLERS, host_network: bool = False,
                timeout_s: float = 30.0) -> Iterator[Pid1System]:
    """Boot systemd as PID 1 in namespaces for the duration of the block (module docstring).

    ``v1``: v1 controllers to hand over on hybrid hosts. ``host_network``: share the host's
    network namespace (default: a private one with only loopback). Raises RuntimeError or
    TimeoutError with the boot log when it does not come up.
    """
    name = _unique("viiwork-test-pid1")
    directory.mkdir(parents=True, exist_ok=True)
    share = directory / "share"
    share.mkdir(exist_ok=True)
    log = directory / "boot.log"
    env = {"PATH": "/usr/sbin:/usr/bin:/sbin:/bin", "B": str(directory), "NAME": name, "V1": " ".join(v1),
           "SHARE": str(share), "SHARE_INSIDE": SHARE_INSIDE, "NET": "host" if host_network else ""}
    proc = None
    systemd_pid: int | None = None
    try:
        with open(log, "wb") as out:
            proc = subprocess.Popen(["bash", str(PID1_SCRIPTS / "boot.sh")], env=env, stdin=subprocess.DEVNULL,
                                    stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + timeout_s
        # boot.sh execs unshare (proc.pid), whose one child becomes PID 1: inner.sh, then systemd.
        while systemd_pid is None:
            systemd_pid = _systemd_child(proc.pid)
            if proc.poll() is not None:
                raise RuntimeError(f"boot.sh exited ({proc.returncode}):\n{_tail(log)}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"no PID 1 within {timeout_s} s:\n{_tail(log)}")
            time.sleep(0.02)
        _wait_path(directory / "run" / "systemd" / "private", max(1.0, deadline - time.monotonic()), proc, log)
        system = Pid1System(root=directory, pid=systemd_pid, share=share, name=name)
        while True:
            answer = system.systemctl("is-system-running", "--wait", check=False,
                                      timeout_s=max(1.0, deadline - time.monotonic()))
            state = answer.stdout.strip()
            # No answer at all: systemctl could not reach PID 1 yet (it is still setting up).
            if state or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        if state not in ("running", "degraded"):
            failed = system.systemctl("list-units", "--failed", "--no-legend", check=False)
            raise RuntimeError(f"container systemd state {state!r} ({answer.stderr.strip()}); failed units:\n"
                               f"{failed.stdout}{failed.stderr}\n{_tail(log)}")
        # PID 1 joins the system bus once dbus.service is up, which can be after "running".
        while "true" not in system.nsenter(
                "busctl", "--system", "call", "org.freedesktop.DBus", "/org/freedesktop/DBus", "org.freedesktop.DBus",
                "NameHasOwner", "s", "org.freedesktop.systemd1", check=False).stdout:
            if time.monotonic() > deadline:
                raise TimeoutError(f"systemd did not join its system bus within {timeout_s} s:\n{_tail(log)}")
            time.sleep(0.02)
        yield system
    finally:
        if proc is not None:
            if systemd_pid is not None and proc.poll() is None:
                # SIGRTMIN+4 asks systemd for a poweroff: units stop, then PID 1 exits.
                try:
                    os.kill(systemd_pid, signal.SIGRTMIN + 4)
                except ProcessLookupError:
                    pass
            try:
                proc.wait(15)
            except subprocess.TimeoutExpired:
                proc.kill()  # unshare --kill-child: the whole pid namespace goes with it
                proc.wait(5)
        for d in _own_cgroup_dirs(name):
            _remove_cgroup_tree(d)
