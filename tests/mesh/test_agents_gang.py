"""A gang over two real agents on loopback (issue 21): the head's agent asks the worker's agent, over
the mesh's mutual TLS, to start its part; the head engine reaches it through the gang tunnel;
losing the part restarts the gang whole; only the named head may start a part.

Fake gang engines (support/fake_gang.py: a loopback-only rpc-server, a llama-server that dials
every ``--rpc`` endpoint before it serves) stand for llama.cpp; each agent's runner is the
process runner. The real llama.cpp RPC run is tests/real/.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from cryptography.hazmat.primitives import serialization

from support.agent import Agent, node_ids, run_agent
from support.gang_driver import gang_binaries
from support.procs import free_port, stop_process
from support.systemd import process_gone
from viiwork.agent.cli import main
from viiwork.agent.gang.wire import START_PATH
from viiwork.mesh.identity import load_or_create_identity
from viiwork.mesh.tls import client_context
from viiwork.mesh.trust import issue_open_certificate, open_mesh_ca

MESH_ID = "test-gang"


def mesh_section(seeds: list[str]) -> dict[str, Any]:
    return {"trust": "open", "mesh_id": MESH_ID, "listen": "127.0.0.1:0", "advertise": "127.0.0.1",
            "discovery": ["seeds"], "seeds": seeds}


def gang_entry(bins: dict[str, str], port: int, log: Path, hosts: list[str]) -> dict[str, Any]:
    return {"name": "g", "engine": "llamacpp", "path": "/dev/null", "parallel": 1, "hosts": hosts,
            "gang_port": port, "env": {"FAKE_GANG_LOG": str(log)},
            "llamacpp": {"binary": bins["llama-server"], "rpc_binary": bins["rpc-server"]}}


def healthy(doc: dict[str, Any]) -> bool:
    models = [m for m in doc["models"] if m["name"] == "g"]
    return bool(models) and all(b["state"] == "healthy" for b in models[0]["backends"])


def worker_parts(agent: Agent) -> list[dict[str, Any]]:
    return agent.status().get("gangs", {}).get("parts", [])


def mesh_view(agent: Agent) -> dict[str, Any]:
    with urllib.request.urlopen(f"{agent.url}/v1/mesh", timeout=5) as r:
        return json.load(r)


def wait_gangs(agent: Agent, gang: str, timeout_s: float = 15) -> dict[str, Any]:
    """``agent``'s /v1/mesh once it shows ``gang`` whole (both ranks published)."""
    deadline = time.monotonic() + timeout_s
    doc: dict[str, Any] = {}
    while time.monotonic() < deadline:
        doc = mesh_view(agent)
        gangs = [g for g in doc["gangs"] if g["gang"] == gang]
        if gangs and [p["rank"] for p in gangs[0]["parts"]] == [0, 1]:
            return doc
        time.sleep(0.1)
    raise AssertionError(f"gang {gang} not whole in {agent.url}/v1/mesh: {json.dumps(doc.get('gangs'))}")


@dataclass
class Gang:
    tmp: Path
    head: Agent
    worker: Agent
    log: Path
    entry: dict[str, Any]


@pytest.fixture
def gang(tmp_path: Path) -> Iterator[Gang]:
    bins = gang_binaries(tmp_path / "bin")
    log = tmp_path / "fake-gang.log"
    # A short startup timeout: a launch waits that long for its hosts (agent/gang/head.py).
    entry = {**gang_entry(bins, free_port(), log, node_ids(tmp_path, "gh", "gw")), "startup_timeout_s": 3}
    with ExitStack() as stack:
        worker = stack.enter_context(run_agent(tmp_path, [entry], name="gw", extra={"mesh": mesh_section([])}))
        address = worker.wait_for(lambda d: bool(d["mesh"]["self"]["mesh"]), 30, "mesh address")["mesh"]["self"]["mesh"]
        head = stack.enter_context(run_agent(tmp_path, [entry], name="gh", extra={
            "mesh": mesh_section([address]), "health": {"interval_s": 0.5, "respawn_backoff_s": 0.2, "max_respawns": 1}}))
        head.wait_for(healthy, 60, "the gang's model healthy on its head")
        yield Gang(tmp_path, head, worker, log, entry)


async def post_as_stranger(tmp: Path, target: Agent, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    """POST ``body`` to ``target``'s gang start route as a mesh member that is not the head."""
    identity = load_or_create_identity(tmp / "stranger")
    cert = tmp / "stranger" / "node.crt"
    cert.write_bytes(issue_open_certificate(identity, "stranger", MESH_ID))
    ca_pem = open_mesh_ca(MESH_ID)[1].public_bytes(serialization.Encoding.PEM)
    ctx = client_context(cert, tmp / "stranger" / "node.key", ca_pem)
    address = target.status()["mesh"]["self"]["mesh"]
    async with aiohttp.ClientSession() as http, http.post(
            f"https://{address}{START_PATH}", json=body, ssl=ctx, timeout=aiohttp.ClientTimeout(total=10)) as r:
        return r.status, json.loads(await r.read())


def test_the_worker_part_starts_first_and_the_head_serves_through_the_tunnel(gang: Gang, capsys: Any) -> None:
    (part,) = worker_parts(gang.worker)
    assert part["model"] == "g" and part["rank"] == 1 and part["running"] is True
    heads = gang.head.status()["gangs"]["heads"]
    assert heads["g"]["gang"] == part["gang"] and heads["g"]["parts"][0]["host"] == "gw"
    events = gang.log.read_text().splitlines()
    rpc = next(i for i, line in enumerate(events) if line.startswith("rpc-server listening"))
    served = next(i for i, line in enumerate(events) if line.startswith("llama-server serving"))
    assert rpc < served
    # The head dialled its tunnel entry on loopback, not the worker's rpc-server port, and the
    # rpc-server's answer came back through the tunnel (bytes both ways).
    rpc_port = events[rpc].split()[-1]
    endpoint = events[served].split()[-1]
    assert endpoint.startswith("127.0.0.1:") and endpoint.split(":")[1] != rpc_port
    # The head's tunnel is a process of its own (agent/gang/tunnel_process.py): it writes its
    # counters every second.
    def carried(doc: dict[str, Any]) -> bool:
        (t,) = doc["gangs"]["heads"]["g"]["tunnels"]
        return t["connections_total"] >= 1 and t["bytes_in"] > 0 and t["bytes_out"] > 0
    (tunnel,) = gang.head.wait_for(carried, 10, "the tunnel's counters")["gangs"]["heads"]["g"]["tunnels"]
    assert tunnel["pid"] not in (None, gang.head.proc.pid) and tunnel["rank"] == 1
    # Each host publishes its membership (the summary's ``gangs`` extension); each sees both.
    head_id = gang.head.status()["mesh"]["self"]["id"]
    worker_id = gang.worker.status()["mesh"]["self"]["id"]
    whole = {"model": "g", "gang": part["gang"], "size": 2, "leader": head_id, "leader_name": "gh",
             "parts": [{"rank": 0, "node": head_id, "name": "gh"}, {"rank": 1, "node": worker_id, "name": "gw"}]}
    for agent, peer, own_rank in ((gang.head, gang.worker, 0), (gang.worker, gang.head, 1)):
        doc = wait_gangs(agent, part["gang"])
        assert doc["gangs"] == [whole]
        (mine,) = doc["self"]["gangs"]
        assert mine == {"model": "g", "gang": part["gang"], "rank": own_rank, "size": 2, "leader": head_id,
                        "leader_name": "gh"}
        (other,) = doc["nodes"][0]["gangs"]
        assert other["rank"] == 1 - own_rank and doc["nodes"][0]["name"] == peer.status()["node"]["name"]
    # viiworkctl mesh --json is that document; the table lists the gang; status shows both sides.
    capsys.readouterr()
    assert main(["mesh", "--json", "--url", gang.worker.url]) == 0
    assert json.loads(capsys.readouterr().out)["gangs"] == [whole]
    assert main(["mesh", "--url", gang.worker.url]) == 0
    assert f"g: gang {part['gang']}, 2/2 parts, leader gh: rank 0 gh, rank 1 gw" in capsys.readouterr().out
    assert main(["status", "--url", gang.head.url]) == 0
    assert f"g: head of gang {part['gang']}, parts: gw rank 1" in capsys.readouterr().out
    assert main(["status", "--url", gang.worker.url]) == 0
    assert f"g: part of gang {part['gang']}, rank 1 of 2, CPU, running" in capsys.readouterr().out


def test_only_the_named_head_starts_a_part(gang: Gang) -> None:
    (part,) = worker_parts(gang.worker)
    body = {"model": "g", "gang": "abcdefghijkl", "rank": 1, "size": 2,
            "addresses": ["127.0.0.1", "127.0.0.1"], "digests": {"name": "0" * 32}, "tunnel_cert": None}
    status, answer = asyncio.run(post_as_stranger(gang.tmp, gang.worker, body))
    assert status == 403 and answer["reason"] == "not_the_head", answer
    status, answer = asyncio.run(post_as_stranger(gang.tmp, gang.worker, {"model": "g"}))
    assert status == 400 and answer["reason"] == "malformed", answer
    refused = gang.worker.status()["gangs"]["refused"]
    assert refused == {"not_the_head": 1, "malformed": 1}
    (still,) = worker_parts(gang.worker)
    assert still == part  # nothing changed


def test_a_worker_that_does_not_know_its_head_yet_waits_for_it(tmp_path: Path) -> None:
    """Under CA trust an entry may name its hosts by name. A worker's agent that just started
    may be asked by its head before the head's summary reached it (the head found it first):
    the start waits for the head's name instead of being refused ``not_the_head``."""
    ctl = str(Path(sys.executable).parent / "viiworkctl")
    ca = tmp_path / "ca"
    subprocess.run([ctl, "mesh", "ca", "init", "--out", str(ca)], check=True, capture_output=True)
    for name in ("gh", "gw"):
        subprocess.run([ctl, "mesh", "enroll", "--ca", str(ca), "--state-dir", str(tmp_path / name), "--name", name],
                       check=True, capture_output=True)
    entry = gang_entry(gang_binaries(tmp_path / "bin"), free_port(), tmp_path / "fake-gang.log", ["gh", "gw"])
    worker_mesh = f"127.0.0.1:{free_port()}"

    def mesh(seeds: list[str], listen: str = "127.0.0.1:0") -> dict[str, Any]:
        return {"mesh": {"trust": "ca", "ca_certificate": str(ca / "ca.crt"), "listen": listen,
                         "advertise": "127.0.0.1", "discovery": ["seeds"], "seeds": seeds}}
    # Digests that differ: a config_mismatch answer says the head check passed, and starts nothing.
    body = {"model": "g", "gang": "abcdefghijkl", "rank": 1, "size": 2,
            "addresses": ["127.0.0.1", "127.0.0.1"], "digests": {"name": "0" * 32}, "tunnel_cert": None}
    ctx = client_context(tmp_path / "gh" / "node.crt", tmp_path / "gh" / "node.key", (ca / "ca.crt").read_bytes())

    async def start_as_gh() -> tuple[int, dict[str, Any]]:
        async with aiohttp.ClientSession() as http, http.post(
                f"https://{worker_mesh}{START_PATH}", json=body, ssl=ctx, timeout=aiohttp.ClientTimeout(total=30)) as r:
            return r.status, json.loads(await r.read())
    with ExitStack() as stack:
        worker = stack.enter_context(run_agent(tmp_path, [entry], name="gw", extra=mesh([], worker_mesh)))
        pool = stack.enter_context(ThreadPoolExecutor(1))
        asked = pool.submit(asyncio.run, start_as_gh())
        time.sleep(1)
        assert not asked.done(), asked.result()  # waiting: this worker knows no node named gh yet
        stack.enter_context(run_agent(tmp_path, [entry], name="gh", extra=mesh([worker_mesh])))
        status, answer = asked.result(30)
        assert (status, answer["reason"]) == (409, "config_mismatch"), answer
        assert "not_the_head" not in worker.status()["gangs"]["refused"]


def test_a_lost_part_restarts_the_gang_whole(gang: Gang) -> None:
    (part,) = worker_parts(gang.worker)
    os.kill(part["parts"][0]["pid"], signal.SIGKILL)
    gang.head.wait_for(lambda d: not healthy(d), 15, "the model unhealthy once its part is gone")

    def new_gang(doc: dict[str, Any]) -> bool:
        parts = worker_parts(gang.worker)
        return healthy(doc) and len(parts) == 1 and parts[0]["gang"] != part["gang"] and parts[0]["running"]
    doc = gang.head.wait_for(new_gang, 60, "a new gang, whole and healthy")
    (again,) = worker_parts(gang.worker)
    assert again["parts"][0]["pid"] != part["parts"][0]["pid"]
    assert doc["gangs"]["heads"]["g"]["gang"] == again["gang"]
    assert doc["gangs"]["heads"]["g"]["parts_lost"] >= 1
    # The new gang id is republished by both hosts; the old one is gone from the summaries.
    assert [g["gang"] for g in wait_gangs(gang.head, again["gang"])["gangs"]] == [again["gang"]]
    # `viiworkctl down` on the head stops the whole gang: the worker's part too.
    assert main(["down", "g", "--socket", str(gang.tmp / "gh" / "admin.sock")]) == 0
    gang.worker.wait_for(lambda d: d["gangs"]["parts"] == [], 15, "the worker's part stopped by the head's down")
    with pytest.raises(ProcessLookupError):
        os.kill(again["parts"][0]["pid"], 0)


def test_a_worker_host_stopping_takes_the_model_down_and_its_part_with_it(gang: Gang) -> None:
    (part,) = worker_parts(gang.worker)
    pid = part["parts"][0]["pid"]
    stop_process(gang.worker.proc, 30)  # SIGTERM: a graceful stop, `leaving` published
    doc = gang.head.wait_for(lambda d: not healthy(d), 15, "the model down once its worker host left")
    assert "gw" in doc["gangs"]["heads"]["g"]["last_failure"]
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)  # the part stopped with its agent
    # A request is refused at once, naming the host gone (not queued for a gang that cannot start).
    asked = time.monotonic()
    request = urllib.request.Request(f"{gang.head.url}/v1/completions", method="POST",
                                     data=json.dumps({"model": "g", "prompt": "hi", "max_tokens": 4}).encode(),
                                     headers={"Content-Type": "application/json"})
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(request, timeout=10)
    answer = json.loads(refused.value.read())
    assert refused.value.code == 503 and time.monotonic() - asked < 5, answer
    assert "gang's worker host gw (rank 1)" in answer["error"]["message"], answer
    assert refused.value.headers["Retry-After"] == "5"
    # No half-gang comes back while the worker is away.
    with pytest.raises(AssertionError):
        gang.head.wait_for(healthy, 5, "the model healthy without its worker")
    # ... and the mesh view lists no gang: the worker that left is not shown as its part.
    assert mesh_view(gang.head)["gangs"] == []
    # Away longer than a launch waits for its hosts, launch after launch: nothing ran, so no
    # respawn is spent (the budget is 1 here) and the model is not dead; the worker back, the
    # gang is whole again without `viiworkctl up`.
    doc = gang.head.wait_for(lambda d: d["gangs"]["heads"]["g"]["failures"] >= 3, 30, "launches tried again")
    assert "not every host is alive in the mesh" in doc["gangs"]["heads"]["g"]["last_failure"]
    assert all(b["state"] != "dead" for b in gang.head.model("g")["backends"])
    head_mesh = gang.head.status()["mesh"]["self"]["mesh"]
    with run_agent(gang.tmp, [gang.entry], name="gw", extra={"mesh": mesh_section([head_mesh])}) as worker:
        gang.head.wait_for(healthy, 30, "the gang whole again once its worker is back")
        (again,) = worker_parts(worker)
        assert again["running"] and again["gang"] != part["gang"]
        assert worker.status()["gangs"]["refused"] == {}
    # Stopped and back again: a gang lost because its worker host left spends no respawn
    # either (the budget is 1 here), so a worker's restarts never leave the model dead.
    doc = gang.head.wait_for(lambda d: not healthy(d), 15, "the model down once its worker host left again")
    assert all(b["state"] != "dead" for b in gang.head.model("g")["backends"])
    assert "its gang's worker host is away: no respawn spent" in gang.head.log_text()
    with run_agent(gang.tmp, [gang.entry], name="gw", extra={"mesh": mesh_section([head_mesh])}):
        gang.head.wait_for(healthy, 30, "the gang whole again after a second stop of its worker")


def test_a_frozen_tunnel_end_takes_the_gang_down_and_it_comes_back_whole(gang: Gang) -> None:
    """SIGSTOP of the worker's tunnel exit: its process runs, so no process check sees it, but
    it stops writing its counters; the worker says its part is not running, the head restarts
    the gang whole (the second attacker pass saw a healthy model that never answered)."""
    (part,) = worker_parts(gang.worker)
    (exit_pid,) = [p["pid"] for p in part["parts"] if p["role"] == "tunnel"]
    os.kill(exit_pid, signal.SIGSTOP)
    try:
        doc = gang.head.wait_for(lambda d: not healthy(d), 30, "the model unhealthy once its tunnel froze")
        assert "not running" in doc["gangs"]["heads"]["g"]["last_failure"]

        def new_gang(d: dict[str, Any]) -> bool:
            parts = worker_parts(gang.worker)
            return healthy(d) and len(parts) == 1 and parts[0]["gang"] != part["gang"] and parts[0]["running"]
        gang.head.wait_for(new_gang, 60, "a new gang, whole and healthy")
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(exit_pid, signal.SIGCONT)


def test_a_head_back_with_another_config_does_not_leave_the_old_part_running(gang: Gang) -> None:
    """kill -9 of the head's agent (its parts die with it: process runner), then the head
    back with a changed entry: its starts are refused (config_mismatch), it never leads the old
    gang again, and the worker stops that gang's part (second attacker pass: it ran on)."""
    (part,) = worker_parts(gang.worker)
    os.kill(gang.head.proc.pid, signal.SIGKILL)
    gang.head.proc.wait(10)
    changed = {**gang.entry, "parallel": 2}
    head_mesh = {"mesh": mesh_section([gang.worker.status()["mesh"]["self"]["mesh"]])}
    with run_agent(gang.tmp, [changed], name="gh", extra=head_mesh) as head:
        head.wait_for(lambda d: "config_mismatch" in str(d["gangs"]["heads"]["g"]["last_failure"])
                      or "different gang entry" in str(d["gangs"]["heads"]["g"]["last_failure"]), 30,
                      "the changed head refused")
        gang.worker.wait_for(lambda d: d["gangs"]["parts"] == [], 40, "the old gang's part stopped")
        assert "has not led this gang" in gang.worker.log_text()
        # The refusals spend none of the head's respawns (the budget is 1 here): the head keeps
        # trying, so the gang comes back once the configs agree again, with no `viiworkctl up`.
        doc = head.wait_for(lambda d: d["gangs"]["heads"]["g"]["failures"] >= 3, 30, "launches tried again")
        assert all(b["state"] != "dead" for b in next(m for m in doc["models"] if m["name"] == "g")["backends"])
        deadline = time.monotonic() + 15
        while not process_gone(part["parts"][0]["pid"]):
            assert time.monotonic() < deadline, "the old part's rpc-server outlived its stop"
            time.sleep(0.1)


def test_a_host_never_seen_is_named_in_a_503_not_a_late_429(tmp_path: Path) -> None:
    """A typo in `hosts` (a well-formed id no node has): once a launch waited for it in vain,
    a request is refused at once, naming it (newcomer pass 2: a 429 after 20 s in the queue)."""
    bins = gang_binaries(tmp_path / "bin")
    (head_id,) = node_ids(tmp_path, "gh")
    entry = {**gang_entry(bins, free_port(), tmp_path / "fake.log", [head_id, "zzzzzzzzzzzzzzzz"]),
             "startup_timeout_s": 2}
    with run_agent(tmp_path, [entry], name="gh", extra={"mesh": mesh_section([])}) as head:
        head.wait_for(lambda d: d["gangs"]["heads"]["g"]["failures"] >= 1, 30, "a launch that waited in vain")
        request = urllib.request.Request(f"{head.url}/v1/completions", method="POST",
                                         data=json.dumps({"model": "g", "prompt": "hi", "max_tokens": 4}).encode(),
                                         headers={"Content-Type": "application/json"})
        asked = time.monotonic()
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(request, timeout=30)
        answer = json.loads(refused.value.read())
        assert refused.value.code == 503 and time.monotonic() - asked < 5, answer
        assert "zzzzzzzzzzzzzzzz (rank 1) is not known in the mesh" in answer["error"]["message"], answer
