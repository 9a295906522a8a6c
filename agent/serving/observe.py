"""What the client API tells observers about each inference request it answered.

``ClientApi`` calls :meth:`Observers.observe` once per answer on the inference paths: after
the pipeline returned (the whole answer written, for a stream), and for the agent's own
answers before routing (unreadable, malformed or oversized body, no model, wrong method:
model "-"): the dashboard's ring of
10-second buckets (agent/serving/dashboard.py) is one observer; histograms can be another.
It runs on the request path, so an observer must be cheap and must not block or raise.
"""

from __future__ import annotations

from typing import Protocol


class RequestObserver(Protocol):
    """One answered request: ``model`` (its /metrics label, "-" for a model nobody serves),
    the HTTP ``status``, ``queued_s`` (seconds from the handler's start to dispatch to a
    backend or peer; None when it never left the queue, a refusal), ``ttft_s`` (to the first
    chunk written for a stream, else the whole duration), ``duration_s`` (the handler's
    loop time), and ``error``: a one-line reason when it was a refusal or a failure
    (status >= 500, or a stream that broke after its first byte), else None. Never prompt text."""

    def observe(self, model: str, status: int, queued_s: float | None, ttft_s: float, duration_s: float,
                error: str | None = None) -> None: ...


class Observers:
    """Fan-out to each observer in ``observers`` (a list callers may append to)."""

    def __init__(self, *observers: RequestObserver) -> None:
        self.observers: list[RequestObserver] = list(observers)

    def observe(self, model: str, status: int, queued_s: float | None, ttft_s: float, duration_s: float,
                error: str | None = None) -> None:
        for observer in self.observers:
            observer.observe(model, status, queued_s, ttft_s, duration_s, error)
