"""200 dead seeds and one live one, with real processes on loopback (docs/mesh.md, "Seeds").

Node B (the live peer) and node A run tests/support/mesh_runner.py with the agent's default
mesh timings (500 ms rounds, connect timeout 1 s, exchange deadline 2 s). A's seeds are 200
dead addresses (tests/support/dead_seeds.py: refused 127.0.0.x ports, listeners that accept
and never answer, black-holed 192.0.2.x) with B's address listed last. While no peer is
alive a node dials every seed in its first round, so A sees B within 5 s (before: 11-39 s,
3 random seeds a round); the dead ones are then retried with backoff, not every round; one
WARNING line names them; ``GET /v1/mesh`` lists each seed's history under ``seeds``.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from support.dead_seeds import DeadSeeds

RUNNER = Path(__file__).resolve().parent.parent / "support" / "mesh_runner.py"
AGENT_TIMINGS = ["--interval-ms", "500", "--suspect-ms", "2000", "--dead-ms", "10000", "--connect-timeout-s", "1.0",
                 "--exchange-timeout-s", "2.0"]
SUMMARY = "seeds did not answer"


class Runner:
    def __init__(self, tmp: Path, name: str, seeds: list[str]):
        self.log_path = tmp / f"{name}.log"
        self.log = open(self.log_path, "wb")
        argv = [sys.executable, str(RUNNER), "--state", str(tmp / name), "--name", name, "--trust", "open",
                "--mesh-id", "dead-seeds", "--discovery", "seeds", "--seeds", ",".join(seeds), *AGENT_TIMINGS]
        self.proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=self.log)
        line = self.proc.stdout.readline()  # one JSON line when ready
        self.started = time.monotonic()
        if not line:
            raise AssertionError(f"runner {name} exited: {self.log_path.read_text()[-2000:]}")
        info = json.loads(line)
        self.node_id, self.mesh_port, self.api_port = info["node_id"], info["mesh_port"], info["api_port"]

    def view(self) -> dict:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.api_port}/v1/mesh", timeout=5) as resp:
            return json.load(resp)

    def logged(self) -> str:
        return self.log_path.read_text(errors="replace")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
        self.log.close()


def wait_until(predicate, timeout_s: float, what: str) -> float:
    started = time.monotonic()
    while time.monotonic() - started < timeout_s:
        if predicate():
            return time.monotonic() - started
        time.sleep(0.02)
    raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")


@pytest.fixture
def dead():
    with DeadSeeds(200) as seeds:
        yield seeds


def test_200_dead_seeds_do_not_hide_the_live_one(tmp_path, dead):
    assert len(dead.addresses) == 200 and dead.refused and dead.silent and dead.blackholed
    b = Runner(tmp_path, "b", [])
    a = None
    try:
        live = f"127.0.0.1:{b.mesh_port}"
        a = Runner(tmp_path, "a", [*dead.addresses, live])

        def a_sees_b() -> bool:
            return any(n["id"] == b.node_id and n["liveness"] == "alive" for n in a.view()["nodes"])

        wait_until(a_sees_b, 5.0, "A to see its live seed B alive behind 200 dead seeds")
        found_s = time.monotonic() - a.started
        print(f"\nlive peer alive in A's view {found_s:.2f} s after A's start (200 dead seeds before it)")
        assert found_s < 5.0

        # One line, once the first round's dials have ended (the silent ones after 2 s).
        wait_until(lambda: SUMMARY in a.logged(), 6.0, "the one line about the seeds that did not answer")
        time.sleep(3.0)  # later rounds retry the dead seeds: no second line
        lines = [ln for ln in a.logged().splitlines() if SUMMARY in ln]
        assert len(lines) == 1, lines
        assert "200 of 201 seeds did not answer" in lines[0] and "and 197 more" in lines[0]

        seeds = {s["address"]: s for s in a.view()["seeds"]}
        assert list(seeds) == [*dead.addresses, live]  # the configured order
        assert seeds[live]["answered"] and seeds[live]["failures"] == 0 and seeds[live]["last_error"] is None
        for address in dead.addresses:
            s = seeds[address]
            assert not s["answered"] and s["attempts"] >= 1 and s["failures"] == s["attempts"], s
        errors = {kind: {seeds[x]["last_error"] for x in getattr(dead, kind)}
                  for kind in ("refused", "silent", "blackholed")}
        assert errors["refused"] == {"connection refused"}, errors
        assert errors["silent"] <= {"timed out", None} and "timed out" in errors["silent"], errors  # None: in flight
        assert errors["blackholed"] <= {"timed out", "no route to host", "network is unreachable", None}, errors
    finally:
        if a is not None:
            a.stop()
        b.stop()


def test_with_no_live_peer_dead_seeds_are_backed_off_not_dialed_every_round(tmp_path, dead):
    a = Runner(tmp_path, "a", dead.addresses)
    try:
        wait_until(lambda: SUMMARY in a.logged(), 5.0, "the one line about the seeds that did not answer")
        time.sleep(max(0.0, 6.0 - (time.monotonic() - a.started)))
        age_s = time.monotonic() - a.started
        seeds = a.view()["seeds"]
        assert len(seeds) == 200 and not any(s["answered"] for s in seeds)
        # Every seed is due every round while no peer is alive, but only once its backoff has
        # passed: dials at about 0, 0.75, 2.25 and 5.25 s for a refused one (12 rounds so far),
        # fewer for the ones that hold a dial for its 1-2 s deadline.
        worst = max(s["attempts"] for s in seeds)
        total = sum(s["attempts"] for s in seeds)
        print(f"\n{total} dials of 200 dead seeds in {age_s:.1f} s ({age_s / 0.5:.0f} rounds); at most {worst} per seed")
        assert all(s["attempts"] >= 1 for s in seeds)
        assert worst <= 5 and total <= 200 * 4
        assert [ln for ln in a.logged().splitlines() if SUMMARY in ln][0].count("200 of 200") == 1
    finally:
        a.stop()


def test_seeds_whose_names_do_not_resolve_do_not_hide_the_live_one(tmp_path):
    """200 seeds named ``nohost-N.invalid`` and the live peer named ``localhost``: names are
    looked up on the mesh's own threads, each within its deadline (viiwork.mesh.lookups), so
    the live one is seen at once and each dead one says its lookup failed (before: behind 200
    such names the live peer was seen after 43.7 s, its dials "timed out")."""
    b = Runner(tmp_path, "b", [])
    a = None
    try:
        names = [f"nohost-{i}.invalid:8087" for i in range(200)]
        live = f"localhost:{b.mesh_port}"
        a = Runner(tmp_path, "a", [*names, live])

        def a_sees_b() -> bool:
            return any(n["id"] == b.node_id and n["liveness"] == "alive" for n in a.view()["nodes"])

        wait_until(a_sees_b, 5.0, "A to see its live seed B (named localhost) behind 200 names that do not resolve")
        print(f"\nlive peer alive in A's view {time.monotonic() - a.started:.2f} s after A's start")
        wait_until(lambda: all(s["attempts"] for s in a.view()["seeds"]), 5.0, "every seed dialed")
        seeds = {s["address"]: s for s in a.view()["seeds"]}
        assert seeds[live]["answered"] and seeds[live]["last_error"] is None
        errors = {seeds[x]["last_error"] for x in names}
        assert all(e is None or e.startswith("name lookup ") for e in errors), errors  # None: in flight
        assert any(e is not None for e in errors), errors
    finally:
        if a is not None:
            a.stop()
        b.stop()
