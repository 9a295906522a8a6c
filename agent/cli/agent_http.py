"""How viiworkctl reads an agent's HTTP API (``/v1/status``, ``/v1/mesh``), with a client key.

An agent in keys mode (docs/security.md, "Client keys") answers ``/v1/status``, ``/metrics``
and ``/v1/mesh`` only for a key with the ``read`` scope, unless ``auth.open_loopback_reads``
and the client is on loopback. ``--api-key KEY``, else ``$VIIWORK_API_KEY``, is sent as
``Authorization: Bearer KEY``; the environment variable keeps the key out of ``ps`` and the
shell's history. The key is never printed: a refusal (401/403) is one line with the agent's
reason and which option or variable gives a key.
"""

from __future__ import annotations

import argparse
import json
import os
import urllib.error
import urllib.request
from typing import Any

API_KEY_ENV = "VIIWORK_API_KEY"
#: What to do about a 401/403 from the agent: appended to its message.
KEY_HINT = (f"pass a client key with the read scope: --api-key KEY or {API_KEY_ENV}=KEY "
            "(or, on the agent's own box, set auth.open_loopback_reads = true)")


class AgentAnswered(ConnectionError):
    """The agent answered with an HTTP error: ``status``, and from its error document
    (docs/api.md) ``code`` and ``message`` ("" when the body is not one). For a 401/403
    the text ends with KEY_HINT."""

    def __init__(self, url: str, status: int, body: bytes) -> None:
        self.status, self.code, self.message = status, "", ""
        try:
            error = json.loads(body).get("error") or {}
            self.code, self.message = str(error.get("code", "")), str(error.get("message", ""))
        except (ValueError, AttributeError):
            pass
        shown = self.message or body[:200].decode("utf-8", "replace").strip() or "(empty body)"
        hint = f"; {KEY_HINT}" if self.refused_key else ""
        super().__init__(f"{url} answered {status}: {shown}{hint}")

    @property
    def refused_key(self) -> bool:
        """The agent refused the request for its client key (or its absence, or its scope)."""
        return self.status in (401, 403)


def add_api_key_arg(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--api-key", metavar="KEY", default=None,
                        help=f"a client key with the read scope, for an agent with client keys on (default: "
                             f"${API_KEY_ENV}; the variable keeps the key out of `ps`)")


def api_key(args: argparse.Namespace) -> str | None:
    """``--api-key``, else ``$VIIWORK_API_KEY``, else None (an empty value counts as none)."""
    return getattr(args, "api_key", None) or os.environ.get(API_KEY_ENV) or None


def key_headers(key: str | None) -> dict[str, str]:
    """The request headers that carry ``key`` (none for None)."""
    return {"Authorization": f"Bearer {key}"} if key else {}


def fetch_json(url: str, timeout: float, key: str | None = None) -> Any:
    """GET ``url`` (with ``key`` as a bearer token when given) and decode JSON. Raises
    AgentAnswered for an HTTP error status, and ConnectionError with a readable message when
    the agent cannot be reached or the body is not JSON."""
    request = urllib.request.Request(url, headers=key_headers(key))
    try:
        with urllib.request.urlopen(request, timeout=timeout) as resp:  # noqa: S310 (http to the agent)
            return json.load(resp)
    except urllib.error.HTTPError as exc:
        raise AgentAnswered(url, exc.code, exc.read()) from None
    except (urllib.error.URLError, OSError, TimeoutError) as exc:
        reason = getattr(exc, "reason", exc)
        raise ConnectionError(f"cannot reach the agent at {url}: {reason} "
                              "(is viiwork-agent running? for one started with --config FILE pass --config FILE; "
                              "else --url or VIIWORK_URL)") from None
    except ValueError as exc:
        raise ConnectionError(f"{url} did not return JSON: {exc}") from None
