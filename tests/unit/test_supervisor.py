"""The supervisor's health ladder against real fake-engine processes (ProcessRunner).

Every backend here is a real process (support/fake_engine.py) launched through the real
llamacpp adapter's command line; intervals are shortened through the config, never patched.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import time
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import tomli_w

from support.engines import fake_engine_binary
from viiwork.agent.config.load import parse_config
from viiwork.agent.config.schema import Config
from viiwork.agent.supervision.backends import Backend, BackendId, BackendState, ModelRuntime, ModelState
from viiwork.agent.supervision.launch import config_hash, escape_name
from viiwork.agent.supervision.runners.process import ProcessRunner
from viiwork.agent.supervision.supervisor import Supervisor, UnknownModel

FAST_HEALTH = {
    "interval_s": 0.1,
    "timeout_s": 0.5,
    "max_failures": 2,
    "max_respawns": 2,
    "drain_timeout_s": 5.0,
    "respawn_backoff_s": 0.05,
    "respawn_backoff_max_s": 0.2,
}
FAST_SUPERVISOR = {
    "runner": "process",
    "max_parallel_loads": 4,
    "stop_timeout_s": 2.0,
    "load_poll_interval_s": 0.1,
    "load_stale_after_s": 0.3,
    "respawn_jitter_s": 0.1,
}


def make_config(tmp_path: Path, models: list[dict[str, Any]], health: dict | None = None,
                supervisor: dict | None = None) -> Config:
    """A config through the real loader (TOML text), with fast intervals."""
    data = {
        "node": {"name": "n1", "state_dir": str(tmp_path / "state")},
        "health": {**FAST_HEALTH, **(health or {})},
        "supervisor": {**FAST_SUPERVISOR, **(supervisor or {})},
        "models": models,
    }
    return parse_config(tomli_w.dumps(data))


def fake_model(binary: Path, name: str = "m", env: dict[str, str] | None = None, **fields: Any) -> dict[str, Any]:
    return {
        "name": name,
        "engine": "llamacpp",
        "path": "/models/fake.gguf",
        "parallel": 2,
        "ctx_per_slot": 512,
        "env": {"FAKE_LOAD_S": "0.1", **(env or {})},
        "llamacpp": {"binary": str(binary)},
        **fields,
    }


def alive(pid: int | None) -> bool:
    if pid is None:
        return False
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except (FileNotFoundError, IndexError):
        return False


async def eventually(predicate, timeout_s: float = 10.0, what: str = "") -> Any:
    """Poll ``predicate`` until truthy (returns it) or fail after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s} s waiting for {what or predicate}")
        await asyncio.sleep(0.02)


class Recorder:
    """A runtime listener recording every backend's (state, pid, phase) at each notify."""

    def __init__(self, runtime: ModelRuntime) -> None:
        self.runtime = runtime
        self.events: list[tuple[tuple[BackendState, int | None, str], ...]] = []
        runtime.listeners.append(self)

    def __call__(self, runtime: ModelRuntime) -> None:
        self.events.append(tuple((b.state, b.pid, b.phase) for b in runtime.backends))

    def states(self, index: int = 0) -> list[BackendState]:
        out: list[BackendState] = []
        for event in self.events:
            if not out or out[-1] is not event[index][0]:
                out.append(event[index][0])
        return out


@pytest.fixture
async def http():
    async with aiohttp.ClientSession() as session:
        yield session


@pytest.fixture
def binary(tmp_path: Path) -> Path:
    return fake_engine_binary(tmp_path / "bin")


@pytest.fixture
async def supervise(http):
    """Start a Supervisor for a config; every one is stopped at the end, leaving no task."""
    started: list[Supervisor] = []
    before = asyncio.all_tasks()

    async def make(config: Config, **kwargs: Any) -> Supervisor:
        sup = Supervisor(config, ProcessRunner(), http, "n1", **kwargs)
        await sup.start()
        started.append(sup)
        return sup

    yield make
    pids = [b.pid for s in started for rt in s.models.values() for b in rt.backends if b.pid]
    for sup in started:
        async with asyncio.timeout(30):
            await sup.stop()
    leaked = {t for t in asyncio.all_tasks() - before if not t.done() and t is not asyncio.current_task()}
    assert not leaked, f"tasks left after stop(): {leaked}"
    assert not [p for p in pids if alive(p)], "engine processes left after stop()"


def backend_of(sup: Supervisor, model: str = "m", index: int = 0) -> Backend:
    return sup.models[model].backends[index]


async def healthy(backend: Backend, timeout_s: float = 10.0) -> Backend:
    await eventually(lambda: backend.state is BackendState.HEALTHY, timeout_s, f"{backend.id} healthy")
    return backend


# ----------------------------------------------------------------- starting -> healthy


async def test_starting_shows_loading_phase_then_healthy(tmp_path, binary, supervise):
    config = make_config(tmp_path, [fake_model(binary, env={"FAKE_LOAD_S": "1.0"})])
    sup = await supervise(config)
    rec = Recorder(sup.models["m"])
    b = backend_of(sup)
    await eventually(lambda: b.state is BackendState.STARTING and b.phase == "loading model", 10,
                     "the engine's loading phase")
    # llama.cpp binds a Unix socket in the backend's private directory, not a port.
    assert b.pid is not None and b.port is None and b.socket_path == str(tmp_path / "state/engines/m-0/engine.sock")
    assert sup.status()[0]["backends"][0]["phase"] == "loading model"
    await healthy(b)
    assert rec.states()[-1] is BackendState.HEALTHY
    assert b.phase == "" and b.reason == ""
    # The first load read follows at once: /slots of the fake (2 slots of 512 tokens).
    await eventually(lambda: b.load is not None, 5, "first load read")
    assert (b.load.slots, b.load.busy, b.load.waiting, b.load.ctx_per_slot) == (2, 0, 0, 512)
    status = sup.status()[0]
    assert (status["name"], status["engine"], status["kind"], status["state"]) == ("m", "llamacpp", "chat", "running")
    assert (status["slots"], status["busy"], status["waiting"], status["ctx_per_slot"]) == (2, 0, 0, 512)
    assert status["backends"][0]["pid"] == b.pid and status["backends"][0]["respawns"] == 0
    log = (tmp_path / "state" / "logs" / "m-0.log").read_text()
    assert f"listening on unix:{b.socket_path}" in log


async def test_engine_environment_is_pinned_and_free_of_agent_secrets(tmp_path, binary, supervise):
    environ = {
        "PATH": os.environ["PATH"],
        "CUDA_VISIBLE_DEVICES": "0",
        "NOTIFY_SOCKET": "/run/systemd/notify",
        "VIIWORK_SECRET": "s3cret",
    }
    config = make_config(tmp_path, [fake_model(binary, name="org/m", env={"FAKE_LOAD_S": "0", "EXTRA": "1"})])
    sup = await supervise(config, environ=environ)
    b = await healthy(backend_of(sup, "org/m"))
    raw = Path(f"/proc/{b.pid}/environ").read_bytes().split(b"\0")
    env = dict(item.decode().split("=", 1) for item in raw if item)
    assert env["CUDA_VISIBLE_DEVICES"] == "-1"  # a CPU model: every GPU hidden
    assert "NOTIFY_SOCKET" not in env and "VIIWORK_SECRET" not in env
    assert env["EXTRA"] == "1"
    cmdline = Path(f"/proc/{b.pid}/cmdline").read_bytes().split(b"\0")
    assert b"--alias" in cmdline and cmdline[cmdline.index(b"--alias") + 1] == b"org/m"
    assert (tmp_path / "state" / "logs" / f"{escape_name('org/m')}-0.log").exists()
    assert escape_name("org/m") == "org_2fm"


# ----------------------------------------------------------------- exits, respawn, dead


async def test_kill_9_is_respawned_and_healthy_again(tmp_path, binary, supervise):
    sup = await supervise(make_config(tmp_path, [fake_model(binary)]))
    b = await healthy(backend_of(sup))
    rec = Recorder(sup.models["m"])
    first_pid = b.pid
    os.kill(first_pid, signal.SIGKILL)
    await eventually(lambda: b.respawns == 1 and b.state is BackendState.HEALTHY and b.pid != first_pid, 10,
                     "respawned and healthy")
    assert BackendState.UNHEALTHY in rec.states()
    assert (b.exit_result, b.exit_status) == ("signal", signal.SIGKILL)
    assert alive(b.pid) and not alive(first_pid)


async def test_respawn_budget_spent_is_dead_with_reason(tmp_path, binary, supervise):
    config = make_config(tmp_path, [fake_model(binary, env={"FAKE_START_FAIL": "1"})], health={"max_respawns": 1})
    sup = await supervise(config)
    runtime = sup.models["m"]
    b = backend_of(sup)
    await eventually(lambda: b.state is BackendState.DEAD, 15, "dead")
    assert b.reason == "exited: exit-code (status 1)"
    assert b.respawns == 1
    assert runtime.state is ModelState.DEAD and not runtime.can_ever_serve
    status = sup.status()[0]
    assert status["state"] == "dead"
    assert status["backends"][0]["reason"] == "exited: exit-code (status 1)"
    assert (status["backends"][0]["exit_result"], status["backends"][0]["exit_status"]) == ("exit-code", 1)
    # Each run exited at once: retried once on a new port, not counted: 2 runs x 2 launches.
    log = (tmp_path / "state" / "logs" / "m-0.log").read_text()
    assert log.count("--- viiwork:") == 4


async def test_binary_missing_is_dead_and_other_models_still_serve(tmp_path, binary, supervise):
    config = make_config(tmp_path, [
        fake_model(Path("/nonexistent/llama-server"), name="broken"),
        fake_model(binary, name="ok"),
    ], health={"max_respawns": 1})
    sup = await supervise(config)
    broken = backend_of(sup, "broken")
    await eventually(lambda: broken.state is BackendState.DEAD, 10, "dead")
    assert broken.reason.startswith("binary not found: /nonexistent/llama-server")
    assert broken.pid is None
    await healthy(backend_of(sup, "ok"))
    by_name = {m["name"]: m for m in sup.status()}
    assert by_name["broken"]["state"] == "dead" and by_name["ok"]["state"] == "running"
    assert "binary not found" in by_name["broken"]["backends"][0]["reason"]


async def test_up_revives_a_dead_model(tmp_path, supervise):
    engine = tmp_path / "bin" / "engine"
    engine.parent.mkdir()
    engine.write_text("#!/bin/sh\necho broken build >&2\nexit 2\n")
    engine.chmod(0o755)
    sup = await supervise(make_config(tmp_path, [fake_model(engine)], health={"max_respawns": 0}))
    b = backend_of(sup)
    await eventually(lambda: b.state is BackendState.DEAD, 10, "dead")
    assert b.reason == "exited: exit-code (status 2)"
    fake_engine_binary(engine.parent, name="engine")  # the operator fixes the install
    await sup.up("m")
    await healthy(b)
    assert sup.models["m"].state is ModelState.RUNNING


async def test_startup_timeout_ends_patience(tmp_path, binary, supervise):
    config = make_config(
        tmp_path, [fake_model(binary, env={"FAKE_LOAD_S": "60"}, startup_timeout_s=2.0)],
        health={"max_respawns": 0},
    )
    sup = await supervise(config)
    b = backend_of(sup)
    await eventually(lambda: b.phase == "loading model", 10, "loading")
    pid = b.pid
    await eventually(lambda: b.state is BackendState.DEAD, 10, "dead")
    assert b.reason == "startup timeout: not ready after 2 s (phase: loading model)"
    assert not alive(pid)


async def test_probe_failures_without_requests_make_it_unhealthy(tmp_path, binary, supervise):
    config = make_config(tmp_path, [fake_model(binary)], supervisor={"stop_timeout_s": 0.3})
    sup = await supervise(config)
    b = await healthy(backend_of(sup))
    rec = Recorder(sup.models["m"])
    frozen = b.pid
    os.kill(frozen, signal.SIGSTOP)  # answers nothing: every probe times out
    try:
        await eventually(lambda: b.respawns == 1 and b.state is BackendState.HEALTHY, 15, "respawned")
    finally:
        if alive(frozen):
            os.kill(frozen, signal.SIGKILL)
    assert BackendState.UNHEALTHY in rec.states()
    assert not alive(frozen)
    assert b.pid != frozen


async def test_probe_timeouts_while_busy_are_not_failures_and_load_goes_stale(tmp_path, binary, supervise):
    # The operator's --parallel 3 (args go last) beats the config's 2: the engine reports 3.
    config = make_config(tmp_path, [fake_model(binary, args=["--parallel", "3"])],
                         health={"timeout_s": 0.2})
    sup = await supervise(config)
    b = await healthy(backend_of(sup))
    await eventually(lambda: b.slots == 3, 5, "engine-reported slots")
    rec = Recorder(sup.models["m"])
    b.in_flight = 1  # routing's count: a request is being served
    os.kill(b.pid, signal.SIGSTOP)  # mid-prefill, the engine answers neither /health nor /slots
    try:
        await eventually(lambda: b.load_stale, 10, "load marked stale")
        assert b.slots == 2  # falls back to the config's parallel
        assert b.busy == 1  # and to routing's in-flight count
        assert sup.status()[0]["waiting"] is None
        # Several probe deadlines pass; none counts while a request is in flight.
        deadline = time.monotonic() + 1.0
        while time.monotonic() < deadline:
            assert b.state is BackendState.HEALTHY
            await asyncio.sleep(0.05)
    finally:
        os.kill(b.pid, signal.SIGCONT)
    await eventually(lambda: not b.load_stale and b.slots == 3, 10, "fresh load again")
    b.in_flight = 0
    assert BackendState.UNHEALTHY not in rec.states()
    assert b.respawns == 0


# ----------------------------------------------------------------- load gate


async def test_load_gate_starts_one_backend_at_a_time(tmp_path, binary, supervise):
    config = make_config(tmp_path, [fake_model(binary, backends=2, env={"FAKE_LOAD_S": "0.5"})],
                         supervisor={"max_parallel_loads": 1})
    sup = await supervise(config)
    rec = Recorder(sup.models["m"])
    b0, b1 = sup.models["m"].backends
    await healthy(b0)
    await healthy(b1)
    launched_second = next(e for e in rec.events if e[1][1] is not None)
    assert launched_second[0][0] is BackendState.HEALTHY, "the second backend launched before the first was ready"
    assert any(e[0][0] is BackendState.STARTING and e[0][1] is not None and e[1][2] == "waiting for a load slot"
               for e in rec.events)


async def test_load_gate_admits_several_when_configured(tmp_path, binary, supervise):
    config = make_config(tmp_path, [fake_model(binary, backends=2, env={"FAKE_LOAD_S": "1.0"})],
                         supervisor={"max_parallel_loads": 2})
    sup = await supervise(config)
    b0, b1 = sup.models["m"].backends
    await eventually(lambda: b0.phase == "loading model" and b1.phase == "loading model", 10, "both loading")


# ----------------------------------------------------------------- staggered respawns, outlier reports


def most_at_once(rec: Recorder, state: BackendState) -> int:
    """The most backends that were in ``state`` together, over every recorded change."""
    return max((sum(1 for s, _, _ in event if s is state) for event in rec.events), default=0)


async def test_respawns_after_a_crash_of_several_backends_relaunch_one_at_a_time(tmp_path, binary, supervise):
    # The load gate would let all three load at once: the respawn cap (1) is what spreads them.
    config = make_config(tmp_path, [fake_model(binary, backends=3, env={"FAKE_LOAD_S": "0.2"})],
                         supervisor={"max_parallel_loads": 3, "max_concurrent_respawns": 1, "respawn_jitter_s": 0})
    sup = await supervise(config)
    backends = sup.models["m"].backends
    for b in backends:
        await healthy(b)
    rec = Recorder(sup.models["m"])
    pids = [b.pid for b in backends]
    for pid in pids:
        os.kill(pid, signal.SIGKILL)
    await eventually(lambda: all(b.respawns == 1 and b.state is BackendState.HEALTHY for b in backends), 20,
                     "all three respawned and healthy")
    assert most_at_once(rec, BackendState.UNHEALTHY) >= 2  # they were down together
    # From the recorded changes, not the clock: never two relaunches (starting) at once.
    assert most_at_once(rec, BackendState.STARTING) == 1
    assert any(phase == "waiting for a respawn slot" for event in rec.events for _, _, phase in event)
    assert not any(alive(p) for p in pids)


async def test_a_health_blip_without_traffic_restarts_one_backend_not_the_node(tmp_path, binary, supervise):
    blip = tmp_path / "blip"
    config = make_config(tmp_path, [fake_model(binary, backends=3, env={"FAKE_HEALTH_FAIL_FILE": str(blip)})],
                         supervisor={"max_parallel_loads": 3, "max_concurrent_respawns": 1, "respawn_jitter_s": 0})
    sup = await supervise(config)
    backends = sup.models["m"].backends
    for b in backends:
        await healthy(b)
    rec = Recorder(sup.models["m"])
    blip.touch()  # every engine's /health answers 503; nothing succeeds meanwhile (no requests)
    await eventually(lambda: sum(b.respawns for b in backends) == 1, 10, "one backend respawning")
    await asyncio.sleep(1.0)  # 10 probe intervals: every backend's streak ended long ago
    assert sum(b.state is BackendState.HEALTHY for b in backends) == 2  # kept in service
    blip.unlink()
    await eventually(lambda: all(b.state is BackendState.HEALTHY for b in backends), 10, "all healthy")
    assert sum(b.respawns for b in backends) == 1
    assert most_at_once(rec, BackendState.UNHEALTHY) + most_at_once(rec, BackendState.STARTING) <= 2
    assert [b.reason for b in backends if b.respawns] == [""]


async def test_report_outlier_respawns_a_healthy_backend_by_the_ladders_rules(tmp_path, binary, supervise, caplog):
    config = make_config(tmp_path, [fake_model(binary, backends=2)], health={"max_respawns": 2})
    sup = await supervise(config)
    b0, b1 = sup.models["m"].backends
    await healthy(b0)
    await healthy(b1)
    rec = Recorder(sup.models["m"])
    first = b0.pid
    assert sup.report_outlier("m", b0.id, "ejected 3 times in a row: 5 failures in a row")
    await eventually(lambda: b0.respawns == 1 and b0.state is BackendState.HEALTHY and b0.pid != first, 10,
                     "respawned after the report")
    assert not alive(first)
    assert BackendState.UNHEALTHY in rec.states(0)
    assert b1.respawns == 0 and BackendState.UNHEALTHY not in rec.states(1)
    # unknown model or backend: ignored
    assert not sup.report_outlier("nope", b0.id, "x")
    assert not sup.report_outlier("m", BackendId("m-9"), "x")
    # A report never spends the last respawn (max_respawns 2): the backend stays in service,
    # logged once (issue 22: a client's bad requests had good backends reported until dead).
    second = b0.pid
    caplog.set_level(logging.DEBUG, "viiwork.agent.supervision.supervisor")
    for _ in range(3):
        assert not sup.report_outlier("m", b0.id, "ejected again")
    await asyncio.sleep(0.3)
    assert b0.state is BackendState.HEALTHY and b0.respawns == 1 and b0.pid == second
    kept = [r for r in caplog.records if r.levelno == logging.WARNING and "kept in service" in r.getMessage()]
    assert len(kept) == 1 and "outlier reports never spend the last respawn" in kept[0].getMessage()
    assert b1.state is BackendState.HEALTHY and b1.respawns == 0


# ----------------------------------------------------------------- drain, stop, down/up


async def test_down_drains_in_flight_requests_first(tmp_path, binary, http, supervise):
    config = make_config(tmp_path, [fake_model(binary, env={"FAKE_TOKENS": "20", "FAKE_TOKEN_DELAY_S": "0.05"})])
    sup = await supervise(config)
    b = await healthy(backend_of(sup))
    pid = b.pid

    async def request_like_routing() -> dict:
        b.in_flight += 1
        try:
            async with aiohttp.ClientSession(connector=aiohttp.UnixConnector(path=b.socket_path)) as own, \
                    own.post(f"{b.base_url}/v1/chat/completions", json={"messages": []},
                             headers={"Authorization": f"Bearer {b.api_key}"}) as resp:
                assert resp.status == 200
                return await resp.json()
        finally:
            b.in_flight -= 1

    req = asyncio.create_task(request_like_routing())
    await eventually(lambda: b.load is not None and b.load.busy == 1, 5, "engine busy")
    down = asyncio.create_task(sup.down("m"))
    await eventually(lambda: b.state is BackendState.DRAINING, 5, "draining")
    assert alive(pid) and not b.admitting
    body = await asyncio.wait_for(req, 10)
    assert body["choices"][0]["message"]["content"]
    await asyncio.wait_for(down, 10)
    assert b.state is BackendState.STOPPED
    assert not alive(pid)
    assert (b.exit_result, b.exit_status) == ("success", 0)


async def test_drain_gives_up_after_drain_timeout(tmp_path, binary, supervise):
    sup = await supervise(make_config(tmp_path, [fake_model(binary)], health={"drain_timeout_s": 0.3}))
    b = await healthy(backend_of(sup))
    b.in_flight = 1  # a request that never finishes
    t0 = time.monotonic()
    await asyncio.wait_for(sup.down("m"), 10)
    assert time.monotonic() - t0 >= 0.3
    assert b.state is BackendState.STOPPED
    b.in_flight = 0


async def test_sigterm_ignored_is_killed_after_grace(tmp_path, binary, supervise):
    config = make_config(tmp_path, [fake_model(binary, env={"FAKE_IGNORE_SIGTERM": "1"})],
                         supervisor={"stop_timeout_s": 0.5})
    sup = await supervise(config)
    b = await healthy(backend_of(sup))
    pid = b.pid
    await asyncio.wait_for(sup.down("m"), 10)
    assert b.state is BackendState.STOPPED
    assert (b.exit_result, b.exit_status) == ("signal", signal.SIGKILL)
    assert not alive(pid)
    assert "cleaning up before exit" in (tmp_path / "state" / "logs" / "m-0.log").read_text()


async def test_down_and_up(tmp_path, binary, supervise):
    sup = await supervise(make_config(tmp_path, [fake_model(binary, backends=2)]))
    runtime = sup.models["m"]
    for b in runtime.backends:
        await healthy(b)
    pids = [b.pid for b in runtime.backends]
    await asyncio.wait_for(sup.down("m"), 10)
    assert runtime.state is ModelState.DOWN and not runtime.can_ever_serve
    assert all(b.state is BackendState.STOPPED and b.pid is None for b in runtime.backends)
    assert not any(alive(p) for p in pids)
    assert sup.status()[0]["state"] == "down"
    await asyncio.wait_for(sup.up("m"), 10)
    assert runtime.state is ModelState.RUNNING
    for b in runtime.backends:
        await healthy(b)
    assert all(b.pid not in pids for b in runtime.backends)
    assert all(b.respawns == 0 for b in runtime.backends)  # an intentional stop is not a respawn


async def test_up_of_a_running_model_restarts_nothing(tmp_path, binary, supervise):
    sup = await supervise(make_config(tmp_path, [fake_model(binary)]))
    b = await healthy(backend_of(sup))
    pid = b.pid
    await asyncio.wait_for(sup.up("m"), 5)
    assert b.state is BackendState.HEALTHY and b.pid == pid


async def test_unknown_model_names_the_known_ones(tmp_path, binary, supervise):
    sup = await supervise(make_config(tmp_path, [fake_model(binary, name="a"), fake_model(binary, name="b")]))
    with pytest.raises(UnknownModel, match="unknown model 'zzz'; this node serves: a, b"):
        await sup.down("zzz")


async def test_notify_is_called_on_state_changes(tmp_path, binary, supervise):
    sup = await supervise(make_config(tmp_path, [fake_model(binary)]))
    rec = Recorder(sup.models["m"])
    await healthy(backend_of(sup))
    assert rec.states()[-1] is BackendState.HEALTHY
    await sup.down("m")
    assert rec.states()[-1] is BackendState.STOPPED


async def test_stop_while_starting_leaves_nothing(tmp_path, binary, http):
    config = make_config(tmp_path, [fake_model(binary, env={"FAKE_LOAD_S": "30"}, backends=2)],
                         supervisor={"max_parallel_loads": 1})
    before = asyncio.all_tasks()
    sup = Supervisor(config, ProcessRunner(), http, "n1")
    await sup.start()
    b0, b1 = sup.models["m"].backends
    await eventually(lambda: b0.phase == "loading model", 10, "loading")
    pid = b0.pid
    await asyncio.wait_for(sup.stop(), 10)
    assert not alive(pid)
    assert b0.state is BackendState.STOPPED and b1.state is BackendState.STOPPED
    assert not {t for t in asyncio.all_tasks() - before if not t.done() and t is not asyncio.current_task()}


# ----------------------------------------------------------------- config hash


def test_config_hash_is_stable_and_tracks_the_entry(tmp_path, binary):
    def model_of(**fields: Any):
        return make_config(tmp_path, [fake_model(binary, **fields)]).models[0]

    base = config_hash(model_of())
    assert base == config_hash(model_of())
    assert len(base) == 64
    assert config_hash(model_of(parallel=3)) != base
    assert config_hash(model_of(args=["--flash-attn"])) != base
    assert config_hash(model_of(llamacpp={"binary": str(binary), "threads": 2})) != base
    # Defaults written out hash like defaults left out.
    assert config_hash(model_of(llamacpp={"binary": str(binary), "metrics": True})) == base


# ----------------------------------------------------------------- the real engine


@pytest.mark.engine
async def test_real_llama_server_starts_and_reports_load(tmp_path, llama_server, tiny_gguf, supervise):
    model = {
        "name": "tiny",
        "engine": "llamacpp",
        "path": str(tiny_gguf),
        "parallel": 2,
        "ctx_per_slot": 256,
        "startup_timeout_s": 60.0,
        "llamacpp": {"binary": str(llama_server), "threads": 1},
    }
    sup = await supervise(make_config(tmp_path, [model], health={"interval_s": 0.2, "timeout_s": 2.0}))
    rec = Recorder(sup.models["tiny"])
    b = backend_of(sup, "tiny")
    await healthy(b, timeout_s=60)
    assert rec.states()[-1] is BackendState.HEALTHY
    await eventually(lambda: b.load is not None, 10, "load read from the real /slots")
    assert (b.load.slots, b.load.busy, b.load.waiting, b.load.ctx_per_slot) == (2, 0, 0, 256)
    assert sup.status()[0]["slots"] == 2
