"""SmolLM2 split across two agents by llama.cpp RPC (issue 21), real binaries on the CPU.

Two agents on loopback in one mesh: ``gw`` (the worker) runs a real ``rpc-server`` when its
head asks, ``gh`` (the head) serves the model with ``llama-server --rpc`` through the gang
tunnel, every layer offloaded to the worker's RPC device. Its first 32 tokens (temperature 0,
a fixed seed) are those of a llama-server alone with the model; kill -9 of the worker's
rpc-server makes the model unhealthy, and the gang comes back whole and answers the same.
Skips (fails under CI=true) where llama-server or rpc-server is not installed.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import pytest
import requests

from support.agent import Agent, node_ids, run_agent
from support.procs import free_port, stop_process

pytestmark = [pytest.mark.engine, pytest.mark.timeout(300)]

BODY = {"model": "smol", "prompt": "Write a short story about a lighthouse keeper who finds a message in a bottle.",
        "max_tokens": 32, "temperature": 0, "seed": 42, "top_k": 1, "ignore_eos": True, "cache_prompt": False}


def mesh_section(seeds: list[str]) -> dict[str, Any]:
    return {"trust": "open", "mesh_id": "test-gang-real", "listen": "127.0.0.1:0", "advertise": "127.0.0.1",
            "discovery": ["seeds"], "seeds": seeds}


def healthy(doc: dict[str, Any]) -> bool:
    models = [m for m in doc["models"] if m["name"] == "smol"]
    return bool(models) and all(b["state"] == "healthy" for b in models[0]["backends"])


def complete(url: str) -> str:
    r = requests.post(f"{url}/v1/completions", json=BODY, timeout=120)
    assert r.status_code == 200, r.text
    return str(r.json()["choices"][0]["text"])


def alone(tmp: Path, llama_server: Path, model: Path) -> str:
    port = free_port()
    with (tmp / "alone.log").open("wb") as log:
        proc = subprocess.Popen([str(llama_server), "-m", str(model), "--host", "127.0.0.1", "--port", str(port),
                                 "-c", "1024", "--parallel", "1", "-t", "1", "--device", "none", "-ngl", "0"],
                                stdout=log, stderr=subprocess.STDOUT)
    try:
        for _ in range(600):
            try:
                if requests.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                    break
            except requests.RequestException:
                pass
            assert proc.poll() is None, (tmp / "alone.log").read_text()[-2000:]
            time.sleep(0.1)
        return complete(f"http://127.0.0.1:{port}")
    finally:
        stop_process(proc, 10)


@pytest.fixture
def gang(tmp_path: Path, llama_server: Path, rpc_server: Path, smollm2_path: Path) -> Iterator[tuple[Agent, Agent]]:
    entry = {"name": "smol", "engine": "llamacpp", "path": str(smollm2_path), "parallel": 1, "ctx_per_slot": 1024,
             "hosts": node_ids(tmp_path, "gh", "gw"), "gang_port": free_port(), "startup_timeout_s": 120,
             "llamacpp": {"binary": str(llama_server), "rpc_binary": str(rpc_server), "threads": 1}}
    with ExitStack() as stack:
        worker = stack.enter_context(run_agent(tmp_path, [entry], name="gw", extra={"mesh": mesh_section([])}))
        address = worker.wait_for(lambda d: bool(d["mesh"]["self"]["mesh"]), 30, "mesh address")["mesh"]["self"]["mesh"]
        head = stack.enter_context(run_agent(tmp_path, [entry], name="gh", extra={"mesh": mesh_section([address])}))
        head.wait_for(healthy, 180, "SmolLM2 served by the gang")
        yield head, worker


def test_smollm2_split_over_two_agents_answers_as_one_host_and_comes_back_whole(
        gang: tuple[Agent, Agent], tmp_path: Path, llama_server: Path, smollm2_path: Path) -> None:
    head, worker = gang
    reference = alone(tmp_path, llama_server, smollm2_path)
    assert len(reference.split()) >= 10, reference
    assert complete(head.url) == reference
    # The weights went through the tunnel (its process writes its counters every second).
    head.wait_for(lambda d: d["gangs"]["heads"]["smol"]["tunnels"][0]["bytes_out"] > os.path.getsize(smollm2_path) // 2,
                  10, "the tunnel's counters")

    (part,) = worker.status()["gangs"]["parts"]
    os.kill(part["parts"][0]["pid"], signal.SIGKILL)  # the worker's real rpc-server
    head.wait_for(lambda d: not healthy(d), 20, "the model unhealthy once its rpc-server is gone")
    head.wait_for(healthy, 180, "the gang back whole")
    (again,) = worker.status()["gangs"]["parts"]
    assert again["gang"] != part["gang"] and again["running"]
    assert complete(head.url) == reference
