"""StreamTail and the usage readers (agent/serving/tokens.py) on real engines' streams.

The captures (tests/engines/*/captures) are cut into chunks at every byte boundary class that
matters: whole events, single bytes, and arbitrary sizes; whatever the cut, the client's bytes
are the stream without its usage event (when stripped) and with ``[DONE]`` held back until
``rest()`` (when holding), and the counts read are the capture's.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from viiwork.agent.serving.tokens import StreamTail, Usage, ask_stream_usage, usage_in_body, usage_of

CAPTURES = Path(__file__).parent.parent / "engines"
LLAMA = CAPTURES / "llamacpp" / "captures" / "7e4c0a9-smollm2-chat_stream.txt"
VLLM = CAPTURES / "vllm" / "captures" / "vllm-0.32.0-cpu-chat_stream_usage.txt"


def body_of(capture: Path) -> bytes:
    raw = capture.read_bytes()
    return raw.split(b"\r\n\r\n", 1)[1] if b"\r\n\r\n" in raw else raw.split(b"\n\n", 1)[1]


def cuts(body: bytes) -> list[list[bytes]]:
    return [[body], [body[i:i + 1] for i in range(len(body))], [body[i:i + 97] for i in range(0, len(body), 97)],
            [e + b"\n\n" for e in body.split(b"\n\n") if e]]


@pytest.mark.parametrize(("capture", "usage"), [
    (LLAMA, Usage(36, 27, 24)),  # prompt_tokens_details.cached_tokens (and timings.cache_n)
    (VLLM, Usage(36, 12, None)),  # no prompt_tokens_details without --enable-prompt-tokens-details
])
@pytest.mark.parametrize("cut", range(4))
def test_usage_read_stripped_and_done_held(capture: Path, usage: Usage, cut: int) -> None:
    body = body_of(capture)
    chunks = cuts(body)[cut]
    tail = StreamTail(strip=True, hold=True)
    sent = b"".join(tail.feed(c) for c in chunks)
    assert tail.usage == usage
    assert b"[DONE]" not in sent and b'"usage"' not in sent
    rest = tail.rest()
    assert rest.startswith(b"data: [DONE]")
    # What the client gets: every event but the usage event, in order, then [DONE].
    events = [e for e in body.split(b"\n\n") if e.strip()]
    expected = [e for e in events if b'"usage"' not in e]
    assert [e for e in (sent + rest).split(b"\n\n") if e.strip()] == expected


@pytest.mark.parametrize("cut", range(4))
def test_a_client_that_asked_gets_the_stream_unchanged(cut: int) -> None:
    body = body_of(LLAMA)
    tail = StreamTail(strip=False, hold=False)
    out = b"".join(tail.feed(c) for c in cuts(body)[cut]) + tail.rest()
    assert out == body and tail.usage == Usage(36, 27, 24)


def test_usage_on_a_content_event_is_removed_from_that_event_only() -> None:
    event = {"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}], "usage": {"prompt_tokens": 3,
             "completion_tokens": 2}, "timings": {"cache_n": 1}}
    tail = StreamTail(strip=True, hold=True)
    sent = tail.feed(b"data: " + json.dumps(event).encode() + b"\n\ndata: [DONE]\n\n")
    assert json.loads(sent.split(b"\n")[0][6:]) == {k: v for k, v in event.items() if k != "usage"}
    assert tail.usage == Usage(3, 2, 1) and tail.rest() == b"data: [DONE]\n\n"


def test_usage_quoted_in_content_is_not_an_event() -> None:
    text = 'the "usage":{"prompt_tokens":1} and data: [DONE] inside content'
    line = b"data: " + json.dumps({"choices": [{"delta": {"content": text}}]}).encode() + b"\n\n"
    tail = StreamTail(strip=True, hold=True)
    assert tail.feed(line) == line and tail.usage is None and tail.rest() == b""


def test_readers() -> None:
    assert usage_of({"usage": {"prompt_tokens": 5, "completion_tokens": True}}) == Usage(5, None, None)
    assert usage_of({"usage": None}) is None and usage_of([]) is None
    assert usage_in_body(b'{"usage":{"prompt_tokens":2,"completion_tokens":3}}') == Usage(2, 3, None)
    assert Usage(2, 3, None).total_tokens == 5 and Usage(None, None, 1).total_tokens is None
    assert usage_in_body(b'{"usage": ') is None
    assert json.loads(ask_stream_usage({"model": "m", "stream_options": {"x": 1}}) or b"") == \
        {"model": "m", "stream_options": {"x": 1, "include_usage": True}}
    assert ask_stream_usage({"stream_options": {"include_usage": True}}) is None
    assert ask_stream_usage({"stream_options": "bad"}) is None
