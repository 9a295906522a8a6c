"""Fake multi-host engine parts: real processes that check they were started in the right order,
with the right ranks and addresses, and fail (exit non-zero) otherwise.

Run as ``python fake_gang.py MODE ARGS...`` (``gang_binaries`` writes one wrapper script per
program, so an adapter's argv runs it unchanged). Each mode takes the flags the adapters build
(engines/*/__init__.py ``gang_command``) and speaks a line protocol of its own over loopback
TCP in place of the real engines' (ggml RPC, torch's rendezvous, Ray's GCS):

- ``rpc-server -H HOST -p PORT [-t N]``: exits 2 unless HOST is 127.0.0.1 (rpc-server has no
  authentication: loopback only). Answers ``HELLO`` with ``RPC <port>``.
- ``llama-server ... --rpc A,B ... --host H --port P``: exits 3 when ``--device none`` is given
  with ``--rpc`` (it turns the RPC devices off), 1 when an RPC server does not answer (as
  llama-server fails at start); then serves ``GET /health`` 200.
- ``python -m sglang.launch_server ... --nnodes N --node-rank I --dist-init-addr H:P --port Q``:
  rank 0 listens on H:P and waits for ranks 1..N-1, each once, with the same N (exit 1 on a
  duplicate, an unknown rank, another N, or FAKE_GANG_TIMEOUT_S without them all); then
  answers ``GO`` to each and serves ``GET /health_generate`` 200 on Q. Rank I > 0 dials H:P
  (retrying until the timeout: ranks start together), sends ``RANK I N``, waits for ``GO`` and
  then runs until rank 0 goes away (exit 1).
- ``ray start --head --port P --node-ip-address A ... --include-dashboard false --block``:
  exits 4 without ``--block`` or with the dashboard on; listens on A:P, counts joined nodes
  (``JOIN <gpus>`` on a connection held open) and answers ``NODES`` with ``<nodes> <gpus>``,
  itself included. ``ray start --address H:P ... --block``: joins (exit 1 when H:P refuses for
  FAKE_GANG_JOIN_S), then runs until the head goes away.
- ``vllm serve ... --tensor-parallel-size T --pipeline-parallel-size M
  --distributed-executor-backend ray`` with ``RAY_ADDRESS``: exits 5 without the ray backend
  or RAY_ADDRESS; asks the head for ``NODES`` until there are T*M GPUs (vLLM's placement
  group), exit 1 after FAKE_GANG_TIMEOUT_S; then serves ``GET /health`` 200.

Every event is appended to FAKE_GANG_LOG (one line: ``<mode> <event> <detail>``), so a test can
also read the order back.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import sys
import time
from collections.abc import Awaitable, Callable

TIMEOUT_S = float(os.environ.get("FAKE_GANG_TIMEOUT_S", "10"))
JOIN_S = float(os.environ.get("FAKE_GANG_JOIN_S", "2"))


def log(mode: str, event: str, detail: str = "") -> None:
    path = os.environ.get("FAKE_GANG_LOG")
    if path:
        with open(path, "a", encoding="utf-8") as f:
            f.write(f"{mode} {event} {detail}".rstrip() + "\n")


def die(mode: str, code: int, why: str) -> None:
    log(mode, "failed", why)
    print(f"fake {mode}: {why}", file=sys.stderr, flush=True)
    os._exit(code)  # from any task: the whole process ends, as a failing engine does


def flag(argv: list[str], name: str, default: str | None = None) -> str | None:
    return argv[argv.index(name) + 1] if name in argv else default


def split_hostport(value: str) -> tuple[str, int]:
    host, _, port = value.rpartition(":")
    return host.strip("[]"), int(port)


async def serve_http(argv: list[str], path: str) -> None:
    """Answer ``GET <path>`` 200 (anything else 404) on --host/--port, or a --host ending in
    .sock / --uds (a Unix socket), until killed."""

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(ConnectionError, asyncio.IncompleteReadError):
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                target = head.split(b" ", 2)[1].decode()
                status, body = ("200 OK", b'{"status":"ok"}') if target == path else ("404 Not Found", b"{}")
                writer.write(f"HTTP/1.1 {status}\r\nContent-Type: application/json\r\n"
                             f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
                await writer.drain()
        writer.close()

    host = flag(argv, "--host", "127.0.0.1") or "127.0.0.1"
    socket_path = flag(argv, "--uds") or (host if host.endswith(".sock") else None)
    if socket_path:
        server = await asyncio.start_unix_server(handle, socket_path)
    else:
        server = await asyncio.start_server(handle, host, int(flag(argv, "--port", "0") or 0))
    async with server:
        await server.serve_forever()


async def rpc_server(argv: list[str]) -> None:
    host, port = flag(argv, "-H", "127.0.0.1"), int(flag(argv, "-p", "50052") or 0)
    if host != "127.0.0.1":
        die("rpc-server", 2, f"-H {host}: rpc-server must listen on loopback only")

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(ConnectionError):
            if (await reader.readline()).strip() == b"HELLO":
                writer.write(f"RPC {port}\n".encode())
                await writer.drain()
        writer.close()

    server = await asyncio.start_server(handle, host, port)
    log("rpc-server", "listening", str(port))
    async with server:
        await server.serve_forever()


async def llama_server(argv: list[str]) -> None:
    rpc = flag(argv, "--rpc")
    if rpc is None:
        die("llama-server", 6, "no --rpc: not a gang head")
    if flag(argv, "--device") == "none":
        die("llama-server", 3, "--device none with --rpc turns the RPC devices off")
    for endpoint in (rpc or "").split(","):
        try:
            reader, writer = await asyncio.wait_for(asyncio.open_connection(*split_hostport(endpoint)), 2)
            writer.write(b"HELLO\n")
            answer = await asyncio.wait_for(reader.readline(), 2)
            writer.close()
        except (OSError, TimeoutError) as exc:
            die("llama-server", 1, f"RPC server {endpoint} unreachable: {exc}")
        if not answer.startswith(b"RPC "):
            die("llama-server", 1, f"RPC server {endpoint} answered {answer!r}")
    log("llama-server", "serving", rpc or "")
    await serve_http(argv, "/health")


async def sglang(argv: list[str]) -> None:
    nnodes, rank = int(flag(argv, "--nnodes", "1") or 1), int(flag(argv, "--node-rank", "0") or 0)
    host, port = split_hostport(flag(argv, "--dist-init-addr", "") or ":0")
    mode = f"sglang-r{rank}"
    if rank == 0:
        joined: dict[int, asyncio.StreamWriter] = {}
        all_in = asyncio.Event()

        async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            words = (await reader.readline()).decode().split()
            if len(words) != 3 or words[0] != "RANK":
                return
            other, their_n = int(words[1]), int(words[2])
            if their_n != nnodes or not 1 <= other < nnodes or other in joined:
                die(mode, 1, f"rank {other} of {their_n} nodes joined a gang of {nnodes} (ranks so far {sorted(joined)})")
            joined[other] = writer
            log(mode, "rank-joined", str(other))
            if len(joined) == nnodes - 1:
                all_in.set()
            await asyncio.Event().wait()  # hold the connection: a rank's exit shows as EOF there

        server = await asyncio.start_server(handle, host, port)
        log(mode, "rendezvous", f"{host}:{port}")
        try:
            await asyncio.wait_for(all_in.wait(), TIMEOUT_S)
        except TimeoutError:
            die(mode, 1, f"ranks {sorted(joined)} of 1..{nnodes - 1} joined within {TIMEOUT_S} s")
        for writer in joined.values():
            writer.write(b"GO\n")
        log(mode, "serving")
        async with server:
            await serve_http(argv, "/health_generate")
        return
    deadline = time.monotonic() + TIMEOUT_S
    while True:
        try:
            reader, writer = await asyncio.open_connection(host, port)
            break
        except OSError:
            if time.monotonic() > deadline:
                die(mode, 1, f"rendezvous {host}:{port} unreachable")
            await asyncio.sleep(0.05)
    writer.write(f"RANK {rank} {nnodes}\n".encode())
    if (await reader.readline()).strip() != b"GO":
        die(mode, 1, "rank 0 refused this rank")
    log(mode, "running")
    await reader.read()  # EOF: rank 0 is gone
    die(mode, 1, "rank 0 went away")


async def ray(argv: list[str]) -> None:
    if "--block" not in argv:
        die("ray", 4, "ray start without --block leaves no process for the unit")
    gpus = int(flag(argv, "--num-gpus", "0") or 0)
    if "--head" in argv:
        if flag(argv, "--include-dashboard") != "false":
            die("ray-head", 4, "the Ray dashboard must be off")
        address, port = flag(argv, "--node-ip-address", "127.0.0.1") or "", int(flag(argv, "--port", "0") or 0)
        nodes = {"head": gpus}

        async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            words = (await reader.readline()).decode().split()
            if words[:1] == ["NODES"]:
                writer.write(f"{len(nodes)} {sum(nodes.values())}\n".encode())
                await writer.drain()
                writer.close()
            elif words[:1] == ["JOIN"]:
                key = f"node{len(nodes)}"
                nodes[key] = int(words[1])
                log("ray-head", "joined", key)
                await reader.read()
                nodes.pop(key, None)

        server = await asyncio.start_server(handle, address, port)
        log("ray-head", "listening", f"{address}:{port}")
        async with server:
            await server.serve_forever()
    head = flag(argv, "--address")
    if head is None:
        die("ray", 4, "neither --head nor --address")
    deadline = time.monotonic() + JOIN_S
    while True:
        try:
            reader, writer = await asyncio.open_connection(*split_hostport(head or ""))
            break
        except OSError:
            if time.monotonic() > deadline:
                die("ray-worker", 1, f"could not join {head}")
            await asyncio.sleep(0.05)
    writer.write(f"JOIN {gpus}\n".encode())
    await writer.drain()
    log("ray-worker", "joined", head or "")
    await reader.read()
    die("ray-worker", 1, "the head went away")


async def vllm(argv: list[str]) -> None:
    address = os.environ.get("RAY_ADDRESS")
    if flag(argv, "--distributed-executor-backend") != "ray" or not address:
        die("vllm", 5, "a gang's vLLM needs --distributed-executor-backend ray and RAY_ADDRESS")
    wanted = int(flag(argv, "--tensor-parallel-size", "1") or 1) * int(flag(argv, "--pipeline-parallel-size", "1") or 1)
    deadline = time.monotonic() + TIMEOUT_S
    have = "nothing"
    while time.monotonic() < deadline:
        try:
            reader, writer = await asyncio.open_connection(*split_hostport(address or ""))
            writer.write(b"NODES\n")
            nodes, gpus = (int(x) for x in (await reader.readline()).split())
            writer.close()
            have = f"{nodes} nodes, {gpus} GPUs"
            if gpus >= wanted:
                log("vllm", "serving", have)
                await serve_http(argv, "/health")
                return
        except (OSError, ValueError) as exc:
            have = str(exc)
        await asyncio.sleep(0.05)
    die("vllm", 1, f"placement group of {wanted} GPUs not ready within {TIMEOUT_S} s ({have})")


MODES: dict[str, Callable[[list[str]], Awaitable[None]]] = {
    "rpc-server": rpc_server, "llama-server": llama_server, "python": sglang, "ray": ray, "vllm": vllm,
}


def main() -> None:
    mode, argv = sys.argv[1], sys.argv[2:]
    if mode == "python" and argv[:2] != ["-m", "sglang.launch_server"]:
        die("python", 7, f"not an SGLang launch: {argv[:2]}")
    if mode == "ray" and argv[:1] != ["start"]:
        die("ray", 7, f"not `ray start`: {argv[:1]}")
    log(mode, "started", " ".join(argv))
    asyncio.run(MODES[mode](argv))


if __name__ == "__main__":
    main()
