"""The agent's hold on ``node.state_dir``: one agent per state dir, and a usable dir at start.

``take_state_dir`` runs first in the agent, before any socket, runner or engine:

1. the dir is created (mode 0700) when missing;
2. the dir is checked before anything is opened in it: a real directory (not a symlink),
   owned by the agent's user and not writable by group or others, so that no other user
   can have put a symlink or a file of theirs in it (``agent.lock`` pointing at a root-only
   file would otherwise be truncated by a root agent);
3. an exclusive ``flock(2)`` on ``<state_dir>/agent.lock`` is taken and held for the life of
   the process. The file is opened with ``O_NOFOLLOW`` and must be a regular file of the
   agent's user with one link; only once the lock is held is it truncated and the holder's
   pid written in it. A second agent on the same dir gets :class:`StateDirLocked` naming
   that pid and exits before it touches anything (it would otherwise adopt, and on its way
   out stop, the first agent's engine units). The kernel drops the lock when the process
   ends, however it ends, so a restarted agent (by systemd, after a crash) finds it free;
   the fd is close-on-exec, so no engine inherits it;
4. the dir is checked writable (a small file is written, fsynced and removed), so a full,
   read-only or foreign dir is one :class:`~viiwork.mesh.persist.StateDirFault` line now
   rather than a traceback later.

docs/reliability.md, "The state dir"; docs/security.md, "Local users".
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import pwd
import stat
from pathlib import Path

from viiwork.mesh.persist import StateDirFault, state_dir_fault

LOCK_FILE = "agent.lock"
PROBE_FILE = ".write-probe"


class StateDirLocked(Exception):
    """Another live process holds the state dir's lock; ``holder_pid`` is None when unknown."""

    def __init__(self, state_dir: Path, holder_pid: int | None) -> None:
        who = f"pid {holder_pid}" if holder_pid is not None else "a process whose pid is not recorded yet"
        super().__init__(
            f"state dir {state_dir} (node.state_dir) is in use by another agent ({who}); one agent per state dir: "
            f"stop that agent first, or give this one its own node.state_dir")
        self.state_dir = state_dir
        self.holder_pid = holder_pid


class StateDirLock:
    """The held lock (an open fd); ``release()`` (or the process's end) frees it."""

    def __init__(self, state_dir: Path, fd: int) -> None:
        self.state_dir = state_dir
        self.path = state_dir / LOCK_FILE
        self._fd: int | None = fd

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # closing the only fd drops the flock
            self._fd = None

    def __enter__(self) -> StateDirLock:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


def _holder(fd: int) -> int | None:
    try:
        text = os.pread(fd, 32, 0).decode("ascii", "replace").strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None


def _owner_name(uid: int) -> str:
    try:
        return f"{uid} ({pwd.getpwuid(uid).pw_name})"
    except KeyError:
        return str(uid)


def lock_state_dir(state_dir: Path) -> StateDirLock:
    """Create ``state_dir`` if missing, check who may write it and take its lock (module
    docstring, steps 1-3).

    Raises StateDirLocked when another process holds it, StateDirFault when the dir or the
    lock file cannot be created, is not safe to use, or cannot be written.
    """
    state_dir = Path(state_dir)
    try:
        if not state_dir.is_dir():
            state_dir.mkdir(parents=True, mode=0o700)
            os.chmod(state_dir, 0o700, follow_symlinks=False)  # mkdir's mode is filtered by the umask
    except OSError as exc:
        raise state_dir_fault(state_dir, exc, "create the directory") from None
    check_state_dir_owner(state_dir)
    path = state_dir / LOCK_FILE
    try:
        # No O_TRUNC: the file is emptied only once the lock is ours (a holder's pid stays readable).
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NOCTTY | os.O_CLOEXEC | os.O_NONBLOCK,
                     0o600)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise StateDirFault(
                f"state dir {state_dir} (node.state_dir): {path} is a symlink, not the agent's lock file; "
                f"fix: remove it (rm {path})", state_dir, "ELOOP") from None
        raise state_dir_fault(state_dir, exc, f"open {LOCK_FILE}") from None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode) or info.st_uid != os.geteuid() or info.st_nlink != 1:
            what = ("not a regular file" if not stat.S_ISREG(info.st_mode) else
                    f"owned by uid {_owner_name(info.st_uid)}" if info.st_uid != os.geteuid() else
                    f"a file with {info.st_nlink} links")
            raise StateDirFault(
                f"state dir {state_dir} (node.state_dir): {path} is {what}, not the agent's lock file; "
                f"fix: remove it (rm {path})", state_dir, None)
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = _holder(fd)
        os.close(fd)
        raise StateDirLocked(state_dir, holder) from None
    except StateDirFault:
        os.close(fd)
        raise
    except OSError as exc:
        os.close(fd)
        raise state_dir_fault(state_dir, exc, f"lock {LOCK_FILE}") from None
    try:
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    except OSError as exc:
        os.close(fd)
        raise state_dir_fault(state_dir, exc, f"write {LOCK_FILE}") from None
    return StateDirLock(state_dir, fd)


def check_state_dir_owner(state_dir: Path) -> None:
    """Step 2 of the module docstring (``lstat``: a symlink is refused, not followed);
    raises StateDirFault naming the fix."""
    state_dir = Path(state_dir)
    try:
        st = state_dir.lstat()
    except OSError as exc:
        raise state_dir_fault(state_dir, exc, "read it") from None
    if stat.S_ISLNK(st.st_mode):
        raise StateDirFault(
            f"state dir {state_dir} (node.state_dir) is a symlink: whoever can change it could point the agent "
            f"at their own files; fix: set node.state_dir to the real directory ({os.path.realpath(state_dir)})",
            state_dir, None)
    if not stat.S_ISDIR(st.st_mode):
        raise state_dir_fault(state_dir, OSError(errno.ENOTDIR, os.strerror(errno.ENOTDIR), str(state_dir)),
                              "use it")
    me = os.geteuid()
    if st.st_uid != me:
        raise StateDirFault(
            f"state dir {state_dir} (node.state_dir) is owned by uid {_owner_name(st.st_uid)}, not by the agent's "
            f"user {_owner_name(me)}: its owner could replace the node key; fix: chown {me} {state_dir}",
            state_dir, None)
    if st.st_mode & 0o022:
        raise StateDirFault(
            f"state dir {state_dir} (node.state_dir) is writable by group or others (mode "
            f"{stat.S_IMODE(st.st_mode):04o}): they could replace the node key; fix: chmod 700 {state_dir}",
            state_dir, None)


def check_state_dir(state_dir: Path) -> None:
    """Steps 2 and 4 of the module docstring; raises StateDirFault naming the fix."""
    state_dir = Path(state_dir)
    check_state_dir_owner(state_dir)
    probe = state_dir / PROBE_FILE
    try:
        fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        try:
            # One page: tmpfs and most file systems refuse it when full; a 0-byte probe would pass.
            os.write(fd, b"\0" * 4096)
            os.fsync(fd)
        finally:
            os.close(fd)
    except OSError as exc:
        with contextlib.suppress(OSError):
            probe.unlink()
        raise state_dir_fault(state_dir, exc, "write a file") from None
    probe.unlink(missing_ok=True)


def take_state_dir(state_dir: Path) -> StateDirLock:
    """Lock and check ``state_dir`` (module docstring). Raises StateDirLocked or StateDirFault."""
    lock = lock_state_dir(state_dir)
    try:
        check_state_dir(Path(state_dir))
    except BaseException:
        lock.release()
        raise
    return lock


__all__ = ["LOCK_FILE", "StateDirLock", "StateDirLocked", "check_state_dir", "check_state_dir_owner", "lock_state_dir",
           "take_state_dir"]
