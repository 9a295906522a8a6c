"""viiworkctl status, mesh and doctor against a real agent with client keys on (issue 17 item 3).

One agent in keys mode, ``open_loopback_reads`` off, so its ``/v1/status`` and ``/v1/mesh``
need a key with the ``read`` scope even from here. The commands run as subprocesses, as an
operator runs them: without a key, or with a key that lacks the scope, each prints one line
naming ``--api-key`` and ``VIIWORK_API_KEY`` (no traceback) and exits non-zero; with a read
key, given as ``--api-key`` or in ``VIIWORK_API_KEY``, each works. The key is never printed.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from support.agent import Agent, run_agent
from support.client_keys import ctl, issue

pytestmark = pytest.mark.timeout(120)


@dataclass
class Keyed:
    agent: Agent
    config: Path
    reader: str  # scope read
    inference_only: str  # scope inference: not enough for /v1/status


@pytest.fixture(scope="module")
def keyed() -> Iterator[Keyed]:
    tmp = Path(tempfile.mkdtemp(prefix="viiwork-cli-key-", dir="/tmp"))
    try:
        ctl("keys", "issuer", "init", "--out", str(tmp / "issuer"))
        key = tmp / "issuer" / "issuer.key"
        reader = issue(key, "--scope", "read")
        inference_only = issue(key)
        with run_agent(tmp, [], extra={"auth": {"mode": "keys", "issuer_keys": str(tmp / "issuer" / "issuer.pub")}},
                       api_key=reader) as agent:
            yield Keyed(agent, tmp / "node-a.toml", reader, inference_only)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def viiworkctl(*args: str, key_env: str | None = None) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k not in ("VIIWORK_URL", "VIIWORK_API_KEY")} | {"COLUMNS": "200"}
    if key_env is not None:
        env["VIIWORK_API_KEY"] = key_env
    done = subprocess.run([sys.executable, "-m", "viiwork.agent.cli", *args], capture_output=True, text=True,
                          env=env, timeout=60)
    assert "Traceback" not in done.stderr, done.stderr
    return done


def _no_key_shown(done: subprocess.CompletedProcess[str], *keys: str) -> None:
    for key in keys:
        assert key not in done.stdout and key not in done.stderr
        assert key.split(".")[2] not in done.stdout + done.stderr  # not even its signature


@pytest.mark.parametrize("command", ["status", "mesh"])
@pytest.mark.parametrize("key", ["none", "inference-only"])
def test_a_refused_read_is_one_line_naming_the_key_options(keyed: Keyed, command: str, key: str) -> None:
    given = [] if key == "none" else ["--api-key", keyed.inference_only]
    done = viiworkctl(command, "--url", keyed.agent.url, *given)
    assert done.returncode == 1 and done.stdout == ""
    assert len(done.stderr.strip().splitlines()) == 1, done.stderr
    line = done.stderr.strip()
    assert line.startswith(f"viiworkctl {command}: ")
    assert "--api-key" in line and "VIIWORK_API_KEY" in line
    assert ("answered 401" in line and "no API key" in line) if key == "none" else \
        ("answered 403" in line and "'read' scope" in line)
    _no_key_shown(done, keyed.inference_only)


def test_status_reads_with_api_key_or_the_environment(keyed: Keyed) -> None:
    for args, env in (((("--api-key", keyed.reader)), None), ((), keyed.reader)):
        done = viiworkctl("status", "--url", keyed.agent.url, "--json", *args, key_env=env)
        assert done.returncode == 0, done.stderr
        doc = json.loads(done.stdout)
        assert doc["node"]["name"] == "node-a" and doc["auth"]["mode"] == "keys"
        _no_key_shown(done, keyed.reader)
    # The option wins over the environment (here: a key without the read scope).
    done = viiworkctl("status", "--url", keyed.agent.url, "--api-key", keyed.reader, key_env=keyed.inference_only)
    assert done.returncode == 0 and "node-a" in done.stdout, done.stderr


def test_mesh_reads_with_a_key(keyed: Keyed) -> None:
    done = viiworkctl("mesh", "--url", keyed.agent.url, key_env=keyed.reader)
    assert done.returncode == 0, done.stderr
    assert "standalone" in done.stdout  # a standalone node: its /v1/mesh says so, once the key is read


def test_doctor_without_a_key_is_degraded_and_reads_the_agent_with_one(keyed: Keyed) -> None:
    done = viiworkctl("doctor", "--config", str(keyed.config), "--json")
    report = json.loads(done.stdout)
    by = {(r["check"], r["subject"]): r for r in report["results"]}
    reachable = by[("agent.reachable", "")]
    assert reachable["verdict"] == "degraded" and "401" in reachable["summary"]
    assert "--api-key" in reachable["remedy"] and "VIIWORK_API_KEY" in reachable["remedy"]
    assert by[("agent.config", "")]["verdict"] == "skipped"
    assert by[("auth", "issuer key")]["verdict"] == "ok"

    done = viiworkctl("doctor", "--config", str(keyed.config), "--json", key_env=keyed.reader)
    report = json.loads(done.stdout)
    by = {(r["check"], r["subject"]): r for r in report["results"]}
    assert by[("agent.reachable", "")]["verdict"] == "ok", by[("agent.reachable", "")]
    assert by[("agent.config", "")]["verdict"] == "ok"
    _no_key_shown(done, keyed.reader)
