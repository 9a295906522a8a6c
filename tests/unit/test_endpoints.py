"""Endpoints beyond chat (issue 19): the engines' declarations, the ``endpoints`` extension, the
router's endpoint filter, Anthropic's error dialect, Responses' stored state, usage in the
Messages and Responses dialects. The same through real engines: tests/real/test_endpoints_real.py.
"""

from __future__ import annotations

import dataclasses
import json
import random

import aiohttp
import pytest

from support.api_app import agent_api
from viiwork.agent.config.schema import ModelConfig
from viiwork.agent.peering.endpoint_ext import endpoints_of
from viiwork.agent.serving.errors import Dialect, as_anthropic, dialect_of, sse_error_event
from viiwork.agent.serving.router import (
    CLASSIC,
    LocalBackend,
    LocalModel,
    PeerSnapshot,
    Queue,
    Refuse,
    Reservations,
    Router,
    RunLocal,
    RunOnPeer,
)
from viiwork.agent.serving.tokens import StreamTail, Usage, usage_in_body
from viiwork.agent.supervision.backends import Backend, BackendId, BackendState, ModelRuntime
from viiwork.engines.contract import (
    CLASSIC_ENDPOINTS,
    ENDPOINT_PATHS,
    BackendSpec,
    Endpoint,
    Kind,
    served_endpoints,
)
from viiwork.engines.llamacpp import LlamaCppOptions
from viiwork.engines.registry import get_engine
from viiwork.mesh.extensions import (
    ENDPOINTS,
    UNKNOWN_EXTENSION_CAP,
    Endpoints,
    Extensions,
    ModelEndpoints,
    decode_extensions,
)
from viiwork.mesh.identity import NodeId
from viiwork.mesh.membership import Liveness
from viiwork.mesh.summary import ModelCapacity, PublishedState

E = Endpoint
GENERATING = {E.CHAT, E.COMPLETIONS, E.RESPONSES}

# --- the engines' declarations ----------------------------------------------------------------


@pytest.mark.parametrize(("engine", "kind", "args", "expected"), [
    ("llamacpp", Kind.CHAT, (), GENERATING | {E.MESSAGES, E.COUNT_TOKENS, E.TOKENIZE, E.DETOKENIZE}),
    ("llamacpp", Kind.CHAT, ("--reranking",), GENERATING | {E.MESSAGES, E.COUNT_TOKENS, E.TOKENIZE, E.DETOKENIZE,
                                                           E.RERANK}),
    ("llamacpp", Kind.EMBEDDING, (), {E.EMBEDDINGS, E.TOKENIZE, E.DETOKENIZE}),
    ("llamacpp", Kind.EMBEDDING, ("--rerank",), {E.EMBEDDINGS, E.RERANK, E.TOKENIZE, E.DETOKENIZE}),
    ("llamacpp", Kind.RERANK, (), {E.RERANK, E.TOKENIZE, E.DETOKENIZE}),
    ("vllm", Kind.CHAT, (), GENERATING | {E.MESSAGES, E.TOKENIZE, E.DETOKENIZE}),
    ("vllm", Kind.EMBEDDING, (), {E.EMBEDDINGS, E.SCORE, E.TOKENIZE, E.DETOKENIZE}),
    ("vllm", Kind.RERANK, (), {E.RERANK, E.SCORE, E.TOKENIZE, E.DETOKENIZE}),
    ("sglang", Kind.CHAT, (), GENERATING | {E.SCORE, E.TOKENIZE, E.DETOKENIZE}),
    ("sglang", Kind.EMBEDDING, (), {E.EMBEDDINGS, E.TOKENIZE, E.DETOKENIZE}),
    ("sglang", Kind.RERANK, (), {E.RERANK, E.TOKENIZE, E.DETOKENIZE}),
], ids=lambda v: v.value if isinstance(v, Kind) else (" ".join(v) or "-") if isinstance(v, tuple) else None)
def test_each_engine_declares_its_endpoints_per_kind_and_flags(engine: str, kind: Kind, args: tuple[str, ...],
                                                              expected: set[Endpoint]) -> None:
    assert served_endpoints(get_engine(engine), kind, args) == expected


class _Broken:
    def endpoints(self, kind: Kind, args: tuple[str, ...]) -> frozenset[Endpoint]:
        raise RuntimeError("adapter bug")


class _Wrong:
    def endpoints(self, kind: Kind, args: tuple[str, ...]) -> object:
        return {"chat"}  # names, not Endpoint values


@pytest.mark.parametrize("engine", [object(), _Broken(), _Wrong()], ids=["none", "raises", "not-endpoints"])
def test_an_adapter_without_a_sound_declaration_serves_the_classic_endpoints(engine: object) -> None:
    assert served_endpoints(engine, Kind.CHAT, ()) == CLASSIC_ENDPOINTS


def test_a_rerank_backend_gets_llama_servers_reranking_flag_once() -> None:
    spec = BackendSpec(model="r", kind=Kind.RERANK, path="/m.gguf", port=9000, ctx_per_slot=512, parallel=1,
                       options=LlamaCppOptions())
    assert get_engine("llamacpp").build_command(spec).argv.count("--reranking") == 1
    own = dataclasses.replace(spec, args=("--rerank",))
    argv = get_engine("llamacpp").build_command(own).argv
    assert "--reranking" not in argv and argv.count("--rerank") == 1


def test_every_endpoint_has_a_path() -> None:
    assert set(ENDPOINT_PATHS) == set(Endpoint)
    assert len(set(ENDPOINT_PATHS.values())) == len(Endpoint)


# --- the endpoints extension ------------------------------------------------------------------

def _endpoints(**models: set[str]) -> Endpoints:
    return Endpoints(tuple(ModelEndpoints(name, frozenset(names)) for name, names in sorted(models.items())))


def test_the_extension_groups_models_serving_the_same_endpoints_and_round_trips() -> None:
    value = _endpoints(a={"chat", "messages"}, b={"chat", "messages"}, r={"rerank"})
    wire = Extensions.of({ENDPOINTS: value}).encode()
    assert wire == {"endpoints": [1, [[["chat", "messages"], ["a", "b"]], [["rerank"], ["r"]]]]}
    decoded = decode_extensions(wire)
    assert decoded.get(ENDPOINTS) == value and decoded.ignored == ()
    assert value.of("r") == {"rerank"} and value.of("other") is None


@pytest.mark.parametrize("value", [
    {"a": ["chat"]},                                  # not a list of groups
    [[["chat"], ["a"]], [["rerank"], ["a"]]],          # a model in two groups
    [[["chat"], []]],                                  # a group without models
    [[[], ["a"]]],                                     # a group without endpoints
    [[["Chat"], ["a"]]],                               # a name outside [a-z][a-z0-9_]*
    [[["chat"], ["a"], ["b"]]],                        # not a pair
    [[["chat"], [7]]],                                 # a model that is not a string
    [[["chat"], ["a"]]] * 9,                           # more than 8 groups
], ids=["object", "twice", "no-models", "no-endpoints", "bad-name", "triple", "model-int", "nine-groups"])
def test_a_malformed_endpoints_value_is_ignored_not_the_summary(value: object) -> None:
    ext = decode_extensions({"endpoints": [1, value]})
    assert ext.get(ENDPOINTS) is None
    assert ext.ignored == (("endpoints", "bad_value"),)
    assert ext.encode() == {"endpoints": [1, value]}  # relayed unchanged


def test_an_unknown_endpoint_name_is_kept_and_matches_nothing() -> None:
    ext = decode_extensions({"endpoints": [1, [[["chat", "telepathy"], ["a"]]]]})
    assert ext.get(ENDPOINTS) == _endpoints(a={"chat", "telepathy"})
    snap = _peer("p", endpoints=ext.get(ENDPOINTS))
    assert snap.endpoints_of("a") == {"chat", "telepathy"}


def _runtime(name: str, kind: str = "chat") -> ModelRuntime:
    cfg = ModelConfig.model_validate({"name": name, "engine": "llamacpp", "path": "/x.gguf", "kind": kind})
    return ModelRuntime(config=cfg, engine=get_engine("llamacpp"))


def test_the_published_value_fits_the_cap_an_older_node_applies() -> None:
    value = endpoints_of([_runtime("chat-model"), _runtime("embedder", "embedding"), _runtime("ranker", "rerank")])
    assert value is not None and value.of("ranker") == {"rerank", "tokenize", "detokenize"}
    assert len(json.dumps(Extensions.of({ENDPOINTS: value}).encode()["endpoints"][1])) < UNKNOWN_EXTENSION_CAP
    many = endpoints_of([_runtime(f"model-with-a-rather-long-name-{i:03d}") for i in range(40)])
    assert many is not None and 0 < len(many.models) < 40  # the rest left out: peers assume the classic set
    assert endpoints_of([]) is None


# --- the router's endpoint filter -------------------------------------------------------------

M = "m"
SELF = NodeId("selfselfselfself")


def _cap(model: str = M, kind: str = "chat") -> ModelCapacity:
    return ModelCapacity(name=model, engine="llamacpp", kind=kind, slots=4, busy=0, waiting=None, ctx_per_slot=512,
                         healthy=1, total=1)


def _peer(name: str, *caps: ModelCapacity, endpoints: Endpoints | None = None) -> PeerSnapshot:
    return PeerSnapshot(node_id=NodeId((name * 16)[:16]), name=name, liveness=Liveness.ALIVE,
                        state=PublishedState.SERVING, age_ms=10.0, order=(1, 1), models=caps or (_cap(),), rtt_ms=1.0,
                        endpoints=endpoints)


def _local(endpoints: set[str], free: int = 2) -> dict[str, LocalModel]:
    return {M: LocalModel(name=M, kind="chat", backends=(LocalBackend("m-0", free),), slots=4, can_serve=True,
                          engine="llamacpp", endpoints=frozenset(endpoints))}


def _router() -> Router:
    return Router(SELF, "self", stale_after_ms=3000, reservations=Reservations(lambda: 0.0), rng=random.Random(1))


def test_a_request_goes_past_a_free_local_backend_that_lacks_its_endpoint_to_a_peer_that_serves_it() -> None:
    peers = [_peer("p", endpoints=_endpoints(m={"chat", "rerank"}))]
    assert _router().route(M, _local({"chat"}), peers, endpoint="rerank") == RunOnPeer(peers[0].node_id, "p", 4)
    assert _router().route(M, _local({"chat"}), peers, endpoint="chat") == RunLocal("m-0")


def test_a_peer_without_the_extension_serves_the_classic_endpoints_only() -> None:
    old = _peer("old")  # no endpoints extension: an agent from before it
    assert old.endpoints_of(M) == CLASSIC
    assert _router().route(M, {}, [old], endpoint="chat") == RunOnPeer(old.node_id, "old", 4)
    refused = _router().route(M, {}, [old], endpoint="messages")
    assert isinstance(refused, Refuse) and refused.code == "endpoint_not_supported"


def test_no_backend_serving_the_endpoint_is_a_400_naming_what_the_model_serves() -> None:
    peers = [_peer("p", endpoints=_endpoints(m={"chat", "tokenize"}))]
    refused = _router().route(M, _local({"chat", "messages"}, free=0), peers, endpoint="rerank")
    assert refused == Refuse(400, "model 'm' is not served at /v1/rerank; its backends serve: /tokenize, "
                             "/v1/chat/completions, /v1/messages", param="model", code="endpoint_not_supported")


def test_an_unknown_model_is_still_a_404_whatever_the_endpoint() -> None:
    refused = _router().route("nope", _local({"chat"}), [], endpoint="rerank")
    assert isinstance(refused, Refuse) and refused.status == 404


def test_a_request_pinned_to_a_node_without_the_endpoint_is_refused_naming_the_node() -> None:
    peers = [_peer("p", endpoints=_endpoints(m={"chat"})), _peer("q", endpoints=_endpoints(m={"rerank"}))]
    refused = _router().route(M, _local({"chat"}), peers, endpoint="rerank", host="p")
    assert isinstance(refused, Refuse) and refused.code == "endpoint_not_supported" and "'p'" in refused.message
    here = _router().route(M, _local({"chat"}), peers, endpoint="rerank", host="self")
    assert isinstance(here, Refuse) and "this node" in here.message
    assert _router().route(M, _local({"chat"}), peers, endpoint="rerank", host="q") == RunOnPeer(
        peers[1].node_id, "q", 4)


def test_a_pinned_request_for_an_endpoint_nothing_serves_gets_the_pinned_nodes_own_refusal() -> None:
    """The mesh-wide "nothing serves it" refusal came first and named no node, and a node
    without the model answered endpoint_not_supported instead of model_not_on_host."""
    peers = [_peer("p", endpoints=_endpoints(m={"chat"})), _peer("r", _cap("other"))]
    named = _router().route(M, _local({"chat"}), peers, endpoint="rerank", host="p")
    assert isinstance(named, Refuse) and named.code == "endpoint_not_supported" and "'p'" in named.message
    elsewhere = _router().route(M, _local({"chat"}), peers, endpoint="rerank", host="r")
    assert isinstance(elsewhere, Refuse) and elsewhere.code == "model_not_on_host"
    unpinned = _router().route(M, _local({"chat"}), peers, endpoint="rerank")
    assert isinstance(unpinned, Refuse) and unpinned.code == "endpoint_not_supported" and " on " not in unpinned.message


def test_a_busy_peer_that_serves_the_endpoint_means_wait_not_refuse() -> None:
    busy = dataclasses.replace(_cap(), busy=4)
    peers = [_peer("p", busy, endpoints=_endpoints(m={"rerank"}))]
    assert isinstance(_router().route(M, _local({"chat"}), peers, endpoint="rerank"), Queue)


# --- errors in the client's dialect -----------------------------------------------------------

@pytest.mark.parametrize(("path", "dialect"), [("/v1/messages", Dialect.ANTHROPIC),
                                               ("/v1/messages/count_tokens", Dialect.ANTHROPIC),
                                               ("/v1/messagesx", Dialect.OPENAI), ("/v1/responses", Dialect.OPENAI),
                                               ("/v1/chat/completions", Dialect.OPENAI)])
def test_the_dialect_follows_the_path(path: str, dialect: Dialect) -> None:
    assert dialect_of(path) is dialect


@pytest.mark.parametrize(("status", "kind"), [(400, "invalid_request_error"), (401, "authentication_error"),
                                              (403, "permission_error"), (404, "not_found_error"),
                                              (405, "invalid_request_error"), (413, "request_too_large"),
                                              (429, "rate_limit_error"), (502, "api_error"),
                                              (503, "overloaded_error"), (504, "timeout_error")])
def test_an_openai_shaped_error_becomes_anthropics(status: int, kind: str) -> None:
    body = json.dumps({"error": {"message": "why", "type": "x", "param": None, "code": "c"}}).encode()
    assert json.loads(as_anthropic(status, body) or b"") == {"type": "error", "error": {"type": kind, "message": "why"}}


@pytest.mark.parametrize("body", [b"not json", b"[1]", b'{"type": "error", "error": {"type": "x", "message": "m"}}',
                                  b'{"error": "text"}'], ids=["text", "list", "already", "string"])
def test_a_body_that_is_not_our_error_shape_is_left_alone(body: bytes) -> None:
    assert as_anthropic(400, body) is None


def test_the_agents_own_stream_error_is_a_named_anthropic_event() -> None:
    event = sse_error_event(502, "backend broke off", "upstream_error", Dialect.ANTHROPIC)
    assert event.startswith(b"event: error\ndata: ") and event.endswith(b"\n\n")
    assert json.loads(event.split(b"data: ", 1)[1]) == {"type": "error", "error": {"type": "api_error",
                                                                                    "message": "backend broke off"}}
    assert sse_error_event(502, "x", "upstream_error").startswith(b'data: {"error"')


def _ranker_runtime() -> dict[str, ModelRuntime]:
    rt = _runtime("ranker", "rerank")
    rt.backends.append(Backend(id=BackendId("ranker#0"), model="ranker", index=0, state=BackendState.HEALTHY,
                               port=9, parallel=1))
    return {"ranker": rt}


@pytest.mark.parametrize(("path", "body", "status", "expected"), [
    ("/v1/messages", b'{"max_tokens": 5, "messages": []}', 400, "'model' is required"),
    ("/v1/messages", b'{"model": 7, "max_tokens": 5}', 400, "'model' is required"),
    ("/v1/messages", b"not json", 400, "JSON"),
    ("/v1/messages/count_tokens", b'{"messages": []}', 400, "'model' is required"),
    ("/v1/messages", b'{"model": "nope", "max_tokens": 5, "messages": []}', 404, "'nope'"),
    ("/v1/messages", b'{"model": "ranker", "max_tokens": 5, "messages": []}', 400, "/v1/rerank"),
    ("/v1/messages", b'{"model": "ranker", "messages": []}', 400, "max_tokens: Field required"),
    ("/v1/messages", b'{"model": "ranker", "max_tokens": null, "messages": []}', 400, "max_tokens: Field required"),
    ("/v1/messages/count_tokens", b'{"model": "ranker", "messages": []}', 400, "/v1/rerank"),
], ids=["no-model", "model-not-string", "not-json", "count-no-model", "unknown-model", "not-served", "no-max-tokens",
        "null-max-tokens", "count-needs-no-max-tokens"])
async def test_anthropic_endpoints_answer_the_agents_errors_in_anthropics_shape(path: str, body: bytes, status: int,
                                                                             expected: str) -> None:
    async with agent_api(_ranker_runtime()) as (url, _), aiohttp.ClientSession() as http:
        async with http.post(url + path, data=body, headers={"Content-Type": "application/json"}) as r:
            assert r.status == status
            doc = await r.json()
    assert doc["type"] == "error" and set(doc) == {"type", "error"}
    assert doc["error"]["type"] == ("not_found_error" if status == 404 else "invalid_request_error")
    assert expected in doc["error"]["message"]


@pytest.mark.parametrize(("path", "body", "code", "param"), [
    ("/v1/responses", b'{"input": "hi"}', "missing_model", "model"),
    ("/tokenize", b"{not json", "invalid_json", None),
    ("/v1/rerank", b'{"model": ["r"]}', "missing_model", "model"),
    ("/v1/responses", b'{"model": "ranker", "input": "hi", "store": true}', "stored_responses_not_supported", "store"),
    ("/v1/responses", b'{"model": "ranker", "input": "hi", "previous_response_id": "resp_1"}',
     "stored_responses_not_supported", "previous_response_id"),
    ("/v1/responses", b'{"model": "ranker", "input": "hi", "conversation": "conv_1"}',
     "stored_responses_not_supported", "conversation"),
    ("/v1/responses", b'{"model": "ranker", "input": "hi", "store": false}', "endpoint_not_supported", "model"),
    ("/v1/responses", b'{"model": "ranker", "input": "hi", "store": null}', "endpoint_not_supported", "model"),
    # vLLM's pydantic reads "true" and 1 as true: anything but a boolean is refused
    ("/v1/responses", b'{"model": "ranker", "input": "hi", "store": "true"}', "invalid_type", "store"),
    ("/v1/responses", b'{"model": "ranker", "input": "hi", "store": 1}', "invalid_type", "store"),
    ("/v1/responses", b'{"model": "ranker", "input": "hi", "store": 0}', "invalid_type", "store"),
    ("/v1/responses", b'{"model": "ranker", "input": "hi", "previous_response_id": ""}',
     "stored_responses_not_supported", "previous_response_id"),
    ("/v1/responses", b'{"model": "ranker", "input": "hi", "conversation": {"id": "conv_1"}}',
     "stored_responses_not_supported", "conversation"),
    ("/v1/responses", b'{"model": "ranker", "input": "hi", "max_output_tokens": -1}', "integer_below_min_value",
     "max_output_tokens"),
    ("/v1/responses", b'{"model": "ranker", "input": "hi", "max_output_tokens": 0}', "integer_below_min_value",
     "max_output_tokens"),
    ("/v1/responses", b'{"model": "ranker", "input": "hi", "max_output_tokens": "5"}', "invalid_type",
     "max_output_tokens"),
    ("/v1/responses", b'{"model": "ranker", "input": "hi", "max_output_tokens": 2.5}', "invalid_type",
     "max_output_tokens"),
    ("/v1/responses", b'{"model": "ranker", "input": "hi", "max_output_tokens": 5}', "endpoint_not_supported",
     "model"),
    ("/detokenize", b'{"model": "ranker", "tokens": [-1]}', "integer_below_min_value", "tokens"),
    ("/detokenize", b'{"model": "ranker", "tokens": [3, -7]}', "integer_below_min_value", "tokens"),
    ("/detokenize", b'{"model": "ranker", "tokens": "3"}', "invalid_type", "tokens"),
    ("/detokenize", b'{"model": "ranker", "tokens": [1, true]}', "invalid_type", "tokens"),
    ("/detokenize", b'{"model": "ranker", "tokens": [1.5]}', "invalid_type", "tokens"),
    ("/detokenize", b'{"model": "ranker"}', "invalid_type", "tokens"),
], ids=["responses-no-model", "tokenize-not-json", "rerank-model-list", "store", "previous-response", "conversation",
        "store-false-routes", "store-null-routes", "store-string", "store-1", "store-0", "previous-response-empty",
        "conversation-object", "max-output-negative", "max-output-0", "max-output-string", "max-output-decimal",
        "max-output-5-routes", "detokenize-negative", "detokenize-negative-later", "detokenize-not-list",
        "detokenize-bool", "detokenize-decimal", "detokenize-no-tokens"])
async def test_other_endpoints_answer_openais_error_contract(path: str, body: bytes, code: str,
                                                             param: str | None) -> None:
    async with agent_api(_ranker_runtime()) as (url, _), aiohttp.ClientSession() as http:
        async with http.post(url + path, data=body, headers={"Content-Type": "application/json"}) as r:
            assert r.status == 400
            error = (await r.json())["error"]
    assert error["code"] == code and error["param"] == param and error["type"] == "invalid_request_error"


# --- usage in the Messages and Responses dialects ---------------------------------------------

def test_anthropic_usage_counts_cache_reads_in_the_prompt() -> None:
    body = b'{"type":"message","usage":{"cache_read_input_tokens":28,"input_tokens":1,"output_tokens":5}}'
    assert usage_in_body(body) == Usage(29, 5, 28)


def test_responses_usage_counts_cached_tokens_within_the_input() -> None:
    body = b'{"object":"response","usage":{"input_tokens":29,"output_tokens":3,"input_tokens_details":{"cached_tokens":28}}}'
    assert usage_in_body(body) == Usage(29, 3, 28)


def test_an_anthropic_stream_merges_input_and_output_from_two_events() -> None:
    stream = (b'event: message_start\ndata: {"type":"message_start","message":{"usage":{"input_tokens":7,'
              b'"cache_read_input_tokens":0,"output_tokens":0}}}\n\n'
              b'event: message_delta\ndata: {"type":"message_delta","delta":{},"usage":{"output_tokens":3}}\n\n'
              b'event: message_stop\ndata: {"type":"message_stop"}\n\n')
    tail = StreamTail(strip=False, hold=True)
    assert tail.feed(stream) == stream and tail.rest() == b""
    assert tail.usage == Usage(7, 3, 0)


_MESSAGE_START = (b'event: message_start\ndata: {"type":"message_start","message":{"usage":{"input_tokens":7,'
                  b'"cache_read_input_tokens":0,"output_tokens":1}}}\n\n')
_TEXT_DELTA = (b'event: content_block_delta\ndata: {"type":"content_block_delta","index":0,'
               b'"delta":{"type":"text_delta","text":"hi"}}\n\n')


def test_a_cut_anthropic_stream_is_charged_the_events_relayed_not_message_starts_placeholder() -> None:
    tail = StreamTail(strip=False, hold=True)
    tail.feed(_MESSAGE_START + _TEXT_DELTA * 3)
    assert tail.usage is None  # message_start's output_tokens (0 or 1) is no count
    assert tail.delivered() == Usage(None, 4, None)  # estimated: docs/usage.md, "Estimated counts"


def test_a_complete_anthropic_stream_is_charged_the_engines_final_count() -> None:
    tail = StreamTail(strip=False, hold=True)
    tail.feed(_MESSAGE_START + _TEXT_DELTA * 3 + b'event: message_delta\ndata: {"type":"message_delta","delta":{},'
              b'"usage":{"output_tokens":9}}\n\n')
    assert tail.usage == Usage(7, 9, 0) and tail.delivered() == Usage(7, 9, 0)


def test_a_responses_stream_reads_usage_from_response_completed() -> None:
    stream = (b'event: response.created\ndata: {"type":"response.created","response":{"status":"in_progress"}}\n\n'
              b'event: response.completed\ndata: {"type":"response.completed","response":{"usage":'
              b'{"input_tokens":9,"output_tokens":2,"input_tokens_details":{"cached_tokens":0}}}}\n\n')
    tail = StreamTail(strip=False, hold=True)
    assert tail.feed(stream) == stream
    assert tail.usage == Usage(9, 2, 0)


# --- an engine's answer to a token id outside the vocabulary ---------------------------------

# llama-server (the wheel's build 7e4c0a9, the tiny GGUF) to POST /detokenize {"tokens": [-1]}, verbatim
_RANGE_CHECK = (b'{"error":{"code":500,"message":"vector::_M_range_check: __n (which is 18446744073709551615) >= '
                b'this->size() (which is 328)","type":"server_error"}}')


def test_llama_servers_range_check_on_a_token_id_is_the_clients_fault() -> None:
    from viiwork.agent.serving.errors import engine_error
    from viiwork.engines.contract import classify_client_fault

    engine = get_engine("llamacpp")
    assert classify_client_fault(engine, 500, _RANGE_CHECK) == "invalid_request"
    response = engine_error(500, _RANGE_CHECK, "tiny#0", engine)
    assert response.status == 400 and b"_M_range_check" in response.body
    quoted = json.dumps({"error": {"code": 500, "message": "crashed on vector::_M_range_check: x",
                                   "type": "server_error"}}).encode()
    assert classify_client_fault(engine, 500, quoted) is None


# --- the conformance kit's check --------------------------------------------------------------

class _NoChat:
    def endpoints(self, kind: Kind, args: tuple[str, ...]) -> frozenset[Endpoint]:
        return frozenset({Endpoint.TOKENIZE})


def test_the_kit_flags_a_declaration_without_the_kinds_own_endpoint() -> None:
    from viiwork.engines.conformance import Violation, _check_endpoints

    out: list[Violation] = []
    _check_endpoints(_NoChat(), out)  # type: ignore[arg-type]
    assert {v.check for v in out} == {"capability.endpoints"} and len(out) == 2 * len(Kind)
    for name in ("llamacpp", "vllm", "sglang"):
        clean: list[Violation] = []
        _check_endpoints(get_engine(name), clean)
        assert clean == []


async def test_a_standalone_node_lists_its_models_endpoints() -> None:
    async with agent_api(_ranker_runtime()) as (url, _), aiohttp.ClientSession() as http:
        async with http.get(f"{url}/v1/models") as r:
            (model,) = (await r.json())["data"]
    assert model["id"] == "ranker" and model["endpoints"] == ["/detokenize", "/tokenize", "/v1/rerank"]


async def test_a_forward_for_an_endpoint_this_node_does_not_serve_is_refused_for_the_origin_to_route_again() -> None:
    from aiohttp.test_utils import make_mocked_request

    from viiwork.agent.serving.pipeline import Call, NoPeers, PeerRefusal, Pipeline
    from viiwork.agent.serving.proxy import Upstream
    from viiwork.agent.serving.waitqueue import Queues

    runtimes = _ranker_runtime()  # serves rerank, tokenize, detokenize: the origin's picture was older
    async with Upstream(stream_idle_timeout_s=5.0) as upstream:
        pipeline = Pipeline(node_name="n", runtimes=runtimes, queues=Queues(runtimes, 4, 5.0),
                            peers=NoPeers(runtimes), upstream=upstream)
        request = make_mocked_request("POST", "/v1/messages", headers={"Content-Type": "application/json"})
        call = Call(request, b'{"model": "ranker"}', "ranker", None, False, "r1", endpoint="messages")
        refusal = await pipeline.run_forwarded(call, None, None)
    assert isinstance(refusal, PeerRefusal) and refusal.status == 503 and refusal.reason == "not-served"
    assert "/v1/messages" in refusal.message
    assert runtimes["ranker"].backends[0].in_flight == 0  # no slot taken
