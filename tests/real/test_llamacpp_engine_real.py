"""The llama.cpp adapter against the real llama-server on the CPU, with the tiny random model.

The command is the adapter's own ``build_command``; probe and read_load talk to the real
process. Skips (fails under CI=true) where llama-server is not installed.
"""

from __future__ import annotations

import asyncio
import json
import os
import socket
import subprocess
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import pytest

from viiwork.engines.contract import BackendSpec, EngineUnavailable, Kind, Probe
from viiwork.engines.llamacpp import LlamaCppEngine, LlamaCppOptions

pytestmark = [pytest.mark.engine, pytest.mark.timeout(60)]

ENGINE = LlamaCppEngine()
CTX_PER_SLOT = 1024
PARALLEL = 2
READY_DEADLINE_S = 20.0


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@dataclass
class Backend:
    spec: BackendSpec
    base_url: str
    process: subprocess.Popen[bytes]
    log: Path


@pytest.fixture
def backend(llama_server: Path, tiny_gguf: Path, tmp_path: Path) -> Iterator[Backend]:
    """A real llama-server started from the adapter's command; killed in the finalizer."""
    port = free_port()
    spec = BackendSpec(
        model="tiny-real", kind=Kind.CHAT, path=str(tiny_gguf), port=port,
        ctx_per_slot=CTX_PER_SLOT, parallel=PARALLEL,
        options=LlamaCppOptions(binary=str(llama_server)),
        host_cpus=len(os.sched_getaffinity(0)),
    )
    cmd = ENGINE.build_command(spec)
    log = tmp_path / "llama-server.log"
    with log.open("wb") as out:
        process = subprocess.Popen(
            cmd.argv, env={**os.environ, **cmd.env}, stdout=out, stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL, start_new_session=True,
        )
    try:
        yield Backend(spec=spec, base_url=f"http://127.0.0.1:{port}", process=process, log=log)
    finally:
        # SIGKILL: llama-server hangs on SIGTERM while a request is in flight.
        process.kill()
        process.wait(timeout=10)


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5)) as session:
        yield session


async def wait_ready(http: aiohttp.ClientSession, backend: Backend) -> list[str]:
    """Probe until ready; returns what each probe saw ("refused", "loading model", "ready")."""
    seen: list[str] = []
    deadline = time.monotonic() + READY_DEADLINE_S
    while time.monotonic() < deadline:
        if backend.process.poll() is not None:
            pytest.fail(f"llama-server exited {backend.process.returncode}:\n{backend.log.read_text()[-2000:]}")
        try:
            result = await ENGINE.probe(http, backend.base_url)
        except EngineUnavailable:
            seen.append("refused")
        else:
            seen.append("ready" if result.ready else result.phase)
            if result.ready:
                return seen
        await asyncio.sleep(0.02)  # poll interval, not synchronisation: the deadline bounds it
    pytest.fail(f"not ready within {READY_DEADLINE_S}s; probes saw {seen[-5:]}\n{backend.log.read_text()[-2000:]}")


async def test_probe_goes_from_not_ready_to_ready(http: aiohttp.ClientSession, backend: Backend) -> None:
    seen = await wait_ready(http, backend)
    assert seen[0] in ("refused", "loading model"), seen
    assert seen[-1] == "ready"
    assert set(seen[:-1]) <= {"refused", "loading model"}, seen
    assert await ENGINE.probe(http, backend.base_url) == Probe(ready=True)


async def test_read_load_idle_then_busy_during_a_streamed_request(http: aiohttp.ClientSession, backend: Backend) -> None:
    await wait_ready(http, backend)
    idle = await ENGINE.read_load(http, backend.spec, backend.base_url)
    assert (idle.slots, idle.busy, idle.waiting, idle.ctx_per_slot) == (PARALLEL, 0, 0, CTX_PER_SLOT)

    body = {
        "messages": [{"role": "user", "content": "tell me a long story"}],
        "max_tokens": CTX_PER_SLOT - 64, "ignore_eos": True, "stream": True,
    }
    async with http.post(f"{backend.base_url}/v1/chat/completions", json=body) as resp:
        assert resp.status == 200
        # Wait for the first content chunk: from then on a slot is processing.
        while True:
            line = await resp.content.readline()
            assert line, "stream ended before any content"
            if line.startswith(b"data: {") and json.loads(line[6:])["choices"][0]["delta"].get("content"):
                break
        busy = await ENGINE.read_load(http, backend.spec, backend.base_url)
        assert busy.busy >= 1
        assert (busy.slots, busy.ctx_per_slot) == (PARALLEL, CTX_PER_SLOT)
        assert (await ENGINE.probe(http, backend.base_url)).ready, "a busy llama-server is still ready"
        resp.close()  # the client goes away; llama-server stops that generation

    deadline = time.monotonic() + 10
    while (load := await ENGINE.read_load(http, backend.spec, backend.base_url)).busy:
        assert time.monotonic() < deadline, f"slot still busy 10 s after the client left: {load}"
        await asyncio.sleep(0.02)
    assert load.waiting == 0
