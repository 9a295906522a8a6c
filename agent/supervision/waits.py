"""How a backend's task waits (for work, its engine's exit, a command or a deadline) and reads the outcome.

The backend's task (agent/supervision/backend_task.py) never awaits a probe, a load read, the
load gate or a backoff alone: a command (down, up, stop) or the engine's exit must end any
wait at once. Every helper here leaves no task pending and never leaks a gate slot.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Iterable
from dataclasses import dataclass
from enum import Enum
from typing import Any, Generic, TypeVar

from viiwork.agent.supervision.runners.base import ExitInfo
from viiwork.engines.contract import EngineError, EngineUnavailable, Probe

# One logger for all of the supervisor's messages, whichever module logs them.
log = logging.getLogger("viiwork.agent.supervision.supervisor")

T = TypeVar("T")
T_co = TypeVar("T_co", covariant=True)


class Wake(Enum):
    """What ended a wait of a backend's task."""

    DONE = "done"          # the awaited work finished (result or exception in the outcome)
    EXITED = "exited"      # the engine process ended
    COMMAND = "command"    # down/up/stop changed what the backend should do
    TIMEOUT = "timeout"


@dataclass(frozen=True)
class Outcome(Generic[T_co]):
    """How a wait ended: ``result`` or ``error`` of the work when ``wake`` is DONE."""

    wake: Wake
    result: T_co | None = None
    error: BaseException | None = None


async def until(
    changed: asyncio.Event,
    exit_task: asyncio.Future[ExitInfo] | None,
    work: Awaitable[T] | None,
    timeout: float | None,
    also: Iterable[asyncio.Future[Any]] = (),
) -> Outcome[T]:
    """Wait for ``work``, the engine's exit (``exit_task``), a command (``changed`` set) or
    ``timeout`` s, whichever first.

    An exit wins over a finished probe (its reason is the better one); a command wins
    over work. Unfinished ``work`` is cancelled before returning; futures in ``also``
    only wake the wait (TIMEOUT is returned then: the caller looks at them itself) and
    are left running.
    """
    work_task = asyncio.ensure_future(work) if work is not None else None
    cmd_task = asyncio.ensure_future(changed.wait())
    waits: set[asyncio.Future[Any]] = {cmd_task, *also}
    if work_task is not None:
        waits.add(work_task)
    if exit_task is not None:
        waits.add(exit_task)
    try:
        await asyncio.wait(waits, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in (work_task, cmd_task):
            if task is not None and not task.done():
                task.cancel()
        # Awaiting the cancelled tasks keeps none pending; our own cancellation still
        # propagates because gather re-raises it here.
        await asyncio.gather(*(t for t in (work_task, cmd_task) if t is not None), return_exceptions=True)
    if exit_task is not None and exit_task.done():
        return Outcome(Wake.EXITED)
    if cmd_task.done() and not cmd_task.cancelled():
        return Outcome(Wake.COMMAND)
    if work_task is not None and work_task.done() and not work_task.cancelled():
        if work_task.exception() is not None:
            return Outcome(Wake.DONE, error=work_task.exception())
        return Outcome(Wake.DONE, result=work_task.result())
    return Outcome(Wake.TIMEOUT)


async def timed(work: Awaitable[T], timeout_s: float) -> Outcome[T]:
    """``work`` under a deadline of ``timeout_s`` s, its result or error captured (never raised)."""
    try:
        async with asyncio.timeout(timeout_s):
            return Outcome(Wake.DONE, result=await work)
    except TimeoutError:
        return Outcome(Wake.TIMEOUT)
    except Exception as exc:  # noqa: BLE001 - captured for the caller to judge
        return Outcome(Wake.DONE, error=exc)


async def acquire_gate(gate: asyncio.Semaphore, changed: asyncio.Event) -> bool:
    """Take a slot of ``gate`` (True), or give up on a command (``changed`` set: False); never
    leaks a slot, also when cancelled in the instant the slot came free."""
    acquire = asyncio.ensure_future(gate.acquire())
    command = asyncio.ensure_future(changed.wait())
    keep = False
    try:
        await asyncio.wait({acquire, command}, return_when=asyncio.FIRST_COMPLETED)
        keep = not changed.is_set()
    finally:
        command.cancel()
        if not acquire.done():
            acquire.cancel()
        await asyncio.gather(acquire, command, return_exceptions=True)
        acquired = acquire.done() and not acquire.cancelled() and acquire.exception() is None
        if acquired and not keep:
            gate.release()
    return keep and acquired


def timed_out(got: Outcome[object]) -> bool:
    """Whether a probe or load read ran out of time (its deadline, or the engine read's own)."""
    if got.wake is Wake.TIMEOUT:
        return True
    err = got.error
    return isinstance(err, EngineUnavailable) and isinstance(err.__cause__, TimeoutError)


def probe_error(got: Outcome[object], timeout_s: float) -> str:
    """Why a probe or load read under a ``timeout_s`` deadline failed, for messages."""
    if got.wake is Wake.TIMEOUT:
        return f"no answer within {timeout_s:g} s"
    if got.error is not None:
        return str(got.error)
    if got.result is not None and isinstance(got.result, Probe):
        return got.result.reason or got.result.phase or "not ready"
    return "unknown"


def adapter_bug(engine: str, what: str, error: BaseException | None) -> None:
    """The contract lets adapters raise only EngineError: anything else ``engine``'s ``what``
    (probe, read_load) raised is a bug in the adapter, logged with its traceback; the caller
    then treats it like a failed call."""
    if error is not None and not isinstance(error, EngineError):
        log.error("engine %s: %s raised %r (adapter bug; counted as a failure)",
                  engine, what, error, exc_info=error)
