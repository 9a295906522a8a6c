"""Summaries of the usage file, for ``viiworkctl usage`` and ``viiworkctl usage --mesh``.

``summarise(conn, since_ms, by)`` groups the rows finished at or after ``since_ms`` by
tenant, model or serving node and gives, per group: requests, errors (status >= 400),
token sums (over the rows where the engine reported the count; ``None`` when no row did)
and the median duration. Blocking: call it off any event loop.

Across the mesh, each node answers with ``parts`` (``summarise_parts``): the same sums, and
its durations as counts in logarithmic buckets instead of a median, since medians do not add
up; ``merge`` adds the nodes' parts and takes the median from the merged buckets, within
``DURATION_BUCKET_RATIO`` of the exact one. Each row is in exactly one node's file (the
serving node's), so adding the nodes' parts counts it once.
"""

from __future__ import annotations

import enum
import math
import sqlite3
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any


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


#: A duration bucket's upper bound over its lower one: the merged median is within half of
#: this step (about 2.5 %) of the exact one. Bucket 0 holds durations under 1 ms.
DURATION_BUCKET_RATIO = 1.05
#: The most groups one node answers with (most requests first); the rest are counted as left out.
MAX_PART_GROUPS = 2000
_LOG_RATIO = math.log(DURATION_BUCKET_RATIO)
#: Buckets up to 30 days in ms (a duration beyond lands in the last): ~420 buckets.
MAX_BUCKET = 1 + int(math.log(30 * 86_400_000) / _LOG_RATIO)


def duration_bucket(duration_ms: float) -> int:
    """The bucket of a duration: 0 below 1 ms, else 1 + floor(log(ms) / log(RATIO)), at most MAX_BUCKET."""
    if not duration_ms >= 1.0:  # (NaN too)
        return 0
    return min(MAX_BUCKET, 1 + int(math.log(duration_ms) / _LOG_RATIO))


def bucket_middle_ms(bucket: int) -> float:
    """A duration standing for ``bucket``: the geometric middle of its bounds (0.5 for bucket 0)."""
    if bucket <= 0:
        return 0.5
    return math.exp((bucket - 0.5) * _LOG_RATIO)


#: The longest group key a peer may send (a tenant, model or node name).
MAX_KEY_CHARS = 256


class GroupKeyRefused(ValueError):
    """A peer's group whose key is over MAX_KEY_CHARS or holds a character that is not
    printable (a control character, a line break, a bidi override): the group is dropped and
    counted, the rest of the answer kept (agent/peering/mesh_usage.py)."""


@dataclass(frozen=True)
class GroupPart:
    """One node's share of a group: the sums of :class:`SummaryRow` and ``durations``, bucket
    (``duration_bucket``) -> rows."""

    key: str
    requests: int
    errors: int
    prompt_tokens: int | None
    completion_tokens: int | None
    cached_tokens: int | None
    durations: Mapping[int, int] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        return {"key": self.key, "requests": self.requests, "errors": self.errors,
                "prompt_tokens": self.prompt_tokens, "completion_tokens": self.completion_tokens,
                "cached_tokens": self.cached_tokens, "durations": [[b, n] for b, n in sorted(self.durations.items())]}

    @classmethod
    def from_dict(cls, doc: Any) -> GroupPart:
        """Read a part a peer sent (``as_dict``'s shape); ValueError when it is not one,
        GroupKeyRefused (a ValueError) when only its key is refused."""
        def count(value: Any, optional: bool = False) -> int | None:
            if value is None and optional:
                return None
            if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < 1 << 53:
                raise ValueError(f"expected a count, got {str(value)[:20]!r}")
            return value

        if not isinstance(doc, dict) or not isinstance(doc.get("key"), str):
            raise ValueError("a group without a key")
        if len(doc["key"]) > MAX_KEY_CHARS or not doc["key"].isprintable():
            raise GroupKeyRefused(f"a group key over {MAX_KEY_CHARS} characters or with a control character")
        buckets = doc.get("durations")
        if not isinstance(buckets, list) or len(buckets) > MAX_BUCKET + 1:
            raise ValueError("durations: expected at most one [bucket, rows] per bucket")
        durations: dict[int, int] = {}
        for item in buckets:
            if not isinstance(item, list) or len(item) != 2:
                raise ValueError("durations: expected [bucket, rows]")
            bucket, rows = count(item[0]), count(item[1])
            assert bucket is not None and rows is not None
            if bucket > MAX_BUCKET:
                raise ValueError(f"bucket {bucket} above {MAX_BUCKET}")
            durations[bucket] = durations.get(bucket, 0) + rows
        requests, errors = count(doc.get("requests")), count(doc.get("errors"))
        assert requests is not None and errors is not None
        if sum(durations.values()) != requests or errors > requests:
            raise ValueError("the durations do not add up to the requests")
        return cls(doc["key"], requests, errors, count(doc.get("prompt_tokens"), True),
                   count(doc.get("completion_tokens"), True), count(doc.get("cached_tokens"), True), durations)


def summarise_parts(conn: sqlite3.Connection, since_ms: int, by: Grouping) -> tuple[list[GroupPart], int]:
    """This file's parts for a mesh-wide summary: the groups of the rows finished at or after
    ``since_ms``, most requests first, at most MAX_PART_GROUPS; returns (parts, groups left out).
    Raises sqlite3.Error."""
    col = by.column  # one of three fixed names: never text from the caller
    conn.create_function("duration_bucket", 1, duration_bucket, deterministic=True)
    rows = conn.execute(
        f"SELECT {col}, duration_bucket(duration_ms), count(*), sum(status >= 400), sum(prompt_tokens), "
        f"sum(completion_tokens), sum(cached_tokens) FROM usage WHERE finished_at_ms >= ? "
        f"GROUP BY {col}, duration_bucket(duration_ms)", (since_ms,)).fetchall()
    groups: dict[str, list[Any]] = {}
    for key, bucket, requests, errors, prompt, completion, cached in rows:
        g = groups.setdefault(key, [0, 0, None, None, None, {}])
        g[0] += requests
        g[1] += int(errors or 0)
        for i, value in ((2, prompt), (3, completion), (4, cached)):
            if value is not None:
                g[i] = (g[i] or 0) + value
        g[5][bucket] = requests
    parts = [GroupPart(key, *g) for key, g in groups.items()]
    parts.sort(key=lambda p: (-p.requests, p.key))
    return parts[:MAX_PART_GROUPS], max(0, len(parts) - MAX_PART_GROUPS)


def merge(parts: Iterable[GroupPart]) -> list[SummaryRow]:
    """The groups of every node's parts added up, most requests first (then by key); a group's
    ``p50_duration_ms`` is the middle of the bucket that holds its lower middle row."""
    merged: dict[str, list[Any]] = {}
    for p in parts:
        g = merged.setdefault(p.key, [0, 0, None, None, None, {}])
        g[0] += p.requests
        g[1] += p.errors
        for i, value in ((2, p.prompt_tokens), (3, p.completion_tokens), (4, p.cached_tokens)):
            if value is not None:
                g[i] = (g[i] or 0) + value
        for bucket, rows in p.durations.items():
            g[5][bucket] = g[5].get(bucket, 0) + rows
    out = []
    for key, (requests, errors, prompt, completion, cached, buckets) in merged.items():
        if requests == 0:
            continue
        middle, seen, p50 = (requests - 1) // 2, 0, 0.0
        for bucket in sorted(buckets):
            seen += buckets[bucket]
            if seen > middle:
                p50 = bucket_middle_ms(bucket)
                break
        out.append(SummaryRow(key=key, requests=requests, errors=errors, prompt_tokens=prompt,
                              completion_tokens=completion, cached_tokens=cached, p50_duration_ms=p50))
    out.sort(key=lambda r: (-r.requests, r.key))
    return out


__all__ = ["DURATION_BUCKET_RATIO", "GroupPart", "Grouping", "SummaryRow", "merge", "summarise", "summarise_parts"]
