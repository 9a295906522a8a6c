"""The GPU inventory: a frozen snapshot of the GPUs this host has, read from NVML and sysfs.

A ``Gpu`` carries what could be measured; every figure that could not be read is ``None``
(never 0, docs/architecture.md, rule 3) and the reason is kept in ``unread``. A ``GpuInventory`` also says,
per vendor, whether its source could be read at all (``SourceStatus``), so "no GPU here" and
"GPUs here but the driver cannot be read" stay different facts.

GPU references in the config (``models[].gpus``) are NVML indexes in PCI bus order or GPU
UUIDs (docs/architecture.md, "A backend's life"); ``GpuInventory.resolve`` turns one into a ``Gpu``.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any, Protocol


class Vendor(StrEnum):
    NVIDIA = "nvidia"
    AMD = "amd"


class SourceState(StrEnum):
    """Whether a vendor's source could be read."""

    OK = "ok"            # read; it may list zero GPUs
    ABSENT = "absent"    # no driver or no device: nothing to read (a CPU box)
    ERROR = "error"      # a driver is there but could not be read


@dataclass(frozen=True, slots=True)
class SourceStatus:
    """One vendor source: ``detail`` is human text ("no NVIDIA driver (...)", "NVML 550.54.15")."""

    vendor: Vendor
    state: SourceState
    detail: str
    driver_version: str | None = None

    def to_json(self) -> dict[str, Any]:
        return {"vendor": self.vendor.value, "state": self.state.value, "detail": self.detail,
                "driver_version": self.driver_version}


@dataclass(frozen=True, slots=True)
class GpuProcess:
    """A process holding a context on a GPU: ``used_memory_bytes`` None when not reported."""

    pid: int
    used_memory_bytes: int | None = None


@dataclass(frozen=True, slots=True)
class Gpu:
    """One GPU as read now.

    Fields:
        vendor: NVIDIA or AMD.
        index: NVIDIA: the NVML index (PCI bus order, what ``CUDA_VISIBLE_DEVICES`` means
            under ``CUDA_DEVICE_ORDER=PCI_BUS_ID``); AMD: the position among this host's AMD
            GPUs in PCI bus order (ROCm's enumeration order).
        uuid: "GPU-..." or None when unreadable.
        name: marketing name, or None.
        pci_bus_id: normalised "dddd:bb:dd.f" (lowercase), or None.
        memory_total_bytes / memory_used_bytes / memory_free_bytes: device memory, or None.
        utilization_percent: 0..100 busy over the driver's last sample period, or None.
        power_watts: current draw in watts, or None.
        temperature_c: GPU core (NVIDIA) or edge (AMD) temperature in °C, or None.
        processes: the processes on it, or None when the list cannot be read (AMD sysfs
            publishes none; placement checks read /proc fdinfo instead).
        lost: the driver reports the GPU lost (fallen off the bus), or it was hot-removed.
        unread: field name -> why it could not be read ("Not Supported", "missing file").
    """

    vendor: Vendor
    index: int
    uuid: str | None = None
    name: str | None = None
    pci_bus_id: str | None = None
    memory_total_bytes: int | None = None
    memory_used_bytes: int | None = None
    memory_free_bytes: int | None = None
    utilization_percent: int | None = None
    power_watts: float | None = None
    temperature_c: float | None = None
    processes: tuple[GpuProcess, ...] | None = None
    lost: bool = False
    unread: Mapping[str, str] = field(default_factory=dict)

    @property
    def key(self) -> str:
        """A stable identity across refreshes: the UUID, else the PCI bus id, else vendor#index."""
        if self.uuid:
            return self.uuid
        if self.pci_bus_id:
            return f"pci:{self.pci_bus_id}"
        return f"{self.vendor.value}#{self.index}"

    def label(self) -> str:
        """``0 (NVIDIA H100 80GB HBM3, GPU-5b1c..., 0000:17:00.0)``: index and what identifies it."""
        parts = [p for p in (self.name, self.uuid, self.pci_bus_id) if p]
        prefix = f"{self.vendor.value}:{self.index}" if self.vendor is not Vendor.NVIDIA else str(self.index)
        return f"{prefix} ({', '.join(parts)})" if parts else prefix

    def to_json(self) -> dict[str, Any]:
        return {
            "vendor": self.vendor.value,
            "index": self.index,
            "uuid": self.uuid,
            "name": self.name,
            "pci_bus_id": self.pci_bus_id,
            "memory_total_bytes": self.memory_total_bytes,
            "memory_used_bytes": self.memory_used_bytes,
            "memory_free_bytes": self.memory_free_bytes,
            "utilization_percent": self.utilization_percent,
            "power_watts": self.power_watts,
            "temperature_c": self.temperature_c,
            "processes": None if self.processes is None else [
                {"pid": p.pid, "used_memory_bytes": p.used_memory_bytes} for p in self.processes],
            "lost": self.lost,
            "unread": dict(self.unread),
        }


class GpuRefError(ValueError):
    """A ``gpus`` entry that names no GPU of this host (or names it ambiguously)."""


_BUS_ID = re.compile(r"^(?:([0-9a-fA-F]{1,8}):)?([0-9a-fA-F]{1,2}):([0-9a-fA-F]{1,2})\.([0-7])$")


def normalize_bus_id(text: str | None) -> str | None:
    """PCI bus id in sysfs form ``dddd:bb:dd.f`` (lowercase, 4-digit domain).

    NVML writes ``00000000:17:00.0`` (8-digit domain, upper case); sysfs and udev write
    ``0000:17:00.0``. Returns None for None or text that is not a bus id.
    """
    if not text:
        return None
    m = _BUS_ID.match(text.strip())
    if not m:
        return None
    domain = int(m.group(1) or "0", 16)
    return f"{domain:04x}:{int(m.group(2), 16):02x}:{int(m.group(3), 16):02x}.{m.group(4)}"


@dataclass(frozen=True, slots=True)
class GpuInventory:
    """A snapshot: the GPUs (NVIDIA first, then AMD, each in index order) and each source's state."""

    gpus: tuple[Gpu, ...] = ()
    sources: tuple[SourceStatus, ...] = ()

    def of(self, vendor: Vendor) -> tuple[Gpu, ...]:
        return tuple(g for g in self.gpus if g.vendor is vendor)

    def source(self, vendor: Vendor) -> SourceStatus | None:
        for s in self.sources:
            if s.vendor is vendor:
                return s
        return None

    @property
    def vendors(self) -> tuple[Vendor, ...]:
        """Vendors with at least one GPU here, in inventory order."""
        seen: list[Vendor] = []
        for g in self.gpus:
            if g.vendor not in seen:
                seen.append(g.vendor)
        return tuple(seen)

    def by_key(self, key: str) -> Gpu | None:
        for g in self.gpus:
            if g.key == key:
                return g
        return None

    def by_bus_id(self, bus_id: str) -> Gpu | None:
        wanted = normalize_bus_id(bus_id)
        for g in self.gpus:
            if wanted is not None and g.pci_bus_id == wanted:
                return g
        return None

    def resolve(self, ref: int | str) -> Gpu:
        """The GPU a config entry names.

        ``ref``: an int (or a string of digits) is an index: the NVML index on an NVIDIA box,
        the AMD index on an AMD box; on a box with both vendors an index is ambiguous and a
        UUID is required. Any other string is a UUID, compared case-insensitively.
        Raises GpuRefError naming what is wrong; the caller adds the list of GPUs.
        """
        if isinstance(ref, bool):
            raise GpuRefError(f"GPU {ref!r} is neither an index nor a UUID")
        text = str(ref).strip()
        if isinstance(ref, int) or text.isdigit():
            index = int(text)
            vendors = self.vendors
            if len(vendors) > 1:
                raise GpuRefError(
                    f"GPU {index} is ambiguous on a host with {' and '.join(v.value for v in vendors)} GPUs; "
                    "name GPUs by UUID")
            for g in self.gpus:
                if g.index == index:
                    return g
            raise GpuRefError(f"GPU {index} does not exist on this host")
        for g in self.gpus:
            if g.uuid and g.uuid.lower() == text.lower():
                return g
        raise GpuRefError(f"no GPU with UUID {text!r} on this host")

    def describe(self) -> str:
        """One line for error messages: the GPUs, or why there are none."""
        if self.gpus:
            return "; ".join(g.label() for g in self.gpus)
        why = "; ".join(f"{s.vendor.value}: {s.detail}" for s in self.sources)
        return f"none ({why})" if why else "none"

    def to_json(self) -> dict[str, Any]:
        return {"sources": [s.to_json() for s in self.sources], "gpus": [g.to_json() for g in self.gpus]}


class GpuSource(Protocol):
    """A vendor reader: ``read()`` blocks (NVML, sysfs) and never raises for a missing driver."""

    def read(self) -> tuple[SourceStatus, tuple[Gpu, ...]]: ...


def read_inventory(sources: Iterable[GpuSource]) -> GpuInventory:
    """Read every source (blocking) into one snapshot; a reader that raises becomes an ERROR source.

    The vendor of a crashed reader is taken from its ``vendor`` attribute when it has one.
    """
    gpus: list[Gpu] = []
    statuses: list[SourceStatus] = []
    for source in sources:
        try:
            status, found = source.read()
        except Exception as exc:  # one broken reader must not hide the other vendor's GPUs
            vendor = getattr(source, "vendor", None)
            if not isinstance(vendor, Vendor):
                raise
            status, found = SourceStatus(vendor, SourceState.ERROR, f"reader failed: {type(exc).__name__}: {exc}"), ()
        statuses.append(status)
        gpus.extend(found)
    return GpuInventory(tuple(gpus), tuple(statuses))


def read_inventory_once(sources: list[GpuSource]) -> GpuInventory:
    """``read_inventory`` for a one-off look (doctor, ``viiworkctl init``): each source's
    ``close()``, where it has one, is called afterwards (NVML's shutdown), even on error."""
    try:
        return read_inventory(sources)
    finally:
        for source in sources:
            close = getattr(source, "close", None)
            if close is not None:
                close()


async def async_read_inventory(sources: Iterable[GpuSource]) -> GpuInventory:
    """``read_inventory`` in a worker thread: NVML and sysfs reads block."""
    return await asyncio.to_thread(read_inventory, list(sources))
