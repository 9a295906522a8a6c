"""One error contract, OpenAI's (docs/routing.md, "Status codes"), over real HTTP.

The client API and proxy are the real ones; engines are a fake llama-server process or a
loopback server replaying an engine's error answer (llama-server's and vLLM's shapes, from
tests/engines/*/captures and llama.cpp's server source), so each row of the table is seen
end to end: status, ``type``, ``param`` and a string (or null) ``code``.
"""

from __future__ import annotations

import gzip
import json
from collections.abc import AsyncIterator
from pathlib import Path
from urllib.parse import urlsplit

import aiohttp
import pytest
from aiohttp import web

from support.api_app import agent_api
from support.procs import fake_engine
from support.replay import Captured, ReplayServer, read_capture, refused_base_url
from viiwork.agent.admin import ActionError, AdminActions, build_admin_app
from viiwork.agent.config.schema import ModelConfig
from viiwork.agent.serving.errors import engine_error, engine_message
from viiwork.agent.supervision.backends import Backend, BackendId, BackendState, ModelRuntime
from viiwork.engines.registry import get_engine

CAPTURES = Path(__file__).resolve().parent.parent / "engines"
CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}

# llama-server's error shape ({"error": {"code": int, "message", "type"}}); the messages are
# llama.cpp server's own (tools/server: "image input is not supported", context overflow).
LLAMA_IMAGE_500 = (b'{"error":{"code":500,"message":"image input is not supported - hint: if this is unexpected, '
                   b'you may need to provide the mmproj","type":"server_error"}}')
LLAMA_CONTEXT_400 = (b'{"error":{"code":400,"message":"the request exceeds the available context size, try '
                     b'increasing it","type":"exceed_context_size_error","n_prompt_tokens":5000,"n_ctx":4096}}')


def make_runtime(name: str, port: int, kind: str = "chat", parallel: int = 2, engine: str = "llamacpp") -> ModelRuntime:
    cfg = ModelConfig.model_validate({"name": name, "engine": engine, "path": "/x.gguf", "kind": kind,
                                      "parallel": parallel})
    rt = ModelRuntime(config=cfg, engine=get_engine(engine))
    rt.backends.append(Backend(id=BackendId(f"{name}#0"), model=name, index=0, state=BackendState.HEALTHY,
                               port=port, parallel=parallel))
    return rt


def assert_error(doc: dict, status_type: str, code: str | None, param: str | None = None) -> dict:
    err = doc["error"]
    assert set(err) == {"message", "type", "param", "code"}, err
    assert isinstance(err["message"], str) and err["message"]
    assert err["type"] == status_type and err["code"] == code and err["param"] == param, err
    return err


@pytest.fixture(scope="module")
def engine_port() -> int:
    with fake_engine("m", parallel=2, env={"FAKE_TOKENS": "3"}) as port:
        yield port


# --- the agent's own errors -----------------------------------------------------------------------

@pytest.mark.parametrize(
    ("method", "path", "body", "headers", "status", "type_", "code", "param", "needle"),
    [
        ("POST", "/v1/chat/completions", b"{not json", {}, 400, "invalid_request_error", "invalid_json", None,
         "not valid JSON"),
        ("POST", "/v1/chat/completions", b"\xff\xfe{}", {}, 400, "invalid_request_error", "invalid_json", None,
         "not UTF-8"),
        ("POST", "/v1/chat/completions", b"[1]", {}, 400, "invalid_request_error", "invalid_json", None,
         "JSON object"),
        ("POST", "/v1/chat/completions", b"[" * 1000, {}, 400, "invalid_request_error", "json_too_deep", None,
         "64"),
        ("POST", "/v1/chat/completions", b'{"model": "m", "x": ' + b"[" * 65 + b"]" * 65 + b"}", {}, 400,
         "invalid_request_error", "json_too_deep", None, "64"),
        ("POST", "/v1/chat/completions", b"not gzip at all", {"Content-Encoding": "gzip"}, 400,
         "invalid_request_error", "invalid_body", None, "cannot be read"),
        ("POST", "/v1/chat/completions", b'{"messages": []}', {}, 400, "invalid_request_error", "missing_model",
         "model", "'model' is required"),
        ("POST", "/v1/embeddings", json.dumps({"model": "m", "input": "x"}).encode(), {}, 400,
         "invalid_request_error", "wrong_model_kind", "model", "is a chat model"),
        ("POST", "/v1/chat/completions", json.dumps({**CHAT, "model": "nope"}).encode(), {}, 404,
         "not_found_error", "model_not_found", "model", "known models: m"),
        ("GET", "/v1/chat/completions", None, {}, 405, "invalid_request_error", "method_not_allowed", None,
         "use POST"),
        ("GET", "/v2/nothing", None, {}, 404, "not_found_error", "not_found", None, "no such endpoint"),
        ("GET", "/v1/mesh", None, {}, 404, "not_found_error", "not_found", None, "standalone"),
    ],
)
async def test_own_errors(engine_port: int, method: str, path: str, body: bytes | None, headers: dict,
                          status: int, type_: str, code: str, param: str | None, needle: str) -> None:
    runtimes = {"m": make_runtime("m", engine_port)}
    async with agent_api(runtimes) as (url, _), aiohttp.ClientSession() as http:
        async with http.request(method, f"{url}{path}", data=body,
                                headers={"Content-Type": "application/json", **headers}) as r:
            assert r.status == status, await r.text()
            assert r.content_type == "application/json"
            err = assert_error(await r.json(), type_, code, param)
    assert needle in err["message"]
    assert runtimes["m"].backends[0].in_flight == 0


async def test_too_large_by_length_and_as_it_arrives(engine_port: int) -> None:
    rt = make_runtime("m", engine_port)
    big = json.dumps({**CHAT, "pad": "x" * 5000}).encode()

    async def chunks() -> AsyncIterator[bytes]:  # no Content-Length: counted as it arrives
        for i in range(0, len(big), 1000):
            yield big[i:i + 1000]

    async with agent_api({"m": rt}, max_body_bytes=4096) as (url, _), aiohttp.ClientSession() as http:
        for data in (big, chunks(), gzip.compress(big)):
            extra = {"Content-Encoding": "gzip"} if isinstance(data, bytes) and data[:2] == b"\x1f\x8b" else {}
            async with http.post(f"{url}/v1/chat/completions", data=data,
                                 headers={"Content-Type": "application/json", **extra}) as r:
                assert r.status == 413
                err = assert_error(await r.json(), "invalid_request_error", "body_too_large")
                assert "4096" in err["message"] and "api.max_body_bytes" in err["message"]


async def test_draining_queue_full_and_unreachable(engine_port: int) -> None:
    async with agent_api({"m": make_runtime("m", engine_port)}) as (url, api), aiohttp.ClientSession() as http:
        api.draining = True
        async with http.post(f"{url}/v1/chat/completions", json=CHAT) as r:
            assert r.status == 503 and r.headers["Retry-After"]
            assert_error(await r.json(), "unavailable_error", "draining")
    rt = make_runtime("m", engine_port, parallel=1)
    rt.backends[0].in_flight = 1  # the only slot is taken and the queue takes none
    async with agent_api({"m": rt}, queue_max=0) as (url, _), aiohttp.ClientSession() as http:
        async with http.post(f"{url}/v1/chat/completions", json=CHAT) as r:
            assert r.status == 429 and r.headers["Retry-After"]
            assert_error(await r.json(), "rate_limit_error", "rate_limit_exceeded")
    dead = make_runtime("m", urlsplit(refused_base_url()).port or 1)
    async with agent_api({"m": dead}) as (url, _), aiohttp.ClientSession() as http:
        async with http.post(f"{url}/v1/chat/completions", json=CHAT) as r:
            assert r.status == 502
            assert_error(await r.json(), "upstream_error", "upstream_unreachable")


async def test_stream_error_events_carry_string_codes() -> None:
    with fake_engine("m", parallel=1, env={"FAKE_TOKENS": "50", "FAKE_TOKEN_DELAY_S": "0.01",
                                           "FAKE_DIE_AFTER_CHUNKS": "3"}) as port:
        async with agent_api({"m": make_runtime("m", port, parallel=1)}) as (url, _), \
                aiohttp.ClientSession() as http:
            async with http.post(f"{url}/v1/chat/completions", json={**CHAT, "max_tokens": 50, "stream": True}) as r:
                raw = await r.read()
    last = json.loads(raw.decode().rstrip().rsplit("data: ", 1)[1])
    assert_error(last, "upstream_error", "upstream_error")


# --- the engine's errors ------------------------------------------------------------------------------

async def replay_engine_answer(captured: Captured, payload: dict, engine: str = "llamacpp") -> tuple[int, dict]:
    async with ReplayServer({"/v1/chat/completions": captured}) as base:
        rt = make_runtime("m", urlsplit(base).port or 0, engine=engine)
        async with agent_api({"m": rt}) as (url, _), aiohttp.ClientSession() as http:
            async with http.post(f"{url}/v1/chat/completions", json=payload) as r:
                assert r.content_type == "application/json"
                return r.status, await r.json()


def json_answer(status: int, body: bytes, content_type: str = "application/json; charset=utf-8") -> Captured:
    return Captured(status=status, headers=(("Content-Type", content_type),), body=body)


async def test_engine_4xx_keeps_status_and_message() -> None:
    captured = read_capture(CAPTURES / "vllm" / "captures" / "vllm-0.32.0-cpu-chat_wrong_model.txt")
    status, doc = await replay_engine_answer(captured, CHAT, engine="vllm")
    assert status == 404
    err = assert_error(doc, "not_found_error", None, "model")  # vLLM's integer code is dropped
    assert err["message"].startswith("The model `wrong-name` does not exist")
    for stream in (False, True):  # a stream refused before its first byte is a JSON error too
        status, doc = await replay_engine_answer(json_answer(400, LLAMA_CONTEXT_400), {**CHAT, "stream": stream})
        assert status == 400
        assert doc["error"]["message"].startswith("the request exceeds the available context size")
        assert_error(doc, "invalid_request_error", "context_length_exceeded")


async def test_engine_5xx_is_400_only_when_the_adapter_says_client_fault() -> None:
    # the llama.cpp adapter classifies its engine's errors (client_fault, engines/contract.py)
    status, doc = await replay_engine_answer(json_answer(500, LLAMA_IMAGE_500), CHAT)
    assert status == 400
    err = assert_error(doc, "invalid_request_error", "unsupported_content")
    assert err["message"].startswith("image input is not supported")
    # a 500 no adapter claims, garbage and llama-server's 501: 502 with our message
    for captured in (json_answer(500, b'{"error":{"code":500,"message":"CUDA error: out of memory",'
                                      b'"type":"server_error"}}'),
                     json_answer(503, b"<html>upstream broke</html>", "text/html"),
                     read_capture(CAPTURES / "llamacpp" / "captures" / "7e4c0a9-tiny-embeddings_chat_server.txt")):
        status, doc = await replay_engine_answer(captured, CHAT)
        assert status == 502
        err = assert_error(doc, "upstream_error", "upstream_error")
        assert err["message"].startswith(f"backend m#0 failed with HTTP {captured.status}")


def test_engine_error_rules_are_pure_and_total() -> None:
    """The rule table without HTTP: a classifier's code is used, and one that raises or
    answers a code outside the contract's set counts as "not the client's fault"."""

    class Classifier:  # an engine adapter's optional capability (engines/contract.py)
        def __init__(self, answer: object) -> None:
            self.answer = answer

        def client_fault(self, status: int, body: bytes) -> str | None:
            if isinstance(self.answer, Exception):
                raise self.answer
            return self.answer  # type: ignore[return-value]

    def answer(status: int, body: bytes, adapter: object) -> tuple[int, dict]:
        response = engine_error(status, body, "b#0", adapter)
        return response.status, json.loads(response.text or "")

    assert answer(500, LLAMA_IMAGE_500, Classifier("unsupported_content"))[0] == 400
    assert answer(500, LLAMA_IMAGE_500, Classifier("unsupported_content"))[1]["error"]["code"] == "unsupported_content"
    assert answer(500, LLAMA_IMAGE_500, Classifier(RuntimeError("bug")))[0] == 502
    assert answer(500, LLAMA_IMAGE_500, Classifier("made_up_code"))[0] == 502
    assert answer(500, LLAMA_IMAGE_500, None)[0] == 502
    assert answer(400, LLAMA_CONTEXT_400, Classifier("context_length_exceeded"))[1]["error"]["code"] == \
        "context_length_exceeded"
    assert answer(422, b'{"detail": "bad field"}', None) == (422, {"error": {
        "message": "bad field", "type": "invalid_request_error", "param": None, "code": None}})
    assert engine_message(b"[" * 100_000) == ("[" * 1000 + "...", None, None)
    assert engine_message(b"") == (None, None, None)
    assert engine_message(b'{"error": {"message": "m", "code": "c", "param": "p"}}') == ("m", "c", "p")


async def test_admin_errors_carry_codes(tmp_path: Path) -> None:
    async def refuse() -> dict:
        raise ActionError(409, "no file to re-read", "not_reloadable")

    async def crash(model: str = "") -> dict:
        raise RuntimeError("boom")

    async def ok(model: str = "") -> dict:
        return {}

    actions = AdminActions(reload=refuse, drain=crash, undrain=ok, down=crash, up=ok, models=ok)
    runner = web.AppRunner(build_admin_app(actions), access_log=None)
    await runner.setup()
    site = web.UnixSite(runner, str(tmp_path / "admin.sock"))
    await site.start()
    try:
        async with aiohttp.ClientSession(connector=aiohttp.UnixConnector(str(tmp_path / "admin.sock"))) as http:
            async with http.post("http://admin/reload") as r:
                assert r.status == 409
                assert_error(await r.json(), "conflict_error", "not_reloadable")
            async with http.post("http://admin/drain") as r:  # an action's bug: 500, and the socket answers on
                assert r.status == 500
                assert_error(await r.json(), "server_error", "internal_error")
            async with http.post("http://admin/undrain", data=b"x" * (128 * 1024)) as r:
                assert r.status == 200  # commands read no body
    finally:
        await runner.cleanup()
