"""This node's prefix-aware routing state: the prefix index per model, the models' service
times, and the counters (docs/routing.md, "Prefix-aware routing").

:class:`PrefixRouting` is shared by the pipeline (which asks it for a request's
:class:`~viiwork.agent.serving.scoring.PrefixQuery` before routing, and tells it which local
backend ran a request, forwarded ones included, and how long it took), the mesh link (which
publishes :meth:`PrefixRouting.published` as the ``prefixes`` extension,
agent/peering/prefix_ext.py) and /metrics. Single-threaded (the event loop).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from viiwork.agent.serving.prefixes import (
    BLOCK_BYTES,
    BYTES_PER_TOKEN,
    DEFAULT_INDEX_ENTRIES,
    PrefixIndex,
    PrefixKey,
    Sharing,
    prefix_key,
)
from viiwork.agent.serving.scoring import Guard, PrefixQuery, ServiceTime
from viiwork.agent.supervision.backends import ModelRuntime

MAX_PUBLISHED_PER_MODEL = 64  # digests a model publishes (mesh/extensions.py: MAX_PREFIXES_PER_MODEL)


@dataclass(frozen=True, slots=True)
class PrefixSettings:
    """``routing.prefix_*`` (docs/configuration.md): ``enabled`` (``prefix_routing``),
    ``sharing`` (``prefix_sharing``: "tenant" salts per tenant, "model" shares across tenants),
    ``index_entries`` per model (``prefix_index_entries``), and the balance ``guard``."""

    enabled: bool = True
    sharing: Sharing = "tenant"
    index_entries: int = DEFAULT_INDEX_ENTRIES
    guard: Guard = Guard()

    @classmethod
    def from_config(cls, routing: Any) -> PrefixSettings:
        """From a ``RoutingConfig`` (agent/config/schema.py)."""
        return cls(enabled=routing.prefix_routing, sharing=routing.prefix_sharing,
                   index_entries=routing.prefix_index_entries,
                   guard=Guard(guard_slots=routing.prefix_guard_slots, min_blocks=routing.prefix_min_blocks))


class PrefixRouting:
    """The prefix indexes of this node's models (one :class:`PrefixIndex` each, created on first
    use) and what routing on them counted. ``runtimes``: the supervisor's models (a backend
    whose engine process changed since it served a prefix is forgotten: its cache is gone)."""

    def __init__(self, settings: PrefixSettings, runtimes: Mapping[str, ModelRuntime]) -> None:
        self.settings = settings
        self.runtimes = runtimes
        self._indexes: dict[str, PrefixIndex] = {}
        self._service: dict[str, ServiceTime] = {}
        self._pids: dict[str, int | None] = {}  # backend id -> the engine process that served its prefixes
        self.routes: Counter[tuple[str, str]] = Counter()  # (model, rule) of requests routed here
        self.hit_blocks: Counter[str] = Counter()  # model -> blocks of prompt found cached (routes by prefix)
        self.guarded: Counter[str] = Counter()  # model -> requests whose hit the balance guard declined

    def index(self, model: str) -> PrefixIndex:
        idx = self._indexes.get(model)
        if idx is None:
            idx = self._indexes[model] = PrefixIndex(self.settings.index_entries, MAX_PUBLISHED_PER_MODEL)
        return idx

    def key(self, payload: Mapping[str, Any], model: str, tenant: str) -> PrefixKey | None:
        """The request's prefix (None: prefix routing off, or the body has no prompt)."""
        if not self.settings.enabled:
            return None
        return prefix_key(payload, model, tenant, self.settings.sharing)

    def query(self, model: str, key: PrefixKey | None) -> PrefixQuery | None:
        """What the router scores ``key`` with (None: no key, or not one whole block)."""
        if key is None or not key.digests:
            return None
        self._forget_restarted(model)
        idx = self._indexes.get(model)
        hits = idx.hits(key) if idx is not None else {}
        service = self._service.get(model)
        return PrefixQuery(key.digests, key.prompt_bytes, hits, service.value_s if service is not None else 1.0,
                           self.settings.guard)

    def local_hit(self, model: str, key: PrefixKey | None, free: Iterable[tuple[str, int]]) -> tuple[str, int] | None:
        """Among local backends ``free`` ((id, busy slots) of those with a free slot), the one
        holding most of ``key`` and its blocks, within the balance guard: at most
        ``guard_slots`` busier than the least busy of them (None: none such holds
        ``min_blocks``): a forwarded request's backend."""
        if key is None or not key.digests or model not in self._indexes:
            return None
        self._forget_restarted(model)
        candidates = list(free)
        if not candidates:
            return None
        least = min(busy for _, busy in candidates)
        guard = self.settings.guard
        hits = self._indexes[model].hits(key)
        best = max(((hits[b], b) for b, busy in candidates
                    if b in hits and hits[b] >= guard.min_blocks and busy - least <= guard.guard_slots), default=None)
        return None if best is None else (best[1], best[0])

    def served(self, model: str, backend_id: str, key: PrefixKey | None) -> None:
        """A request with ``key`` was given to local backend ``backend_id``."""
        if key is None or not key.digests:
            return
        runtime = self.runtimes.get(model)
        if runtime is not None:
            backend = next((b for b in runtime.backends if b.id == backend_id), None)
            if backend is not None:
                self._pids[backend_id] = backend.pid
        self.index(model).served(backend_id, key)

    def ended(self, model: str, seconds: float) -> None:
        """A request of ``model`` ran here for ``seconds`` (its service time)."""
        service = self._service.get(model)
        if service is None:
            service = self._service[model] = ServiceTime()
        service.add(seconds)

    def routed(self, model: str, route: str) -> None:
        """Count a request routed by ``route`` (the X-Viiwork-Route rule)."""
        rule, _, rest = route.partition(" ")
        self.routes[(model, rule)] += 1
        if rule == "prefix-hit" and rest.startswith("blocks="):
            self.hit_blocks[model] += int(rest[len("blocks="):])
        elif rest.startswith("guarded="):
            self.guarded[model] += 1

    def published(self) -> dict[str, tuple[str, ...]]:
        """Per model, the digests to publish (most recent last; models with none left out)."""
        return {model: tuple(idx.recent)
                for model, idx in sorted(self._indexes.items()) if idx.recent}

    def version(self) -> tuple[tuple[str, int], ...]:
        """Changes whenever :meth:`published` may have."""
        return tuple((m, idx.version) for m, idx in sorted(self._indexes.items()))

    def models(self) -> set[str]:
        """The models with an index or a counted route."""
        return set(self._indexes) | {model for model, _ in self.routes} | set(self.hit_blocks) | set(self.guarded)

    def forget_model(self, model: str) -> None:
        """Drop ``model``'s index, service time and counters (it left the config and the mesh)."""
        idx = self._indexes.pop(model, None)
        if idx is not None:
            for backend in {b for held in idx._entries.values() for b in held}:
                self._pids.pop(backend, None)
        self._service.pop(model, None)
        self.hit_blocks.pop(model, None)
        self.guarded.pop(model, None)
        for key in [k for k in self.routes if k[0] == model]:
            del self.routes[key]

    def _forget_restarted(self, model: str) -> None:
        runtime = self.runtimes.get(model)
        idx = self._indexes.get(model)
        if runtime is None or idx is None:
            return
        gone = [b.id for b in runtime.backends if b.id in self._pids and self._pids[b.id] != b.pid]
        if gone:
            idx.forget(gone)
            for b in gone:
                del self._pids[b]

    def metric_families(self) -> Iterator[CounterMetricFamily | GaugeMetricFamily]:
        """``viiwork_routes_total{model,route}``, ``viiwork_prefix_hit_blocks_total{model}``,
        ``viiwork_prefix_hit_tokens_total{model}`` (blocks x 256, an estimate; the engines' own
        count is ``viiwork_usage_tokens_total{kind="cached"}``), ``viiwork_prefix_guard_declines_total{model}``,
        ``viiwork_prefix_index_entries{model}``
        and ``viiwork_prefix_index_evictions_total{model}`` (docs/metrics.md)."""
        routes = CounterMetricFamily("viiwork_routes", "Requests this node routed, by the rule that decided "
                                     "(X-Viiwork-Route).", labels=["model", "route"])
        for (model, rule), n in sorted(self.routes.items()):
            routes.add_metric([model, rule], n)
        yield routes
        blocks = CounterMetricFamily("viiwork_prefix_hit_blocks", "Prompt blocks (1 KiB) found cached on the "
                                     "backend a request was routed to by prefix.", labels=["model"])
        tokens = CounterMetricFamily("viiwork_prefix_hit_tokens", "Estimated cached prompt tokens of requests "
                                     "routed by prefix (blocks x 256).", labels=["model"])
        for model, n in sorted(self.hit_blocks.items()):
            blocks.add_metric([model], n)
            tokens.add_metric([model], n * BLOCK_BYTES // BYTES_PER_TOKEN)
        yield from (blocks, tokens)
        guarded = CounterMetricFamily("viiwork_prefix_guard_declines", "Requests whose prefix hit the balance "
                                      "guard declined (routing.prefix_guard_slots): routed least-loaded.",
                                      labels=["model"])
        for model, n in sorted(self.guarded.items()):
            guarded.add_metric([model], n)
        yield guarded
        entries = GaugeMetricFamily("viiwork_prefix_index_entries", "Digests in the prefix index.", labels=["model"])
        evicted = CounterMetricFamily("viiwork_prefix_index_evictions", "Digests evicted from the prefix index "
                                      "(its budget, routing.prefix_index_entries).", labels=["model"])
        for model, idx in sorted(self._indexes.items()):
            entries.add_metric([model], len(idx))
            evicted.add_metric([model], idx.evicted)
        yield from (entries, evicted)


__all__ = ["PrefixRouting", "PrefixSettings"]
