"""llama.cpp RPC through the gang tunnel (issue 21) with the real binaries on the CPU.

A real ``rpc-server`` listens on 127.0.0.1 only; a :class:`TunnelExit` (the worker's mesh
certificate, admitting only the head) splices to it, a :class:`TunnelEntry` (the head's
certificate) listens on loopback for ``llama-server --rpc 127.0.0.1:<entry> -ngl 99``, which
offloads every layer of SmolLM2 to the RPC device. Its first 32 tokens (temperature 0, a
fixed seed) must be those of a llama-server alone with the model. Skips (fails under CI=true)
where llama-server or rpc-server is not installed (`make venv` builds both).
"""

from __future__ import annotations

import asyncio
import os
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import aiohttp
import pytest

from support.mesh_nodes import enrol, make_ca
from support.procs import free_port
from viiwork.agent.gang.tunnel import TunnelEntry, TunnelExit
from viiwork.agent.gang.tunnel_cert import entry_context, exit_context, make_credential, pinned_der, write_peer
from viiwork.mesh.identity import load_or_create_identity

pytestmark = [pytest.mark.engine, pytest.mark.timeout(180)]

# SmolLM2's chat template (ChatML); ignore_eos: 32 tokens even where the answer ends sooner.
PROMPT = ("<|im_start|>user\nWrite a short story about a lighthouse keeper who finds a message in a bottle."
          "<|im_end|>\n<|im_start|>assistant\n")
N_PREDICT = 32
# One thread each: on a loaded 2-core host two spinning ggml threads per process made the
# 32 tokens take 14 s instead of 0.5 s (three llama.cpp processes here at once at most).
THREADS = "1"


@contextmanager
def process(argv: list[str], log: Path) -> Iterator[subprocess.Popen[bytes]]:
    with log.open("wb") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                start_new_session=True)
    try:
        yield proc
    finally:
        proc.kill()  # llama-server can hang on SIGTERM with a request in flight
        proc.wait(timeout=10)


async def wait_listening(port: int, proc: subprocess.Popen[bytes], log: Path, timeout_s: float = 30) -> None:
    async with asyncio.timeout(timeout_s):
        while True:
            assert proc.poll() is None, f"{proc.args[0]} exited with {proc.returncode}: {log.read_text()[-2000:]}"
            try:
                _, writer = await asyncio.open_connection("127.0.0.1", port)
            except OSError:
                await asyncio.sleep(0.05)
                continue
            writer.close()
            return


async def first_tokens(http: aiohttp.ClientSession, port: int, proc: subprocess.Popen[bytes], log: Path) -> list[int]:
    """Wait for llama-server's /health (never blocking the loop: the tunnel runs on it), then
    complete PROMPT greedily; returns the generated token ids."""
    base = f"http://127.0.0.1:{port}"
    async with asyncio.timeout(120):
        while True:
            assert proc.poll() is None, f"llama-server exited with {proc.returncode}: {log.read_text()[-3000:]}"
            try:
                async with http.get(f"{base}/health") as resp:
                    if resp.status == 200:
                        break
            except aiohttp.ClientError:
                pass
            await asyncio.sleep(0.1)
        body = {"prompt": PROMPT, "n_predict": N_PREDICT, "temperature": 0, "seed": 42, "top_k": 1,
                "ignore_eos": True,
                "return_tokens": True, "cache_prompt": False}
        async with http.post(f"{base}/completion", json=body) as resp:
            assert resp.status == 200, await resp.text()
            answer = await resp.json()
    tokens = answer["tokens"]
    assert len(tokens) == N_PREDICT, answer
    return [int(t) for t in tokens]


def server_argv(llama_server: Path, model: Path, port: int, *extra: str) -> list[str]:
    return [str(llama_server), "-m", str(model), "--host", "127.0.0.1", "--port", str(port), "-c", "1024",
            "--parallel", "1", "-t", THREADS, "--no-webui", *extra]


async def test_rpc_through_the_tunnel_answers_as_one_host(tmp_path: Path, llama_server: Path, rpc_server: Path,
                                                          smollm2_path: Path) -> None:
    ca = make_ca(tmp_path / "ca")
    for name in ("head", "worker"):
        enrol(tmp_path / name, ca, name)
    head_id = load_or_create_identity(tmp_path / "head").node_id
    worker_id = load_or_create_identity(tmp_path / "worker").node_id

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=90)) as http:
        alone_port = free_port()
        with process(server_argv(llama_server, smollm2_path, alone_port, "--device", "none", "-ngl", "0"),
                     tmp_path / "alone.log") as alone:
            reference = await first_tokens(http, alone_port, alone, tmp_path / "alone.log")

        rpc_port = free_port()
        with process([str(rpc_server), "-H", "127.0.0.1", "-p", str(rpc_port), "-t", THREADS],
                     tmp_path / "rpc-server.log") as worker:
            await wait_listening(rpc_port, worker, tmp_path / "rpc-server.log")
            # Each end's credential, the other's certificate pinned, as the agents make them
            # (agent/gang/tunnel_cert.py).
            head_dir, worker_dir = tmp_path / "h" / "smol-gang-tunnel", tmp_path / "w" / "smol-gang-tunnel"
            head_pem = make_credential(head_dir, "abcdefghijkl", None)
            worker_pem = make_credential(worker_dir, "abcdefghijkl", None)
            tunnel_exit = await TunnelExit(
                gang="smol-1", head=head_id, client_cert=pinned_der(head_pem), rpc_port=rpc_port,
                listen_host="127.0.0.1",
                ssl_context=exit_context(worker_dir, write_peer(worker_dir, "head", head_pem, None))).start()
            entry = await TunnelEntry(
                gang="smol-1", worker=worker_id, server_cert=pinned_der(worker_pem), worker_host="127.0.0.1",
                worker_port=tunnel_exit.port,
                ssl_context=entry_context(head_dir, write_peer(head_dir, "r1", worker_pem, None))).start()
            try:
                head_port = free_port()
                with process(server_argv(llama_server, smollm2_path, head_port, "--rpc", f"127.0.0.1:{entry.port}",
                                         "-ngl", "99"), tmp_path / "head.log") as head:
                    split = await first_tokens(http, head_port, head, tmp_path / "head.log")
            finally:
                await entry.stop()
                await tunnel_exit.stop()

    assert split == reference
    # The weights went to the worker through the tunnel (SmolLM2-135M's GGUF is ~100 MB+),
    # and nothing was refused on the way.
    model_bytes = os.path.getsize(smollm2_path)
    assert entry.counters.bytes_out > model_bytes // 2, (entry.counters.as_dict(), model_bytes)
    assert tunnel_exit.counters.bytes_in == entry.counters.bytes_out
    assert sum(entry.counters.refused.values()) == sum(tunnel_exit.counters.refused.values()) == 0
