"""The agent's usage ledger: ``await ledger.record(row)`` returns once the row is committed.

The rule (issue 17, docs/usage.md): the serving node commits a finished request's row before
the request's end is reported, so a kill -9 of the agent loses no finished request. A
commit costs about 45 us on this project's test machine, but a WAL checkpoint fsyncs and
can take milliseconds, so no SQLite call runs on the event loop: one writer thread owns the
connection. ``record`` puts the row on the thread's queue and waits for its commit; the
thread takes every row that arrived while it was committing into the next transaction
(group commit), so rows per second grow with concurrency while each still waits for a commit.

When SQLite refuses (a full disk, EFBIG, a read-only or vanished file: any ``sqlite3.Error``
or OSError), the rows go to an in-memory backlog of at most :data:`BACKLOG_MAX` rows, and
``record`` returns :attr:`Recorded.BACKLOGGED` at once: serving goes on. Beyond the bound
the oldest rows are dropped and counted. The thread reopens the file and retries the
backlog every ``retry_interval_s``, oldest first. ``stats()`` is read by ``/v1/status`` and
``doctor``.

Retention: rows older than ``retention_days`` are deleted by the same thread, at most
:data:`PRUNE_BATCH` rows per transaction, and only when no row waits, so a large deletion
never holds a request's commit for long.
"""

from __future__ import annotations

import asyncio
import enum
import logging
import queue
import sqlite3
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from viiwork.agent.usage.store import SchemaNewer, UsageRow, check_row, delete_before, insert_rows, open_for_writing

log = logging.getLogger(__name__)

# Rows held in memory while the file refuses writes: ~100,000 rows x ~0.5 KiB is ~50 MiB at
# most, hours of a busy node's traffic; a disk full for longer loses the oldest, counted.
BACKLOG_MAX = 100_000
RETRY_INTERVAL_S = 5.0
PRUNE_BATCH = 1000
PRUNE_INTERVAL_S = 600.0
DAY_MS = 86_400_000


class Recorded(enum.Enum):
    """What ``record`` did with a row: committed to the file, or held in the backlog."""

    COMMITTED = "committed"
    BACKLOGGED = "backlogged"


class LedgerClosed(Exception):
    """``record`` was called before ``start()`` or after ``close()``."""


@dataclass(frozen=True)
class LedgerStats:
    """The ledger for ``/v1/status`` and doctor. ``rows_written``: committed since start;
    ``backlog``: rows held in memory, waiting for the file; ``dropped``: backlog rows lost to
    the bound since start; ``pruned``: rows deleted by retention since start; ``last_error``:
    the last failure's text ("" when none since the last success), with ``last_error_at``
    its wall-clock time (Unix s, None when none)."""

    path: str
    rows_written: int
    backlog: int
    backlog_max: int
    dropped: int
    pruned: int
    last_error: str
    last_error_at: float | None

    def as_dict(self) -> dict[str, object]:
        return {"path": self.path, "rows_written": self.rows_written, "backlog": self.backlog,
                "backlog_max": self.backlog_max, "dropped": self.dropped, "pruned": self.pruned,
                "last_error": self.last_error, "last_error_at": self.last_error_at}


@dataclass
class _Pending:
    row: UsageRow
    loop: asyncio.AbstractEventLoop
    future: asyncio.Future[Recorded]


@dataclass
class _Prune:
    loop: asyncio.AbstractEventLoop
    future: asyncio.Future[int]


_STOP = object()


def _resolve(loop: asyncio.AbstractEventLoop, futures: list[asyncio.Future[Any]], value: object) -> None:
    """Set ``futures`` (all of ``loop``) to ``value`` with one wake-up of ``loop`` (each
    ``call_soon_threadsafe`` writes its self-pipe); a waiter that was cancelled is skipped: its
    row is kept regardless."""
    def set_them() -> None:
        for future in futures:
            if not future.done():
                future.set_result(value)
    try:
        loop.call_soon_threadsafe(set_them)
    except RuntimeError:
        pass  # the loop is closed: nobody waits any more


def _resolve_rows(pending: list[_Pending], value: object) -> None:
    """Answer every row of one group commit: one wake-up per event loop, not one per row."""
    by_loop: dict[asyncio.AbstractEventLoop, list[asyncio.Future[Any]]] = {}
    for p in pending:
        by_loop.setdefault(p.loop, []).append(p.future)
    for loop, futures in by_loop.items():
        _resolve(loop, futures, value)


class Ledger:
    """The usage file at ``path``, written by one thread (module docstring).

    ``retention_days``: rows older are deleted (1..3650). ``clock``: wall clock in Unix
    seconds (tests inject one). ``backlog_max``/``retry_interval_s``: the backlog's bound and
    how often a refused file is retried.
    """

    def __init__(self, path: Path, *, retention_days: int = 90, clock: Callable[[], float] = time.time,
                 backlog_max: int = BACKLOG_MAX, retry_interval_s: float = RETRY_INTERVAL_S,
                 prune_interval_s: float = PRUNE_INTERVAL_S) -> None:
        if not 1 <= retention_days <= 3650:
            raise ValueError(f"retention_days must be 1..3650, got {retention_days}")
        self.path = Path(path)
        self.retention_days = retention_days
        self._clock = clock
        self._backlog_max = backlog_max
        self._retry_interval_s = retry_interval_s
        self._prune_interval_s = prune_interval_s
        self._queue: queue.SimpleQueue[object] = queue.SimpleQueue()
        self._backlog: deque[UsageRow] = deque()
        self._lock = threading.Lock()  # guards the counters and the backlog's length for stats()
        self._written = 0
        self._dropped = 0
        self._pruned = 0
        self._last_error = ""
        self._last_error_at: float | None = None
        self._conn: sqlite3.Connection | None = None
        self._thread: threading.Thread | None = None
        self._closed = False
        self._next_prune = 0.0  # monotonic; 0: at the first idle moment

    # -- the loop's side ---------------------------------------------------------------

    def start(self) -> None:
        """Start the writer thread (it opens the file; a failure to open is a backlog, not an
        exception, except a file of a newer schema: SchemaNewer, raised here)."""
        if self._thread is not None:
            return
        try:
            self._conn = open_for_writing(self.path)
        except SchemaNewer:
            raise
        except (sqlite3.Error, OSError) as exc:
            self._note_error(exc)
        self._thread = threading.Thread(target=self._run, name="usage-ledger", daemon=True)
        self._thread.start()

    async def record(self, row: UsageRow) -> Recorded:
        """Commit ``row``; returns COMMITTED once it is in the file, or BACKLOGGED when the file
        refused it (it is retried later). Raises LedgerClosed when not started or closed, and
        TypeError for a row whose fields are not of their types (it would fail every commit).
        Cancelling the caller does not withdraw the row."""
        if self._thread is None or self._closed:
            raise LedgerClosed("the usage ledger is not running (start() it first; close() ends it)")
        check_row(row)
        loop = asyncio.get_running_loop()
        future: asyncio.Future[Recorded] = loop.create_future()
        self._queue.put(_Pending(row, loop, future))
        return await future

    async def prune(self) -> int:
        """Run retention now, to its end; returns the rows deleted (0 while the file refuses)."""
        if self._thread is None or self._closed:
            raise LedgerClosed("the usage ledger is not running")
        loop = asyncio.get_running_loop()
        future: asyncio.Future[int] = loop.create_future()
        self._queue.put(_Prune(loop, future))
        return await future

    async def close(self) -> None:
        """Commit what waits (one last try of the backlog), stop the thread, close the file."""
        if self._thread is None or self._closed:
            return
        self._closed = True
        self._queue.put(_STOP)
        await asyncio.to_thread(self._thread.join)

    def stats(self) -> LedgerStats:
        with self._lock:
            return LedgerStats(path=str(self.path), rows_written=self._written, backlog=len(self._backlog),
                               backlog_max=self._backlog_max, dropped=self._dropped, pruned=self._pruned,
                               last_error=self._last_error, last_error_at=self._last_error_at)

    # -- the writer thread -------------------------------------------------------------

    def _note_error(self, exc: BaseException) -> None:
        text = f"{type(exc).__name__}: {exc}"
        with self._lock:
            first = not self._last_error
            self._last_error, self._last_error_at = text, self._clock()
        # Once per outage at WARNING (a full disk fails every commit), then DEBUG.
        log.log(logging.WARNING if first else logging.DEBUG, "usage ledger %s: %s; rows are held in memory "
                "(at most %d) and retried every %g s", self.path, text, self._backlog_max, self._retry_interval_s)
        if self._conn is not None:
            try:
                self._conn.close()
            except sqlite3.Error:
                pass
            self._conn = None

    def _hold(self, rows: list[UsageRow]) -> None:
        with self._lock:
            for row in rows:
                if len(self._backlog) >= self._backlog_max:
                    self._backlog.popleft()
                    self._dropped += 1
                self._backlog.append(row)

    def _commit(self, rows: list[UsageRow]) -> bool:
        """Write the backlog (oldest first) and ``rows`` in one transaction; False when refused."""
        with self._lock:
            held = list(self._backlog)
        try:
            if self._conn is None:
                self._conn = open_for_writing(self.path)
            insert_rows(self._conn, held + rows)
        except (sqlite3.Error, OSError, SchemaNewer) as exc:
            self._note_error(exc)
            return False
        with self._lock:
            for _ in held:  # rows added meanwhile (none: only this thread adds) stay
                self._backlog.popleft()
            self._written += len(held) + len(rows)
            was_failing = bool(self._last_error)
            self._last_error = ""
        if was_failing:
            log.warning("usage ledger %s: writing again (%d held rows written)", self.path, len(held))
        return True

    def _prune_all(self) -> bool:
        """Delete rows past retention, a batch per transaction, until none is left (True) or
        rows wait to be written (False: the rest later)."""
        cutoff = int(self._clock() * 1000) - self.retention_days * DAY_MS
        while True:
            try:
                if self._conn is None:
                    self._conn = open_for_writing(self.path)
                n = delete_before(self._conn, cutoff, PRUNE_BATCH)
            except (sqlite3.Error, OSError, SchemaNewer) as exc:
                self._note_error(exc)
                return True  # retried at the next interval
            with self._lock:
                self._pruned += n
            if n < PRUNE_BATCH:
                return True
            if not self._queue.empty():  # rows wait: they go first
                return False

    def _run(self) -> None:
        retry_at = 0.0  # monotonic: the next try of a refusing file
        stopping = False
        while not stopping:
            now = time.monotonic()
            with self._lock:
                failing = bool(self._backlog)
            wait = max(0.0, retry_at - now) if failing else max(0.0, self._next_prune - now)
            try:
                items = [self._queue.get(timeout=max(wait, 0.001))]
            except queue.Empty:
                items = []
            while True:  # group commit: everything that arrived meanwhile
                try:
                    items.append(self._queue.get_nowait())
                except queue.Empty:
                    break
            pending = [i for i in items if isinstance(i, _Pending)]
            stopping = any(i is _STOP for i in items)
            rows = [p.row for p in pending]
            try:
                retry_at = self._step(items, pending, rows, failing, retry_at, stopping)
            except Exception as exc:  # a bug here must not leave record() waiting for ever
                log.exception("usage ledger %s: the writer failed; %d row(s) held in memory", self.path, len(rows))
                self._note_error(exc)
                self._hold(rows)
                retry_at = time.monotonic() + self._retry_interval_s
                _resolve_rows(pending, Recorded.BACKLOGGED)
                for item in items:
                    if isinstance(item, _Prune):
                        _resolve(item.loop, [item.future], 0)
        if self._conn is not None:
            self._conn.close()
            self._conn = None
        with self._lock:
            lost = len(self._backlog)
        if lost:
            log.error("usage ledger %s: %d row(s) could not be written before the agent stopped and are lost",
                      self.path, lost)

    def _step(self, items: list[object], pending: list[_Pending], rows: list[UsageRow], failing: bool,
              retry_at: float, stopping: bool) -> float:
        """One round of the writer: commit (or hold) ``rows``, answer prunes, prune when idle;
        returns the next retry time of a refusing file."""
        outcome = Recorded.COMMITTED
        if failing and time.monotonic() < retry_at and not stopping:
            outcome = Recorded.BACKLOGGED  # the file refused lately: no try per request
        elif rows or failing:
            if not self._commit(rows):
                outcome = Recorded.BACKLOGGED
                retry_at = time.monotonic() + self._retry_interval_s
        if outcome is Recorded.BACKLOGGED:
            self._hold(rows)
        _resolve_rows(pending, outcome)
        for item in items:
            if isinstance(item, _Prune):
                with self._lock:
                    before = self._pruned
                while not self._prune_all():
                    pass
                with self._lock:
                    _resolve(item.loop, [item.future], self._pruned - before)
        if not rows and not failing and time.monotonic() >= self._next_prune:
            done = self._prune_all()
            self._next_prune = time.monotonic() + (self._prune_interval_s if done else 0.0)
        return retry_at


__all__ = ["BACKLOG_MAX", "Ledger", "LedgerClosed", "LedgerStats", "Recorded", "UsageRow"]
