"""A /health blip on every backend while completions succeed restarts nothing (issue 22, item 5).

One real agent, three fake llama-servers whose /health answers 503 for 3 s
(support/health_blip.py); six clients send completions through the agent meanwhile. With the
report's settings (``health.interval_s`` 1, ``timeout_s`` 1, ``max_failures`` 3) every backend
fails at least 3 probes in a row, and ``supervisor.max_concurrent_respawns`` is 3, so neither
the respawn cap nor luck keeps them up: only the requests that succeeded meanwhile, counted
as good probes (``health.success_counts_as_probe_s``, docs/reliability.md, "Health blips").
"""

from __future__ import annotations

from pathlib import Path

import pytest

from support.health_blip import run_blip

pytestmark = pytest.mark.timeout(90)


def test_a_health_blip_while_completions_succeed_restarts_nothing(tmp_path: Path) -> None:
    result = run_blip(tmp_path, supervisor={"max_concurrent_respawns": 3})
    during = [r for r in result.requests if 0.0 <= r[0] < result.blip_s]
    assert len(during) >= 20, "too few completions were sent during the blip"
    assert result.failed == 0, [r for r in result.requests if r[2] != 200]
    assert result.respawns == {"m-0": 0, "m-1": 0, "m-2": 0}, result.log[-3000:]
    assert set(result.states.values()) == {"healthy"}
    # The blip was seen: every backend's failed probes were contradicted by its requests.
    for backend in ("m-0", "m-1", "m-2"):
        assert f"backend {backend}: probe failed but a request succeeded" in result.log
    assert "probe failed (" not in result.log  # none counted
