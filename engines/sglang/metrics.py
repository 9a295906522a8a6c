"""Reading SGLang's scheduler gauges out of its Prometheus text, label sets and all.

``viiwork.engines.prometheus.parse_gauges`` sums every label set of a name, which is right
for vLLM (one series per data-parallel engine) and wrong for SGLang, whose scheduler gauges
(SGLang 0.5.23, ``srt/observability/metrics_collector.py``) carry the labels
``model_name, engine_type, tp_rank, pp_rank, moe_ep_rank`` plus ``dp_rank`` under data
parallelism and ``priority`` under priority scheduling:

- with priority scheduling the total is the series with ``priority=""`` and each priority
  also gets its own series (``priority="3"``): summing counts every request twice;
- with ``--enable-metrics-for-all-schedulers`` every tensor-parallel rank publishes the same
  scheduler's numbers, and pipeline stages each publish their view of one request set:
  summing multiplies the count by the number of ranks;
- data-parallel ranks (``dp_rank``) are separate schedulers with separate requests: those
  do add up.

So :func:`scheduler_total` keeps the totals, takes the largest value among the series of
one data-parallel rank, and sums over ranks.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True)
class Sample:
    """One sample line: metric name, its labels, its value."""

    name: str
    value: float
    labels: dict[str, str] = field(default_factory=dict)


def parse_samples(text: str) -> list[Sample]:
    """Every sample of a Prometheus text exposition, with its labels.

    Comment lines, malformed lines and NaN values are skipped (absent, not zero). Label
    values are unescaped (``\\\\``, ``\\"``, ``\\n``).
    """
    out: list[Sample] = []
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        sample = _parse_line(line)
        if sample is not None:
            out.append(sample)
    return out


def scheduler_total(samples: list[Sample], name: str) -> float | None:
    """The backend-wide value of an SGLang scheduler gauge, or None when no series has it.

    Series with a non-empty ``priority`` label (per-priority breakdowns) are ignored; within
    one ``dp_rank`` (absent = one rank) the largest series is taken, since tensor-parallel
    and pipeline ranks repeat one scheduler's numbers; the ranks are summed.
    """
    per_rank: dict[str, float] = {}
    for s in samples:
        if s.name != name or s.labels.get("priority", ""):
            continue
        rank = s.labels.get("dp_rank", "")
        per_rank[rank] = max(per_rank.get(rank, s.value), s.value)
    if not per_rank:
        return None
    return sum(per_rank.values())


def scheduler_constant(samples: list[Sample], name: str) -> float | None:
    """A value every rank publishes alike (``sglang:context_len``): the largest, or None."""
    values = [s.value for s in samples if s.name == name and not s.labels.get("priority", "")]
    return max(values) if values else None


def _parse_line(line: str) -> Sample | None:
    labels: dict[str, str] = {}
    brace = line.find("{")
    space = line.find(" ")
    if brace != -1 and (space == -1 or brace < space):
        name = line[:brace]
        end = _parse_labels(line, brace + 1, labels)
        if end is None:
            return None
        rest = line[end:]
    else:
        if space == -1:
            return None
        name, rest = line[:space], line[space:]
    parts = rest.split()
    if not name or not parts:
        return None
    try:
        value = float(parts[0])
    except ValueError:
        return None
    if math.isnan(value):
        return None
    return Sample(name=name, value=value, labels=labels)


_ESCAPES = {"\\": "\\", '"': '"', "n": "\n"}


def _parse_labels(line: str, i: int, labels: dict[str, str]) -> int | None:
    """Parse ``k="v",...}`` starting at ``i``; return the index after ``}``, None if malformed."""
    n = len(line)
    while i < n:
        while i < n and line[i] in " ,":
            i += 1
        if i < n and line[i] == "}":
            return i + 1
        eq = line.find("=", i)
        if eq == -1 or eq + 1 >= n or line[eq + 1] != '"':
            return None
        key = line[i:eq].strip()
        i = eq + 2
        value: list[str] = []
        while i < n and line[i] != '"':
            if line[i] == "\\" and i + 1 < n:
                value.append(_ESCAPES.get(line[i + 1], line[i + 1]))
                i += 2
            else:
                value.append(line[i])
                i += 1
        if i >= n:
            return None
        labels[key] = "".join(value)
        i += 1
    return None
