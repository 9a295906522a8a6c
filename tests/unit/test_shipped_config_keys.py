"""The shipped config (packaging/viiwork.toml) turns client keys on (issue 17 item 9), walked as
docs/install.md walks a fresh install, on a real agent and the real ``viiworkctl``.

The file is used as shipped, with only what a test must change: its issuer key path moved
into a temporary directory, and [node], [api], [supervisor] and one model (the fake
llama-server) appended where an operator uncomments them. Without an issuer key the agent
starts, refuses inference with a 401 naming the fix, ``viiworkctl status`` reads on loopback,
and ``viiworkctl doctor`` fails with that fix; with ``issuer.pub`` installed and the agent
restarted, a key from ``viiworkctl keys issue`` is served and no key is refused.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from conftest import REPO

from support.agent import Agent, render_config
from support.client_keys import bearer, chat, ctl, issue, request
from support.engines import fake_engine_binary
from support.procs import free_port, stop_process

pytestmark = pytest.mark.timeout(120)

SHIPPED = REPO / "packaging" / "viiwork.toml"
SHIPPED_ISSUER_KEYS = "/etc/viiwork/issuer.pub"


def test_the_shipped_config_sets_keys_mode() -> None:
    auth = tomllib.loads(SHIPPED.read_text())["auth"]
    assert auth["mode"] == "keys" and auth["issuer_keys"] == SHIPPED_ISSUER_KEYS
    assert auth["open_loopback_reads"] is True  # viiworkctl status on the box itself, before any key exists


def _start(config: Path, url: str, log: Path) -> Agent:
    with open(log, "ab") as out:
        proc = subprocess.Popen([str(Path(sys.executable).parent / "viiwork-agent"), "--config", str(config),
                                 "--log-level", "info"], stdout=out, stderr=subprocess.STDOUT)
    agent = Agent(proc, url, log)
    try:
        agent.wait_healthy("m", timeout_s=60)
    except BaseException:
        stop_process(proc, 30)
        raise
    return agent


def viiworkctl(*args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k not in ("VIIWORK_URL", "VIIWORK_API_KEY")} | {"COLUMNS": "200"}
    return subprocess.run([sys.executable, "-m", "viiwork.agent.cli", *args], capture_output=True, text=True,
                          env=env, timeout=60)


def test_a_fresh_install_on_the_shipped_config_ends_with_keys_on(tmp_path: Path) -> None:
    pub = tmp_path / "etc" / "issuer.pub"
    pub.parent.mkdir()
    port = free_port()
    state = tmp_path / "state"
    shipped = SHIPPED.read_text()
    assert shipped.count(json.dumps(SHIPPED_ISSUER_KEYS)) == 1
    config = tmp_path / "viiwork.toml"
    config.write_text(shipped.replace(json.dumps(SHIPPED_ISSUER_KEYS), json.dumps(str(pub))) + "\n" + render_config(
        {"node": {"name": "gpu-01", "state_dir": str(state)},
         "api": {"listen": f"127.0.0.1:{port}", "admin_socket": str(state / "admin.sock")},
         "supervisor": {"runner": "process"}},
        [{"name": "m", "engine": "llamacpp", "path": "/dev/null", "parallel": 1, "backends": 1,
          "llamacpp": {"binary": str(fake_engine_binary(tmp_path / "bin"))}}]))
    url = f"http://127.0.0.1:{port}"

    # 1. Installed, no issuer key yet: it starts, and every inference is a 401 that says how.
    agent = _start(config, url, tmp_path / "agent.log")
    try:
        status, body, _ = request(f"{url}/v1/chat/completions", chat())
        assert status == 401 and body["error"]["code"] == "invalid_api_key"
        message = body["error"]["message"]
        assert str(pub) in message and "viiworkctl keys issuer init" in message and "docs/install.md" in message
        shown = viiworkctl("status", "--config", str(config))
        assert shown.returncode == 0 and "gpu-01" in shown.stdout, shown.stderr  # open_loopback_reads
        doctor = viiworkctl("doctor", "--config", str(config), "--json")
        report = json.loads(doctor.stdout)
        (auth,) = [r for r in report["results"] if r["check"] == "auth"]
        assert auth["verdict"] == "fail" and str(pub) in auth["remedy"]
        assert "viiworkctl keys issuer init" in auth["remedy"] and doctor.returncode == 1
    finally:
        stop_process(agent.proc, 30)

    # 2. The workstation makes an issuer; its issuer.pub is copied to the node; restart.
    ctl("keys", "issuer", "init", "--out", str(tmp_path / "workstation"))
    pub.write_bytes((tmp_path / "workstation" / "issuer.pub").read_bytes())
    agent = _start(config, url, tmp_path / "agent.log")
    try:
        # 3. A first key, for this node's audience (its name), used like an OpenAI key.
        key = issue(tmp_path / "workstation" / "issuer.key", "--models", "m", tenant="team-a", audience="gpu-01")
        status, body, _ = request(f"{url}/v1/chat/completions", chat(), bearer(key))
        assert status == 200 and body["choices"], body
        assert request(f"{url}/v1/chat/completions", chat())[0] == 401
        doctor = viiworkctl("doctor", "--config", str(config), "--json")
        (auth,) = [r for r in json.loads(doctor.stdout)["results"] if r["check"] == "auth"]
        assert auth["verdict"] == "ok" and "aud 'gpu-01'" in auth["summary"]
    finally:
        stop_process(agent.proc, 30)
