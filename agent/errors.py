"""OpenAI-shaped error responses: ``{"error": {"message", "type", "param", "code"}}``."""

from __future__ import annotations

import json

from aiohttp import web

_TYPES = {
    400: "invalid_request_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    500: "server_error",
    502: "upstream_error",
    503: "unavailable_error",
    504: "timeout_error",
}


def error_body(status: int, message: str, *, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": _TYPES.get(status, "error"), "param": param,
                      "code": code if code is not None else status}}


def error_response(status: int, message: str, *, param: str | None = None, code: str | None = None,
                   retry_after_s: int | None = None, headers: dict[str, str] | None = None) -> web.Response:
    """A JSON error response; 429/503 carry ``Retry-After`` (seconds)."""
    out = dict(headers or {})
    if retry_after_s is not None:
        out["Retry-After"] = str(retry_after_s)
    return web.Response(status=status, body=json.dumps(error_body(status, message, param=param, code=code)),
                        content_type="application/json", headers=out)


def sse_error_event(status: int, message: str) -> bytes:
    """A terminal SSE event that tells a streaming client the stream broke (no [DONE])."""
    return b"data: " + json.dumps(error_body(status, message)).encode() + b"\n\n"
