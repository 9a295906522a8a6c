"""The demo's SmolLM2 GGUF served as ``kind = "embedding"`` by the real llama-server.

The issue's case: that GGUF declares no pooling type, so without the adapter's
``--pooling mean`` every ``/v1/embeddings`` call got llama-server's 400 about pooling. The
command is the adapter's own ``build_command``; the conformance kit's ``check_embeddings``
judges the answer. Skips (fails under CI=true) where llama-server or the model is missing.
"""

from __future__ import annotations

import asyncio
import os
import socket
import subprocess
import time
from pathlib import Path

import aiohttp
import pytest

from viiwork.engines.conformance import check_embeddings
from viiwork.engines.contract import BackendSpec, EngineUnavailable, Kind
from viiwork.engines.llamacpp import LlamaCppEngine, LlamaCppOptions

pytestmark = [pytest.mark.engine, pytest.mark.timeout(90)]

ENGINE = LlamaCppEngine()
READY_DEADLINE_S = 60.0


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


async def test_smollm2_embedding_backend_answers_embeddings(llama_server: Path, smollm2_path: Path, tmp_path: Path) -> None:
    port = free_port()
    spec = BackendSpec(
        model="smollm2-embed", kind=Kind.EMBEDDING, path=str(smollm2_path), port=port,
        ctx_per_slot=512, parallel=1, options=LlamaCppOptions(binary=str(llama_server)),
        host_cpus=len(os.sched_getaffinity(0)),
    )
    cmd = ENGINE.build_command(spec)
    assert "--pooling" in cmd.argv, cmd.argv
    log = tmp_path / "llama-server.log"
    with log.open("wb") as out:
        process = subprocess.Popen(
            cmd.argv, env={**os.environ, **cmd.env}, stdout=out, stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL, start_new_session=True,
        )
    base = f"http://127.0.0.1:{port}"
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=20)) as http:
            deadline = time.monotonic() + READY_DEADLINE_S
            while True:
                assert process.poll() is None, f"llama-server exited {process.returncode}:\n{log.read_text()[-2000:]}"
                assert time.monotonic() < deadline, f"not ready within {READY_DEADLINE_S}s:\n{log.read_text()[-2000:]}"
                try:
                    if (await ENGINE.probe(http, base)).ready:
                        break
                except EngineUnavailable:
                    pass
                await asyncio.sleep(0.05)  # poll interval; the deadline bounds the wait
            assert await check_embeddings(http, base, spec.model) == []
    finally:
        process.kill()  # llama-server can hang on SIGTERM; nothing here needs a clean exit
        process.wait(timeout=10)
