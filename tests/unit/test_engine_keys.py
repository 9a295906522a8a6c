"""Engines answer only the agent (docs/security.md, "Local users").

A real agent process runs the fake llama-server (which, like llama-server, binds a Unix
socket for a ``--host`` ending in ``.sock`` and refuses every route but /health and /models
without ``Authorization: Bearer <key>`` once given ``--api-key-file``). The engine has no TCP
port; its socket and key live in a directory another local user (``nobody``) cannot open;
a request over the socket without the key gets 401; the agent's own requests (probes,
/slots, proxied completions) carry the key; a client's Authorization header never reaches
the engine, and the key is never in an answer, /v1/status or the agent's log.
"""

from __future__ import annotations

import json
import os
import pwd
import shutil
import stat
import subprocess
import sys
import tempfile
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from support.agent import Agent, run_agent
from support.engines import fake_engine_binary
from viiwork.agent.supervision.engine_keys import EngineKeyError, read_key, write_env_file, write_key
from viiwork.engines.contract import BackendSpec, Kind
from viiwork.engines.llamacpp import LlamaCppOptions

pytestmark = pytest.mark.timeout(60)

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


@pytest.fixture(scope="module")
def agent() -> Iterator[Agent]:
    # Not under pytest's 0700 base: another user must be able to reach the state dir, so
    # that what stops them is the backend's own directory.
    tmp = Path(tempfile.mkdtemp(prefix="viiwork-keys-", dir="/tmp"))
    tmp.chmod(0o755)
    binary = fake_engine_binary(tmp / "bin")
    model = {"name": "m", "engine": "llamacpp", "path": "/dev/null", "parallel": 2, "backends": 1,
             "llamacpp": {"binary": str(binary), "metrics": True}}
    try:
        with run_agent(tmp, [model]) as a:
            a.wait_healthy("m")
            # The load read (/slots, /metrics: key required) succeeded: slots come from the engine.
            a.wait_for(lambda doc: doc["models"][0]["backends"][0]["load_stale"] is False, 10, "a load read")
            a.key_dir = tmp / "node-a" / "engines" / "m-0"  # type: ignore[attr-defined]
            # A state dir open to everyone (the agent keeps its own 0700): the backend's
            # directory must stop other users by itself.
            (tmp / "node-a").chmod(0o755)
            yield a
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def post(url: str, doc: dict, headers: dict[str, str] | None = None) -> tuple[int, bytes, dict[str, str]]:
    req = urllib.request.Request(url, data=json.dumps(doc).encode(), method="POST",
                                 headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return r.status, r.read(), dict(r.headers)
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read(), dict(exc.headers)


def listening_tcp_inodes() -> set[str]:
    """Socket inodes of every listening TCP socket in this network namespace."""
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as f:
            for line in f.readlines()[1:]:
                fields = line.split()
                if fields[3] == "0A":  # TCP_LISTEN
                    inodes.add(fields[9])
    return inodes


def socket_inodes(pid: int) -> set[str]:
    out = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            out.add(target[8:-1])
    return out


def the_key(agent: Agent) -> str:
    return (agent.key_dir / "key").read_text().strip()  # type: ignore[attr-defined]


def test_the_key_file_is_private_to_the_engine_user(agent: Agent) -> None:
    key_dir: Path = agent.key_dir  # type: ignore[attr-defined]
    assert stat.S_IMODE(key_dir.stat().st_mode) == 0o700
    info = (key_dir / "key").stat()
    assert stat.S_IMODE(info.st_mode) == 0o600
    assert info.st_uid == os.geteuid()  # the process runner: the engine runs as the agent's user
    assert len(the_key(agent)) >= 40


def test_the_engine_listens_on_a_socket_and_no_tcp_port(agent: Agent) -> None:
    backend = agent.model("m")["backends"][0]
    assert backend["port"] is None
    sock = Path(backend["socket"])
    assert sock.parent == agent.key_dir and sock.is_socket()  # type: ignore[attr-defined]
    assert not socket_inodes(backend["pid"]) & listening_tcp_inodes()


@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("setpriv") is None, reason="needs root and setpriv")
def test_another_local_user_cannot_reach_the_socket_or_the_key(agent: Agent) -> None:
    sock = agent.engine_socket("m")
    probe = (
        "import os, socket, sys\n"
        "engines, sock, key = sys.argv[1:]\n"
        "os.stat(engines)\n"  # the way up to the engines dir is open: the backend dir is what stops us
        "for what, call in (('connect', lambda: socket.socket(socket.AF_UNIX).connect(sock)),\n"
        "                   ('read', lambda: open(key).read()), ('list', lambda: os.listdir(os.path.dirname(sock)))):\n"
        "    try:\n"
        "        call()\n"
        "    except PermissionError:\n"
        "        continue\n"
        "    sys.exit(f'{what} succeeded')\n"
        "print('refused')\n"
    )
    out = subprocess.run(["setpriv", "--reuid=nobody", "--regid=nogroup", "--clear-groups", sys.executable, "-c",
                          probe, str(Path(sock).parent.parent), sock, str(Path(sock).parent / "key")],
                         capture_output=True, text=True, timeout=30)
    assert out.returncode == 0 and out.stdout.strip() == "refused", out.stderr + out.stdout


def test_a_local_user_without_the_key_is_refused(agent: Agent) -> None:
    for headers in ({}, {"Authorization": "Bearer guess"}):
        status, body = agent.engine_request("m", "POST", "/v1/chat/completions", CHAT, headers=headers, key=False)
        assert status == 401, body
        for path in ("/slots", "/metrics"):
            status, body = agent.engine_request("m", "GET", path, headers=headers, key=False)
            assert status == 401, (path, body)


def test_the_agent_sends_the_key_and_never_the_clients_authorization(agent: Agent) -> None:
    status, body, headers = post(agent.url + "/v1/chat/completions", CHAT,
                                 {"Authorization": "Bearer client-secret"})
    assert status == 200, body
    seen = agent.engine_stats("m")["authorizations"]
    assert seen[-1] == f"Bearer {the_key(agent)}"
    assert not any("client-secret" in s for s in seen)
    key = the_key(agent)
    assert key not in body.decode() and key not in json.dumps(headers)


def test_the_key_is_never_shown(agent: Agent) -> None:
    key = the_key(agent)
    post(agent.url + "/v1/chat/completions", {**CHAT, "stream": True})
    with urllib.request.urlopen(agent.url + "/v1/status", timeout=5) as r:
        assert key not in r.read().decode()
    with urllib.request.urlopen(agent.url + "/metrics", timeout=5) as r:
        assert key not in r.read().decode()
    assert key not in agent.log_text()
    # The engine's log starts with its command line: the key file's name, not the key.
    engine_log = (agent.key_dir.parent.parent / "logs" / "m-0.log").read_text()  # type: ignore[attr-defined]
    assert f"--api-key-file {agent.key_dir}/key" in engine_log  # type: ignore[attr-defined]
    assert key not in engine_log


@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("setpriv") is None, reason="needs root and setpriv")
def test_as_root_the_key_belongs_to_the_engine_user_only(tmp_path: Path) -> None:
    """The systemd runner's case (agent root, engines as another user): that user, and only
    it, reads the key. ``nobody`` stands for the engine user, ``daemon`` for anyone else."""
    root = Path(tempfile.mkdtemp(prefix="viiwork-owner-", dir="/tmp"))
    try:
        root.chmod(0o755)
        key, path = write_key(root / "engines" / "m-0", "nobody")
        info = path.parent.stat()
        assert (info.st_uid, stat.S_IMODE(info.st_mode)) == (pwd.getpwnam("nobody").pw_uid, 0o700)
        assert stat.S_IMODE(path.stat().st_mode) == 0o600 and path.stat().st_uid == info.st_uid
        for user, expect in (("nobody", key), ("daemon", "PermissionError")):
            out = subprocess.run(["setpriv", f"--reuid={user}", f"--regid={user if user != 'nobody' else 'nogroup'}",
                                  "--clear-groups", sys.executable, "-c",
                                  "import sys\ntry:\n print(open(sys.argv[1]).read().strip())\n"
                                  "except PermissionError:\n print('PermissionError')", str(path)],
                                 capture_output=True, text=True, timeout=30)
            assert out.stdout.strip() == expect, (user, out.stderr)
        assert write_key(root / "engines" / "m-0", "nobody")[0] != key  # a fresh key per launch
    finally:
        shutil.rmtree(root, ignore_errors=True)


def test_links_left_in_the_backend_dir_are_never_followed(tmp_path: Path) -> None:
    """The backend dir may belong to the engine user: a symlink, hard link or FIFO it leaves
    at ``key`` (or at the temp name the agent writes first) is neither written through nor
    read (nor waited on) by the agent."""
    victim = tmp_path / "victim"
    victim.write_text("precious\n")
    victim.chmod(0o600)
    d = tmp_path / "engines" / "m-0"
    d.parent.mkdir(mode=0o711)
    d.mkdir(mode=0o700)
    (d / "key").symlink_to(victim)
    (d / f".key.{os.getpid()}").symlink_to(victim)
    key, path = write_key(d)
    assert victim.read_text() == "precious\n" and stat.S_IMODE(victim.stat().st_mode) == 0o600
    assert not path.is_symlink() and path.read_text() == f"{key}\n" and read_key(d) == key
    for plant in (lambda p: p.symlink_to(victim), lambda p: os.link(victim, p), lambda p: os.mkfifo(p)):
        path.unlink()
        plant(path)
        assert read_key(d) is None  # a FIFO would block a plain open() for good
    assert victim.read_text() == "precious\n"


@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("setpriv") is None, reason="needs root and setpriv")
def test_the_engine_user_cannot_swap_the_environment_file() -> None:
    """systemd reads vLLM's environment file as root: it must not be where the engine user
    (``nobody`` here) can replace it with a link to a root-only file (its lines would become
    the engine's environment). It lives in the agent's 0711 engine dir, beside the backend's."""
    root = Path(tempfile.mkdtemp(prefix="viiwork-env-", dir="/tmp"))
    try:
        root.chmod(0o755)
        engines = root / "engines"
        key, _ = write_key(engines / "v-0", "nobody")
        (engines / "v-0" / "key.env").symlink_to("/etc/shadow")  # where it used to be, planted
        env = write_env_file(engines / "v-0", "VLLM_API_KEY", key)
        assert env == engines / "v-0.env" and env.read_text() == f"VLLM_API_KEY={key}\n"
        info, top = env.stat(), engines.stat()
        assert (info.st_uid, stat.S_IMODE(info.st_mode)) == (0, 0o600)
        assert (top.st_uid, stat.S_IMODE(top.st_mode)) == (0, 0o711)
        assert not (engines / "v-0" / "key.env").is_symlink()
        swap = ("import os, sys\nenv = sys.argv[1]\n"
                "for call in (lambda: os.symlink('/etc/shadow', env + '.x'), lambda: os.unlink(env),\n"
                "             lambda: os.rename(env, env + '.y')):\n"
                "    try:\n        call()\n    except PermissionError:\n        continue\n"
                "    sys.exit('the engine user changed the engine dir')\nprint('refused')\n")
        out = subprocess.run(["setpriv", "--reuid=nobody", "--regid=nogroup", "--clear-groups", sys.executable, "-c",
                              swap, str(env)], capture_output=True, text=True, timeout=30)
        assert out.stdout.strip() == "refused", out.stderr + out.stdout
        os.chown(engines, 65534, 65534)  # an engine dir someone else owns is refused, not used
        with pytest.raises(EngineKeyError, match="owned by uid 65534"):
            write_env_file(engines / "v-0", "VLLM_API_KEY", key)
    finally:
        shutil.rmtree(root, ignore_errors=True)


def test_socket_paths_over_the_kernel_limit_are_refused_clearly() -> None:
    base = {"model": "m", "kind": Kind.CHAT, "path": "/m.gguf", "ctx_per_slot": 8, "parallel": 1,
            "options": LlamaCppOptions()}
    ok = "/run/viiwork/engines/m-0/engine.sock"
    assert BackendSpec(**base, port=0, socket_path=ok).address == f"unix:{ok}"
    long = "/" + "d" * 100 + "/engine.sock"
    with pytest.raises(ValueError, match=r"over the 107-byte limit of a Unix socket path"):
        BackendSpec(**base, port=0, socket_path=long)
    with pytest.raises(ValueError, match="port must be 0 with a socket_path"):
        BackendSpec(**base, port=8080, socket_path=ok)
    with pytest.raises(ValueError, match="not absolute"):
        BackendSpec(**base, port=0, socket_path="engine.sock")
