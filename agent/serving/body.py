"""Request bodies read within a size limit and parsed as JSON within a nesting limit.

Every listener of the agent that takes a JSON body (the client API, the mesh listener's
forward, want and offer routes) reads it here, so any input ends in a clear 4xx
(docs/routing.md, "Status codes"), never in an exception that aiohttp answers with 500:

- :func:`read_body`: at most ``limit`` bytes from ``request.content``, checked as they
  arrive (a chunked or compressed body has no honest ``Content-Length``). Reading the
  stream ourselves, not ``request.read()``, makes the limit per route: the application's
  ``client_max_size`` only bounds ``read()``/``post()``.
- :func:`count_param_error`: the counts a request asks for (``max_tokens``,
  ``max_completion_tokens``, ``n``, Responses' ``max_output_tokens``) are integers >= 1 or null, as OpenAI requires (it answers
  400 otherwise); llama.cpp takes a negative ``max_tokens`` as "no limit", and key limits
  estimate a request's tokens from them (agent/auth/limits.py).
- :func:`parse_json_object`: UTF-8 JSON (RFC 8259 §8.1) whose arrays and objects nest at
  most :data:`MAX_JSON_DEPTH` deep, checked before ``json.loads`` runs. CPython's parser
  recurses once per level; 1,000 nested ``[`` raise RecursionError.
"""

from __future__ import annotations

import asyncio
import json
import re
from itertools import accumulate
from typing import Any

from aiohttp import web

from viiwork.agent.serving.errors import ErrorCode

MAX_JSON_DEPTH = 64
# The default for a read of a body that gets no byte (api.body_read_timeout_s, docs/configuration.md).
BODY_READ_TIMEOUT_S = 30.0
# The default for a whole body (api.body_timeout_s): a client that sends a byte just before
# each read deadline would otherwise hold its connection for as long as it likes.
BODY_TIMEOUT_S = 60.0

# A JSON string (RFC 8259 §7), unrolled so the regex engine does not backtrack per character.
_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"', re.DOTALL)
# Every byte except the four brackets is deleted; "[" / "{" count +1, "]" / "}" -1.
_NOT_BRACKETS = bytes(b for b in range(256) if b not in b"[]{}")
_STEP = {ord("["): 1, ord("{"): 1, ord("]"): -1, ord("}"): -1}


class BodyError(Exception):
    """A request body that cannot be taken: ``status`` (400 or 413), an OpenAI error
    ``code`` (``agent/serving/errors.py``) and the message for the client."""

    def __init__(self, status: int, code: str, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.code = code


async def read_body(request: web.Request, limit: int, setting: str,
                    read_timeout_s: float = BODY_READ_TIMEOUT_S, total_timeout_s: float = BODY_TIMEOUT_S) -> bytes:
    """The whole body of ``request``, at most ``limit`` bytes.

    ``setting`` names the limit in the error (e.g. "api.max_body_bytes"). Raises
    BodyError 413 ``body_too_large`` when ``Content-Length`` or the bytes received exceed
    ``limit`` (nothing more is read), 400 ``invalid_body`` when the body cannot be
    decoded (bad chunked framing, a Content-Encoding that does not decode) or ends early,
    408 ``body_read_timeout`` when one read gets no byte for ``read_timeout_s`` (a client
    that stalls mid-body, or a chunked body that never ends and never sends), or when the
    whole body has not arrived ``total_timeout_s`` after the first read (a client that
    dribbles a byte per read deadline).
    """
    length = request.content_length
    if length is not None and length > limit:
        raise BodyError(413, ErrorCode.BODY_TOO_LARGE,
                        f"request body is {length} bytes; the limit is {limit} ({setting})")
    content = request.content
    deadline = asyncio.get_running_loop().time() + total_timeout_s
    whole = False  # which deadline fired
    try:
        async with asyncio.timeout(read_timeout_s):
            first = await content.read(limit + 1)
        if content.at_eof() or len(first) > limit:
            body = first
        else:
            parts = bytearray(first)
            while len(parts) <= limit:
                whole = asyncio.get_running_loop().time() + read_timeout_s > deadline
                async with asyncio.timeout_at(min(deadline, asyncio.get_running_loop().time() + read_timeout_s)):
                    chunk = await content.read(limit + 1 - len(parts))
                if not chunk:
                    break
                parts += chunk
            body = bytes(parts)
    except web.RequestPayloadError as exc:
        raise BodyError(400, ErrorCode.INVALID_BODY, f"request body cannot be read: {_first_line(exc)}") from None
    except ConnectionError:
        raise BodyError(400, ErrorCode.INVALID_BODY, "request body ended early: the connection closed") from None
    except TimeoutError:
        if whole:
            raise BodyError(408, ErrorCode.BODY_READ_TIMEOUT, f"the request body did not arrive in full within "
                            f"{total_timeout_s:g} s (api.body_timeout_s)") from None
        raise BodyError(408, ErrorCode.BODY_READ_TIMEOUT, f"no byte of the request body arrived for "
                        f"{read_timeout_s:g} s (api.body_read_timeout_s)") from None
    if len(body) > limit:
        raise BodyError(413, ErrorCode.BODY_TOO_LARGE, f"request body exceeds {limit} bytes ({setting})")
    return body


def json_depth(data: bytes) -> int:
    """How deep the arrays and objects of ``data`` nest: 0 for a scalar, 1 for ``[]``.

    Exact for valid JSON; for anything else an estimate (the parser then refuses it).
    Linear in ``len(data)`` with no per-byte Python loop and no recursion: strings are cut
    out by a regex, the remaining brackets summed by ``itertools.accumulate``.
    """
    brackets = _STRING.sub(b"", data).translate(None, _NOT_BRACKETS)
    return max(accumulate(map(_STEP.__getitem__, brackets), initial=0))


def parse_json(data: bytes, max_depth: int = MAX_JSON_DEPTH) -> Any:
    """``data`` as JSON: UTF-8 (no other encoding, no BOM), nested at most ``max_depth``.

    Raises BodyError 400 ``json_too_deep`` (naming the limit) or ``invalid_json`` (with
    the parser's reason). Never raises anything else, for any bytes.
    """
    # Depth is at most the number of "[" and "{": most bodies skip the scan (two counts).
    if data.count(b"[") + data.count(b"{") > max_depth and json_depth(data) > max_depth:
        raise BodyError(400, ErrorCode.JSON_TOO_DEEP,
                        f"request body nests arrays/objects deeper than {max_depth} levels (the limit)")
    try:
        return json.loads(data.decode("utf-8"))
    except UnicodeDecodeError as exc:
        raise BodyError(400, ErrorCode.INVALID_JSON,
                        f"request body is not valid JSON: not UTF-8 at byte {exc.start}") from None
    except RecursionError:  # unreachable within max_depth; kept so no input can escape
        raise BodyError(400, ErrorCode.JSON_TOO_DEEP,
                        f"request body nests arrays/objects deeper than {max_depth} levels (the limit)") from None
    except ValueError as exc:
        raise BodyError(400, ErrorCode.INVALID_JSON, f"request body is not valid JSON: {exc}") from None


def parse_json_object(data: bytes, max_depth: int = MAX_JSON_DEPTH) -> dict[str, Any]:
    """:func:`parse_json`, and the value must be an object (400 ``invalid_json`` otherwise)."""
    value = parse_json(data, max_depth)
    if not isinstance(value, dict):
        raise BodyError(400, ErrorCode.INVALID_JSON,
                        f"request body must be a JSON object, got {type(value).__name__}")
    return value


def _first_line(exc: Exception) -> str:
    text = str(exc).strip().splitlines()
    return " ".join(line.strip() for line in text[:2])[:200] if text else type(exc).__name__


#: The parameters that bound what a request may generate: integers >= 1 when given (OpenAI's rule;
#: ``max_output_tokens`` is the Responses API's ``max_tokens``).
COUNT_PARAMS = ("max_tokens", "max_completion_tokens", "max_output_tokens", "n")


def count_param_error(payload: dict[str, Any]) -> tuple[str, str, str] | None:
    """``(param, code, message)`` for the first of :data:`COUNT_PARAMS` given (not null) that
    is not an integer >= 1 (``code``: ``invalid_type`` or ``integer_below_min_value``,
    OpenAI's); None when all are absent, null or valid."""
    for name in COUNT_PARAMS:
        value = payload.get(name)
        if value is None:
            continue
        if not isinstance(value, int) or isinstance(value, bool):
            return name, ErrorCode.INVALID_TYPE, (f"Invalid type for '{name}': expected an integer, but got "
                                                 f"{_json_type(value)} instead.")
        if value < 1:
            return name, ErrorCode.INTEGER_BELOW_MIN_VALUE, (f"Invalid '{name}': integer below minimum value. "
                                                             f"Expected a value >= 1, but got {value} instead.")
    return None


def _json_type(value: Any) -> str:
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, float):
        return "a decimal"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, list):
        return "an array"
    return "an object"
