"""Writes into the state dir: one clear line for a fault, and retries for what a running node
could not persist.

At start a state dir the agent cannot write (full, read-only, a file in the way, owned by
someone else) stops the agent with :class:`StateDirFault`, whose message names the path,
the errno and the fix (:func:`state_dir_fault`). Once running, a failed write never stops
the node: :class:`PendingWrites` keeps the latest content of each kind of file (the boot
generation, open-mode name pins), retries every ``retry_s`` and reports what is pending
(``/v1/status`` ``state_dir.pending_writes``, ``viiworkctl doctor``): docs/reliability.md,
"The state dir".
"""

from __future__ import annotations

import errno
import logging
import os
import pwd
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

#: Seconds between retries of a write that failed while running.
RETRY_S = 5.0


class StateDirFault(Exception):
    """The state dir (or a file in it) cannot be used; the message is one line with the fix."""

    def __init__(self, message: str, path: Path, errno_name: str | None = None) -> None:
        super().__init__(message)
        self.path = path
        self.errno_name = errno_name


def _user() -> str:
    uid = os.geteuid()
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return str(uid)


def fix_for(code: int | None, path: Path) -> str:
    """The remedy for an errno met while writing under ``path`` (one clause)."""
    if code in (errno.ENOSPC, errno.EDQUOT):
        return f"free space on the file system holding {path} (df -h {path.parent}) or move node.state_dir"
    if code == errno.EROFS:
        return f"the file system holding {path} is read-only: remount it read-write or set node.state_dir elsewhere"
    if code in (errno.EACCES, errno.EPERM):
        return f"let the agent's user ({_user()}) write it: chown {_user()} {path} && chmod 700 {path}"
    if code in (errno.ENOTDIR, errno.EEXIST):
        return "a file is in the way: move it, or set node.state_dir to a directory"
    if code == errno.EIO:
        return "the disk reports an I/O error: check it (dmesg)"
    return f"check {path} and the file system that holds it"


def state_dir_fault(state_dir: Path, exc: OSError, doing: str) -> StateDirFault:
    """A :class:`StateDirFault` for ``exc`` met while ``doing`` (e.g. "write boot.json")."""
    name = errno.errorcode.get(exc.errno or 0)
    where = Path(exc.filename) if exc.filename else Path(state_dir)
    reason = exc.strerror or str(exc)
    message = (f"state dir {state_dir} (node.state_dir): cannot {doing}: {reason} "
               f"({name or 'no errno'}, {where}); fix: {fix_for(exc.errno, Path(state_dir))}")
    return StateDirFault(message, Path(state_dir), name)


#: errnos of a disk that filled up, turned read-only or failed: retried, never an engine's fault.
DISK_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EIO})


def _caller_retries() -> None:
    """The ``write`` of a pending write that its caller retries itself."""


@dataclass
class PendingWrite:
    """A write that failed: ``what`` it holds, its ``path``, the last error, and when."""

    what: str
    path: Path
    write: Callable[[], None]
    error: str
    errno_name: str | None
    first_failed: float  # wall clock (s since the epoch)
    attempts: int
    next_try: float  # monotonic s


class PendingWrites:
    """Writes into the state dir that failed while running, retried until they succeed.

    ``attempt(what, path, write)`` runs ``write`` (a blocking file write); an ``OSError`` is
    logged (WARNING once per ``what``, then DEBUG) and the write kept, replacing any older
    one of the same ``what`` (only the latest content matters). ``retry_due()`` re-runs the
    writes whose ``retry_s`` passed. Thread-safe: writes may run in ``asyncio.to_thread``.
    """

    def __init__(self, retry_s: float = RETRY_S, clock: Callable[[], float] = time.monotonic) -> None:
        self.retry_s = retry_s
        self.clock = clock
        self._pending: dict[str, PendingWrite] = {}
        self._lock = threading.Lock()

    def attempt(self, what: str, path: Path, write: Callable[[], None]) -> bool:
        """Run ``write``; True when it succeeded (and nothing of ``what`` is pending now)."""
        try:
            write()
        except OSError as exc:
            self.failed(what, path, exc, write)
            return False
        self.succeeded(what, path)
        return True

    def failed(self, what: str, path: Path, exc: OSError, write: Callable[[], None] | None = None,
               kept: str = "kept in memory") -> None:
        """Record that the write of ``what`` to ``path`` failed with ``exc``. Without ``write``
        the caller retries it itself (``retry_due`` skips it) and reports the outcome here and
        to :meth:`succeeded` (an engine's key file: agent/supervision/backend_task.py)."""
        name = errno.errorcode.get(exc.errno or 0)
        with self._lock:
            old = self._pending.get(what)
            self._pending[what] = PendingWrite(
                what, Path(path), write or _caller_retries, exc.strerror or str(exc), name,
                old.first_failed if old else time.time(), (old.attempts if old else 0) + 1,
                self.clock() + self.retry_s if write else float("inf"))
        (log.debug if old else log.warning)(
            "could not persist the %s to %s: %s (%s); %s, retried every %g s (fix: %s)",
            what, path, exc.strerror or exc, name, kept, self.retry_s, fix_for(exc.errno, Path(path).parent))

    def succeeded(self, what: str, path: Path) -> None:
        """The write of ``what`` worked: nothing of it is pending any more."""
        with self._lock:
            old = self._pending.pop(what, None)
        if old is not None:
            log.info("persisted the %s to %s after %d failed attempt(s)", what, path, old.attempts)

    def discard(self, what: str) -> None:
        """Forget a pending write whose file is no longer wanted (a backend removed by a reload)."""
        with self._lock:
            self._pending.pop(what, None)

    def pending(self, what: str) -> bool:
        with self._lock:
            return what in self._pending

    def due(self) -> bool:
        """True when some pending write is due for a retry."""
        now = self.clock()
        with self._lock:
            return any(p.next_try <= now for p in self._pending.values())

    def retry_due(self) -> None:
        """Retry every pending write whose time came (blocking: run in a thread)."""
        now = self.clock()
        with self._lock:
            due = [p for p in self._pending.values() if p.next_try <= now]
        for p in due:
            self.attempt(p.what, p.path, p.write)

    def status(self) -> list[dict[str, Any]]:
        """``[{"what", "path", "error", "errno", "since", "attempts"}]``: ``since`` is the
        first failure (s since the epoch), ``errno`` its name (``ENOSPC``) or null."""
        with self._lock:
            items = list(self._pending.values())
        return [{"what": p.what, "path": str(p.path), "error": p.error, "errno": p.errno_name,
                 "since": round(p.first_failed, 3), "attempts": p.attempts} for p in items]


__all__ = ["DISK_ERRNOS", "RETRY_S", "PendingWrites", "StateDirFault", "fix_for", "state_dir_fault"]
