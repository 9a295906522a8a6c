"""One agent per state dir and per socket, and state dir faults as one clear line (issue 14,
items 2, 4 and 5): real ``viiwork-agent`` processes with fake llama-servers.

docs/reliability.md, "The state dir"; docs/security.md, "Local users".
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import socket
import stat
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from support.agent import Agent, run_agent, write_config
from support.engines import fake_engine_binary
from support.procs import free_port

AGENT = Path(sys.executable).parent / "viiwork-agent"
CTL = Path(sys.executable).parent / "viiworkctl"
EXIT_TIMEOUT_S = 30  # a refused agent exits at once; this only bounds a broken one


def model(binary: Path) -> dict[str, Any]:
    return {"name": "m", "engine": "llamacpp", "path": "/dev/null", "parallel": 1, "backends": 1,
            "llamacpp": {"binary": str(binary)}, "env": {"FAKE_LOAD_S": "0.1"}}


def marking_binary(directory: Path, marker: Path) -> Path:
    """A fake engine that first creates ``marker``: proof that an agent launched an engine."""
    real = fake_engine_binary(directory / "real")
    path = directory / "marking-llama-server"
    path.write_text(f"#!/bin/sh\ntouch {marker}\nexec {real} \"$@\"\n")
    path.chmod(0o755)
    return path


def run_to_exit(config: Path, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """Run an agent that is expected to refuse to start; fails the test if it keeps running."""
    proc = subprocess.Popen([str(AGENT), "--config", str(config)], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env={**os.environ, **(env or {})})
    try:
        out, _ = proc.communicate(timeout=EXIT_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, _ = proc.communicate()
        pytest.fail(f"the second agent kept running; its log:\n{out[-3000:]}")
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, "")


def admin_answers(sock: Path) -> bool:
    done = subprocess.run([str(CTL), "models", "--socket", str(sock)], capture_output=True, text=True, timeout=30)
    return done.returncode == 0


def backend_pid(agent: Agent) -> int:
    return agent.model("m")["backends"][0]["pid"]


@pytest.fixture
def first(tmp_path: Path) -> Iterator[Agent]:
    """A healthy agent ``node-a`` (state dir tmp_path/node-a), mesh on a fixed port."""
    mesh_port = free_port()
    extra = {"mesh": {"trust": "open", "mesh_id": "lock-mesh", "listen": f"127.0.0.1:{mesh_port}",
                      "discovery": ["seeds"]}}
    with run_agent(tmp_path, [model(fake_engine_binary(tmp_path / "bin"))], name="node-a", extra=extra) as agent:
        agent.wait_healthy("m", timeout_s=30)
        agent.mesh_port = mesh_port  # type: ignore[attr-defined]
        yield agent


def second_config(tmp_path: Path, marker: Path, **overrides: dict[str, Any]) -> Path:
    """``node-b`` with its own state dir, admin socket and ports, then ``overrides``."""
    extra: dict[str, dict[str, Any]] = {"mesh": {"trust": "open", "mesh_id": "lock-mesh",
                                                 "listen": "127.0.0.1:0", "discovery": ["seeds"]}}
    for section, table in overrides.items():
        extra[section] = {**extra.get(section, {}), **table}
    port = extra.pop("port", {}).get("api") or free_port()
    return write_config(tmp_path, [model(marking_binary(tmp_path / "bin-b", marker))], "node-b", extra, port)


def assert_first_untouched(first: Agent, pid: int, tmp_path: Path) -> None:
    doc = first.wait_healthy("m", timeout_s=10)
    assert first.proc.poll() is None
    assert next(m for m in doc["models"] if m["name"] == "m")["backends"][0]["pid"] == pid
    os.kill(pid, 0)  # the first agent's engine still runs
    assert admin_answers(tmp_path / "node-a" / "admin.sock")


def test_second_agent_on_the_same_state_dir_exits_naming_the_holder(first: Agent, tmp_path: Path) -> None:
    pid = backend_pid(first)
    marker = tmp_path / "b-launched"
    config = second_config(tmp_path, marker, node={"state_dir": str(tmp_path / "node-a")},
                           api={"admin_socket": str(tmp_path / "b.sock")})
    done = run_to_exit(config)
    assert done.returncode != 0
    assert f"pid {first.proc.pid}" in done.stdout and str(tmp_path / "node-a") in done.stdout, done.stdout
    assert "Traceback" not in done.stdout
    assert not marker.exists(), "the second agent launched an engine"
    assert not (tmp_path / "b.sock").exists(), "the second agent bound its admin socket before the lock"
    assert_first_untouched(first, pid, tmp_path)


def test_second_agent_on_the_same_admin_socket_leaves_the_first_answering(first: Agent, tmp_path: Path) -> None:
    pid = backend_pid(first)
    sock = tmp_path / "node-a" / "admin.sock"
    marker = tmp_path / "b-launched"
    done = run_to_exit(second_config(tmp_path, marker, api={"admin_socket": str(sock)}))
    assert done.returncode != 0
    assert f"another agent answers on {sock}" in done.stdout, done.stdout
    assert "Traceback" not in done.stdout
    assert not marker.exists()
    assert_first_untouched(first, pid, tmp_path)


@pytest.mark.parametrize("listener", ["api", "mesh"])
def test_second_agent_on_a_taken_port_fails_before_starting_engines(first: Agent, tmp_path: Path,
                                                                     listener: str) -> None:
    """SO_REUSEADDR (set on both listeners) lets no second listener onto a live port on
    Linux; the agent must find that out before it launches (or adopts) a single engine."""
    pid = backend_pid(first)
    marker = tmp_path / "b-launched"
    if listener == "api":
        port = int(first.url.rpartition(":")[2])
        config = second_config(tmp_path, marker, port={"api": port})
        expect = "cannot listen on"
    else:
        config = second_config(tmp_path, marker, mesh={"listen": f"127.0.0.1:{first.mesh_port}"})  # type: ignore[attr-defined]
        expect = "cannot bind"
    done = run_to_exit(config)
    assert done.returncode != 0
    assert expect in done.stdout and "Traceback" not in done.stdout, done.stdout
    assert not marker.exists(), "the second agent launched an engine before finding its port taken"
    assert_first_untouched(first, pid, tmp_path)


def test_stale_admin_socket_is_removed_and_the_agent_starts(tmp_path: Path) -> None:
    sock = tmp_path / "node-a" / "admin.sock"
    sock.parent.mkdir(mode=0o700)
    with socket.socket(socket.AF_UNIX) as s:  # bound, never listening, closed: what a killed agent leaves
        s.bind(str(sock))
    assert sock.is_socket()
    with run_agent(tmp_path, [], name="node-a") as agent:
        agent.wait_for(lambda doc: True, 10)
        assert admin_answers(sock)


# -- state dir faults at start ----------------------------------------------------------------


@contextlib.contextmanager
def tmpfs(path: Path, size: str = "64k") -> Iterator[Path]:
    path.mkdir(parents=True, exist_ok=True)
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size},mode=0700", "tmpfs", str(path)],
                          capture_output=True, text=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here (needs root): {done.stderr.strip()}")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)


def fill(directory: Path) -> Path:
    """Fill the file system holding ``directory``; returns the filler file."""
    filler = directory / "filler"
    with open(filler, "wb", buffering=0) as f:
        try:
            while True:
                f.write(b"\0" * 4096)
        except OSError as exc:
            assert exc.errno == errno.ENOSPC
    return filler


@pytest.fixture
def notify_socket(tmp_path: Path) -> Iterator[socket.socket]:
    """A datagram socket standing for systemd's NOTIFY_SOCKET."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as s:
        s.bind(str(tmp_path / "notify.sock"))
        s.settimeout(5)
        yield s


def _full(base: Path, stack: contextlib.ExitStack) -> Path:
    mnt = stack.enter_context(tmpfs(base / "full"))
    fill(mnt)
    return mnt / "state"


def _read_only(base: Path, stack: contextlib.ExitStack) -> Path:
    mnt = stack.enter_context(tmpfs(base / "ro"))
    (mnt / "state").mkdir(mode=0o700)
    subprocess.run(["mount", "-o", "remount,ro", str(mnt)], check=True)
    return mnt / "state"


def _a_file(base: Path, stack: contextlib.ExitStack) -> Path:
    (base / "state").write_text("not a dir\n")
    return base / "state"


def _under_a_file(base: Path, stack: contextlib.ExitStack) -> Path:
    (base / "file").write_text("not a dir\n")
    return base / "file" / "state"


def _foreign_owner(base: Path, stack: contextlib.ExitStack) -> Path:
    (base / "state").mkdir(mode=0o700)
    os.chown(base / "state", 65534, 65534)
    return base / "state"


def _group_writable(base: Path, stack: contextlib.ExitStack) -> Path:
    (base / "state").mkdir()
    os.chmod(base / "state", 0o770)
    return base / "state"


FAULTS = {
    "full": (_full, "ENOSPC"),
    "read-only": (_read_only, "EROFS"),
    "a-file": (_a_file, "EEXIST"),
    "under-a-file": (_under_a_file, "ENOTDIR"),
    "foreign-owner": (_foreign_owner, "chown"),
    "group-writable": (_group_writable, "chmod 700"),
}


@pytest.mark.parametrize("fault", list(FAULTS))
def test_state_dir_fault_is_one_line_and_a_status(tmp_path: Path, notify_socket: socket.socket, fault: str) -> None:
    if os.geteuid() != 0 and fault in ("full", "read-only", "foreign-owner"):
        pytest.skip("needs root (mount, chown)")
    make, needle = FAULTS[fault]
    with contextlib.ExitStack() as stack:
        (tmp_path / "fault").mkdir()
        state = make(tmp_path / "fault", stack)
        config = write_config(tmp_path, [], "node-f", {
            "node": {"state_dir": str(state)}, "api": {"admin_socket": str(tmp_path / "f.sock")},
            "mesh": {"trust": "open", "mesh_id": "fault-mesh", "listen": "127.0.0.1:0", "discovery": ["seeds"]}},
            free_port())
        done = run_to_exit(config, env={"NOTIFY_SOCKET": str(tmp_path / "notify.sock")})
    assert done.returncode != 0
    assert "Traceback" not in done.stdout, done.stdout
    lines = [line for line in done.stdout.splitlines() if "ERROR" in line]
    assert len(lines) == 1, done.stdout
    assert str(state) in lines[0] and needle in lines[0] and "fix:" in lines[0], lines[0]
    status = notify_socket.recv(4096).decode()
    # systemctl status shows one line of at most 200 characters: the start of the same text.
    assert status.startswith(f"STATUS={lines[0].partition('viiwork.agent: ')[2][:100]}"), status
    assert not (tmp_path / "f.sock").exists()


# -- a disk that fills while the agent runs ----------------------------------------------------


def test_disk_filling_while_running_is_reported_and_retried(tmp_path: Path) -> None:
    """A's state dir fills up; B then joins, so A must persist a new name pin: A keeps
    running and gossiping, /v1/status shows the pending write, and once space is freed the
    retry stores it."""
    if os.geteuid() != 0:
        pytest.skip("needs root (mount)")
    mesh = {"trust": "open", "mesh_id": "full-mesh", "listen": "127.0.0.1:0", "advertise": "127.0.0.1",
            "discovery": ["seeds"], "gossip_interval_ms": 100, "suspect_after_ms": 1000, "dead_after_ms": 3000}
    with contextlib.ExitStack() as stack:
        mnt = stack.enter_context(tmpfs(tmp_path / "disk", size="128k"))
        a = stack.enter_context(run_agent(tmp_path, [], name="node-a",
                                          extra={"node": {"state_dir": str(mnt / "state")}, "mesh": mesh}))
        seed = a.wait_for(lambda d: bool(d["mesh"]["self"]["mesh"]), 20, "mesh address")["mesh"]["self"]["mesh"]
        assert a.status()["state_dir"]["pending_writes"] == []
        filler = fill(mnt)
        b = stack.enter_context(run_agent(tmp_path, [], name="node-b", extra={"mesh": {**mesh, "seeds": [seed]}}))
        doc = a.wait_for(lambda d: d["state_dir"]["pending_writes"], 20, "a pending write")
        pending = doc["state_dir"]["pending_writes"][0]
        assert pending["what"] == "name pins" and pending["errno"] == "ENOSPC", pending
        # Still gossiping: the failed write did not end the gossip loop.
        a.wait_for(lambda d: d["mesh"]["peers"].get("alive") == 1, 20, "b alive on a")
        b.wait_for(lambda d: d["mesh"]["peers"].get("alive") == 1, 20, "a alive on b")
        assert a.proc.poll() is None
        filler.unlink()
        a.wait_for(lambda d: d["state_dir"]["pending_writes"] == [], 20, "the retry to succeed")
        pins = json.loads((mnt / "state" / "known_nodes.json").read_text())["pins"]
        assert "node-b" in pins
        assert not [p for p in (mnt / "state").iterdir() if ".tmp-" in p.name], "a partial temp file was left"


def test_a_full_disk_at_respawn_is_a_pending_write_not_a_dead_backend(tmp_path: Path) -> None:
    """The engine dies while the disk is full: its respawn cannot write the new key. That is
    no engine failure: no respawn is spent (the backend would be dead within seconds), the
    key shows as a pending write, and once space is freed the launch succeeds."""
    if os.geteuid() != 0:
        pytest.skip("needs root (mount)")
    health = {"interval_s": 0.5, "respawn_backoff_s": 0.05, "respawn_backoff_max_s": 0.1, "max_respawns": 1}
    with contextlib.ExitStack() as stack:
        mnt = stack.enter_context(tmpfs(tmp_path / "disk", size="256k"))
        a = stack.enter_context(run_agent(tmp_path, [model(fake_engine_binary(tmp_path / "bin"))], name="node-a",
                                          extra={"node": {"state_dir": str(mnt / "state")}, "health": health}))
        a.wait_healthy("m", timeout_s=30)
        pid = backend_pid(a)
        filler = fill(mnt)
        os.kill(pid, 9)
        doc = a.wait_for(lambda d: any(p["attempts"] >= 2 for p in d["state_dir"]["pending_writes"]), 20,
                         "a retried pending key write")
        pending = doc["state_dir"]["pending_writes"]
        assert [(p["what"], p["errno"]) for p in pending] == [("engine key of m-0", "ENOSPC")], pending
        backend = next(m for m in doc["models"] if m["name"] == "m")["backends"][0]
        assert backend["state"] == "unhealthy" and backend["respawns"] <= 1, backend
        assert "retried every" in backend["reason"], backend
        filler.unlink()
        doc = a.wait_healthy("m", timeout_s=20)
        assert doc["state_dir"]["pending_writes"] == []
        assert backend_pid(a) != pid and a.proc.poll() is None


def test_a_second_demo_is_told_one_demo_per_user(tmp_path: Path) -> None:
    """The demo has no config in which to give another state dir: its refusal says to stop the
    other demo, naming its pid (the lock is taken before the demo's engine starts)."""
    from viiwork.agent.host.statedir import take_state_dir

    held = take_state_dir(tmp_path / "viiwork-demo")
    try:
        proc = subprocess.run([str(AGENT), "--demo"], capture_output=True, text=True, timeout=EXIT_TIMEOUT_S,
                              env={**os.environ, "XDG_STATE_HOME": str(tmp_path)})
    finally:
        held.release()
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1, out
    assert f"another demo agent of this user runs (pid {os.getpid()}" in out and "one demo per user" in out, out
    assert "Traceback" not in out


# -- a state dir prepared by someone else ------------------------------------------------------


def _lock_symlink_in_foreign_dir(state: Path, victim: Path) -> None:
    """What another local user can prepare under /tmp: their 0777 dir, agent.lock -> victim."""
    state.mkdir()
    os.chmod(state, 0o777)
    (state / "agent.lock").symlink_to(victim)
    os.lchown(state / "agent.lock", 65534, 65534)
    os.chown(state, 65534, 65534)


def _lock_symlink_in_own_dir(state: Path, victim: Path) -> None:
    state.mkdir(mode=0o700)
    (state / "agent.lock").symlink_to(victim)


def _lock_hardlink_in_own_dir(state: Path, victim: Path) -> None:
    state.mkdir(mode=0o700)
    os.link(victim, state / "agent.lock")


LOCK_TRAPS = {
    "symlink-in-foreign-dir": (_lock_symlink_in_foreign_dir, "owned by uid 65534"),
    "symlink-in-own-dir": (_lock_symlink_in_own_dir, "is a symlink"),
    "hardlink-in-own-dir": (_lock_hardlink_in_own_dir, "2 links"),
}


@pytest.mark.parametrize("trap", list(LOCK_TRAPS))
def test_a_lock_file_that_points_elsewhere_is_refused_untouched(tmp_path: Path, trap: str) -> None:
    """agent.lock must never be followed to (and truncated in) a file of someone else: the dir
    is checked before anything is opened in it, and the lock opened O_NOFOLLOW and fstat'ed."""
    if os.geteuid() != 0 and trap == "symlink-in-foreign-dir":
        pytest.skip("needs root (chown)")
    make, needle = LOCK_TRAPS[trap]
    victim = tmp_path / "victim"
    victim.write_text("precious root data\n")
    victim.chmod(0o600)
    before = victim.stat()
    state = tmp_path / "state"
    make(state, victim)
    config = write_config(tmp_path, [], "node-l", {"node": {"state_dir": str(state)},
                                                   "api": {"admin_socket": str(tmp_path / "l.sock")}}, free_port())
    done = run_to_exit(config)
    assert done.returncode != 0
    assert "Traceback" not in done.stdout, done.stdout
    lines = [line for line in done.stdout.splitlines() if "ERROR" in line]
    assert len(lines) == 1 and needle in lines[0] and "fix:" in lines[0], done.stdout
    assert victim.read_text() == "precious root data\n"
    after = victim.stat()
    assert (after.st_mtime_ns, after.st_size, stat.S_IMODE(after.st_mode)) == \
        (before.st_mtime_ns, before.st_size, 0o600)


def test_the_demo_takes_another_port_and_says_so_when_its_port_is_held(tmp_path: Path) -> None:
    """`--demo --listen HOST:PORT` moves the demo; a held port's error names that option; `--listen`
    without `--demo` is a usage error (a config file sets api.listen)."""
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen(1)
        port = holder.getsockname()[1]
        proc = subprocess.run([str(AGENT), "--demo", "--listen", f"127.0.0.1:{port}"], capture_output=True,
                              text=True, timeout=EXIT_TIMEOUT_S, env={**os.environ, "XDG_STATE_HOME": str(tmp_path)})
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1, out
    assert f"cannot listen on 127.0.0.1:{port} (api.listen)" in out, out
    assert "run the demo on another port with --listen 127.0.0.1:PORT" in out and "Traceback" not in out, out
    proc = subprocess.run([str(AGENT), "--listen", "127.0.0.1:1", "--config", str(tmp_path / "x.toml")],
                          capture_output=True, text=True, timeout=EXIT_TIMEOUT_S)
    assert proc.returncode == 2 and "--listen is for --demo" in proc.stderr, proc.stderr
