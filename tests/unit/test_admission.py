"""Local admission: most-free-slot choice, FIFO queue, bounds, and dispatch on change."""

from __future__ import annotations

import asyncio

import pytest

from viiwork.agent.admission import ModelAdmission, NoCapacity, QueueFull, QueueTimeout
from viiwork.agent.backends import Backend, BackendId, BackendState, ModelRuntime, ModelState
from viiwork.agent.config import ModelConfig
from viiwork.engines.registry import get_engine


def runtime(*parallels: int, state: BackendState = BackendState.HEALTHY) -> ModelRuntime:
    cfg = ModelConfig.model_validate({"name": "m", "engine": "llamacpp", "path": "/m.gguf"})
    rt = ModelRuntime(config=cfg, engine=get_engine("llamacpp"))
    for i, p in enumerate(parallels):
        rt.backends.append(Backend(id=BackendId(f"m#{i}"), model="m", index=i, state=state,
                                   port=40000 + i, parallel=p))
    return rt


async def test_picks_backend_with_most_free_slots() -> None:
    rt = runtime(1, 3)
    adm = ModelAdmission(rt, queue_max=4, queue_timeout_s=1)
    first = await adm.acquire()
    assert first.backend.id == "m#1"
    second = await adm.acquire()
    assert second.backend.id == "m#1"  # 2 free on m#1 vs 1 on m#0
    third = await adm.acquire()
    assert {third.backend.id} <= {"m#0", "m#1"}
    assert sum(b.in_flight for b in rt.backends) == 3


async def test_queue_is_fifo_and_dispatched_on_release() -> None:
    rt = runtime(1)
    adm = ModelAdmission(rt, queue_max=5, queue_timeout_s=5)
    held = await adm.acquire()
    order: list[int] = []

    async def waiter(n: int) -> None:
        lease = await adm.acquire()
        order.append(n)
        await asyncio.sleep(0)
        adm.release(lease.backend)

    tasks = []
    for n in range(3):
        tasks.append(asyncio.create_task(waiter(n)))
        await asyncio.sleep(0)  # arrival order = creation order
    assert adm.queued == 3
    adm.release(held.backend)
    await asyncio.wait_for(asyncio.gather(*tasks), 2)
    assert order == [0, 1, 2]
    assert rt.backends[0].in_flight == 0


async def test_new_arrival_never_overtakes_queue() -> None:
    rt = runtime(1)
    adm = ModelAdmission(rt, queue_max=5, queue_timeout_s=5)
    held = await adm.acquire()
    early = asyncio.create_task(adm.acquire())
    await asyncio.sleep(0)
    # Free the slot without dispatching (as if the engine's capacity grew), then a late
    # arrival must still queue behind the early one.
    rt.backends[0].parallel = 2
    late = asyncio.create_task(adm.acquire())
    await asyncio.sleep(0)
    rt.notify()
    first_done = await asyncio.wait_for(early, 1)
    assert first_done.backend.id == "m#0"
    adm.release(held.backend)
    await asyncio.wait_for(late, 1)


async def test_queue_full_rejects_at_once() -> None:
    rt = runtime(1)
    adm = ModelAdmission(rt, queue_max=2, queue_timeout_s=5)
    await adm.acquire()
    queued = [asyncio.create_task(adm.acquire()) for _ in range(2)]
    await asyncio.sleep(0)
    with pytest.raises(QueueFull) as exc:
        await adm.acquire()
    assert exc.value.status == 429 and exc.value.retry_after_s >= 1
    for t in queued:
        t.cancel()
    await asyncio.gather(*queued, return_exceptions=True)
    assert adm.queued == 0


async def test_queue_timeout() -> None:
    rt = runtime(1)
    adm = ModelAdmission(rt, queue_max=2, queue_timeout_s=0.05)
    await adm.acquire()
    with pytest.raises(QueueTimeout) as exc:
        await adm.acquire()
    assert exc.value.status == 429
    assert adm.queued == 0


async def test_starting_backend_queues_then_serves_when_healthy() -> None:
    rt = runtime(2, state=BackendState.STARTING)
    adm = ModelAdmission(rt, queue_max=4, queue_timeout_s=5)
    pending = asyncio.create_task(adm.acquire())
    await asyncio.sleep(0)
    assert not pending.done() and adm.queued == 1
    rt.backends[0].state = BackendState.HEALTHY
    rt.notify()
    lease = await asyncio.wait_for(pending, 1)
    assert lease.backend.id == "m#0" and lease.queued_ms >= 0


async def test_all_dead_is_no_capacity_and_fails_waiters() -> None:
    rt = runtime(1, state=BackendState.STARTING)
    adm = ModelAdmission(rt, queue_max=4, queue_timeout_s=5)
    pending = asyncio.create_task(adm.acquire())
    await asyncio.sleep(0)
    rt.backends[0].state = BackendState.DEAD
    rt.backends[0].reason = "binary not found"
    rt.notify()
    with pytest.raises(NoCapacity, match="binary not found"):
        await asyncio.wait_for(pending, 1)
    with pytest.raises(NoCapacity) as exc:
        await adm.acquire()
    assert exc.value.status == 503


async def test_down_model_is_no_capacity() -> None:
    rt = runtime(1)
    rt.state = ModelState.DOWN
    rt.backends[0].state = BackendState.STOPPED
    adm = ModelAdmission(rt, queue_max=4, queue_timeout_s=5)
    with pytest.raises(NoCapacity, match="down"):
        await adm.acquire()


async def test_cancelled_waiter_hands_slot_to_next() -> None:
    rt = runtime(1)
    adm = ModelAdmission(rt, queue_max=4, queue_timeout_s=5)
    held = await adm.acquire()
    a = asyncio.create_task(adm.acquire())
    b = asyncio.create_task(adm.acquire())
    await asyncio.sleep(0)
    a.cancel()
    await asyncio.gather(a, return_exceptions=True)
    adm.release(held.backend)
    lease = await asyncio.wait_for(b, 1)
    assert lease.backend.in_flight == 1
