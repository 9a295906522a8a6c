"""Three mesh nodes on three "hosts" (network namespaces on a bridge, real 10.99.0.x
addresses, nothing on loopback): they find each other by mDNS alone, and with mDNS off,
by seeds alone; over mutual TLS with a CA made by the viiworkctl commands."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import require

from support.netns import bridged_hosts, netns_available

pytestmark = pytest.mark.netns

RUNNER = Path(__file__).resolve().parent.parent / "support" / "mesh_runner.py"
VIIWORKCTL = Path(sys.executable).parent / "viiworkctl"


def read_view(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def wait_until(predicate, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.1)
    raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")


@pytest.mark.parametrize("discovery", ["mdns", "seeds"])
def test_three_hosts_form_a_ca_mesh(tmp_path, discovery):
    ok, reason = netns_available()
    require(ok, reason)
    ca = tmp_path / "ca"
    assert subprocess.run([str(VIIWORKCTL), "mesh", "ca", "init", "--out", str(ca)], capture_output=True).returncode == 0
    for i in (1, 2, 3):
        out = subprocess.run([str(VIIWORKCTL), "mesh", "enroll", "--ca", str(ca), "--state-dir", str(tmp_path / f"h{i}"),
                              "--name", f"h{i}"], capture_output=True, text=True)
        assert out.returncode == 0, out.stderr
    with bridged_hosts(f"vwm{os.getpid() % 10000}{discovery[0]}", 3) as hosts:
        views = {}
        for i in (1, 2, 3):
            views[i] = tmp_path / f"h{i}.view.json"
            argv = [sys.executable, str(RUNNER), "--state", str(tmp_path / f"h{i}"), "--name", f"h{i}", "--trust", "ca",
                    "--ca", str(ca / "ca.crt"), "--host", hosts.address(i), "--mesh-port", "8087",
                    "--discovery", discovery, "--model", f"model-h{i}", "--view-file", str(views[i])]
            if discovery == "seeds":
                argv += ["--seeds", f"{hosts.address(1)}:8087"]
            log = open(tmp_path / f"h{i}.log", "wb")
            proc = hosts.popen(i, argv, stdout=subprocess.PIPE, stderr=log)
            assert json.loads(proc.stdout.readline())["mesh_port"] == 8087

        def formed():
            for i, path in views.items():
                doc = read_view(path)
                if doc is None:
                    return False
                alive = {n["name"] for n in doc["nodes"] if n["liveness"] == "alive"}
                if alive != {f"h{j}" for j in (1, 2, 3) if j != i}:
                    return False
            return True

        wait_until(formed, 30, f"three hosts to form a mesh by {discovery}")
        doc = read_view(views[1])
        assert {n["mesh"] for n in doc["nodes"]} == {"10.99.0.2:8087", "10.99.0.3:8087"}
        assert doc["self"]["mesh"] == "10.99.0.1:8087" and doc["self"]["trust"] == "ca"
        assert doc["counters"]["transport"].get("handshake_failed", 0) == 0
