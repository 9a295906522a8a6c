"""Read samples from Prometheus text exposition (the format engines publish on /metrics),
through prometheus-client's own parser, labels kept."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from prometheus_client.parser import text_string_to_metric_families

from viiwork.engines.contract import LoadUnknown, TokenCounters


@dataclass(frozen=True, slots=True)
class Sample:
    """One sample line: metric name (as written, ``_total``/``_bucket`` included), its labels
    (values unescaped), its value."""

    name: str
    value: float
    labels: dict[str, str] = field(default_factory=dict)


def parse_samples(text: str) -> list[Sample]:
    """Every sample of a Prometheus text exposition, in order, with its labels.

    Comments are skipped, and so are NaN values (absent, not zero). A text the parser refuses
    is read again line by line, so one malformed line (an engine's bug) costs only itself.
    """
    try:
        return _samples(text)
    except ValueError:
        pass
    out: list[Sample] = []
    for line in text.splitlines():
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        try:
            out += _samples(line + "\n")
        except ValueError:
            continue
    return out


def parse_gauges(text: str) -> dict[str, float]:
    """Map each sample name to its value, summed over label sets (vLLM labels gauges by
    model name and data-parallel engine). Errors and NaN as :func:`parse_samples`."""
    out: dict[str, float] = {}
    for sample in parse_samples(text):
        out[sample.name] = out.get(sample.name, 0.0) + sample.value
    return out


def _samples(text: str) -> list[Sample]:
    """The samples of ``text``; ValueError when prometheus-client's parser refuses it."""
    return [Sample(s.name, s.value, dict(s.labels))
            for family in text_string_to_metric_families(text) for s in family.samples if not math.isnan(s.value)]

def request_count(value: float, name: str) -> int:
    """A gauge ``name`` read as a number of requests: ``value`` as an int.

    Raises LoadUnknown when it is negative or not a whole number (a count nobody can trust).
    """
    if value < 0 or value != int(value):
        raise LoadUnknown(f"{name} is {value!r}, not a request count")
    return int(value)


def token_counters(gauges: dict[str, float], prompt_tokens: str, prompt_seconds: str, decode_tokens: str,
                   decode_seconds: str) -> TokenCounters | None:
    """The four cumulative counters named (as :func:`parse_gauges` maps them, summed over
    label sets), or None when one is missing or negative (the engine's speed is then unknown)."""
    values = [gauges.get(name) for name in (prompt_tokens, prompt_seconds, decode_tokens, decode_seconds)]
    if any(v is None or v < 0 for v in values):
        return None
    return TokenCounters(*(float(v) for v in values if v is not None))
