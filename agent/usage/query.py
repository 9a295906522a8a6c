"""Summaries of the usage file, for ``viiworkctl usage`` (and later ``--mesh``).

``summarise(conn, since_ms, by)`` groups the rows finished at or after ``since_ms`` by
tenant, model or serving node and gives, per group: requests, errors (status >= 400),
token sums (over the rows where the engine reported the count; ``None`` when no row did)
and the median duration. Blocking: call it off any event loop.
"""

from __future__ import annotations

import enum
import sqlite3
from dataclasses import dataclass


class Grouping(enum.Enum):
    """What ``summarise`` groups by: the column of the usage table."""

    TENANT = "tenant"
    MODEL = "model"
    NODE = "node"

    @property
    def column(self) -> str:
        return {"tenant": "tenant", "model": "model", "node": "serving_node"}[self.value]


@dataclass(frozen=True)
class SummaryRow:
    """One group: ``key`` its tenant, model or serving node id ("" for no tenant);
    ``requests`` and ``errors`` counts; token sums (None: no row of the group had the
    count); ``p50_duration_ms`` the median of ``duration_ms`` (the lower middle row)."""

    key: str
    requests: int
    errors: int
    prompt_tokens: int | None
    completion_tokens: int | None
    cached_tokens: int | None
    p50_duration_ms: float

    def as_dict(self) -> dict[str, object]:
        return {"key": self.key, "requests": self.requests, "errors": self.errors,
                "prompt_tokens": self.prompt_tokens, "completion_tokens": self.completion_tokens,
                "cached_tokens": self.cached_tokens, "p50_duration_ms": self.p50_duration_ms}


def summarise(conn: sqlite3.Connection, since_ms: int, by: Grouping) -> list[SummaryRow]:
    """The groups of the rows finished at or after ``since_ms`` (Unix ms), most requests
    first (then by key). Raises sqlite3.Error."""
    col = by.column  # one of three fixed names: never text from the caller
    groups = conn.execute(
        f"SELECT {col}, count(*), sum(status >= 400), sum(prompt_tokens), sum(completion_tokens), "
        f"sum(cached_tokens) FROM usage WHERE finished_at_ms >= ? GROUP BY {col}", (since_ms,)).fetchall()
    out = []
    for key, requests, errors, prompt, completion, cached in groups:
        (p50,) = conn.execute(
            f"SELECT duration_ms FROM usage WHERE finished_at_ms >= ? AND {col} = ? "
            "ORDER BY duration_ms LIMIT 1 OFFSET ?", (since_ms, key, (requests - 1) // 2)).fetchone()
        out.append(SummaryRow(key=key, requests=requests, errors=int(errors or 0), prompt_tokens=prompt,
                              completion_tokens=completion, cached_tokens=cached, p50_duration_ms=float(p50)))
    out.sort(key=lambda r: (-r.requests, r.key))
    return out


__all__ = ["Grouping", "SummaryRow", "summarise"]
