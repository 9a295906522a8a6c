"""The rows of the requests this node's engines answered, and their per-tenant counters (docs/usage.md).

Issue 17, item 8: the serving node records every request that ran on one of its backends, for
its own client or forwarded by a peer (``origin_node``), once: the origin of a forwarded
request records nothing, so each request has one row in the mesh, on the node that served it.
:meth:`Accounting.end_of` gives the request path (``Upstream.forward``, agent/serving/proxy.py)
a :class:`RequestEnd`, which it awaits before it reports the end: the last byte of a whole
answer, a stream's ``[DONE]`` (held back until then: ``StreamTail``) or its terminal error
event. ``await`` returns once the row is committed (``Ledger.record``), or held in the
ledger's backlog when the disk refuses it.

What is a row and what is not (docs/usage.md, "Which requests are rows"): an answer of this
node's engine that reached the client (any status, a stream broken after its first byte
included, with the status of its terminal error event); a stream whose client went away
(status 499, recorded without delaying anything). Not a row: the agent's own refusals before
any engine ran (401/403/429 of keys and limits, 404, a full queue), and a failure before the
first byte (``Failed``: the request runs again elsewhere, where it gets its row).

The counters for /metrics are kept here too, per row, so /metrics and the ledger count the
same requests; their label sets are bounded (:data:`MAX_TENANT_LABELS`).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from prometheus_client.core import CounterMetricFamily

from viiwork.agent.serving.tokens import Usage
from viiwork.agent.usage.ledger import Ledger, LedgerClosed
from viiwork.agent.usage.store import UsageRow

log = logging.getLogger(__name__)

#: Distinct tenants with series of their own on /metrics; the rest share ``tenant="_other"``.
MAX_TENANT_LABELS = 100
OTHER_TENANT = "_other"
#: The tenant label of a request without a client key (``[auth] mode = "none"``).
NO_TENANT = "-"
#: The status of a row whose client went away before its stream ended (nginx's convention).
CLIENT_GONE = 499


@dataclass(slots=True)
class RequestEnd:
    """One request's row, completed when its answer ends (``__call__``). Times are loop times
    (s): ``arrived`` when this node got the request; ``queued_ms`` the wait before dispatch
    (at the origin, for a forwarded request)."""

    accounting: Accounting
    request_id: str
    tenant: str
    jti: str
    model: str
    origin_node: str
    queued_ms: float
    arrived: float

    async def __call__(self, status: int, usage: Usage | None, first_chunk_at: float | None) -> None:
        """Record the row (``status`` the client got, the engine's ``usage``, the loop time of
        a stream's first chunk, None for a whole answer); returns once it is committed (or
        backlogged). Never raises, except CancelledError (the row is committed regardless)."""
        await self.accounting.record(self._row(status, usage, first_chunk_at))

    def soon(self, status: int, usage: Usage | None, first_chunk_at: float | None) -> None:
        """Record the row without waiting for it (a client that went away: nothing waits)."""
        self.accounting.record_soon(self._row(status, usage, first_chunk_at))

    def _row(self, status: int, usage: Usage | None, first_chunk_at: float | None) -> UsageRow:
        now = asyncio.get_running_loop().time()
        # A forwarded request waited in the origin's queue before it arrived here; a local
        # request's wait is part of its time since arrival.
        before = self.queued_ms if self.origin_node else 0.0
        return UsageRow(
            finished_at_ms=int(time.time() * 1000), request_id=self.request_id, tenant=self.tenant, jti=self.jti,
            model=self.model, origin_node=self.origin_node, serving_node=self.accounting.serving_node(),
            prompt_tokens=usage.prompt_tokens if usage else None,
            completion_tokens=usage.completion_tokens if usage else None,
            cached_tokens=usage.cached_tokens if usage else None, status=status,
            queued_ms=round(self.queued_ms, 3),
            ttft_ms=None if first_chunk_at is None else round((first_chunk_at - self.arrived) * 1000 + before, 3),
            duration_ms=round((now - self.arrived) * 1000 + before, 3))


class Accounting:
    """Rows (``ledger``; None: none are written, the counters still count) and counters of the
    requests this node served. ``serving_node`` names this node in its rows: its node id in a
    mesh (known once the mesh has started: read per row), else its name."""

    def __init__(self, ledger: Ledger | None, serving_node: Callable[[], str]) -> None:
        self.ledger = ledger
        self._serving_node = serving_node
        self.requests: Counter[tuple[str, str, str]] = Counter()  # (tenant, model, status class)
        self.tokens: Counter[tuple[str, str, str]] = Counter()  # (tenant, model, prompt|completion|cached)
        self.record_errors = 0
        self._tenants: set[str] = set()
        self._pending: set[asyncio.Task[None]] = set()

    def serving_node(self) -> str:
        return self._serving_node()

    def end_of(self, *, request_id: str, tenant: str, jti: str, model: str, origin_node: str,
               queued_s: float | None, arrived: float) -> RequestEnd:
        """The row of a request about to run on this node's backend."""
        return RequestEnd(self, request_id, tenant, jti, model, origin_node,
                          max(0.0, (queued_s or 0.0) * 1000), arrived)

    async def record(self, row: UsageRow) -> None:
        self._count(row)
        if self.ledger is None:
            return
        try:
            await self.ledger.record(row)
        except (LedgerClosed, TypeError) as exc:  # stopped (a request that outlived the drain), or a bad row
            self.record_errors += 1
            log.warning("usage row of request %s not recorded: %s", row.request_id, exc)

    def record_soon(self, row: UsageRow) -> None:
        task = asyncio.get_running_loop().create_task(self.record(row))
        self._pending.add(task)
        task.add_done_callback(self._pending.discard)

    def _tenant_label(self, tenant: str) -> str:
        if not tenant:
            return NO_TENANT
        if tenant in self._tenants:
            return tenant
        if len(self._tenants) < MAX_TENANT_LABELS:
            self._tenants.add(tenant)
            return tenant
        return OTHER_TENANT

    def _count(self, row: UsageRow) -> None:
        tenant = self._tenant_label(row.tenant)
        self.requests[(tenant, row.model, f"{row.status // 100}xx")] += 1
        for kind, value in (("prompt", row.prompt_tokens), ("completion", row.completion_tokens),
                            ("cached", row.cached_tokens)):
            if value:
                self.tokens[(tenant, row.model, kind)] += value

    def forget_model(self, model: str) -> None:
        """Drop ``model``'s usage series (a model that left: ``ClientApi.sync_models``); the
        ledger's rows stay."""
        for counter in (self.requests, self.tokens):
            for key in [k for k in counter if k[1] == model]:
                del counter[key]

    def metric_families(self) -> Iterable[CounterMetricFamily]:
        """``viiwork_usage_requests_total{tenant,model,status}`` (status: ``2xx``, ``4xx``, ``5xx``)
        and ``viiwork_usage_tokens_total{tenant,model,kind}`` (kind: prompt, completion, cached):
        the requests this node served, as its ledger counts them (docs/metrics.md)."""
        requests = CounterMetricFamily("viiwork_usage_requests", "Requests this node's engines answered, by "
                                       "tenant, model and status class (the usage ledger's rows).",
                                       labels=["tenant", "model", "status"])
        for labels, n in sorted(self.requests.items()):
            requests.add_metric(list(labels), n)
        tokens = CounterMetricFamily("viiwork_usage_tokens", "Tokens of the requests this node's engines "
                                     "answered, as the engines counted them, by tenant, model and kind.",
                                     labels=["tenant", "model", "kind"])
        for labels, n in sorted(self.tokens.items()):
            tokens.add_metric(list(labels), n)
        return [requests, tokens]
