"""Two real agents with ``[mesh] detector = "probe"`` (issue 16): A has no model, B serves
``only-b`` with a fake llama-server. In probe mode a summary is re-signed only on change, so
B's may be far older than ``routing.stale_after_ms``: the router's rule is liveness, and A
still forwards to B (docs/mesh.md, "Probe mode").
"""

from __future__ import annotations

import time
from contextlib import ExitStack
from pathlib import Path

import aiohttp
import pytest

from support.agent import run_agent
from support.engines import fake_engine_binary

pytestmark = pytest.mark.timeout(120)

STALE_AFTER_MS = 300


def mesh_section(seeds: list[str]) -> dict:
    return {"trust": "open", "mesh_id": "probe-agents", "listen": "127.0.0.1:0", "advertise": "127.0.0.1",
            "discovery": ["seeds"], "seeds": seeds, "gossip_interval_ms": 100, "detector": "probe"}


async def test_an_agent_forwards_to_a_probe_mode_peer_whose_summary_is_old(tmp_path: Path) -> None:
    binary = fake_engine_binary(tmp_path / "bin")
    routing = {"stale_after_ms": STALE_AFTER_MS}
    with ExitStack() as stack:
        b = stack.enter_context(run_agent(
            tmp_path, [{"name": "only-b", "engine": "llamacpp", "path": "/dev/null", "parallel": 1, "backends": 1,
                        "llamacpp": {"binary": str(binary)}}],
            name="node-b", extra={"mesh": mesh_section([]), "routing": routing}))
        b.wait_healthy("only-b", timeout_s=30)
        seed = b.wait_for(lambda d: bool(d["mesh"]["self"]["mesh"]), 30, "b's mesh address")["mesh"]["self"]["mesh"]
        a = stack.enter_context(run_agent(tmp_path, [], name="node-a",
                                          extra={"mesh": mesh_section([seed]), "routing": routing}))
        a.wait_for(lambda d: d["mesh"]["peers"].get("alive", 0) == 1, 30, "b alive at a")
        a.wait_for(lambda d: d["mesh"]["counters"]["probe"]["detector_probes"] >= 2, 10, "a probing b")
        time.sleep(3 * STALE_AFTER_MS / 1000)  # b publishes nothing new meanwhile: its summary ages
        published = b.status()["mesh"]["counters"]["summaries_published"]
        async with aiohttp.ClientSession() as http:
            for _ in range(2):
                body = {"model": "only-b", "messages": [{"role": "user", "content": "hi"}]}
                async with http.post(f"{a.url}/v1/chat/completions", json=body) as r:
                    assert r.status == 200, await r.text()
                    assert r.headers["X-Viiwork-Node"] == "node-b"
                    await r.read()
        # Change-only: the few summaries b signed are its load changes, not one per round.
        assert published <= 8, published
        # gossip_interval_ms is set in probe mode: one warning at start names what replaced it.
        for agent in (a, b):
            lines = [ln for ln in agent.log_text().splitlines() if 'deprecated with detector = "probe"' in ln]
            assert len(lines) == 1, agent.log_text()[-3000:]
            assert "WARNING" in lines[0] and "gossip is no longer paced by gossip_interval_ms" in lines[0]
