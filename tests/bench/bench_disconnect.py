"""llama-server: how long a slot stays busy after its client closes the connection.

usage: .venv/bin/python tests/bench/bench_disconnect.py [-n 3] [--model GGUF] [--after 1.0]
       [--max-tokens 2000] [--out FILE]

Starts the real llama-server (``.venv/bin/llama-server``) from the llama.cpp adapter's own
``build_command`` (``--parallel 2``, 2,048 tokens of context per slot), the model SmolLM2-135M
from the demo package unless ``--model`` names another. For each mode (not streamed,
streamed), ``-n`` times: a chat request with ``max_tokens`` 2000 and ``ignore_eos`` (so the
generation would run for many seconds) is sent on a raw TCP connection; once ``GET /slots``
shows a slot ``is_processing`` the bench waits ``--after`` seconds and closes the socket;
then ``/slots`` is polled every 20 ms until no slot is processing. The figure is the time
from the close to that poll (so it carries up to 20 ms of polling), or "still busy" when the
slot did not free within ``--give-up`` seconds (the generation would have ended by itself).

The result decides ``nonstream_stops_on_disconnect`` of the llama.cpp adapter
(docs/engines.md, "When the client goes away").

Prints a Markdown section (and writes it to --out when given).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import aiohttp

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent

from viiwork.agent.config.demo import find_demo_model  # noqa: E402
from viiwork.engines.contract import BackendSpec, Kind  # noqa: E402
from viiwork.engines.llamacpp import LlamaCppEngine, LlamaCppOptions  # noqa: E402

POLL_S = 0.02


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def request_bytes(port: int, stream: bool, max_tokens: int) -> bytes:
    body = json.dumps({
        "model": "bench", "messages": [{"role": "user", "content": "Write a very long story about the sea."}],
        "max_tokens": max_tokens, "ignore_eos": True, "temperature": 0, "seed": 1, "stream": stream,
    }).encode()
    return (f"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n").encode() + body


async def busy_slots(http: aiohttp.ClientSession, base: str) -> int:
    async with http.get(f"{base}/slots") as r:
        return sum(1 for slot in await r.json() if slot.get("is_processing"))


async def wait_until(predicate, timeout_s: float) -> float | None:
    """Seconds until ``await predicate()`` is true, polled every POLL_S; None past timeout_s."""
    start = time.monotonic()
    while time.monotonic() - start < timeout_s:
        if await predicate():
            return time.monotonic() - start
        await asyncio.sleep(POLL_S)
    return None


async def one_run(http: aiohttp.ClientSession, port: int, stream: bool, args: argparse.Namespace) -> float | None:
    base = f"http://127.0.0.1:{port}"
    if await wait_until(lambda: _idle(http, base), 120.0) is None:
        raise SystemExit("llama-server did not go idle between runs")
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(request_bytes(port, stream, args.max_tokens))
    await writer.drain()
    if await wait_until(lambda: _busy(http, base), 30.0) is None:
        raise SystemExit("the request never occupied a slot")
    await asyncio.sleep(args.after)
    writer.close()  # what a client that gives up does: close(2) of its socket
    return await wait_until(lambda: _idle(http, base), args.give_up)


async def _busy(http: aiohttp.ClientSession, base: str) -> bool:
    return await busy_slots(http, base) > 0


async def _idle(http: aiohttp.ClientSession, base: str) -> bool:
    return await busy_slots(http, base) == 0


async def amain(args: argparse.Namespace) -> str:
    binary = ROOT / ".venv" / "bin" / "llama-server"
    model = args.model or find_demo_model()
    port = free_port()
    spec = BackendSpec(model="bench", kind=Kind.CHAT, path=model, port=port, ctx_per_slot=2048, parallel=2,
                       options=LlamaCppOptions(binary=str(binary)), host_cpus=len(os.sched_getaffinity(0)))
    cmd = LlamaCppEngine().build_command(spec)
    log = Path(tempfile.mkdtemp(prefix="bench-disconnect-")) / "llama-server.log"
    figures: dict[str, list[float | None]] = {"not streamed": [], "streamed": []}
    with log.open("wb") as out:
        process = subprocess.Popen(cmd.argv, env={**os.environ, **cmd.env}, stdout=out, stderr=subprocess.STDOUT,
                                   stdin=subprocess.DEVNULL, start_new_session=True)
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5)) as http:
            async def ready() -> bool:
                try:
                    async with http.get(f"http://127.0.0.1:{port}/health") as r:
                        return r.status == 200
                except aiohttp.ClientError:
                    return False
            if await wait_until(ready, 60.0) is None:
                raise SystemExit(f"llama-server not ready in 60 s; see {log}")
            for _ in range(args.n):
                for mode, stream in (("not streamed", False), ("streamed", True)):
                    figures[mode].append(await one_run(http, port, stream, args))
                    print(f"{mode}: {figures[mode][-1]}", file=sys.stderr)
    finally:
        process.kill()  # llama-server hangs on SIGTERM while a request is in flight
        process.wait(timeout=10)

    def show(value: float | None) -> str:
        return f"{value:.2f} s" if value is not None else f"still busy after {args.give_up:g} s"

    lines = [
        "## llama-server: slot busy after the client closed its connection",
        "",
        f"`{Path(sys.argv[0]).name} -n {args.n} --after {args.after:g} --max-tokens {args.max_tokens}`; "
        f"model {Path(model).name}; {platform.machine()}, {len(os.sched_getaffinity(0))} CPUs; "
        f"`{' '.join(Path(a).name if a.startswith('/') else a for a in cmd.argv)}`",
        "",
        "| request | close -> slot free, each run |",
        "|---|---|",
    ]
    for mode, values in figures.items():
        lines.append(f"| {mode} | {', '.join(show(v) for v in values)} |")
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("-n", type=int, default=3, help="runs per mode")
    parser.add_argument("--model", help="GGUF path (default: SmolLM2-135M of the demo package)")
    parser.add_argument("--after", type=float, default=1.0, help="seconds between busy and close")
    parser.add_argument("--max-tokens", type=int, default=2000)
    parser.add_argument("--give-up", type=float, default=90.0, help="seconds to wait for the slot to free")
    parser.add_argument("--out", help="also write the Markdown here")
    args = parser.parse_args()
    text = asyncio.run(amain(args))
    print(text)
    if args.out:
        Path(args.out).write_text(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
