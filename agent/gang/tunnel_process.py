"""A gang tunnel's ends as processes of their own (docs/mesh.md, "Gangs").

``python -m viiwork.agent.gang.tunnel_process entry --gang G --rank R --worker NODE --connect
HOST:PORT --port P --dir DIR --peer FILE`` runs the head's end for rank R, a
:class:`~viiwork.agent.gang.tunnel.TunnelEntry`: it listens on ``127.0.0.1:P`` (the head
llama-server's ``--rpc`` endpoint for that rank) and carries each connection over mutual TLS
to the worker's exit at ``HOST:PORT``, whose certificate must be the one in ``FILE``.

``python -m viiwork.agent.gang.tunnel_process exit --gang G --rank R --head NODE --listen
HOST:PORT --rpc-port Q --dir DIR --peer FILE`` runs the worker's end, a
:class:`~viiwork.agent.gang.tunnel.TunnelExit`: it listens on the worker's mesh address and
splices each connection presenting the certificate in ``FILE`` (the head's) to
``127.0.0.1:Q`` (the worker's rpc-server).

Each end's own TLS credential is the gang's (agent/gang/tunnel_cert.py, in ``DIR``), never the
node's mesh key. Each agent starts its end through its runner, as the transient unit
``viiwork-gang-<model>-<gang>-r<R>-tunnel`` beside the gang's other parts
(agent/supervision/gang_units.py): it lives as long as the gang does, and an agent that
restarts adopts it with the gang, so the engine's RPC connections are never cut by an agent's
restart on either host.

Its counters (:class:`~viiwork.agent.gang.tunnel.TunnelCounters`) are written to
``DIR/counters-r<R>.json`` every :data:`COUNTERS_INTERVAL_S` and at exit (a fresh name, then a
rename), which its agent reads for ``/v1/status`` and ``/metrics`` (:func:`read_counters`).
SIGTERM or SIGINT stops it: it closes its listener and cuts what it carries, exit status 0.
Exit status 2: bad arguments; 1: the address could not be bound or the credentials not read.
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
from collections.abc import Callable
from pathlib import Path

from viiwork.agent.gang.tunnel import TunnelCounters, TunnelEntry, TunnelExit
from viiwork.agent.gang.tunnel_cert import entry_context, exit_context, pinned_der
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
    except (OSError, ValueError, RecursionError):  # the engine's user writes there: anything may be
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


def _checked(check: Callable[[object], bool], what: str) -> Callable[[str], str]:
    def parse(value: str) -> str:
        if not check(value):
            raise argparse.ArgumentTypeError(f"not a {what}: {value!r}")
        return value
    return parse


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m viiwork.agent.gang.tunnel_process",
                                description="One end of a gang tunnel (docs/mesh.md, Gangs).")
    ends = p.add_subparsers(dest="end", required=True)
    entry = ends.add_parser("entry", help="the head's end, for one worker")
    exit_ = ends.add_parser("exit", help="a worker's end")
    for sub in (entry, exit_):
        sub.add_argument("--gang", required=True, type=_checked(is_gang_id, "gang id"))
        sub.add_argument("--rank", required=True, type=int, help="the worker's rank")
        sub.add_argument("--dir", required=True, type=Path, help="this end's tunnel directory (credential, counters)")
        sub.add_argument("--peer", required=True, type=Path, help="the other end's certificate (PEM)")
    entry.add_argument("--worker", required=True, type=_checked(is_node_id, "node id"), help="the worker's node id")
    entry.add_argument("--connect", required=True, type=_endpoint, help="the worker's exit, HOST:PORT")
    entry.add_argument("--port", required=True, type=_port, help="the loopback port to listen on")
    exit_.add_argument("--head", required=True, type=_checked(is_node_id, "node id"), help="the head's node id")
    exit_.add_argument("--listen", required=True, type=_endpoint, help="where to listen, HOST:PORT")
    exit_.add_argument("--rpc-port", required=True, type=_port, help="the rpc-server's port on 127.0.0.1")
    exit_.add_argument("--head-host", help="the address the head connects from (its connections keep their slots)")
    return p


def _end(args: argparse.Namespace) -> TunnelEntry | TunnelExit:
    """The end the arguments ask for; raises OSError/ValueError when the credentials cannot be read."""
    peer = pinned_der(args.peer.read_text())
    if args.end == "entry":
        host, port = args.connect
        return TunnelEntry(gang=args.gang, worker=NodeId(args.worker), server_cert=peer, worker_host=host,
                           worker_port=port, ssl_context=entry_context(args.dir, args.peer), listen_port=args.port)
    host, port = args.listen
    return TunnelExit(gang=args.gang, head=NodeId(args.head), client_cert=peer, rpc_port=args.rpc_port,
                      ssl_context=exit_context(args.dir, args.peer), listen_host=host, listen_port=port,
                      head_host=args.head_host)


async def serve(args: argparse.Namespace) -> int:
    try:
        end = _end(args)
    except (OSError, ValueError) as exc:
        log.error("gang %s tunnel %s r%d: cannot read the tunnel credentials in %s: %s", args.gang, args.end,
                  args.rank, args.dir, exc)
        return 1
    try:
        await end.start()
    except OSError as exc:
        log.error("gang %s tunnel %s r%d: cannot listen: %s", args.gang, args.end, args.rank, exc)
        return 1
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    log.info("gang %s tunnel %s r%d: listening on port %d", args.gang, args.end, args.rank, end.port)
    path = counters_path(args.dir, args.rank)
    try:
        while not stop.is_set():
            _write_counters(path, end.counters)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), COUNTERS_INTERVAL_S)
    finally:
        await end.stop()
        _write_counters(path, end.counters)
    return 0


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(levelname)s %(name)s: %(message)s")
    return asyncio.run(serve(args))


if __name__ == "__main__":
    sys.exit(main())
