"""Client keys between two real agents on loopback: a forward carries the key, and the serving
node verifies it again with its own Verifier (issue 17 item 5; docs/security.md, "Client keys").

Node B serves the only model; node A is the origin. B holds a revocation list that A cannot
take: mid-rotation, the list is signed by the issuer's next key, which only B has installed yet
(A fetches it from B, as every node fetches a newer list a peer publishes, and refuses it as
``unknown_kid``). A key revoked there passes A's check, and B refuses the forward with 401
``revoked``, which A relays. A good key runs on B, and B's engine never sees the key.
"""

from __future__ import annotations

import json
import shutil
import tempfile
import time
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path

import pytest

from support.agent import Agent, run_agent
from support.client_keys import bearer, chat, ctl, issue, jti_of, request
from support.engines import fake_engine_binary
from viiwork.agent.auth.claims import KeyClaims
from viiwork.agent.auth.issuing import load_issuer, new_jti, sign_key
from viiwork.agent.auth.jws import MAX_TOKEN_BYTES
from viiwork.agent.auth.keyset import KeySet
from viiwork.agent.auth.revocations import RevocationStore

pytestmark = pytest.mark.timeout(120)

MESH_ID = "keys-mesh"


def mesh_section(seeds: list[str]) -> dict:
    return {"trust": "open", "mesh_id": MESH_ID, "listen": "127.0.0.1:0", "advertise": "127.0.0.1",
            "discovery": ["seeds"], "seeds": seeds, "gossip_interval_ms": 100, "suspect_after_ms": 1000,
            "dead_after_ms": 3000}


def longest_key(key: Path) -> str:
    """A key of MAX_TOKEN_BYTES (8192) characters (a long model list): its header lines, at
    the origin and in the forward, are over aiohttp's default limit of 8190 bytes."""
    issuer = load_issuer(key)
    for pad in range(1, 128):
        models = ("only-b", *(f"model-{i:03d}-" + "x" * 100 for i in range(51)), "p" * pad)
        token = sign_key(issuer, KeyClaims(iss=issuer.name, aud=(MESH_ID,), jti=new_jti(), exp=int(time.time()) + 3600,
                                           tenant="acme", models=models))
        if len(token) == MAX_TOKEN_BYTES:
            return token
    raise AssertionError("no padding gives a key of MAX_TOKEN_BYTES")


@pytest.fixture(scope="module")
def mesh2() -> Iterator[tuple[Agent, Agent, dict[str, str]]]:
    tmp = Path(tempfile.mkdtemp(prefix="viiwork-keys-mesh-", dir="/tmp"))
    try:
        ctl("keys", "issuer", "init", "--out", str(tmp / "issuer"))
        key, pub = tmp / "issuer" / "issuer.key", tmp / "issuer" / "issuer.pub"
        tokens = {"good": issue(key, "--scope", "inference,read", audience=MESH_ID),
                  "revoked_at_b": issue(key, audience=MESH_ID), "longest": longest_key(key)}
        # The issuer's next key (a rotation): B has its public half installed, A not yet.
        ctl("keys", "issuer", "init", "--out", str(tmp / "next"))
        keys_b = tmp / "keys-b"
        keys_b.mkdir()
        shutil.copy(pub, keys_b / "current.pub")
        shutil.copy(tmp / "next" / "issuer.pub", keys_b / "next.pub")
        revocations = tmp / "revocations.jwt"
        ctl("keys", "revoke", "--issuer-key", str(tmp / "next" / "issuer.key"), "--id", jti_of(tokens["revoked_at_b"]),
            "--out", str(revocations), "--audience", MESH_ID)
        (tmp / "node-b").mkdir(mode=0o700)
        RevocationStore(tmp / "node-b", KeySet.from_path(keys_b), issuer="viiwork-issuer",
                        audiences=[MESH_ID]).offer(revocations.read_text().strip())
        binary = fake_engine_binary(tmp / "bin")
        auth = {"mode": "keys", "issuer_keys": str(pub), "allow_open_mesh": True}
        auth_b = {**auth, "issuer_keys": str(keys_b)}
        with ExitStack() as stack:
            b = stack.enter_context(run_agent(
                tmp, [{"name": "only-b", "engine": "llamacpp", "path": "/dev/null", "parallel": 2, "backends": 1,
                       "llamacpp": {"binary": str(binary)}}],
                name="node-b", extra={"mesh": mesh_section([]), "auth": auth_b}, api_key=tokens["good"]))
            seed = b.wait_for(lambda d: bool(d["mesh"]["self"]["mesh"]), 30, "mesh address")["mesh"]["self"]["mesh"]
            a = stack.enter_context(run_agent(tmp, [], name="node-a",
                                              extra={"mesh": mesh_section([seed]), "auth": auth},
                                              api_key=tokens["good"]))
            b.wait_healthy("only-b")
            a.wait_for(lambda d: d["mesh"]["peers"].get("alive", 0) == 1, 30, "node-b alive")
            yield a, b, tokens
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def test_a_forward_carries_the_key_and_runs_on_the_peer(mesh2: tuple[Agent, Agent, dict[str, str]]) -> None:
    a, b, tokens = mesh2
    for _ in range(3):
        status, body, headers = request(f"{a.url}/v1/chat/completions", chat("only-b"), bearer(tokens["good"]))
        assert status == 200, body
        assert headers["x-viiwork-node"] == "node-b"
    stats = b.engine_stats("only-b")
    assert set(stats["authorizations"]) == {b.engine_headers("only-b")["Authorization"]}
    assert tokens["good"] not in json.dumps(stats)
    assert tokens["good"] not in a.log_text() and tokens["good"] not in b.log_text()


def test_a_key_of_the_largest_size_passes_both_listeners(mesh2: tuple[Agent, Agent, dict[str, str]]) -> None:
    """The client API's and the mesh listener's parsers take a header line above the key's
    8 KiB (agent/serving/api.py PARSER_MAX_FIELD_BYTES, mesh/transport.py
    MAX_HEADER_FIELD_BYTES): the longest key a client may hold runs across the hop."""
    a, _, tokens = mesh2
    for headers in (bearer(tokens["longest"]), {"x-api-key": tokens["longest"]}):
        status, body, got = request(f"{a.url}/v1/chat/completions", chat("only-b"), headers)
        assert status == 200, body
        assert got["x-viiwork-node"] == "node-b"


def test_the_serving_node_verifies_the_key_again(mesh2: tuple[Agent, Agent, dict[str, str]]) -> None:
    a, b, tokens = mesh2
    # A fetched B's list (B publishes a higher version) and refused it: signed by a key A lacks.
    a.wait_for(lambda d: d["revocations"]["refused"].get("unknown_kid", 0) >= 1, 10, "A refused B's list")
    assert a.status()["revocations"]["version"] == 0
    # B knows the key is revoked; A does not, admits it and forwards it: B refuses.
    status, body, _ = request(f"{a.url}/v1/chat/completions", chat("only-b"), bearer(tokens["revoked_at_b"]))
    assert status == 401, body
    assert body["error"]["code"] == "invalid_api_key" and "(revoked)" in body["error"]["message"]
    assert jti_of(tokens["revoked_at_b"]) in b.log_text()
    # And B itself refuses it to a client at once.
    assert request(f"{b.url}/v1/chat/completions", chat("only-b"), bearer(tokens["revoked_at_b"]))[0] == 401


def test_keys_in_an_open_mesh_warn_at_start(mesh2: tuple[Agent, Agent, dict[str, str]]) -> None:
    """auth.allow_open_mesh lets keys mode run with trust = "open"; each agent says at start what
    that costs (issue 17 item 5; the doctor's `auth` check is degraded for it, tests/unit/test_doctor.py)."""
    for agent in mesh2[:2]:
        assert "client keys are on in an open mesh (auth.allow_open_mesh)" in agent.log_text()
        assert f"mesh id '{MESH_ID}'" in agent.log_text()
