"""A gang's head agent killed with -9 and started again adopts the whole gang (issue 21).

Two real agents on loopback, each with the systemd runner on one real ``systemd --user``
(tests/systemd/conftest.py): ``gw`` runs a real ``rpc-server`` when its head asks, ``gh``
serves SmolLM2 with a real ``llama-server --rpc`` through its tunnel process, every layer on
the worker's RPC device. kill -9 of the head's agent leaves its engine and its tunnel running
as units (the worker's part never notices); the head's agent started again adopts all of
them: the same gang id, the same PIDs (no reload), and the same first tokens. Then a stop of
the head's agent stops its units, and the worker's agent stopping stops its part.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import pytest
import requests

from support.agent import Agent, run_agent
from support.procs import free_port
from support.systemd import UserManager, process_gone, unit_show

pytestmark = [pytest.mark.systemd, pytest.mark.engine, pytest.mark.timeout(420)]

BODY = {"model": "smol", "prompt": "The lighthouse keeper opened the bottle and read", "max_tokens": 16,
        "temperature": 0, "seed": 42, "top_k": 1, "ignore_eos": True, "cache_prompt": False}


def mesh_section(seeds: list[str]) -> dict[str, Any]:
    return {"trust": "open", "mesh_id": "test-gang-adopt", "listen": "127.0.0.1:0", "advertise": "127.0.0.1",
            "discovery": ["seeds"], "seeds": seeds}


def healthy(doc: dict[str, Any]) -> bool:
    models = [m for m in doc["models"] if m["name"] == "smol"]
    return bool(models) and all(b["state"] == "healthy" for b in models[0]["backends"])


def complete(url: str) -> str:
    r = requests.post(f"{url}/v1/completions", json=BODY, timeout=120)
    assert r.status_code == 200, r.text
    return str(r.json()["choices"][0]["text"])


def snapshot(head: Agent, worker: Agent) -> dict[str, Any]:
    """The gang id and every process of the gang: the head's engine and tunnel, the worker's part."""
    doc = head.status()
    (backend,) = next(m for m in doc["models"] if m["name"] == "smol")["backends"]
    gang = doc["gangs"]["heads"]["smol"]
    (tunnel,) = gang["tunnels"]
    (part,) = worker.status()["gangs"]["parts"]
    return {"gang": gang["gang"], "engine": (backend["unit"], backend["pid"]), "tunnel": (tunnel["unit"], tunnel["pid"]),
            "part": (part["gang"], part["parts"][0]["unit"], part["parts"][0]["pid"])}


@pytest.fixture
def entry(tmp_path: Path, llama_server: Path, rpc_server: Path, smollm2_path: Path) -> dict[str, Any]:
    return {"name": "smol", "engine": "llamacpp", "path": str(smollm2_path), "parallel": 1, "ctx_per_slot": 1024,
            "hosts": ["gh", "gw"], "gang_port": free_port(), "startup_timeout_s": 120, "sandbox": "none",
            "llamacpp": {"binary": str(llama_server), "rpc_binary": str(rpc_server), "threads": 1}}


def test_head_agent_kill_9_and_restart_adopts_the_whole_gang(systemd_user: UserManager, tmp_path: Path,
                                                              entry: dict[str, Any]) -> None:
    runner = {"runner": "systemd", "bus": "user", "bus_address": systemd_user.bus_address}
    with ExitStack() as stack:
        worker = stack.enter_context(run_agent(tmp_path, [entry], name="gw",
                                               extra={"mesh": mesh_section([]), "supervisor": runner}))
        address = worker.wait_for(lambda d: bool(d["mesh"]["self"]["mesh"]), 30, "mesh address")["mesh"]["self"]["mesh"]
        head_extra = {"mesh": mesh_section([address]), "supervisor": runner}

        def run_head() -> Iterator[Agent]:
            return run_agent(tmp_path, [entry], name="gh", extra=head_extra)

        with run_head() as head:
            head.wait_for(healthy, 180, "SmolLM2 served by the gang")
            first = snapshot(head, worker)
            assert first["part"][0] == first["gang"]
            assert first["tunnel"][0] == f"viiwork-gang-smol-{first['gang']}-r1-tunnel.service"
            assert all(unit_show(systemd_user, unit, "MainPID") == str(pid)
                       for unit, pid in (first["engine"], first["tunnel"], first["part"][1:]))
            reference = complete(head.url)
            os.kill(head.proc.pid, signal.SIGKILL)
            head.proc.wait(10)
        # The head's agent is gone; its engine and tunnel are not, nor the worker's part.
        for unit, _ in (first["engine"], first["tunnel"]):
            assert unit_show(systemd_user, unit, "ActiveState") == "active", unit

        with run_head() as head:
            head.wait_for(lambda d: healthy(d) and d["gangs"]["heads"]["smol"]["adopted"], 90, "the gang adopted")
            assert snapshot(head, worker) == first  # same gang, same processes: nothing restarted
            assert "gang %s of smol: adopted" % first["gang"] in head.log_text()
            assert complete(head.url) == reference  # the engine kept its RPC devices through the tunnel
            status = head.status()["gangs"]["heads"]["smol"]
            assert status["starts"] == 0 and status["adopted"] == 1
        # A stop of the head's agent (not a restart) stops its units; the worker's part is asked to stop.
        for unit, pid in (first["engine"], first["tunnel"]):
            assert unit_show(systemd_user, unit, "LoadState") == "not-found", unit
            assert process_gone(pid)
        worker.wait_for(lambda d: d["gangs"]["parts"] == [], 30, "the worker's part stopped")
        assert process_gone(first["part"][2])
