"""The read-only dashboard at ``/ui`` on the client API (docs/dashboard.md).

Routes: ``GET /ui`` (the page), ``/ui/static/{name}`` (its script, style sheet and the
vendored uPlot, read once from the package's ``ui/`` folder), ``/ui/api/state`` (the JSON the
page polls every 1.5 s). The state is a projection of ``/v1/status`` and ``/v1/mesh``
(nodes, liveness, version, GPUs, models with backends and slots, queue) plus this node's
:class:`RequestStats`: a 15-minute ring of 10-second buckets and its last errors. Backend
``reason`` strings and engine logs are left out (they can hold prompt text).

Every answer carries ``Content-Security-Policy: default-src 'self'; frame-ancestors 'none'``
and ``X-Content-Type-Options: nosniff``. The Host and Origin checks against DNS rebinding and
cross-site requests are the whole client API's (agent/serving/browser_guard.py, a middleware):
a rebinding page in the operator's browser cannot read the dashboard.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from importlib import resources
from typing import Any

from aiohttp import web

from viiwork.agent.serving.browser_guard import SECURITY_HEADERS

BUCKET_S = 10
WINDOW_S = 900
ERRORS_KEPT = 50
MESSAGE_MAX = 200


#: URL name -> (file under ui/, content type).
STATIC = {
    "dashboard.js": ("dashboard.js", "text/javascript"),
    "dashboard.css": ("dashboard.css", "text/css"),
    "uPlot.iife.min.js": ("vendor/uplot/uPlot.iife.min.js", "text/javascript"),
    "uPlot.min.css": ("vendor/uplot/uPlot.min.css", "text/css"),
    "uPlot-LICENSE": ("vendor/uplot/LICENSE", "text/plain"),
}


@dataclass(slots=True)
class _Bucket:
    index: int = -1  # unix time // BUCKET_S; -1: never used
    requests: int = 0
    errors: int = 0
    queued: int = 0  # requests with a queue time
    queued_sum_s: float = 0.0
    queued_max_s: float = 0.0
    ttft: int = 0  # requests with a time to first token (answers below 400)
    ttft_sum_s: float = 0.0
    ttft_max_s: float = 0.0

    def reset(self, index: int) -> None:
        """Reuse this bucket for ``index``, empty (in place: no allocation as the ring turns)."""
        self.index = index
        self.requests = self.errors = self.queued = self.ttft = 0
        self.queued_sum_s = self.queued_max_s = self.ttft_sum_s = self.ttft_max_s = 0.0


class RequestStats:
    """This node's answered requests over the last :data:`WINDOW_S` seconds, in buckets of
    :data:`BUCKET_S` s (wall clock: the chart's time axis), and its last :data:`ERRORS_KEPT`
    errors. An observer of agent/serving/observe.py; ``clock`` returns unix seconds."""

    def __init__(self, clock: Callable[[], float] = time.time) -> None:
        self.clock = clock
        self._ring = [_Bucket() for _ in range(WINDOW_S // BUCKET_S)]
        self.errors: deque[dict[str, Any]] = deque(maxlen=ERRORS_KEPT)

    def observe(self, model: str, status: int, queued_s: float | None, ttft_s: float, duration_s: float,
                error: str | None = None) -> None:
        now = self.clock()
        index = int(now // BUCKET_S)
        bucket = self._ring[index % len(self._ring)]
        if bucket.index != index:
            bucket.reset(index)
        bucket.requests += 1
        if queued_s is not None:
            bucket.queued += 1
            bucket.queued_sum_s += queued_s
            bucket.queued_max_s = max(bucket.queued_max_s, queued_s)
        if status < 400:  # the same set as viiwork_time_to_first_token_seconds: an error carries no token
            bucket.ttft += 1
            bucket.ttft_sum_s += ttft_s
            bucket.ttft_max_s = max(bucket.ttft_max_s, ttft_s)
        if error is not None or status >= 500:
            bucket.errors += 1
            self.errors.append({"time": now, "model": model, "status": status,
                                "message": (error or f"status {status}")[:MESSAGE_MAX]})

    def buckets(self) -> list[dict[str, Any]]:
        """The window's buckets, oldest first, each ``{"t": start (unix s), "requests",
        "errors", "rate_per_s", "queued_ms_avg", "queued_ms_max", "ttft_ms_avg", "ttft_ms_max"}``
        (averages null without requests; the TTFT figures over answers below 400 only, as the
        Prometheus histogram); empty buckets included, so the chart's axis is whole."""
        last = int(self.clock() // BUCKET_S)
        out = []
        for index in range(last - len(self._ring) + 1, last + 1):
            b = self._ring[index % len(self._ring)]
            if b.index != index:
                b = _Bucket(index)
            out.append({
                "t": index * BUCKET_S, "requests": b.requests, "errors": b.errors,
                "rate_per_s": b.requests / BUCKET_S,
                "queued_ms_avg": round(b.queued_sum_s / b.queued * 1000, 1) if b.queued else None,
                "queued_ms_max": round(b.queued_max_s * 1000, 1),
                "ttft_ms_avg": round(b.ttft_sum_s / b.ttft * 1000, 1) if b.ttft else None,
                "ttft_ms_max": round(b.ttft_max_s * 1000, 1),
            })
        return out


class Dashboard:
    """The ``/ui`` routes. ``status``: this node's /v1/status document; ``mesh``: its /v1/mesh
    document, or None on a standalone node; ``stats``: the request observer it charts."""

    def __init__(self, *, status: Callable[[], dict[str, Any]], mesh: Callable[[], dict[str, Any] | None],
                 stats: RequestStats) -> None:
        self.status = status
        self.mesh = mesh
        self.stats = stats
        folder = resources.files("viiwork.agent.serving") / "ui"
        self.page = (folder / "index.html").read_bytes()
        self.files = {name: ((folder / path).read_bytes(), ctype) for name, (path, ctype) in STATIC.items()}

    def add_routes(self, app: web.Application) -> None:
        for path, handler in (("/ui", self.handle_page), ("/ui/", self.handle_page),
                              ("/ui/static/{name}", self.handle_static), ("/ui/api/state", self.handle_state)):
            app.router.add_get(path, handler)

    async def handle_page(self, request: web.Request) -> web.Response:
        return _answer(self.page, "text/html")

    async def handle_static(self, request: web.Request) -> web.Response:
        found = self.files.get(request.match_info["name"])
        if found is None:
            return _answer(b"no such file\n", "text/plain", status=404)
        return _answer(*found)

    async def handle_state(self, request: web.Request) -> web.Response:
        response = web.json_response(self.state())
        response.headers.update(SECURITY_HEADERS)
        return response

    def state(self) -> dict[str, Any]:
        """``{"node": {name, version, draining, stopping, in_flight, uptime_s}, "standalone": bool,
        "nodes": [{"name", "self", "api", "liveness", "state", "version", "age_ms", "gpus": [{"index",
        "name", "memory_total_mib", "memory_free_mib"}], "models": [{"name", "kind", "engine", "slots",
        "busy", "waiting", "healthy", "total", "speed": {"prefill_tps", "decode_tps"} (tokens/s, each null when
        unknown) or null, "queued"?, "backends"?: [{"id", "state", "phase", "slots",
        "busy", "in_flight", "ejected", "respawns"}]}]}], "buckets": RequestStats.buckets(),
        "bucket_s", "errors": newest first}``."""
        status = self.status()
        mesh = self.mesh()
        own_models = []
        for m in status.get("models", []):
            backends = [{k: b.get(k) for k in ("id", "state", "phase", "slots", "busy", "in_flight", "ejected",
                                                "respawns")} for b in m.get("backends", [])]
            own_models.append({
                "name": m.get("name"), "kind": m.get("kind"), "engine": m.get("engine"), "slots": m.get("slots"),
                "busy": m.get("busy"), "waiting": m.get("waiting"), "queued": m.get("queued"), "speed": m.get("speed"),
                "healthy": sum(b["state"] == "healthy" for b in backends), "total": len(backends),
                "backends": backends,
            })
        node = status.get("node", {})
        me = (mesh or {}).get("self") or {}
        gpus = me.get("gpus") or [
            {"index": g.get("index"), "name": g.get("name"), "memory_total_mib": g.get("memory_total_mib"),
             "memory_free_mib": g.get("memory_free_mib")}
            for g in (status.get("gpus") or {}).get("gpus", []) if isinstance(g, dict)]
        nodes = [{"name": node.get("name"), "self": True, "api": me.get("api"), "liveness": "self",
                  "state": "draining" if node.get("draining") else me.get("state", "serving"),
                  "version": node.get("version"), "age_ms": 0, "gpus": gpus, "models": own_models}]
        for p in (mesh or {}).get("nodes", []):
            nodes.append({
                "name": p.get("name"), "self": False, "api": p.get("api"), "liveness": p.get("liveness"),
                "state": p.get("state"), "version": p.get("version"), "age_ms": p.get("age_ms"),
                "gpus": p.get("gpus", []),
                "models": [{k: m.get(k) for k in ("name", "kind", "engine", "slots", "busy", "waiting", "healthy",
                                                  "total", "speed")} for m in p.get("models", [])],
            })
        return {"node": node, "standalone": mesh is None, "nodes": nodes, "bucket_s": BUCKET_S,
                "buckets": self.stats.buckets(), "errors": list(reversed(self.stats.errors))}


def _answer(body: bytes, content_type: str, status: int = 200) -> web.Response:
    response = web.Response(body=body, status=status, content_type=content_type,
                            charset="utf-8" if content_type.startswith("text/") else None)
    response.headers.update(SECURITY_HEADERS)
    return response
