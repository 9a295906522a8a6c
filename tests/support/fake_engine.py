"""A fake llama-server: a standalone aiohttp program that behaves like llama.cpp's server.

Run it as ``python fake_engine.py --model M --alias NAME --port P ...`` (or through the
wrapper script of ``support.engines.fake_engine_binary``). It takes the flags the llamacpp
adapter builds (``--model --alias --host --port --ctx-size --parallel --threads
--n-gpu-layers --device --embedding --metrics --api-key-file``) and ignores any others.
A ``--host`` ending in ``.sock`` binds that Unix socket instead of a TCP port (as llama-server).
With ``--api-key-file`` it refuses (401) every request without one of the file's keys as
``Authorization: Bearer``, except ``/health``, ``/models``, ``/v1/models`` (llama-server's
public routes) and ``/fake/stats``, which counts the refusals (``unauthorized``) and lists
the ``Authorization`` and ``x-api-key`` headers of the last 50 POSTs (``authorizations``,
``x_api_keys``), and their ``X-Request-Id``, ``traceparent`` and ``tracestate`` (``traces``: one
object per POST, a header absent is null).

What it mimics (shapes as captured from a real llama-server build):

- ``GET /health``: 503 ``{"error":{"message":"Loading model","type":"unavailable_error",
  "code":503}}`` for FAKE_LOAD_S seconds after start, then 200 ``{"status":"ok"}`` (also
  while busy).
- ``GET /slots``: one entry per slot: ``id``, ``n_ctx`` (= ctx-size / parallel),
  ``speculative``, ``is_processing``.
- ``GET /metrics``: Prometheus text with ``llamacpp:requests_processing``,
  ``llamacpp:requests_deferred`` and the token counters ``llamacpp:prompt_tokens_total``,
  ``prompt_seconds_total``, ``tokens_predicted_total``, ``tokens_predicted_seconds_total``
  (only with ``--metrics``; 501 otherwise, as llama-server). The seconds are not measured:
  each completion adds its tokens divided by FAKE_PREFILL_TPS / FAKE_DECODE_TPS, so the
  agent's speed reading is exact whatever the machine's speed.
- ``GET /v1/models``: the alias.
- ``POST /v1/chat/completions`` and ``/v1/completions``: non-stream JSON, or an SSE stream of
  a role chunk, FAKE_TOKENS content chunks FAKE_TOKEN_DELAY_S apart, a finish chunk, a usage
  chunk with empty ``choices`` (only when the request sets ``stream_options.include_usage``),
  then ``data: [DONE]``. ``model`` is the alias. ``max_tokens``
  caps the count (finish_reason "length"). With ``--embedding`` these answer 501.
- ``POST /v1/embeddings``: only with ``--embedding`` (501 otherwise).
- Slots: at most ``--parallel`` requests generate at once; more wait for a slot and are
  counted as deferred.
- After each streamed response the TCP connection is closed although the response said
  ``Connection: keep-alive`` (llama-server does this; pooled clients then hit a dead socket).
- A client that closes its connection mid-request (streamed or not) cancels the request and
  frees its slot at once (as llama-server does); ``GET /fake/stats`` (not llama-server's)
  counts those: ``{"cancelled": n, "in_flight": n, "busy": n, "requests": n}``.

Knobs (environment):
    FAKE_LOAD_S              seconds of "Loading model" (default 0.2)
    FAKE_TOKENS              content chunks per response (default 8)
    FAKE_TOKEN_DELAY_S       seconds between chunks (default 0.0)
    FAKE_PREFILL_TPS         prompt tokens/s the counters report (default 600)
    FAKE_DECODE_TPS          generated tokens/s the counters report (default 40)
    FAKE_EXIT_AFTER_S        exit on its own this many seconds after start (default: never)
    FAKE_EXIT_CODE           status for FAKE_EXIT_AFTER_S and FAKE_DIE_AFTER_CHUNKS (default 1)
    FAKE_START_FAIL          "1": print an error and exit 1 at once
    FAKE_CHECK_MODEL         "1": exit 1 when --model is not an existing file (like llama-server)
    FAKE_IGNORE_SIGTERM      "1": ignore SIGTERM always; "busy": only while a request is in
                             flight (llama-server hangs so); otherwise SIGTERM exits 0
    FAKE_HANG_AFTER_CHUNKS   streams go silent after this many content chunks
    FAKE_DIE_AFTER_CHUNKS    the process exits (FAKE_EXIT_CODE) after this many content chunks
    FAKE_CLOSE_AFTER_STREAM  "1" (default): close the connection after each streamed response
    FAKE_NONSTREAM_IGNORES_CLOSE  "1": a non-streamed generation runs to its end (slot busy)
                             after its client closed the connection (llama-server in some
                             runs, SGLang for up to 4 s: docs/engines.md)
    FAKE_ERROR_AFTER_CHUNKS  streams end with llama-server's error event (``data:
                             {"error": {"code": 500, ...}}``, no [DONE]) after this many
                             content chunks
    FAKE_SLOTS_FAIL_AFTER_S  /slots answers 500 from this many seconds after start (health
                             stays ok): the agent's load reading goes stale
    FAKE_HEALTH_FAIL_FILE    /health answers 503 ("health blip (FAKE_HEALTH_FAIL_FILE)") while
                             this path exists; completions are not affected (a /health blip)
    FAKE_COMPLETION_STATUS   every completion answers this status at once (e.g. 503, in
                             llama-server's error shape) while /health and /slots stay fine; or
                             the path of a file holding the status, read per request (missing,
                             empty or 0: answer normally), so a test can make it fail and recover
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import socket
import sys
import time
import uuid
from dataclasses import dataclass, field

from aiohttp import web

FINGERPRINT = "b1-fake"
WORDS = ("The", " quick", " brown", " fox", " jumps", " over", " the", " lazy", " dog", ".")


def _env_float(name: str, default: float | None) -> float | None:
    raw = os.environ.get(name, "")
    return float(raw) if raw.strip() else default


def _env_int(name: str, default: int | None) -> int | None:
    raw = os.environ.get(name, "")
    return int(raw) if raw.strip() else default


@dataclass
class Knobs:
    load_s: float
    tokens: int
    prefill_tps: float
    decode_tps: float
    token_delay_s: float
    exit_after_s: float | None
    exit_code: int
    start_fail: bool
    check_model: bool
    ignore_sigterm: str
    hang_after_chunks: int | None
    die_after_chunks: int | None
    close_after_stream: bool
    nonstream_ignores_close: bool = False
    error_after_chunks: int | None = None
    slots_fail_after_s: float | None = None
    health_fail_file: str = ""
    completion_status: str = ""

    def failing_status(self) -> int:
        """FAKE_COMPLETION_STATUS now (0: answer normally)."""
        value = self.completion_status
        if value.startswith("/"):
            try:
                with open(value) as f:
                    value = f.read()
            except OSError:
                return 0
        return int(value) if value.strip() else 0

    @classmethod
    def from_env(cls) -> Knobs:
        return cls(
            load_s=_env_float("FAKE_LOAD_S", 0.2) or 0.0,
            tokens=_env_int("FAKE_TOKENS", 8) or 0,
            prefill_tps=_env_float("FAKE_PREFILL_TPS", 600.0) or 600.0,
            decode_tps=_env_float("FAKE_DECODE_TPS", 40.0) or 40.0,
            token_delay_s=_env_float("FAKE_TOKEN_DELAY_S", 0.0) or 0.0,
            exit_after_s=_env_float("FAKE_EXIT_AFTER_S", None),
            exit_code=_env_int("FAKE_EXIT_CODE", 1) or 0,
            start_fail=os.environ.get("FAKE_START_FAIL", "") == "1",
            check_model=os.environ.get("FAKE_CHECK_MODEL", "") == "1",
            ignore_sigterm=os.environ.get("FAKE_IGNORE_SIGTERM", ""),
            hang_after_chunks=_env_int("FAKE_HANG_AFTER_CHUNKS", None),
            die_after_chunks=_env_int("FAKE_DIE_AFTER_CHUNKS", None),
            close_after_stream=os.environ.get("FAKE_CLOSE_AFTER_STREAM", "1") == "1",
            nonstream_ignores_close=os.environ.get("FAKE_NONSTREAM_IGNORES_CLOSE", "") == "1",
            error_after_chunks=_env_int("FAKE_ERROR_AFTER_CHUNKS", None),
            slots_fail_after_s=_env_float("FAKE_SLOTS_FAIL_AFTER_S", None),
            health_fail_file=os.environ.get("FAKE_HEALTH_FAIL_FILE", ""),
            completion_status=os.environ.get("FAKE_COMPLETION_STATUS", "").strip(),
        )


@dataclass
class Engine:
    alias: str
    parallel: int
    n_ctx_slot: int
    embedding: bool
    metrics: bool
    knobs: Knobs
    started: float = field(default_factory=time.monotonic)
    busy: list[bool] = field(default_factory=list)
    deferred: int = 0
    in_flight: int = 0
    slot_freed: asyncio.Condition | None = None
    requests_total: int = 0
    cancelled: int = 0
    # Token counters of /metrics: tokens, and seconds at the knobs' speeds.
    prompt_tokens: int = 0
    decode_tokens: int = 0

    def count_tokens(self, prompt: int, generated: int) -> None:
        self.prompt_tokens += prompt
        self.decode_tokens += generated
    api_keys: frozenset[str] = frozenset()
    refused_unauthorized: int = 0
    authorizations: list[str] = field(default_factory=list)
    x_api_keys: list[str] = field(default_factory=list)  # the x-api-key header of each POST ("" when absent)
    traces: list[dict[str, str | None]] = field(default_factory=list)  # each POST's trace context headers

    def loaded(self) -> bool:
        return time.monotonic() - self.started >= self.knobs.load_s

    async def acquire_slot(self) -> int:
        assert self.slot_freed is not None
        async with self.slot_freed:
            if all(self.busy):
                self.deferred += 1
                try:
                    await self.slot_freed.wait_for(lambda: not all(self.busy))
                finally:
                    self.deferred -= 1
            slot = self.busy.index(False)
            self.busy[slot] = True
            return slot

    async def release_slot(self, slot: int) -> None:
        assert self.slot_freed is not None
        async with self.slot_freed:
            self.busy[slot] = False
            self.slot_freed.notify()


ENGINE_KEY = web.AppKey("engine", Engine)


def _dumps(obj: object) -> str:
    return json.dumps(obj, separators=(",", ":"))


def _error(status: int, message: str, kind: str) -> web.Response:
    return web.json_response({"error": {"code": status, "message": message, "type": kind}}, status=status, dumps=_dumps)


def _headers() -> dict[str, str]:
    return {"Server": "llama.cpp", "Keep-Alive": "timeout=5, max=100"}


async def health(request: web.Request) -> web.Response:
    engine = request.app[ENGINE_KEY]
    if not engine.loaded():
        return web.json_response(
            {"error": {"message": "Loading model", "type": "unavailable_error", "code": 503}},
            status=503, headers=_headers(), dumps=_dumps,
        )
    if engine.knobs.health_fail_file and os.path.exists(engine.knobs.health_fail_file):
        return _error(503, "health blip (FAKE_HEALTH_FAIL_FILE)", "unavailable_error")
    return web.json_response({"status": "ok"}, headers=_headers(), dumps=_dumps)


async def slots(request: web.Request) -> web.Response:
    engine = request.app[ENGINE_KEY]
    if not engine.loaded():
        return _error(503, "Loading model", "unavailable_error")
    fail_after = engine.knobs.slots_fail_after_s
    if fail_after is not None and time.monotonic() - engine.started >= fail_after:
        return _error(500, "slots unavailable (FAKE_SLOTS_FAIL_AFTER_S)", "server_error")
    body = [
        {"id": i, "n_ctx": engine.n_ctx_slot, "speculative": False, "is_processing": busy}
        for i, busy in enumerate(engine.busy)
    ]
    return web.json_response(body, headers=_headers(), dumps=_dumps)


async def metrics(request: web.Request) -> web.Response:
    engine = request.app[ENGINE_KEY]
    if not engine.metrics:
        return _error(501, "This server does not support metrics endpoint. Start it with `--metrics`",
                      "not_supported_error")
    if not engine.loaded():
        return _error(503, "Loading model", "unavailable_error")
    lines = [
        "# HELP llamacpp:requests_processing Number of requests processing",
        "# TYPE llamacpp:requests_processing gauge",
        f"llamacpp:requests_processing {sum(engine.busy)}",
        "# HELP llamacpp:requests_deferred Number of requests deferred",
        "# TYPE llamacpp:requests_deferred gauge",
        f"llamacpp:requests_deferred {engine.deferred}",
        "# TYPE llamacpp:prompt_tokens_total counter",
        f"llamacpp:prompt_tokens_total {engine.prompt_tokens}",
        "# TYPE llamacpp:prompt_seconds_total counter",
        f"llamacpp:prompt_seconds_total {engine.prompt_tokens / engine.knobs.prefill_tps:.6f}",
        "# TYPE llamacpp:tokens_predicted_total counter",
        f"llamacpp:tokens_predicted_total {engine.decode_tokens}",
        "# TYPE llamacpp:tokens_predicted_seconds_total counter",
        f"llamacpp:tokens_predicted_seconds_total {engine.decode_tokens / engine.knobs.decode_tps:.6f}",
        "",
    ]
    return web.Response(text="\n".join(lines), content_type="text/plain", headers=_headers())


async def models(request: web.Request) -> web.Response:
    engine = request.app[ENGINE_KEY]
    if not engine.loaded():
        return _error(503, "Loading model", "unavailable_error")
    return web.json_response({
        "object": "list",
        "data": [{
            "id": engine.alias, "aliases": [engine.alias], "tags": [], "object": "model",
            "created": int(time.time()), "owned_by": "llamacpp",
            "meta": {"n_ctx": engine.n_ctx_slot * engine.parallel, "n_ctx_train": 8192},
        }],
    }, headers=_headers(), dumps=_dumps)


async def _read_json(request: web.Request) -> dict | web.Response:
    try:
        body = await request.json()
    except ValueError:
        return _error(400, "Invalid JSON body", "invalid_request_error")
    if not isinstance(body, dict):
        return _error(400, "Request body must be a JSON object", "invalid_request_error")
    return body


async def completions(request: web.Request) -> web.StreamResponse:
    engine = request.app[ENGINE_KEY]
    chat = request.path.endswith("/chat/completions")
    if engine.embedding:
        return _error(501, "This server does not support completions. Start it without `--embeddings`",
                      "not_supported_error")
    if not engine.loaded():
        return _error(503, "Loading model", "unavailable_error")
    failing = engine.knobs.failing_status()
    if failing:
        engine.requests_total += 1
        return _error(failing, "fake engine fails every completion (FAKE_COMPLETION_STATUS)", "server_error")
    body = await _read_json(request)
    if isinstance(body, web.Response):
        return body
    limit = body.get("max_tokens", body.get("n_predict"))
    n_tokens = engine.knobs.tokens
    finish = "stop"
    if isinstance(limit, int) and 0 <= limit < n_tokens:
        n_tokens, finish = limit, "length"
    prompt_tokens = max(1, len(json.dumps(body.get("messages", body.get("prompt", "")))) // 4)
    engine.in_flight += 1
    engine.requests_total += 1
    try:
        slot = await engine.acquire_slot()
        engine.count_tokens(prompt_tokens, n_tokens)
        try:
            if body.get("stream"):
                options = body.get("stream_options")
                usage = isinstance(options, dict) and options.get("include_usage") is True
                return await _stream(request, engine, chat, n_tokens, finish, prompt_tokens, usage)
            generation = asyncio.ensure_future(_generate(engine, n_tokens))
            try:
                await asyncio.shield(generation) if engine.knobs.nonstream_ignores_close else await generation
            except asyncio.CancelledError:
                if engine.knobs.nonstream_ignores_close:  # the slot stays busy until the end
                    await generation
                raise
            return web.json_response(_full_response(engine, chat, n_tokens, finish, prompt_tokens),
                                     headers=_headers(), dumps=_dumps)
        finally:
            await engine.release_slot(slot)
    except (asyncio.CancelledError, ConnectionResetError):  # the client closed its connection
        engine.cancelled += 1
        raise
    finally:
        engine.in_flight -= 1


async def _generate(engine: Engine, n_tokens: int) -> None:
    for _ in range(n_tokens):
        if engine.knobs.token_delay_s:
            await asyncio.sleep(engine.knobs.token_delay_s)


async def stats(request: web.Request) -> web.Response:
    engine = request.app[ENGINE_KEY]
    return web.json_response({"cancelled": engine.cancelled, "in_flight": engine.in_flight,
                              "busy": sum(engine.busy), "requests": engine.requests_total,
                              "unauthorized": engine.refused_unauthorized,
                              "authorizations": engine.authorizations[-50:],
                              "x_api_keys": engine.x_api_keys[-50:], "traces": engine.traces[-50:]})


# As llama-server: with --api-key-file every route but these needs "Authorization: Bearer <key>"
# (401 {"error": {"code": 401, "message": "Invalid API Key", "type": "authentication_error"}}).
PUBLIC_PATHS = frozenset({"/health", "/v1/health", "/models", "/v1/models", "/fake/stats"})


@web.middleware
async def require_key(request: web.Request, handler):  # type: ignore[no-untyped-def]
    engine = request.app[ENGINE_KEY]
    if request.method == "POST":
        engine.authorizations.append(request.headers.get("Authorization", ""))
        engine.x_api_keys.append(request.headers.get("x-api-key", ""))
        engine.traces.append({name: request.headers.get(name)
                              for name in ("X-Request-Id", "traceparent", "tracestate")})
    if engine.api_keys and request.path not in PUBLIC_PATHS:
        given = request.headers.get("Authorization", "").removeprefix("Bearer ")
        if given not in engine.api_keys:
            engine.refused_unauthorized += 1
            return web.json_response({"error": {"code": 401, "message": "Invalid API Key",
                                                "type": "authentication_error"}}, status=401)
    return await handler(request)


def _text(n_tokens: int) -> list[str]:
    return [WORDS[i % len(WORDS)] for i in range(n_tokens)]


def _usage(n_tokens: int, prompt_tokens: int) -> dict:
    return {"completion_tokens": n_tokens, "prompt_tokens": prompt_tokens,
            "total_tokens": n_tokens + prompt_tokens, "prompt_tokens_details": {"cached_tokens": 0}}


def _full_response(engine: Engine, chat: bool, n_tokens: int, finish: str, prompt_tokens: int) -> dict:
    content = "".join(_text(n_tokens))
    if chat:
        choice = {"finish_reason": finish, "index": 0, "message": {"role": "assistant", "content": content}}
        obj, prefix = "chat.completion", "chatcmpl-"
    else:
        choice = {"text": content, "index": 0, "logprobs": None, "finish_reason": finish}
        obj, prefix = "text_completion", "cmpl-"
    return {
        "choices": [choice], "created": int(time.time()), "model": engine.alias,
        "system_fingerprint": FINGERPRINT, "object": obj,
        "usage": _usage(n_tokens, prompt_tokens), "id": prefix + uuid.uuid4().hex,
    }


async def _stream(request: web.Request, engine: Engine, chat: bool, n_tokens: int, finish: str,
                  prompt_tokens: int, usage: bool) -> web.StreamResponse:
    resp = web.StreamResponse(headers={
        **_headers(), "Content-Type": "text/event-stream", "X-Accel-Buffering": "no",
        "Connection": "keep-alive",
    })
    await resp.prepare(request)
    rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
    created = int(time.time())
    obj = "chat.completion.chunk" if chat else "text_completion"

    def chunk(choices: list, **extra: object) -> bytes:
        data = {"choices": choices, "created": created, "id": rid, "model": engine.alias,
                "system_fingerprint": FINGERPRINT, "object": obj, **extra}
        return b"data: " + json.dumps(data, separators=(",", ":")).encode() + b"\n\n"

    def choice(text: str | None, reason: str | None, role: bool = False) -> dict:
        if chat:
            delta: dict = {}
            if role:
                delta = {"role": "assistant", "content": None}
            elif text is not None:
                delta = {"content": text}
            return {"finish_reason": reason, "index": 0, "delta": delta}
        return {"text": text or "", "index": 0, "logprobs": None, "finish_reason": reason}

    knobs = engine.knobs
    if chat:
        await resp.write(chunk([choice(None, None, role=True)]))
    for i, word in enumerate(_text(n_tokens)):
        if knobs.die_after_chunks is not None and i >= knobs.die_after_chunks:
            print("fake engine: dying mid-stream (FAKE_DIE_AFTER_CHUNKS)", file=sys.stderr, flush=True)
            os._exit(knobs.exit_code)
        if knobs.hang_after_chunks is not None and i >= knobs.hang_after_chunks:
            # Silent until the client goes away (the handler is cancelled then).
            await asyncio.Event().wait()
        if knobs.token_delay_s and i:
            await asyncio.sleep(knobs.token_delay_s)
        if knobs.error_after_chunks is not None and i >= knobs.error_after_chunks:
            error = {"error": {"code": 500, "message": "fake engine failed mid-stream", "type": "server_error"}}
            await resp.write(b"data: " + json.dumps(error).encode() + b"\n\n")
            await resp.write_eof()
            return resp
        await resp.write(chunk([choice(word, None)]))
    await resp.write(chunk([choice(None, finish)]))
    if usage:  # only when asked (stream_options.include_usage), as llama-server and vLLM do
        await resp.write(chunk([], usage=_usage(n_tokens, prompt_tokens)))
    await resp.write(b"data: [DONE]\n\n")
    await resp.write_eof()
    if knobs.close_after_stream:
        # The response promised keep-alive; llama-server closes anyway.
        request.protocol.force_close()
    return resp


async def embeddings(request: web.Request) -> web.Response:
    engine = request.app[ENGINE_KEY]
    if not engine.embedding:
        return _error(501, "This server does not support embeddings. Start it with `--embeddings`",
                      "not_supported_error")
    if not engine.loaded():
        return _error(503, "Loading model", "unavailable_error")
    body = await _read_json(request)
    if isinstance(body, web.Response):
        return body
    inputs = body.get("input")
    if isinstance(inputs, str):
        inputs = [inputs]
    if not isinstance(inputs, list) or not inputs:
        return _error(400, "\"input\" must be a string or a list of strings", "invalid_request_error")
    engine.in_flight += 1
    engine.requests_total += 1
    try:
        slot = await engine.acquire_slot()
        try:
            data = []
            for i, text in enumerate(inputs):
                seed = sum(str(text).encode()) % 97
                vec = [((seed + k) % 13 - 6) / 10.0 for k in range(8)]
                data.append({"embedding": vec, "index": i, "object": "embedding"})
            tokens = sum(max(1, len(str(t)) // 4) for t in inputs)
            return web.json_response({
                "model": engine.alias, "object": "list",
                "usage": {"prompt_tokens": tokens, "total_tokens": tokens}, "data": data,
            }, headers=_headers(), dumps=_dumps)
        finally:
            await engine.release_slot(slot)
    finally:
        engine.in_flight -= 1


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="fake-llama-server", add_help=False)
    p.add_argument("-m", "--model", default="")
    p.add_argument("-a", "--alias", default="")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8080)
    p.add_argument("-c", "--ctx-size", type=int, default=4096)
    p.add_argument("-np", "--parallel", type=int, default=1)
    p.add_argument("-t", "--threads", type=int, default=1)
    p.add_argument("-ngl", "--n-gpu-layers", "--gpu-layers", default="0")
    p.add_argument("-dev", "--device", default="")
    p.add_argument("--embedding", "--embeddings", action="store_true")
    p.add_argument("--metrics", action="store_true")
    p.add_argument("--api-key-file", default="")
    args, _unknown = p.parse_known_args(argv)
    return args


async def amain(args: argparse.Namespace, knobs: Knobs) -> int:
    parallel = max(1, args.parallel)
    engine = Engine(
        alias=args.alias or args.model, parallel=parallel, n_ctx_slot=max(1, args.ctx_size // parallel),
        embedding=args.embedding, metrics=args.metrics, knobs=knobs,
    )
    engine.busy = [False] * parallel
    if args.api_key_file:
        with open(args.api_key_file) as f:  # as llama-server: one key a line, '#' comments
            engine.api_keys = frozenset(line.strip() for line in f if line.strip() and not line.startswith("#"))
    engine.slot_freed = asyncio.Condition()

    # llama-server takes large bodies (long prompts); aiohttp's default would cap them at 1 MiB.
    app = web.Application(client_max_size=64 * 1024 * 1024, middlewares=[require_key])
    app[ENGINE_KEY] = engine
    app.router.add_get("/health", health)
    app.router.add_get("/slots", slots)
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/fake/stats", stats)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/models", models)
    app.router.add_post("/v1/chat/completions", completions)
    app.router.add_post("/chat/completions", completions)
    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/completions", completions)
    app.router.add_post("/v1/embeddings", embeddings)
    app.router.add_post("/embeddings", embeddings)

    # handler_cancellation: a client that disconnects cancels its handler (freeing the slot),
    # as llama-server stops generating for a closed connection.
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None, shutdown_timeout=1.0)
    await runner.setup()
    unix = args.host.endswith(".sock")  # as llama-server: a --host ending in .sock is a Unix socket
    try:
        if unix:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.bind(args.host)
        else:
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            sock.bind((args.host, args.port))
    except OSError as exc:
        print(f"E srv start: couldn't bind HTTP server socket, hostname: {args.host}, port: {args.port}: {exc}",
              file=sys.stderr, flush=True)
        return 1
    site = web.SockSite(runner, sock)
    await site.start()
    print(f"I srv load_model: loading model '{args.model}'", file=sys.stderr, flush=True)
    where = f"unix:{args.host}" if unix else f"http://{args.host}:{args.port}"
    print(f"I srv llama_server: listening on {where}", file=sys.stderr, flush=True)

    stop = asyncio.Event()
    exit_code = 0
    loop = asyncio.get_running_loop()

    def on_sigterm() -> None:
        mode = knobs.ignore_sigterm
        if mode == "1" or (mode == "busy" and engine.in_flight):
            print("I srv operator(): cleaning up before exit...", file=sys.stderr, flush=True)
            return
        stop.set()

    loop.add_signal_handler(signal.SIGTERM, on_sigterm)
    loop.add_signal_handler(signal.SIGINT, stop.set)

    async def announce_loaded() -> None:
        await asyncio.sleep(knobs.load_s)
        print("I srv llama_server: model loaded", file=sys.stderr, flush=True)

    announce = asyncio.create_task(announce_loaded())
    try:
        if knobs.exit_after_s is not None:
            try:
                await asyncio.wait_for(stop.wait(), knobs.exit_after_s)
            except TimeoutError:
                print(f"fake engine: exiting on its own with {knobs.exit_code}", file=sys.stderr, flush=True)
                exit_code = knobs.exit_code
        else:
            await stop.wait()
    finally:
        announce.cancel()
        print("I srv operator(): cleaning up before exit...", file=sys.stderr, flush=True)
        await runner.cleanup()
    return exit_code


def main(argv: list[str] | None = None) -> int:
    if "--version" in (sys.argv[1:] if argv is None else argv):
        # As llama-server: the version on stderr, exit 0 (viiworkctl doctor asks for it).
        print("version: 0 (fake-llama-server)\nbuilt with python", file=sys.stderr, flush=True)
        return 0
    args = parse_args(sys.argv[1:] if argv is None else argv)
    knobs = Knobs.from_env()
    if knobs.start_fail:
        print("E fake engine: FAKE_START_FAIL set, exiting", file=sys.stderr, flush=True)
        return 1
    if knobs.check_model and not os.path.isfile(args.model):
        print(f"E gguf_init_from_file: failed to open GGUF file '{args.model}' (No such file or directory)",
              file=sys.stderr, flush=True)
        return 1
    return asyncio.run(amain(args, knobs))


if __name__ == "__main__":
    sys.exit(main())
