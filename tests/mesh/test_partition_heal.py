"""A peer cut off for 8 s (network namespaces on a bridge: its cable pulled, packets lost, no
reset) is ``alive`` again in the others' views soon after the heal, and stays so
(docs/mesh.md, "Partitions heal": probe mode, the default detector).

Found by a newcomer's check of the ``refuted`` change (2026-12-06): after a cut of 5 s or
more, the observers saw the healed peer ``alive`` within a second, then ``suspect`` again
1-2 s later, and so up to three times over the next 5 s (once ``dead`` again), in every one
of 6 runs (none after SIGSTOP freezes of 2-20 s, where the kernel keeps acknowledging). The
channel each observer opened to the peer before the cut is still open after the heal, its
TCP connection in retransmission backoff (``ss -tni``: ``rto:6528 backoff:5``, frames
``notsent``): the probes written on it after the heal wait for the next retransmission,
seconds away, and miss. Killing those connections (``ss -K``) just before the heal removed
the flaps (3 runs of 3). This test fails until the channels recover from that.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import aiohttp
import pytest
from conftest import require

from support.agent import Agent, write_config
from support.netns import Hosts, bridged_hosts, in_netns, netns_available
from support.procs import stop_process

pytestmark = [pytest.mark.netns, pytest.mark.timeout(120)]

API_PORT, MESH_PORT = 8080, 8087
AGENT = Path(sys.executable).parent / "viiwork-agent"
CUT_S = 8.0  # several TCP retransmission timeouts (0.2 s doubling): 5 s was enough in every run
BACK_S = 5.0  # "alive to each other again within seconds of the network healing"
WATCH_S = 6.0  # the flaps came 1-5 s after the peer was first alive again


@contextmanager
def agent_on(hosts: Hosts, i: int, tmp: Path) -> Iterator[Agent]:
    """``viiwork-agent`` without models on host ``i`` (API ``10.99.0.i:8080``), seeded with
    host 1, with the default detector and timings; stopped by SIGTERM at the end."""
    name = f"node-{'abc'[i - 1]}"
    address = hosts.address(i)
    extra = {
        "api": {"listen": f"{address}:{API_PORT}"},
        "mesh": {"trust": "open", "mesh_id": "heal-mesh", "listen": f"{address}:{MESH_PORT}",
                 "advertise": address, "discovery": ["seeds"],
                 "seeds": [] if i == 1 else [f"{hosts.address(1)}:{MESH_PORT}"]},
        "health": {"drain_timeout_s": 2}, "supervisor": {"stop_timeout_s": 2},
    }
    config = write_config(tmp, [], name, extra, API_PORT)
    log = tmp / f"{name}.log"
    with open(log, "ab") as out:
        proc = hosts.popen(i, [str(AGENT), "--config", str(config)], stdout=out, stderr=subprocess.STDOUT)
    try:
        yield Agent(proc, f"http://{address}:{API_PORT}", log)
    finally:
        stop_process(proc, 15)


async def liveness(http: aiohttp.ClientSession, origin: Agent, node: str) -> str:
    """``node``'s liveness in ``origin``'s ``GET /v1/mesh``; "absent" when it is not listed."""
    async with http.get(f"{origin.url}/v1/mesh") as r:
        doc = await r.json()
    return next((n["liveness"] for n in doc["nodes"] if n["name"] == node), "absent")


async def until_alive(http: aiohttp.ClientSession, pairs: list[tuple[Agent, str]], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            seen = [await liveness(http, a, node) for a, node in pairs]
        except (TimeoutError, aiohttp.ClientError, OSError) as exc:  # an API not up yet
            seen = [repr(exc)]
        if all(s == "alive" for s in seen):
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"not all alive after {timeout_s} s: {seen}")
        await asyncio.sleep(0.05)


async def cut_heal_watch(hosts: Hosts, a: Agent, b: Agent, c: Agent) -> tuple[float, list[tuple[float, str, str]]]:
    """Cut C for ``CUT_S``, heal; returns the seconds until C is alive in A's and B's views,
    and every change of C's liveness there in the ``WATCH_S`` after that (seconds after it,
    observer, liveness)."""
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5)) as http:
        everyone = [(a, "node-b"), (a, "node-c"), (b, "node-a"), (b, "node-c"), (c, "node-a"), (c, "node-b")]
        await until_alive(http, everyone, 60)
        await asyncio.sleep(2)  # the channels are open both ways and carry probes
        hosts.cut(3)
        await asyncio.sleep(CUT_S)
        assert await liveness(http, a, "node-c") != "alive"
        hosts.heal(3)
        healed = time.monotonic()
        await until_alive(http, [(a, "node-c"), (b, "node-c")], BACK_S)
        back = time.monotonic()
        changes: list[tuple[float, str, str]] = []
        last = {a.log.stem: "alive", b.log.stem: "alive"}
        while time.monotonic() - back < WATCH_S:
            for observer in (a, b):
                seen = await liveness(http, observer, "node-c")
                if seen != last[observer.log.stem]:
                    last[observer.log.stem] = seen
                    changes.append((round(time.monotonic() - back, 2), observer.log.stem, seen))
            await asyncio.sleep(0.05)
    return back - healed, changes


def test_a_peer_cut_off_for_8_s_is_alive_again_after_the_heal_and_stays_alive(tmp_path: Path) -> None:
    ok, reason = netns_available()
    require(ok, reason)
    with bridged_hosts(f"vwh{os.getpid() % 10000}", 3) as hosts:
        with agent_on(hosts, 1, tmp_path) as a, agent_on(hosts, 2, tmp_path) as b, agent_on(hosts, 3, tmp_path) as c:
            try:
                back_s, changes = in_netns(hosts.ns(1), lambda: asyncio.run(cut_heal_watch(hosts, a, b, c)), 100)
            except BaseException:
                for agent in (a, b, c):
                    print(f"--- {agent.log.name}\n{agent.log_text()[-2500:]}")
                raise
    print(f"C cut off for {CUT_S} s: alive in A's and B's views {back_s:.2f} s after the heal; "
          f"changes in the {WATCH_S} s after: {changes}")
    assert not changes, f"C flapped after the heal (seconds after it was alive again, observer, liveness): {changes}"
