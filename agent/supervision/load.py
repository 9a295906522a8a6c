"""A healthy backend's load readings: the read's deadline, and when a failed read makes the load stale.

Load is read every ``supervisor.load_poll_interval_s`` (agent/supervision/backend_task.py)
under ``LOAD_READ_TIMEOUT_S``; a failed read keeps the last value until it is
``supervisor.load_stale_after_s`` old, then the backend is marked ``load_stale`` (slots fall
back to ``parallel``, busy to routing's in-flight count: agent/supervision/backends.py).
A reading's token counters feed the backend's speed estimate (agent/supervision/speeds.py).
"""

from __future__ import annotations

import logging
import time

from viiwork.agent.supervision import health_ladder as hl
from viiwork.agent.supervision.backends import Backend, ModelRuntime
from viiwork.agent.supervision.waits import Outcome, Wake, adapter_bug, probe_error
from viiwork.engines.contract import Load

# One logger for all of the supervisor's messages, whichever module logs them.
log = logging.getLogger("viiwork.agent.supervision.supervisor")

#: Deadline of one load read (docs/architecture.md, "A backend's life").
LOAD_READ_TIMEOUT_S = 1.0


def record_load(runtime: ModelRuntime, backend: Backend, got: Outcome[Load], stale_after_s: float) -> None:
    """Show the load read ``got`` on ``backend`` of ``runtime``; a failed read marks the load
    stale once none succeeded for ``stale_after_s`` s. Notifies ``runtime`` when the
    backend's slots or staleness changed."""
    before = (backend.slots, backend.load_stale)
    now = time.monotonic()
    if got.wake is Wake.DONE and got.error is None:
        backend.load = got.result
        backend.load_at = now
        backend.speed.update(got.result.tokens if got.result is not None else None, now)
        backend.load_stale = False
    else:
        adapter_bug(runtime.config.engine, "read_load", got.error)
        if not backend.load_stale and hl.load_goes_stale(backend.load_at, backend.healthy_since, now, stale_after_s):
            log.warning("backend %s: load unread for %g s or more (%s): falling back to parallel/in-flight",
                        backend.id, stale_after_s, probe_error(got, LOAD_READ_TIMEOUT_S))
            backend.load_stale = True
    if (backend.slots, backend.load_stale) != before:
        runtime.notify()
