"""One node per identity between real agents (issue 14, item 2; docs/mesh.md, "One node per
identity"): two ``viiwork-agent`` processes started from one copied state dir, on loopback with
different ports, gossiping with a third over mutual TLS (open trust). The higher boot exits
(78) naming the other's address; the other stays; the peer marks the id ``conflict``. A restart
and an address change never trigger it.
"""

from __future__ import annotations

import json
import shutil
import time
import urllib.request
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import pytest

from support.agent import Agent, run_agent
from support.procs import free_port
from viiwork.mesh.identity import load_or_create_identity

DEAD_MS = 1500
EXIT_IDENTITY_CONFLICT = 78


def extra(seeds: list[str], listen: str = "127.0.0.1:0") -> dict[str, dict[str, Any]]:
    return {"mesh": {"trust": "open", "mesh_id": "clone-mesh", "listen": listen, "advertise": "127.0.0.1",
                     "discovery": ["seeds"], "seeds": seeds, "gossip_interval_ms": 100,
                     "suspect_after_ms": 600, "dead_after_ms": DEAD_MS}}


def mesh_doc(agent: Agent) -> dict[str, Any]:
    with urllib.request.urlopen(f"{agent.url}/v1/mesh", timeout=5) as r:
        return json.load(r)


def peer(agent: Agent, name: str) -> dict[str, Any] | None:
    return next((n for n in mesh_doc(agent)["nodes"] if n["name"] == name), None)


def mesh_address(agent: Agent) -> str:
    return agent.wait_for(lambda d: bool(d["mesh"]["self"]["mesh"]), 30, "mesh address")["mesh"]["self"]["mesh"]


def test_copied_state_dir_the_higher_boot_exits_naming_the_other_and_the_other_stays(tmp_path: Path) -> None:
    with ExitStack() as stack:
        c = stack.enter_context(run_agent(tmp_path, [], name="node-c", extra=extra([])))
        seeds = [mesh_address(c)]
        state = tmp_path / "h1" / "node-a"
        load_or_create_identity(state)
        shutil.copytree(state, tmp_path / "h2" / "node-a")  # the state dir copied to a second machine
        agents = [stack.enter_context(run_agent(tmp_path / h, [], name="node-a", extra=extra(seeds)))
                  for h in ("h1", "h2")]
        addresses = [mesh_address(a) for a in agents]
        boots = [mesh_doc(a)["self"]["boot"] for a in agents]
        leaver = boots.index(max(boots))
        stayer = 1 - leaver
        seen_by_c = set()
        deadline = time.monotonic() + 10 * DEAD_MS / 1000
        while agents[leaver].proc.poll() is None and time.monotonic() < deadline:
            view = peer(c, "node-a")
            if view is not None:
                seen_by_c.add(view["liveness"])
            time.sleep(0.05)
        assert agents[leaver].proc.wait(5) == EXIT_IDENTITY_CONFLICT, agents[leaver].log_text()[-3000:]
        last_error = [ln for ln in agents[leaver].log_text().splitlines() if " ERROR " in ln][-1]
        assert addresses[stayer] in last_error and "own node.state_dir" in last_error, last_error
        assert "conflict" in seen_by_c, seen_by_c
        # Both logged it once; the one that stays serves on, and the peer takes it back.
        for a in agents:
            assert a.log_text().count("is also published by another running agent") == 1
        stays = agents[stayer]
        stays.wait_for(lambda d: d["mesh"]["self"]["identity_conflict"] is None, 10, "the conflict over")
        deadline = time.monotonic() + 10
        while (view := peer(c, "node-a")) is None or view["liveness"] != "alive" or view["mesh"] != addresses[stayer]:
            assert time.monotonic() < deadline, view
            time.sleep(0.05)
        assert stays.proc.poll() is None


@pytest.mark.parametrize("new_address", [False, True], ids=["restart on the same address", "address change"])
def test_restart_or_address_change_with_the_same_state_dir_is_no_conflict(tmp_path: Path, new_address: bool) -> None:
    with ExitStack() as stack:
        c = stack.enter_context(run_agent(tmp_path, [], name="node-c", extra=extra([])))
        seeds = [mesh_address(c)]
        port = free_port()
        with run_agent(tmp_path, [], name="node-a", extra=extra(seeds, f"127.0.0.1:{port}")) as first:
            c.wait_for(lambda d: d["mesh"]["peers"].get("alive") == 1, 15, "node-a alive")
            first_boot = mesh_doc(first)["self"]["boot"]
        again = f"127.0.0.1:{free_port() if new_address else port}"
        with run_agent(tmp_path, [], name="node-a", extra=extra(seeds, again)) as second:
            second_address = mesh_address(second)
            assert mesh_doc(second)["self"]["boot"] != first_boot
            seen_by_c = set()
            deadline = time.monotonic() + 2 * DEAD_MS / 1000
            while time.monotonic() < deadline:
                view = peer(c, "node-a")
                if view is not None:
                    seen_by_c.add(view["liveness"])
                assert second.proc.poll() is None, second.log_text()[-3000:]
                time.sleep(0.05)
            assert "conflict" not in seen_by_c
            assert peer(c, "node-a")["mesh"] == second_address and peer(c, "node-a")["liveness"] == "alive"
            assert mesh_doc(second)["self"]["identity_conflict"] is None
            assert "is also published by another running agent" not in second.log_text()
