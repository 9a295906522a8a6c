"""Connection floods: memory per pending TLS handshake, and other clients' latency meanwhile.

usage: .venv/bin/python tests/bench/bench_floods.py [--mesh-conns 8000] [--api-conns 5000]
       [--tls-conns 1500] [-n 300] [--out FILE]

1. **Memory per pending handshake** (in this process, a real :class:`MutualTlsSite` on
   127.0.0.1): ``--pending`` silent TCP connections (from 127.0.2.x, 16 per address), once
   with the caps out of reach (as before issue 14: every connection starts a handshake) and
   once with the defaults (64 pending, 16 per address); the figure is the growth of this
   process's VmRSS divided by the handshakes pending. Then the same flood kept up for 20 s
   (silent connections re-opened as the 5 s handshake timeout closes them): the growth must
   stay flat (asyncio's SSLProtocol is freed at once, not at the next full gc collection).
2. **Other clients meanwhile** (a real ``viiwork-agent`` with an open-trust mesh listener
   and no models, its limits at their defaults): ``-n`` sequential ``GET /v1/status`` from
   127.0.0.1 (p50, p99, max), idle, during ``--mesh-conns`` silent connections to the mesh
   port (from 80 addresses), during ``--api-conns`` slowloris connections to the API (one
   header line, then nothing, from 127.0.0.2), and during both; with the agent's peak RSS
   over its idle RSS (/proc/PID/status VmHWM - VmRSS).
3. **Idle established TLS** (the same agent; in open trust anyone can make a certificate):
   ``--tls-conns`` completed handshakes from 10 addresses that then send nothing: how many
   are established (the rest refused at accept), the agent's RSS growth, and how many are
   still open after 8 s (the first-request deadline is 5 s).

Prints a Markdown section (and writes it to --out when given).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import resource
import socket
import ssl
import statistics
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))  # tests/ for support.*

from aiohttp import web  # noqa: E402

from support.agent import run_agent  # noqa: E402
from support.floods import connect_many, proc_status_kb  # noqa: E402
from viiwork.mesh.transport import MAX_PENDING_HANDSHAKES, MAX_PENDING_PER_ADDRESS, MutualTlsSite  # noqa: E402

MESH = {"trust": "open", "mesh_id": "bench-floods", "listen": "127.0.0.1:0", "advertise": "127.0.0.1",
        "discovery": ["seeds"], "seeds": []}


def close_all(socks: list[socket.socket]) -> None:
    for s in socks:
        s.close()


async def per_handshake(pending: int) -> list[str]:
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    rows = []
    sources = [f"127.0.2.{i}" for i in range(1, 255)]
    # Capped first: memory the uncapped run frees is returned to the system, and would hide
    # the capped run's growth.
    for label, cap, per_address in ((f"capped ({MAX_PENDING_HANDSHAKES}, {MAX_PENDING_PER_ADDRESS}/address)",
                                     MAX_PENDING_HANDSHAKES, MAX_PENDING_PER_ADDRESS),
                                    ("uncapped (before)", 10**9, 10**9)):
        runner = web.AppRunner(web.Application())
        await runner.setup()
        site = MutualTlsSite(runner, "127.0.0.1", 0, ctx, max_pending_handshakes=cap,
                             max_pending_per_address=per_address)
        await site.start()
        base = proc_status_kb(os.getpid(), "VmRSS")
        held = await connect_many(site.port, sources[:pending // 16], 16)
        await asyncio.sleep(0.5)
        grown = proc_status_kb(os.getpid(), "VmRSS") - base
        n = site.pending_handshakes
        rows.append(f"| {label} | {len(held)} | {n} | {grown / 1024:.1f} MiB | "
                    f"{grown / max(n, 1):.0f} KiB |")
        # Kept up: re-open what the handshake timeout closed, for 20 s.
        sustained = grown
        if cap < 10**9:
            until = time.monotonic() + 20
            while time.monotonic() < until:
                await asyncio.sleep(1)
                close_all(held)
                held = await connect_many(site.port, sources[:pending // 16], 16)
                sustained = max(sustained, proc_status_kb(os.getpid(), "VmRSS") - base)
            rows[-1] += f" {sustained / 1024:.1f} MiB |"
        else:
            rows[-1] += " - |"
        close_all(held)
        await runner.cleanup()
    return rows


async def latencies(port: int, n: int) -> list[float]:
    out = []
    for _ in range(n):
        started = time.perf_counter()
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"GET /v1/status HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n")
        raw = await reader.read()
        writer.close()
        assert raw.startswith(b"HTTP/1.1 200"), raw[:100]
        out.append((time.perf_counter() - started) * 1000)
    return out


async def agent_floods(args: argparse.Namespace, agent) -> list[str]:
    doc = agent.wait_for(lambda d: bool(d["mesh"]["self"]["mesh"]), 30, "the mesh address")
    mport = int(doc["mesh"]["self"]["mesh"].rpartition(":")[2])
    aport = int(agent.url.rpartition(":")[2])
    pid = agent.proc.pid
    await latencies(aport, 50)
    idle = proc_status_kb(pid, "VmRSS")
    rows = []
    for label, mesh_n, api_n in (("idle", 0, 0), (f"{args.mesh_conns} silent to the mesh port", args.mesh_conns, 0),
                                 (f"{args.api_conns} slowloris to the API", 0, args.api_conns),
                                 ("both", args.mesh_conns, args.api_conns)):
        held = []
        if mesh_n:
            held += await connect_many(mport, [f"127.0.1.{i}" for i in range(1, 81)], mesh_n // 80)
        if api_n:
            held += await connect_many(aport, ["127.0.0.2"], api_n, first=b"GET /health HTTP/1.1\r\nHost: localhost\r\n")
        lat = sorted(await latencies(aport, args.n))
        peak = proc_status_kb(pid, "VmHWM")
        close_all(held)
        rows.append(f"| {label} | {statistics.median(lat):.2f} | {lat[int(0.99 * (len(lat) - 1))]:.2f} | "
                    f"{lat[-1]:.2f} | {(peak - idle) / 1024:.1f} MiB |")
        await asyncio.sleep(6)  # the held ones time out (head 10 s is longer: closed by us above)
    return rows


async def idle_tls(args: argparse.Namespace, agent, tmp: Path) -> list[str]:
    from cryptography.hazmat.primitives import serialization

    from viiwork.mesh.identity import load_or_create_identity
    from viiwork.mesh.tls import client_context
    from viiwork.mesh.trust import issue_open_certificate, open_mesh_ca

    doc = agent.wait_for(lambda d: bool(d["mesh"]["self"]["mesh"]), 30, "the mesh address")
    mport = int(doc["mesh"]["self"]["mesh"].rpartition(":")[2])
    pid = agent.proc.pid
    rogue = tmp / "rogue"
    rogue.mkdir()
    ident = load_or_create_identity(rogue)
    (rogue / "node.crt").write_bytes(issue_open_certificate(ident, "rogue", MESH["mesh_id"]))
    ctx = client_context(rogue / "node.crt", ident.key_path,
                         open_mesh_ca(MESH["mesh_id"])[1].public_bytes(serialization.Encoding.PEM))
    before = proc_status_kb(pid, "VmRSS")
    writers = []
    for i in range(args.tls_conns):
        try:
            _, w = await asyncio.wait_for(asyncio.open_connection(
                "127.0.0.1", mport, ssl=ctx, server_hostname="x", local_addr=(f"127.0.3.{1 + i % 10}", 0)), 5)
            writers.append(w)
        except (OSError, ssl.SSLError, TimeoutError):
            pass
    await asyncio.sleep(0.5)
    established = sum(1 for w in writers if not w.transport.is_closing())
    grown = proc_status_kb(pid, "VmRSS") - before
    await asyncio.sleep(8)
    still = sum(1 for w in writers if not w.transport.is_closing())
    for w in writers:
        w.close()
    return [f"| {args.tls_conns} | {established} | {grown / 1024:.1f} MiB | {grown / max(established, 1):.0f} KiB "
            f"| {still} |"]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mesh-conns", type=int, default=8000)
    parser.add_argument("--api-conns", type=int, default=5000)
    parser.add_argument("--pending", type=int, default=2000)
    parser.add_argument("--tls-conns", type=int, default=1500)
    parser.add_argument("-n", type=int, default=300)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    handshake_rows = asyncio.run(per_handshake(args.pending))
    with tempfile.TemporaryDirectory() as tmp:
        with run_agent(Path(tmp), [], name="floods", extra={"mesh": MESH}) as agent:
            flood_rows = asyncio.run(agent_floods(args, agent))
            tls_rows = asyncio.run(idle_tls(args, agent, Path(tmp)))
    cmd = "python tests/bench/bench_floods.py " + " ".join(sys.argv[1:])
    text = "\n".join([
        "## Connection floods (issue 14)", "",
        f"`{cmd.strip()}` on {platform.node()} ({os.cpu_count()} CPUs, Python {platform.python_version()}).", "",
        f"Memory per pending TLS handshake on the mesh listener ({args.pending} silent connections, this process's "
        "VmRSS):", "",
        "| listener | connections | handshakes pending | RSS growth | per pending | RSS growth, kept up 20 s |",
        "|---|---|---|---|---|---|", *handshake_rows, "",
        f"Other clients during floods: {args.n} sequential `GET /v1/status` (new connection each) on a real agent "
        "(default limits), milliseconds; the agent's peak RSS over idle:", "",
        "| flood | p50 ms | p99 ms | max ms | agent peak RSS (VmHWM, so far) - idle |", "|---|---|---|---|---|", *flood_rows, "",
        "Idle established TLS connections to the mesh port (open trust, 10 source addresses; the agent's VmRSS):", "",
        "| handshakes tried | established | agent RSS growth | per connection | still open after 8 s |",
        "|---|---|---|---|---|", *tls_rows, "",
    ])
    print(text)
    if args.out:
        args.out.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
