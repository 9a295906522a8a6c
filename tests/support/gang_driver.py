"""A test launcher for gangs: drives ``GangLaunch`` (engines/gang_plan.py) with real processes.

All the gang's "hosts" are on this machine: each rank's part runs the command its adapter
builds (``gang_command``) from that rank's spec and addresses. The driver observes what the
agent's gang launcher will: a part's process running or gone, its ``gang_listen`` address
accepting TCP, the serving part's ``probe`` answering ready, and feeds them to the plan's
tracker, starting the parts its actions name. The fakes (support/fake_gang.py) fail when
started out of order or with wrong ranks or addresses, so a wrong plan ends ``GangFailed``.
"""

from __future__ import annotations

import asyncio
import os
import shlex
import subprocess
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp

from viiwork.engines.contract import BackendSpec, Engine, EngineUnavailable
from viiwork.engines.gang import GangAddresses, GangEngine, GangPart, PartRole
from viiwork.engines.gang_plan import GangAction, GangFailed, GangLaunch, GangPlan, GangServing, Ready, StartParts

FAKE_GANG = Path(__file__).resolve().parent / "fake_gang.py"
PROGRAMS = ("rpc-server", "llama-server", "python", "ray", "vllm")


def gang_binaries(directory: Path) -> dict[str, str]:
    """One executable wrapper per fake program in ``directory``; program -> its path."""
    directory.mkdir(parents=True, exist_ok=True)
    out = {}
    for program in PROGRAMS:
        path = directory / f"fake-{program}"
        path.write_text("#!/bin/sh\n"
                        f"exec {shlex.quote(sys.executable)} {shlex.quote(str(FAKE_GANG))} {program} \"$@\"\n")
        path.chmod(0o755)
        out[program] = str(path)
    return out


@dataclass
class GangRun:
    """What happened: every action in order, the parts started (in order) and their processes."""

    actions: list[GangAction] = field(default_factory=list)
    started: list[GangPart] = field(default_factory=list)
    processes: dict[GangPart, subprocess.Popen[bytes]] = field(default_factory=dict)

    @property
    def outcome(self) -> GangAction | None:
        final = [a for a in self.actions if isinstance(a, (GangServing, GangFailed))]
        return final[-1] if final else None

    def stop(self) -> None:
        for proc in reversed(list(self.processes.values())):
            if proc.poll() is None:
                proc.terminate()
        for proc in self.processes.values():
            try:
                proc.wait(5)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(5)


async def _accepts(endpoint: str) -> bool:
    host, _, port = endpoint.rpartition(":")
    try:
        _, writer = await asyncio.wait_for(asyncio.open_connection(host.strip("[]"), int(port)), 1)
    except (OSError, TimeoutError):
        return False
    writer.close()
    return True


async def drive_gang(engine: Engine, plan: GangPlan, specs: Mapping[int, BackendSpec],
                     addresses: Mapping[int, GangAddresses], run: GangRun, *, env: Mapping[str, str],
                     timeout_s: float = 15.0, until_failed: bool = False) -> GangRun:
    """Start ``plan`` with ``engine``'s commands until it serves or fails (or, with
    ``until_failed``, keep watching a serving gang until it fails); ``run`` collects what
    happened (the caller stops its processes). TimeoutError after ``timeout_s``."""
    assert isinstance(engine, GangEngine)
    launch = GangLaunch(plan)
    pending: list[GangAction] = launch.start()
    http = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=2))
    try:
        async with asyncio.timeout(timeout_s):
            while True:
                while pending:
                    action = pending.pop(0)
                    run.actions.append(action)
                    if isinstance(action, GangFailed):
                        return run
                    if isinstance(action, GangServing) and not until_failed:
                        return run
                    if isinstance(action, StartParts):
                        for part in action.parts:
                            cmd = engine.gang_command(specs[part.rank], part.role, addresses[part.rank])
                            run.started.append(part)
                            run.processes[part] = subprocess.Popen(
                                list(cmd.argv), env={**os.environ, **env, **cmd.env},
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
                for part, proc in list(run.processes.items()):
                    if proc.poll() is not None:
                        pending += launch.part_exited(part, f"exit status {proc.returncode}")
                        continue
                    pending += launch.part_reached(part, Ready.PROCESS)
                    listen = engine.gang_listen(part.role, addresses[part.rank])
                    if listen is not None and await _accepts(listen):
                        pending += launch.part_reached(part, Ready.PORT)
                    if part.role is PartRole.SERVER:
                        spec = specs[part.rank]
                        try:
                            probe = await engine.probe(http, f"http://127.0.0.1:{spec.port}")
                        except EngineUnavailable:
                            continue
                        if probe.ready:
                            pending += launch.part_reached(part, Ready.PROBE)
                if not pending:
                    await asyncio.sleep(0.05)
    finally:
        await http.close()
