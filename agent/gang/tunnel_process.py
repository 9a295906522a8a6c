"""The head's end of a gang tunnel as a process of its own (docs/mesh.md, "Gangs").

``python -m viiwork.agent.gang.tunnel_process --gang G --rank R --worker NODE --connect HOST:PORT
--port P --dir DIR`` runs one :class:`~viiwork.agent.gang.tunnel.TunnelEntry`: it listens on
``127.0.0.1:P`` (the head llama-server's ``--rpc`` endpoint for rank R) and carries each
connection over mutual TLS to the worker's exit at ``HOST:PORT``, whose certificate must be
node ``NODE``'s. Its TLS credential is the gang's own (agent/gang/tunnel_cert.py, files in
``DIR``), not the node's mesh key. The head's agent starts it through its runner, as a
transient unit ``viiwork-gang-<model>-<gang>-r<R>-tunnel`` beside the gang's other parts
(agent/supervision/gang_units.py), so it lives as long as the head's engine does and an
agent that restarts adopts it with the engine: the engine's RPC connections are never cut by
an agent's restart.

Its counters (:class:`~viiwork.agent.gang.tunnel.TunnelCounters`) are written to
``DIR/counters-r<R>.json`` every :data:`COUNTERS_INTERVAL_S` and at exit (a fresh name, then a
rename), which the agent reads for ``/v1/status`` and ``/metrics`` (:func:`read_counters`).
SIGTERM or SIGINT stops it: it closes its listener and cuts what it carries, exit status 0.
Exit status 2: bad arguments; 1: the port could not be bound or the credential not read.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import os
import signal
import sys
from pathlib import Path

from viiwork.agent.gang.tunnel import TunnelCounters, TunnelEntry
from viiwork.agent.gang.tunnel_cert import entry_context
from viiwork.engines.gang import is_gang_id
from viiwork.mesh.identity import NodeId, is_node_id

log = logging.getLogger("viiwork.gang.tunnel")

COUNTERS_INTERVAL_S = 1.0
#: The largest counters file read back (a few hundred bytes are written).
MAX_COUNTERS_BYTES = 16 * 1024


def counters_path(directory: Path, rank: int) -> Path:
    return directory / f"counters-r{rank}.json"


def read_counters(directory: Path, rank: int) -> TunnelCounters | None:
    """The counters the tunnel process of ``rank`` last wrote in ``directory``; None when there
    is no such file or it is not a JSON object (a process that has not written yet). Opens
    without following a link (the directory belongs to the engine's user)."""
    path = counters_path(directory, rank)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
        with os.fdopen(fd, "rb") as f:
            raw = f.read(MAX_COUNTERS_BYTES + 1)
        doc = json.loads(raw) if len(raw) <= MAX_COUNTERS_BYTES else None
    except (OSError, ValueError):
        return None
    return TunnelCounters.from_dict(doc) if isinstance(doc, dict) else None


def _write_counters(path: Path, counters: TunnelCounters) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    with contextlib.suppress(OSError):
        tmp.write_text(json.dumps(counters.as_dict()))
        os.replace(tmp, path)


def _endpoint(value: str) -> tuple[str, int]:
    host, _, port = value.rpartition(":")
    host = host.strip("[]")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise argparse.ArgumentTypeError(f"expected HOST:PORT, got {value!r}")
    return host, int(port)


def _port(value: str) -> int:
    if not value.isdigit() or not 0 < int(value) < 65536:
        raise argparse.ArgumentTypeError(f"expected a port, got {value!r}")
    return int(value)


def _checked(check: object, what: str) -> object:
    def parse(value: str) -> str:
        if not check(value):  # type: ignore[operator]
            raise argparse.ArgumentTypeError(f"not a {what}: {value!r}")
        return value
    return parse


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m viiwork.agent.gang.tunnel_process",
                                description="The head's end of a gang tunnel (docs/mesh.md, Gangs).")
    p.add_argument("--gang", required=True, type=_checked(is_gang_id, "gang id"))  # type: ignore[arg-type]
    p.add_argument("--rank", required=True, type=int)
    p.add_argument("--worker", required=True, type=_checked(is_node_id, "node id"),  # type: ignore[arg-type]
                   help="the worker's node id (its exit's certificate must be this node's)")
    p.add_argument("--connect", required=True, type=_endpoint, help="the worker's exit, HOST:PORT")
    p.add_argument("--port", required=True, type=_port, help="the loopback port to listen on")
    p.add_argument("--dir", required=True, type=Path, help="the gang tunnel's directory (credential, counters)")
    return p


async def serve(args: argparse.Namespace) -> int:
    try:
        context = entry_context(args.dir)
    except (OSError, ValueError) as exc:
        log.error("gang %s tunnel r%d: cannot read the tunnel credential in %s: %s", args.gang, args.rank, args.dir, exc)
        return 1
    host, port = args.connect
    entry = TunnelEntry(gang=args.gang, worker=NodeId(args.worker), worker_host=host, worker_port=port,
                        ssl_context=context, listen_port=args.port)
    try:
        await entry.start()
    except OSError as exc:
        log.error("gang %s tunnel r%d: cannot listen on 127.0.0.1:%d: %s", args.gang, args.rank, args.port, exc)
        return 1
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    log.info("gang %s tunnel r%d: 127.0.0.1:%d -> %s:%d (node %s)", args.gang, args.rank, entry.port, host, port,
             args.worker)
    path = counters_path(args.dir, args.rank)
    try:
        while not stop.is_set():
            _write_counters(path, entry.counters)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), COUNTERS_INTERVAL_S)
    finally:
        await entry.stop()
        _write_counters(path, entry.counters)
    return 0


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(levelname)s %(name)s: %(message)s")
    return asyncio.run(serve(args))


if __name__ == "__main__":
    sys.exit(main())
