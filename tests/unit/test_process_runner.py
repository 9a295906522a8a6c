"""ProcessRunner: real child processes in their own group, stop escalation, parent death."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from support.engines import fake_engine_binary
from support.procs import free_port
from viiwork.agent.supervision.runners.base import LaunchRequest, RunHandle, RunnerError
from viiwork.agent.supervision.runners.process import ProcessRunner


def alive(pid: int) -> bool:
    """True while ``pid`` exists and is not a zombie (a reaped-later orphan counts as gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return False
    return state not in ("Z", "X")


async def gone_within(pid: int, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not alive(pid):
            return True
        await asyncio.sleep(0.02)
    return not alive(pid)


async def file_text_within(path: Path, timeout_s: float = 5.0) -> str:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if path.exists() and path.read_text().strip():
            return path.read_text().strip()
        await asyncio.sleep(0.02)
    raise AssertionError(f"{path} not written within {timeout_s} s")


def request(argv, tmp_path: Path, env=None, name="test-engine") -> LaunchRequest:
    return LaunchRequest(
        name=name, argv=tuple(str(a) for a in argv), env={**os.environ, **(env or {})},
        description="test", labels={"owner": "n1"}, log_path=str(tmp_path / "logs" / f"{name}.log"),
    )


@pytest.fixture
async def handles():
    """Handles started by a test; any still running at the end are killed."""
    started: list[RunHandle] = []
    yield started
    for h in started:
        if h.running():
            await h.stop(0.5)


async def test_missing_binary_path_is_a_runner_error(tmp_path):
    with pytest.raises(RunnerError, match=r"binary not found: /nonexistent/llama-server"):
        await ProcessRunner().start(request(["/nonexistent/llama-server"], tmp_path))


async def test_missing_binary_name_says_path(tmp_path):
    with pytest.raises(RunnerError, match=r"not on PATH") as raised:
        await ProcessRunner().start(request(["viiwork-no-such-engine"], tmp_path, env={"PATH": str(tmp_path)}))
    # The options that set it, a gang's worker binaries too (a newcomer was sent to `binary`).
    assert "`binary`" in str(raised.value) and "`rpc_binary`" in str(raised.value)


async def test_not_executable_is_a_runner_error(tmp_path):
    script = tmp_path / "engine"
    script.write_text("#!/bin/sh\n")
    script.chmod(0o644)
    with pytest.raises(RunnerError, match="not executable"):
        await ProcessRunner().start(request([script], tmp_path))


@pytest.mark.parametrize(
    ("script", "result", "returncode", "sig"),
    [
        pytest.param("exit 0", "success", 0, None, id="success"),
        pytest.param("exit 3", "exit-code", 3, None, id="exit-code"),
        pytest.param("kill -SEGV $$", "signal", None, signal.SIGSEGV, id="signal"),
    ],
)
async def test_exit_info(tmp_path, handles, script, result, returncode, sig):
    h = await ProcessRunner().start(request(["/bin/sh", "-c", script], tmp_path))
    handles.append(h)
    async with asyncio.timeout(10):
        info = await h.wait()
    assert (info.result, info.returncode, info.signal) == (result, returncode, sig)
    assert await h.wait() == info  # safe to call again
    assert not h.running()


async def test_output_is_appended_to_the_log(tmp_path, handles):
    runner = ProcessRunner()
    for word in ("first", "second"):
        h = await runner.start(request(["/bin/sh", "-c", f"echo {word}; echo {word}-err >&2"], tmp_path))
        handles.append(h)
        async with asyncio.timeout(10):
            await h.wait()
    text = (tmp_path / "logs" / "test-engine.log").read_text()
    assert text.count("--- viiwork:") == 2
    assert text.index("first") < text.index("first-err") < text.index("second") < text.index("second-err")


async def test_environment_is_exactly_the_requested_one(tmp_path, handles):
    out = tmp_path / "env.txt"
    req = LaunchRequest(name="env", argv=("/bin/sh", "-c", f"env > {out}"), env={"PATH": "/usr/bin:/bin", "A": "1"},
                        description="t")
    h = await ProcessRunner().start(req)
    handles.append(h)
    async with asyncio.timeout(10):
        await h.wait()
    lines = {line.split("=", 1)[0] for line in out.read_text().splitlines()}
    assert {"PATH", "A"} <= lines
    assert "HOME" not in lines and "VIRTUAL_ENV" not in lines


async def test_engine_runs_in_its_own_process_group_and_session(tmp_path, handles):
    h = await ProcessRunner().start(request(["/bin/sh", "-c", "sleep 30"], tmp_path))
    handles.append(h)
    assert os.getpgid(h.pid) == h.pid
    assert os.getsid(h.pid) == h.pid
    assert os.getpgid(h.pid) != os.getpgid(0)


async def test_stop_terminates_the_whole_group(tmp_path, handles):
    child = tmp_path / "child.pid"
    h = await ProcessRunner().start(request(["/bin/sh", "-c", f"sleep 30 & echo $! > {child}; wait"], tmp_path))
    handles.append(h)
    child_pid = int(await file_text_within(child))
    async with asyncio.timeout(10):
        info = await h.stop(5.0)
    assert info.result == "signal" and info.signal == signal.SIGTERM
    assert await gone_within(child_pid, 5), "a process of the engine's group survived the stop"


async def test_group_is_killed_when_the_leader_exits(tmp_path, handles):
    # An engine that dies leaving workers behind (vLLM does): the workers must not hold GPUs.
    child = tmp_path / "child.pid"
    h = await ProcessRunner().start(request(["/bin/sh", "-c", f"sleep 30 & echo $! > {child}; exit 3"], tmp_path))
    handles.append(h)
    child_pid = int(await file_text_within(child))
    async with asyncio.timeout(10):
        info = await h.wait()
    assert info.returncode == 3
    assert await gone_within(child_pid, 5)


async def test_sigterm_ignored_escalates_to_sigkill_after_grace(tmp_path, handles):
    # Like llama-server with a request in flight: SIGTERM is logged and ignored.
    child = tmp_path / "child.pid"
    script = f"trap 'echo got-term' TERM; sleep 30 & echo $! > {child}; while :; do wait; done"
    h = await ProcessRunner().start(request(["/bin/sh", "-c", script], tmp_path, env={}))
    handles.append(h)
    child_pid = int(await file_text_within(child))
    # A stopped process cannot act on SIGTERM (it stays pending): only SIGKILL ends it.
    os.kill(child_pid, signal.SIGSTOP)
    t0 = time.monotonic()
    async with asyncio.timeout(10):
        info = await h.stop(0.5)
    waited = time.monotonic() - t0
    assert info.result == "signal" and info.signal == signal.SIGKILL
    assert waited >= 0.5
    assert await gone_within(child_pid, 5)
    assert "got-term" in (tmp_path / "logs" / "test-engine.log").read_text()


async def test_fake_engine_ignoring_sigterm_is_killed(tmp_path, handles):
    binary = fake_engine_binary(tmp_path / "bin")
    port = free_port()
    h = await ProcessRunner().start(request(
        [binary, "--port", port, "--alias", "m"], tmp_path, env={"FAKE_IGNORE_SIGTERM": "1", "FAKE_LOAD_S": "0"}))
    handles.append(h)
    log = tmp_path / "logs" / "test-engine.log"
    deadline = time.monotonic() + 10
    while "listening" not in log.read_text():
        assert time.monotonic() < deadline, log.read_text()
        await asyncio.sleep(0.02)
    async with asyncio.timeout(10):
        info = await h.stop(0.5)
    assert info.signal == signal.SIGKILL
    assert "cleaning up before exit" in log.read_text()


async def test_adoptable_is_empty():
    assert await ProcessRunner().adoptable("n1") == []


PARENT = textwrap.dedent("""
    import asyncio, os, sys
    from viiwork.agent.supervision.runners.base import LaunchRequest
    from viiwork.agent.supervision.runners.process import ProcessRunner

    async def main():
        req = LaunchRequest(name="pd", argv=tuple(sys.argv[1:]), env=dict(os.environ), description="pd")
        handle = await ProcessRunner().start(req)
        print(handle.pid, flush=True)
        await asyncio.Event().wait()

    asyncio.run(main())
""")


def test_engine_dies_with_its_parent(tmp_path):
    """kill -9 of the agent (the parent) kills the engine: PR_SET_PDEATHSIG."""
    binary = fake_engine_binary(tmp_path / "bin")
    script = tmp_path / "parent.py"
    script.write_text(PARENT)
    parent = subprocess.Popen(
        [sys.executable, str(script), str(binary), "--port", str(free_port()), "--alias", "m"],
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
        env={**os.environ, "FAKE_LOAD_S": "0"},
    )
    engine_pid = None
    try:
        engine_pid = int(parent.stdout.readline())
        assert alive(engine_pid)
        parent.kill()
        parent.wait(10)
        deadline = time.monotonic() + 10
        while alive(engine_pid) and time.monotonic() < deadline:
            time.sleep(0.02)
        assert not alive(engine_pid), "the engine outlived its parent"
    finally:
        if parent.poll() is None:
            parent.kill()
            parent.wait(10)
        if engine_pid is not None and alive(engine_pid):
            os.kill(engine_pid, signal.SIGKILL)
