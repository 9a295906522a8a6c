"""Local admission: most-free-slot choice, the FIFO origin queue with one freed slot per
waiter, its bounds, and what a standalone node answers when nothing can serve
(agent/serving/waitqueue.py, agent/serving/pipeline.py NoPeers; the whole path over HTTP: test_api.py)."""

from __future__ import annotations

import asyncio

from viiwork.agent.config.schema import ModelConfig
from viiwork.agent.serving.pipeline import NoPeers
from viiwork.agent.serving.router import Queue, Refuse, RunLocal
from viiwork.agent.serving.waitqueue import Queues
from viiwork.agent.supervision.backends import Backend, BackendId, BackendState, ModelRuntime, ModelState
from viiwork.engines.registry import get_engine


def runtime(*parallels: int, state: BackendState = BackendState.HEALTHY) -> ModelRuntime:
    cfg = ModelConfig.model_validate({"name": "m", "engine": "llamacpp", "path": "/m.gguf"})
    rt = ModelRuntime(config=cfg, engine=get_engine("llamacpp"))
    for i, p in enumerate(parallels):
        rt.backends.append(Backend(id=BackendId(f"m#{i}"), model="m", index=i, state=state,
                                   port=40000 + i, parallel=p))
    return rt


def queues(rt: ModelRuntime, queue_max: int = 4) -> Queues:
    return Queues({"m": rt}, queue_max, 5.0)


async def test_picks_backend_with_most_free_slots() -> None:
    rt = runtime(1, 3)
    q = queues(rt).of("m")
    assert q.take().id == "m#1"  # type: ignore[union-attr]
    assert q.take().id == "m#1"  # type: ignore[union-attr]  # 2 free on m#1 vs 1 on m#0
    assert q.take() is not None
    assert sum(b.in_flight for b in rt.backends) == 3
    assert NoPeers({"m": rt}).route("m", host=None, affinity=None, exclude=set()) == RunLocal("m#1")


async def test_queue_is_fifo_and_dispatched_on_release() -> None:
    rt = runtime(1)
    q = queues(rt).of("m")
    held = q.take()
    assert held is not None
    waiters = [q.enter() for _ in range(3)]
    assert len(q) == 3
    q.release(held)
    q.grant()  # the freed slot goes to the oldest waiter, and only to it
    assert waiters[0].grant is held and waiters[0].event.is_set()
    assert all(w.grant is None and not w.event.is_set() for w in waiters[1:])
    q.leave(waiters[0])
    q.release(held)
    q.grant()
    assert waiters[1].grant is held and waiters[2].grant is None


async def test_new_arrival_never_overtakes_queue() -> None:
    rt = runtime(1)
    qs = queues(rt)
    q = qs.of("m")
    held = q.take()
    early = q.enter()
    # The engine's capacity grows: the free slot goes to the early waiter, not a late one.
    rt.backends[0].parallel = 2
    late = q.enter()
    rt.notify()
    assert early.grant is rt.backends[0] and late.grant is None
    assert held is not None


async def test_queue_full_rejects_at_once() -> None:
    rt = runtime(1)
    q = queues(rt, queue_max=2).of("m")
    q.take()
    waiters = [q.enter(), q.enter()]
    assert q.full()
    for w in waiters:
        q.leave(w)
    assert len(q) == 0 and not q.full()


async def test_queue_timeout() -> None:
    rt = runtime(1)
    q = queues(rt).of("m")
    q.take()
    waiter = q.enter()
    loop = asyncio.get_running_loop()
    started = loop.time()
    await q.park(waiter, 0.05)  # parks at most what is left of the timeout
    assert 0.04 <= loop.time() - started < 0.4 and waiter.grant is None


async def test_starting_backend_queues_then_serves_when_healthy() -> None:
    rt = runtime(2, state=BackendState.STARTING)
    q = queues(rt).of("m")
    assert isinstance(NoPeers({"m": rt}).route("m", host=None, affinity=None, exclude=set()), Queue)
    waiter = q.enter()
    rt.backends[0].state = BackendState.HEALTHY
    rt.notify()
    assert waiter.grant is rt.backends[0] and waiter.event.is_set()


async def test_all_dead_is_no_capacity_and_fails_waiters() -> None:
    rt = runtime(1, state=BackendState.STARTING)
    q = queues(rt).of("m")
    waiter = q.enter()
    rt.backends[0].state = BackendState.DEAD
    rt.backends[0].reason = "binary not found"
    rt.notify()
    assert waiter.event.is_set()  # woken to route again: it is refused
    decision = NoPeers({"m": rt}).route("m", host=None, affinity=None, exclude=set())
    assert isinstance(decision, Refuse) and decision.status == 503 and "binary not found" in decision.message


async def test_down_model_is_no_capacity() -> None:
    rt = runtime(1)
    rt.state = ModelState.DOWN
    rt.backends[0].state = BackendState.STOPPED
    decision = NoPeers({"m": rt}).route("m", host=None, affinity=None, exclude=set())
    assert isinstance(decision, Refuse) and decision.status == 503 and "down" in decision.message


async def test_cancelled_waiter_hands_slot_to_next() -> None:
    rt = runtime(1)
    q = queues(rt).of("m")
    held = q.take()
    assert held is not None
    a, b = q.enter(), q.enter()
    q.release(held)
    q.grant()
    unused = q.leave(a)  # it gave up after the slot was granted to it
    assert unused is held
    q.release(unused)
    q.grant()
    assert b.grant is held and held.in_flight == 1


async def test_a_waiter_pinned_elsewhere_is_not_ahead() -> None:
    """``WaitQueue.ahead``: a waiter pinned to another node competes only for that node's
    slots; an unpinned one, or one pinned to the same node, holds a new request back."""
    q = queues(runtime(1)).of("m")
    q.enter("node-b", here=False)
    assert not q.ahead(None, True)  # may run anywhere: node-b's waiter is not in its way
    assert not q.ahead("node-a", True)  # pinned here
    assert q.ahead("node-b", False)  # pinned to the same busy node: behind it
    q.enter("node-a", here=True)  # waits while node-a (this node) is busy
    assert not q.ahead(None, True)  # it can run on an idle peer meanwhile
    assert q.ahead("node-a", True)
    free = queues(runtime(1)).of("m")
    free.enter(None)
    assert free.ahead(None, True) and free.ahead("node-b", False)


async def test_a_request_refused_elsewhere_waits_in_its_arrival_place() -> None:
    """A request that arrived first but waits only after a peer refused it (``arrived``
    given) goes before the requests that arrived after it: the freed slot is its."""
    rt = runtime(1)
    q = queues(rt).of("m")
    held = q.take()
    assert held is not None
    later = [q.enter(), q.enter()]
    first = q.enter(arrived=later[0].arrived - 1.0)
    q.release(held)
    q.grant()
    assert first.grant is held
    assert all(w.grant is None for w in later)
    assert q.oldest() == first.arrived


async def test_a_freed_slot_goes_by_priority_then_tenant_turns() -> None:
    """Issue 17 item 7: with keys, a higher priority first, tenants in turn within one
    (agent/serving/turns.py); a new request waits only behind waiters served before it."""
    from viiwork.mesh.extensions import Priority

    rt = runtime(1)
    q = queues(rt, queue_max=16).of("m")
    held = q.take()
    assert held is not None
    burst = [q.enter(priority=Priority.LOW, tenant="bulk") for _ in range(5)]
    assert not q.ahead(None, True, priority=Priority.HIGH, tenant="web")  # low waiters do not hold it back
    assert q.ahead(None, True, priority=Priority.LOW, tenant="other")  # the burst's first does
    urgent = q.enter(priority=Priority.HIGH, tenant="web")
    other = q.enter(priority=Priority.LOW, tenant="other")
    served = []
    for _ in range(4):
        q.release(held)
        q.grant()
        (winner,) = [w for w in [*burst, urgent, other] if w.grant is not None]
        served.append(winner)
        q.leave(winner)
    assert served == [urgent, burst[0], other, burst[1]]
