"""A running or stopped agent's usage rows, read as `viiworkctl usage` reads them (read-only)."""

from __future__ import annotations

from support.agent import Agent
from viiwork.agent.usage.store import UsageRow, open_read_only, read_rows


def rows(agent: Agent) -> dict[str, UsageRow]:
    """The agent's ledger rows by request id."""
    assert agent.state_dir is not None
    conn = open_read_only(agent.state_dir / "usage.sqlite3")
    try:
        return {r.request_id: r for r in read_rows(conn)}
    finally:
        conn.close()
