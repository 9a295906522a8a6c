"""GPU devices on the PCI bus through udev (``pyudev``): enumeration and hot-plug events.

A GPU is a PCI device of the display class (class code 0x03xxxx: VGA, 3D controller, other
display) from NVIDIA (vendor 0x10de) or AMD (0x1002). Udev sees it whether or not a driver
is bound, so enumeration answers "is there a GPU here at all" when NVML cannot.

Hot-plug: ``add``/``bind`` and ``remove``/``unbind`` events of such devices become
``GpuHotplug`` facts (``gpu_hotplug_from``, a pure function over the event's properties,
which the kernel includes even for a removed device). ``UdevGpuEvents`` delivers them on
the event loop from a netlink monitor (udevd's events where udevd runs, else the kernel's).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from viiwork.agent.host.gpus.inventory import Vendor, normalize_bus_id

log = logging.getLogger(__name__)

PCI_VENDORS: dict[int, Vendor] = {0x10DE: Vendor.NVIDIA, 0x1002: Vendor.AMD}
_DISPLAY_CLASS = 0x03
_ACTIONS = {"add": "add", "bind": "add", "remove": "remove", "unbind": "remove"}


@dataclass(frozen=True, slots=True)
class UdevEvent:
    """A udev event as facts: ``action`` and the device's properties (udev's names)."""

    action: str
    properties: Mapping[str, str]

    @classmethod
    def from_device(cls, device: Any) -> UdevEvent:
        """From a ``pyudev.Device`` delivered by a monitor."""
        return cls(device.action or "", dict(device.properties))


@dataclass(frozen=True, slots=True)
class PciGpu:
    """A GPU on the PCI bus: ``pci_id`` "10DE:2330", ``driver`` bound (None: no driver)."""

    vendor: Vendor
    pci_bus_id: str
    pci_id: str
    driver: str | None

    def to_json(self) -> dict[str, Any]:
        return {"vendor": self.vendor.value, "pci_bus_id": self.pci_bus_id, "pci_id": self.pci_id,
                "driver": self.driver}


@dataclass(frozen=True, slots=True)
class GpuHotplug:
    """A GPU appeared (``add``) or went away (``remove``) at ``pci_bus_id``."""

    action: str
    vendor: Vendor
    pci_bus_id: str


def pci_gpu_from(properties: Mapping[str, str]) -> PciGpu | None:
    """The GPU a PCI device's udev properties describe, or None when it is not a GPU.

    Uses ``SUBSYSTEM`` (pci), ``PCI_CLASS`` (hex class code, e.g. "30200"), ``PCI_ID``
    ("VVVV:DDDD"), ``PCI_SLOT_NAME`` and ``DRIVER``.
    """
    if properties.get("SUBSYSTEM", "pci") != "pci":
        return None
    try:
        pci_class = int(properties.get("PCI_CLASS", ""), 16)
        vendor_id = int(properties.get("PCI_ID", "").partition(":")[0], 16)
    except ValueError:
        return None
    if pci_class >> 16 != _DISPLAY_CLASS or vendor_id not in PCI_VENDORS:
        return None
    bus = normalize_bus_id(properties.get("PCI_SLOT_NAME"))
    if bus is None:
        return None
    return PciGpu(PCI_VENDORS[vendor_id], bus, properties.get("PCI_ID", ""), properties.get("DRIVER") or None)


def gpu_hotplug_from(event: UdevEvent) -> GpuHotplug | None:
    """The hot-plug fact in a udev event, or None (not a GPU, or an action that changes nothing)."""
    action = _ACTIONS.get(event.action)
    if action is None:
        return None
    gpu = pci_gpu_from(event.properties)
    if gpu is None:
        return None
    return GpuHotplug(action, gpu.vendor, gpu.pci_bus_id)


def enumerate_pci_gpus(context: Any = None) -> tuple[PciGpu, ...]:
    """The NVIDIA and AMD GPUs udev knows on the PCI bus, in bus order (blocking, reads sysfs)."""
    import pyudev

    context = context or pyudev.Context()
    found = []
    for device in context.list_devices(subsystem="pci"):
        props = dict(device.properties)
        if "DRIVER" not in props and device.driver:
            props["DRIVER"] = device.driver
        gpu = pci_gpu_from(props)
        if gpu is not None:
            found.append(gpu)
    return tuple(sorted(found, key=lambda g: g.pci_bus_id))


def _monitor_source() -> str:
    # udevd's own event stream exists only where udevd runs; the kernel's always does.
    return "udev" if Path("/run/udev/control").exists() else "kernel"


class UdevGpuEvents:
    """Async iterator of PCI ``UdevEvent``s from a netlink monitor, on the running loop.

    ``async with UdevGpuEvents() as events: async for event in events: ...``. The monitor's
    socket is watched with ``loop.add_reader``; nothing blocks the loop. Events are not
    filtered to GPUs here (``gpu_hotplug_from`` does that), so a test can see any PCI event.
    """

    def __init__(self, source: str | None = None, max_queue: int = 256) -> None:
        self.source = source or _monitor_source()
        self._queue: asyncio.Queue[UdevEvent] = asyncio.Queue(max_queue)
        self._monitor: Any = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self.dropped = 0

    async def __aenter__(self) -> UdevGpuEvents:
        import pyudev

        context = pyudev.Context()
        self._monitor = pyudev.Monitor.from_netlink(context, source=self.source)
        self._monitor.filter_by("pci")
        self._monitor.start()
        self._loop = asyncio.get_running_loop()
        self._loop.add_reader(self._monitor.fileno(), self._on_readable)
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self._loop is not None and self._monitor is not None:
            self._loop.remove_reader(self._monitor.fileno())
        self._monitor = None

    def _on_readable(self) -> None:
        # Drain what is ready without blocking: poll(timeout=0) returns None when empty.
        while self._monitor is not None:
            device = self._monitor.poll(timeout=0)
            if device is None:
                return
            try:
                self._queue.put_nowait(UdevEvent.from_device(device))
            except asyncio.QueueFull:
                self.dropped += 1
                if self.dropped == 1:
                    log.warning("udev event queue full; dropping events (GPU refresh still runs)")

    def __aiter__(self) -> AsyncIterator[UdevEvent]:
        return self

    async def __anext__(self) -> UdevEvent:
        return await self._queue.get()
