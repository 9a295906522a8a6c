"""The agent's error answers: OpenAI's shape ``{"error": {"message", "type", "param", "code"}}``,
and Anthropic's on Anthropic's endpoints (:class:`Dialect`).

``type`` follows the HTTP status (``invalid_request_error`` for 400, ...); ``code`` is one
of :class:`ErrorCode` (OpenAI's own where one exists, e.g. ``model_not_found``,
``rate_limit_exceeded``, ``context_length_exceeded``), a code an engine adapter gave for its
engine's error, or null. The table of every case is docs/routing.md, "Status codes".

An engine's own error answer is rewritten into this shape by :func:`engine_error`: a 4xx
keeps its status and the engine's message; a 5xx that the engine adapter classifies as the
client's fault (optional ``client_fault(status, body) -> str | None`` of engines/contract.py)
becomes 400 with the engine's message; any other 5xx becomes 502.

On ``/v1/messages`` and ``/v1/messages/count_tokens`` (Anthropic's Messages API) a client's SDK
reads Anthropic's shape, ``{"type": "error", "error": {"type", "message"}}``, with Anthropic's
error types (:data:`ANTHROPIC_TYPES`; docs.anthropic.com, "Errors"): every answer is built in
OpenAI's shape and rewritten there once, whoever made it (``anthropic_error_body``, applied by
the client API's dialect middleware, agent/serving/api.py), and an SSE error event is written
in the dialect of the request's path (:func:`sse_error_event`).
"""

from __future__ import annotations

import json
from enum import StrEnum
from typing import Any

from aiohttp import web

from viiwork.engines.contract import Engine, classify_client_fault

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    408: "timeout_error",
    409: "conflict_error",
    413: "invalid_request_error",
    415: "invalid_request_error",
    422: "invalid_request_error",
    429: "rate_limit_error",
    500: "server_error",
    502: "upstream_error",
    503: "unavailable_error",
    504: "timeout_error",
}

# Anthropic's error types by status (docs.anthropic.com/en/api/errors); a status without its
# own type takes invalid_request_error below 500 and api_error from 500. The HTTP status is kept
# (Anthropic's own API answers 529 when overloaded; the agent's 503 says the same).
ANTHROPIC_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    500: "api_error",
    502: "api_error",
    503: "overloaded_error",
    504: "timeout_error",
    529: "overloaded_error",
}


class Dialect(StrEnum):
    """Which error shape a client reads: OpenAI's, or Anthropic's on its Messages API."""

    OPENAI = "openai"
    ANTHROPIC = "anthropic"


ANTHROPIC_PATH = "/v1/messages"


def dialect_of(path: str) -> Dialect:
    """The dialect of a request at ``path``: Anthropic's at ``/v1/messages`` and under it."""
    if path == ANTHROPIC_PATH or path.startswith(ANTHROPIC_PATH + "/"):
        return Dialect.ANTHROPIC
    return Dialect.OPENAI


def anthropic_error_body(status: int, message: str) -> dict[str, Any]:
    """``{"type": "error", "error": {"type", "message"}}`` with Anthropic's type for ``status``."""
    kind = ANTHROPIC_TYPES.get(status, "invalid_request_error" if status < 500 else "api_error")
    return {"type": "error", "error": {"type": kind, "message": message}}


def as_anthropic(status: int, body: bytes) -> bytes | None:
    """An error answer ``body`` in OpenAI's shape (the agent's, or an engine's as
    :func:`engine_error` renders it) rewritten in Anthropic's, keeping its message; None when
    ``body`` is not such an object (an answer already in Anthropic's shape, or not JSON)."""
    try:
        doc = json.loads(body)
    except (ValueError, RecursionError):
        return None
    inner = doc.get("error") if isinstance(doc, dict) and doc.get("type") != "error" else None
    if not isinstance(inner, dict) or not isinstance(inner.get("message"), str):
        return None
    return json.dumps(anthropic_error_body(status, inner["message"])).encode()


# An engine's message is kept up to this many characters (an error body can be anything).
ENGINE_MESSAGE_MAX_CHARS = 1000


class ErrorCode(StrEnum):
    """The agent's own ``code`` values (docs/routing.md, "Status codes")."""

    INVALID_JSON = "invalid_json"                  # 400: not UTF-8 JSON, or not an object
    JSON_TOO_DEEP = "json_too_deep"                # 400: nested deeper than 64 levels
    INVALID_BODY = "invalid_body"                  # 400: framing or Content-Encoding broken, or cut short
    BODY_TOO_LARGE = "body_too_large"              # 413: over api.max_body_bytes (or a message limit)
    BODY_READ_TIMEOUT = "body_read_timeout"        # 408: api.body_read_timeout_s / api.body_timeout_s
    TOO_MANY_CONNECTIONS = "too_many_connections"  # 503: api.max_connections (or per address) reached
    HOST_NOT_ALLOWED = "host_not_allowed"          # 403: Host not a name of this API (DNS rebinding)
    ORIGIN_NOT_ALLOWED = "origin_not_allowed"      # 403: Origin another site (api.allowed_origins)
    CROSS_SITE_NOT_ALLOWED = "cross_site_not_allowed"  # 403: another site's <img>/no-cors request
    UNSUPPORTED_MEDIA_TYPE = "unsupported_media_type"  # 415: a browser's text/plain or form POST
    MISSING_MODEL = "missing_model"                # 400: no "model" string
    MISSING_REQUIRED_PARAMETER = "missing_required_parameter"  # 400: /v1/messages without max_tokens
    INVALID_TYPE = "invalid_type"                  # 400: max_tokens, max_completion_tokens, max_output_tokens or n
    #                                                  not an integer; store not a boolean; tokens not integers
    INTEGER_BELOW_MIN_VALUE = "integer_below_min_value"  # 400: one of those below 1
    WRONG_MODEL_KIND = "wrong_model_kind"          # 400: chat endpoint, embedding model (or the reverse)
    MODEL_NOT_FOUND = "model_not_found"            # 404: no node serves the model
    MODEL_NOT_ON_HOST = "model_not_on_host"        # 400: the pinned node does not serve it
    ENDPOINT_NOT_SUPPORTED = "endpoint_not_supported"  # 400: no backend of the model serves the endpoint
    STORED_RESPONSES = "stored_responses_not_supported"  # 400: /v1/responses with store, previous_response_id
    #                                                      or conversation
    HOST_NOT_FOUND = "host_not_found"              # 404: pinned to an unknown node
    HOST_AMBIGUOUS = "host_ambiguous"              # 404: pinned to a name several nodes carry
    NOT_FOUND = "not_found"                        # 404: no such endpoint
    METHOD_NOT_ALLOWED = "method_not_allowed"      # 405
    RATE_LIMIT_EXCEEDED = "rate_limit_exceeded"    # 429: queue full or no slot in time
    DRAINING = "draining"                          # 503: the node admits nothing new
    NO_CAPACITY = "no_capacity"                    # 503: nothing can serve the model now
    UPSTREAM_UNREACHABLE = "upstream_unreachable"  # 502: the engine could not be reached
    UPSTREAM_ERROR = "upstream_error"              # 502: the engine failed or broke off
    UPSTREAM_TIMEOUT = "upstream_timeout"          # 504: the engine stayed silent
    INVALID_MESSAGE = "invalid_message"            # 400: a malformed mesh want/offer message
    INVALID_CONFIG = "invalid_config"              # 400 (admin): the config file does not load
    NOT_RELOADABLE = "not_reloadable"              # 409 (admin): the embedded demo config
    INTERNAL_ERROR = "internal_error"              # 500 (admin): a control command failed


def error_body(status: int, message: str, *, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    """``{"error": {"message", "type", "param", "code"}}``; ``code`` None is JSON null."""
    return {"error": {"message": message, "type": _TYPES.get(status, "invalid_request_error" if status < 500
                                                             else "server_error"),
                      "param": param, "code": None if code is None else str(code)}}


def error_response(status: int, message: str, *, param: str | None = None, code: str | None = None,
                   retry_after_s: int | None = None, headers: dict[str, str] | None = None) -> web.Response:
    """A JSON error response; 429/503 carry ``Retry-After`` (seconds)."""
    out = dict(headers or {})
    if retry_after_s is not None:
        out["Retry-After"] = str(retry_after_s)
    return web.Response(status=status, body=json.dumps(error_body(status, message, param=param, code=code)).encode(),
                        content_type="application/json", headers=out)


def sse_error_event(status: int, message: str, code: str | None = None,
                    dialect: Dialect = Dialect.OPENAI) -> bytes:
    """A terminal SSE event that tells a streaming client the stream broke (no [DONE]): OpenAI's
    ``data: {"error": ...}``, or Anthropic's named ``event: error`` with its error object."""
    if dialect is Dialect.ANTHROPIC:
        return b"event: error\ndata: " + json.dumps(anthropic_error_body(status, message)).encode() + b"\n\n"
    return b"data: " + json.dumps(error_body(status, message, code=code)).encode() + b"\n\n"


def engine_message(body: bytes) -> tuple[str | None, str | None, str | None]:
    """``(message, code, param)`` read from an engine's error body, each None when absent.

    Shapes read (docs/engines.md): llama-server ``{"error": {"code": int, "message", "type"}}``,
    vLLM/SGLang ``{"error": {"message", "type", "param", "code"}}`` (OpenAI's), FastAPI's
    ``{"detail": ...}``, and plain text. Only a string ``code`` is kept (an integer one
    repeats the status). Never raises, for any bytes.
    """
    text = body.decode("utf-8", "replace").strip()
    try:
        doc = json.loads(text) if text.startswith("{") and text.count("[") + text.count("{") <= 64 else None
    except (ValueError, RecursionError):
        doc = None
    if isinstance(doc, dict):
        inner = doc.get("error")
        if isinstance(inner, dict):
            message, code, param = inner.get("message"), inner.get("code"), inner.get("param")
            return (_clip(message) if isinstance(message, str) and message.strip() else None,
                    code if isinstance(code, str) and code else None,
                    param if isinstance(param, str) and param else None)
        if isinstance(inner, str) and inner.strip():
            return _clip(inner), None, None
        detail = doc.get("detail") if isinstance(doc.get("detail"), str) else doc.get("message")
        if isinstance(detail, str) and detail.strip():
            return _clip(detail), None, None
        return None, None, None
    return (_clip(text) if text else None), None, None


def engine_error(status: int, body: bytes, backend_id: str, adapter: Engine | None, *,
                 headers: dict[str, str] | None = None) -> web.Response:
    """The client's answer to an engine's error ``status`` (>= 400) with ``body``.

    4xx: the same status, the engine's message, ``code`` from the adapter's
    ``client_fault`` if it has one, else the engine's string code, else null. 5xx:
    ``client_fault`` returns a code -> 400 with the engine's message and that code;
    None (or no such capability, or ``adapter`` None) -> 502 ``upstream_error`` naming the
    backend and the engine's status. A classifier that raises or answers a code outside
    ``CLIENT_FAULT_CODES`` counts as None (``classify_client_fault``).
    """
    message, engine_code, param = engine_message(body)
    fault = classify_client_fault(adapter, status, body)
    if status < 500:
        return error_response(status, message or f"backend {backend_id} refused the request ({status})",
                              param=param, code=fault or engine_code, headers=headers)
    if fault is not None:
        return error_response(400, message or f"backend {backend_id} refused the request", param=param,
                              code=fault, headers=headers)
    detail = f": {message[:200]}" if message else ""
    return error_response(502, f"backend {backend_id} failed with HTTP {status}{detail}",
                          code=ErrorCode.UPSTREAM_ERROR, headers=headers)


def engine_failed(status: int, body: bytes, adapter: Engine | None) -> bool:
    """Whether an engine's error ``status`` with ``body`` is the engine's failure (what
    :func:`engine_error` answers with a 5xx), not the client's fault: a 5xx that the
    adapter's ``client_fault`` does not classify. Used for an error event in a relayed stream,
    whose status is already sent: only a failure counts against its backend."""
    return status >= 500 and classify_client_fault(adapter, status, body) is None


def _clip(text: str) -> str:
    text = text.strip()
    return text if len(text) <= ENGINE_MESSAGE_MAX_CHARS else text[:ENGINE_MESSAGE_MAX_CHARS] + "..."
