"""The real llama-server answers only the agent (docs/security.md, "Local users").

One agent runs llama-server with SmolLM2-135M. The engine listens on a Unix socket in the
backend's private directory (``--host <path>.sock``), with no TCP port, and was started with
the agent's per-backend key (``--api-key-file``): a completion sent straight to the engine
without the key, or with a wrong one, is refused with 401, as are /slots and /metrics;
through the agent the same request answers 200. A web page of another origin gets no CORS
grant from the engine (``--cors-origins localhost --no-cors-credentials``).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import pytest

from support.agent import ENGINE_URL, Agent, run_agent

pytestmark = [pytest.mark.engine, pytest.mark.timeout(120)]

BODY = {"model": "smol", "messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 4, "temperature": 0}


@pytest.fixture(scope="module")
def agent(tmp_path_factory: pytest.TempPathFactory, llama_server: Path, smollm2_path: Path) -> Iterator[Agent]:
    tmp = tmp_path_factory.mktemp("engine-key")
    model = {"name": "smol", "engine": "llamacpp", "path": str(smollm2_path), "ctx_per_slot": 512, "parallel": 1,
             "backends": 1, "startup_timeout_s": 60, "llamacpp": {"binary": str(llama_server), "metrics": True}}
    with run_agent(tmp, [model]) as a:
        a.wait_healthy("smol")
        yield a


def listening_tcp_inodes() -> set[str]:
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as f:
            inodes |= {line.split()[9] for line in f.readlines()[1:] if line.split()[3] == "0A"}
    return inodes


def test_engine_has_a_socket_and_no_tcp_port(agent: Agent) -> None:
    backend = agent.model("smol")["backends"][0]
    assert backend["port"] is None and Path(backend["socket"]).is_socket()
    pid = backend["pid"]
    fds = {os.readlink(f"/proc/{pid}/fd/{fd}") for fd in os.listdir(f"/proc/{pid}/fd")}
    inodes = {t[8:-1] for t in fds if t.startswith("socket:[")}
    assert inodes and not inodes & listening_tcp_inodes()


async def test_engine_refuses_requests_without_the_agents_key(agent: Agent) -> None:
    url = ENGINE_URL
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as http, \
            agent.engine_session("smol", key=False) as bare, agent.engine_session("smol") as keyed:
        for headers in ({}, {"Authorization": "Bearer guess"}):
            async with bare.post(url + "/v1/chat/completions", json=BODY, headers=headers) as r:
                assert r.status == 401, await r.text()
            for path in ("/slots", "/metrics"):
                async with bare.get(url + path, headers=headers) as r:
                    assert r.status == 401, (path, await r.text())
        async with http.post(agent.url + "/v1/chat/completions", json=BODY) as r:
            assert r.status == 200, await r.text()
            assert (await r.json())["choices"][0]["message"]["content"]
        # The key the agent wrote is the one the engine takes.
        async with keyed.post(url + "/v1/chat/completions", json=BODY) as r:
            assert r.status == 200, await r.text()
    # The agent's load reads (/slots, /metrics need the key) work: the slot count is the engine's.
    backend = agent.model("smol")["backends"][0]
    assert backend["load_stale"] is False and backend["slots"] == 1


async def test_engine_grants_no_cors_to_other_origins(agent: Agent) -> None:
    evil = {"Origin": "http://evil.example", "Access-Control-Request-Method": "POST"}
    async with agent.engine_session("smol", key=False) as http:
        async with http.options(ENGINE_URL + "/v1/chat/completions", headers=evil) as r:
            allowed = r.headers.get("Access-Control-Allow-Origin", "")
            assert allowed not in ("*", "http://evil.example"), dict(r.headers)
            assert r.headers.get("Access-Control-Allow-Credentials", "") != "true"
