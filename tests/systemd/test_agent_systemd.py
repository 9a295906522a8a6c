"""The real agent (``viiwork-agent``) with the systemd runner on a real ``systemd --user``.

- adoption: kill -9 the agent, start it again: same units, same MainPIDs, serving again;
  a changed model entry is replaced, an unchanged one kept; a deliberate stop stops them;
- the agent as a Type=notify unit of the manager: READY/STATUS, `systemctl restart` keeps
  the engines, a frozen agent misses its watchdog and is restarted (engines kept),
  `systemctl stop` stops them.

Models use ``sandbox = "none"``: the fake engine's wrapper lives under /tmp, which the
default profile's PrivateTmp hides (profiles are tested in test_systemd_runner/test_pid1_runner).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path

import pytest

from support.agent import render_config, run_agent
from support.engines import fake_engine_binary
from support.procs import free_port
from support.systemd import UserManager, process_gone, unit_show

pytestmark = pytest.mark.systemd

AGENT_BIN = Path(sys.executable).parent / "viiwork-agent"


def fake_model(name: str, binary: Path, **extra) -> dict:
    return {"name": name, "engine": "llamacpp", "path": "/dev/null", "parallel": 2, "sandbox": "none",
            "env": {"FAKE_LOAD_S": "0"}, **extra, "llamacpp": {"binary": str(binary)}}


def systemd_extra(um: UserManager) -> dict:
    return {"supervisor": {"runner": "systemd", "bus": "user", "bus_address": um.bus_address}}


def backends(doc: dict) -> dict[str, dict]:
    return {b["id"]: b for m in doc["models"] for b in m["backends"]}


def chat(url: str, model: str) -> int:
    body = json.dumps({"model": model, "messages": [{"role": "user", "content": "hi"}]}).encode()
    req = urllib.request.Request(f"{url}/v1/chat/completions", data=body, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=10) as r:
        return r.status


def wait_healthy(url: str, model: str, timeout_s: float = 30.0) -> dict:
    """/v1/status once every backend of ``model`` is healthy (polled, bounded)."""
    def ready() -> dict | None:
        try:
            with urllib.request.urlopen(f"{url}/v1/status", timeout=5) as r:
                doc = json.load(r)
        except OSError:
            return None
        m = next(m for m in doc["models"] if m["name"] == model)
        return doc if m["backends"] and all(b["state"] == "healthy" for b in m["backends"]) else None
    return wait_until(f"{model} healthy at {url}", ready, timeout_s)  # type: ignore[return-value]


def wait_until(what: str, predicate: Callable[[], object], timeout_s: float = 30.0) -> object:
    deadline = time.monotonic() + timeout_s
    while True:
        got = predicate()
        if got:
            return got
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def test_engines_survive_agent_kill_9_and_are_adopted(systemd_user: UserManager, tmp_path: Path) -> None:
    binary = fake_engine_binary(tmp_path / "bin")
    models = [fake_model("alpha", binary), fake_model("beta", binary)]
    extra = systemd_extra(systemd_user)
    with run_agent(tmp_path, models, extra=extra) as agent:
        first = backends(agent.wait_healthy("alpha") and agent.wait_healthy("beta"))
        units = {bid: b["unit"] for bid, b in first.items()}
        pids = {bid: b["pid"] for bid, b in first.items()}
        assert units == {"alpha-0": "viiwork-engine-node-a-alpha-0.service",
                         "beta-0": "viiwork-engine-node-a-beta-0.service"}
        assert all(str(pids[b]) == unit_show(systemd_user, units[b], "MainPID") for b in units)
        os.kill(agent.proc.pid, signal.SIGKILL)
        agent.proc.wait(10)
    # The agent is gone; its engines are not.
    assert all(unit_show(systemd_user, u, "ActiveState") == "active" for u in units.values())

    with run_agent(tmp_path, models, extra=extra) as agent:
        again = backends(agent.wait_healthy("alpha", timeout_s=10) and agent.wait_healthy("beta", timeout_s=10))
        assert {b: again[b]["pid"] for b in again} == pids  # adopted: no new process, no reload
        assert {b: again[b]["unit"] for b in again} == units
        assert "adopting viiwork-engine-node-a-alpha-0.service" in agent.log_text()
        assert chat(agent.url, "alpha") == 200 and chat(agent.url, "beta") == 200
        os.kill(agent.proc.pid, signal.SIGKILL)
        agent.proc.wait(10)

    # beta's entry changes: its engine is replaced; alpha's is kept.
    changed = [fake_model("alpha", binary), fake_model("beta", binary, parallel=3)]
    with run_agent(tmp_path, changed, extra=extra) as agent:
        third = backends(agent.wait_healthy("alpha", timeout_s=10) and agent.wait_healthy("beta", timeout_s=20))
        assert third["alpha-0"]["pid"] == pids["alpha-0"]
        assert third["beta-0"]["pid"] != pids["beta-0"]
        assert process_gone(pids["beta-0"])
        assert "its config entry changed" in agent.log_text()
        final = {b: third[b]["pid"] for b in third}
    # run_agent's exit is SIGTERM: not a restart by systemd (this agent is no unit), so stop.
    for bid, unit in units.items():
        assert unit_show(systemd_user, unit, "LoadState") == "not-found", bid
        assert process_gone(final[bid])


def test_model_removed_from_config_is_stopped_at_start(systemd_user: UserManager, tmp_path: Path) -> None:
    binary = fake_engine_binary(tmp_path / "bin")
    extra = systemd_extra(systemd_user)
    with run_agent(tmp_path, [fake_model("alpha", binary), fake_model("beta", binary)], extra=extra) as agent:
        pids = {b: v["pid"] for b, v in backends(agent.wait_healthy("alpha") and agent.wait_healthy("beta")).items()}
        os.kill(agent.proc.pid, signal.SIGKILL)
        agent.proc.wait(10)
    with run_agent(tmp_path, [fake_model("alpha", binary)], extra=extra) as agent:
        doc = agent.wait_healthy("alpha", timeout_s=10)
        assert backends(doc)["alpha-0"]["pid"] == pids["alpha-0"]
        assert "its model or backend is no longer configured" in agent.log_text()
        wait_until("beta's engine to be gone", lambda: process_gone(pids["beta-0"]), 15)
        assert unit_show(systemd_user, "viiwork-engine-node-a-beta-0.service", "LoadState") == "not-found"


# --- the agent as a notify unit ---------------------------------------------------------------


AGENT_UNIT = "viiwork-test-agent.service"


def start_agent_unit(um: UserManager, workdir: Path, models: list[dict]) -> str:
    """Run viiwork-agent as a Type=notify transient unit of the user manager; returns its URL."""
    port = free_port()
    state = workdir / "agent-state"
    sections = {
        "node": {"name": "node-u", "state_dir": str(state)},
        "api": {"listen": f"127.0.0.1:{port}", "admin_socket": str(state / "admin.sock")},
        "health": {"interval_s": 0.5, "respawn_backoff_s": 0.2},
        **systemd_extra(um),
    }
    config = workdir / "agent.toml"
    config.write_text(render_config(sections, models))
    log = workdir / "agent-unit.log"
    # `systemd-run` waits for the start job, which for Type=notify ends at READY=1.
    # The unit gets the manager's environment: PYTHONPATH passed on runs the code under test
    # (a mutant's scratch copy, tests/mutants/run.py), not the checkout's.
    python_path = [f"--setenv=PYTHONPATH={os.environ['PYTHONPATH']}"] if os.environ.get("PYTHONPATH") else []
    subprocess.run(
        ["systemd-run", "--user", "--quiet", f"--unit={AGENT_UNIT}", *python_path, "-p", "Type=notify",
         "-p", "WatchdogSec=2s",
         "-p", "Restart=on-failure", "-p", "RestartSec=200ms", "-p", "TimeoutStopSec=30s",
         "-p", f"StandardOutput=append:{log}", "-p", f"StandardError=append:{log}",
         str(AGENT_BIN), "--config", str(config), "--log-level", "debug"],
        env=um.env(), check=True, capture_output=True, text=True, timeout=60)
    return f"http://127.0.0.1:{port}"


def test_agent_unit_restart_keeps_engines_watchdog_restarts_stop_stops(systemd_user: UserManager,
                                                                        tmp_path: Path) -> None:
    um = systemd_user
    binary = fake_engine_binary(tmp_path / "bin")
    url = start_agent_unit(um, tmp_path, [fake_model("alpha", binary)])
    log = tmp_path / "agent-unit.log"
    try:
        assert unit_show(um, AGENT_UNIT, "ActiveState") == "active"  # READY=1 was sent
        doc = wait_healthy(url, "alpha")
        engine = backends(doc)["alpha-0"]
        wait_until("STATUS= to show the healthy backend",
                   lambda: unit_show(um, AGENT_UNIT, "StatusText") == "1 model, 1/1 backends healthy, 0/2 slots busy",
                   15)

        # systemctl restart: a restart job; the engine keeps running and is adopted.
        agent_pid = int(unit_show(um, AGENT_UNIT, "MainPID"))
        um.systemctl("restart", AGENT_UNIT)
        assert int(unit_show(um, AGENT_UNIT, "MainPID")) != agent_pid
        doc = wait_healthy(url, "alpha", timeout_s=10)
        assert backends(doc)["alpha-0"]["pid"] == engine["pid"]
        assert "stopping for a restart" in log.read_text()

        # A frozen agent sends no WATCHDOG=1: systemd kills it and starts it again.
        agent_pid = int(unit_show(um, AGENT_UNIT, "MainPID"))
        os.kill(agent_pid, signal.SIGSTOP)
        wait_until("the watchdog restart", lambda: unit_show(um, AGENT_UNIT, "NRestarts") == "1", 20)
        doc = wait_healthy(url, "alpha", timeout_s=15)
        assert backends(doc)["alpha-0"]["pid"] == engine["pid"]
        assert int(unit_show(um, AGENT_UNIT, "MainPID")) != agent_pid

        # systemctl stop: a stop job; the engine is drained and stopped.
        um.systemctl("stop", AGENT_UNIT)
        assert "draining and stopping engines" in log.read_text()
        assert process_gone(engine["pid"])
        assert unit_show(um, engine["unit"], "LoadState") == "not-found"
    finally:
        um.systemctl("stop", AGENT_UNIT, check=False)


def test_second_agent_for_the_node_leaves_the_first_agents_units_running(systemd_user: UserManager,
                                                                          tmp_path: Path) -> None:
    """Issue 14: the same config started twice. The second agent used to bind (unlink) the
    admin socket, adopt the first agent's engine units, fail on the API port and stop those
    units on its way out; now it exits at the state dir's lock, naming the holder."""
    binary = fake_engine_binary(tmp_path / "bin")
    with run_agent(tmp_path, [fake_model("alpha", binary)], extra=systemd_extra(systemd_user)) as agent:
        before = backends(agent.wait_healthy("alpha"))["alpha-0"]
        second = subprocess.run([str(AGENT_BIN), "--config", str(tmp_path / "node-a.toml")], capture_output=True,
                                text=True, timeout=60)
        assert second.returncode != 0
        assert f"in use by another agent (pid {agent.proc.pid})" in second.stderr, second.stderr
        assert unit_show(systemd_user, before["unit"], "ActiveState") == "active"
        assert unit_show(systemd_user, before["unit"], "MainPID") == str(before["pid"])
        after = backends(agent.wait_healthy("alpha", timeout_s=10))["alpha-0"]
        assert after["pid"] == before["pid"] and chat(agent.url, "alpha") == 200
        ctl = subprocess.run([str(AGENT_BIN.parent / "viiworkctl"), "models", "--socket",
                              str(tmp_path / "node-a" / "admin.sock")], capture_output=True, text=True, timeout=30)
        assert ctl.returncode == 0, ctl.stderr
