"""Time for a node to find its one live peer among dead seeds, with real processes.

Node B (the live peer) and node A are tests/support/mesh_runner.py processes on 127.0.0.1
(open trust, seeds only) with the agent's default mesh settings (500 ms rounds, fanout 3,
suspect 2 s, dead 10 s, connect timeout 1 s, exchange deadline 2 s). A's ``mesh.seeds`` are
``--dead`` dead addresses (tests/support/dead_seeds.py: refused 127.0.0.x ports, silent
listeners that accept and never answer, black-holed 192.0.2.x) followed by B's address,
listed last. Figure: seconds from A's start (its ready line) until A's ``GET /v1/mesh``
shows B ``alive`` (polled every 20 ms), min / median / max of ``-n`` rounds, each with a
fresh A. The same B serves every round.

Usage: .venv/bin/python tests/bench/bench_dead_seeds.py [--dead 0,50,200] [-n 3] [--timeout-s 60]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from support.dead_seeds import DeadSeeds  # noqa: E402

RUNNER = Path(__file__).resolve().parent.parent / "support" / "mesh_runner.py"
DEFAULTS = ["--trust", "open", "--mesh-id", "dead-seeds-bench", "--discovery", "seeds", "--interval-ms", "500",
            "--suspect-ms", "2000", "--dead-ms", "10000", "--connect-timeout-s", "1.0", "--exchange-timeout-s", "2.0"]


class Node:
    def __init__(self, tmp: Path, name: str, seeds: list[str]):
        self.log_path = tmp / f"{name}.log"
        self.log = open(self.log_path, "wb")
        argv = [sys.executable, str(RUNNER), "--state", str(tmp / name), "--name", name, *DEFAULTS,
                "--seeds", ",".join(seeds), "--log-level", "WARNING"]
        self.proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=self.log)
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        self.started = time.monotonic()
        if not line:
            raise RuntimeError(f"{name} exited: {self.log_path.read_text()[-2000:]}")
        info = json.loads(line)
        self.node_id, self.mesh_port, self.api_port = info["node_id"], info["mesh_port"], info["api_port"]

    def view(self) -> dict:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.api_port}/v1/mesh", timeout=5) as resp:
            return json.load(resp)

    def sees_alive(self, node_id: str) -> bool:
        return any(n["id"] == node_id and n["liveness"] == "alive" for n in self.view()["nodes"])

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        self.log.close()


def one_round(tmp: Path, live: Node, dead: DeadSeeds, i: int, timeout_s: float) -> tuple[float | None, str]:
    """Seconds until A sees B alive (None past ``timeout_s``), and A's log."""
    a = Node(tmp, f"a{len(dead.addresses)}-{i}", [*dead.addresses, f"127.0.0.1:{live.mesh_port}"])
    try:
        found = None
        while time.monotonic() - a.started < timeout_s:
            if a.sees_alive(live.node_id):
                found = time.monotonic() - a.started
                break
            time.sleep(0.02)
        if found is not None and dead.addresses:
            time.sleep(2.5)  # let the first round's dials end, for the summary line in the log
        return found, a.log_path.read_text(errors="replace") if a.log_path.exists() else ""
    finally:
        a.stop()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dead", default="0,50,200", help="numbers of dead seeds, comma-separated")
    ap.add_argument("-n", type=int, default=3, help="rounds per number")
    ap.add_argument("--timeout-s", type=float, default=60.0)
    args = ap.parse_args()
    sizes = [int(x) for x in args.dead.split(",") if x]
    rows, sample_line = [], ""
    with tempfile.TemporaryDirectory(prefix="bench-dead-seeds-") as tmpname:
        tmp = Path(tmpname)
        live = Node(tmp, "b", [])
        try:
            for n in sizes:
                with DeadSeeds(n) as dead:
                    times: list[float] = []
                    missed = 0
                    for i in range(args.n):
                        found, log = one_round(tmp, live, dead, i, args.timeout_s)
                        if found is None:
                            missed += 1
                        else:
                            times.append(found)
                        for line in log.splitlines():
                            if "seeds did not answer" in line and not sample_line:
                                sample_line = line.strip()
                    kinds = f"{len(dead.refused)} refused, {len(dead.silent)} silent, {len(dead.blackholed)} black-holed"
                    figure = (f"{min(times):.2f} / {statistics.median(times):.2f} / {max(times):.2f}"
                              if times else "-")
                    rows.append((n, kinds if n else "-", figure, missed))
                    print(f"{n} dead seeds: {figure} s, {missed} not found within {args.timeout_s:.0f} s", flush=True)
        finally:
            live.stop()
    print()
    print(f"Dead seeds before the live one; {args.n} rounds each; seconds until the live peer is alive in the "
          f"new node's view (min / median / max); {platform.machine()}, Python {platform.python_version()}.")
    print()
    print(f"| dead seeds | kinds | live peer alive after (s) | not found within {args.timeout_s:.0f} s |")
    print("|---|---|---|---|")
    for n, kinds, figure, missed in rows:
        print(f"| {n} | {kinds} | {figure} | {missed} of {args.n} |")
    if sample_line:
        print()
        print("The node's one summary line (WARNING):")
        print()
        print("    " + sample_line)
    return 0 if all(missed == 0 for *_, missed in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
