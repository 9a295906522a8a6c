"""The running agent's ``GET /v1/status``, as the doctor asks it (blocking, bounded)."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

#: The most of an error answer read for its message (an OpenAI-shaped error document is small).
MAX_ERROR_BYTES = 64 * 1024


@dataclass(frozen=True, slots=True)
class AgentFacts:
    """What ``GET {url}/v1/status`` answered: ``status`` (the JSON document) or ``error``.
    ``http_status``: the HTTP status of an error answer (401/403: client keys refused the
    doctor's request), None otherwise."""

    url: str
    reachable: bool
    status: Mapping[str, Any] | None = None
    error: str | None = None
    http_status: int | None = None


def read_agent(url: str, timeout_s: float = 3.0, api_key: str | None = None) -> AgentFacts:
    """GET /v1/status from the agent (blocking, bounded by ``timeout_s``), with ``api_key`` as
    a bearer token when given. An error answer's ``error.message`` (docs/api.md) is kept in
    ``error``; the key itself never is."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    request = urllib.request.Request(f"{url.rstrip('/')}/v1/status", headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as resp:
            body = resp.read(8 * 1024 * 1024)
    except urllib.error.HTTPError as exc:
        return AgentFacts(url, True, None, f"/v1/status answered HTTP {exc.code}{_message(exc)}", exc.code)
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


def _message(exc: urllib.error.HTTPError) -> str:
    """``: <error.message>`` of an error answer, or "" when it has none."""
    try:
        error = json.loads(exc.read(MAX_ERROR_BYTES)).get("error") or {}
        message = str(error.get("message") or "")
    except (ValueError, AttributeError, OSError):
        return ""
    return f": {message[:300]}" if message else ""
