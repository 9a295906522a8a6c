"""One capacity view (``ModelRuntime.capacity``): /v1/status and the gossiped summary agree.

A real agent with a [mesh] runs a fake llama-server whose ``/slots`` fails after a while
(``FAKE_SLOTS_FAIL_AFTER_S``) while its health stays ok: the load reading goes stale, and an
engine figure read before that (``waiting`` from ``llamacpp:requests_deferred``) is no longer
fact. Both the node's own status and the summary it signs and gossips (its ``/v1/mesh`` self
entry) must drop it (``waiting`` null, slots back to ``parallel``).
"""

from __future__ import annotations

import json
import urllib.request
from pathlib import Path
from typing import Any

from support.agent import Agent, run_agent
from support.engines import fake_engine_binary

GOSSIP_MS = 100


def published(agent: Agent) -> dict[str, Any] | None:
    """``m`` in the summary this node publishes (the one peers receive), or None."""
    with urllib.request.urlopen(f"{agent.url}/v1/mesh", timeout=5) as r:
        doc = json.load(r)
    own = doc.get("self") or {}
    return next((m for m in own.get("models", []) if m["name"] == "m"), None)


def wait_published(agent: Agent, predicate: Any, timeout_s: float, what: str) -> dict[str, Any]:
    last: dict[str, Any] | None = None

    def ok(_: dict) -> bool:
        nonlocal last
        last = published(agent)
        return last is not None and predicate(last)

    try:
        agent.wait_for(ok, timeout_s, what)
    except AssertionError as exc:
        raise AssertionError(f"{what}: last published {json.dumps(last)}") from exc
    assert last is not None
    return last


def test_stale_load_reading_is_left_out_of_status_and_gossip_alike(tmp_path: Path) -> None:
    binary = fake_engine_binary(tmp_path / "bin")
    model = {"name": "m", "engine": "llamacpp", "path": "/dev/null", "parallel": 2, "backends": 1,
             "llamacpp": {"binary": str(binary)},
             "env": {"FAKE_LOAD_S": "0.1", "FAKE_SLOTS_FAIL_AFTER_S": "3.0"}}
    mesh = {"trust": "open", "mesh_id": "capacity-view", "listen": "127.0.0.1:0", "advertise": "127.0.0.1",
            "discovery": ["seeds"], "seeds": [], "gossip_interval_ms": GOSSIP_MS}
    extra = {"health": {"interval_s": 0.2}, "mesh": mesh,
             "supervisor": {"load_poll_interval_s": 0.1, "load_stale_after_s": 0.5}}
    with run_agent(tmp_path, [model], name="node-a", extra=extra) as agent:
        agent.wait_healthy("m", timeout_s=30)
        # While the engine answers /slots, its queue (0) is known and published.
        fresh = wait_published(agent, lambda m: m["waiting"] == 0, 10, "a fresh waiting published")
        assert agent.model("m")["waiting"] == 0
        assert fresh["slots"] == 2
        # /slots fails from 3 s after the engine's start: 0.5 s later the reading is stale.
        agent.wait_for(lambda d: d["models"][0]["backends"][0]["load_stale"], 15, "load stale")
        status = agent.model("m")
        assert status["waiting"] is None and status["slots"] == 2, status
        gossiped = wait_published(agent, lambda m: m["waiting"] is None, 5, "the stale waiting left out")
        assert (gossiped["slots"], gossiped["busy"], gossiped["healthy"]) == (2, 0, 1)
        assert agent.model("m")["backends"][0]["load_stale"]  # still stale: the view, not a fresh read
