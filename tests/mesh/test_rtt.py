"""Round-trip times and a seed's node id between two real processes (docs/routing.md, "Randomisation
among near-equals"; docs/mesh.md, "Seeds").

Node A has node B's address as its only seed; B knows nobody. Each runs
tests/support/mesh_runner.py on loopback. After a few gossip rounds each one's ``GET /v1/mesh``
shows a measured ``rtt_ms`` for the other (A's from dialling the seed, B's from dialling A back as
a known peer), and A's seed entry names B's node id. Both come from the TLS peer of the exchange's
response (mesh/transport.py): a small reply arrives whole with its head and aiohttp releases the
connection before the client could read the peer from it, which once left both null.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

RUNNER = Path(__file__).resolve().parent.parent / "support" / "mesh_runner.py"


class Runner:
    def __init__(self, tmp: Path, name: str, seeds: list[str]):
        self.log = open(tmp / f"{name}.log", "wb")
        argv = [sys.executable, str(RUNNER), "--state", str(tmp / name), "--name", name, "--trust", "open",
                "--mesh-id", "rtt-lab", "--discovery", "seeds", "--seeds", ",".join(seeds)]
        self.proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=self.log)
        line = self.proc.stdout.readline()  # one JSON line when ready
        if not line:
            raise AssertionError(f"runner {name} exited: {(tmp / f'{name}.log').read_text()[-2000:]}")
        info = json.loads(line)
        self.node_id, self.mesh_port, self.api_port = info["node_id"], info["mesh_port"], info["api_port"]

    def view(self) -> dict:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.api_port}/v1/mesh", timeout=5) as resp:
            return json.load(resp)

    def node(self, other: Runner) -> dict | None:
        return next((n for n in self.view()["nodes"] if n["id"] == other.node_id), None)

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


def test_two_processes_measure_each_others_rtt_and_learn_the_seeds_node_id(tmp_path):
    b = Runner(tmp_path, "b", [])
    a = None
    try:
        a = Runner(tmp_path, "a", [f"127.0.0.1:{b.mesh_port}"])

        def measured(x: Runner, y: Runner) -> bool:
            n = x.node(y)
            return n is not None and n["liveness"] == "alive" and n["rtt_ms"] is not None

        wait_until(lambda: measured(a, b) and measured(b, a), 10, "both nodes to measure the other's RTT")
        for x, y in ((a, b), (b, a)):
            rtt = x.node(y)["rtt_ms"]
            assert 0.0 < rtt < 1000.0, (x.node_id, rtt)
        [seed] = a.view()["seeds"]
        assert seed["answered"] and seed["node_id"] == b.node_id, seed
    finally:
        if a is not None:
            a.stop()
        b.stop()
