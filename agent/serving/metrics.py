"""/metrics through prometheus-client: one registry per ClientApi, read at scrape time.

Nothing here counts: the counters live where they are counted (ClientApi.responses, the
runtimes, the mesh link, Ejections, the listener's guard, the protocol log), and the
collectors turn them into metric families when Prometheus scrapes, so nothing is counted
twice. The per-model histograms (:class:`RequestHistograms`) are the exception: they are an
observer of ``agent/serving/observe.py`` and hold their own buckets. The names (docs/metrics.md)
follow Prometheus' conventions: ``_total`` counters, base units (``_seconds``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, InfoMetricFamily
from prometheus_client.exposition import choose_encoder
from prometheus_client.registry import Collector

from viiwork import __version__

if TYPE_CHECKING:
    from viiwork.agent.serving.api import ClientApi

# A source of more families (the listener's connection counters, malformed requests).
MetricSource = Callable[[], Iterable[GaugeMetricFamily | CounterMetricFamily]]

# Bucket bounds (s). Queue time: a free slot answers in well under a millisecond, a full
# queue waits up to api.queue_timeout_s (30 s by default). TTFT and duration: a small model's
# first token in tens of milliseconds up to a long prompt's minutes.
QUEUE_BUCKETS_S = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
TTFT_BUCKETS_S = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
DURATION_BUCKETS_S = (0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)


class RequestHistograms:
    """Per-model histograms of queue time, time to first token and request duration (s),
    an observer of ClientApi (agent/serving/observe.py): every answer's duration, the queue
    time of those dispatched, the time to first token of those below 400."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.queue = Histogram("viiwork_request_queue_seconds", "Seconds from admission to dispatch to a backend "
                               "or peer, per model (requests that were dispatched).", ["model"],
                               registry=registry, buckets=QUEUE_BUCKETS_S)
        self.ttft = Histogram("viiwork_time_to_first_token_seconds", "Seconds to the first chunk of a streamed "
                              "answer (the whole answer when not streamed), per model (answers below 400).",
                              ["model"], registry=registry, buckets=TTFT_BUCKETS_S)
        self.duration = Histogram("viiwork_request_duration_seconds", "Seconds from the request's arrival to "
                                  "the end of its answer, per model (every answer).", ["model"],
                                  registry=registry, buckets=DURATION_BUCKETS_S)
        # model -> its three children: one dict lookup per request instead of three labels() calls.
        self._children: dict[str, tuple[Histogram, Histogram, Histogram]] = {}

    def observe(self, model: str, status: int, queued_s: float | None, ttft_s: float, duration_s: float,
                error: str | None = None) -> None:
        children = self._children.get(model)
        if children is None:
            children = self._children[model] = (self.queue.labels(model), self.ttft.labels(model),
                                                self.duration.labels(model))
        queue, ttft, duration = children
        duration.observe(duration_s)
        if queued_s is not None:
            queue.observe(queued_s)
        if status < 400:  # an error answer carries no token (the dashboard's TTFT counts the same set)
            ttft.observe(ttft_s)

    def models(self) -> list[str]:
        """The model labels that have series now."""
        return sorted(self._children)

    def remove(self, model: str) -> None:
        """Drop ``model``'s series from the three histograms (a model that left the config:
        ``ClientApi.sync_models``); nothing when it has none."""
        if self._children.pop(model, None) is not None:
            for histogram in (self.queue, self.ttft, self.duration):
                histogram.remove(model)


class ApiCollector(Collector):
    """The client API's own families, read from ``api`` at each scrape."""

    def __init__(self, api: ClientApi) -> None:
        self.api = api

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily | InfoMetricFamily]:
        api = self.api
        info = InfoMetricFamily("viiwork_node", "This node's name and agent version.")
        info.add_metric([], {"node": api.node_name, "version": __version__})
        yield info
        yield GaugeMetricFamily("viiwork_draining", "1 while the node drains or stops (new requests get 503).",
                                value=int(api.draining or api.stopping))
        responses = CounterMetricFamily("viiwork_responses", "Client API responses by model and status code.",
                                        labels=["model", "code"])
        for (model, status), n in sorted(api.responses.items()):
            responses.add_metric([model, str(status)], n)
        yield responses
        slots = GaugeMetricFamily("viiwork_model_slots", "Slots of healthy backends.", labels=["model"])
        in_flight = GaugeMetricFamily("viiwork_model_in_flight", "Requests running on this node's backends.",
                                      labels=["model"])
        queued = GaugeMetricFamily("viiwork_model_queued", "Requests waiting in this node's queue.", labels=["model"])
        respawns = CounterMetricFamily("viiwork_backend_respawns", "Respawns per backend.",
                                       labels=["model", "backend"])
        for name, rt in sorted(api.runtimes.items()):
            capacity = rt.capacity()
            slots.add_metric([name], capacity.slots)
            in_flight.add_metric([name], capacity.in_flight)
            queued.add_metric([name], api.queues.queued(name))
            for b in rt.backends:
                respawns.add_metric([name, b.id], b.respawns)
        yield from (slots, in_flight, queued, respawns)
        if api.mesh is not None:
            offers = CounterMetricFamily("viiwork_mesh_offers", "Slot offer events by kind (docs/routing.md, "
                                         "Slot offers).", labels=["event"])
            for event, n in sorted(api.mesh.offer_counters.items()):
                offers.add_metric([event], n)
            yield offers
            yield GaugeMetricFamily("viiwork_mesh_slots_held", "Local slots kept for an offer now.",
                                    value=len(api.mesh.holds))
        yield from api.ejections.metric_families()
        yield CounterMetricFamily("viiwork_retries", "Requests run again on another backend after a failure "
                                  "before the first byte.", value=api.pipeline.retries)
        for source in api.metric_sources:
            yield from source()


def build_registry(api: ClientApi) -> tuple[CollectorRegistry, RequestHistograms]:
    """A registry of its own for ``api`` (never prometheus-client's process-wide default):
    the API's collector, and its request histograms, which it returns subscribed to
    ``api.observers``."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(ApiCollector(api))
    histograms = RequestHistograms(registry)
    api.observers.observers.append(histograms)
    return registry, histograms


def exposition(registry: CollectorRegistry, accept: str | None) -> tuple[bytes, str]:
    """The registry's text and its content type, as the scraper's ``Accept`` header asks
    (the Prometheus text format 0.0.4 by default, OpenMetrics when asked)."""
    encoder, content_type = choose_encoder(accept or "")
    return encoder(registry), content_type
