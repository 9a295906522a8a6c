"""Client keys enforced by a real agent on loopback (issue 17 items 4 and 9; docs/security.md, "Client keys").

One agent process in keys mode runs the fake llama-server; keys are made by the real
``viiworkctl keys`` (issuer init, issue, revoke) or, for tokens no issuer would sign (expired,
``alg: none``), by the issuing module and by hand. Every refusal goes through HTTP: 401
``invalid_api_key`` per reason, 403 for a model or scope, 429 with OpenAI's headers after the
key's rpm and at its concurrency; the key never reaches the engine (which records the headers
it receives) nor the agent's log.
"""

from __future__ import annotations

import asyncio
import base64
import http.client
import json
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.parse
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import aiohttp
import pytest

from support.agent import Agent, run_agent
from support.client_keys import AUD, bearer, chat, ctl, issue, jti_of, request
from support.engines import fake_engine_binary
from viiwork.agent.auth.claims import KeyClaims
from viiwork.agent.auth.headers import MAX_HEADER_BYTES
from viiwork.agent.auth.issuing import load_issuer, new_jti, sign_key
from viiwork.agent.auth.keyset import KeySet
from viiwork.agent.auth.revocations import RevocationStore

pytestmark = pytest.mark.timeout(120)

class Keys:
    """The issuer of the module's agent, and keys of each kind."""

    def __init__(self, directory: Path) -> None:
        ctl("keys", "issuer", "init", "--out", str(directory))
        self.key = directory / "issuer.key"
        self.pub = directory / "issuer.pub"
        self.good = issue(self.key, "--scope", "inference,read")
        self.limited_models = issue(self.key, "--models", "m")
        self.reader = issue(self.key, "--scope", "read")
        self.inference_only = issue(self.key)
        self.revoked = issue(self.key)
        self.other_audience = issue(self.key, audience="some-other-mesh")
        self.rpm3 = issue(self.key, "--rpm", "3")
        self.concurrency1 = issue(self.key, "--concurrency", "1")
        self.tpm100 = issue(self.key, "--tpm", "100")
        self.tpm100_streams = issue(self.key, "--tpm", "100")
        self.tpm100_cut = issue(self.key, "--tpm", "100")
        self.tpm100_null = issue(self.key, "--tpm", "100")
        issuer = load_issuer(self.key)
        claims = KeyClaims(iss=issuer.name, aud=(AUD,), jti=new_jti(), exp=int(time.time()) - 3600, tenant="acme")
        self.expired = sign_key(issuer, claims)
        head = base64.urlsafe_b64encode(json.dumps({"alg": "none", "typ": "JWT"}).encode()).rstrip(b"=").decode()
        body = base64.urlsafe_b64encode(json.dumps(replace(claims, exp=int(time.time()) + 3600).to_payload())
                                        .encode()).rstrip(b"=").decode()
        self.alg_none = f"{head}.{body}."


@pytest.fixture(scope="module")
def keyed() -> Iterator[tuple[Agent, Keys]]:
    tmp = Path(tempfile.mkdtemp(prefix="viiwork-auth-", dir="/tmp"))
    try:
        keys = Keys(tmp / "issuer")
        # The revocation list, as `keys revoke` writes it, given to the node's store before it starts.
        revocations = tmp / "revocations.jwt"
        ctl("keys", "revoke", "--issuer-key", str(keys.key), "--id", jti_of(keys.revoked), "--out", str(revocations))
        state = tmp / "node-a"
        state.mkdir(mode=0o700)
        RevocationStore(state, KeySet.from_path(keys.pub), issuer="viiwork-issuer",
                        audiences=[AUD]).offer(revocations.read_text().strip())
        binary = fake_engine_binary(tmp / "bin")
        models = [{"name": name, "engine": "llamacpp", "path": "/dev/null", "parallel": 4, "backends": 1,
                   "llamacpp": {"binary": str(binary)}, "env": {"FAKE_TOKENS": "4"}} for name in ("m", "other")]
        # About 2 s per answer: a request that stays in flight while another is sent.
        models.append({**models[0], "name": "slow", "env": {"FAKE_TOKENS": "20", "FAKE_TOKEN_DELAY_S": "0.1"}})
        with run_agent(tmp, models, extra={"auth": {"mode": "keys", "issuer_keys": str(keys.pub)}},
                       api_key=keys.good) as agent:
            agent.wait_healthy("m")
            agent.wait_healthy("other")
            agent.wait_healthy("slow")
            yield agent, keys
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


@pytest.mark.parametrize("kind", ["missing", "expired", "revoked", "wrong_audience", "bad_alg", "malformed"])
def test_each_bad_key_is_a_401_invalid_api_key(keyed: tuple[Agent, Keys], kind: str) -> None:
    agent, keys = keyed
    headers = {
        "missing": {},
        "expired": bearer(keys.expired),
        "revoked": bearer(keys.revoked),
        "wrong_audience": bearer(keys.other_audience),
        "bad_alg": bearer(keys.alg_none),
        "malformed": {"Authorization": "Basic dXNlcjpwYXNz"},
    }[kind]
    status, body, _ = request(f"{agent.url}/v1/chat/completions", chat(), headers)
    assert status == 401, body
    assert body["error"]["code"] == "invalid_api_key"
    assert body["error"]["type"] == "authentication_error"
    assert f"({kind})" in body["error"]["message"]
    # Counted by reason, on /metrics.
    _, metrics, _ = request(f"{agent.url}/metrics", headers=bearer(keys.good))
    assert f'viiwork_auth_refused_total{{reason="{kind}"}}' in metrics["text"]


def test_a_valid_key_answers_through_bearer_and_x_api_key(keyed: tuple[Agent, Keys]) -> None:
    agent, keys = keyed
    status, body, _ = request(f"{agent.url}/v1/chat/completions", chat(), bearer(keys.good))
    assert status == 200, body
    status, body, _ = request(f"{agent.url}/v1/chat/completions", chat(), {"x-api-key": keys.good})
    assert status == 200, body


def _raw_post(url: str, headers: list[tuple[str, str]]) -> tuple[int, str, dict]:
    """POST a chat body with ``headers`` sent as given, repeated names included (urllib folds them)."""
    parts = urllib.parse.urlsplit(url)
    conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=10)
    try:
        body = json.dumps(chat()).encode()
        conn.putrequest("POST", parts.path)
        for name, value in [("Content-Type", "application/json"), ("Content-Length", str(len(body))), *headers]:
            conn.putheader(name, value)
        conn.endheaders(body)
        resp = conn.getresponse()
        raw = resp.read().decode(errors="replace")
        return resp.status, resp.getheader("Content-Type") or "", json.loads(raw) if raw.startswith("{") else {"text": raw}
    finally:
        conn.close()


@pytest.mark.parametrize("repeated", ["authorization_then_garbage", "authorization_twice_same", "x_api_key_two_keys"])
def test_a_repeated_key_header_is_refused_as_malformed(keyed: tuple[Agent, Keys], repeated: str) -> None:
    agent, keys = keyed
    headers = {
        "authorization_then_garbage": [("Authorization", f"Bearer {keys.good}"), ("Authorization", "garbage")],
        "authorization_twice_same": [("Authorization", f"Bearer {keys.good}")] * 2,
        "x_api_key_two_keys": [("x-api-key", keys.good), ("X-Api-Key", keys.reader)],
    }[repeated]
    status, _, body = _raw_post(f"{agent.url}/v1/chat/completions", headers)
    assert status == 401, body
    assert body["error"]["code"] == "invalid_api_key"
    assert "(malformed)" in body["error"]["message"]
    # One copy of each is still fine.
    status, _, body = _raw_post(f"{agent.url}/v1/chat/completions", headers[:1])
    assert status == 200, body


@pytest.mark.parametrize("name", ["Authorization", "x-api-key"])
def test_a_key_header_over_the_limit_is_an_openai_shaped_401(keyed: tuple[Agent, Keys], name: str) -> None:
    """Our 8 KiB limit decides, not aiohttp's 8190-byte header line (agent/serving/api.py,
    PARSER_MAX_FIELD_BYTES): a value just over MAX_HEADER_BYTES is the JSON 401 malformed."""
    agent, _ = keyed
    value = ("Bearer " if name == "Authorization" else "") + "a" * MAX_HEADER_BYTES
    status, content_type, body = _raw_post(f"{agent.url}/v1/chat/completions", [(name, value)])
    assert status == 401 and content_type.startswith("application/json"), (status, content_type, body)
    assert body["error"]["code"] == "invalid_api_key" and "(malformed)" in body["error"]["message"]


def test_model_outside_the_key_is_403_and_models_lists_only_its_own(keyed: tuple[Agent, Keys]) -> None:
    agent, keys = keyed
    status, body, _ = request(f"{agent.url}/v1/chat/completions", chat("other"), bearer(keys.limited_models))
    assert status == 403 and body["error"]["code"] == "model_not_allowed", body
    status, body, _ = request(f"{agent.url}/v1/chat/completions", chat("m"), bearer(keys.limited_models))
    assert status == 200, body
    status, body, _ = request(f"{agent.url}/v1/models", headers=bearer(keys.limited_models))
    assert status == 200 and [m["id"] for m in body["data"]] == ["m"]
    status, body, _ = request(f"{agent.url}/v1/models", headers=bearer(keys.good))
    assert status == 200 and [m["id"] for m in body["data"]] == ["m", "other", "slow"]
    assert request(f"{agent.url}/v1/models")[0] == 401


def test_scopes_inference_and_read(keyed: tuple[Agent, Keys]) -> None:
    agent, keys = keyed
    # A read-only key cannot run inference ...
    status, body, _ = request(f"{agent.url}/v1/chat/completions", chat(), bearer(keys.reader))
    assert status == 403 and body["error"]["code"] == "permission_denied", body
    # ... and the reads need the read scope: none without a key, 403 with an inference-only one.
    for path in ("/v1/status", "/metrics", "/ui/api/state"):
        assert request(f"{agent.url}{path}")[0] == 401, path
        assert request(f"{agent.url}{path}", headers=bearer(keys.inference_only))[0] == 403, path
        assert request(f"{agent.url}{path}", headers=bearer(keys.reader))[0] == 200, path
    status, body, _ = request(f"{agent.url}/health")
    assert status == 200 and body["status"] == "ok"  # open
    # The dashboard's page and files hold no data: open, so the page can ask for a read key.
    for path in ("/ui", "/ui/static/dashboard.js"):
        assert request(f"{agent.url}{path}")[0] == 200, path


def test_rpm_refuses_with_openai_headers(keyed: tuple[Agent, Keys]) -> None:
    agent, keys = keyed
    answers = [request(f"{agent.url}/v1/chat/completions", chat(), bearer(keys.rpm3)) for _ in range(5)]
    statuses = [s for s, _, _ in answers]
    # A window (the wall-clock minute) may end between two requests: at most one more passes then.
    assert statuses.count(429) >= 1 and statuses[:3] == [200, 200, 200], statuses
    ok_headers = answers[0][2]
    assert ok_headers["x-ratelimit-limit-requests"] == "3"
    assert ok_headers["x-ratelimit-remaining-requests"] == "2"
    assert ok_headers["x-ratelimit-reset-requests"].endswith("s")
    status, body, headers = next(a for a in answers if a[0] == 429)
    assert body["error"]["code"] == "rate_limit_exceeded" and body["error"]["type"] == "rate_limit_error"
    assert 1 <= int(headers["retry-after"]) <= 60
    assert headers["x-ratelimit-limit-requests"] == "3" and headers["x-ratelimit-remaining-requests"] == "0"
    assert "x-ratelimit-reset-requests" in headers


def test_tpm_debits_the_estimate_then_the_engines_usage(keyed: tuple[Agent, Keys]) -> None:
    agent, keys = keyed
    # Estimated: 1 (2 characters / 4, rounded up) + max_tokens 50 = 51; the fake engine's usage
    # says 12 (8 prompt + 4 completion). On the estimate alone a second request would pass 100.
    first = request(f"{agent.url}/v1/chat/completions", chat(max_tokens=50), bearer(keys.tpm100))
    assert first[0] == 200 and first[1]["usage"]["total_tokens"] == 12, first[1]
    assert first[2]["x-ratelimit-limit-tokens"] == "100" and first[2]["x-ratelimit-remaining-tokens"] == "49"
    second = request(f"{agent.url}/v1/chat/completions", chat(max_tokens=50), bearer(keys.tpm100))
    # 100 - 12 - 51 = 37 (49 when the wall-clock minute ended between the two requests).
    assert second[0] == 200, second[1]
    assert second[2]["x-ratelimit-remaining-tokens"] in ("37", "49"), second[2]


async def test_tpm_debits_a_streams_real_usage_its_client_did_not_ask_for(keyed: tuple[Agent, Keys]) -> None:
    agent, keys = keyed
    # As above, streamed: the agent asked the engine for the usage event (the client did not
    # and gets none), and debits its 12 tokens. On the estimate alone the second would be refused.
    async with aiohttp.ClientSession(headers=bearer(keys.tpm100_streams)) as http:
        remaining = []
        for _ in range(2):
            async with http.post(f"{agent.url}/v1/chat/completions", json=chat(stream=True, max_tokens=50)) as r:
                assert r.status == 200, await r.text()
                text = await r.text()
                remaining.append(r.headers["x-ratelimit-remaining-tokens"])
            assert text.rstrip().endswith("data: [DONE]") and '"usage"' not in text, text
    assert remaining[0] == "49" and remaining[1] in ("37", "49"), remaining


async def test_a_stream_without_max_tokens_may_use_what_is_left_and_a_cut_one_is_charged(
        keyed: tuple[Agent, Keys]) -> None:
    agent, keys = keyed
    url = f"{agent.url}/v1/chat/completions"
    if 60 - time.time() % 60 < 10:  # the whole test in one window (the wall-clock minute)
        await asyncio.sleep(60 - time.time() % 60 + 0.2)
    async with aiohttp.ClientSession(headers=bearer(keys.tpm100_cut)) as http:
        # No max_tokens: estimated at what the key has left (100), so one such request at a time.
        first = await http.post(url, json=chat("slow", stream=True))
        assert first.status == 200 and first.headers["x-ratelimit-remaining-tokens"] == "0", first.headers
        async with http.post(url, json=chat("slow", stream=True)) as second:
            assert second.status == 429, await second.text()
            assert (await second.json())["error"]["code"] == "rate_limit_exceeded"
        # The client reads 10 of the 20 content events and leaves before the usage event.
        seen = 0
        while seen < 10:
            line = await first.content.readline()
            assert line, "the stream ended early"
            seen += b'"content":"' in line
        first.close()
        # Charged what was relayed (the role event and 10 or a few more content events, plus
        # the prompt's 1), not the estimate: 100 - (12..16) - 2 (this request's estimate) left.
        for _ in range(100):
            async with http.post(url, json=chat(max_tokens=1)) as third:
                if third.status == 200:
                    break
            await asyncio.sleep(0.05)
        assert third.status == 200, "the cut stream kept its key's whole minute"
        assert 82 <= int(third.headers["x-ratelimit-remaining-tokens"]) <= 86, third.headers


@pytest.mark.parametrize(("field", "value", "code"), [
    ("max_tokens", -100, "integer_below_min_value"), ("max_completion_tokens", -1000, "integer_below_min_value"),
    ("max_tokens", 0, "integer_below_min_value"), ("max_tokens", 1.5, "invalid_type"),
    ("n", 0, "integer_below_min_value"), ("max_completion_tokens", "9", "invalid_type")])
def test_a_count_below_1_or_not_an_integer_is_a_400_naming_it(keyed: tuple[Agent, Keys], field: str,
                                                               value: object, code: str) -> None:
    agent, keys = keyed
    status, body, _ = request(f"{agent.url}/v1/chat/completions", chat(**{field: value}), bearer(keys.good))
    assert status == 400, body
    assert body["error"]["type"] == "invalid_request_error" and body["error"]["param"] == field, body
    assert body["error"]["code"] == code, body


def test_a_null_max_tokens_does_not_hide_max_completion_tokens(keyed: tuple[Agent, Keys]) -> None:
    agent, keys = keyed
    status, body, _ = request(f"{agent.url}/v1/chat/completions",
                              chat(max_tokens=None, max_completion_tokens=1000), bearer(keys.tpm100_null))
    assert status == 429 and "about 1001" in body["error"]["message"], body


async def test_concurrency_refuses_the_second_request_in_flight(keyed: tuple[Agent, Keys]) -> None:
    agent, keys = keyed
    async with aiohttp.ClientSession(headers=bearer(keys.concurrency1)) as http:
        # A stream held open (not read) keeps the first request in flight.
        async with http.post(f"{agent.url}/v1/chat/completions", json=chat("slow", stream=True)) as first:
            assert first.status == 200
            async with http.post(f"{agent.url}/v1/chat/completions", json=chat()) as second:
                assert second.status == 429, await second.text()
                assert "Retry-After" in second.headers
                assert "in flight" in (await second.json())["error"]["message"]
            await first.read()
        # Once it ended the key may send again.
        for _ in range(50):
            async with http.post(f"{agent.url}/v1/chat/completions", json=chat()) as again:
                if again.status == 200:
                    break
            await asyncio.sleep(0.05)
        assert again.status == 200


def test_the_key_reaches_neither_the_engine_nor_the_log(keyed: tuple[Agent, Keys]) -> None:
    agent, keys = keyed
    assert request(f"{agent.url}/v1/chat/completions", chat(), bearer(keys.good))[0] == 200
    assert request(f"{agent.url}/v1/chat/completions", chat(), {"x-api-key": keys.good})[0] == 200
    request(f"{agent.url}/v1/chat/completions", chat(), bearer(keys.revoked))  # a refusal is logged
    stats = agent.engine_stats("m")
    engine_key = agent.engine_headers("m")["Authorization"]
    assert stats["authorizations"] and set(stats["authorizations"]) == {engine_key}
    assert set(stats["x_api_keys"]) == {""}
    log = agent.log_text()
    for token in (keys.good, keys.revoked):
        assert token not in log and token.split(".")[2] not in log
    assert jti_of(keys.revoked) in log  # the refusal names the key by its id


def test_the_openai_sdk_with_api_key(keyed: tuple[Agent, Keys]) -> None:
    openai = pytest.importorskip("openai")
    agent, keys = keyed
    client = openai.OpenAI(base_url=f"{agent.url}/v1", api_key=keys.good, max_retries=0)
    answer = client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}])
    assert answer.choices[0].message.content
    refused = openai.OpenAI(base_url=f"{agent.url}/v1", api_key=keys.revoked, max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        refused.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}])


def test_a_node_alone_takes_a_pushed_list_at_once(keyed: tuple[Agent, Keys]) -> None:
    """keys push-revocations on a node without a mesh: taken without a restart, nothing to push to."""
    agent, keys = keyed
    token = issue(keys.key)
    assert request(f"{agent.url}/v1/models", None, bearer(token))[0] == 200
    listed = keys.key.parent / "next.jwt"
    ctl("keys", "revoke", "--issuer-key", str(keys.key), "--id", jti_of(token), "--out", str(listed))
    assert agent.state_dir is not None
    out = ctl("keys", "push-revocations", str(listed), "--socket", str(agent.state_dir / "admin.sock"))
    assert "revocation list version 2 taken: 2 revoked key(s); pushed to 0 peer(s)" in out, out
    for revoked in (token, keys.revoked):
        status, body, _ = request(f"{agent.url}/v1/models", None, bearer(revoked))
        assert status == 401 and "(revoked)" in body["error"]["message"], body
    assert agent.status()["auth"]["revocations_version"] == 2
    # The same list pushed again (a retried push) is already held: no error, as in a mesh.
    again = ctl("keys", "push-revocations", str(listed), "--socket", str(agent.state_dir / "admin.sock"))
    assert "version 2 already held" in again, again


def test_no_issuer_key_starts_and_says_how_to_install_one(tmp_path: Path) -> None:
    binary = fake_engine_binary(tmp_path / "bin")
    models = [{"name": "m", "engine": "llamacpp", "path": "/dev/null", "parallel": 1, "backends": 1,
               "llamacpp": {"binary": str(binary)}}]
    missing = tmp_path / "nowhere" / "issuer.pub"
    with run_agent(tmp_path, models, extra={"auth": {"mode": "keys", "issuer_keys": str(missing),
                                                     "open_loopback_reads": True}}) as agent:
        status, body, _ = request(f"{agent.url}/v1/chat/completions", chat(), bearer("a.b.c"))
        assert status == 401 and body["error"]["code"] == "invalid_api_key"
        assert "docs/install.md" in body["error"]["message"] and str(missing) in body["error"]["message"]
        # open_loopback_reads: this client is on loopback, so /v1/status answers without a key.
        status, doc, _ = request(f"{agent.url}/v1/status")
        assert status == 200 and doc["auth"]["issuer_key"] is False
        assert request(f"{agent.url}/health")[0] in (200, 503)
        # Nor can it take a revocation list: the command says why.
        listed = tmp_path / "list.jwt"
        listed.write_text("a.b.c\n")
        assert agent.state_dir is not None
        done = subprocess.run([sys.executable, "-m", "viiwork.agent.cli", "keys", "push-revocations", str(listed),
                               "--socket", str(agent.state_dir / "admin.sock")], capture_output=True, text=True,
                              timeout=30)
        assert done.returncode == 1 and "takes no revocation list" in done.stderr, done.stderr


def test_mode_none_beyond_loopback_warns_at_start(tmp_path: Path) -> None:
    with run_agent(tmp_path, []) as agent:  # listens on 127.0.0.1: no warning
        assert "client keys are off" not in agent.log_text()
    config = tmp_path / "wide.toml"
    state = tmp_path / "wide"
    config.write_text(f'[node]\nname = "wide"\nstate_dir = "{state}"\n[api]\nlisten = "0.0.0.0:0"\n'
                      f'admin_socket = "{state}/admin.sock"\n[supervisor]\nrunner = "process"\n')
    proc = subprocess.Popen([str(Path(sys.executable).parent / "viiwork-agent"), "--config", str(config)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        assert proc.stdout is not None
        seen = ""
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and "API listening" not in seen:
            seen += proc.stdout.readline()
        assert "client keys are off" in seen, seen
    finally:
        proc.terminate()
        proc.wait(30)


def test_the_anthropic_sdk_gets_the_keys_refusals_in_anthropics_shape(keyed: tuple[Agent, Keys]) -> None:
    anthropic = pytest.importorskip("anthropic")
    agent, keys = keyed
    hello = [{"role": "user", "content": "hi"}]
    revoked = anthropic.Anthropic(base_url=agent.url, api_key=keys.revoked, max_retries=0)  # sends x-api-key
    with pytest.raises(anthropic.AuthenticationError) as unauthenticated:
        revoked.messages.create(model="m", max_tokens=4, messages=hello)
    assert unauthenticated.value.body["type"] == "error"
    assert unauthenticated.value.body["error"]["type"] == "authentication_error"
    assert "(revoked)" in unauthenticated.value.body["error"]["message"]
    limited = anthropic.Anthropic(base_url=agent.url, api_key=keys.limited_models, max_retries=0)
    with pytest.raises(anthropic.PermissionDeniedError) as forbidden:
        limited.messages.count_tokens(model="other", messages=hello)
    assert forbidden.value.body == {"type": "error", "error": {"type": "permission_error",
                                                               "message": forbidden.value.body["error"]["message"]}}
    assert "'other'" in forbidden.value.body["error"]["message"]
