"""The /metrics usage counters (agent/serving/accounting.py): bounded tenant labels (docs/metrics.md)."""

from __future__ import annotations

from viiwork.agent.serving.accounting import MAX_TENANT_LABELS, Accounting
from viiwork.agent.serving.tokens import Usage


async def test_tenants_beyond_the_bound_share_one_label() -> None:
    accounting = Accounting(None, lambda: "node-x")
    for i in range(MAX_TENANT_LABELS + 20):
        end = accounting.end_of(request_id=f"r{i}", tenant=f"t{i:03d}", jti=f"k{i}", model="m", origin_node="",
                                queued_s=0.0, arrived=0.0)
        await end(200, Usage(3, 2, None), None)
    await accounting.end_of(request_id="nokey", tenant="", jti="", model="m", origin_node="", queued_s=None,
                            arrived=0.0)(500, None, None)
    requests, tokens = accounting.metric_families()
    tenants = {s.labels["tenant"] for s in requests.samples}
    assert len(tenants) == MAX_TENANT_LABELS + 2  # the first 100, "_other" and "-" (no key)
    other = [s.value for s in requests.samples if s.labels["tenant"] == "_other"]
    assert other == [20]
    assert [s.labels["status"] for s in requests.samples if s.labels["tenant"] == "-"] == ["5xx"]
    prompt = sum(s.value for s in tokens.samples if s.labels["kind"] == "prompt")
    assert prompt == 3 * (MAX_TENANT_LABELS + 20)  # every row's tokens, whatever its label
    assert not [s for s in tokens.samples if s.labels["kind"] == "cached"]  # unknown counts add nothing
