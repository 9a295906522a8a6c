"""A non-streamed answer assembled from the engine's stream (docs/engines.md, "When the client goes away").

Some engines keep generating a non-streamed answer after its client has gone (measured:
llama.cpp, SGLang). For those the agent asks for a stream, whose closed connection the
engine does notice, and builds the non-streamed answer from its events; the client gets
exactly the form it asked for.

The one rule for every body change the agent makes (issue 13, docs/engines.md): the agent
may change only ``stream`` and ``stream_options`` of a request body, nothing else, and it
returns to the client exactly the form the client asked for. :func:`stream_body` is that
change: the body is re-serialised with ``"stream": true`` and ``"stream_options":
{"include_usage": true}`` (JSON values are kept as parsed: a number like ``1e2`` is written
``100.0``, which every JSON reader takes as the same number).

The answer (:func:`assemble`), from the ``data:`` events of an OpenAI-style stream
(``/v1/chat/completions`` ``chat.completion.chunk`` events, ``/v1/completions``
``text_completion`` events):

- top-level keys: every key any event carried (``id``, ``created``, ``model``,
  ``system_fingerprint``, llama.cpp's ``timings``...), the last non-null value winning, a
  key only ever null kept as null; ``object`` is the non-streamed one (``chat.completion``,
  ``text_completion``); ``usage`` is the one of the usage event (``stream_options``);
- one choice per ``index``: chat ``delta`` events merge into ``message`` (strings such as
  ``content``, ``reasoning_content`` and ``refusal`` concatenated, ``role`` the last given,
  ``tool_calls`` merged by their ``index``: ``id`` and ``type`` the last given, ``function``
  ``name`` and ``arguments`` concatenated; the ``index`` itself dropped, as the non-streamed
  form has none); completion ``text`` concatenated; ``logprobs`` lists (``content``,
  ``refusal``; ``tokens``, ``token_logprobs``, ``top_logprobs``, ``text_offset``)
  concatenated; any other list (vLLM's ``token_ids``) concatenated; ``finish_reason`` and
  every other value the last non-null one.

An event ``{"error": ...}`` (or vLLM's older ``{"object": "error", ...}``) raises
:class:`StreamError` carrying the event, for the caller to answer as the engine's error.
Pure functions: no I/O, never raise on a shape they do not know (unknown keys follow the
rules above), only :class:`StreamError` / :class:`StreamBroken`.

The same error events in a stream relayed as is (not assembled) are found by
:class:`ErrorEventWatch`, chunk by chunk, without parsing the events that are not errors.
"""

from __future__ import annotations

import json
import json.scanner
from collections.abc import Iterable
from typing import Any, cast

from viiwork.agent.serving.tokens import body_bytes

# Path -> the ``object`` of its non-streamed answer. /v1/embeddings has no stream.
ASSEMBLED_PATHS: dict[str, str] = {
    "/v1/chat/completions": "chat.completion",
    "/v1/completions": "text_completion",
}

DONE = "[DONE]"

# json.loads's own scanner (``JSONDecoder.scan_once``, which ``raw_decode`` calls), reached once
# instead of through two wrappers per event (parse_events).
# (typeshed types make_scanner's argument as its own class: the decoder is what it reads.)
_scan_once = json.scanner.make_scanner(cast(Any, json.JSONDecoder()))


class StreamError(Exception):
    """The engine ended its stream with an error event: ``status`` (its ``code`` when an
    HTTP error status, else 500) and ``body`` (the event's JSON, bytes)."""

    def __init__(self, status: int, body: bytes) -> None:
        super().__init__(f"engine error event ({status})")
        self.status = status
        self.body = body


class StreamBroken(Exception):
    """The stream cannot be assembled: an event that is not a JSON object, no ``[DONE]``,
    or no event at all."""


def stream_body(body: bytes) -> bytes:
    """``body`` (a JSON object, already validated) asking for a stream with usage.

    The only change: ``stream`` set to true and ``stream_options`` to ``{"include_usage":
    true}`` (the client's own ``stream_options`` have no meaning for the non-streamed
    request it sent). Raises ValueError when ``body`` is not a JSON object.
    """
    payload = json.loads(body)
    if not isinstance(payload, dict):
        raise ValueError("request body is not a JSON object")
    payload["stream"] = True
    payload["stream_options"] = {"include_usage": True}
    return body_bytes(payload)


def stream_lines(body: bytes) -> list[str]:
    """``body`` (an SSE stream, UTF-8) decoded once and cut into lines as ``bytes.splitlines``
    cuts (at "\\n", "\\r\\n" and "\\r", never at the other breaks ``str.splitlines`` knows, which
    JSON strings may hold raw); line ends dropped. What :func:`sse_data` reads."""
    text = body.decode("utf-8", "replace")
    if "\r" in text:
        text = text.replace("\r\n", "\n").replace("\r", "\n")
    return text.split("\n")


def sse_data(lines: Iterable[bytes | str]) -> list[str]:
    """The ``data`` of each event of an SSE stream given line by line (line ends optional).

    The event-stream format (WHATWG HTML, "Server-sent events", 9.2.6): a field line
    ``data:`` with one optional space after the colon; several ``data`` lines of one event
    are joined by "\\n"; a blank line ends the event; lines starting with ":" are comments;
    other fields (``event``, ``id``, ``retry``) are ignored, except ``error``: llama-server
    builds whose ``server_sent_event(sink, "error", ...)`` writes a stream's error as an
    ``error: {...}`` line give an event ``{"error": {...}}``. An event still open when the
    lines end is kept (engines end with a blank line; a cut stream is judged by its last
    event).
    """
    events: list[str] = []
    data: list[str] | None = None
    for raw in lines:
        line = (raw.decode("utf-8", "replace") if isinstance(raw, bytes) else raw).rstrip("\r\n")
        if line.startswith("data: "):  # nearly every line engines write
            (data := data if data is not None else []).append(line[6:])
            continue
        if not line:
            if data is not None:
                events.append("\n".join(data))
            data = None
            continue
        if line.startswith(":"):
            continue
        name, _, value = line.partition(":")
        if value.startswith(" "):
            value = value[1:]
        if name == "error":  # llama-server's own error line: an event of its own
            events.append('{"error":' + value + "}")
        elif name == "data":
            (data := data if data is not None else []).append(value)
    if data is not None:
        events.append("\n".join(data))
    return events


def parse_events(data: Iterable[str]) -> list[dict[str, Any]]:
    """Each event's JSON object, up to ``[DONE]``; raises StreamError for an error event,
    StreamBroken for one that is not a JSON object and for a stream without ``[DONE]``
    (cut short: an answer must not pass for complete)."""
    out: list[dict[str, Any]] = []
    scan = _scan_once
    for text in data:
        if text.strip() == DONE:
            return out
        try:
            # json.loads without its wrapper (a third of its cost on these small events):
            # the same C scanner; any text it does not read whole (surrounding space, not
            # JSON) goes through json.loads, which reads it or raises as it always did.
            try:
                event, end = scan(text, 0)
            except StopIteration:
                end = -1
            if end != len(text):
                event = json.loads(text)
        except (ValueError, RecursionError):
            raise StreamBroken(f"stream event is not JSON: {text[:120]!r}") from None
        if not isinstance(event, dict):
            raise StreamBroken(f"stream event is not a JSON object: {text[:120]!r}")
        if "error" in event or event.get("object") == "error":  # error_event's test, inline: once per event
            raise StreamError(_error_status(event), json.dumps(event).encode())
        out.append(event)
    raise StreamBroken("the stream ended before [DONE]")


def error_event(event: dict[str, Any]) -> StreamError | None:
    """The :class:`StreamError` of an engine's error event (``{"error": ...}``, or vLLM's
    older ``{"object": "error", ...}``), None for any other event."""
    if "error" in event or event.get("object") == "error":
        return StreamError(_error_status(event), json.dumps(event).encode())
    return None


# Any error event's line holds one of these: the key "error" (or vLLM's value "error"), or
# llama-server's ``error:`` field at a line's start. Text inside a JSON string cannot hold
# the first (its quotes are escaped).
_ERROR_MARK = b'"error"'
_ERROR_FIELD = b"error:"
_ERROR_FIELD_LINE = b"\nerror:"


class ErrorEventWatch:
    """Finds the first error event (:func:`error_event`, :func:`sse_data`'s reading of the
    ``error:`` field) in a stream fed chunk by chunk as it is relayed.

    Cheap on the hot path: a chunk whose lines hold no ``"error"`` (nor an ``error:`` line)
    is only searched for those bytes; only a complete line that holds one is parsed. A line
    cut between chunks is kept until its end arrives (at most ``MAX_LINE_BYTES``: a longer
    line is not an error event and is skipped). One event per ``data:`` line, as engines
    write them (an event split over several ``data:`` lines is not seen). ``error``: the
    first error event found, None until then; once found, later chunks are not searched.
    """

    MAX_LINE_BYTES = 64 * 1024

    __slots__ = ("_partial", "_skip_line", "error")

    def __init__(self) -> None:
        self._partial = b""
        self._skip_line = False  # the next line's start was dropped (over MAX_LINE_BYTES)
        self.error: StreamError | None = None

    def feed(self, chunk: bytes) -> StreamError | None:
        """Read the next ``chunk`` of the stream; the error event found in it (also kept
        in ``error``), else None. Never raises."""
        if self.error is not None:
            return None
        skip = self._skip_line  # this chunk starts inside a line too long to be an error event
        data = self._partial + chunk if self._partial else chunk
        end = len(data) if data.endswith(b"\n") else data.rfind(b"\n") + 1
        if end == 0:  # no line ends in it: keep it for the next chunk
            if skip or len(data) > self.MAX_LINE_BYTES:
                self._partial, self._skip_line = b"", True
            else:
                self._partial = data
            return None
        self._partial, self._skip_line = data[end:], False
        if len(self._partial) > self.MAX_LINE_BYTES:
            self._partial, self._skip_line = b"", True
        if _ERROR_MARK not in data and not data.startswith(_ERROR_FIELD) and _ERROR_FIELD_LINE not in data:
            return None
        lines = data[:end].split(b"\n")
        if skip:
            lines = lines[1:]
        for line in lines:
            if _ERROR_MARK in line or line.startswith(_ERROR_FIELD):
                for text in sse_data([line]):
                    try:
                        event = json.loads(text)
                    except (ValueError, RecursionError):
                        continue
                    if isinstance(event, dict) and (found := error_event(event)) is not None:
                        self.error = found
                        return found
        return None


def assemble(events: Iterable[dict[str, Any]], obj: str) -> dict[str, Any]:
    """The non-streamed answer (``object`` = ``obj``) of a stream's parsed ``events``.

    Raises StreamBroken when there is no event at all.
    """
    top: dict[str, Any] = {}
    choices: dict[int, dict[str, Any]] = {}
    calls: dict[int, dict[int, dict[str, Any]]] = {}  # choice index -> tool-call index -> call
    seen = False
    for event in events:
        seen = True
        for key, value in event.items():
            if key == "choices":
                for choice in value if isinstance(value, list) else ():
                    if isinstance(choice, dict):
                        _merge_choice(choices, calls, choice)
            elif value is not None or key not in top:  # _latest, inline: once per key of every event
                top[key] = value
    if not seen:
        raise StreamBroken("the stream ended before any event")
    for index, by_call in calls.items():
        message = choices[index]["message"]
        if "tool_calls" in message:
            message["tool_calls"] = [by_call[i] for i in sorted(by_call)]
    answer = {"choices": [choices[i] for i in sorted(choices)], **top}
    answer["object"] = obj
    return answer


def _merge_choice(choices: dict[int, dict[str, Any]], calls: dict[int, dict[int, dict[str, Any]]],
                  choice: dict[str, Any]) -> None:
    index = choice.get("index", 0)
    index = index if isinstance(index, int) else 0
    into = choices.setdefault(index, {})
    for key, value in choice.items():
        if key == "delta":
            message = into.setdefault("message", {})
            if isinstance(value, dict):
                _merge_delta(message, calls.setdefault(index, {}), value)
        elif key == "text" or isinstance(value, (list, dict)):
            into[key] = _accumulate(into.get(key), value)
        elif value is not None or key not in into:  # _latest, inline
            into[key] = value


def _merge_delta(message: dict[str, Any], calls: dict[int, dict[str, Any]], delta: dict[str, Any]) -> None:
    for key, value in delta.items():
        if key == "role" or not isinstance(value, (str, list, dict)):
            if value is not None or key not in message:  # _latest, inline
                message[key] = value
        elif key == "tool_calls" and isinstance(value, list):
            message.setdefault("tool_calls", None)  # filled by assemble(), in index order
            _merge_tool_calls(calls, value)
        elif isinstance(value, str) and isinstance(acc := message.get(key), str):  # _accumulate's common case
            message[key] = acc + value
        else:
            message[key] = _accumulate(message.get(key), value)


def _merge_tool_calls(calls: dict[int, dict[str, Any]], deltas: list[Any]) -> None:
    """Tool-call deltas merged by their ``index`` (their position when it is missing)."""
    for position, delta in enumerate(deltas):
        if not isinstance(delta, dict):
            continue
        index = delta.get("index", position)
        call = calls.setdefault(index if isinstance(index, int) else position, {})
        for key, value in delta.items():
            if key == "index":
                continue
            if key == "function" and isinstance(value, dict):
                call[key] = _accumulate(call.get(key), value)
            else:
                _latest(call, key, value)


def _latest(into: dict[str, Any], key: str, value: Any) -> None:
    """Set ``key`` unless ``value`` is null and the key already has a value."""
    if value is not None or key not in into:
        into[key] = value


def _accumulate(acc: Any, new: Any) -> Any:
    """Strings and lists concatenated, objects merged key by key, null ignored."""
    if new is None:
        return acc
    if acc is None:
        return _copy(new)
    if isinstance(acc, str) and isinstance(new, str):
        return acc + new
    if isinstance(acc, list) and isinstance(new, list):
        return acc + _copy(new)
    if isinstance(acc, dict) and isinstance(new, dict):
        for key, value in new.items():
            acc[key] = _accumulate(acc.get(key), value)
        return acc
    return _copy(new)


def _copy(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _copy(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_copy(v) for v in value]
    return value


def _error_status(event: dict[str, Any]) -> int:
    inner = event.get("error")
    code = inner.get("code") if isinstance(inner, dict) else event.get("code")
    return code if isinstance(code, int) and not isinstance(code, bool) and 400 <= code <= 599 else 500
