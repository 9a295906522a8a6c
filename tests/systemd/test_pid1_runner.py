"""SystemdRunner against systemd as PID 1 (system bus, journald, v1 memory/pids controllers).

What the user manager cannot show: limits enforced by the kernel, engines as the
unprivileged ``viiwork`` user with the GPU device groups, journald.
"""

from __future__ import annotations

import asyncio
import grp
import signal
import time
from pathlib import Path

import aiohttp
import pytest
from conftest import require

from support.procs import free_port
from support.systemd import Pid1System, checkout_hidden_by_private_tmp, missing_pid1, pid1_system, unit_show
from viiwork.agent.supervision.runners.base import LaunchRequest
from viiwork.agent.supervision.runners.systemd.runner import SystemdRunner
from viiwork.agent.supervision.runners.systemd.units import engine_unit_stem, gpu_device_groups

pytestmark = pytest.mark.systemd

REPO = Path(__file__).resolve().parents[2]
MiB = 1024 * 1024

# Allocates (and touches) 8 MiB at a time up to TARGET_MIB, printing its progress, then idles.
ALLOCATE = """
import sys, time
target = int(sys.argv[1])
held = []
for i in range(target // 8):
    held.append(b"x" * (8 << 20))
    print("allocated", (i + 1) * 8, "MiB", flush=True)
print("holding", flush=True)
time.sleep(3600)
"""


def request(name: str, argv: tuple[str, ...], **kw) -> LaunchRequest:
    return LaunchRequest(name=name, argv=argv, env={"PATH": "/usr/bin:/bin"}, description=f"viiwork test {name}",
                         labels={"owner": "n1", "model": name, "index": "0", "config_hash": "h"}, stop_timeout_s=5.0,
                         **kw)


async def wait_journal(system: Pid1System, unit: str, text: str, timeout_s: float = 10.0) -> str:
    deadline = time.monotonic() + timeout_s
    while True:
        journal = await asyncio.to_thread(system.journal, unit)
        if text in journal:
            return journal
        assert time.monotonic() < deadline, f"{text!r} not in the journal of {unit}:\n{journal}"
        await asyncio.sleep(0.1)


async def test_memory_max_is_enforced_and_reported(systemd_pid1: Pid1System) -> None:
    runner = await SystemdRunner.connect("system", systemd_pid1.bus_address, engine_user=None)
    try:
        limit = 64 * MiB
        hog = await runner.start(request(engine_unit_stem("n1", "hog", 0), ("/usr/bin/python3", "-c", ALLOCATE, "512"),
                                         memory_max_bytes=limit))
        modest = await runner.start(request(engine_unit_stem("n1", "modest", 0),
                                            ("/usr/bin/python3", "-c", ALLOCATE, "16"), memory_max_bytes=limit))
        assert unit_show(systemd_pid1, hog.unit, "MemoryMax") == str(limit)
        async with asyncio.timeout(30):
            info = await hog.wait()
        if (Path("/sys/fs/cgroup") / "cgroup.controllers").exists():
            # cgroup v2: systemd reads memory.events and says so itself.
            assert info.result == "oom-kill", info
        else:
            # cgroup v1: the kernel's OOM killer sends SIGKILL; systemd cannot name it.
            assert (info.result, info.signal) == ("signal", signal.SIGKILL), info
            assert f"MemoryMax={limit}" in info.detail
        journal = await wait_journal(systemd_pid1, hog.unit, "allocated 8 MiB")
        assert "holding" not in journal  # it never got all 512 MiB
        # Same limit, allocation below it: keeps running (the limit, not the program, killed the hog).
        await wait_journal(systemd_pid1, modest.unit, "holding")
        assert modest.running()
        stopped = await modest.stop(5.0)
        assert stopped.result == "success"
    finally:
        await runner.close()


async def test_tasks_max_is_enforced(systemd_pid1: Pid1System) -> None:
    forker = ("import os, sys, time\n"
              "n = 0\n"
              "try:\n"
              "    for n in range(1, 50):\n"
              "        if os.fork() == 0:\n"
              "            time.sleep(3600)\n"
              "except OSError as exc:\n"
              "    print('fork failed after', n - 1, 'children:', exc.strerror, flush=True)\n"
              "    sys.exit(7)\n"
              "sys.exit(0)\n")
    runner = await SystemdRunner.connect("system", systemd_pid1.bus_address, engine_user=None)
    try:
        handle = await runner.start(request(engine_unit_stem("n1", "forker", 0), ("/usr/bin/python3", "-c", forker),
                                            tasks_max=8))
        async with asyncio.timeout(20):
            info = await handle.wait()
        assert (info.result, info.returncode) == ("exit-code", 7), info
        await wait_journal(systemd_pid1, handle.unit, "fork failed after 7 children")
    finally:
        await runner.close()


def test_engine_runs_as_viiwork_user_with_device_groups_under_strict_sandbox(tmp_path: Path) -> None:
    reason = missing_pid1() or checkout_hidden_by_private_tmp()
    require(reason is None, f"systemd PID 1 tier: {reason}")
    # Host network: the engine's loopback port is reachable from this test.
    with pid1_system(tmp_path / "p1", host_network=True) as system:
        system.nsenter("systemd-sysusers", str(REPO / "systemd" / "sysusers.d" / "viiwork.conf"))
        asyncio.run(_run_as_viiwork(system))


async def _run_as_viiwork(system: Pid1System) -> None:
    port = free_port()
    # Writes into $HOME (the unit's cache directory), then serves HTTP on loopback.
    engine = ("import os, sys, http.server\n"
              "open(os.path.join(os.environ['HOME'], 'probe'), 'w').write('ok')\n"
              "try:\n"
              "    open('/var/lib/outside-home', 'w')\n"
              "    print('wrote outside', flush=True)\n"
              "except OSError as exc:\n"
              "    print('read-only outside home:', exc.strerror, flush=True)\n"
              f"http.server.test(http.server.SimpleHTTPRequestHandler, port={port}, bind='127.0.0.1')\n")
    runner = await SystemdRunner.connect("system", system.bus_address, engine_user="viiwork")
    try:
        assert runner.supplementary_groups == gpu_device_groups()
        handle = await runner.start(request(engine_unit_stem("n1", "as-user", 0), ("/usr/bin/python3", "-c", engine),
                                            sandbox="strict"))
        deadline = time.monotonic() + 20
        async with aiohttp.ClientSession() as http:
            while True:
                try:
                    async with http.get(f"http://127.0.0.1:{port}/", timeout=aiohttp.ClientTimeout(total=2)) as r:
                        if r.status == 200:
                            break
                except aiohttp.ClientError:
                    pass
                assert handle.running(), await handle.wait()
                assert time.monotonic() < deadline, "engine did not serve"
                await asyncio.sleep(0.05)
        user = system.nsenter("ps", "-o", "user=", "-p", str(handle.pid)).stdout.strip()
        assert user == "viiwork"
        status = system.nsenter("cat", f"/proc/{handle.pid}/status").stdout
        groups = {int(g) for g in next(line for line in status.splitlines() if line.startswith("Groups:")).split()[1:]}
        assert {grp.getgrnam(name).gr_gid for name in runner.supplementary_groups} <= groups
        owner = system.nsenter("stat", "-c", "%U %a", "/var/cache/viiwork/engines/probe").stdout.split()
        assert owner[0] == "viiwork"
        await wait_journal(system, handle.unit, "read-only outside home: Read-only file system")
        info = await handle.stop(5.0)
        assert info.result in ("success", "exit-code"), info
    finally:
        await runner.close()
