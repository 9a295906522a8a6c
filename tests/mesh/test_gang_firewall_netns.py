"""A gang part's nftables rules on real packets: three "hosts" in network namespaces
(support/netns.py), a gang of hosts 1 and 2, host 3 outside it.

The part runs on host 1 through the real ProcessRunner (its event loop in a thread inside
host 1's namespace, so nft and the part run there): a listener on two gang ports and one
port outside the block. While it runs, host 2 (a member) connects to the gang ports and
host 3 does not (dropped: the connect times out), but reaches the port outside the block;
once the part has stopped its table is gone and host 3 connects. Then a worker's part
started the way its agent starts it (``start_part``, on host 2) comes with its table, and
without one under ``gang_firewall = false``. Needs root, iproute2 and nft (Debian's nftables).
"""

from __future__ import annotations

import asyncio
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import aiohttp
import pytest
from conftest import require

from support.netns import Hosts, bridged_hosts, in_netns, netns_available
from viiwork.agent.config.load import parse_config
from viiwork.agent.config.schema import Config
from viiwork.agent.gang.firewall import part_firewall
from viiwork.agent.gang.parts import part_spec, start_part, wait_ready
from viiwork.agent.supervision.backend_task import NodeContext
from viiwork.agent.supervision.runners.base import LaunchRequest
from viiwork.agent.supervision.runners.process import ProcessRunner
from viiwork.engines.gang import GangAddresses, GangPart, PartRole
from viiwork.engines.gang_plan import Ready
from viiwork.engines.sglang import SglangEngine

pytestmark = pytest.mark.netns

GANG_PORT = 29500
OUTSIDE = GANG_PORT + 400  # not in SGLang's block (gang_port .. +15)

# Listens on every port given on host 1's address, accepting (and closing) forever.
LISTENER = """
import socket, sys, selectors
sel = selectors.DefaultSelector()
for port in sys.argv[2:]:
    s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind((sys.argv[1], int(port))); s.listen(16); sel.register(s, selectors.EVENT_READ)
print("listening", flush=True)
while True:
    for key, _ in sel.select():
        conn, _ = key.fileobj.accept(); conn.close()
"""

# Exit 0 when the TCP connect succeeds, 1 when it is refused or times out (a drop).
CONNECT = """
import socket, sys
try:
    socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=float(sys.argv[3])).close()
except OSError:
    sys.exit(1)
"""


def connects(hosts: Hosts, i: int, port: int, timeout_s: float = 0.7) -> bool:
    out = hosts.run(i, [sys.executable, "-c", CONNECT, hosts.address(1), str(port), str(timeout_s)])
    return out.returncode == 0


def has_table(hosts: Hosts, name: str) -> bool:
    return hosts.run(1, ["nft", "list", "table", "inet", name]).returncode == 0


def test_only_the_gangs_hosts_reach_a_parts_ports_while_it_runs(tmp_path: Path) -> None:
    ok, reason = netns_available()
    require(ok, reason)
    require(shutil.which("nft") is not None, "nft is not installed (Debian's nftables)")
    with bridged_hosts(f"vwf{os.getpid() % 10000}", 3) as hosts:
        gang = GangAddresses(gang_id="fwtestaaaaaa", rank=0, size=2,
                             node_addresses=(hosts.address(1), hosts.address(2)), port=GANG_PORT)
        part = GangPart(0, PartRole.SERVER)
        table = part_firewall(part, gang, SglangEngine().gang_ports(part.role, gang))
        assert table is not None
        ready = tmp_path / "listener.log"
        request = LaunchRequest(
            name="viiwork-gang-fw-test", env={"PATH": os.environ.get("PATH", "/usr/bin:/bin")},
            argv=(sys.executable, "-c", LISTENER, hosts.address(1), str(GANG_PORT), str(GANG_PORT + 15), str(OUTSIDE)),
            description="gang firewall test", log_path=str(ready), firewall=table)
        seen: dict[str, object] = {}

        async def part_on_host_1() -> None:
            runner = ProcessRunner()
            handle = await runner.start(request)
            try:
                deadline = time.monotonic() + 10
                while b"listening" not in ready.read_bytes():
                    assert handle.running() and time.monotonic() < deadline, ready.read_text()
                    await asyncio.sleep(0.05)
                seen["table while running"] = await asyncio.to_thread(has_table, hosts, table.name)
                for who, i in (("member", 2), ("outsider", 3)):
                    for port in (GANG_PORT, GANG_PORT + 15, OUTSIDE):
                        seen[f"{who} to {port}"] = await asyncio.to_thread(connects, hosts, i, port)
            finally:
                await handle.stop(5.0)
            seen["table after stop"] = await asyncio.to_thread(has_table, hosts, table.name)

        in_netns(hosts.ns(1), lambda: asyncio.run(part_on_host_1()), timeout_s=60)
        assert seen == {
            "table while running": True,
            "member to 29500": True, "member to 29515": True, "member to 29900": True,
            "outsider to 29500": False, "outsider to 29515": False, "outsider to 29900": True,
            "table after stop": False,
        }
        # The rules ended with the part: the outsider reaches the gang's port again.
        listener = hosts.popen(1, [sys.executable, "-c", LISTENER, hosts.address(1), str(GANG_PORT)],
                               stdout=subprocess.PIPE)
        assert listener.stdout is not None and listener.stdout.readline().strip() == b"listening"
        assert connects(hosts, 3, GANG_PORT)


def gang_config(tmp_path: Path, python: Path, firewall: bool) -> Config:
    return parse_config(f"""
[node]
name = "h2"
state_dir = "{tmp_path / 'state'}"
[mesh]
trust = "ca"
ca_certificate = "{tmp_path / 'ca.crt'}"
[supervisor]
runner = "process"
[[models]]
name = "big"
engine = "sglang"
path = "/models/big"
gpus = [0]
hosts = ["h1", "h2"]
gang_port = {GANG_PORT}
gang_firewall = {str(firewall).lower()}
[models.sglang]
python = "{python}"
""")


@pytest.mark.parametrize("firewall", [True, False], ids=["gang_firewall", "gang_firewall-false"])
def test_a_worker_part_starts_with_its_table_and_stops_without_it(tmp_path: Path, firewall: bool) -> None:
    """start_part (agent/gang/parts.py), as a worker's agent calls it, on host 2 (rank 1 of
    an SGLang gang): the part's table lives in host 2's namespace exactly as long as the part;
    with ``gang_firewall = false`` there is none."""
    ok, reason = netns_available()
    require(ok, reason)
    require(shutil.which("nft") is not None, "nft is not installed (Debian's nftables)")
    rank = tmp_path / "fake-sglang"  # stands for `python -m sglang.launch_server ...`: runs until stopped
    rank.write_text("#!/bin/sh\nexec sleep 600\n")
    rank.chmod(0o755)
    config = gang_config(tmp_path, rank, firewall)
    model = config.models[0]
    part = GangPart(1, PartRole.RANK)
    with bridged_hosts(f"vwp{os.getpid() % 10000}", 2) as hosts:
        gang = GangAddresses(gang_id="fwpartaaaaaa", rank=1, size=2,
                             node_addresses=(hosts.address(1), hosts.address(2)), port=GANG_PORT)
        name = f"viiwork_gang_{gang.gang_id}_r1_rank"

        def listed() -> bool:
            return hosts.run(2, ["nft", "list", "table", "inet", name]).returncode == 0

        async def worker_on_host_2() -> tuple[bool, bool]:
            async with aiohttp.ClientSession() as http:
                node = NodeContext(config=config, runner=ProcessRunner(), http=http, node_name="h2",
                                   vendor_of=lambda gpu: "nvidia", environ=None, gate=asyncio.Semaphore(1),
                                   engine_dir=tmp_path / "engines", host_cpus=2)
                handle = await start_part(node, model, part_spec(node, model, 1), part, gang)
                try:
                    await wait_ready(handle, Ready.PROCESS, None)
                    running = await asyncio.to_thread(listed)
                finally:
                    await handle.stop(5.0)
                return running, await asyncio.to_thread(listed)

        running, after = in_netns(hosts.ns(2), lambda: asyncio.run(worker_on_host_2()), timeout_s=60)
        assert (running, after) == (firewall, False)
