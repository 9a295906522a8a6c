"""The revocation list across a mesh of three real agents in CA mode on loopback (issue 17 item 2;
docs/security.md, "Revocation across the mesh").

A list pushed at one node (``viiworkctl keys push-revocations`` on its admin socket) is pushed by
it to the two others over mutual TLS: all three refuse the key within 2 s. A node stopped at the
time fetches it from a peer when it starts again (the peers publish a higher version in their
summaries), and its own list survives its restart. A forged list (another issuer's key) and an
older one sent by a member over mutual TLS are dropped and counted. On the same three agents,
``viiworkctl usage --mesh`` at one node gathers every node's ledger, each row once.

viiworkctl runs in this process (``cli``: the same code as the command, without a Python start
per call), the agents as processes.
"""

from __future__ import annotations

import asyncio
import io
import json
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack, redirect_stderr, redirect_stdout
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
import pytest

from support.agent import Agent, run_agent
from support.client_keys import bearer, jti_of, request
from viiwork.agent.cli import main as viiworkctl
from viiwork.agent.peering.revocation_sync import REVOCATIONS_PATH
from viiwork.agent.usage.store import UsageRow, insert_rows, open_for_writing
from viiwork.mesh.tls import client_context

pytestmark = pytest.mark.timeout(180)

AUDIENCE = "revocations-mesh"
NAMES = ("node-a", "node-b", "node-c")


@dataclass
class Mesh3:
    """Three agents (``agents`` by name), the issuer's key, and how to (re)start node C."""

    tmp: Path
    issuer_key: Path
    read_key: str
    agents: dict[str, Agent]
    start: Callable[[str], Agent]
    stop: Callable[[str], None]
    versions: list[int] = field(default_factory=list)

    def revoke(self, token: str) -> Path:
        """The next version of the list, with ``token``'s key added; its file."""
        out = self.tmp / f"revocations-{len(self.versions) + 1}.jwt"
        ctl("keys", "revoke", "--issuer-key", str(self.issuer_key), "--id", jti_of(token), "--out", str(out))
        self.versions.append(len(self.versions) + 1)
        return out


def mesh_section(tmp: Path, seeds: list[str]) -> dict:
    return {"trust": "ca", "ca_certificate": str(tmp / "ca" / "ca.crt"), "listen": "127.0.0.1:0",
            "advertise": "127.0.0.1", "discovery": ["seeds"], "seeds": seeds, "gossip_interval_ms": 100,
            "suspect_after_ms": 1000, "dead_after_ms": 3000}


@dataclass
class Done:
    returncode: int
    stdout: str
    stderr: str


def cli(*args: str) -> Done:
    """``viiworkctl ARGS`` in this process: exit code, stdout, stderr."""
    out, err = io.StringIO(), io.StringIO()
    with redirect_stdout(out), redirect_stderr(err):
        code = viiworkctl(list(args))
    return Done(code, out.getvalue(), err.getvalue())


def ctl(*args: str) -> str:
    done = cli(*args)
    assert done.returncode == 0, done.stderr
    return done.stdout


def issue(key: Path, *args: str) -> str:
    return ctl("keys", "issue", "--issuer-key", str(key), "--tenant", "acme", "--audience", AUDIENCE, *args).strip()


def push(socket: Path, file: Path) -> Done:
    return cli("keys", "push-revocations", str(file), "--socket", str(socket))


def refuses(agent: Agent, token: str) -> bool:
    """Whether ``agent`` refuses ``token`` as revoked (a key is checked before the model is looked up)."""
    status, body, _ = request(f"{agent.url}/v1/models", None, bearer(token))
    if status == 200:
        return False
    assert status == 401 and "(revoked)" in body["error"]["message"], (status, body)
    return True


def revocations(agent: Agent) -> dict:
    return agent.status()["revocations"]


@pytest.fixture(scope="module")
def mesh3() -> Iterator[Mesh3]:
    tmp = Path(tempfile.mkdtemp(prefix="viiwork-revocations-", dir="/tmp"))
    try:
        ctl("mesh", "ca", "init", "--out", str(tmp / "ca"))
        for name in (*NAMES, "member-x"):
            (tmp / name).mkdir(mode=0o700)
            ctl("mesh", "enroll", "--ca", str(tmp / "ca"), "--state-dir", str(tmp / name), "--name", name)
        ctl("keys", "issuer", "init", "--out", str(tmp / "issuer"))
        key, pub = tmp / "issuer" / "issuer.key", tmp / "issuer" / "issuer.pub"
        read_key = issue(key, "--scope", "inference,read")
        auth = {"mode": "keys", "issuer_keys": str(pub), "audience": AUDIENCE}
        with ExitStack() as stack:
            agents: dict[str, Agent] = {}
            stops: dict[str, ExitStack] = {}
            seeds: list[str] = []

            def start(name: str) -> Agent:
                node = ExitStack()
                agent = node.enter_context(run_agent(tmp, [], name=name, api_key=read_key,
                                                     extra={"mesh": mesh_section(tmp, seeds), "auth": auth}))
                stops[name] = node
                stack.callback(node.close)
                agents[name] = agent
                return agent

            def stop(name: str) -> None:
                stops.pop(name).close()

            a = start("node-a")
            seeds.append(a.wait_for(lambda d: bool(d["mesh"]["self"]["mesh"]), 30, "mesh address")
                         ["mesh"]["self"]["mesh"])
            start("node-b")
            start("node-c")
            for agent in agents.values():
                agent.wait_for(lambda d: d["mesh"]["peers"].get("alive", 0) == 2, 30, "two peers alive")
            yield Mesh3(tmp, key, read_key, agents, start, stop)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def wait_all_refuse(agents: list[Agent], token: str, within_s: float) -> float:
    """Poll until every agent refuses ``token``; the seconds it took (fails past ``within_s``)."""
    began = time.monotonic()
    left = list(agents)
    while left:
        left = [a for a in left if not refuses(a, token)]
        elapsed = time.monotonic() - began
        assert elapsed < within_s or not left, f"{[a.url for a in left]} still take the key after {elapsed:.2f} s"
        if left:
            time.sleep(0.02)
    return time.monotonic() - began


def test_revocation_at_one_node_refuses_the_key_at_all_three_within_2s(mesh3: Mesh3) -> None:
    a, b, c = (mesh3.agents[n] for n in NAMES)
    token = issue(mesh3.issuer_key)
    assert not any(refuses(agent, token) for agent in (a, b, c))
    listed = mesh3.revoke(token)
    before = {n: revocations(mesh3.agents[n])["version"] for n in NAMES}
    done = push(a.state_dir / "admin.sock", listed)
    assert done.returncode == 0, done.stderr
    ver = mesh3.versions[-1]
    assert f"revocation list version {ver} taken" in done.stdout, done.stdout
    assert "node-b: taken" in done.stdout and "node-c: taken" in done.stdout, done.stdout
    wait_all_refuse([a, b, c], token, within_s=2.0)
    for name in ("node-b", "node-c"):
        state = revocations(mesh3.agents[name])
        assert state["version"] == ver > before[name]
        # B and C took it from A's push, not by fetching it later.
        assert state["mesh"].get("pushes_in_taken", 0) == 1 and state["mesh"].get("fetches_taken", 0) == 0, state
    # Each node publishes the version it holds: none is ahead of another.
    for agent in (a, b, c):
        agent.wait_for(lambda d: d["revocations"]["peers_ahead"] == [], 5, "no peer ahead")
    # The same list again: held already, pushed again, refused by nobody.
    again = push(b.state_dir / "admin.sock", listed)
    assert again.returncode == 0 and "already held" in again.stdout, again.stdout + again.stderr


def test_a_node_stopped_at_the_time_learns_it_when_it_starts_again(mesh3: Mesh3) -> None:
    a, b = mesh3.agents["node-a"], mesh3.agents["node-b"]
    token = issue(mesh3.issuer_key)
    older = issue(mesh3.issuer_key)
    # An earlier list that C holds before it stops: its restart must not un-revoke it.
    first = mesh3.revoke(older)
    assert push(a.state_dir / "admin.sock", first).returncode == 0
    wait_all_refuse(list(mesh3.agents.values()), older, within_s=2.0)
    held_before_stop = revocations(mesh3.agents["node-c"])["version"]
    mesh3.stop("node-c")
    b.wait_for(lambda d: d["mesh"]["peers"].get("alive", 0) == 1, 10, "C gone")
    listed = mesh3.revoke(token)
    done = push(b.state_dir / "admin.sock", listed)
    assert done.returncode == 0 and "pushed to 1 peer(s)" in done.stdout, done.stdout + done.stderr
    wait_all_refuse([a, b], token, within_s=2.0)

    c = mesh3.start("node-c")
    starts = [line for line in c.log_text().splitlines() if "client keys on:" in line]
    assert starts[-1].endswith(f"revocation list version {held_before_stop}"), starts[-1]  # from its state file
    assert refuses(c, older)  # never un-revoked, even before it catches up
    c.wait_for(lambda d: d["mesh"]["peers"].get("alive", 0) == 2, 30, "C back in the mesh")
    began = time.monotonic()
    c.wait_for(lambda d: d["revocations"]["version"] == mesh3.versions[-1], 10, "C fetched the newer list")
    caught_up_s = time.monotonic() - began
    assert refuses(c, token) and refuses(c, older)
    state = revocations(c)
    assert state["mesh"]["fetches_taken"] == 1 and state["mesh"].get("pushes_in_taken", 0) == 0, state
    assert caught_up_s < 2.0, caught_up_s


async def _post_as_member(tmp: Path, target: Agent, body: bytes) -> tuple[int, dict]:
    """POST ``body`` to ``target``'s revocation route over mutual TLS, as a member of the mesh
    (``member-x``, enrolled by the same CA) that is not one of the running agents."""
    ctx = client_context(tmp / "member-x" / "node.crt", tmp / "member-x" / "node.key",
                         (tmp / "ca" / "ca.crt").read_bytes())
    address = target.status()["mesh"]["self"]["mesh"]
    async with aiohttp.ClientSession() as http, http.post(
            f"https://{address}{REVOCATIONS_PATH}", data=body, ssl=ctx,
            timeout=aiohttp.ClientTimeout(total=10)) as resp:
        return resp.status, json.loads(await resp.read())


def test_a_forged_or_older_list_from_a_member_is_dropped_and_counted(mesh3: Mesh3) -> None:
    b = mesh3.agents["node-b"]
    token = issue(mesh3.issuer_key)
    listed = mesh3.revoke(token)
    assert push(b.state_dir / "admin.sock", listed).returncode == 0
    held = mesh3.versions[-1]
    # Another issuer's list, with a version far above: refused as forged.
    rogue = mesh3.tmp / "rogue" / "issuer.key"
    ctl("keys", "issuer", "init", "--out", str(rogue.parent), "--name", "viiwork-issuer")
    revoked = [mesh3.read_key] + [issue(rogue) for _ in range(held + 2)]
    for victim in revoked:  # the rogue's list reaches a higher version than the real one
        ctl("keys", "revoke", "--issuer-key", str(rogue), "--id", jti_of(victim), "--out", str(mesh3.tmp / "rogue.jwt"))
    before = revocations(b)
    status, answer = asyncio.run(_post_as_member(mesh3.tmp, b, (mesh3.tmp / "rogue.jwt").read_bytes()))
    assert status == 200 and answer == {"taken": False, "version": held, "reason": "unknown_kid"}, answer
    older = (mesh3.tmp / f"revocations-{held - 1}.jwt").read_bytes()
    status, answer = asyncio.run(_post_as_member(mesh3.tmp, b, older))
    assert status == 200 and answer == {"taken": False, "version": held, "reason": "stale"}, answer
    status, _ = asyncio.run(_post_as_member(mesh3.tmp, b, b"x" * (4 * 1024 * 1024 + 1)))
    assert status == 413
    after = revocations(b)
    assert after["version"] == held and not refuses(b, mesh3.read_key)  # the forged list revoked nothing
    assert after["refused"].get("unknown_kid", 0) == before["refused"].get("unknown_kid", 0) + 1
    assert after["refused"].get("stale", 0) == before["refused"].get("stale", 0) + 1
    assert after["mesh"]["pushes_in_dropped"] == before["mesh"].get("pushes_in_dropped", 0) + 3
    metrics = request(f"{b.url}/metrics", None, bearer(mesh3.read_key))[1]["text"]
    assert 'viiwork_auth_revocation_lists_refused_total{reason="unknown_kid"}' in metrics
    assert f"viiwork_auth_revocation_list_version {held}.0" in metrics
    # The operator's command says why, too.
    refused = push(b.state_dir / "admin.sock", mesh3.tmp / "rogue.jwt")
    assert refused.returncode == 1 and "unknown_kid" in refused.stderr, refused.stderr
    stale = push(b.state_dir / "admin.sock", mesh3.tmp / f"revocations-{held - 1}.jwt")
    assert stale.returncode == 1 and "stale" in stale.stderr, stale.stderr


def _usage_row(i: int, node: str, tenant: str, duration_ms: float) -> UsageRow:
    return UsageRow(finished_at_ms=int(time.time() * 1000) - 1000, request_id=f"req-{i}", tenant=tenant, jti="k",
                    model="m", origin_node="", serving_node=node, prompt_tokens=10, completion_tokens=i,
                    cached_tokens=None, status=500 if i == 4 else 200, queued_ms=0.0, ttft_ms=None,
                    duration_ms=duration_ms)


def test_usage_mesh_gathers_every_node_and_counts_each_row_once(mesh3: Mesh3) -> None:
    # Rows as each serving node's ledger holds them, written through the ledger's own store while the
    # agents run (the request path writes them in production). The same request id at two nodes is
    # two requests (a retry served elsewhere is a row at each server).
    plan = {"node-a": [("acme", 100.0)] * 3, "node-b": [("acme", 200.0), ("acme", 200.0), ("globex", 50.0)],
            "node-c": [("globex", 400.0)] * 4}
    i = 0
    for name, wanted in plan.items():
        conn = open_for_writing(mesh3.agents[name].state_dir / "usage.sqlite3")
        try:
            batch = []
            for tenant, ms in wanted:
                batch.append(_usage_row(i, name, tenant, ms))
                i += 1
            insert_rows(conn, batch)
        finally:
            conn.close()
    a = mesh3.agents["node-a"]
    done = cli("usage", "--mesh", "--json", "--since", "1h", "--socket", str(a.state_dir / "admin.sock"))
    assert done.returncode == 0, done.stderr
    doc = json.loads(done.stdout)
    assert doc["nodes"] == {"node-a": "ok", "node-b": "ok", "node-c": "ok"}, doc
    groups = {g["key"]: g for g in doc["groups"]}
    assert {k: g["requests"] for k, g in groups.items()} == {"acme": 5, "globex": 5}
    assert groups["acme"]["errors"] == 1 and groups["acme"]["prompt_tokens"] == 50
    assert groups["acme"]["completion_tokens"] == sum(range(5))
    assert abs(groups["acme"]["p50_duration_ms"] / 100.0 - 1) <= 0.05  # the middle of 100,100,100,200,200
    assert abs(groups["globex"]["p50_duration_ms"] / 400.0 - 1) <= 0.05
    by_node = cli("usage", "--mesh", "--by", "node", "--since", "1h", "--socket", str(a.state_dir / "admin.sock"))
    assert by_node.returncode == 0, by_node.stderr
    lines = {line.split()[0]: line.split()[1] for line in by_node.stdout.splitlines()[1:4]}
    assert lines == {"node-a": "3", "node-b": "3", "node-c": "4"}, by_node.stdout
    assert "from 3 node(s): node-a, node-b, node-c" in by_node.stdout
