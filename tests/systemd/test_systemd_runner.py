"""SystemdRunner against a real ``systemd --user`` (user-manager tier).

Real units, real engine processes (the fake llama-server and the real llama-server with the
tiny model), state from systemd's D-Bus signals.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import aiohttp
import pytest
from conftest import require
from dbus_fast.aio import MessageBus

from support.engines import FAKE_ENGINE, fake_engine_binary
from support.procs import free_port
from support.systemd import UserManager, process_gone, unit_main_pid, unit_show
from viiwork.agent.supervision.runners.base import ExitInfo, LaunchRequest, RunnerError
from viiwork.agent.supervision.runners.systemd.bus import (
    MANAGER_IFACE,
    SYSTEMD_BUS_NAME,
    SYSTEMD_PATH,
    call,
    detect_runner,
)
from viiwork.agent.supervision.runners.systemd.runner import SystemdRunner
from viiwork.agent.supervision.runners.systemd.units import (
    ENGINE_SLICE,
    engine_unit_stem,
    labels_from_environment,
    unit_name,
    unit_object_path,
)
from viiwork.engines.contract import BackendSpec, Kind
from viiwork.engines.llamacpp import LlamaCppEngine, LlamaCppOptions

pytestmark = pytest.mark.systemd

BASE_ENV = {"PATH": "/usr/local/bin:/usr/bin:/bin", "FAKE_LOAD_S": "0"}


def request_for(argv: tuple[str, ...], tmp_path: Path, *, owner: str = "node1", model: str = "m",
                index: int = 0, env: dict[str, str] | None = None, **limits) -> LaunchRequest:
    return LaunchRequest(
        name=engine_unit_stem(owner, model, index),
        argv=argv,
        env={**BASE_ENV, **(env or {})},
        description=f"viiwork engine test for {model} #{index}",
        labels={"owner": owner, "model": model, "index": str(index), "config_hash": "c0ffee"},
        log_path=str(tmp_path / f"engine-{index}.log"),
        stop_timeout_s=5.0,
        **limits,
    )


def fake_argv(tmp_path: Path, port: int, alias: str = "m") -> tuple[str, ...]:
    binary = fake_engine_binary(tmp_path / "bin")
    return (str(binary), "--alias", alias, "--host", "127.0.0.1", "--port", str(port), "--parallel", "2")


async def wait_health(port: int, timeout_s: float = 20.0, handle=None) -> dict:
    """Poll the engine's /health until 200 (bounded); fails early if the unit ended."""
    deadline = time.monotonic() + timeout_s
    last: object = None
    async with aiohttp.ClientSession() as http:
        while time.monotonic() < deadline:
            if handle is not None and not handle.running():
                raise AssertionError(f"engine ended while waiting for /health: {await handle.wait()}")
            try:
                async with http.get(f"http://127.0.0.1:{port}/health", timeout=aiohttp.ClientTimeout(total=2)) as r:
                    if r.status == 200:
                        return await r.json()
                    last = r.status
            except (TimeoutError, aiohttp.ClientError) as exc:
                last = exc
            await asyncio.sleep(0.05)
    raise AssertionError(f"/health on port {port} not ready within {timeout_s} s (last: {last})")


async def test_fake_engine_unit_starts_serves_and_stops(user_runner: SystemdRunner, systemd_user: UserManager,
                                                        tmp_path: Path) -> None:
    port = free_port()
    handle = await user_runner.start(request_for(fake_argv(tmp_path, port), tmp_path))
    try:
        assert handle.unit == unit_name(engine_unit_stem("node1", "m", 0))
        assert handle.unit == "viiwork-engine-node1-m-0.service"
        assert handle.pid == unit_main_pid(systemd_user, handle.unit)
        assert await wait_health(port, handle=handle) == {"status": "ok"}
        assert unit_show(systemd_user, handle.unit, "Slice") == ENGINE_SLICE
        assert unit_show(systemd_user, handle.unit, "KillMode") == "control-group"
        assert unit_show(systemd_user, handle.unit, "CollectMode") == "inactive-or-failed"
        assert unit_show(systemd_user, handle.unit, "Description") == "viiwork engine test for m #0"
        assert unit_show(systemd_user, handle.unit, "SyslogIdentifier") == "viiwork-engine-node1-m-0"
        assert unit_show(systemd_user, handle.unit, "TimeoutStopUSec") == "5s"
        env = unit_show(systemd_user, handle.unit, "Environment").split()
        assert labels_from_environment(env) == {"owner": "node1", "model": "m", "index": "0", "config_hash": "c0ffee"}
        cache = systemd_user.cache_dir / "viiwork" / "engines"
        assert f"HOME={cache}" in env and f"XDG_CACHE_HOME={cache}" in env
        assert cache.is_dir()  # CacheDirectory= made it
        pid = handle.pid
        info = await handle.stop(5.0)
    finally:
        if handle.running():
            await handle.stop(1.0)
    # The fake engine exits 0 on SIGTERM.
    assert info.result == "success"
    assert handle.running() is False
    # Inactive means the process exited; systemd reaps it right after (a zombie for a moment).
    deadline = time.monotonic() + 5
    while not process_gone(pid):
        assert time.monotonic() < deadline, f"pid {pid} still exists after the unit stopped"
        await asyncio.sleep(0.02)
    # CollectMode=inactive-or-failed: the unit is gone, not left loaded.
    assert unit_show(systemd_user, handle.unit, "LoadState") == "not-found"


async def test_real_llama_server_with_tiny_model(user_runner: SystemdRunner, systemd_user: UserManager,
                                                 tmp_path: Path, llama_server: Path, tiny_gguf: Path) -> None:
    port = free_port()
    spec = BackendSpec(model="tiny", kind=Kind.CHAT, path=str(tiny_gguf), port=port, ctx_per_slot=256, parallel=1,
                       options=LlamaCppOptions(binary=str(llama_server), threads=1))
    command = LlamaCppEngine().build_command(spec)
    request = request_for(command.argv, tmp_path, model="tiny", env=dict(command.env))
    handle = await user_runner.start(request)
    try:
        await wait_health(port, timeout_s=60, handle=handle)
        async with aiohttp.ClientSession() as http, http.post(
            f"http://127.0.0.1:{port}/v1/chat/completions",
            json={"messages": [{"role": "user", "content": "hello"}], "max_tokens": 4},
            timeout=aiohttp.ClientTimeout(total=30),
        ) as resp:
            assert resp.status == 200
            body = await resp.json()
        assert body["choices"][0]["message"]["role"] == "assistant"
        assert handle.pid == unit_main_pid(systemd_user, handle.unit)
        info = await handle.stop(5.0)
    finally:
        if handle.running():
            await handle.stop(1.0)
    # llama-server exits 0 on SIGTERM when idle (recipes §4).
    assert info.result == "success", info


async def test_kill_9_of_main_pid_is_reported_from_signals(user_runner: SystemdRunner, tmp_path: Path) -> None:
    port = free_port()
    handle = await user_runner.start(request_for(fake_argv(tmp_path, port), tmp_path))
    await wait_health(port, handle=handle)
    pid = handle.pid
    os.kill(pid, signal.SIGKILL)
    async with asyncio.timeout(5):
        info = await handle.wait()
    assert (info.result, info.signal, info.returncode) == ("signal", signal.SIGKILL, None)
    assert handle.pid == pid  # kept for /v1/status after the exit
    assert "perhaps by the kernel" not in info.detail  # no MemoryMax: no OOM hint


async def test_exit_status_is_reported(user_runner: SystemdRunner, tmp_path: Path) -> None:
    handle = await user_runner.start(request_for(
        fake_argv(tmp_path, free_port()), tmp_path, env={"FAKE_EXIT_AFTER_S": "0.3", "FAKE_EXIT_CODE": "3"}))
    async with asyncio.timeout(10):
        info = await handle.wait()
    assert info == ExitInfo(result="exit-code", returncode=3, signal=None, detail=f"unit {handle.unit}")
    # Calling wait() again gives the same answer; stop() on an ended unit too.
    assert await handle.wait() == info
    assert await handle.stop(1.0) == info


async def test_stop_escalates_to_sigkill_after_grace(user_runner: SystemdRunner, tmp_path: Path) -> None:
    port = free_port()
    handle = await user_runner.start(request_for(
        fake_argv(tmp_path, port), tmp_path, env={"FAKE_IGNORE_SIGTERM": "1"}))
    await wait_health(port, handle=handle)
    started = time.monotonic()
    info = await handle.stop(0.5)
    # Ended by our KillUnit(SIGKILL), long before the unit's own TimeoutStopSec (5 s).
    assert info.signal == signal.SIGKILL
    assert time.monotonic() - started < 4.5


async def test_whole_process_tree_dies_with_the_unit(user_runner: SystemdRunner, tmp_path: Path) -> None:
    # An engine that forks a worker which ignores SIGTERM (as vLLM's workers can): the unit's
    # stop kills the whole cgroup (KillMode=control-group), not just the main process.
    pidfile = tmp_path / "worker.pid"
    script = (f"import os, signal, time\n"
              f"pid = os.fork()\n"
              f"if pid == 0:\n"
              f"    signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
              f"    open({str(pidfile)!r}, 'w').write(str(os.getpid()))\n"
              f"    time.sleep(3600)\n"
              f"time.sleep(3600)\n")
    handle = await user_runner.start(request_for(("/usr/bin/python3", "-c", script), tmp_path))
    deadline = time.monotonic() + 10
    while not pidfile.exists() or not pidfile.read_text():
        assert time.monotonic() < deadline, "worker did not start"
        await asyncio.sleep(0.02)
    worker = int(pidfile.read_text())
    await handle.stop(0.5)
    assert process_gone(worker)


@pytest.mark.parametrize("model", [
    "Qwen/Qwen3-8B:Q4",
    "llama 3 (8B)",
    "ünïcödé-模型",
    "../../etc/passwd",
    "a-b",
    "x" * 200,
], ids=["hub-id-with-colon", "spaces-parens", "non-ascii", "path-traversal", "dash", "very-long"])
async def test_odd_model_names_make_valid_units_and_round_trip(user_runner: SystemdRunner, systemd_user: UserManager,
                                                               tmp_path: Path, model: str) -> None:
    request = request_for(("/usr/bin/sleep", "60"), tmp_path, model=model)
    handle = await user_runner.start(request)
    try:
        assert len(handle.unit) <= 255
        assert handle.unit.startswith("viiwork-engine-node1-") and handle.unit.endswith(".service")
        assert "/" not in handle.unit and " " not in handle.unit
        assert unit_show(systemd_user, handle.unit, "ActiveState") == "active"
        # Our object path escaping (signals are matched by it) is systemd's.
        (path,) = await call(user_runner._conn, SYSTEMD_BUS_NAME, SYSTEMD_PATH, MANAGER_IFACE, "GetUnit", "s",
                             [handle.unit])
        assert path == handle.path == unit_object_path(handle.unit)
        # Labels carry the exact name, whatever the unit name had to become.
        other = await SystemdRunner.connect("user", systemd_user.bus_address, engine_user=None)
        try:
            adopted = await other.adoptable("node1")
        finally:
            await other.close()
        assert [(h.unit, h.labels["model"], h.pid) for h in adopted] == [(handle.unit, model, handle.pid)]
    finally:
        await handle.stop(2.0)


def test_unit_names_of_different_node_model_splits_differ() -> None:
    # node "a-b" + model "c" vs node "a" + model "b-c": distinct units, no adoption mix-up.
    assert unit_name(engine_unit_stem("a-b", "c", 0)) != unit_name(engine_unit_stem("a", "b-c", 0))
    assert unit_name(engine_unit_stem("n", "x" * 300, 0)) != unit_name(engine_unit_stem("n", "x" * 299 + "y", 0))


async def test_adoptable_lists_own_running_units_after_runner_is_recreated(
        systemd_user: UserManager, tmp_path: Path) -> None:
    first = await SystemdRunner.connect("user", systemd_user.bus_address, engine_user=None)
    mine = [await first.start(request_for(("/usr/bin/sleep", "300"), tmp_path, model=m, index=i))
            for m, i in (("alpha", 0), ("alpha", 1), ("beta", 0))]
    theirs = await first.start(request_for(("/usr/bin/sleep", "300"), tmp_path, owner="node2", model="alpha"))
    ended = await first.start(request_for(("/usr/bin/true",), tmp_path, model="gamma"))
    async with asyncio.timeout(5):
        await ended.wait()
    await first.close()  # the agent goes away; its units stay

    second = await SystemdRunner.connect("user", systemd_user.bus_address, engine_user=None)
    try:
        adopted = await second.adoptable("node1")
        got = sorted((h.unit, h.pid, h.labels["model"], h.labels["index"]) for h in adopted)
        want = sorted((h.unit, h.pid, h.labels["model"], h.labels["index"]) for h in mine)
        assert got == want
        assert [h.unit for h in await second.adoptable("node2")] == [theirs.unit]
        assert await second.adoptable("node3") == []
        # Adopted handles follow the unit through signals: a crash is seen...
        victim = next(h for h in adopted if h.labels["model"] == "beta")
        os.kill(victim.pid, signal.SIGKILL)
        async with asyncio.timeout(5):
            info = await victim.wait()
        assert (info.result, info.signal) == ("signal", signal.SIGKILL)
        # ...and they can be stopped.
        for h in adopted:
            await h.stop(2.0)
        assert all(not h.running() for h in adopted)
        assert await second.adoptable("node1") == []
    finally:
        for h in await second.adoptable("node2"):
            await h.stop(2.0)
        await second.close()


async def test_starting_a_running_unit_again_is_refused(user_runner: SystemdRunner, systemd_user: UserManager,
                                                        tmp_path: Path) -> None:
    request = request_for(("/usr/bin/sleep", "60"), tmp_path)
    handle = await user_runner.start(request)
    try:
        other = await SystemdRunner.connect("user", systemd_user.bus_address, engine_user=None)
        try:
            with pytest.raises(RunnerError, match="already exists and is active: adopt it or stop it first"):
                await other.start(request)
        finally:
            await other.close()
        assert unit_main_pid(systemd_user, handle.unit) == handle.pid
    finally:
        await handle.stop(2.0)


async def test_restart_under_the_same_name_right_after_a_crash(user_runner: SystemdRunner, tmp_path: Path) -> None:
    request = request_for(("/usr/bin/sleep", "60"), tmp_path)
    for _ in range(3):
        handle = await user_runner.start(request)
        os.kill(handle.pid, signal.SIGKILL)
        async with asyncio.timeout(5):
            await handle.wait()


async def test_missing_binary_is_a_clear_error(user_runner: SystemdRunner, tmp_path: Path) -> None:
    with pytest.raises(RunnerError, match=r"binary not found: /nonexistent/llama-server"):
        await user_runner.start(request_for(("/nonexistent/llama-server",), tmp_path))
    with pytest.raises(RunnerError, match=r"not on PATH"):
        await user_runner.start(request_for(("no-such-engine-binary",), tmp_path))


async def test_exec_failure_inside_systemd_fails_the_start(user_runner: SystemdRunner, systemd_user: UserManager,
                                                           tmp_path: Path) -> None:
    # Executable, but its interpreter is missing: execve fails in systemd's child (status 203).
    script = tmp_path / "broken-engine"
    script.write_text("#!/nonexistent/interpreter\n")
    script.chmod(0o755)
    with pytest.raises(RunnerError, match=r"job failed, exit-code \(status 203\).*EXEC"):
        await user_runner.start(request_for((str(script),), tmp_path))
    # The failed unit is collected, so the same name can be used again.
    assert unit_show(systemd_user, unit_name(engine_unit_stem("node1", "m", 0)), "LoadState") == "not-found"


async def test_limits_and_sandbox_are_set_on_the_unit(user_runner: SystemdRunner, systemd_user: UserManager,
                                                      tmp_path: Path) -> None:
    port = free_port()
    # PrivateTmp hides the host's /tmp (where tmp_path and the wrapper script live): run the
    # fake engine straight from the source tree.
    argv = (sys.executable, str(FAKE_ENGINE), "--alias", "m", "--host", "127.0.0.1", "--port", str(port))
    request = request_for(argv, tmp_path, memory_max_bytes=512 * 1024 * 1024,
                          cpu_weight=50, tasks_max=64, sandbox="strict")
    request = dataclasses.replace(request, log_path=None)
    handle = await user_runner.start(request)
    try:
        await wait_health(port, handle=handle)  # still serves on loopback under the profile
        show = {p: unit_show(systemd_user, handle.unit, p) for p in (
            "MemoryMax", "CPUWeight", "TasksMax", "NoNewPrivileges", "ProtectSystem", "PrivateTmp",
            "ProtectHome", "RestrictNamespaces")}
        assert show == {"MemoryMax": str(512 * 1024 * 1024), "CPUWeight": "50", "TasksMax": "64",
                        "NoNewPrivileges": "yes", "ProtectSystem": "strict", "PrivateTmp": "yes",
                        "ProtectHome": "read-only", "RestrictNamespaces": "yes"}
    finally:
        await handle.stop(2.0)


async def test_unknown_sandbox_profile_is_refused(user_runner: SystemdRunner, tmp_path: Path) -> None:
    with pytest.raises(RunnerError, match="unknown sandbox profile 'paranoid'; known: none, basic, strict"):
        await user_runner.start(request_for(("/usr/bin/sleep", "1"), tmp_path, sandbox="paranoid"))


async def test_detect_runner_needs_systemd_on_the_bus(systemd_user: UserManager, tmp_path: Path) -> None:
    choice = await detect_runner("user", systemd_user.bus_address)
    assert choice.kind == "systemd" and "systemd" in choice.reason
    # A real D-Bus daemon without systemd on it is not enough.
    require(subprocess.run(["which", "dbus-daemon"], capture_output=True).returncode == 0, "dbus-daemon not installed")
    sock = tmp_path / "plain-bus"
    daemon = subprocess.Popen(["dbus-daemon", "--session", "--nofork", "--nopidfile", "--print-address=1",
                               f"--address=unix:path={sock}"], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                              text=True)
    try:
        # The address is printed once the daemon listens (the socket file exists earlier).
        async with asyncio.timeout(10):
            printed = await asyncio.to_thread(daemon.stdout.readline)
        assert printed.startswith(f"unix:path={sock}"), printed
        choice = await detect_runner("user", f"unix:path={sock}")
        assert choice == type(choice)("process", "user bus: no org.freedesktop.systemd1 on this bus")
        with pytest.raises(RunnerError, match="no org.freedesktop.systemd1 on this bus"):
            await SystemdRunner.connect("user", f"unix:path={sock}")
        # Waiting for systemd to join: nobody does within the wait...
        choice = await detect_runner("user", f"unix:path={sock}", wait_s=0.2)
        assert choice.reason == "user bus: no org.freedesktop.systemd1 on this bus (waited 0.2 s)"
        # ...or someone takes the name meanwhile (and, not being systemd, fails the next check).
        impostor = MessageBus(bus_address=f"unix:path={sock}")
        await impostor.connect()
        try:
            async def claim_later() -> None:
                await asyncio.sleep(0.1)
                await impostor.request_name(SYSTEMD_BUS_NAME)
            claim = asyncio.create_task(claim_later())
            choice = await detect_runner("user", f"unix:path={sock}", wait_s=10)
            await claim
            assert choice.kind == "process" and "does not answer Manager.Version" in choice.reason
        finally:
            impostor.disconnect()
    finally:
        daemon.terminate()
        daemon.wait(5)
        daemon.stdout.close()
    choice = await detect_runner("user", f"unix:path={tmp_path / 'nothing-here'}")
    assert choice.kind == "process" and "cannot connect" in choice.reason


async def test_runner_follows_systemd_across_daemon_reexec(user_runner: SystemdRunner, systemd_user: UserManager,
                                                           tmp_path: Path) -> None:
    handle = await user_runner.start(request_for(("/usr/bin/sleep", "300"), tmp_path))
    owner_before = user_runner._systemd_owner
    systemd_user.systemctl("daemon-reexec")
    # systemd comes back on the bus under a new unique name; the runner follows it.
    deadline = time.monotonic() + 10
    while user_runner._systemd_owner == owner_before:
        assert time.monotonic() < deadline, "runner did not see systemd return to the bus"
        await asyncio.sleep(0.02)
    assert handle.running()
    os.kill(handle.pid, signal.SIGKILL)
    async with asyncio.timeout(10):
        info = await handle.wait()
    assert (info.result, info.signal) == ("signal", signal.SIGKILL)
    # And new units still start and report.
    again = await user_runner.start(request_for(("/usr/bin/true",), tmp_path, index=1))
    async with asyncio.timeout(10):
        assert (await again.wait()).result == "success"


async def test_strict_sandbox_engine_binds_its_socket_in_its_private_dir(user_runner: SystemdRunner,
                                                                          systemd_user: UserManager,
                                                                          tmp_path: Path) -> None:
    """ProtectSystem=strict makes everything read-only: the runner adds ReadWritePaths= for the
    backend's private directory (agent/supervision/engine_keys.py), where the engine binds its socket."""
    import shutil
    import tempfile

    private = Path(tempfile.mkdtemp(prefix="viiwork-rw-", dir=Path.home()))  # not under PrivateTmp
    sock = private / "engine.sock"
    try:
        argv = (sys.executable, str(FAKE_ENGINE), "--alias", "m", "--host", str(sock))
        request = dataclasses.replace(request_for(argv, tmp_path, sandbox="strict", private_dir=str(private)),
                                      log_path=None)
        handle = await user_runner.start(request)
        try:
            assert unit_show(systemd_user, handle.unit, "ReadWritePaths") == str(private)
            deadline = time.monotonic() + 20
            async with aiohttp.ClientSession(connector=aiohttp.UnixConnector(path=str(sock))) as http:
                while True:
                    assert handle.running(), await handle.wait()
                    try:
                        async with http.get("http://localhost/health") as r:
                            if r.status == 200:
                                break
                    except aiohttp.ClientError:
                        pass
                    assert time.monotonic() < deadline, "the engine never served on its socket"
                    await asyncio.sleep(0.05)
        finally:
            await handle.stop(2.0)
    finally:
        shutil.rmtree(private, ignore_errors=True)


async def test_environment_file_key_reaches_the_engine_not_the_unit_properties(
        user_runner: SystemdRunner, systemd_user: UserManager, tmp_path: Path) -> None:
    """An engine that reads its key from the environment (vLLM's VLLM_API_KEY) gets it from
    EnvironmentFile= (agent/supervision/engine_keys.py write_env_file, 0600): the engine sees it, while
    ExecStart= and Environment=, which `systemctl show` prints to anyone, do not carry it."""
    import shutil
    import tempfile

    from viiwork.agent.supervision.engine_keys import write_env_file

    root = Path(tempfile.mkdtemp(prefix="viiwork-key-", dir=Path.home()))  # the agent's engine dir
    private = root / "v-0"
    try:
        private.mkdir(mode=0o700)
        key = "k3y-" + os.urandom(12).hex()
        env_file = write_env_file(private, "VLLM_API_KEY", key)
        assert env_file == root / "v-0.env" and env_file.stat().st_mode & 0o777 == 0o600
        seen = private / "seen"
        argv = (sys.executable, "-c", f"import os, time; open({str(seen)!r} + '.tmp', 'w').write("
                f"os.environ.get('VLLM_API_KEY', '')); os.rename({str(seen)!r} + '.tmp', {str(seen)!r}); "
                "time.sleep(60)")
        request = dataclasses.replace(request_for(argv, tmp_path, environment_file=str(env_file)), log_path=None)
        handle = await user_runner.start(request)
        try:
            deadline = time.monotonic() + 20
            while not seen.exists():
                assert handle.running(), await handle.wait()
                assert time.monotonic() < deadline, "the engine never wrote what it saw"
                await asyncio.sleep(0.05)
            assert seen.read_text() == key
            shown = {prop: unit_show(systemd_user, handle.unit, prop)
                     for prop in ("ExecStart", "Environment", "EnvironmentFiles")}
            assert "VIIWORK_OWNER=node1" in shown["Environment"]  # the unit is there to be shown
            assert key not in shown["ExecStart"] and key not in shown["Environment"], shown
            assert str(env_file) in shown["EnvironmentFiles"], shown
        finally:
            await handle.stop(2.0)
    finally:
        shutil.rmtree(root, ignore_errors=True)
