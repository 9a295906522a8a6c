"""vLLM backends answer only the agent (docs/security.md, "Local users"): ``--uds`` in the
backend's private directory, and the key in ``VLLM_API_KEY`` from an environment file, never
on the command line or in the environment the runner is given (``ps``, ``systemctl show``).
The systemd side: tests/systemd/test_systemd_runner.py
``test_environment_file_key_reaches_the_engine_not_the_unit_properties``."""

from __future__ import annotations

import json
import os
import shlex
import stat
import sys
import urllib.request
from pathlib import Path

from support.agent import run_agent
from viiwork.engines.contract import BackendSpec, Kind
from viiwork.engines.vllm import VllmEngine, VllmOptions

FAKE_VLLM = Path(__file__).with_name("fake_vllm.py")


def test_command_binds_the_socket_and_names_the_key_variable_only() -> None:
    spec = BackendSpec(model="m", kind=Kind.CHAT, path="/models/m", port=0, ctx_per_slot=2048, parallel=2,
                       gpus=("0",), options=VllmOptions(), api_key_file="/run/viiwork/engines/m-0/key",
                       socket_path="/run/viiwork/engines/m-0/engine.sock")
    cmd = VllmEngine().build_command(spec)
    argv = list(cmd.argv)
    assert argv[argv.index("--uds") + 1] == spec.socket_path
    assert "--host" not in argv and "--port" not in argv and "--api-key" not in argv
    assert cmd.key_env == "VLLM_API_KEY" and "VLLM_API_KEY" not in cmd.env


def test_agent_gives_vllm_its_key_through_the_environment_file_only(tmp_path: Path) -> None:
    binary = tmp_path / "vllm"
    binary.write_text(f"#!/bin/sh\nexec {shlex.quote(sys.executable)} {shlex.quote(str(FAKE_VLLM))} \"$@\"\n")
    binary.chmod(0o755)
    report = tmp_path / "report.json"
    model = {"name": "v", "engine": "vllm", "path": str(tmp_path / "model"), "ctx_per_slot": 1024,
             "parallel": 2, "backends": 1, "startup_timeout_s": 60,
             "env": {"FAKE_VLLM_REPORT": str(report)}, "vllm": {"binary": str(binary)}}
    with run_agent(tmp_path, [model], name="node-v") as agent:
        backend = agent.wait_healthy("v", timeout_s=60)["models"][0]["backends"][0]
        key_dir = tmp_path / "node-v" / "engines" / "v-0"
        assert backend["socket"] == str(key_dir / "engine.sock") and backend["port"] is None
        key = (key_dir / "key").read_text().strip()
        # Read by systemd as root: in the agent's engine dir, not in the engine user's v-0/.
        env_file = key_dir.parent / "v-0.env"
        assert env_file.read_text() == f"VLLM_API_KEY={key}\n"
        assert stat.S_IMODE(env_file.stat().st_mode) == 0o600 and env_file.stat().st_uid == os.geteuid()
        assert not (key_dir / "key.env").exists()
        seen = json.loads(report.read_text())
        assert seen["has_key"] and key not in json.dumps(seen["argv"])
        cmdline = Path(f"/proc/{backend['pid']}/cmdline").read_bytes()
        assert key.encode() not in cmdline
        # The engine refuses a local user without the key; the agent's own requests carry it.
        assert agent.engine_request("v", "GET", "/v1/models", key=False)[0] == 401
        assert agent.engine_request("v", "GET", "/v1/models")[0] == 200
        req = urllib.request.Request(f"{agent.url}/v1/chat/completions", method="POST",
                                     data=json.dumps({"model": "v", "messages": [{"role": "user", "content": "x"}]}).encode(),
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=10) as r:
            assert r.status == 200 and json.load(r)["choices"][0]["message"]["content"] == "hi"
        assert key not in agent.log_text()


class _NoBus:
    """unit_properties is pure: a runner that never talks to systemd needs no bus."""

    def add_message_handler(self, handler: object) -> None:
        pass


def test_vllm_unit_reads_its_key_from_an_environment_file(tmp_path: Path) -> None:
    from viiwork.agent.supervision.engine_keys import write_env_file, write_key
    from viiwork.agent.supervision.runners.base import LaunchRequest
    from viiwork.agent.supervision.runners.systemd.runner import SystemdRunner

    key, key_file = write_key(tmp_path / "v-0")
    spec = BackendSpec(model="v", kind=Kind.CHAT, path="/models/v", port=0, ctx_per_slot=1024, parallel=1,
                       options=VllmOptions(), api_key_file=str(key_file),
                       socket_path=str(tmp_path / "v-0" / "engine.sock"))
    cmd = VllmEngine().build_command(spec)
    env_file = write_env_file(tmp_path / "v-0", cmd.key_env or "", key)
    assert env_file == tmp_path / "v-0.env"
    assert env_file.read_text() == f"VLLM_API_KEY={key}\n"
    assert stat.S_IMODE(env_file.stat().st_mode) == 0o600
    request = LaunchRequest(name="viiwork-engine-n-v-0", argv=cmd.argv, env=dict(cmd.env), description="v",
                            labels={"owner": "n"}, environment_file=str(env_file))
    runner = SystemdRunner(_NoBus(), system=True, cache_root="/var/cache", systemd_owner="root")  # type: ignore[arg-type]
    props = {name: variant.value for name, variant in runner.unit_properties(request, "/usr/bin/vllm")}
    assert props["EnvironmentFiles"] == [[str(env_file), False]]
    assert key not in repr(props["ExecStart"]) and key not in repr(props["Environment"])
    assert not any(e.startswith("VLLM_API_KEY=") for e in props["Environment"])
