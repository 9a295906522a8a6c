"""A stand-in agent for testing viiwork's unit files and lifecycle code under a real systemd.

It does what the real agent does around systemd, with the real modules
(``viiwork.agent.notify``, ``viiwork.agent.supervision.runners.systemd``) and nothing else: adopts its
engine units or starts them (``/usr/bin/sleep infinity`` as the engine), sends READY=1 and
STATUS=, pings the watchdog from its event loop, and on SIGTERM asks systemd whether this is
a restart or a stop (``stop_intent``), stopping its engines only on a stop.

Usage: ``python notify_agent.py --dir DIR [--engines N] [--owner NAME] [--bus system|user]``.
Every step is appended to ``DIR/events.jsonl`` as one JSON object per line. Control files in
DIR: ``fail`` (exit 3 before READY=1, for start-limit tests), ``block`` (renamed to
``blocked``, then the event loop is blocked by a synchronous sleep, for watchdog tests).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import sys
import time
from pathlib import Path

from viiwork.agent.notify import Notifier, StopIntent, stop_intent
from viiwork.agent.supervision.runners.base import LaunchRequest
from viiwork.agent.supervision.runners.systemd.runner import SystemdRunner
from viiwork.agent.supervision.runners.systemd.units import engine_unit_stem

ENGINE_ARGV = ("/usr/bin/sleep", "infinity")


def record(directory: Path, **event: object) -> None:
    event["pid"] = os.getpid()
    event["t"] = time.time()
    with open(directory / "events.jsonl", "a") as f:
        f.write(json.dumps(event) + "\n")
        f.flush()
        os.fsync(f.fileno())


async def watch_block_file(directory: Path) -> None:
    while True:
        if (directory / "block").exists():
            (directory / "block").rename(directory / "blocked")  # once: the next agent runs normally
            record(directory, event="blocking")
            time.sleep(3600)  # deliberately blocks the event loop: the watchdog must fire
        await asyncio.sleep(0.05)


async def amain(args: argparse.Namespace) -> int:
    directory: Path = args.dir
    notifier = Notifier()
    if (directory / "fail").exists():
        record(directory, event="failing")
        return 3
    runner = await SystemdRunner.connect(args.bus, args.bus_address)
    adopted = await runner.adoptable(args.owner)
    handles = list(adopted)
    have = {h.labels.get("index") for h in handles}
    started = []
    for i in range(args.engines):
        if str(i) in have:
            continue
        request = LaunchRequest(
            name=engine_unit_stem(args.owner, "stub-model", i), argv=ENGINE_ARGV, env={"PATH": "/usr/bin:/bin"},
            description=f"viiwork test engine stub-model #{i}",
            labels={"owner": args.owner, "model": "stub-model", "index": str(i), "config_hash": "h"},
            sandbox="basic",
        )
        handle = await runner.start(request)
        handles.append(handle)
        started.append(handle)
    record(directory, event="ready",
           adopted=[{"unit": h.unit, "pid": h.pid} for h in adopted],
           started=[{"unit": h.unit, "pid": h.pid} for h in started],
           engine_user=runner.engine_user)
    notifier.ready(f"stub agent: {len(handles)} engines ({len(adopted)} adopted)")

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGTERM, stop.set)
    tasks = [asyncio.create_task(notifier.run_watchdog(), name="watchdog"),
             asyncio.create_task(watch_block_file(directory), name="block")]
    await stop.wait()
    decision = await stop_intent(runner._conn)
    notifier.stopping(f"stopping: {decision.intent}")
    record(directory, event="stopping", intent=str(decision.intent), job_type=decision.job_type,
           unit=decision.unit, reason=decision.reason)
    if decision.intent is StopIntent.STOP:
        for handle in handles:
            await handle.stop(5.0)
        record(directory, event="engines-stopped")
    for task in tasks:
        task.cancel()
    await runner.close()
    return 0


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--dir", type=Path, required=True)
    p.add_argument("--engines", type=int, default=1)
    p.add_argument("--owner", default="stub")
    p.add_argument("--bus", default="system", choices=["system", "user"])
    p.add_argument("--bus-address", default=None)
    return asyncio.run(amain(p.parse_args()))


if __name__ == "__main__":
    sys.exit(main())
