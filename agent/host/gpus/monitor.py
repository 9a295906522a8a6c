"""The agent's view of its GPUs over time: inventory refreshes, hot-plug, placement checks.

``GpuMonitor`` holds the latest ``GpuInventory`` and derives from it, after every refresh or
hot-plug event:

- which backends sit on a GPU that vanished (hot-removed, unbound, or reported lost by the
  driver): they are *marked* (``losses``, logged at WARNING, ``on_gpu_lost`` called), not
  stopped; the supervisor's health ladder notices a dead engine by itself;
- for each healthy backend, once per process, whether its process tree is on exactly its
  GPUs (``placements``; report only).

Config GPU references are resolved against the inventory read at start
(``placement_inventory``): NVML indexes shift when a GPU disappears, but the backends were
pinned by the indexes of the GPUs present when they started.

Concurrency: every method runs on the event loop; blocking reads (NVML, sysfs, /proc) go
through ``asyncio.to_thread``. Listeners must not block.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from viiwork.agent.host.gpus.amd import AmdSysfsReader
from viiwork.agent.host.gpus.inventory import (
    Gpu,
    GpuInventory,
    GpuRefError,
    GpuSource,
    async_read_inventory,
)
from viiwork.agent.host.gpus.nvml import NvmlReader
from viiwork.agent.host.gpus.placement import GpuPlacement, PlacementVerdict, gpu_pids, process_tree, verify_placement
from viiwork.agent.host.gpus.udev import GpuHotplug, UdevEvent, UdevGpuEvents, gpu_hotplug_from
from viiwork.agent.supervision.backends import Backend, BackendId, BackendState

log = logging.getLogger(__name__)


class GpuReadTimeout(Exception):
    """Reading the GPUs did not finish in time."""


@dataclass(frozen=True, slots=True)
class GpuLoss:
    """A backend whose assigned GPU is gone: ``since`` is the monitor clock (monotonic s)."""

    backend: BackendId
    model: str
    gpu_key: str
    gpu_label: str
    since: float


@dataclass(frozen=True, slots=True)
class HotplugRecord:
    change: GpuHotplug
    at: float


@dataclass(frozen=True, slots=True)
class PlacementRecord:
    pid: int | None
    placement: GpuPlacement
    at: float


def default_sources() -> tuple[GpuSource, ...]:
    """NVML for NVIDIA and sysfs for AMD, on this host."""
    return (NvmlReader(), AmdSysfsReader("/"))


class GpuMonitor:
    """Latest inventory, GPU-loss marks and placement verdicts for one node.

    sources: the vendor readers (default: NVML + sysfs). backends: returns the node's
    backends now (the supervisor's objects; read only). on_gpu_lost: called with the
    backend and the vanished GPU when a backend is first marked. clock: monotonic seconds.
    """

    def __init__(
        self,
        sources: Sequence[GpuSource] | None = None,
        *,
        backends: Callable[[], Iterable[Backend]] = tuple,
        on_gpu_lost: Callable[[Backend, Gpu], None] | None = None,
        proc_root: Path | str = "/proc",
        clock: Callable[[], float] = time.monotonic,
        max_events: int = 32,
        read_timeout_s: float = 30.0,
    ) -> None:
        self.sources: tuple[GpuSource, ...] = tuple(sources) if sources is not None else default_sources()
        self.backends = backends
        self.on_gpu_lost = on_gpu_lost
        self.proc_root = Path(proc_root)
        self.clock = clock
        self.inventory = GpuInventory()
        self.placement_inventory: GpuInventory | None = None
        self.refreshed_at: float | None = None
        self.losses: dict[BackendId, GpuLoss] = {}
        self.placements: dict[BackendId, PlacementRecord] = {}
        self.events: deque[HotplugRecord] = deque(maxlen=max_events)
        self.hotplug_available: bool | None = None
        self.read_timeout_s = read_timeout_s
        self.last_error: str | None = None
        self._lock = asyncio.Lock()
        self._reading: asyncio.Future[GpuInventory] | None = None

    # -- inventory ---------------------------------------------------------------------

    async def async_refresh(self) -> GpuInventory:
        """Read every source again (in a worker thread) and re-derive the loss marks.

        Raises GpuReadTimeout when the read takes over ``read_timeout_s`` (a driver call on a
        dying GPU can hang); the read keeps running and the next refresh waits for that same
        read instead of starting another thread.
        """
        async with self._lock:
            if self._reading is None or self._reading.done():
                self._reading = asyncio.ensure_future(async_read_inventory(self.sources))
            try:
                async with asyncio.timeout(self.read_timeout_s):
                    inventory = await asyncio.shield(self._reading)
            except TimeoutError:
                self.last_error = f"reading the GPUs took over {self.read_timeout_s:g} s (driver hung?)"
                raise GpuReadTimeout(self.last_error) from None
            self.last_error = None
            self._set_inventory(inventory)
        return inventory

    def _set_inventory(self, inventory: GpuInventory) -> None:
        self.inventory = inventory
        self.refreshed_at = self.clock()
        if self.placement_inventory is None:
            self.placement_inventory = inventory
        self._reconcile()

    def assigned_gpus(self, backend: Backend) -> tuple[Gpu, ...]:
        """The GPUs a backend was pinned to, resolved against the start-up inventory.

        Raises GpuRefError when a reference names no GPU of that inventory.
        """
        base = self.placement_inventory or self.inventory
        return tuple(base.resolve(ref) for ref in backend.gpus)

    def _reconcile(self) -> None:
        present: set[BackendId] = set()
        for backend in self.backends():
            present.add(backend.id)
            try:
                assigned = self.assigned_gpus(backend)
            except GpuRefError:
                continue
            gone = [g for g in assigned if (now := self.inventory.by_key(g.key)) is None or now.lost]
            if gone and backend.id not in self.losses:
                gpu = gone[0]
                self.losses[backend.id] = GpuLoss(backend.id, backend.model, gpu.key, gpu.label(), self.clock())
                log.warning("GPU %s is gone: backend %s (model %s) is marked", gpu.label(), backend.id, backend.model)
                if self.on_gpu_lost is not None:
                    try:
                        self.on_gpu_lost(backend, gpu)
                    except Exception:  # a listener's bug must not stop the marking
                        log.exception("on_gpu_lost listener failed for backend %s", backend.id)
            elif not gone and backend.id in self.losses:
                log.info("GPU %s is back: mark on backend %s cleared", self.losses[backend.id].gpu_label, backend.id)
                del self.losses[backend.id]
        for backend_id in [b for b in self.losses if b not in present]:
            del self.losses[backend_id]
        for backend_id in [b for b in self.placements if b not in present]:
            del self.placements[backend_id]

    async def async_handle_event(self, event: UdevEvent) -> GpuHotplug | None:
        """Apply one udev event; returns the GPU change it carried, or None when it carried none.

        A removal drops the GPU from the snapshot at once (no driver call: a GPU that fell
        off the bus can make NVML calls hang or fail) and resets the readers so the next
        refresh enumerates again; an addition re-reads every source.
        """
        change = gpu_hotplug_from(event)
        if change is None:
            return None
        self.events.append(HotplugRecord(change, self.clock()))
        log.warning("GPU %s at %s: %s", change.vendor.value, change.pci_bus_id, change.action)
        await asyncio.to_thread(self._reset_readers)
        if change.action == "remove":
            async with self._lock:
                gpus = tuple(g for g in self.inventory.gpus if g.pci_bus_id != change.pci_bus_id)
                self._set_inventory(replace(self.inventory, gpus=gpus))
        else:
            await self.async_refresh()
        return change

    def _reset_readers(self) -> None:
        for source in self.sources:
            reset = getattr(source, "reset", None)
            if reset is not None:
                reset()

    # -- placement ---------------------------------------------------------------------

    async def async_verify(self, backend: Backend) -> GpuPlacement:
        """Check that ``backend``'s process tree is on exactly its GPUs; recorded and logged."""
        pid = backend.pid
        try:
            expected = tuple(g.key for g in self.assigned_gpus(backend))
        except GpuRefError as exc:
            placement = GpuPlacement(PlacementVerdict.UNKNOWN, f"cannot resolve its GPUs: {exc}")
        else:
            if pid is None:
                placement = GpuPlacement(PlacementVerdict.UNKNOWN, "no pid known for the backend", expected)
            else:
                inventory = await self.async_refresh()
                tree, host = await asyncio.to_thread(process_tree, pid, self.proc_root)
                pids = await asyncio.to_thread(gpu_pids, inventory, tree, self.proc_root)
                placement = verify_placement(tree, expected, pids, host)
        previous = self.placements.get(backend.id)
        self.placements[backend.id] = PlacementRecord(pid, placement, self.clock())
        if previous is None or previous.placement.verdict is not placement.verdict or previous.pid != pid:
            level = logging.WARNING if placement.verdict is PlacementVerdict.MISMATCH else logging.INFO
            log.log(level, "backend %s (pid %s) GPU placement %s: %s", backend.id, pid,
                    placement.verdict.value, placement.reason)
        return placement

    def pending_verification(self) -> list[Backend]:
        """Healthy backends whose current process has not been verified yet."""
        out = []
        for backend in self.backends():
            if backend.state is not BackendState.HEALTHY or backend.pid is None:
                continue
            record = self.placements.get(backend.id)
            if record is None or record.pid != backend.pid:
                out.append(backend)
        return out

    # -- the long-lived task -----------------------------------------------------------

    async def async_run(self, *, interval_s: float = 10.0, hotplug: bool = True) -> None:
        """Refresh every ``interval_s``, verify newly healthy backends, follow udev events.

        Runs until cancelled. Without a netlink socket (containers) hot-plug is off and the
        periodic refresh still notices a vanished GPU.
        """
        async with asyncio.TaskGroup() as tasks:
            if hotplug:
                tasks.create_task(self._async_follow_udev(), name="gpus-udev")
            last_failure = None
            while True:
                try:
                    await self.async_refresh()
                    for backend in self.pending_verification():
                        await self.async_verify(backend)
                    last_failure = None
                except Exception as exc:  # a failing refresh must not end GPU monitoring
                    failure = f"{type(exc).__name__}: {exc}"
                    # The same fault every interval is logged once at WARNING, then at DEBUG.
                    log.log(logging.DEBUG if failure == last_failure else logging.WARNING,
                            "GPU refresh failed: %s", failure, exc_info=failure != last_failure)
                    last_failure = failure
                    self.last_error = failure
                await asyncio.sleep(interval_s)

    async def _async_follow_udev(self) -> None:
        try:
            events = UdevGpuEvents()
            await events.__aenter__()
        except Exception as exc:  # no netlink (container, seccomp): degrade to polling
            self.hotplug_available = False
            log.warning("GPU hot-plug events unavailable (%s); relying on periodic refresh", exc)
            return
        self.hotplug_available = True
        try:
            async for event in events:
                try:
                    await self.async_handle_event(event)
                except Exception:
                    log.exception("GPU hot-plug event failed")
        finally:
            await events.__aexit__(None, None, None)

    # -- reporting ---------------------------------------------------------------------

    def status_section(self) -> dict[str, Any]:
        """The ``gpus`` section of ``GET /v1/status``.

        Shape: ``{"sources": [{vendor, state, detail, driver_version}], "gpus": [Gpu.to_json()
        + {"backends": [backend ids pinned to it]}], "lost_backends": [{backend, model, gpu,
        age_s}], "placements": [{backend, pid, age_s, verdict, reason, expected, seen_on,
        missing_on, unexpected_on, unreadable}], "hotplug": {"available": bool|null,
        "events": [{action, vendor, pci_bus_id, age_s}]}, "refreshed_age_s": float|null,
        "error": the last refresh failure or null}``.
        """
        now = self.clock()
        pinned: dict[str, list[str]] = {}
        for backend in self.backends():
            try:
                for gpu in self.assigned_gpus(backend):
                    pinned.setdefault(gpu.key, []).append(backend.id)
            except GpuRefError:
                continue
        return {
            "sources": [s.to_json() for s in self.inventory.sources],
            "gpus": [{**g.to_json(), "backends": pinned.get(g.key, [])} for g in self.inventory.gpus],
            "lost_backends": [
                {"backend": lost.backend, "model": lost.model, "gpu": lost.gpu_label,
                 "age_s": round(now - lost.since, 1)}
                for lost in self.losses.values()],
            "placements": [
                {"backend": bid, "pid": r.pid, "age_s": round(now - r.at, 1), **r.placement.to_json()}
                for bid, r in self.placements.items()],
            "hotplug": {"available": self.hotplug_available, "events": [
                {"action": e.change.action, "vendor": e.change.vendor.value, "pci_bus_id": e.change.pci_bus_id,
                 "age_s": round(now - e.at, 1)} for e in self.events]},
            "refreshed_age_s": None if self.refreshed_at is None else round(now - self.refreshed_at, 1),
            "error": self.last_error,
        }
