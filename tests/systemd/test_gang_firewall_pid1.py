"""A gang part's nftables table owned by its unit, under systemd as PID 1 (in namespaces,
with a network namespace of its own: the machine's rules are never touched).

The engine runs as the unprivileged ``viiwork`` user in the strict sandbox; the table is made
by the unit's privileged ``ExecStartPre=`` and deleted by its ``ExecStopPost=``: present while
the part runs, gone after a stop, and gone after the engine exits by itself.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from conftest import require

from support.systemd import Pid1System, checkout_hidden_by_private_tmp, missing_pid1, pid1_system
from viiwork.agent.gang.firewall import part_firewall
from viiwork.agent.supervision.runners.base import LaunchRequest, NftTable
from viiwork.agent.supervision.runners.nft import nft_binary
from viiwork.agent.supervision.runners.systemd.runner import SystemdRunner
from viiwork.engines.gang import GangAddresses, GangPart, PartRole
from viiwork.engines.vllm import VllmEngine

pytestmark = pytest.mark.systemd

REPO = Path(__file__).resolve().parents[2]


def table_for(rank: int) -> NftTable:
    gang = GangAddresses(gang_id="pidonefwaaaa", rank=rank, size=2, node_addresses=("10.7.0.1", "10.7.0.2"),
                         port=29500)
    part = GangPart(rank, PartRole.RUNTIME)
    table = part_firewall(part, gang, VllmEngine().gang_ports(part.role, gang))
    assert table is not None
    return table


def request(name: str, table: NftTable, code: str) -> LaunchRequest:
    return LaunchRequest(name=name, argv=("/usr/bin/python3", "-c", code), env={"PATH": "/usr/bin:/bin"},
                         description=f"viiwork test {name}", labels={"owner": "n1", "model": "big", "index": "0"},
                         stop_timeout_s=5.0, sandbox="strict", firewall=table)


def listed(system: Pid1System, table: NftTable) -> str | None:
    done = system.nsenter("nft", "list", "table", table.family, table.name, check=False)
    return done.stdout if done.returncode == 0 else None


def test_the_unit_makes_its_table_before_the_engine_and_deletes_it_however_it_stops(tmp_path: Path) -> None:
    reason = missing_pid1() or checkout_hidden_by_private_tmp()
    require(reason is None, f"systemd PID 1 tier: {reason}")
    try:
        nft_binary()
    except Exception as exc:  # noqa: BLE001 - RunnerError naming the package
        require(False, str(exc))
    with pid1_system(tmp_path / "p1") as system:
        system.nsenter("systemd-sysusers", str(REPO / "systemd" / "sysusers.d" / "viiwork.conf"))
        asyncio.run(_lifecycle(system))


async def _lifecycle(system: Pid1System) -> None:
    runner = await SystemdRunner.connect("system", system.bus_address, engine_user="viiwork")
    try:
        stopped, crashed = table_for(0), table_for(1)
        handle = await runner.start(request("viiwork-gang-fw-stop", stopped, "import time; time.sleep(600)"))
        rules = listed(system, stopped)
        assert rules is not None and "tcp dport 29500-29755 drop" in rules, rules
        assert "ip saddr { 10.7.0.1, 10.7.0.2 } accept" in rules
        info = await handle.stop(5.0)
        assert info.result in ("success", "signal", "exit-code"), info
        assert listed(system, stopped) is None
        # An engine that exits by itself (a part that dies): ExecStopPost= runs all the same.
        handle = await runner.start(request("viiwork-gang-fw-crash", crashed, "import time; time.sleep(0.5); exit(3)"))
        async with asyncio.timeout(20):
            info = await handle.wait()
        assert (info.result, info.returncode) == ("exit-code", 3), info
        for _ in range(50):  # the stop-post command runs as the unit goes inactive
            if listed(system, crashed) is None:
                break
            await asyncio.sleep(0.1)
        assert listed(system, crashed) is None
    finally:
        await runner.close()
