"""viiworkctl without flags against a running demo-like agent, `mesh` on a standalone node,
and tables that fit 80 and 100 columns.

The agent is a real process with fake llama-servers; its config file is put where a running
demo writes its own ($XDG_STATE_HOME/viiwork-demo/demo-config.toml), so viiworkctl finds it
the way it finds `viiwork-agent --demo` (agent/cli/target.py).
"""

from __future__ import annotations

import io
import json
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from rich.console import Console

from support.agent import Agent, run_agent
from support.engines import fake_engine_binary
from support.tiny_gguf import write_tiny_gguf
from viiwork.agent.cli import mesh as mesh_cli
from viiwork.agent.cli import status as status_cli
from viiwork.agent.cli.tables import UNBOUNDED_WIDTH
from viiwork.agent.config.demo import DEMO_CONFIG_FILE

MODEL = "smollm2-with-a-long-model-name"


@pytest.fixture
def demo(tmp_path: Path) -> Iterator[tuple[Agent, dict[str, str]]]:
    if Path("/etc/viiwork/viiwork.toml").exists():
        pytest.skip("a system config exists here: viiworkctl would see two candidates")
    binary = fake_engine_binary(tmp_path / "bin")
    xdg = tmp_path / "xdg"
    xdg.mkdir()
    gguf = tmp_path / "model.gguf"  # a real (tiny) GGUF: config check's host checks read the path
    write_tiny_gguf(gguf, seed=1)
    models = [{"name": MODEL, "engine": "llamacpp", "path": str(gguf), "parallel": 2, "backends": 2,
               "startup_timeout_s": 30, "llamacpp": {"binary": str(binary)}, "env": {"FAKE_LOAD_S": "0.1"}}]
    with run_agent(xdg, models, name="viiwork-demo") as agent:
        agent.wait_healthy(MODEL)
        shutil.copy(xdg / "viiwork-demo.toml", xdg / "viiwork-demo" / DEMO_CONFIG_FILE)
        env = {k: v for k, v in os.environ.items() if k != "VIIWORK_URL"}
        env.update(XDG_STATE_HOME=str(xdg), COLUMNS="100")
        yield agent, env


def ctl(env: dict[str, str], *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "viiwork.agent.cli", *args], capture_output=True, text=True,
                          env=env, timeout=60)


def test_ctl_finds_the_demo_without_flags(demo: tuple[Agent, dict[str, str]]) -> None:
    agent, env = demo
    status = ctl(env, "status", "--json")
    assert status.returncode == 0, status.stderr
    assert json.loads(status.stdout)["node"]["name"] == "viiwork-demo"
    models = ctl(env, "models")  # over the admin socket
    assert models.returncode == 0, models.stderr
    assert MODEL in models.stdout


def test_mesh_on_a_standalone_node(demo: tuple[Agent, dict[str, str]]) -> None:
    _, env = demo
    plain = ctl(env, "mesh")
    assert plain.returncode == 0, plain.stderr
    assert "standalone" in plain.stdout and len(plain.stdout.strip().splitlines()) == 1
    assert "b'" not in plain.stdout + plain.stderr
    as_json = ctl(env, "mesh", "--json")
    assert as_json.returncode == 0, as_json.stderr
    assert json.loads(as_json.stdout) == {"mesh": None}


def _text(render, doc: dict, width: int, wide: bool = False) -> str:
    out = io.StringIO()
    render(doc, Console(file=out, width=width, color_system=None), wide=wide)
    return out.getvalue()


@pytest.mark.parametrize("width", [80, 100])
def test_status_table_fits(demo: tuple[Agent, dict[str, str]], width: int) -> None:
    agent, _ = demo
    doc = agent.status()
    text = _text(status_cli.render, doc, width)
    assert "…" not in text
    assert max(len(line) for line in text.splitlines()) <= width
    assert text.count("healthy") >= 2  # each backend's state whole, not "hea…"


def test_status_wide_shows_every_column(demo: tuple[Agent, dict[str, str]]) -> None:
    agent, _ = demo
    text = _text(status_cli.render, agent.status(), 200, wide=True)
    for col in ("engine", "ctx/slot", "pid", "port", "respawns", "slots"):
        assert col in text
    assert "pid" not in _text(status_cli.render, agent.status(), 200)


MESH_DOC = {
    "self": {"name": "gpu-node-a", "id": "n-aaaa", "mesh_id": "m-1", "trust": "ca", "state": "serving",
             "models": [], "gpus": []},
    "nodes": [{"name": f"gpu-node-{i}.rack-7.example.internal", "id": f"node-{i:032x}",
               "api": f"http://10.20.30.{i}:8086", "liveness": "alive", "state": "serving", "age_ms": 1200,
               "trust": "ca", "models": [{"name": "smollm2-135m-instruct", "busy": 1, "slots": 4, "waiting": 0}],
               "gpus": [{"index": 0, "name": "NVIDIA H200", "memory_total_mib": 143771, "memory_free_mib": 1024}]}
              for i in range(3)],
    "conflicts": [],
}


@pytest.mark.parametrize("width", [80, 100])
def test_mesh_table_fits(width: int) -> None:
    text = _text(mesh_cli.render, MESH_DOC, width)
    assert "…" not in text
    assert max(len(line) for line in text.splitlines()) <= width
    wide = _text(mesh_cli.render, MESH_DOC, UNBOUNDED_WIDTH, wide=True)  # the width --wide prints at
    assert "node-" + "0" * 32 in wide and "trust" in wide


def test_status_wide_is_not_cut_by_the_terminal(demo: tuple[Agent, dict[str, str]]) -> None:
    _, env = demo  # COLUMNS=100, the width that used to wrap --wide's headers
    wide = ctl(env, "status", "--wide")
    assert wide.returncode == 0, wide.stderr
    header = next(line for line in wide.stdout.splitlines() if "model" in line and "respawns" in line)
    for col in ("engine", "backend state", "ctx/slot", "pid", "port", "respawns"):
        assert col in header
    assert any(MODEL in line for line in wide.stdout.splitlines())  # the name whole, not folded
    plain = ctl(env, "status")
    assert max(len(line) for line in plain.stdout.splitlines()) <= 100


def test_models_has_a_header_row(demo: tuple[Agent, dict[str, str]]) -> None:
    _, env = demo
    models = ctl(env, "models")
    assert models.returncode == 0, models.stderr
    lines = models.stdout.splitlines()
    assert lines[0].split() == ["model", "engine", "state", "backends"]
    assert lines[1].split()[:3] == [MODEL, "llamacpp", "running"]


@pytest.mark.parametrize("command", ["check", "show"])
def test_config_commands_find_the_running_demo(demo: tuple[Agent, dict[str, str]], command: str) -> None:
    agent, env = demo
    demo_file = Path(env["XDG_STATE_HOME"]) / "viiwork-demo" / DEMO_CONFIG_FILE
    found = ctl(env, "config", command)
    assert found.returncode == 0, found.stderr
    assert f"using {demo_file} (the running demo's config, found through its admin socket" in found.stderr
    assert str(demo_file) in found.stdout
    for form in ([str(demo_file)], ["--config", str(demo_file)]):
        given = ctl(env, "config", command, *form)
        assert given.returncode == 0, given.stderr
        assert "using" not in given.stderr and str(demo_file) in given.stdout
    both = ctl(env, "config", command, str(demo_file), "--config", "/nonexistent.toml")
    assert both.returncode == 2 and "differ" in both.stderr


def _other_config(agent: Agent, tmp_path: Path) -> Path:
    """A config on the demo's API port whose own agent does not run (its admin socket is elsewhere)."""
    other = tmp_path / "other.toml"
    other.write_text(f'[api]\nlisten = "{agent.url.removeprefix("http://")}"\n'
                     f'admin_socket = "{tmp_path / "other-admin.sock"}"\n')
    return other


def test_status_with_config_talks_to_that_agent_only(demo: tuple[Agent, dict[str, str]], tmp_path: Path) -> None:
    agent, env = demo
    other = _other_config(agent, tmp_path)
    status = ctl(env, "status", "--config", str(other))
    assert status.returncode == 1
    assert f"the agent of {other} does not run: nothing answers on its admin socket" in status.stderr
    assert "viiwork-demo" not in status.stdout
    missing = ctl(env, "status", "--config", str(tmp_path / "missing.toml"))
    assert missing.returncode == 1 and "cannot use --config" in missing.stderr
    demo_file = Path(env["XDG_STATE_HOME"]) / "viiwork-demo" / DEMO_CONFIG_FILE
    mine = ctl(env, "status", "--config", str(demo_file), "--json")
    assert mine.returncode == 0, mine.stderr
    assert json.loads(mine.stdout)["node"]["name"] == "viiwork-demo"


def test_port_held_by_the_demo_names_it(demo: tuple[Agent, dict[str, str]], tmp_path: Path) -> None:
    agent, env = demo
    other = _other_config(agent, tmp_path)
    check = ctl(env, "config", "check", str(other))
    assert check.returncode == 1
    port = agent.url.rpartition(":")[2]
    sock = Path(env["XDG_STATE_HOME"]) / "viiwork-demo" / "admin.sock"
    assert f"port {port} (127.0.0.1:{port}) is held by the demo (" in check.stderr
    assert f"a running viiwork agent (admin socket {sock}, pid {agent.proc.pid}): stop it or set api.listen" \
        in check.stderr


def test_doctor_with_config_asks_only_that_configs_agent(demo: tuple[Agent, dict[str, str]], tmp_path: Path) -> None:
    """`doctor --config X` whose agent does not run says so (agent.reachable degraded, the other
    agent.* checks skipped) instead of judging X against the demo that answers on X's
    api.listen (a newcomer's finding)."""
    agent, env = demo
    other = _other_config(agent, tmp_path)
    doctor = ctl(env, "doctor", "--config", str(other), "--json")
    results = {r["check"]: r for r in json.loads(doctor.stdout)["results"]}
    assert results["agent.reachable"]["verdict"] == "degraded", results["agent.reachable"]
    assert f"the agent of {other} does not run" in results["agent.reachable"]["summary"]
    assert results["agent.config"]["verdict"] == "skipped", results["agent.config"]
    assert "viiwork-demo" not in doctor.stdout
    demo_file = Path(env["XDG_STATE_HOME"]) / "viiwork-demo" / DEMO_CONFIG_FILE
    mine = ctl(env, "doctor", "--config", str(demo_file), "--json")
    mine_results = {r["check"]: r for r in json.loads(mine.stdout)["results"]}
    assert mine_results["agent.reachable"]["verdict"] == "ok", mine_results["agent.reachable"]
