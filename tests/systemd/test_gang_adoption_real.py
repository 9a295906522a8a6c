"""A gang's head agent killed with -9 and started again adopts the whole gang (issue 21).

Two real agents on loopback, each with the systemd runner on one real ``systemd --user``
(tests/systemd/conftest.py): ``gw`` runs a real ``rpc-server`` when its head asks, ``gh``
serves SmolLM2 with a real ``llama-server --rpc`` through its tunnel process, every layer on
the worker's RPC device. kill -9 of the head's agent leaves its engine and its tunnel running
as units (the worker's part never notices); the head's agent started again adopts all of
them: the same gang id, the same PIDs (no reload), and the same first tokens. A gang whose
tunnel died while the head's agent was away is not adopted: a new gang serves. Then a stop of
the head's agent stops its units, and the worker's part follows its head out.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import pytest
import requests

from support.agent import Agent, node_ids, run_agent, write_config
from support.dbus_relay import DbusRelay
from support.procs import free_port
from support.systemd import UserManager, process_gone, unit_show

pytestmark = [pytest.mark.systemd, pytest.mark.engine, pytest.mark.timeout(420)]

AGENT_BIN = Path(sys.executable).parent / "viiwork-agent"

BODY = {"model": "smol", "prompt": "The lighthouse keeper opened the bottle and read", "max_tokens": 16,
        "temperature": 0, "seed": 42, "top_k": 1, "ignore_eos": True, "cache_prompt": False}


def mesh_section(seeds: list[str]) -> dict[str, Any]:
    return {"trust": "open", "mesh_id": "test-gang-adopt", "listen": "127.0.0.1:0", "advertise": "127.0.0.1",
            "discovery": ["seeds"], "seeds": seeds}


def healthy(doc: dict[str, Any]) -> bool:
    models = [m for m in doc["models"] if m["name"] == "smol"]
    return bool(models) and all(b["state"] == "healthy" for b in models[0]["backends"])


def complete(url: str) -> str:
    r = requests.post(f"{url}/v1/completions", json=BODY, timeout=120)
    assert r.status_code == 200, r.text
    return str(r.json()["choices"][0]["text"])


def snapshot(head: Agent, worker: Agent) -> dict[str, Any]:
    """The gang id and every process of the gang: the head's engine and tunnel, the worker's part."""
    doc = head.status()
    (backend,) = next(m for m in doc["models"] if m["name"] == "smol")["backends"]
    gang = doc["gangs"]["heads"]["smol"]
    (tunnel,) = gang["tunnels"]
    (part,) = worker.status()["gangs"]["parts"]
    return {"gang": gang["gang"], "engine": (backend["unit"], backend["pid"]), "tunnel": (tunnel["unit"], tunnel["pid"]),
            "part": (part["gang"], part["parts"][0]["unit"], part["parts"][0]["pid"])}


@contextlib.contextmanager
def frozen(pid: int) -> Iterator[None]:
    """``pid`` stopped (SIGSTOP) for the block, continued after, whatever happens."""
    os.kill(pid, signal.SIGSTOP)
    try:
        yield
    finally:
        os.kill(pid, signal.SIGCONT)


def wait_log(agent: Agent, text: str, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while text not in agent.log_text():
        assert time.monotonic() < deadline, f"{text!r} not logged within {timeout_s} s:\n{agent.log_text()[-3000:]}"
        time.sleep(0.05)


def start_pair(stack: ExitStack, tmp_path: Path, entry: dict[str, Any], um: UserManager,
               head_supervisor: dict[str, Any] | None = None,
               mesh_extra: dict[str, Any] | None = None) -> tuple[Agent, Agent]:
    """The worker's agent ``gw`` and the head's ``gh`` (systemd runner on ``um``), the gang healthy."""
    runner = {"runner": "systemd", "bus": "user", "bus_address": um.bus_address}
    worker = stack.enter_context(run_agent(tmp_path, [entry], name="gw", extra={
        "mesh": {**mesh_section([]), **(mesh_extra or {})}, "supervisor": runner}))
    address = worker.wait_for(lambda d: bool(d["mesh"]["self"]["mesh"]), 30, "mesh address")["mesh"]["self"]["mesh"]
    head = stack.enter_context(run_agent(tmp_path, [entry], name="gh", extra={
        "mesh": {**mesh_section([address]), **(mesh_extra or {})}, "supervisor": {**runner, **(head_supervisor or {})},
        "health": {"drain_timeout_s": 5}}))
    head.wait_for(healthy, 180, "SmolLM2 served by the gang")
    return worker, head


@pytest.fixture
def entry(tmp_path: Path, llama_server: Path, rpc_server: Path, smollm2_path: Path) -> dict[str, Any]:
    return {"name": "smol", "engine": "llamacpp", "path": str(smollm2_path), "parallel": 1, "ctx_per_slot": 1024,
            "hosts": node_ids(tmp_path, "gh", "gw"), "gang_port": free_port(), "startup_timeout_s": 120, "sandbox": "none",
            "llamacpp": {"binary": str(llama_server), "rpc_binary": str(rpc_server), "threads": 1}}


def test_head_agent_kill_9_and_restart_adopts_the_whole_gang(systemd_user: UserManager, tmp_path: Path,
                                                              entry: dict[str, Any]) -> None:
    runner = {"runner": "systemd", "bus": "user", "bus_address": systemd_user.bus_address}
    with ExitStack() as stack:
        worker = stack.enter_context(run_agent(tmp_path, [entry], name="gw",
                                               extra={"mesh": mesh_section([]), "supervisor": runner}))
        address = worker.wait_for(lambda d: bool(d["mesh"]["self"]["mesh"]), 30, "mesh address")["mesh"]["self"]["mesh"]
        head_extra = {"mesh": mesh_section([address]), "supervisor": runner}

        def run_head() -> Iterator[Agent]:
            return run_agent(tmp_path, [entry], name="gh", extra=head_extra)

        with run_head() as head:
            head.wait_for(healthy, 180, "SmolLM2 served by the gang")
            first = snapshot(head, worker)
            assert first["part"][0] == first["gang"]
            assert first["tunnel"][0] == f"viiwork-gang-smol-{first['gang']}-r1-tunnel-entry.service"
            assert all(unit_show(systemd_user, unit, "MainPID") == str(pid)
                       for unit, pid in (first["engine"], first["tunnel"], first["part"][1:]))
            reference = complete(head.url)
            os.kill(head.proc.pid, signal.SIGKILL)
            head.proc.wait(10)
        # The head's agent is gone; its engine and tunnel are not, nor the worker's part.
        for unit, _ in (first["engine"], first["tunnel"]):
            assert unit_show(systemd_user, unit, "ActiveState") == "active", unit

        with run_head() as head:
            head.wait_for(lambda d: healthy(d) and d["gangs"]["heads"]["smol"]["adopted"], 90, "the gang adopted")
            assert snapshot(head, worker) == first  # same gang, same processes: nothing restarted
            assert f"gang {first['gang']} of smol: adopted" in head.log_text()
            assert complete(head.url) == reference  # the engine kept its RPC devices through the tunnel
            status = head.status()["gangs"]["heads"]["smol"]
            assert status["starts"] == 0 and status["adoptions"] == 1 and status["adopted"] is True
            # Again, but the tunnel dies while the head's agent is away: that gang cannot serve,
            # so it is not adopted: its units are stopped and a new gang starts.
            os.kill(head.proc.pid, signal.SIGKILL)
            head.proc.wait(10)
        os.kill(first["tunnel"][1], signal.SIGKILL)
        with run_head() as head:
            head.wait_for(lambda d: healthy(d) and d["gangs"]["heads"]["smol"]["gang"] not in (None, first["gang"]),
                          180, "a new gang")
            assert "not adopting viiwork-engine-gh-smol-0.service" in head.log_text()
            assert process_gone(first["engine"][1])
            second = snapshot(head, worker)
            assert second["part"][0] == second["gang"] and second["part"][2] != first["part"][2]
            assert complete(head.url) == reference
        # A stop of the head's agent (not a restart) stops its units; the worker's part follows.
        for unit, pid in (second["engine"], second["tunnel"]):
            assert unit_show(systemd_user, unit, "LoadState") == "not-found", unit
            assert process_gone(pid)
        worker.wait_for(lambda d: d["gangs"]["parts"] == [], 30, "the worker's part stopped")
        deadline = time.monotonic() + 15
        while not (process_gone(second["part"][2]) and process_gone(first["part"][2])):
            assert time.monotonic() < deadline, "the worker's rpc-server outlived its part"
            time.sleep(0.1)


def test_worker_agent_frozen_and_suspected_keeps_the_gang_serving(systemd_user: UserManager, tmp_path: Path,
                                                                  entry: dict[str, Any]) -> None:
    """The worker's agent stopped (SIGSTOP) for 4.5 s, long enough for the head to suspect it,
    then resumed: a suspicion that is refuted is not a lost part (its rpc-server and tunnel exit
    are units of their own and serve throughout), so the gang keeps serving: same gang, same
    PIDs. (An agent that restarts faster than the head's watch sees it publish ``restarting``
    is suspected the same way: the CI flake of stop 32.) The head watches every
    WATCH_INTERVAL_S after a watch of up to WATCH_TIMEOUT_S (3 s apart at most while the
    worker is frozen), so it looks at the worker while it is suspect; with
    ``suspicion_mult = 20`` the suspicion lasts 10 s before ``dead``, so the refutation comes
    well within it; and the frozen agent misses at most 2 watches (3 make a lost part)."""
    with ExitStack() as stack:
        worker, head = start_pair(stack, tmp_path, entry, systemd_user, mesh_extra={"suspicion_mult": 20})
        first = snapshot(head, worker)
        reference = complete(head.url)
        with frozen(worker.proc.pid):
            stopped = time.monotonic()
            wait_log(head, "-> suspect", 10)
            time.sleep(max(0.0, stopped + 4.5 - time.monotonic()))
        head.wait_for(lambda d: d["mesh"]["peers"] == {"alive": 1} and "suspect -> alive" in head.log_text(),
                      30, "the worker refuting its suspicion")
        assert complete(head.url) == reference
        assert snapshot(head, worker) == first  # nothing restarted
        status = head.status()["gangs"]["heads"]["smol"]
        assert status["parts_lost"] == 0 and status["starts"] == 1, status


def test_gang_lost_to_a_frozen_worker_is_not_routed_to_while_its_part_is_asked_to_stop(
        systemd_user: UserManager, tmp_path: Path, entry: dict[str, Any]) -> None:
    """The worker's agent stopped (SIGSTOP) until the head holds it ``dead``: the gang is lost
    and its engine stopped at once, while asking the frozen worker to stop its part waits for
    up to 5 s + stop_timeout_s. Meanwhile the backend is not ``healthy`` (a request is
    answered 503, not sent to the stopped engine for a 502); once the worker is back, a new
    gang serves the same tokens."""
    with ExitStack() as stack:
        worker, head = start_pair(stack, tmp_path, entry, systemd_user, {"stop_timeout_s": 20})
        first = snapshot(head, worker)
        reference = complete(head.url)
        with frozen(worker.proc.pid):
            wait_log(head, f"engine unit {first['engine'][0]} (pid {first['engine'][1]}) ended", 30)
            assert "is dead (no answer): stopping the gang" in head.log_text()
            # The worker is still frozen: the head's request to stop its part is pending.
            head.wait_for(lambda d: not healthy(d), 3, "the backend of the lost gang out of service")
            r = requests.post(f"{head.url}/v1/completions", json=BODY, timeout=30)
            assert r.status_code == 503, r.text
        head.wait_for(lambda d: healthy(d) and d["gangs"]["heads"]["smol"]["gang"] not in (None, first["gang"]),
                      180, "a new gang")
        assert complete(head.url) == reference


def test_worker_agent_back_answers_its_head_only_once_it_adopted_its_part(
        systemd_user: UserManager, tmp_path: Path, entry: dict[str, Any]) -> None:
    """kill -9 of the worker's agent and a new one at once, on a slow systemd: its mesh
    listener is up before it has listed and adopted its part (GangWorker.adopt), and a head
    that asks meanwhile must not hear that no part runs (``parts: []``), or it takes the part
    for lost and restarts the gang. The D-Bus relay (support/dbus_relay.py) holds systemd's
    answer to the new agent's listing of its gang units for 1.5 s, longer than the head's
    watch period (1 s), shorter than a watch's timeout (2 s). Same gang, same PIDs after."""
    runner = {"runner": "systemd", "bus": "user", "bus_address": systemd_user.bus_address}
    worker_mesh = {**mesh_section([]), "listen": f"127.0.0.1:{free_port()}"}
    with ExitStack() as stack:
        worker = stack.enter_context(run_agent(tmp_path, [entry], name="gw",
                                               extra={"mesh": worker_mesh, "supervisor": runner}))
        head = stack.enter_context(run_agent(tmp_path, [entry], name="gh", extra={
            "mesh": mesh_section([worker_mesh["listen"]]), "supervisor": runner}))
        head.wait_for(healthy, 180, "SmolLM2 served by the gang")
        first = snapshot(head, worker)
        reference = complete(head.url)
        relay = stack.enter_context(DbusRelay(systemd_user.runtime_dir / "bus", tmp_path / "relay.sock",
                                              (b"ListUnitsByPatterns", b"viiwork-gang-"), hold_s=1.5))
        os.kill(worker.proc.pid, signal.SIGKILL)
        worker.proc.wait(10)
        worker = stack.enter_context(run_agent(tmp_path, [entry], name="gw", extra={
            "mesh": worker_mesh, "supervisor": {**runner, "bus_address": relay.address}}))
        assert relay.held_at is not None, "the new agent never listed its gang units"
        worker.wait_for(lambda d: bool(d["gangs"]["parts"]), 30, "the new worker to adopt its part")
        time.sleep(max(0.0, relay.held_at + 3 - time.monotonic()))  # the head's watches since
        status = head.status()["gangs"]["heads"]["smol"]
        assert status["parts_lost"] == 0 and status["starts"] == 1, status
        assert snapshot(head, worker) == first
        assert complete(head.url) == reference


WORKER_UNIT = "viiwork-test-gang-worker.service"


class UnitAgent:
    """The worker's agent run as a Type=notify unit of the user manager (so that ``systemctl
    restart`` is a restart it can tell from a stop, and publishes ``restarting``)."""

    def __init__(self, um: UserManager, tmp: Path, entry: dict[str, Any], runner: dict[str, Any]) -> None:
        self.um, self.port, self.mesh_port = um, free_port(), free_port()
        mesh = {**mesh_section([]), "listen": f"127.0.0.1:{self.mesh_port}"}
        config = write_config(tmp, [entry], "gw", {"mesh": mesh, "supervisor": runner}, self.port)
        self.log = tmp / "gw-unit.log"
        # The unit gets the manager's environment, not the test's: pass PYTHONPATH on, so that
        # the code under test (a mutant's scratch copy: tests/mutants/run.py) is what it runs.
        python_path = [f"--setenv=PYTHONPATH={os.environ['PYTHONPATH']}"] if os.environ.get("PYTHONPATH") else []
        subprocess.run(
            ["systemd-run", "--user", "--quiet", f"--unit={WORKER_UNIT}", "-p", "Type=notify", *python_path,
             "-p", "TimeoutStopSec=30s", "-p", f"StandardOutput=append:{self.log}",
             "-p", f"StandardError=append:{self.log}", str(AGENT_BIN), "--config", str(config), "--log-level", "debug"],
            env=um.env(), check=True, capture_output=True, text=True, timeout=60)
        self.url = f"http://127.0.0.1:{self.port}"

    def status(self) -> dict[str, Any]:
        return dict(requests.get(f"{self.url}/v1/status", timeout=5).json())

    def wait_for(self, predicate: Callable[[dict[str, Any]], bool], timeout_s: float, what: str) -> dict[str, Any]:
        deadline = time.monotonic() + timeout_s
        while True:
            with contextlib.suppress(requests.RequestException, ValueError):
                doc = self.status()
                if predicate(doc):
                    return doc
            assert time.monotonic() < deadline, f"timed out waiting for {what}; log:\n{self.log.read_text()[-3000:]}"
            time.sleep(0.2)

    def stop(self) -> None:
        self.um.systemctl("stop", WORKER_UNIT, check=False)


def test_worker_agent_restart_keeps_the_gang_serving(systemd_user: UserManager, tmp_path: Path,
                                                     entry: dict[str, Any]) -> None:
    """``systemctl restart`` of the worker's agent: it publishes ``restarting`` and leaves its
    part (rpc-server and tunnel exit units) running; the head waits for it within the restart
    grace instead of restarting the gang; the new agent adopts the part. Same gang, same PIDs,
    requests answered throughout."""
    runner = {"runner": "systemd", "bus": "user", "bus_address": systemd_user.bus_address}
    worker = UnitAgent(systemd_user, tmp_path, entry, runner)
    try:
        with run_agent(tmp_path, [entry], name="gh",
                       extra={"mesh": mesh_section([f"127.0.0.1:{worker.mesh_port}"]), "supervisor": runner}) as head:
            head.wait_for(healthy, 180, "SmolLM2 served by the gang")
            first = snapshot(head, worker)  # type: ignore[arg-type]
            (exit_unit,) = [p["unit"] for p in worker.status()["gangs"]["parts"][0]["parts"]
                            if p["role"] == "tunnel"] or [None]
            reference = complete(head.url)
            systemd_user.systemctl("restart", WORKER_UNIT)
            assert "stopping for a restart" in worker.log.read_text()
            worker.wait_for(lambda d: bool(d["gangs"]["parts"]), 60, "the restarted worker to adopt its part")
            assert complete(head.url) == reference  # the engine kept its RPC device through the restart
            assert snapshot(head, worker) == first  # type: ignore[arg-type]
            status = head.status()["gangs"]["heads"]["smol"]
            assert status["parts_lost"] == 0 and status["starts"] == 1, status
            assert f"gang {first['gang']} of smol: rank 1 adopted" in worker.log.read_text()
            assert exit_unit is None or unit_show(systemd_user, exit_unit, "ActiveState") == "active"
    finally:
        worker.stop()
