"""Usage rows across two real agents on loopback, client keys on (issue 17 item 8; docs/usage.md).

Node A (the origin) serves ``only-a``, node B serves ``only-b``. Each request has one row, on
the node that served it: a local request on A, with no origin; a request A forwards to B on B,
with A's node id as its origin, and none on A. A stream whose client did not ask for usage gets
no usage event from either node while B's row has the engine's counts. Rows name the key's
tenant and id, never the key.
"""

from __future__ import annotations

import json
import shutil
import tempfile
import urllib.request
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path

import pytest

from support.agent import Agent, run_agent
from support.client_keys import bearer, chat, ctl, issue, jti_of, request
from support.engines import fake_engine_binary
from support.ledger_rows import rows

pytestmark = pytest.mark.timeout(120)

MESH_ID = "usage-mesh"


def mesh_section(seeds: list[str]) -> dict:
    return {"trust": "open", "mesh_id": MESH_ID, "listen": "127.0.0.1:0", "advertise": "127.0.0.1",
            "discovery": ["seeds"], "seeds": seeds, "gossip_interval_ms": 100, "suspect_after_ms": 1000,
            "dead_after_ms": 3000}


def model(binary: Path, name: str) -> dict:
    return {"name": name, "engine": "llamacpp", "path": "/dev/null", "parallel": 2, "backends": 1,
            "llamacpp": {"binary": str(binary)}, "env": {"FAKE_LOAD_S": "0.1"}}


@pytest.fixture(scope="module")
def mesh2() -> Iterator[tuple[Agent, Agent, str]]:
    tmp = Path(tempfile.mkdtemp(prefix="viiwork-usage-mesh-", dir="/tmp"))
    try:
        ctl("keys", "issuer", "init", "--out", str(tmp / "issuer"))
        key, pub = tmp / "issuer" / "issuer.key", tmp / "issuer" / "issuer.pub"
        token = issue(key, "--scope", "inference,read", tenant="acme", audience=MESH_ID)
        binary = fake_engine_binary(tmp / "bin")
        auth = {"mode": "keys", "issuer_keys": str(pub), "allow_open_mesh": True}
        with ExitStack() as stack:
            b = stack.enter_context(run_agent(tmp, [model(binary, "only-b")], name="node-b",
                                              extra={"mesh": mesh_section([]), "auth": auth}, api_key=token))
            seed = b.wait_for(lambda d: bool(d["mesh"]["self"]["mesh"]), 30, "mesh address")["mesh"]["self"]["mesh"]
            a = stack.enter_context(run_agent(tmp, [model(binary, "only-a")], name="node-a",
                                              extra={"mesh": mesh_section([seed]), "auth": auth}, api_key=token))
            b.wait_healthy("only-b")
            a.wait_healthy("only-a")
            a.wait_for(lambda d: d["mesh"]["peers"].get("alive", 0) == 1, 30, "node-b alive")
            yield a, b, token
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def stream(agent: Agent, token: str, doc: dict, request_id: str) -> list[dict]:
    req = urllib.request.Request(agent.url + "/v1/chat/completions", data=json.dumps(doc).encode(), method="POST",
                                 headers={"Content-Type": "application/json", "X-Request-Id": request_id,
                                          **bearer(token)})
    with urllib.request.urlopen(req, timeout=20) as r:
        lines = [line[6:].strip() for line in r.read().decode().split("\n") if line.startswith("data: ")]
    assert lines[-1] == "[DONE]", lines
    return [json.loads(line) for line in lines[:-1]]


def test_one_row_per_request_on_the_serving_node(mesh2: tuple[Agent, Agent, str]) -> None:
    a, b, token = mesh2
    a_id, b_id = a.status()["mesh"]["self"]["id"], b.status()["mesh"]["self"]["id"]
    auth = {**bearer(token)}
    status, _, headers = request(f"{a.url}/v1/chat/completions", chat("only-a"), {**auth, "X-Request-Id": "local-a"})
    assert status == 200 and headers["x-viiwork-node"] == "node-a"
    status, body, headers = request(f"{a.url}/v1/chat/completions", chat("only-b", max_tokens=4),
                                    {**auth, "X-Request-Id": "fwd-whole"})
    assert status == 200 and headers["x-viiwork-node"] == "node-b" and body["usage"]["completion_tokens"] == 4
    # A stream forwarded A -> B whose client did not ask for usage: no usage event reaches it.
    plain = stream(a, token, chat("only-b", stream=True, max_tokens=6), "fwd-stream")
    assert not [e for e in plain if "usage" in e], plain
    asked = stream(a, token, chat("only-b", stream=True, stream_options={"include_usage": True}), "fwd-asked")
    assert [e["usage"]["completion_tokens"] for e in asked if e.get("usage")] == [8], asked
    on_a, on_b = rows(a), rows(b)
    assert set(on_a) == {"local-a"}, on_a  # the origin records nothing it forwarded
    assert set(on_b) == {"fwd-whole", "fwd-stream", "fwd-asked"}, on_b
    assert (on_a["local-a"].origin_node, on_a["local-a"].serving_node) == ("", a_id)
    for request_id, completion in (("fwd-whole", 4), ("fwd-stream", 6), ("fwd-asked", 8)):
        row = on_b[request_id]
        assert (row.origin_node, row.serving_node, row.model, row.status) == (a_id, b_id, "only-b", 200), row
        assert row.completion_tokens == completion and row.prompt_tokens is not None and row.prompt_tokens > 0
    for row in [*on_a.values(), *on_b.values()]:
        assert (row.tenant, row.jti) == ("acme", jti_of(token)), row
    # The key is in no row, no ledger file and no log: only its id.
    for agent in (a, b):
        assert agent.state_dir is not None
        for path in agent.state_dir.glob("usage.sqlite3*"):
            assert token.encode() not in path.read_bytes(), path
        assert token not in agent.log_text()
