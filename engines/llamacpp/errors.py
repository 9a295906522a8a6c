"""Which of llama-server's error answers are the client's fault (``Engine.client_fault``).

llama-server answers errors as ``{"error": {"code": <status>, "message": ..., "type": ...}}``.
The rules below come from its real answers, captured verbatim in
``tests/engines/llamacpp/captures/`` (``*-error_*.txt``, made by ``capture_errors.sh``;
``captures/README.md`` says with which build):

- ``type`` "exceed_context_size_error" (400: "request (2731 tokens) exceeds the available
  context size (256 tokens), try increasing it", chat, completions, streamed or not):
  "context_length_exceeded".
- "input (N tokens) is too large to process. increase the physical batch size" (500: an
  embeddings input longer than the batch, which embeddings cannot split):
  "context_length_exceeded".
- "image input is not supported", "audio input is not supported", "video input is not
  supported" (500, streamed or not: the model has no ``--mmproj``) and "unsupported
  content[].type" (400: a part type llama-server does not know): "unsupported_content".
- "Failed to parse messages: ..." (500: a message llama-server's chat parser cannot read: a
  text part without ``text`` or with a number for it, ``tool_calls`` not a list of calls),
  "Failed to parse tools: ..." (500: ``tools`` not a list of tool objects) and "Unknown
  reasoning format: ..." (500 on chat: an unknown ``reasoning_format``; /v1/completions
  answers it 400 "Field 'reasoning_format': ..."): "invalid_request". The engine's own text
  after the prefix is a JSON library's message about the client's JSON.
- "vector::_M_range_check: __n (which is N) >= this->size() (which is V)" (500 on
  ``/detokenize``: a token id outside the vocabulary, a negative one read as 2**64 - 1; the
  message of libstdc++'s ``std::out_of_range``, answered verbatim in tests/unit/test_endpoints.py):
  "invalid_request". It counted as the backend's failure, and a client's five of them ejected
  a healthy backend (docs/routing.md, "Outlier ejection").

Anything else is None (not the client's fault, or not known to be): the pooling refusal of
an embedding server ("Pooling type 'none' is not OAI compatible") is the operator's
configuration, and a 500 that says nothing more is the engine's.
"""

from __future__ import annotations

import json
import re

__all__ = ["MAX_ERROR_BODY_BYTES", "client_fault"]

MAX_ERROR_BODY_BYTES = 64 * 1024
"""Longer bodies are not classified: llama-server's error bodies are a few hundred bytes."""

_CONTEXT_TYPES = frozenset({"exceed_context_size_error"})
# Anchored at the message's start: a message that merely quotes one of these (an echo of
# the prompt) does not match.
_MESSAGE_RULES: tuple[tuple[re.Pattern[str], str], ...] = (
    (re.compile(r"input \(\d+ tokens\) is too large to process\b"), "context_length_exceeded"),
    (re.compile(r"(image|audio|video) input is not supported\b"), "unsupported_content"),
    (re.compile(r"unsupported content\[\]\.type\b"), "unsupported_content"),
    (re.compile(r"Failed to parse (messages|tools): "), "invalid_request"),
    (re.compile(r"Unknown reasoning format: "), "invalid_request"),
    (re.compile(r"vector::_M_range_check: "), "invalid_request"),
)


def client_fault(status: int, body: bytes) -> str | None:
    """The OpenAI code for a llama-server error answer that is the client's fault, else None.

    ``status``: the HTTP status (anything below 400 is None); ``body``: the raw body. Never
    raises: a body over ``MAX_ERROR_BODY_BYTES``, not JSON, nested too deep to parse, or of
    another shape is None.
    """
    if status < 400 or len(body) > MAX_ERROR_BODY_BYTES:
        return None
    try:
        data = json.loads(body)
    except (ValueError, RecursionError):  # UnicodeDecodeError is a ValueError
        return None
    error = data.get("error") if isinstance(data, dict) else None
    if not isinstance(error, dict):
        return None
    kind, message = error.get("type"), error.get("message")
    if isinstance(kind, str) and kind in _CONTEXT_TYPES:
        return "context_length_exceeded"
    if isinstance(message, str):
        for pattern, code in _MESSAGE_RULES:
            if pattern.match(message):
                return code
    return None
