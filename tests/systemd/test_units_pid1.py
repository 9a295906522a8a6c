"""The shipped units (systemd/) under a real systemd PID 1, driven by a stand-in agent.

``support/notify_agent.py`` does exactly the agent's systemd part with the real modules
(notify, stop intent, SystemdRunner): so these tests check the unit files, the sysusers
entry, the hardening the agent's code runs under, and the lifecycle rules: restart keeps
engines, stop stops them, a crash or a missed watchdog keeps them, a failure for good stops
them through OnFailure=.
"""

from __future__ import annotations

import json
import sys
import time
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from conftest import require

from support.agent import render_config
from support.engines import fake_engine_binary
from support.procs import free_port
from support.systemd import (
    Pid1System,
    checkout_hidden_by_private_tmp,
    missing_pid1,
    pid1_system,
    unit_main_pid,
    unit_show,
)

pytestmark = pytest.mark.systemd

REPO = Path(__file__).resolve().parents[2]
UNITS = ("viiwork.service", "viiwork-engines.slice", "viiwork-engines-stop.service")
STUB = REPO / "tests" / "support" / "notify_agent.py"
ENGINE = "viiwork-engine-stub-stub\\x2dmodel-0.service"


@dataclass
class InstalledAgent:
    system: Pid1System
    events_dir: Path

    def events(self) -> list[dict]:
        path = self.events_dir / "events.jsonl"
        if not path.exists():
            return []
        return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]

    def wait_for(self, what: str, predicate: Callable[[], object], timeout_s: float = 20.0) -> object:
        deadline = time.monotonic() + timeout_s
        while True:
            got = predicate()
            if got:
                return got
            if time.monotonic() > deadline:
                journal = self.system.journal("viiwork.service")[-3000:]
                raise AssertionError(f"timed out waiting for {what}; events: {self.events()}\njournal:\n{journal}")
            time.sleep(0.05)

    def readies(self) -> list[dict]:
        return [e for e in self.events() if e["event"] == "ready"]

    def stoppings(self) -> list[dict]:
        return [e for e in self.events() if e["event"] == "stopping"]


@pytest.fixture
def agent(systemd_pid1: Pid1System) -> Iterator[InstalledAgent]:
    """The shipped units installed in the container, ExecStart replaced by the stand-in agent."""
    system = systemd_pid1
    events = system.share / "agent"
    events.mkdir()
    for unit in UNITS:
        system.nsenter("cp", str(REPO / "systemd" / unit), f"/etc/systemd/system/{unit}")
    system.nsenter("systemd-sysusers", str(REPO / "systemd" / "sysusers.d" / "viiwork.conf"))
    dropin = (
        "[Unit]\n"
        "StartLimitIntervalSec=1min\n"
        "StartLimitBurst=3\n"
        "[Service]\n"
        "ExecStart=\n"
        f"ExecStart={sys.executable} {STUB} --dir {system.inside(events)}\n"
        f"ReadWritePaths={system.inside(events)}\n"
        "WatchdogSec=2s\n"
        "RestartSec=200ms\n"
    )
    system.nsenter("mkdir", "-p", "/etc/systemd/system/viiwork.service.d")
    system.nsenter("tee", "/etc/systemd/system/viiwork.service.d/test.conf", input=dropin)
    system.systemctl("daemon-reload")
    yield InstalledAgent(system, events)


def test_shipped_units_verify(agent: InstalledAgent) -> None:
    # Inside the container only: systemd-analyze writes /run/systemd/systemd-units-load.
    verify = agent.system.nsenter("systemd-analyze", "verify", "--man=no", *UNITS, check=False)
    assert verify.returncode == 0, verify.stderr
    assert "viiwork" not in verify.stderr, verify.stderr  # no warnings about our units


def test_agent_starts_as_notify_service_and_engines_run_as_viiwork(agent: InstalledAgent) -> None:
    system = agent.system
    # Type=notify: `systemctl start` returns once the agent sent READY=1.
    system.systemctl("start", "viiwork.service")
    assert unit_show(system, "viiwork.service", "ActiveState") == "active"
    assert unit_show(system, "viiwork.service", "StatusText") == "stub agent: 1 engines (0 adopted)"
    (ready,) = agent.readies()
    assert ready["engine_user"] == "viiwork" and [s["unit"] for s in ready["started"]] == [ENGINE]
    assert unit_show(system, ENGINE, "User") == "viiwork"
    assert unit_show(system, ENGINE, "Slice") == "viiwork-engines.slice"
    assert unit_show(system, ENGINE, "MainPID") == str(ready["started"][0]["pid"])
    # The agent runs with the unit's directories.
    assert system.nsenter("stat", "-c", "%a", "/var/lib/viiwork").stdout.strip() == "700"
    assert system.nsenter("test", "-d", "/run/viiwork", check=False).returncode == 0
    assert system.nsenter("getent", "group", "viiwork-admin", check=False).returncode == 0


def test_restart_keeps_engines_and_the_next_agent_adopts_them(agent: InstalledAgent) -> None:
    system = agent.system
    system.systemctl("start", "viiwork.service")
    engine_pid = unit_main_pid(system, ENGINE)
    system.systemctl("restart", "viiwork.service")
    (stopping,) = agent.stoppings()
    assert (stopping["intent"], stopping["job_type"], stopping["unit"]) == ("restart", "restart", "viiwork.service")
    first, second = agent.readies()
    assert second["pid"] != first["pid"]
    assert second["adopted"] == [{"unit": ENGINE, "pid": engine_pid}] and second["started"] == []
    assert unit_main_pid(system, ENGINE) == engine_pid


def test_deliberate_stop_stops_the_engines(agent: InstalledAgent) -> None:
    system = agent.system
    system.systemctl("start", "viiwork.service")
    system.systemctl("stop", "viiwork.service")
    (stopping,) = agent.stoppings()
    assert (stopping["intent"], stopping["job_type"]) == ("stop", "stop")
    assert agent.events()[-1]["event"] == "engines-stopped"
    assert unit_show(system, ENGINE, "ActiveState") in ("inactive", "")
    assert unit_show(system, ENGINE, "LoadState") == "not-found"


def test_crashed_agent_is_restarted_and_adopts_running_engines(agent: InstalledAgent) -> None:
    system = agent.system
    system.systemctl("start", "viiwork.service")
    engine_pid = unit_main_pid(system, ENGINE)
    system.systemctl("kill", "--signal=SIGKILL", "viiwork.service")
    second = agent.wait_for("a restarted agent", lambda: agent.readies()[1:])[0]
    assert second["adopted"] == [{"unit": ENGINE, "pid": engine_pid}]
    assert agent.stoppings() == []  # SIGKILL: nothing ran on the way out
    assert unit_show(system, "viiwork.service", "NRestarts") == "1"


def test_blocked_event_loop_misses_the_watchdog_and_engines_survive(agent: InstalledAgent) -> None:
    system = agent.system
    system.systemctl("start", "viiwork.service")
    engine_pid = unit_main_pid(system, ENGINE)
    (agent.events_dir / "block").touch()
    second = agent.wait_for("the agent restarted by the watchdog", lambda: agent.readies()[1:])[0]
    assert second["adopted"] == [{"unit": ENGINE, "pid": engine_pid}]
    assert "Watchdog timeout" in system.journal("viiwork.service")
    assert unit_show(system, "viiwork.service", "NRestarts") == "1"


def test_agent_failing_for_good_stops_the_engine_slice(agent: InstalledAgent) -> None:
    system = agent.system
    system.systemctl("start", "viiwork.service")
    assert unit_show(system, ENGINE, "ActiveState") == "active"
    (agent.events_dir / "fail").touch()  # every restart now exits 3 before READY=1
    system.systemctl("kill", "--signal=SIGKILL", "viiwork.service")
    agent.wait_for("viiwork.service to fail for good",
                   lambda: unit_show(system, "viiwork.service", "ActiveState") == "failed")
    # Restart=on-failure restarted it until StartLimitBurst=3; only then did it fail (the
    # result stays the last failure's, exit-code).
    assert "Start request repeated too quickly" in system.journal("viiwork.service")
    assert unit_show(system, "viiwork.service", "Result") == "exit-code"
    agent.wait_for("the engines to be stopped by viiwork-engines-stop.service",
                   lambda: unit_show(system, ENGINE, "LoadState") == "not-found")
    assert unit_show(system, "viiwork-engines-stop.service", "Result") == "success"


def test_real_agent_under_the_shipped_unit(tmp_path: Path) -> None:
    """viiwork-agent itself under viiwork.service's hardening, on the system bus: READY=1,
    engines as system units, restart keeps them (adopted), stop stops them."""
    reason = missing_pid1() or checkout_hidden_by_private_tmp()
    require(reason is None, f"systemd PID 1 tier: {reason}")
    # Host network: the agent's API on loopback is reachable from this test. No sysusers
    # here: without the `viiwork` user the engines run as root, which can run the test
    # venv's Python (it lives under /root).
    with pid1_system(tmp_path / "p1", host_network=True) as system:
        port = free_port()
        binary = fake_engine_binary(system.share / "bin")
        # The wrapper execs the venv's Python on fake_engine.py: both outside /tmp, so the
        # default sandbox profile (PrivateTmp) does not hide them.
        config = system.share / "viiwork.toml"
        config.write_text(render_config(
            {"node": {"name": "p1"}, "api": {"listen": f"127.0.0.1:{port}"},
             "health": {"interval_s": 0.5}},
            [{"name": "alpha", "engine": "llamacpp", "path": "/dev/null", "parallel": 2,
              "env": {"FAKE_LOAD_S": "0"}, "llamacpp": {"binary": str(system.inside(binary))}}]))
        for unit in UNITS:
            system.nsenter("cp", str(REPO / "systemd" / unit), f"/etc/systemd/system/{unit}")
        agent_bin = Path(sys.executable).parent / "viiwork-agent"
        system.nsenter("mkdir", "-p", "/etc/systemd/system/viiwork.service.d")
        system.nsenter("tee", "/etc/systemd/system/viiwork.service.d/test.conf",
                       input=f"[Service]\nExecStart=\nExecStart={agent_bin} --config {system.inside(config)}\n")
        system.systemctl("daemon-reload")
        system.systemctl("start", "viiwork.service")  # returns at READY=1
        url = f"http://127.0.0.1:{port}"
        unit = "viiwork-engine-p1-alpha-0.service"
        try:
            engine = _wait_alpha_healthy(url)
            assert engine["unit"] == unit
            assert str(engine["pid"]) == unit_show(system, unit, "MainPID")
            assert unit_show(system, unit, "Slice") == "viiwork-engines.slice"
            assert unit_show(system, unit, "ProtectSystem") == "full"  # the default profile, basic
            # The engine's socket and key live in the agent's runtime dir (docs/security.md).
            assert engine["port"] is None and engine["socket"] == "/run/viiwork/engines/alpha-0/engine.sock"

            system.systemctl("restart", "viiwork.service")
            again = _wait_alpha_healthy(url)
            # Adopted: RuntimeDirectoryPreserve=restart kept its key and socket.
            assert again["pid"] == engine["pid"] and again["socket"] == engine["socket"]
            assert "stopping for a restart" in system.journal("viiwork.service")

            system.systemctl("stop", "viiwork.service")
            assert unit_show(system, unit, "LoadState") == "not-found"
            assert "draining and stopping engines" in system.journal("viiwork.service")
        except BaseException:
            print(system.journal("viiwork.service")[-4000:])
            raise


def _wait_alpha_healthy(url: str, timeout_s: float = 30.0) -> dict:
    deadline = time.monotonic() + timeout_s
    last: object = None
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(f"{url}/v1/status", timeout=5) as r:
                doc = json.load(r)
            (backend,) = next(m for m in doc["models"] if m["name"] == "alpha")["backends"]
            if backend["state"] == "healthy":
                return backend
            last = backend
        except OSError as exc:
            last = exc
        time.sleep(0.05)
    raise AssertionError(f"alpha not healthy within {timeout_s} s; last: {last}")
