"""Reading SGLang's scheduler gauges out of its Prometheus text, label sets and all.

The samples come from ``viiwork.engines.prometheus.parse_samples`` (prometheus-client's
parser, labels kept). ``parse_gauges`` there sums every label set of a name, which is right
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

from viiwork.engines.prometheus import Sample, parse_samples

__all__ = ["Sample", "parse_samples", "scheduler_constant", "scheduler_total"]


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
