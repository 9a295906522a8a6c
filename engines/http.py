"""The adapters' HTTP reads: one GET through the session the caller gives, with every
transport failure turned into ``EngineUnavailable`` and every HTTP answer returned whole;
and ``probe_status``, the readiness rule of an engine whose health route says it all in its
status code (vLLM's ``/health``, SGLang's ``/health_generate``).

An adapter holds no session, connector or key (docs/engines.md): the session it is handed
already reaches the backend. For a backend on a Unix socket (``BackendSpec.socket_path``)
the supervisor builds it on an ``aiohttp.UnixConnector`` and ``base_url`` is
``http://localhost`` (the host is only a label); for a backend with a key
(``BackendSpec.api_key_file``) the session sends ``Authorization: Bearer <key>`` as a default
header (agent/supervision/backend_task.py, agent/supervision/engine_keys.py). So ``fetch`` adds no header and opens
no connection of its own, and an engine that refuses the key answers 401: an answer, which
the adapter reads like any other status, not a transport failure.
"""

from __future__ import annotations

from dataclasses import dataclass

import aiohttp

from viiwork.engines.contract import EngineUnavailable, Probe

__all__ = ["TRANSPORT_ERRORS", "Answer", "fetch", "probe_status"]

#: What means no HTTP answer was read: refused, reset, a missing socket file
#: (aiohttp's UnixClientConnectorError), bytes that are not HTTP (ClientResponseError "Bad
#: status line"), a truncated body, or the session's timeout (TimeoutError).
TRANSPORT_ERRORS = (aiohttp.ClientError, TimeoutError)


@dataclass(frozen=True, slots=True)
class Answer:
    """One HTTP answer from a backend: its status code and its whole raw body."""

    status: int
    body: bytes

    def text(self) -> str:
        """The body as text: UTF-8 (Prometheus' text format and JSON both are), with
        undecodable bytes replaced, so a garbled body is unreadable load, not a crash."""
        return self.body.decode("utf-8", errors="replace")


async def fetch(http: aiohttp.ClientSession, base_url: str, path: str) -> Answer:
    """``GET base_url + path`` through ``http``, the body read to its end.

    Returns the Answer whatever its status (a 404, 401 or 503 is for the adapter to read).
    Raises EngineUnavailable("GET <path>: <error class>: <error>") on a transport failure
    (``TRANSPORT_ERRORS``), chained ``from`` the aiohttp error, whose class the supervisor
    reads: a ``TimeoutError`` cause is a timed-out read (agent/supervision/waits.py ``timed_out``).
    """
    try:
        async with http.get(f"{base_url}{path}") as resp:
            return Answer(status=resp.status, body=await resp.read())
    except TRANSPORT_ERRORS as exc:
        raise EngineUnavailable(f"GET {path}: {exc.__class__.__name__}: {exc}") from exc


async def probe_status(http: aiohttp.ClientSession, base_url: str, path: str, *, engine: str, phase: str,
                       not_ready: str) -> Probe:
    """Readiness from the status of ``GET base_url + path`` alone.

    Returns Probe(ready=True) for a 200; for a 503 Probe(ready=False, phase=``phase``,
    reason="<engine> <path> answered 503: <not_ready>"); for any other status a not-ready
    Probe whose reason names the status and the body's first 200 bytes. ``engine`` is the
    engine's display name. Raises EngineUnavailable on a transport failure (``fetch``).
    """
    answer = await fetch(http, base_url, path)
    if answer.status == 200:
        return Probe(ready=True)
    if answer.status == 503:
        return Probe(ready=False, phase=phase, reason=f"{engine} {path} answered 503: {not_ready}")
    return Probe(ready=False, reason=f"{engine} {path} answered {answer.status}: {answer.body[:200]!r}")
