"""viiwork.agent.notify: sd_notify messages on a real datagram socket, and the stop-intent
rule against a real user manager's jobs."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import sys
from pathlib import Path

import pytest

from support.engines import FAKE_ENGINE
from support.procs import free_port, wait_http
from support.systemd import UserManager
from viiwork.agent.notify import Notifier, StopIntent, one_line, stop_intent
from viiwork.agent.supervision.runners.base import LaunchRequest
from viiwork.agent.supervision.runners.systemd.bus import MANAGER_IFACE, SYSTEMD_BUS_NAME, SYSTEMD_PATH, call
from viiwork.agent.supervision.runners.systemd.runner import SystemdRunner
from viiwork.agent.supervision.runners.systemd.units import engine_unit_stem


@pytest.fixture
def notify_socket(tmp_path: Path):
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    path = tmp_path / "notify"
    sock.bind(str(path))
    sock.settimeout(5)
    yield path, sock
    sock.close()


def received(sock: socket.socket) -> dict[str, str]:
    data = sock.recv(4096).decode()
    return dict(line.split("=", 1) for line in data.split("\n"))


def test_ready_status_stopping_reach_the_socket(notify_socket) -> None:
    path, sock = notify_socket
    env = {"NOTIFY_SOCKET": str(path), "OTHER": "kept"}
    notifier = Notifier(env)
    assert env == {"OTHER": "kept"}  # consumed: engines never inherit the agent's socket
    assert notifier.ready("2 models,\n 3/8 slots busy")
    assert received(sock) == {"READY": "1", "STATUS": "2 models, 3/8 slots busy"}
    assert notifier.status("x" * 500)
    status = received(sock)["STATUS"]
    assert len(status) == 200 and status.endswith("…")
    assert notifier.stopping("draining")
    assert received(sock) == {"STOPPING": "1", "STATUS": "draining"}
    assert notifier.reloading()
    assert received(sock) == {"RELOADING": "1"}
    notifier.close()


def test_abstract_socket_address(tmp_path: Path) -> None:
    name = f"viiwork-test-{os.getpid()}"
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind("\0" + name)
    sock.settimeout(5)
    try:
        notifier = Notifier({"NOTIFY_SOCKET": "@" + name})
        assert notifier.watchdog()
        assert received(sock) == {"WATCHDOG": "1"}
    finally:
        sock.close()


def test_without_notify_socket_everything_is_a_no_op() -> None:
    notifier = Notifier({})
    assert not notifier.enabled
    assert notifier.ready() is False and notifier.watchdog() is False
    assert notifier.watchdog_interval_s is None


def test_unreachable_socket_does_not_raise(tmp_path: Path, caplog) -> None:
    caplog.set_level("DEBUG", logger="viiwork.agent.notify")
    notifier = Notifier({"NOTIFY_SOCKET": str(tmp_path / "gone")})
    assert notifier.ready() is False
    assert notifier.status("x") is False
    assert [r.levelname for r in caplog.records if "sd_notify" in r.getMessage()] == ["WARNING", "DEBUG"]


@pytest.mark.parametrize(("env", "interval"), [
    ({"WATCHDOG_USEC": "30000000"}, 15.0),
    ({"WATCHDOG_USEC": "30000000", "WATCHDOG_PID": "4242"}, 15.0),
    ({"WATCHDOG_USEC": "30000000", "WATCHDOG_PID": "1"}, None),   # meant for another process
    ({"WATCHDOG_USEC": "0"}, None),
    ({"WATCHDOG_USEC": "soon"}, None),
], ids=["half-period", "pid-matches", "pid-differs", "zero", "garbage"])
def test_watchdog_interval(env: dict[str, str], interval: float | None, tmp_path: Path) -> None:
    notifier = Notifier({"NOTIFY_SOCKET": str(tmp_path / "s"), **env}, pid=4242)
    assert notifier.watchdog_interval_s == interval


async def test_run_watchdog_pings_from_the_loop_and_skips_when_not_alive(notify_socket) -> None:
    path, sock = notify_socket
    sock.setblocking(False)
    notifier = Notifier({"NOTIFY_SOCKET": str(path), "WATCHDOG_USEC": "20000"})  # ping every 10 ms
    alive = True
    task = asyncio.create_task(notifier.run_watchdog(lambda: alive))
    loop = asyncio.get_running_loop()
    try:
        async with asyncio.timeout(5):
            for _ in range(3):
                data = await loop.sock_recv(sock, 4096)
                assert data == b"WATCHDOG=1"
        alive = False
        # Drain what was sent before, then nothing more arrives while not alive.
        await asyncio.sleep(0.05)
        while True:
            try:
                sock.recv(4096)
            except BlockingIOError:
                break
        await asyncio.sleep(0.1)
        with pytest.raises(BlockingIOError):
            sock.recv(4096)
    finally:
        task.cancel()


def test_one_line() -> None:
    assert one_line("a\nb\t c") == "a b c"


# --- stop intent against real jobs ---------------------------------------------------------


async def test_stop_intent_reads_the_job_queued_for_the_unit(systemd_user: UserManager, tmp_path: Path) -> None:
    runner = await SystemdRunner.connect("user", systemd_user.bus_address, engine_user=None)
    conn = runner._conn
    try:
        # An engine that ignores SIGTERM keeps its stop (or restart) job pending for a while.
        port = free_port()
        request = LaunchRequest(
            name=engine_unit_stem("n", "slow-stop", 0),
            argv=(sys.executable, str(FAKE_ENGINE), "--port", str(port)),
            env={"PATH": "/usr/bin:/bin", "FAKE_IGNORE_SIGTERM": "1", "FAKE_LOAD_S": "0"},
            description="slow stop", labels={"owner": "n"}, stop_timeout_s=30.0)
        handle = await runner.start(request)
        pid = handle.pid
        # Serving means its SIGTERM handling is in place (before that, SIGTERM would kill it
        # at once and the restart job would be over before we look).
        await asyncio.to_thread(wait_http, f"http://127.0.0.1:{port}/health")

        decision = await stop_intent(conn, pid)
        assert (decision.intent, decision.job_type, decision.unit) == (StopIntent.STOP, None, handle.unit)
        assert "no job queued" in decision.reason

        await call(conn, SYSTEMD_BUS_NAME, SYSTEMD_PATH, MANAGER_IFACE, "RestartUnit", "ss", [handle.unit, "replace"])
        decision = await stop_intent(conn, pid)
        assert (decision.intent, decision.job_type) == (StopIntent.RESTART, "restart")

        await call(conn, SYSTEMD_BUS_NAME, SYSTEMD_PATH, MANAGER_IFACE, "StopUnit", "ss", [handle.unit, "replace"])
        decision = await stop_intent(conn, pid)
        assert (decision.intent, decision.job_type) == (StopIntent.STOP, "stop")
        os.kill(pid, signal.SIGKILL)
        async with asyncio.timeout(5):
            await handle.wait()

        # A process systemd does not manage: asking fails, and the safe answer is STOP.
        decision = await stop_intent(conn, os.getpid())
        assert decision.intent is StopIntent.STOP and "could not ask systemd" in decision.reason
    finally:
        await runner.close()


async def test_runner_stop_intent_depends_on_the_runner(systemd_user: UserManager) -> None:
    from viiwork.agent.notify import runner_stop_intent
    from viiwork.agent.supervision.runners.process import ProcessRunner

    decision = await runner_stop_intent(ProcessRunner())
    assert decision.intent is StopIntent.STOP and "process runner" in decision.reason
    runner = await SystemdRunner.connect("user", systemd_user.bus_address, engine_user=None)
    try:
        # This test process is no unit of that manager: asking fails, so STOP.
        decision = await runner_stop_intent(runner)
        assert decision.intent is StopIntent.STOP and "could not ask systemd" in decision.reason
    finally:
        await runner.close()
