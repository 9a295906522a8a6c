"""Local admission: pick the healthy backend with the most free slots, else queue (DESIGN §6).

One ``ModelAdmission`` per model. A request takes a slot with ``acquire()`` and gives it back
with ``release()``. When no backend has a free slot, or the model's backends are still
starting, the request waits in a bounded FIFO queue: first come, first served, since a new
arrival never overtakes a queued one. Queue full or wait too long -> ``QueueFull`` /
``QueueTimeout`` (429); nothing on this node can ever serve it (every backend dead or the
model down) -> ``NoCapacity`` (503).

Runs on the event loop only; every state change is synchronous, so no locks.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from dataclasses import dataclass

from viiwork.agent.backends import Backend, ModelRuntime


class AdmissionError(Exception):
    """Base: the request cannot be admitted. ``retry_after_s`` is a hint for clients."""

    status = 503
    retry_after_s = 1

    def __init__(self, model: str, message: str) -> None:
        super().__init__(message)
        self.model = model


class QueueFull(AdmissionError):
    status = 429
    retry_after_s = 1


class QueueTimeout(AdmissionError):
    status = 429
    retry_after_s = 2


class NoCapacity(AdmissionError):
    status = 503
    retry_after_s = 5


@dataclass(slots=True)
class Lease:
    """A slot taken on ``backend``; ``queued_ms`` is the time spent waiting for it."""

    backend: Backend
    queued_ms: float


class ModelAdmission:
    """Admission for one model: pick, queue, dispatch on release or on backend change.

    queue_max: waiting requests allowed (0 = no queue). queue_timeout_s: longest wait.
    """

    def __init__(self, runtime: ModelRuntime, queue_max: int, queue_timeout_s: float) -> None:
        self.runtime = runtime
        self.queue_max = queue_max
        self.queue_timeout_s = queue_timeout_s
        self._waiters: deque[asyncio.Future[Backend]] = deque()
        self.admitted = 0
        self.rejected_full = 0
        self.rejected_timeout = 0
        self.rejected_no_capacity = 0
        runtime.listeners.append(self._on_change)

    @property
    def queued(self) -> int:
        return sum(1 for w in self._waiters if not w.done())

    def _pick(self) -> Backend | None:
        best: Backend | None = None
        best_free = 0
        for backend in self.runtime.backends:
            free = backend.free_slots
            if free > best_free:
                best, best_free = backend, free
        return best

    def try_acquire(self, backend_id: str | None = None) -> Backend | None:
        """Take a free local slot now, never queueing: ``backend_id``'s if it has one, else
        the backend with the most free slots; None when nothing is free. For mesh routing
        (the origin queues itself) and forwarded requests (a receiver never queues)."""
        backend = None
        if backend_id is not None:
            backend = next((b for b in self.runtime.backends if b.id == backend_id and b.free_slots > 0), None)
        if backend is None:
            backend = self._pick()
        if backend is not None:
            backend.in_flight += 1
            self.admitted += 1
        return backend

    async def acquire(self) -> Lease:
        """Take a slot, waiting in the queue if needed. Raises an AdmissionError subclass."""
        if not self._waiters:
            backend = self._pick()
            if backend is not None:
                backend.in_flight += 1
                self.admitted += 1
                return Lease(backend, 0.0)
        if not self.runtime.can_ever_serve:
            self.rejected_no_capacity += 1
            raise NoCapacity(self.runtime.name, f"model {self.runtime.name!r} has no backend that can serve it "
                             f"({self._why_not()})")
        if self.queued >= self.queue_max:
            self.rejected_full += 1
            raise QueueFull(self.runtime.name, f"model {self.runtime.name!r}: all slots busy and the queue is full "
                            f"({self.queue_max} waiting)")
        loop = asyncio.get_running_loop()
        waiter: asyncio.Future[Backend] = loop.create_future()
        self._waiters.append(waiter)
        started = time.monotonic()
        try:
            async with asyncio.timeout(self.queue_timeout_s):
                backend = await waiter
        except TimeoutError:
            self.rejected_timeout += 1
            raise QueueTimeout(self.runtime.name, f"model {self.runtime.name!r}: no slot freed within "
                               f"{self.queue_timeout_s:g} s") from None
        except asyncio.CancelledError:
            # Cancelled after the dispatcher handed us a slot: give it to the next waiter.
            if waiter.done() and not waiter.cancelled() and waiter.exception() is None:
                self.release(waiter.result())
            raise
        finally:
            if not waiter.done():
                waiter.cancel()
            self._discard(waiter)
        self.admitted += 1
        return Lease(backend, (time.monotonic() - started) * 1000.0)

    def release(self, backend: Backend) -> None:
        """Give back a slot taken by ``acquire``; dispatches the next waiter."""
        backend.end_request()
        if self._waiters:
            self._dispatch()

    def _discard(self, waiter: asyncio.Future[Backend]) -> None:
        try:
            self._waiters.remove(waiter)
        except ValueError:
            pass

    def _dispatch(self) -> None:
        while self._waiters:
            head = self._waiters[0]
            if head.done():
                self._waiters.popleft()
                continue
            backend = self._pick()
            if backend is None:
                return
            self._waiters.popleft()
            backend.in_flight += 1
            head.set_result(backend)

    def _on_change(self, runtime: ModelRuntime) -> None:
        self._dispatch()
        if self._waiters and not runtime.can_ever_serve:
            error = NoCapacity(runtime.name, f"model {runtime.name!r} can no longer be served ({self._why_not()})")
            while self._waiters:
                waiter = self._waiters.popleft()
                if not waiter.done():
                    self.rejected_no_capacity += 1
                    waiter.set_exception(error)

    def _why_not(self) -> str:
        states = ", ".join(f"{b.id} {b.state.value}" + (f": {b.reason}" if b.reason else "")
                           for b in self.runtime.backends)
        return f"model is {self.runtime.state.value}" + (f"; {states}" if states else "")
