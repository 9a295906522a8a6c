"""A request's token counts from its engine's answer, and a stream's end held back (docs/usage.md).

Issue 17 (items 6 and 8): the serving node records each finished request's real token counts,
and the limiter debits them instead of the estimate. A whole answer carries ``usage``; a
stream carries it only when the request asks (``stream_options.include_usage``: OpenAI's
rule, which llama.cpp, vLLM and SGLang follow). So the agent asks for it on every stream
(:func:`ask_stream_usage`, under the one body-change rule of docs/engines.md, "When the
client goes away": only ``stream`` and ``stream_options`` change) and, when the client did
not ask, removes the usage from what the client gets (:class:`StreamTail`): the client gets
exactly the form it asked for.

Where the counts come from (captures in tests/engines/*/captures): ``usage.prompt_tokens``,
``usage.completion_tokens``; cached prompt tokens from ``usage.prompt_tokens_details.
cached_tokens`` (OpenAI, llama.cpp; vLLM with ``--enable-prompt-tokens-details``, SGLang with
``--enable-cache-report``), else llama.cpp's ``timings.cache_n``.

Anthropic's Messages API and OpenAI's Responses API name them ``input_tokens`` and
``output_tokens`` (read as prompt and completion tokens): a Messages answer's ``usage`` counts
cached tokens apart (``input_tokens`` excludes ``cache_read_input_tokens`` and
``cache_creation_input_tokens``: the prompt is their sum, the cached part the first), a
Responses answer within (``input_tokens_details.cached_tokens``). In their streams the usage
sits in ``message_start``'s ``message`` and ``message_delta`` (Anthropic: input, then output),
and in ``response.completed``'s ``response``: the counts of successive events are merged.
``message_start``'s ``output_tokens`` is a placeholder (0 or 1, before any token was made) and
is not read: only ``message_delta`` gives the output count, so a Messages stream cut before it
is charged the events relayed, as a chat stream cut before its usage event (docs/usage.md,
"Estimated counts").
The agent never asks these streams for usage (they carry it unasked).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from aiohttp import web

#: A whole answer larger than this is not searched for its usage (its counts stay unknown).
MAX_USAGE_BODY_BYTES = 1 << 20


@dataclass(frozen=True, slots=True)
class Usage:
    """An engine's token counts for one request; None where it did not say (never 0 for unknown)."""

    prompt_tokens: int | None
    completion_tokens: int | None
    cached_tokens: int | None

    @property
    def total_tokens(self) -> int | None:
        """Prompt plus completion tokens (None when neither is known)."""
        if self.prompt_tokens is None and self.completion_tokens is None:
            return None
        return (self.prompt_tokens or 0) + (self.completion_tokens or 0)


#: The engine's usage of a response, when the agent read it (a stream's usage event, a whole or
#: assembled answer's ``usage``): the ledger's row and the limiter's debit (agent/auth/gate.py).
USAGE = web.ResponseKey("viiwork_usage", Usage)


def _count(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else None


def usage_of(answer: Any) -> Usage | None:
    """The :class:`Usage` of a parsed answer or stream event (a dict with a ``usage`` object,
    or Anthropic's ``message`` / Responses' ``response`` holding one), None when it has none.
    ``message_start``'s ``output_tokens`` is not a count (module doc): its completion is None.
    Never raises."""
    if not isinstance(answer, dict):
        return None
    if answer.get("type") == "message_start":
        message = answer.get("message")
        start = message.get("usage") if isinstance(message, dict) else None
        if not isinstance(start, dict):
            return None
        counts = _input_output_usage(start)
        return Usage(counts.prompt_tokens, None, counts.cached_tokens)
    usage = answer.get("usage")
    if not isinstance(usage, dict):
        inner = answer.get("response")
        usage = inner.get("usage") if isinstance(inner, dict) else None
        if not isinstance(usage, dict):
            return None
    if "input_tokens" in usage or "output_tokens" in usage:
        return _input_output_usage(usage)
    details = usage.get("prompt_tokens_details")
    cached = _count(details.get("cached_tokens")) if isinstance(details, dict) else None
    if cached is None:
        timings = answer.get("timings")  # llama.cpp: prompt tokens taken from its cache
        cached = _count(timings.get("cache_n")) if isinstance(timings, dict) else None
    return Usage(_count(usage.get("prompt_tokens")), _count(usage.get("completion_tokens")), cached)


def _input_output_usage(usage: dict[str, Any]) -> Usage:
    """Anthropic's or Responses' ``usage`` (module doc)."""
    prompt = _count(usage.get("input_tokens"))
    cached = None
    details = usage.get("input_tokens_details")
    if isinstance(details, dict):  # Responses: cached tokens are part of input_tokens
        cached = _count(details.get("cached_tokens"))
    elif prompt is not None:  # Anthropic: cache reads and writes are counted apart
        cached = _count(usage.get("cache_read_input_tokens"))
        prompt += (cached or 0) + (_count(usage.get("cache_creation_input_tokens")) or 0)
    return Usage(prompt, _count(usage.get("output_tokens")), cached)


def merged(old: Usage | None, new: Usage) -> Usage:
    """``new``'s counts, ``old``'s where ``new`` does not say (Anthropic's stream gives input
    and output tokens in two events)."""
    if old is None:
        return new
    return Usage(new.prompt_tokens if new.prompt_tokens is not None else old.prompt_tokens,
                 new.completion_tokens if new.completion_tokens is not None else old.completion_tokens,
                 new.cached_tokens if new.cached_tokens is not None else old.cached_tokens)


def usage_in_body(body: bytes) -> Usage | None:
    """The :class:`Usage` of a whole JSON answer (at most MAX_USAGE_BODY_BYTES), None when it
    has none or is not a JSON object."""
    if len(body) > MAX_USAGE_BODY_BYTES or b'"usage"' not in body:
        return None
    try:
        return usage_of(json.loads(body))
    except (ValueError, RecursionError):
        return None


def ask_stream_usage(payload: dict[str, Any]) -> bytes | None:
    """The body of a streamed request whose client did not ask for usage, asking for it:
    ``payload`` with ``stream_options.include_usage`` set true (the client's other
    ``stream_options`` kept), re-serialised as :func:`viiwork.agent.serving.assemble.stream_body`
    does. None when the client asked already, or its ``stream_options`` is not an object (the
    engine answers that as it would: the body is left as is)."""
    options = payload.get("stream_options")
    if options is None:
        options = {}
    if not isinstance(options, dict) or options.get("include_usage") is True:
        return None
    changed = {**payload, "stream_options": {**options, "include_usage": True}}
    return body_bytes(changed)


def body_bytes(payload: dict[str, Any]) -> bytes:
    """``payload`` as a compact JSON body, UTF-8. A string holding a lone UTF-16 surrogate (valid
    JSON as ``\\ud800``, not encodable as UTF-8) is sent escaped, as the client wrote it: the
    engine answers it as it would the client's own body (it was a 500 of the agent)."""
    try:
        return json.dumps(payload, ensure_ascii=False, separators=(",", ":")).encode()
    except UnicodeEncodeError:
        return json.dumps(payload, separators=(",", ":")).encode()


_DONE_LINES = (b"data: [DONE]", b"data:[DONE]")
_USAGE_MARKS = (b'"usage":{', b'"usage": {')


class StreamTail:
    """Reads a stream as it is relayed: finds the engine's usage event, removes it when the
    client did not ask for it (``strip``), and holds back the terminal ``data: [DONE]``
    (``hold``) until the caller has recorded the request (docs/usage.md, "The durability rule").

    ``feed(chunk)`` returns the bytes to write to the client now; ``rest()`` what was held back
    (the ``[DONE]`` event and anything after it, an unfinished last line), to write once the
    row is committed. Cheap on the hot path: a chunk is searched for ``[DONE]`` and a non-null
    ``"usage":{`` (text in a JSON string cannot hold it: its quotes are escaped) and only a
    chunk that holds one is cut into lines; the incomplete last line of a chunk waits for its
    end (engines write whole events, so it is nearly always empty), at most MAX_LINE_BYTES.
    ``usage``: the engine's counts, None until an event gave the completion tokens (Anthropic's
    ``message_start`` gives only the input: it waits in ``_started`` for ``message_delta``).
    ``events``: the ``data:``
    events passed on (not ``[DONE]``, not a usage event of its own), what :meth:`delivered`
    counts when the engine's usage never came. Never raises.
    """

    MAX_LINE_BYTES = 64 * 1024

    __slots__ = ("_held", "_partial", "_skip_blank", "_started", "events", "hold", "strip", "usage")

    def __init__(self, *, strip: bool, hold: bool) -> None:
        self.strip = strip
        self.hold = hold
        self.usage: Usage | None = None
        self._started: Usage | None = None  # counts without the completion's yet
        self.events = 0
        self._partial = b""
        self._held: list[bytes] | None = None  # from the [DONE] line on, when holding
        self._skip_blank = False  # the usage event was removed: drop the blank line that ended it

    def feed(self, chunk: bytes) -> bytes:
        if self._held is not None:
            self._held.append(chunk)
            return b""
        data = self._partial + chunk if self._partial else chunk
        end = data.rfind(b"\n") + 1
        if end == 0:
            if len(data) > self.MAX_LINE_BYTES:  # no event line is this long: pass it on
                self._partial = b""
                return data
            self._partial = data
            return b""
        complete, self._partial = (data, b"") if end == len(data) else (data[:end], data[end:])
        overflow = b""
        if len(self._partial) > self.MAX_LINE_BYTES:  # no event line is this long: pass it on
            overflow, self._partial = self._partial, b""
        if (b"[DONE]" not in complete and _USAGE_MARKS[0] not in complete and _USAGE_MARKS[1] not in complete
                and not self._skip_blank):
            # ``complete`` starts a line, and a JSON string holds no raw newline: one per event.
            self.events += complete.count(b"\ndata:") + complete.startswith(b"data:")
            return complete + overflow if overflow else complete
        out = self._lines(complete)
        if overflow:
            if self._held is not None:
                self._held.append(overflow)
            else:
                out += overflow
        return out

    def _lines(self, complete: bytes) -> bytes:
        out: list[bytes] = []
        lines = complete.split(b"\n")
        last = len(lines) - 1  # complete ends with "\n": the last item is the empty rest
        for i, line in enumerate(lines[:last]):
            raw = line + b"\n"
            if self._held is not None:
                self._held.append(raw)
                continue
            text = line.rstrip(b"\r")
            if self._skip_blank:
                self._skip_blank = False
                if not text:
                    continue
            if text in _DONE_LINES:
                if self.hold:
                    self._held = [raw, *(x + b"\n" for x in lines[i + 1:last])]
                    break
                out.append(raw)
                continue
            if text.startswith(b"data:"):
                self.events += 1
                if _USAGE_MARKS[0] in text or _USAGE_MARKS[1] in text:
                    raw = self._usage_line(text, raw)
            out.append(raw)
        return b"".join(out)

    def _usage_line(self, text: bytes, raw: bytes) -> bytes:
        """A ``data:`` line with a usage object: its counts read; the line as the client gets it."""
        try:
            event = json.loads(text[5:])
        except (ValueError, RecursionError):
            return raw
        usage = usage_of(event)
        if usage is None:
            return raw
        counts = merged(self.usage or self._started, usage)
        if counts.completion_tokens is None:
            self._started = counts
        else:
            self.usage = counts
        alone = event.get("choices") == []  # the usage event itself (OpenAI, vLLM, SGLang, llama.cpp)
        if alone:
            self.events -= 1  # no content of its own
        if not self.strip:
            return raw
        if alone:
            self._skip_blank = True
            return b""
        del event["usage"]  # usage on a content event (older engines): the event without it
        return b"data: " + json.dumps(event, ensure_ascii=False, separators=(",", ":")).encode() + b"\n"

    def delivered(self) -> Usage | None:
        """What this stream used: the engine's :attr:`usage` when it came; else, when events
        were passed on, ``completion_tokens`` = :attr:`events` (an estimate: about one token per
        event for llama.cpp, vLLM and SGLang, tests/engines/*/captures; the role and finish
        events count too) and ``prompt_tokens`` None (the engine did not say); else None."""
        if self.usage is not None:
            return self.usage
        return Usage(None, self.events, None) if self.events else None

    def rest(self) -> bytes:
        """What is held back: the ``[DONE]`` event and what followed it, and an unfinished line."""
        held = b"".join(self._held) if self._held is not None else b""
        self._held = None
        rest, self._partial = held + self._partial, b""
        return rest


#: The stream relayed for a request (set by the relay, agent/serving/proxy.py): what a stream
#: without the engine's usage is charged by its key's limits (agent/auth/gate.py), also when
#: the handler was cancelled and left no response.
RELAYED_STREAM = web.RequestKey("viiwork_relayed_stream", StreamTail)
