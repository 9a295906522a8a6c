"""The running agent's ``GET /v1/status``, as the doctor asks it (blocking, bounded)."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, slots=True)
class AgentFacts:
    """What ``GET {url}/v1/status`` answered: ``status`` (the JSON document) or ``error``."""

    url: str
    reachable: bool
    status: Mapping[str, Any] | None = None
    error: str | None = None


def read_agent(url: str, timeout_s: float = 3.0) -> AgentFacts:
    """GET /v1/status from the agent (blocking, bounded by ``timeout_s``)."""
    try:
        with urllib.request.urlopen(f"{url.rstrip('/')}/v1/status", timeout=timeout_s) as resp:
            body = resp.read(8 * 1024 * 1024)
    except urllib.error.HTTPError as exc:
        return AgentFacts(url, True, None, f"/v1/status answered HTTP {exc.code}")
    except (urllib.error.URLError, OSError, TimeoutError) as exc:
        reason = getattr(exc, "reason", exc)
        return AgentFacts(url, False, None, str(reason))
    try:
        doc = json.loads(body)
        if not isinstance(doc, dict):
            raise ValueError("not a JSON object")
    except ValueError as exc:
        return AgentFacts(url, True, None, f"/v1/status is not valid JSON: {exc}")
    return AgentFacts(url, True, doc)
