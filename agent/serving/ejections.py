"""Outlier ejection on a node: the detector's verdicts acted on (docs/routing.md, "Outlier ejection").

The rules (when a target is ejected, for how long, the half-open probe) are the pure state
machine of agent/serving/outliers.py; this module feeds it the outcomes of the requests this
node sends and carries out what it decides, on the agent's event loop:

- targets: a local backend (key: its ``BackendId``) and a peer for one model (key:
  ``(peer node id, model)``), in one ``OutlierDetector``;
- a local backend's ``Backend.ejected`` follows the detector: set on an ejection (its slots
  leave ``ModelRuntime.capacity()``, so the summary this node publishes no longer offers
  them), cleared when the ejection ends (half-open: its next request is the probe), set again
  while the probe runs, cleared on a restore; each change calls ``ModelRuntime.notify()`` so
  waiting requests route again. Timers (``loop.call_later``) bring the flag back in step when
  an ejection ends or a probe's outcome never came (``probe_timeout_s``);
- a peer's key is read per request (``peer_usable``): the router leaves ejected peers out;
- every ejection is one WARNING line, every restore one INFO line; a local backend ejected
  ``report_after_ejections`` times in a row is reported to the supervisor (``report``), whose
  health ladder respawns it (or keeps it in service: outlier reports never spend a backend's
  last respawn);
- what the request path counts (agent/serving/pipeline.py): a 2xx or 3xx is a success, a 4xx
  nothing (the client's; a half-open probe that ends so is released: ``unjudged``), and a
  failure before the first byte that a retry elsewhere repeated is the request's fault,
  counted against no target (``request_fault``).

With ``enabled`` False nothing is recorded and every target is usable (the behaviour before
issue 22; ``[routing.outliers] enabled = false``).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from viiwork.agent.config.schema import OutliersConfig
from viiwork.agent.serving.outliers import HALF_OPEN, OK, Ejected, OutlierDetector, OutlierSettings, Restored
from viiwork.agent.supervision.backends import Backend, BackendId, ModelRuntime
from viiwork.mesh.identity import NodeId

log = logging.getLogger(__name__)

#: ``report(model, backend_id, reason)``: tell the supervisor a local backend is unhealthy;
#: True when its engine is being replaced (a respawn), False when the report was ignored or
#: declined (the backend stays in service, and ejected).
Report = Callable[[str, BackendId, str], bool]


def outlier_settings(config: OutliersConfig) -> OutlierSettings:
    """The detector's settings from ``[routing.outliers]`` (every key but ``enabled``)."""
    return OutlierSettings(**config.model_dump(exclude={"enabled"}))


class Ejections:
    """This node's outlier ejection (see the module doc).

    ``runtimes``: the node's models by name (read at each use: a reload may replace them);
    ``settings``: the detector's; ``enabled``: False records nothing; ``report``: called
    for a local backend ejected ``report_after_ejections`` times in a row (None: nobody).
    """

    def __init__(self, runtimes: Mapping[str, ModelRuntime], settings: OutlierSettings | None = None, *,
                 enabled: bool = True, report: Report | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.runtimes = runtimes
        self.detector = OutlierDetector(settings)
        self.enabled = enabled
        self.report = report
        self.clock = clock
        self.reports = 0
        self.request_faults = 0
        self._names: dict[NodeId, str] = {}  # peers forwarded to: node id -> name, for status

    @classmethod
    def from_config(cls, runtimes: Mapping[str, ModelRuntime], config: OutliersConfig,
                    report: Report | None = None) -> Ejections:
        return cls(runtimes, outlier_settings(config), enabled=config.enabled, report=report)

    # -- local backends --------------------------------------------------------------------

    def sent(self, backend: Backend) -> bool:
        """A request goes to ``backend`` now: takes its half-open probe (``allow``). True when
        this request is that probe."""
        if not self.enabled:
            return False
        now = self.clock()
        if self.detector.state(backend.id, now) == HALF_OPEN and self.detector.allow(backend.id, now):
            backend.ejected = True  # the probe runs: nothing else until its outcome
            self._later(self.detector.settings.probe_timeout_s, backend)
            return True
        return False

    def unjudged(self, backend: Backend) -> None:
        """The half-open probe sent to ``backend`` ended with nothing to count (a client's 4xx,
        or a failure that was the request's fault): the probe is released, the next request is
        the probe (``OutlierDetector.release``)."""
        if self.enabled:
            self.detector.release(backend.id, self.clock())
            self._sync(backend)

    def request_fault(self) -> None:
        """Count a request that failed before its first byte on two targets or more (a retry
        failed too) or whose retry answered a 4xx: its failures are the request's fault, counted
        against no target (``request_faults_total``)."""
        if self.enabled:
            self.request_faults += 1

    def outcome(self, backend: Backend, ok: bool) -> None:
        """The outcome of a request sent to ``backend``: ``ok`` False for an engine 5xx that is
        not the client's fault, a reset, a timeout (agent/serving/proxy.py, ``Failed``)."""
        if not self.enabled:
            return
        event = self.detector.record(backend.id, ok, self.clock())
        if isinstance(event, Ejected):
            log.warning("backend %s%s", event.message, _consequence(event))
            self._sync(backend)
            self._later(event.ejection_s, backend)
            if event.report_unhealthy and self.report is not None:
                self.reports += 1
                if self.report(backend.model, backend.id, f"ejected {event.in_row} times in a row: {event.reason}"):
                    # The supervisor replaces the engine: the new one gets its probe as soon as it
                    # is healthy, not after the rest of this ejection (the count in a row is kept).
                    self.detector.end_ejection(backend.id, self.clock())
                    self._sync(backend)
        elif isinstance(event, Restored):
            log.info("backend %s", event.message)
            self._sync(backend)

    def _later(self, delay_s: float, backend: Backend) -> None:
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # no loop (a unit test): the next outcome or `sent` syncs it
            return
        loop.call_later(delay_s + 0.001, self._sync, backend)

    def _sync(self, backend: Backend) -> None:
        """``backend.ejected`` from the detector; a change lets waiting requests route again."""
        ejected = not self.detector.usable(backend.id, self.clock())
        if ejected != backend.ejected:
            backend.ejected = ejected
            runtime = self.runtimes.get(backend.model)
            if runtime is not None:
                runtime.notify()

    # -- peers -----------------------------------------------------------------------------

    def peer_usable(self, node_id: NodeId, model: str) -> bool:
        """May a request for ``model`` go to peer ``node_id`` (not ejected in this node's view)?
        Takes no probe: the router filters with it (``peer_sent`` takes the probe)."""
        return not self.enabled or self.detector.usable((node_id, model), self.clock())

    def ejected_peers(self, model: str, node_ids: Iterable[NodeId]) -> frozenset[NodeId]:
        """Those of ``node_ids`` that are not ``peer_usable`` for ``model`` (empty when the
        table is: one dict lookup per peer otherwise)."""
        if not self.enabled or not len(self.detector):
            return frozenset()
        now = self.clock()
        usable = self.detector.usable
        return frozenset(n for n in node_ids if not usable((n, model), now))

    def peer_sent(self, node_id: NodeId, model: str) -> bool:
        """A forward for ``model`` goes to ``node_id`` now: takes its half-open probe. True when
        this forward is that probe."""
        if not self.enabled:
            return False
        key = (node_id, model)
        now = self.clock()
        return self.detector.state(key, now) == HALF_OPEN and self.detector.allow(key, now)

    def peer_unjudged(self, node_id: NodeId, model: str) -> None:
        """A forward to ``node_id`` for ``model`` ended with nothing to count (a refusal, a 4xx,
        a failure that was the request's fault): a half-open probe out there is released."""
        if self.enabled:
            self.detector.release((node_id, model), self.clock())

    def peer_outcome(self, node_id: NodeId, name: str, model: str, ok: bool) -> None:
        """The outcome of a forward to peer ``node_id`` (``name``) for ``model``."""
        if not self.enabled:
            return
        self._names[node_id] = name
        event = self.detector.record((node_id, model), ok, self.clock())
        if isinstance(event, Ejected):
            log.warning("peer %s (%s) for %s ejected for %.1f s (ejection %d in a row): %s; its requests go to "
                        "other nodes (it stays a member)", name, node_id, model, event.ejection_s, event.in_row,
                        event.reason)
        elif isinstance(event, Restored):
            log.info("peer %s (%s) for %s restored after a successful probe", name, node_id, model)

    # -- views -----------------------------------------------------------------------------

    def rows(self) -> list[dict[str, Any]]:
        """The targets that hold state (``OutlierDetector.snapshot``), each with ``kind``
        ("backend" or "peer"), ``model``, and for a peer ``node`` (its name) and ``node_id``."""
        out = []
        for row in self.detector.snapshot(self.clock()):
            text = str(row["key"])
            head, _, rest = text.partition("/")
            if rest and NodeId(head) in self._names:
                out.append({"kind": "peer", "node": self._names[NodeId(head)], "node_id": head, "model": rest, **row})
            else:
                model = next((b.model for rt in self.runtimes.values() for b in rt.backends if b.id == text), "")
                out.append({"kind": "backend", "backend": text, "model": model, **row})
        return out

    def status(self) -> dict[str, Any]:
        """The ``outliers`` section of /v1/status: ``enabled``, ``settings``, ``counters``
        (``OutlierDetector.counters``, ``reports_total``: local backends reported unhealthy, and
        ``request_faults_total``: requests whose failures were their own fault, ``request_fault``)
        and ``targets`` (``rows``)."""
        settings = self.detector.settings
        return {"enabled": self.enabled,
                "settings": {name: getattr(settings, name) for name in settings.__dataclass_fields__},
                "counters": self.counters(), "targets": self.rows()}

    def counters(self) -> dict[str, int]:
        """The counters of /v1/status and /metrics, by name."""
        return {**self.detector.counters(), "reports_total": self.reports,
                "request_faults_total": self.request_faults}

    def peer_state(self, node_id: str, model: str) -> str:
        """"ok", "ejected" or "half-open": peer ``node_id`` for ``model`` in this node's view."""
        return self.detector.state((NodeId(node_id), model), self.clock()) if self.enabled else OK

    def metric_families(self) -> list[CounterMetricFamily | GaugeMetricFamily]:
        """/metrics: the detector's counters and the targets out of routing now, by kind."""
        families: list[CounterMetricFamily | GaugeMetricFamily] = [
            CounterMetricFamily(f"viiwork_outlier_{name}", _HELP[name], value=value)
            for name, value in self.counters().items()]
        out_now = {"backend": 0, "peer": 0}
        for row in self.rows():
            if row["state"] != OK:
                out_now[row["kind"]] += 1
        ejected = GaugeMetricFamily("viiwork_outlier_ejected", "Targets ejected or half-open now, by kind (backend: "
                                    "this node's; peer: a peer for one model, in this node's view).", labels=["kind"])
        for kind, n in out_now.items():
            ejected.add_metric([kind], n)
        families.append(ejected)
        return families


_HELP = {
    "ejections_total": "Outlier ejections (backends and peers).",
    "restores_total": "Ejected targets restored after a successful probe.",
    "probes_total": "Half-open probes let through.",
    "dropped_total": "Targets dropped to keep the outlier table within routing.outliers.max_targets.",
    "reports_total": "Local backends reported unhealthy to the supervisor after repeated ejections.",
    "request_faults_total": "Requests that failed before the first byte on two backends (or whose retry answered "
                            "a 4xx): the request's fault, counted against no backend.",
}


def _consequence(event: Ejected) -> str:
    if event.report_unhealthy:
        return "; reported unhealthy to the supervisor"
    return "; no new requests while another backend can take them"
