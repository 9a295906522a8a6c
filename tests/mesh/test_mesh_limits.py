"""Key limits that hold mesh-wide, between three real agents on loopback in CA mode (issue 17
item 6; docs/security.md, "Limits across the mesh").

Node A serves the only model; B and C forward to it. Each node is the origin of the requests
its clients send it, admits them against the key's limits, and reports what it admitted itself
to its peers (agent/peering/usage_share.py). Windows are the wall clock's minutes, so each test
first makes sure the current one has time left for it.
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import json
import secrets
import shutil
import ssl
import tempfile
import time
from collections.abc import Iterator
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import pytest

from support.agent import Agent, run_agent
from support.client_keys import bearer, chat, jti_of, request
from support.engines import fake_engine_binary
from viiwork.agent.cli import main as viiworkctl
from viiwork.agent.peering.usage_share import (
    KEY_USAGE_PATH,
    MAX_KEYS_PER_REPORT,
    MAX_KEYS_PER_SENDER,
    REPORT_MAX_BYTES,
)
from viiwork.mesh import tls

pytestmark = pytest.mark.timeout(180)

AUDIENCE = "limits-mesh"


@dataclass
class Mesh3:
    a: Agent
    b: Agent
    c: Agent
    issuer_key: Path
    ca: Path
    tmp: Path

    def key(self, *args: str) -> str:
        return issue(self.issuer_key, *args)


def ctl(*args: str) -> str:
    """``viiworkctl`` in this process (a process per call costs seconds on a loaded host); its stdout."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()):
        assert viiworkctl(list(args)) == 0, args
    return out.getvalue()


def issue(issuer_key: Path, *args: str) -> str:
    return ctl("keys", "issue", "--issuer-key", str(issuer_key), "--tenant", "acme", "--audience", AUDIENCE,
               *args).strip()


def mesh_section(ca: Path, seeds: list[str]) -> dict:
    return {"trust": "ca", "ca_certificate": str(ca / "ca.crt"), "listen": "127.0.0.1:0",
            "advertise": "127.0.0.1", "discovery": ["seeds"], "seeds": seeds, "gossip_interval_ms": 100,
            "suspect_after_ms": 1000, "dead_after_ms": 3000}


def enroll(ca: Path, state: Path, name: str) -> None:
    state.mkdir(mode=0o700)
    ctl("mesh", "enroll", "--ca", str(ca), "--state-dir", str(state), "--name", name)


@pytest.fixture(scope="module")
def mesh3() -> Iterator[Mesh3]:
    tmp = Path(tempfile.mkdtemp(prefix="viiwork-mesh-limits-", dir="/tmp"))
    try:
        ctl("keys", "issuer", "init", "--out", str(tmp / "issuer"))
        key, pub = tmp / "issuer" / "issuer.key", tmp / "issuer" / "issuer.pub"
        reader = issue(key, "--scope", "inference,read")
        ca = tmp / "ca"
        ctl("mesh", "ca", "init", "--out", str(ca))
        for name in ("node-a", "node-b", "node-c"):
            enroll(ca, tmp / name, name)
        binary = fake_engine_binary(tmp / "bin")
        auth = {"mode": "keys", "issuer_keys": str(pub), "audience": AUDIENCE}
        with ExitStack() as stack:
            a = stack.enter_context(run_agent(
                tmp, [{"name": "m", "engine": "llamacpp", "path": "/dev/null", "parallel": 4, "backends": 1,
                       "llamacpp": {"binary": str(binary)}}],
                name="node-a", extra={"mesh": mesh_section(ca, []), "auth": auth}, api_key=reader))
            seed = a.wait_for(lambda d: bool(d["mesh"]["self"]["mesh"]), 30, "mesh address")["mesh"]["self"]["mesh"]
            b, c = (stack.enter_context(run_agent(tmp, [], name=name, extra={"mesh": mesh_section(ca, [seed]),
                                                                              "auth": auth}, api_key=reader))
                    for name in ("node-b", "node-c"))
            a.wait_healthy("m")
            for agent in (a, b, c):
                agent.wait_for(lambda d: d["mesh"]["peers"].get("alive", 0) == 2, 30, "two peers alive")
            yield Mesh3(a, b, c, key, ca, tmp)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def window_with_time_left(seconds: float) -> int:
    """The current window (minutes since the epoch) once it has ``seconds`` left (waits for
    the next one otherwise): a test's requests must all fall in one window."""
    left = 60 - time.time() % 60
    if left < seconds:
        time.sleep(left + 0.05)
    return int(time.time() // 60)


def reports(agent: Agent) -> dict:
    return agent.status()["usage_reports"]


def assert_rate_limited(status: int, body: dict, headers: dict[str, str], rpm: int) -> None:
    assert status == 429, body
    assert body["error"]["code"] == "rate_limit_exceeded", body
    assert 1 <= int(headers["retry-after"]) <= 60, headers
    assert headers["x-ratelimit-limit-requests"] == str(rpm), headers
    assert headers["x-ratelimit-remaining-requests"] == "0", headers
    assert headers["x-ratelimit-reset-requests"], headers


def test_a_key_is_limited_in_total_across_three_origins(mesh3: Mesh3) -> None:
    """The issue's test: a key limited to 30 rpm sending 60 requests round-robin over three
    nodes gets 27-33 through, and 429s with the headers (each node alone would let all 60 by)."""
    token = mesh3.key("--rpm", "30")
    window_with_time_left(15)
    started = time.monotonic()
    agents = (mesh3.a, mesh3.b, mesh3.c)
    before = [reports(agent).get("reports_in", 0) for agent in agents]
    admitted, refused_by = 0, {agent.url: 0 for agent in agents}
    for i in range(60):
        agent = agents[i % 3]
        status, body, headers = request(f"{agent.url}/v1/chat/completions", chat("m"), bearer(token))
        if status == 200:
            admitted += 1
            assert headers["x-ratelimit-limit-requests"] == "30", headers
        else:
            assert_rate_limited(status, body, headers, 30)
            refused_by[agent.url] += 1
    print(f"{admitted} of 60 admitted in {time.monotonic() - started:.1f} s")
    assert 27 <= admitted <= 33, f"{admitted} of 60 admitted for a limit of 30"
    assert all(count > 0 for count in refused_by.values()), refused_by  # every origin held the line
    for agent, count in zip(agents, before, strict=True):
        assert reports(agent)["reports_in"] > count  # each heard its peers


async def test_a_burst_at_three_origins_at_once_is_limited_in_total(mesh3: Mesh3) -> None:
    """60 requests sent at once, 20 to each node: each origin takes a share of what is left
    per report round trip (``UsageShare.pace``), so the total stays within 10% of the limit
    (on reports alone every origin would admit its 20 before any report arrived)."""
    token = mesh3.key("--rpm", "30")
    window_with_time_left(15)
    agents = (mesh3.a, mesh3.b, mesh3.c)
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as http:
        async def send(url: str) -> tuple[int, dict[str, str]]:
            async with http.post(f"{url}/v1/chat/completions", json=chat("m"), headers=bearer(token)) as r:
                await r.read()
                return r.status, {k.lower(): v for k, v in r.headers.items()}

        answers = await asyncio.gather(*(send(agents[i % 3].url) for i in range(60)))
    admitted = sum(1 for status, _ in answers if status == 200)
    assert 27 <= admitted <= 33, f"{admitted} of 60 admitted for a limit of 30: {[reports(a) for a in agents]}"
    for status, headers in answers:
        assert status in (200, 429), status
        assert headers["x-ratelimit-limit-requests"] == "30"
        if status == 429:
            assert "retry-after" in headers and headers["x-ratelimit-remaining-requests"] == "0", headers
    assert sum(reports(agent).get("paced", 0) for agent in agents) > 0


def test_a_forwarded_request_counts_once(mesh3: Mesh3) -> None:
    """C is the only origin and A serves: A admits nothing of its own, so C's count is exact
    (A reporting the requests it served would halve what C lets through)."""
    token = mesh3.key("--rpm", "10")
    window_with_time_left(10)
    remaining = []
    for _ in range(14):
        status, body, headers = request(f"{mesh3.c.url}/v1/chat/completions", chat("m"), bearer(token))
        if status == 200:
            assert headers["x-viiwork-node"] == "node-a"
            remaining.append(int(headers["x-ratelimit-remaining-requests"]))
        else:
            assert_rate_limited(status, body, headers, 10)
    assert remaining == list(range(9, -1, -1))


def member_context(mesh3: Mesh3) -> ssl.SSLContext:
    """Node C's client context: reports sent with it come from a live member of the mesh (C's
    own pushes carry another epoch, and C admits none of these tests' keys)."""
    state = mesh3.tmp / "node-c"
    return tls.client_context(state / "node.crt", state / "node.key", (mesh3.ca / "ca.crt").read_bytes())


def probe_context(mesh3: Mesh3) -> ssl.SSLContext:
    """A client context of a node enrolled with the mesh CA that runs no agent: not a member."""
    state = mesh3.tmp / "probe"
    if not state.exists():
        enroll(mesh3.ca, state, "probe")
    return tls.client_context(state / "node.crt", state / "node.key", (mesh3.ca / "ca.crt").read_bytes())


async def wait_reports_in(agent: Agent, above: int) -> None:
    deadline = time.monotonic() + 10
    while reports(agent).get("reports_in", 0) <= above:
        assert time.monotonic() < deadline, f"no report reached {agent.url}: {reports(agent)}"
        await asyncio.sleep(0.02)


async def test_a_report_replaces_the_last_and_is_not_relayed(mesh3: Mesh3) -> None:
    """A member (C's identity) reports 4 of a 5 rpm key to A, twice (replaced, not added): A admits one more.
    A then reports only its own 1 to B, which admits 4 more (relaying would leave it none)."""
    token = mesh3.key("--rpm", "5")
    jti = jti_of(token)
    window = window_with_time_left(15)
    epoch = secrets.token_hex(8)
    mesh_a = "https://" + mesh3.a.status()["mesh"]["self"]["mesh"]
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(ssl=member_context(mesh3))) as member:
        for seq in (1, 2):
            doc = {"epoch": epoch, "seq": seq, "window": window, "usage": [[jti, 4, 0]]}
            async with member.post(mesh_a + KEY_USAGE_PATH, json=doc) as r:
                assert r.status == 204, await r.text()
        b_heard = reports(mesh3.b).get("reports_in", 0)
        status, body, headers = request(f"{mesh3.a.url}/v1/chat/completions", chat("m"), bearer(token))
        assert status == 200, body
        assert headers["x-ratelimit-remaining-requests"] == "0"
        assert_rate_limited(*request(f"{mesh3.a.url}/v1/chat/completions", chat("m"), bearer(token)), 5)
        await wait_reports_in(mesh3.b, b_heard)
        at_b = [request(f"{mesh3.b.url}/v1/chat/completions", chat("m"), bearer(token))[0] for _ in range(5)]
        assert at_b == [200, 200, 200, 200, 429]
        # A report for an old window, or one older than the last, changes nothing.
        for seq, when in ((3, window - 1), (2, window)):
            doc = {"epoch": epoch, "seq": seq, "window": when, "usage": [[jti, 0, 0]]}
            async with member.post(mesh_a + KEY_USAGE_PATH, json=doc) as r:
                assert r.status == 204
        # One for the next window (the sender's clock turned first) is refused, to be sent again.
        doc = {"epoch": epoch, "seq": 10, "window": window + 1, "usage": [[jti, 0, 0]]}
        async with member.post(mesh_a + KEY_USAGE_PATH, json=doc) as r:
            assert r.status == 409
        assert_rate_limited(*request(f"{mesh3.a.url}/v1/chat/completions", chat("m"), bearer(token)), 5)
        counters = reports(mesh3.a)
        assert counters["ignored_window"] >= 1 and counters["ignored_stale"] >= 1 and counters["ahead"] >= 1, counters


async def test_malformed_and_oversized_reports_are_dropped_and_counted(mesh3: Mesh3) -> None:
    window = int(time.time() // 60)
    good = {"epoch": "0123456789abcdef", "seq": 1, "window": window, "usage": []}
    malformed = [
        b"not json",
        b"[1, 2]",
        json.dumps({**good, "epoch": "NOT-HEX-AT-ALL!!"}).encode(),
        json.dumps({**good, "seq": -1}).encode(),
        json.dumps({**good, "seq": True}).encode(),
        json.dumps({**good, "window": "now"}).encode(),
        json.dumps({**good, "usage": {"key": [1, 2]}}).encode(),
        json.dumps({**good, "usage": [["key", 1]]}).encode(),
        json.dumps({**good, "usage": [["bad key!", 1, 2]]}).encode(),
        json.dumps({**good, "usage": [["key", 1.5, 2]]}).encode(),
        json.dumps({**good, "usage": [["key", 1, -2]]}).encode(),
        json.dumps({**good, "usage": [["key", 1, 2], ["key", 3, 4]]}).encode(),
    ]
    too_many = json.dumps({**good, "usage": [[f"k{i}", 1, 1] for i in range(MAX_KEYS_PER_REPORT + 1)]}).encode()
    oversized = json.dumps({**good, "pad": "x" * REPORT_MAX_BYTES}).encode()
    agent = mesh3.b
    before = reports(agent)
    mesh_b = "https://" + agent.status()["mesh"]["self"]["mesh"]
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(ssl=member_context(mesh3))) as member:
        async def post(data: bytes) -> tuple[int, str]:
            async with member.post(mesh_b + KEY_USAGE_PATH, data=data, headers={"Content-Type": "application/json"}) as r:
                return r.status, await r.text()

        for data in malformed:
            status, text = await post(data)
            assert status == 400 and "malformed" in text, (data[:80], status, text[:300])
        status, text = await post(too_many)
        assert status == 400 and str(MAX_KEYS_PER_REPORT) in text, text[:300]
        status, text = await post(oversized)
        assert status == 413, text[:300]
    after = reports(agent)

    def grew(name: str) -> int:
        return after.get(name, 0) - before.get(name, 0)

    assert grew("dropped_malformed") == len(malformed), after
    assert grew("dropped_too_many_keys") == 1 and grew("dropped_too_large") == 1, after
    assert agent.proc.poll() is None
    # The node keeps serving.
    token = mesh3.key()
    assert request(f"{agent.url}/v1/chat/completions", chat("m"), bearer(token))[0] == 200


async def test_a_report_from_an_identity_that_is_not_a_member_is_refused(mesh3: Mesh3) -> None:
    """A certificate of the mesh's CA with no agent behind it (never a live member) reports a
    key spent: refused (403), counted, and the key is admitted as before."""
    token = mesh3.key("--rpm", "2")
    window = int(time.time() // 60)  # refused before its window is looked at: no wait needed
    before = reports(mesh3.a).get("dropped_not_member", 0)
    mesh_a = "https://" + mesh3.a.status()["mesh"]["self"]["mesh"]
    doc = {"epoch": secrets.token_hex(8), "seq": 1, "window": window, "usage": [[jti_of(token), 2, 0]]}
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(ssl=probe_context(mesh3))) as probe:
        async with probe.post(mesh_a + KEY_USAGE_PATH, json=doc) as r:
            assert r.status == 403 and "not_member" in await r.text()
    assert reports(mesh3.a)["dropped_not_member"] == before + 1
    status, body, headers = request(f"{mesh3.a.url}/v1/chat/completions", chat("m"), bearer(token))
    assert status == 200 and headers["x-ratelimit-remaining-requests"] == "1", (status, body)


async def test_a_members_flood_of_made_up_keys_resets_no_count_and_fills_only_its_part(mesh3: Mesh3) -> None:
    """The eviction flood (run last: it fills C's part for the window): a member reports 135 x 512
    made-up keys to A. Before, they pushed the real key's own count out of A's limiter (its rpm
    started again) and filled the table for every sender. Now the real key stays spent, the
    member keeps at most MAX_KEYS_PER_SENDER keys, and /v1/status shows it per sender."""
    token = mesh3.key("--rpm", "3")
    window = window_with_time_left(10)
    url = f"{mesh3.a.url}/v1/chat/completions"
    assert [request(url, chat("m"), bearer(token))[0] for _ in range(4)] == [200, 200, 200, 429]
    mesh_a = "https://" + mesh3.a.status()["mesh"]["self"]["mesh"]
    epoch = secrets.token_hex(8)
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(ssl=member_context(mesh3))) as member:
        for i in range(135):
            doc = {"epoch": epoch, "seq": i + 1, "window": window,
                   "usage": [[f"made-up-{i}-{j}", 0, 0] for j in range(MAX_KEYS_PER_REPORT)]}
            async with member.post(mesh_a + KEY_USAGE_PATH, json=doc) as r:
                assert r.status == 204, await r.text()
    assert_rate_limited(*request(url, chat("m"), bearer(token)), 3)
    status = reports(mesh3.a)
    c_id = mesh3.c.status()["mesh"]["self"]["id"]
    sender = status["by_sender"][c_id]
    assert sender["name"] == "node-c" and sender["keys"] == MAX_KEYS_PER_SENDER, sender
    assert sender["keys_full"] >= 135 * MAX_KEYS_PER_REPORT - MAX_KEYS_PER_SENDER, sender
    assert status["keys_from_peers"] <= 2 * MAX_KEYS_PER_SENDER, status
