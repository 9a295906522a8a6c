"""The admin socket and viiworkctl's control commands against a real agent process.

Backends are fake llama-servers (separate processes); agent, supervisor, admin API and
the CLI are the real ones.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from support.agent import Agent, render_config, run_agent
from support.engines import fake_engine_binary

CTL = str(Path(sys.executable).parent / "viiworkctl")


def model(binary: Path, name: str, **extra: object) -> dict:
    return {"name": name, "engine": "llamacpp", "path": "/dev/null", "parallel": 2, "backends": 1,
            "startup_timeout_s": 30, "llamacpp": {"binary": str(binary)}, "env": {"FAKE_LOAD_S": "0.1"}, **extra}


def ctl(agent_dir: Path, *args: str) -> subprocess.CompletedProcess:
    sock = agent_dir / "node-a" / "admin.sock"
    return subprocess.run([CTL, *args, "--socket", str(sock)], capture_output=True, text=True, timeout=120)


def chat_status(agent: Agent, name: str) -> int:
    req = urllib.request.Request(f"{agent.url}/v1/chat/completions", method="POST",
                                 data=json.dumps({"model": name, "messages": []}).encode(),
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status
    except urllib.error.HTTPError as exc:
        return exc.code


def pids(agent: Agent) -> dict[str, int]:
    return {m["name"]: m["backends"][0]["pid"] for m in agent.status()["models"] if m["backends"]}


@pytest.fixture
def binary(tmp_path: Path) -> Path:
    return fake_engine_binary(tmp_path / "bin")


def test_admin_socket_mode(tmp_path: Path, binary: Path) -> None:
    with run_agent(tmp_path, [model(binary, "a")]) as agent:
        agent.wait_healthy("a")
        mode = os.stat(tmp_path / "node-a" / "admin.sock").st_mode & 0o777
        assert mode == 0o660


def test_drain_undrain_down_up_models(tmp_path: Path, binary: Path) -> None:
    with run_agent(tmp_path, [model(binary, "a"), model(binary, "b")]) as agent:
        agent.wait_healthy("a")
        agent.wait_healthy("b")
        assert chat_status(agent, "a") == 200
        r = ctl(tmp_path, "drain")
        assert r.returncode == 0, r.stderr
        assert chat_status(agent, "a") == 503
        assert agent.status()["node"]["draining"] is True
        with pytest.raises(urllib.error.HTTPError) as health:  # load balancers stop sending here
            urllib.request.urlopen(f"{agent.url}/health", timeout=5)
        assert health.value.code == 503 and json.load(health.value)["status"] == "draining"
        assert ctl(tmp_path, "undrain").returncode == 0
        assert chat_status(agent, "a") == 200
        with urllib.request.urlopen(f"{agent.url}/health", timeout=5) as r:
            assert json.load(r)["status"] == "ok"

        r = ctl(tmp_path, "down", "b")
        assert r.returncode == 0, r.stderr
        doc = agent.model("b")
        assert doc["state"] == "down" and doc["backends"][0]["state"] == "stopped"
        assert chat_status(agent, "b") == 503
        assert chat_status(agent, "a") == 200

        r = ctl(tmp_path, "models", "--json")
        states = {m["name"]: m["state"] for m in json.loads(r.stdout)["models"]}
        assert states == {"a": "running", "b": "down"}

        assert ctl(tmp_path, "up", "b").returncode == 0
        agent.wait_healthy("b")
        assert chat_status(agent, "b") == 200

        r = ctl(tmp_path, "down", "nope")
        assert r.returncode == 1 and "unknown model 'nope'" in r.stderr and "a, b" in r.stderr


def test_reload_restarts_only_changed_models(tmp_path: Path, binary: Path) -> None:
    models = [model(binary, "a"), model(binary, "b"), model(binary, "c")]
    with run_agent(tmp_path, models) as agent:
        for name in "abc":
            agent.wait_healthy(name)
        before = pids(agent)
        config = tmp_path / "node-a.toml"
        text = config.read_text()
        # change b, remove c, add d
        new_models = [model(binary, "a"), model(binary, "b", parallel=3), model(binary, "d")]
        sections = text.split("[[models]]")[0]
        config.write_text(sections + "\n" + render_config({}, new_models))
        r = ctl(tmp_path, "reload", "--json")
        assert r.returncode == 0, r.stderr
        result = json.loads(r.stdout)
        assert (result["added"], result["changed"], result["removed"], result["unchanged"]) == \
            (["d"], ["b"], ["c"], ["a"])
        agent.wait_healthy("b")
        agent.wait_healthy("d")
        after = pids(agent)
        assert after["a"] == before["a"]
        assert after["b"] != before["b"]
        assert "c" not in after
        assert agent.model("b")["slots"] == 3
        assert chat_status(agent, "c") == 404
        assert chat_status(agent, "d") == 200

        # a broken config is refused and the running one stays
        config.write_text(text.replace("[node]", "[node]\nbogus = 1"))
        r = ctl(tmp_path, "reload")
        assert r.returncode == 1 and "node.bogus: unknown key" in r.stderr
        assert pids(agent) == after

        # SIGHUP reloads too (c comes back)
        config.write_text(text)
        agent.proc.send_signal(signal.SIGHUP)
        agent.wait_healthy("c", timeout_s=30)
        assert "d" not in {m["name"] for m in agent.status()["models"]}

        # [routing] is read at start only: the reload says it did not apply it
        assert "[routing]" not in text
        config.write_text(text.replace("[[models]]", "[routing]\nqueue_max = 7\n\n[[models]]", 1))
        r = ctl(tmp_path, "reload")
        assert r.returncode == 0 and "not applied: changes to [routing]" in r.stdout, r.stdout


def test_ctl_without_agent_says_how_to_fix(tmp_path: Path) -> None:
    r = subprocess.run([CTL, "drain", "--socket", str(tmp_path / "none.sock")], capture_output=True, text=True,
                       timeout=30)
    assert r.returncode == 1 and "cannot reach the agent's admin socket" in r.stderr


def test_logs_of_process_runner(tmp_path: Path, binary: Path) -> None:
    with run_agent(tmp_path, [model(binary, "a")]) as agent:
        agent.wait_healthy("a")
        r = subprocess.run([CTL, "logs", "a", "--url", agent.url, "--config", str(tmp_path / "node-a.toml")],
                           capture_output=True, text=True, timeout=30)
        assert r.returncode == 0, r.stderr
        assert "listening on" in r.stdout
        r = subprocess.run([CTL, "logs", "zzz", "--url", agent.url], capture_output=True, text=True, timeout=30)
        assert r.returncode == 1 and "known models: a" in r.stderr
