"""The usage file: its schema and the blocking SQL on it (stdlib ``sqlite3``).

Every function here blocks on the disk: the agent calls them from the ledger's writer
thread only (viiwork.agent.usage.ledger), ``viiworkctl usage`` from its main thread.

The file is SQLite in WAL mode with ``synchronous=NORMAL``: a committed transaction survives
the process's death (kill -9: the WAL is in the kernel's page cache), and the last ones may
be lost when the machine itself loses power before the next checkpoint (sqlite.org/wal.html,
"Performance Considerations"). The schema's version is ``PRAGMA user_version``
(:data:`SCHEMA_VERSION`); a file of a newer version is refused, not rewritten.
"""

from __future__ import annotations

import os
import sqlite3
from collections.abc import Iterable
from dataclasses import astuple, dataclass
from pathlib import Path
from urllib.parse import quote

SCHEMA_VERSION = 1
USAGE_FILE = "usage.sqlite3"
# sqlite3's own wait for another connection's lock (the CLI reading while the agent writes).
BUSY_TIMEOUT_MS = 5000

_SCHEMA = """
CREATE TABLE IF NOT EXISTS usage (
    id INTEGER PRIMARY KEY,
    finished_at_ms INTEGER NOT NULL,
    request_id TEXT NOT NULL,
    tenant TEXT NOT NULL,
    jti TEXT NOT NULL,
    model TEXT NOT NULL,
    origin_node TEXT NOT NULL,
    serving_node TEXT NOT NULL,
    prompt_tokens INTEGER,
    completion_tokens INTEGER,
    cached_tokens INTEGER,
    status INTEGER NOT NULL,
    queued_ms REAL NOT NULL,
    ttft_ms REAL,
    duration_ms REAL NOT NULL
);
CREATE INDEX IF NOT EXISTS usage_finished_at ON usage (finished_at_ms);
CREATE INDEX IF NOT EXISTS usage_tenant ON usage (tenant, finished_at_ms);
"""

COLUMNS = ("finished_at_ms", "request_id", "tenant", "jti", "model", "origin_node", "serving_node",
           "prompt_tokens", "completion_tokens", "cached_tokens", "status", "queued_ms", "ttft_ms", "duration_ms")
_INSERT = f"INSERT INTO usage ({', '.join(COLUMNS)}) VALUES ({', '.join('?' * len(COLUMNS))})"


@dataclass(frozen=True, slots=True)
class UsageRow:
    """One finished request, as the node that served it saw it.

    ``finished_at_ms``: wall clock (Unix ms) when the response ended. ``request_id``: the
    request's id (``X-Request-Id``). ``tenant``/``jti``: the API key's tenant and key id, ""
    when keys are off. ``origin_node``: the node id the request came through, "" for a local
    client; ``serving_node``: this node's id. Token counts: the engine's usage, None when the
    engine did not say (never 0 for unknown). ``status``: the HTTP status the client got.
    ``queued_ms``: time waiting for a slot; ``ttft_ms``: to the first token, None when no
    token came; ``duration_ms``: from the request's arrival to its end.
    """

    finished_at_ms: int
    request_id: str
    tenant: str
    jti: str
    model: str
    origin_node: str
    serving_node: str
    prompt_tokens: int | None
    completion_tokens: int | None
    cached_tokens: int | None
    status: int
    queued_ms: float
    ttft_ms: float | None
    duration_ms: float


_FIELD_TYPES: tuple[tuple[str, tuple[type, ...], bool], ...] = (
    ("finished_at_ms", (int,), False), ("request_id", (str,), False), ("tenant", (str,), False),
    ("jti", (str,), False), ("model", (str,), False), ("origin_node", (str,), False),
    ("serving_node", (str,), False), ("prompt_tokens", (int,), True), ("completion_tokens", (int,), True),
    ("cached_tokens", (int,), True), ("status", (int,), False), ("queued_ms", (int, float), False),
    ("ttft_ms", (int, float), True), ("duration_ms", (int, float), False))


def check_row(row: UsageRow) -> None:
    """Raise TypeError naming the first field of ``row`` that is not of its type (bool is no
    int here); a row SQLite cannot bind would otherwise fail the transaction of every row."""
    for name, types, optional in _FIELD_TYPES:
        value = getattr(row, name)
        if value is None and optional:
            continue
        if isinstance(value, bool) or not isinstance(value, types):
            raise TypeError(f"UsageRow.{name} must be {' or '.join(t.__name__ for t in types)}"
                            f"{' or None' if optional else ''}, got {type(value).__name__}")


class SchemaNewer(Exception):
    """The file was written by a newer agent (its ``user_version`` is above ours)."""

    def __init__(self, path: Path, version: int) -> None:
        super().__init__(f"usage file {path} has schema version {version}, newer than this agent's "
                         f"{SCHEMA_VERSION}: run the newer agent, or point usage.path at another file")
        self.path = path
        self.version = version


def open_for_writing(path: Path) -> sqlite3.Connection:
    """Open (creating, mode 0600) the usage file for the ledger's writer thread: WAL,
    ``synchronous=NORMAL``, the schema created or checked. Autocommit mode: the caller opens
    and commits its transactions. Raises sqlite3.Error, OSError, SchemaNewer."""
    path = Path(path)
    # SQLite creates files with 0644 less the umask, and its -wal and -shm take the file's mode.
    os.close(os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600))
    conn = sqlite3.connect(path, isolation_level=None, check_same_thread=False, timeout=BUSY_TIMEOUT_MS / 1000)
    try:
        if conn.execute("PRAGMA journal_mode=WAL").fetchone()[0].lower() != "wal":
            raise sqlite3.OperationalError(f"{path}: the file system does not allow WAL mode")
        conn.execute("PRAGMA synchronous=NORMAL")
        version = conn.execute("PRAGMA user_version").fetchone()[0]
        if version > SCHEMA_VERSION:
            raise SchemaNewer(path, version)
        if version < SCHEMA_VERSION:
            conn.execute("BEGIN IMMEDIATE")
            for statement in _SCHEMA.split(";"):
                if statement.strip():
                    conn.execute(statement)
            conn.execute(f"PRAGMA user_version={SCHEMA_VERSION}")
            conn.execute("COMMIT")
    except BaseException:
        conn.close()
        raise
    return conn


def open_read_only(path: Path) -> sqlite3.Connection:
    """Open the usage file read-only (an ``mode=ro`` URI), as ``viiworkctl usage`` does while
    the agent writes it. Raises sqlite3.Error (no such file, not a database) and SchemaNewer."""
    path = Path(path)
    if not path.is_file():
        raise sqlite3.OperationalError(f"no usage file at {path}")
    conn = sqlite3.connect(f"file:{quote(str(path.resolve()))}?mode=ro", uri=True, timeout=BUSY_TIMEOUT_MS / 1000)
    try:
        version = conn.execute("PRAGMA user_version").fetchone()[0]
        if version > SCHEMA_VERSION:
            raise SchemaNewer(path, version)
        if version < SCHEMA_VERSION:
            raise sqlite3.OperationalError(f"{path} holds no usage table yet (schema version {version})")
    except BaseException:
        conn.close()
        raise
    return conn


def insert_rows(conn: sqlite3.Connection, rows: Iterable[UsageRow]) -> int:
    """Insert ``rows`` in one transaction and commit it; returns how many. On any error the
    transaction is rolled back (none of them is in the file) and the error raised."""
    values = [astuple(r) for r in rows]
    conn.execute("BEGIN IMMEDIATE")
    try:
        conn.executemany(_INSERT, values)
        conn.execute("COMMIT")
    except BaseException:
        if conn.in_transaction:
            try:
                conn.execute("ROLLBACK")
            except sqlite3.Error:
                pass  # the connection is reopened by the caller after any error
        raise
    return len(values)


def delete_before(conn: sqlite3.Connection, cutoff_ms: int, batch: int) -> int:
    """Delete at most ``batch`` rows finished before ``cutoff_ms`` (Unix ms), oldest first, in
    one short transaction; returns how many were deleted (fewer than ``batch``: none is left)."""
    conn.execute("BEGIN IMMEDIATE")
    try:
        cur = conn.execute("DELETE FROM usage WHERE id IN (SELECT id FROM usage WHERE finished_at_ms < ? "
                           "ORDER BY finished_at_ms LIMIT ?)", (cutoff_ms, batch))
        conn.execute("COMMIT")
    except BaseException:
        if conn.in_transaction:
            try:
                conn.execute("ROLLBACK")
            except sqlite3.Error:
                pass
        raise
    return cur.rowcount


def read_rows(conn: sqlite3.Connection, since_ms: int = 0) -> list[UsageRow]:
    """Every row finished at or after ``since_ms``, oldest first (tests and exports)."""
    cur = conn.execute(f"SELECT {', '.join(COLUMNS)} FROM usage WHERE finished_at_ms >= ? "
                       "ORDER BY finished_at_ms, id", (since_ms,))
    return [UsageRow(*r) for r in cur.fetchall()]


__all__ = ["COLUMNS", "SCHEMA_VERSION", "USAGE_FILE", "SchemaNewer", "UsageRow", "check_row", "delete_before", "insert_rows",
           "open_for_writing", "open_read_only", "read_rows"]
