"""Read gauge samples from Prometheus text exposition (the format engines publish on /metrics)."""

from __future__ import annotations

import math

from viiwork.engines.contract import LoadUnknown


def parse_gauges(text: str) -> dict[str, float]:
    """Map each unlabelled sample name to its value; a labelled sample is keyed by its bare
    name and summed over label sets (vLLM labels gauges by model name).

    Comment lines and malformed lines are skipped; NaN values are skipped (absent, not zero).
    """
    out: dict[str, float] = {}
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        if "{" in line:
            name, _, rest = line.partition("{")
            _, _, rest = rest.rpartition("}")
        else:
            name, _, rest = line.partition(" ")
        parts = rest.split()
        if not name or not parts:
            continue
        try:
            value = float(parts[0])
        except ValueError:
            continue
        if math.isnan(value):
            continue
        out[name.strip()] = out.get(name.strip(), 0.0) + value
    return out


def request_count(value: float, name: str) -> int:
    """A gauge ``name`` read as a number of requests: ``value`` as an int.

    Raises LoadUnknown when it is negative or not a whole number (a count nobody can trust).
    """
    if value < 0 or value != int(value):
        raise LoadUnknown(f"{name} is {value!r}, not a request count")
    return int(value)
