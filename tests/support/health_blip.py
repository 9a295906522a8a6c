"""A /health blip on every backend of a real agent while completions keep flowing through it.

Shared by tests/unit/test_health_blip.py (asserts) and tests/bench/bench_health_blip.py
(figures). One real ``viiwork-agent`` (process runner) serves one model on ``backends`` fake
llama-servers (support/fake_engine.py) whose ``/health`` answers 503 while a file exists
(``FAKE_HEALTH_FAIL_FILE``); completions keep succeeding. ``clients`` loops send non-streamed
chat completions through the agent before, during and after the blip; the result holds every
request's (start, end, status) and each backend's respawn count at the end, read from
``/v1/status``.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

from support.agent import run_agent
from support.engines import fake_engine_binary

#: The settings of the report (issue 22): probes every 1 s, 1 s deadline, 3 failures.
ISSUE_HEALTH = {"interval_s": 1.0, "timeout_s": 1.0, "max_failures": 3}


@dataclass
class BlipResult:
    """``requests``: (start, end, status) in seconds from the blip's start (status 0: a
    transport error). ``respawns``: per backend id at the end. ``states``: per backend id at
    the end. ``blip_s``: how long /health failed. ``log``: the agent's log."""

    blip_s: float
    requests: list[tuple[float, float, int]] = field(default_factory=list)
    respawns: dict[str, int] = field(default_factory=dict)
    states: dict[str, str] = field(default_factory=dict)
    log: str = ""

    @property
    def failed(self) -> int:
        return sum(1 for _, _, status in self.requests if status != 200)

    def completed_between(self, start: float, end: float) -> int:
        return sum(1 for _, done, status in self.requests if status == 200 and start <= done < end)

    def slowest_s(self) -> float:
        return max((done - began for began, done, _ in self.requests), default=0.0)


def blip_model(binary: Path, flag: Path, backends: int) -> dict[str, Any]:
    # 10 tokens 0.02 s apart: a completion takes about 0.2 s.
    return {"name": "m", "engine": "llamacpp", "path": "/dev/null", "parallel": 2, "backends": backends,
            "llamacpp": {"binary": str(binary)},
            "env": {"FAKE_LOAD_S": "0.5", "FAKE_TOKENS": "10", "FAKE_TOKEN_DELAY_S": "0.02",
                    "FAKE_HEALTH_FAIL_FILE": str(flag)}}


async def _client(http: aiohttp.ClientSession, url: str, t0: float, until: float,
                  out: list[tuple[float, float, int]]) -> None:
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    while time.monotonic() < until:
        began = time.monotonic()
        try:
            async with http.post(url + "/v1/chat/completions", json=body) as resp:
                await resp.read()
                status = resp.status
        except (aiohttp.ClientError, TimeoutError):
            status = 0
        out.append((began - t0, time.monotonic() - t0, status))


async def _drive(url: str, flag: Path, blip_s: float, before_s: float, after_s: float,
                 clients: int) -> list[tuple[float, float, int]]:
    out: list[tuple[float, float, int]] = []
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as http:
        t0 = time.monotonic() + before_s
        until = t0 + blip_s + after_s
        loops = [asyncio.create_task(_client(http, url, t0, until, out)) for _ in range(clients)]
        await asyncio.sleep(max(0.0, t0 - time.monotonic()))
        flag.touch()
        await asyncio.sleep(max(0.0, t0 + blip_s - time.monotonic()))
        flag.unlink()
        await asyncio.gather(*loops)
    return out


def run_blip(workdir: Path, *, health: dict[str, Any] | None = None, supervisor: dict[str, Any] | None = None,
             backends: int = 3, clients: int = 6, blip_s: float = 3.0, before_s: float = 1.0,
             after_s: float = 2.0, settle_s: float = 0.0) -> BlipResult:
    """Run one agent, wait for its backends, blip their /health for ``blip_s`` with ``clients``
    completion loops running from ``before_s`` before the blip to ``after_s`` after it, wait
    ``settle_s`` more, and return what happened. ``health``/``supervisor``: config keys over
    ISSUE_HEALTH and the defaults."""
    workdir.mkdir(parents=True, exist_ok=True)
    binary = fake_engine_binary(workdir / "bin")
    flag = workdir / "health-blip"
    extra = {"health": {**ISSUE_HEALTH, **(health or {})}, "supervisor": {"runner": "process", **(supervisor or {})}}
    with run_agent(workdir, [blip_model(binary, flag, backends)], extra=extra) as agent:
        agent.wait_healthy("m", timeout_s=30)
        result = BlipResult(blip_s=blip_s)
        result.requests = asyncio.run(_drive(agent.url, flag, blip_s, before_s, after_s, clients))
        time.sleep(settle_s)
        for b in agent.model("m")["backends"]:
            result.respawns[b["id"]] = b["respawns"]
            result.states[b["id"]] = b["state"]
        result.log = agent.log_text()
    return result
