"""The non-streamed answer assembled from an engine's stream (agent/serving/assemble.py).

Against real captures (tests/engines/llamacpp/captures, tests/engines/vllm/captures):
llama-server's streamed and non-streamed chat answers, vLLM's. Tool calls, logprobs and the
error shapes have no capture: their events are written after OpenAI's stream format.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from viiwork.agent.serving.assemble import (
    ASSEMBLED_PATHS,
    ErrorEventWatch,
    StreamBroken,
    StreamError,
    assemble,
    parse_events,
    sse_data,
    stream_body,
    stream_lines,
)
from viiwork.agent.serving.errors import engine_failed
from viiwork.agent.serving.tokens import ask_stream_usage
from viiwork.engines.contract import stops_nonstream_on_disconnect
from viiwork.engines.llamacpp import LlamaCppEngine
from viiwork.engines.sglang import SglangEngine
from viiwork.engines.vllm import VllmEngine

ENGINES = Path(__file__).resolve().parents[1] / "engines"


def capture(name: str) -> bytes:
    raw = (ENGINES / name).read_bytes()
    head, sep, body = raw.partition(b"\r\n\r\n")
    return body if sep else raw.partition(b"\n\n")[2]


def from_stream(raw: bytes, obj: str = "chat.completion") -> dict[str, Any]:
    return assemble(parse_events(sse_data(raw.splitlines())), obj)


def shape(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: shape(v) for k, v in value.items()}
    if isinstance(value, list):
        return [shape(value[0])] if value else []
    return type(value).__name__


def events(*chunks: dict[str, Any]) -> bytes:
    return b"".join(b"data: " + json.dumps(c).encode() + b"\n\n" for c in chunks) + b"data: [DONE]\n\n"


def test_llamacpp_chat_stream_assembles_to_the_nonstreamed_shape() -> None:
    stream = capture("llamacpp/captures/7e4c0a9-smollm2-chat_stream.txt")
    native = json.loads(capture("llamacpp/captures/7e4c0a9-smollm2-chat_nonstream.txt"))
    answer = from_stream(stream)
    assert shape(answer) == shape(native)
    deltas = [json.loads(d) for d in sse_data(stream.splitlines()) if d != "[DONE]"]
    text = "".join(c["delta"].get("content") or "" for d in deltas for c in d["choices"])
    assert answer["choices"][0]["message"] == {"role": "assistant", "content": text}
    assert answer["choices"][0]["finish_reason"] == "stop"
    assert answer["usage"] == deltas[-1]["usage"] and answer["timings"] == deltas[-1]["timings"]
    assert answer["object"] == "chat.completion" and answer["id"] == deltas[0]["id"]


# vLLM cancels a non-streamed request on disconnect (with_cancellation): it never takes the
# assembled path. Its non-streamed answer carries keys no stream event has; an assembled
# vLLM answer would lack exactly these (docs/engines.md, "When the client goes away").
VLLM_NONSTREAM_ONLY = {
    (): {"service_tier", "prompt_logprobs", "kv_transfer_params", "ec_transfer_params", "metrics"},
    ("choice",): {"routed_experts"},
    ("message",): {"refusal", "annotations", "audio", "function_call", "reasoning"},
    ("usage",): {"prompt_tokens_details", "completion_tokens_details"},
}


def test_vllm_chat_stream_lacks_only_the_documented_keys() -> None:
    assert VllmEngine.nonstream_stops_on_disconnect is True
    answer = from_stream(capture("vllm/captures/vllm-0.32.0-cpu-chat_stream.txt"))
    native = json.loads(capture("vllm/captures/vllm-0.32.0-cpu-chat_nonstream.txt"))
    pairs = {(): (answer, native), ("choice",): (answer["choices"][0], native["choices"][0]),
             ("message",): (answer["choices"][0]["message"], native["choices"][0]["message"]),
             ("usage",): (answer["usage"], native["usage"])}
    for where, (got, want) in pairs.items():
        assert set(got) <= set(want), where
        assert set(want) - set(got) == VLLM_NONSTREAM_ONLY[where], where
    assert answer["choices"][0]["message"]["content"].startswith("Dear, K")
    assert answer["choices"][0]["finish_reason"] == "stop"
    assert answer["usage"] == {"prompt_tokens": 36, "total_tokens": 61, "completion_tokens": 25}


def test_tool_calls_merge_by_index_and_logprobs_concatenate() -> None:
    base = {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 1, "model": "m"}

    def chunk(delta: dict, finish: str | None = None, logprobs: dict | None = None) -> dict:
        choice: dict = {"index": 0, "delta": delta, "finish_reason": finish, "logprobs": logprobs}
        return {**base, "choices": [choice]}

    lp = [{"token": "a", "logprob": -0.1, "bytes": [97], "top_logprobs": []}]
    raw = events(
        chunk({"role": "assistant", "content": None}),
        chunk({"tool_calls": [{"index": 0, "id": "call_a", "type": "function",
                               "function": {"name": "get_weather", "arguments": ""}}]}, logprobs={"content": lp}),
        chunk({"tool_calls": [{"index": 1, "id": "call_b", "type": "function",
                               "function": {"name": "get_time", "arguments": "{\"tz\""}}]}),
        chunk({"tool_calls": [{"index": 0, "function": {"arguments": "{\"city\": "}}]}, logprobs={"content": lp}),
        chunk({"tool_calls": [{"index": 0, "function": {"arguments": "\"Oslo\"}"}}]}),
        chunk({"tool_calls": [{"index": 1, "function": {"arguments": ": \"UTC\"}"}}]}),
        chunk({}, finish="tool_calls"),
        {**base, "choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": 9, "total_tokens": 14}},
    )
    answer = from_stream(raw)
    choice = answer["choices"][0]
    assert choice["message"] == {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_a", "type": "function", "function": {"name": "get_weather", "arguments": "{\"city\": \"Oslo\"}"}},
        {"id": "call_b", "type": "function", "function": {"name": "get_time", "arguments": "{\"tz\": \"UTC\"}"}},
    ]}
    assert choice["finish_reason"] == "tool_calls"
    assert choice["logprobs"] == {"content": lp + lp}
    assert answer["usage"]["total_tokens"] == 14 and answer["object"] == "chat.completion"


def test_completion_text_and_legacy_logprobs() -> None:
    base = {"id": "cmpl-1", "object": "text_completion", "created": 1, "model": "m"}

    def chunk(text: str, finish: str | None = None) -> dict:
        lp = {"tokens": [text], "token_logprobs": [-1.0], "top_logprobs": [{text: -1.0}], "text_offset": [0]}
        return {**base, "choices": [{"text": text, "index": 0, "logprobs": lp, "finish_reason": finish}]}

    answer = from_stream(events(chunk("The"), chunk(" sea"), chunk("", "length"),
                                {**base, "choices": [], "usage": {"completion_tokens": 2}}), "text_completion")
    choice = answer["choices"][0]
    assert choice["text"] == "The sea" and choice["finish_reason"] == "length"
    assert choice["logprobs"]["tokens"] == ["The", " sea", ""]
    assert answer["usage"] == {"completion_tokens": 2}


def test_choices_by_index() -> None:
    def chunk(index: int, text: str) -> dict:
        return {"object": "chat.completion.chunk", "choices": [{"index": index, "delta": {"content": text}}]}

    answer = from_stream(events(chunk(1, "b"), chunk(0, "a"), chunk(1, "B"), chunk(0, "A")))
    assert [c["message"]["content"] for c in answer["choices"]] == ["aA", "bB"]


@pytest.mark.parametrize("line, status", [
    (b'data: {"error":{"code":500,"message":"image input is not supported","type":"server_error"}}', 500),
    (b'error: {"code":400,"message":"the request exceeds the available context size","type":"x"}', 400),
    (b'data: {"object":"error","message":"bad","type":"BadRequestError","code":400}', 400),
    (b'data: {"error":{"message":"oops","code":"weird"}}', 500),
])
def test_error_event_raises_stream_error(line: bytes, status: int) -> None:
    first = b'data: {"choices":[{"index":0,"delta":{"content":"x"}}]}\n\n'
    with pytest.raises(StreamError) as info:
        parse_events(sse_data((first + line + b"\n\n").splitlines()))
    assert info.value.status == status
    doc = json.loads(info.value.body)
    assert "error" in doc or doc["object"] == "error"


def watched(chunks: list[bytes]) -> StreamError | None:
    watch = ErrorEventWatch()
    found = [e for c in chunks if (e := watch.feed(c)) is not None]
    assert len(found) <= 1 and (found[0] if found else None) is watch.error
    return watch.error


VLLM_STREAMS = ["vllm-0.32.0-cpu-chat_stream.txt", "vllm-0.32.0-cpu-chat_stream_usage.txt"]
ERROR_LINES = [
    (b'data: {"error":{"code":500,"message":"image input is not supported","type":"server_error"}}', 500),
    (b'error: {"code":400,"message":"the request exceeds the available context size","type":"x"}', 400),
    (b'data: {"object":"error","message":"bad","type":"BadRequestError","code":400}', 400),
    (b'data: {"error":{"message":"oops","code":"weird"}}', 500),
]


@pytest.mark.parametrize("line, status", ERROR_LINES)
def test_error_event_found_in_a_relayed_stream_however_it_is_cut(line: bytes, status: int) -> None:
    """The events parse_events raises for, found chunk by chunk (agent/serving/proxy.py relays
    them as they come), wherever the chunks are cut."""
    stream = capture("llamacpp/captures/7e4c0a9-smollm2-chat_stream.txt").split(b"data: [DONE]")[0]
    stream += line + b"\n\n"
    for cut in [*range(len(stream) - 300, len(stream)), 1]:
        error = watched([stream[:cut], stream[cut:]])
        assert error is not None and error.status == status, cut
        assert json.loads(error.body) == json.loads(sse_data([line])[0])
    error = watched([stream[i:i + 1] for i in range(len(stream) - 400, len(stream))])  # byte by byte
    assert error is not None and error.status == status


def test_no_error_event_in_ordinary_streams() -> None:
    stream = capture("llamacpp/captures/7e4c0a9-smollm2-chat_stream.txt")
    assert watched([stream]) is None and watched([stream[i:i + 7] for i in range(0, len(stream), 7)]) is None
    assert watched([capture("vllm/captures/" + name) for name in VLLM_STREAMS]) is None
    # The word in content (its quotes escaped), a logprobs token "error", an "error:" inside a line.
    quoted = events({"choices": [{"index": 0, "delta": {"content": '{"error": 1}\nerror: x'}}]},
                    {"choices": [{"index": 0, "logprobs": {"content": [{"token": "error"}]}}]})
    assert b'"error"' in quoted and watched([quoted]) is None


def test_a_line_too_long_for_an_error_event_is_skipped() -> None:
    long = b'data: {"choices":[{"delta":{"content":"' + b"x" * (ErrorEventWatch.MAX_LINE_BYTES * 2) + b'"}}]}\n\n'
    error = b'data: {"error":{"code":500,"message":"late"}}\n\n'
    step = 4096
    assert watched([(long + error)[i:i + step] for i in range(0, len(long) + len(error), step)]) is not None
    # The tail of the dropped line is not read as a line of its own.
    head = b'data: {"' + b"y" * ErrorEventWatch.MAX_LINE_BYTES
    assert watched([head, b'error: {"code": 500}\n']) is None
    assert watched([head[:100], head[100:], b"y" * 10, b'error: {"code": 500}\n']) is None
    assert watched([head[:100], b'error: {"code": 500}\n']) is None  # (not at a line's start)


@pytest.mark.parametrize("line, status", ERROR_LINES)
def test_only_an_error_that_is_not_the_clients_fault_is_a_failure(line: bytes, status: int) -> None:
    """The rule of engine_error (agent/serving/errors.py): a 4xx, or a 5xx the adapter
    classifies as the client's (llama-server's "image input is not supported"), is not."""
    error = watched([line + b"\n\n"])
    assert error is not None
    llamacpp = LlamaCppEngine()
    assert engine_failed(error.status, error.body, llamacpp) == (status >= 500 and b"image" not in line)
    assert engine_failed(error.status, error.body, None) == (status >= 500)


@pytest.mark.parametrize("raw", [
    b"",  # nothing at all
    b'data: {"choices":[]}\n\n',  # cut before [DONE]
    b"data: not json\n\ndata: [DONE]\n\n",
    b"data: [1, 2]\n\ndata: [DONE]\n\n",
    b"data: " + b"[" * 5000 + b"\n\ndata: [DONE]\n\n",
])
def test_broken_streams_raise_stream_broken(raw: bytes) -> None:
    with pytest.raises(StreamBroken):
        assemble(parse_events(sse_data(raw.splitlines())), "chat.completion")


def test_assemble_needs_an_event() -> None:
    with pytest.raises(StreamBroken):
        from_stream(b"data: [DONE]\n\n")


def test_sse_framing() -> None:
    raw = b": comment\r\ndata:{\"a\":\r\ndata: 1}\r\nid: 7\r\nevent: x\r\n\r\ndata: [DONE]"
    assert sse_data(raw.splitlines()) == ['{"a":\n1}', "[DONE]"]
    assert sse_data(stream_lines(raw)) == ['{"a":\n1}', "[DONE]"]


# Lines of SSE as engines and broken engines write them: fields, comments, blank lines, any
# line end, text with the breaks str.splitlines knows and bytes.splitlines does not.
SSE_LINE = st.one_of(
    st.builds(lambda v: b"data: " + v, st.binary(max_size=12)),
    st.sampled_from([b"", b": c", b"data:x", b"data:  two", b"event: e", b"error: {\"code\": 500}", b"data: [DONE]",
                     "data: \"\u2028\x85\x1c\"".encode(), b"\xff\xfe", b"data: \xe2\x80"]),
    st.binary(max_size=8))
SSE = st.lists(st.tuples(SSE_LINE, st.sampled_from([b"\n", b"\r\n", b"\r"])), max_size=10).map(
    lambda lines: b"".join(line + end for line, end in lines))


@settings(max_examples=400, deadline=None)
@given(SSE)
def test_stream_lines_read_a_body_as_its_bytes_lines(raw: bytes) -> None:
    """The whole-body reading (one decode) gives the events that line-by-line decoding gives."""
    assert sse_data(stream_lines(raw)) == sse_data(raw.splitlines())


EVENT_TEXT = st.one_of(st.builds(lambda doc, pad: pad[0] + json.dumps(doc) + pad[1],
                                 st.dictionaries(st.text(max_size=4), st.integers() | st.text(max_size=4), max_size=3),
                                 st.sampled_from([("", ""), (" ", ""), ("", " "), ("\t", "\n"), ("\ufeff", "")])),
                       st.sampled_from(["{}", '{"a": 1} {"b": 2}', '{"a": 1}x', "[1]", "1", "nul", '"s"', "{", ""]),
                       st.text(max_size=6))


def _old_parse(texts: list[str]) -> list[dict[str, Any]] | str:
    """parse_events as it read each event before: json.loads."""
    out = []
    for text in texts:
        if text.strip() == "[DONE]":
            return out
        try:
            event = json.loads(text)
        except (ValueError, RecursionError):
            return "broken"
        if not isinstance(event, dict):
            return "broken"
        out.append(event)
    return "broken"


@settings(max_examples=400, deadline=None)
@given(st.lists(EVENT_TEXT, max_size=5), st.booleans())
def test_parse_events_reads_each_event_as_json_loads_does(texts: list[str], done: bool) -> None:
    texts = [t for t in texts if "error" not in t] + (["[DONE]"] if done else [])
    try:
        got: list[dict[str, Any]] | str = parse_events(texts)
    except StreamBroken:
        got = "broken"
    assert got == _old_parse(texts)


JSON = st.recursive(st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False)
                    | st.text(), lambda inner: st.lists(inner, max_size=4)
                    | st.dictionaries(st.text(max_size=8), inner, max_size=4), max_leaves=20)


# Request keys of the OpenAI API as well as any text: each is drawn often enough to be seen.
KEYS = st.sampled_from(["model", "messages", "prompt", "user", "temperature", "seed", "max_tokens", "tools",
                        "logprobs", "n", "stop", "stream", "stream_options"]) | st.text(max_size=10)


@settings(max_examples=300, deadline=None)
@given(st.dictionaries(KEYS, JSON, max_size=8))
def test_stream_body_changes_only_stream_and_stream_options(payload: dict[str, Any]) -> None:
    out = json.loads(stream_body(json.dumps(payload).encode()))
    assert out.pop("stream") is True and out.pop("stream_options") == {"include_usage": True}
    assert out == {k: v for k, v in payload.items() if k not in ("stream", "stream_options")}


def test_embeddings_are_never_assembled() -> None:
    assert "/v1/embeddings" not in ASSEMBLED_PATHS  # no stream there


def test_stream_body_refuses_a_non_object() -> None:
    with pytest.raises(ValueError):
        stream_body(b"[1]")


def test_adapters_declare_whether_a_close_stops_a_nonstreamed_generation() -> None:
    assert stops_nonstream_on_disconnect(LlamaCppEngine()) is False  # tests/bench/bench_disconnect.py
    assert stops_nonstream_on_disconnect(SglangEngine()) is False
    assert stops_nonstream_on_disconnect(VllmEngine()) is True
    assert stops_nonstream_on_disconnect(None) is True
    assert stops_nonstream_on_disconnect(type("Odd", (), {"nonstream_stops_on_disconnect": "no"})()) is True


def test_a_lone_surrogate_is_sent_on_escaped_not_a_500() -> None:
    # Valid JSON, not encodable as UTF-8: the agent answered 500 (UnicodeEncodeError).
    raw = b'{"model":"m","messages":[{"role":"user","content":"a\\ud800b \xc3\xa9"}]}'
    out = stream_body(raw)
    assert json.loads(out)["messages"][0]["content"] == "a\ud800b \u00e9"
    asked = ask_stream_usage(json.loads(raw))
    assert asked is not None and json.loads(asked)["messages"][0]["content"] == "a\ud800b \u00e9"
