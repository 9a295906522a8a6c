"""No input makes the agent answer 5xx from its own code (issue 13, item 4).

Property-based (hypothesis): over 100,000 generated bodies, mesh messages, engine error
bodies and header values against the pure parsing and validation (``agent/serving/body.py``,
``agent/peering/offers.py``, ``agent/serving/errors.py``, the router), then at most 2,000 requests over
HTTP: 1,000 to a real ClientApi app on loopback (fake llama-server process behind it), 500
to the forward route of a real agent's mesh listener (mutual TLS, an open-mesh client
certificate, as a peer sends them). Every answer is < 500, or 502/503/504 with an
upstream/capacity code (an engine's failure, not ours).

The same two real agents carry the 5 MB forward of the issue: served locally and through a
peer alike (the mesh listener's forward route takes ``api.max_body_bytes``, not gossip's
limit).
"""

from __future__ import annotations

import asyncio
import gzip
import http.client
import json
import random
import ssl
import threading
import zlib
from collections import Counter
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from cryptography.hazmat.primitives import serialization
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from support.agent import Agent, run_agent
from support.engines import fake_engine_binary
from support.procs import fake_engine
from viiwork.agent.config.schema import ModelConfig
from viiwork.agent.peering.offers import Want, WantError, parse_offer
from viiwork.agent.serving.api import ClientApi
from viiwork.agent.serving.body import MAX_JSON_DEPTH, BodyError, json_depth, parse_json, parse_json_object
from viiwork.agent.serving.errors import engine_error
from viiwork.agent.serving.proxy import Upstream
from viiwork.agent.serving.router import LocalBackend, LocalModel, PeerSnapshot, Refuse, Reservations, Router
from viiwork.agent.supervision.backends import Backend, BackendId, BackendState, ModelRuntime
from viiwork.engines.registry import get_engine
from viiwork.mesh import tls
from viiwork.mesh.identity import NodeId, load_or_create_identity
from viiwork.mesh.membership import Liveness
from viiwork.mesh.summary import ModelCapacity, PublishedState
from viiwork.mesh.trust import issue_open_certificate, open_mesh_ca

# Each example checks a batch: hypothesis' own cost per example (about 1 ms on a loaded
# 2-core box) would otherwise be most of the run. Batches x examples >= 100,000 in all.
PURE = settings(deadline=None, database=None, derandomize=True, suppress_health_check=list(HealthCheck))
OVER_HTTP = PURE
# Codes of a 5xx that is an engine's or the fleet's state, not a fault of the agent's code.
NOT_OURS = {"upstream_error", "upstream_unreachable", "upstream_timeout", "no_capacity", "draining"}
MESH_ID = "fuzz-mesh"
FUZZED: Counter[str] = Counter()  # bodies and header sets checked, by test (reported by -s runs)

# --- strategies (cheap: one or two draws per body) ----------------------------------------------------

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=10),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3),
    max_leaves=10)

_UNITS = (b"[", b'{"k":', b'["]]\\"[",', b"[1,")
_TAILS = (b"0", b'"x"', b"[]", b"")


def _deep(seed: bytes) -> bytes:
    """Brackets nested 0..3000 deep, half of them under 200 (some strings holding brackets),
    closed fully or partly;
    everything decided by 4 drawn bytes."""
    depth = int.from_bytes(seed[:2], "big") % (3001 if seed[2] & 0x80 else 200)  # mostly near the limit
    unit = _UNITS[seed[2] % len(_UNITS)]
    closing = (b"}" if unit.startswith(b"{") else b"]") * depth
    keep = depth if seed[3] < 128 else depth * seed[3] // 255
    return unit * depth + _TAILS[seed[3] % len(_TAILS)] + closing[:keep]


deep_nesting = st.binary(min_size=4, max_size=4).map(_deep)
_CHATS = [json.dumps({"model": m, "messages": [{"role": "user", "content": "hi [there] {you} \\\" \u00e9"}],
                      "max_tokens": 2, **extra}).encode()
          for m in ("m", "e", "nope", "") for extra in ({}, {"stream": True}, {"stream": "yes"}, {"model": 7})]


def _splice(draw: tuple[int, int, bytes]) -> bytes:
    index, at, junk = draw
    data = _CHATS[index % len(_CHATS)]
    if not junk:
        return data
    at %= len(data) + 1
    return data[:at] + junk + data[at + len(junk) % 5:]


chat_bodies = st.tuples(st.integers(0, 255), st.integers(0, 1 << 16), st.binary(max_size=8)).map(_splice)
bodies = st.binary(max_size=300) | deep_nesting | chat_bodies | json_values.map(lambda v: json.dumps(v).encode())


def batch(strategy: st.SearchStrategy[Any], size: int) -> st.SearchStrategy[list[Any]]:
    return st.lists(strategy, min_size=size, max_size=size)


def true_depth(value: Any) -> int:
    """Nesting depth of a decoded value, without recursion."""
    best, stack = 0, [(value, 1)]
    while stack:
        item, level = stack.pop()
        if isinstance(item, (list, dict)):
            best = max(best, level)
            stack.extend((child, level + 1) for child in (item.values() if isinstance(item, dict) else item))
    return best


# --- pure: parsing and validation -----------------------------------------------------------------------

@settings(PURE, max_examples=1200)
@given(batch(st.binary(max_size=400) | chat_bodies, 50))
def test_any_bytes_parse_or_fail_with_a_400(datas: list[bytes]) -> None:
    for data in datas:
        FUZZED["bytes"] += 1
        try:
            value = parse_json_object(data)
        except BodyError as exc:
            assert exc.status == 400 and exc.code in ("invalid_json", "json_too_deep"), exc
            assert str(exc)
        else:
            assert isinstance(value, dict)


@settings(PURE, max_examples=1000)
@given(batch(deep_nesting, 10), batch(json_values, 1))
def test_depth_is_exact_and_the_limit_holds(deep: list[bytes], values: list[Any]) -> None:
    for data in deep + [json.dumps(v).encode() for v in values]:
        FUZZED["nesting"] += 1
        try:
            decoded = json.loads(data)
        except RecursionError:
            decoded = None  # deeper than CPython's parser goes: ours must refuse it
        except ValueError:
            with pytest.raises(BodyError):  # not JSON (an unclosed nest): refused, whatever it is
                parse_json(data)
            continue
        if decoded is None and data[:1] in (b"[", b"{"):
            with pytest.raises(BodyError, match="deeper than 64 levels"):
                parse_json(data)
            continue
        depth = true_depth(decoded)
        assert json_depth(data) == depth
        if depth > MAX_JSON_DEPTH:
            with pytest.raises(BodyError, match="deeper than 64 levels"):
                parse_json(data)
        else:
            assert parse_json(data) == decoded


@settings(PURE, max_examples=500)
@given(batch(bodies, 20))
def test_mesh_messages_are_dropped_with_a_want_error(datas: list[bytes]) -> None:
    for data in datas:
        FUZZED["mesh messages"] += 1
        try:
            value = parse_json(data)
        except BodyError:
            continue
        for parse in (Want.parse, parse_offer):
            try:
                parse(value)
            except WantError as exc:
                assert str(exc)


LLAMACPP = get_engine("llamacpp")
engine_bodies = bodies | json_values.map(lambda m: json.dumps({"error": m}).encode())


@settings(PURE, max_examples=250)
@given(batch(st.tuples(st.integers(400, 599), engine_bodies), 20))
def test_engine_error_bodies_become_our_shape(answers: list[tuple[int, bytes]]) -> None:
    for status, data in answers:
        FUZZED["engine errors"] += 1
        response = engine_error(status, data, "m#0", LLAMACPP)
        assert response.status == status if status < 500 else response.status in (400, 502)
        err = json.loads(response.text or "")["error"]
        assert set(err) == {"message", "type", "param", "code"} and err["message"]
        assert err["code"] is None or isinstance(err["code"], str)


header_text = st.text(st.characters(min_codepoint=32, max_codepoint=255), max_size=40)
ROUTER_PEERS = [PeerSnapshot(node_id=NodeId("a" * 16), name="peer-a", liveness=Liveness.ALIVE,
                             state=PublishedState.SERVING, age_ms=10.0, order=(1, 1), rtt_ms=1.0,
                             models=(ModelCapacity(name="m", engine="llamacpp", kind="chat", slots=2, busy=1,
                                                   waiting=None, ctx_per_slot=4096, healthy=1, total=1),))]
ROUTER_LOCAL = {"m": LocalModel(name="m", kind="chat", backends=(LocalBackend("m-0", 0),), slots=2, can_serve=True,
                                ctx_per_slot=4096, engine="llamacpp")}


@settings(PURE, max_examples=500)
@given(batch(st.tuples(st.sampled_from(["m", "x"]) | header_text, header_text, header_text), 30))
def test_header_values_route_or_refuse(headers: list[tuple[str, str, str]]) -> None:
    """``?host=`` / ``X-Viiwork-Host`` and ``X-Session-Id`` reach the router as any text."""
    router = Router(NodeId("s" * 16), "self", stale_after_ms=3000,
                    reservations=Reservations(lambda: 1000.0), rng=random.Random(1))
    for model, host, affinity in headers:
        FUZZED["headers"] += 1
        decision = router.route(model, ROUTER_LOCAL, ROUTER_PEERS, host=host or None, affinity=affinity or None)
        if isinstance(decision, Refuse):
            assert 400 <= decision.status < 600 and decision.message
            assert decision.status < 500 or decision.code == "no_capacity"


# --- over HTTP: a real ClientApi app ------------------------------------------------------------------------

class ApiThread:
    """A ClientApi app on 127.0.0.1 served by an event loop in a thread (hypothesis drives
    the requests synchronously). ``port``; ``stop()``."""

    def __init__(self, engine_port: int) -> None:
        self.engine_port = engine_port
        self.loop = asyncio.new_event_loop()
        self.ready = threading.Event()
        self.port = 0
        self._stop: asyncio.Event | None = None
        self.thread = threading.Thread(target=self.loop.run_until_complete, args=(self._serve(),), daemon=True)
        self.thread.start()
        assert self.ready.wait(20), "the API did not start"

    async def _serve(self) -> None:
        self._stop = asyncio.Event()
        runtimes = {}
        for name, kind in (("m", "chat"), ("e", "embedding")):
            cfg = ModelConfig.model_validate({"name": name, "engine": "llamacpp", "path": "/x.gguf", "kind": kind,
                                              "parallel": 4})
            rt = ModelRuntime(config=cfg, engine=get_engine("llamacpp"))
            rt.backends.append(Backend(id=BackendId(f"{name}#0"), model=name, index=0, state=BackendState.HEALTHY,
                                       port=self.engine_port, parallel=4))
            runtimes[name] = rt
        async with Upstream(10) as upstream:
            api = ClientApi(node_name="fuzz", runtimes=runtimes, upstream=upstream, max_body_bytes=4096,
                            queue_max=4, queue_timeout_s=2, status_source=lambda: [])
            runner = web.AppRunner(api.build_app(), handler_cancellation=True, access_log=None)
            await runner.setup()
            site = web.TCPSite(runner, "127.0.0.1", 0)
            await site.start()
            self.port = runner.addresses[0][1]
            self.ready.set()
            await self._stop.wait()
            await runner.cleanup()

    def stop(self) -> None:
        if self._stop is not None:
            self.loop.call_soon_threadsafe(self._stop.set)
        self.thread.join(10)
        self.loop.close()


ENCODINGS = {"": lambda b: b, "gzip": gzip.compress, "deflate": zlib.compress, "garbage-gzip": lambda b: b}
header_values = st.text(st.characters(min_codepoint=33, max_codepoint=126), max_size=30)


@st.composite
def requests(draw: st.DrawFn, paths: list[str]) -> tuple[str, str, dict[str, str], bytes]:
    body = draw(bodies)
    FUZZED["http requests"] += 1
    headers = {"Content-Type": draw(st.sampled_from(["application/json", "text/plain", ""]) | header_values)}
    for name in ("X-Request-Id", "X-Viiwork-Host", "X-Session-Id", "X-Viiwork-Origin", "Accept"):
        if draw(st.booleans()):
            headers[name] = draw(header_values)
    encoding = draw(st.sampled_from(sorted(ENCODINGS)))
    if encoding:
        body = ENCODINGS[encoding](body)
        headers["Content-Encoding"] = encoding.removeprefix("garbage-")
    method = draw(st.sampled_from(["POST"] * 8 + ["GET", "PUT"]))
    return method, draw(st.sampled_from(paths)), headers, body


def check_answer(status: int, content_type: str, raw: bytes, seen: Counter[int]) -> None:
    seen[status] += 1
    if content_type.startswith("application/json") and status >= 400:
        err = json.loads(raw)["error"]
        assert set(err) == {"message", "type", "param", "code"}, err
        assert err["code"] is None or isinstance(err["code"], str), err
        if status >= 500:
            assert err["code"] in NOT_OURS, (status, err)
    else:
        assert status < 500, (status, content_type, raw[:300])


def send(conn_factory: Any, state: dict[str, Any], method: str, path: str, headers: dict[str, str],
         body: bytes) -> tuple[int, str, bytes]:
    for attempt in (0, 1):
        conn = state.get("conn") or conn_factory()
        state["conn"] = conn
        try:
            conn.request(method, path, body=body, headers={**headers, "Content-Length": str(len(body))})
            r = conn.getresponse()
            raw = r.read()
            if r.getheader("Connection", "").lower() == "close":
                conn.close()
                state["conn"] = None
            return r.status, r.getheader("Content-Type", ""), raw
        except (http.client.HTTPException, ConnectionError, ssl.SSLError):
            # A kept-alive connection the server closed since (after an answer that ends the
            # connection, or idle): what any client does, one retry on a fresh one.
            conn.close()
            state["conn"] = None
            if attempt:
                raise
    raise AssertionError("unreachable")


@pytest.fixture(scope="module")
def api_thread() -> Iterator[ApiThread]:
    with fake_engine("m", parallel=4, env={"FAKE_TOKENS": "2"}) as engine_port:
        server = ApiThread(engine_port)
        try:
            yield server
        finally:
            server.stop()


API_SEEN: Counter[int] = Counter()


@settings(OVER_HTTP, max_examples=1000)
@given(requests(["/v1/chat/completions", "/v1/completions", "/v1/embeddings"]))
def test_client_api_never_answers_5xx_of_its_own(api_thread: ApiThread, request_: tuple) -> None:
    state = api_thread.__dict__.setdefault("http", {})
    status, content_type, raw = send(lambda: http.client.HTTPConnection("127.0.0.1", api_thread.port, timeout=20),
                                     state, *request_)
    check_answer(status, content_type, raw, API_SEEN)


# --- two real agents: the mesh listener's forward route ---------------------------------------------------

def mesh_section(seeds: list[str]) -> dict:
    return {"trust": "open", "mesh_id": MESH_ID, "listen": "127.0.0.1:0", "advertise": "127.0.0.1",
            "discovery": ["seeds"], "seeds": seeds, "gossip_interval_ms": 100,
            "suspect_after_ms": 2000, "dead_after_ms": 6000}


def mesh_address(agent: Agent) -> str:
    return agent.wait_for(lambda d: bool(d["mesh"]["self"]["mesh"]), 30, "mesh address")["mesh"]["self"]["mesh"]


@pytest.fixture(scope="module")
def agents2(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Agent]]:
    """Agents a (serving only-a) and b (serving only-b), api.max_body_bytes = 8 MiB."""
    tmp = tmp_path_factory.mktemp("agents2")
    binary = fake_engine_binary(tmp / "bin")
    agents: dict[str, Agent] = {}
    seeds: list[str] = []
    with ExitStack() as stack:
        for name in "ab":
            model = {"name": f"only-{name}", "engine": "llamacpp", "path": "/dev/null", "parallel": 2,
                     "backends": 1, "llamacpp": {"binary": str(binary)},
                     "env": {"FAKE_LOAD_S": "0.1", "FAKE_TOKENS": "2"}}
            agents[name] = stack.enter_context(run_agent(
                tmp, [model], name=f"node-{name}",
                extra={"mesh": mesh_section(seeds), "api": {"max_body_bytes": 8 << 20}}))
            if not seeds:
                seeds = [mesh_address(agents[name])]
        for agent in agents.values():
            agent.wait_for(lambda d: all(b["state"] == "healthy" for m in d["models"] for b in m["backends"])
                           and d.get("mesh", {}).get("peers", {}).get("alive", 0) == 1, 30,
                           "backends healthy and the peer alive")
        yield agents


def mesh_client_context(directory: Path) -> ssl.SSLContext:
    """An open-mesh client certificate for MESH_ID: what a peer presents on the mesh listener."""
    identity = load_or_create_identity(directory)
    cert = directory / "client.crt"
    cert.write_bytes(issue_open_certificate(identity, "fuzz-peer", MESH_ID))
    ca_pem = open_mesh_ca(MESH_ID)[1].public_bytes(serialization.Encoding.PEM)
    return tls.client_context(cert, identity.key_path, ca_pem)


def big_chat(model: str, size: int) -> bytes:
    return json.dumps({"model": model, "max_tokens": 2,
                       "messages": [{"role": "user", "content": "x" * size}]}).encode()


async def test_5mb_request_runs_locally_and_through_a_peer(agents2: dict[str, Agent]) -> None:
    a = agents2["a"]
    async with aiohttp.ClientSession() as client:
        for model, node in (("only-a", "node-a"), ("only-b", "node-b")):
            async with client.post(f"{a.url}/v1/chat/completions", data=big_chat(model, 5 << 20),
                                   headers={"Content-Type": "application/json"}) as r:
                assert r.status == 200, await r.text()
                assert r.headers["X-Viiwork-Node"] == node
                assert (await r.json())["choices"][0]["message"]["content"]
        async with client.post(f"{a.url}/v1/chat/completions", data=big_chat("only-b", 9 << 20),
                               headers={"Content-Type": "application/json"}) as r:
            assert r.status == 413 and (await r.json())["error"]["code"] == "body_too_large"


async def test_forward_route_limits(agents2: dict[str, Agent], tmp_path: Path) -> None:
    """A peer's forward: 5 MB accepted, over api.max_body_bytes 413, too deep 400 naming the limit."""
    ctx = mesh_client_context(tmp_path / "peer")
    base = f"https://{mesh_address(agents2['b'])}/v1/chat/completions"
    cases = [(big_chat("only-b", 5 << 20), 200, None), (big_chat("only-b", 9 << 20), 413, "body_too_large"),
             (b"[" * 1000, 400, "json_too_deep"), (b'{"model": "only-b", "x": ' + b"{\"k\":" * 100 + b"1" +
                                                   b"}" * 100 + b"}", 400, "json_too_deep")]
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(ssl=ctx)) as peer:
        for data, status, code in cases:
            async with peer.post(base, data=data, headers={"Content-Type": "application/json"}) as r:
                assert r.status == status, (data[:40], await r.text())
                if code is not None:
                    err = (await r.json())["error"]
                    assert err["code"] == code and "forwarded request is malformed" in err["message"]
                    if code == "json_too_deep":
                        assert "64" in err["message"]


MESH_SEEN: Counter[int] = Counter()


@settings(OVER_HTTP, max_examples=500)
@given(requests(["/v1/chat/completions", "/v1/completions", "/v1/embeddings"]))
def test_mesh_forward_route_never_answers_5xx_of_its_own(agents2: dict[str, Agent], tmp_path_factory: Any,
                                                         request_: tuple) -> None:
    b = agents2["b"]
    state = b.__dict__.setdefault("fuzz", {})
    if "ctx" not in state:
        state["ctx"] = mesh_client_context(tmp_path_factory.mktemp("peer"))
        state["address"] = mesh_address(b).rsplit(":", 1)
    host, port = state["address"]
    method, path, headers, body = request_
    if headers.get("X-Request-Id"):
        headers["X-Request-Id"] = headers["X-Request-Id"].replace("only", "x")
    if body.startswith(b'{"model": "m"'):
        body = body.replace(b'"m"', b'"only-b"', 1)  # reach the engine too
    status, content_type, raw = send(
        lambda: http.client.HTTPSConnection(host, int(port), context=state["ctx"], timeout=20),
        state, method, path, headers, body)
    check_answer(status, content_type, raw, MESH_SEEN)
    assert b.proc.poll() is None


@pytest.fixture(scope="module", autouse=True)
def fuzz_report() -> Iterator[None]:
    """Prints what was checked (run with -s): the figures of docs/reliability.md."""
    yield
    print(f"\nfuzzed: {dict(FUZZED)}; total {sum(FUZZED.values())}; HTTP statuses: client API "
          f"{dict(sorted(API_SEEN.items()))}, mesh forward {dict(sorted(MESH_SEEN.items()))}")
