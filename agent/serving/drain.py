"""Requests in flight through the agent's listeners, and how a stop ends them.

:class:`InFlight` counts every inference request (``POST /v1/...``) while its handler runs,
on the client API and on the mesh listener (forwards from peers), so a request relayed
through this node counts here in both directions: as the origin (client API) and as the
peer that runs it (mesh listener). A streamed answer is written by its handler, so a stream
counts until its last byte. The stop path (docs/architecture.md, "Stopping") waits on it:

- :meth:`InFlight.drain` returns as soon as nothing is in flight (an ``asyncio.Event``, no
  polling), or after ``timeout_s`` (``health.drain_timeout_s``);
- what still runs then is ended: a stream whose headers went out gets a terminal SSE error
  event (``data: {"error": {...}}``, no ``[DONE]``: the form of
  :func:`viiwork.agent.serving.errors.sse_error_event`) and its end; a request that sent nothing yet
  (queued, or waiting for an engine's or a peer's first byte) is answered 503 with
  ``Retry-After``; both carry the code ``draining`` (:class:`viiwork.agent.serving.errors.ErrorCode`),
  like new requests refused during the stop. Each is cancelled (its engine or peer connection
  closes, freeing the slot) and answered from the middleware, within :data:`CUT_GRACE_S`.

Which response a request has started is learned from aiohttp's ``on_response_prepare``
signal (sent from the handler's own task when a stream's headers are written).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from aiohttp import web

from viiwork.agent.serving.errors import Dialect, ErrorCode, dialect_of, error_response, sse_error_event
from viiwork.engines.contract import ENDPOINT_OF_PATH

log = logging.getLogger(__name__)

#: Seconds the requests ended at the drain deadline have to write their last answer.
CUT_GRACE_S = 2.0
#: ``Retry-After`` (seconds) of the 503 given to a request that had not started.
RETRY_AFTER_S = 5

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


@dataclass(frozen=True, slots=True)
class DrainOutcome:
    """What :meth:`InFlight.drain` did: requests in flight when it began (``waited_for``),
    seconds it waited, streams ended with an SSE error event (``cut_streams``) and requests
    answered 503 before their first byte (``cut_unstarted``)."""

    waited_for: int
    seconds: float
    cut_streams: int
    cut_unstarted: int


class InFlight:
    """Counts the inference requests running through the apps it is attached to (see the
    module doc); ``len()`` is the count now."""

    def __init__(self) -> None:
        self._running: dict[asyncio.Task[object], web.Request] = {}
        self._prepared: dict[asyncio.Task[object], web.StreamResponse] = {}
        self._cut: set[asyncio.Task[object]] = set()
        self._idle = asyncio.Event()
        self._idle.set()
        self._message = "the node stopped before this request ended"
        self.cut_streams = 0
        self.cut_unstarted = 0

    def __len__(self) -> int:
        return len(self._running)

    def attach(self, app: web.Application) -> None:
        """Count ``app``'s ``POST /v1/...`` requests (call before the app is started)."""
        app.middlewares.append(self._middleware)
        app.on_response_prepare.append(self._on_prepare)

    async def _on_prepare(self, request: web.Request, response: web.StreamResponse) -> None:
        task = asyncio.current_task()
        if task is not None and task in self._running:
            self._prepared[task] = response

    @web.middleware
    async def _middleware(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        if request.method != "POST" or not (request.path.startswith("/v1/") or request.path in ENDPOINT_OF_PATH):
            return await handler(request)
        task = asyncio.current_task()
        assert task is not None
        self._running[task] = request
        self._idle.clear()
        try:
            return await handler(request)
        except asyncio.CancelledError:
            if task not in self._cut:  # the client left (handler cancellation): not ours
                raise
            task.uncancel()
            return await self._cut_answer(task)
        finally:
            self._running.pop(task, None)
            self._prepared.pop(task, None)
            self._cut.discard(task)
            if not self._running:
                self._idle.set()

    async def _cut_answer(self, task: asyncio.Task[object]) -> web.StreamResponse:
        response = self._prepared.get(task)
        request = self._running.get(task)
        dialect = dialect_of(request.path) if request is not None else Dialect.OPENAI
        if response is None:
            self.cut_unstarted += 1
            return error_response(503, self._message, code=ErrorCode.DRAINING, retry_after_s=RETRY_AFTER_S)
        self.cut_streams += 1
        # The client may be gone, or the stream already complete (write after its end).
        with contextlib.suppress(ConnectionError, RuntimeError):
            await response.write(sse_error_event(503, self._message, code=ErrorCode.DRAINING, dialect=dialect))
            await response.write_eof()
        return response

    async def wait_idle(self, timeout_s: float) -> bool:
        """True as soon as nothing is in flight; False after ``timeout_s`` seconds."""
        try:
            async with asyncio.timeout(max(timeout_s, 0.0)):
                await self._idle.wait()
        except TimeoutError:
            return False
        return True

    async def drain(self, timeout_s: float, message: str) -> DrainOutcome:
        """Let what is in flight end, for at most ``timeout_s`` seconds; then end the rest
        (module doc) with ``message`` in the error event or the 503. Returns within
        ``timeout_s + CUT_GRACE_S`` seconds; requests that arrive meanwhile count too."""
        loop = asyncio.get_running_loop()
        started = loop.time()
        waited_for = len(self._running)
        streams, unstarted = self.cut_streams, self.cut_unstarted
        if not await self.wait_idle(timeout_s):
            self._message = message
            left = list(self._running)
            log.warning("drain: %d request(s) still running after %g s; ending them", len(left), timeout_s)
            for task in left:
                self._cut.add(task)
                task.cancel()
            if not await self.wait_idle(CUT_GRACE_S):
                for task in list(self._running):  # could not even write its end: cut it off
                    self._cut.discard(task)
                    task.cancel()
        return DrainOutcome(waited_for, loop.time() - started, self.cut_streams - streams,
                            self.cut_unstarted - unstarted)
