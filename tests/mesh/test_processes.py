"""Three mesh nodes in three processes on 127.0.0.1 (mDNS bound to 127.0.0.1 only).

Each runs tests/support/mesh_runner.py (a MeshNode plus GET /v1/mesh on loopback, as the
agent serves it); `viiworkctl mesh --url` reads each one. Once with trust = "open", once
with a CA made by `viiworkctl mesh ca init` and nodes enrolled by `viiworkctl mesh enroll`.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

RUNNER = Path(__file__).resolve().parent.parent / "support" / "mesh_runner.py"
VIIWORKCTL = Path(sys.executable).parent / "viiworkctl"


def ctl(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([str(VIIWORKCTL), *args], capture_output=True, text=True, timeout=30)


class Runner:
    def __init__(self, tmp: Path, name: str, trust: str, ca: Path | None):
        argv = [sys.executable, str(RUNNER), "--state", str(tmp / name), "--name", name, "--trust", trust,
                "--discovery", "mdns", "--model", f"model-{name}"]
        argv += ["--ca", str(ca / "ca.crt")] if ca else ["--mesh-id", "proc-lab"]
        self.name = name
        self.log = open(tmp / f"{name}.log", "wb")
        self.proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=self.log)
        line = self.proc.stdout.readline()  # the runner prints one JSON line when ready
        if not line:
            raise AssertionError(f"runner {name} exited: {(tmp / f'{name}.log').read_text()[-2000:]}")
        info = json.loads(line)
        self.node_id, self.api_port = info["node_id"], info["api_port"]

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.api_port}"

    def view(self) -> dict:
        with urllib.request.urlopen(self.url + "/v1/mesh", timeout=5) as resp:
            return json.load(resp)

    def liveness_of(self, other: Runner) -> str | None:
        for node in self.view()["nodes"]:
            if node["id"] == other.node_id:
                return node["liveness"]
        return None

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
        self.log.close()


def wait_until(predicate, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.1)
    raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")


@pytest.fixture(params=["open", "ca"])
def trio(request, tmp_path):
    ca = None
    if request.param == "ca":
        ca = tmp_path / "ca"
        assert ctl("mesh", "ca", "init", "--out", str(ca)).returncode == 0
        for name in ("a", "b", "c"):
            out = ctl("mesh", "enroll", "--ca", str(ca), "--state-dir", str(tmp_path / name), "--name", name)
            assert out.returncode == 0, out.stderr
    runners = []
    try:
        for name in ("a", "b", "c"):
            runners.append(Runner(tmp_path, name, request.param, ca))
        yield runners
    finally:
        for r in runners:
            r.stop()


def test_three_processes_find_each_other_then_detect_crash_and_leave(trio):
    a, b, c = trio

    def everyone_sees_everyone():
        for r in trio:
            nodes = {n["name"]: n for n in r.view()["nodes"]}
            others = {x.name for x in trio if x is not r}
            if set(nodes) != others or any(n["liveness"] != "alive" for n in nodes.values()):
                return False
        return True

    wait_until(everyone_sees_everyone, 20, "mDNS discovery and gossip between three processes")
    table = ctl("mesh", "--url", a.url).stdout
    assert "model-b 0/4" in table and "model-c 0/4" in table
    out = ctl("mesh", "--json", "--url", a.url)
    assert out.returncode == 0, out.stderr
    doc = json.loads(out.stdout)
    assert {n["name"] for n in doc["nodes"]} == {"b", "c"}
    assert {n["trust"] for n in doc["nodes"]} == {doc["self"]["trust"]}

    c.proc.send_signal(signal.SIGKILL)  # a crash: no leave announcement
    c.proc.wait(10)
    wait_until(lambda: a.liveness_of(c) == "suspect" and b.liveness_of(c) in ("suspect", "dead"), 5,
               "the killed node to turn suspect")
    wait_until(lambda: a.liveness_of(c) == "dead" and b.liveness_of(c) == "dead", 8,
               "the killed node to turn dead")

    b.proc.send_signal(signal.SIGTERM)  # a graceful stop announces `leaving`
    started = time.monotonic()
    wait_until(lambda: a.liveness_of(b) == "left", 3, "the stopped node to be left")
    assert time.monotonic() - started < 3
    assert b.proc.wait(10) == 0
