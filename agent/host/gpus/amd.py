"""AMD GPUs through sysfs (the amdgpu driver), and which processes use them through /proc.

Read per card (``/sys/class/drm/cardN/device``, a PCI device; kernel amdgpu sysfs ABI):
``vendor`` (0x1002 is AMD), ``uevent`` (``PCI_SLOT_NAME``), ``mem_info_vram_total`` and
``mem_info_vram_used`` (bytes), ``gpu_busy_percent``, ``product_name``, ``unique_id``, and
the card's hwmon directory: ``power1_average`` or ``power1_input`` (microwatts) and
``temp1_input`` (edge sensor, millidegrees C). Each missing or unreadable file makes its
field ``None`` and is recorded in ``Gpu.unread``; the other fields are still read.

Processes: sysfs lists none. A process that opened a GPU's DRM node publishes it in
``/proc/PID/fdinfo/FD`` as ``drm-pdev: 0000:03:00.0`` (kernel drm-usage-stats), which is
what ``drm_devices_of_pid`` reads for placement checks.

The root path is injectable (``root``) so tests run on fake sysfs trees.
"""

from __future__ import annotations

import logging
import os
import re
from pathlib import Path

from viiwork.agent.host.gpus.inventory import Gpu, SourceState, SourceStatus, Vendor, normalize_bus_id

log = logging.getLogger(__name__)

AMD_PCI_VENDOR = 0x1002
_CARD = re.compile(r"^card\d+$")


def _read_text(path: Path) -> str:
    return path.read_text(encoding="ascii", errors="replace").strip()


class _Fields:
    """Reads sysfs files into fields, recording why a field is unknown."""

    def __init__(self) -> None:
        self.unread: dict[str, str] = {}

    def text(self, fields: tuple[str, ...], path: Path | None) -> str | None:
        if path is None:
            for f in fields:
                self.unread[f] = "no hwmon directory"
            return None
        try:
            return _read_text(path)
        except FileNotFoundError:
            reason = f"missing file {path.name}"
        except OSError as exc:
            reason = f"cannot read {path.name}: {exc.strerror or exc}"
        for f in fields:
            self.unread[f] = reason
        return None

    def integer(self, fields: tuple[str, ...], path: Path | None) -> int | None:
        raw = self.text(fields, path)
        if raw is None:
            return None
        try:
            return int(raw, 0)
        except ValueError:
            for f in fields:
                self.unread[f] = f"{path.name if path else '?'} is not a number: {raw[:40]!r}"
            return None


def _hwmon_dir(device: Path) -> Path | None:
    try:
        entries = sorted(p for p in (device / "hwmon").iterdir() if p.name.startswith("hwmon"))
    except OSError:
        return None
    return entries[0] if entries else None


def _bus_id(card_device: Path) -> str | None:
    try:
        for line in _read_text(card_device / "uevent").splitlines():
            key, _, value = line.partition("=")
            if key == "PCI_SLOT_NAME":
                return normalize_bus_id(value)
    except OSError:
        pass
    # Real sysfs: cardN/device is a link to the PCI device directory, named by its bus id.
    return normalize_bus_id(card_device.resolve().name)


class AmdSysfsReader:
    """Reads the AMD GPUs under ``root``/sys/class/drm; ``read()`` blocks (worker thread)."""

    vendor = Vendor.AMD

    def __init__(self, root: Path | str = "/") -> None:
        self.root = Path(root)

    def read(self) -> tuple[SourceStatus, tuple[Gpu, ...]]:
        """The source status and the AMD GPUs, indexed 0.. in PCI bus order."""
        drm = self.root / "sys/class/drm"
        try:
            cards = sorted((p for p in drm.iterdir() if _CARD.match(p.name)), key=lambda p: int(p.name[4:]))
        except FileNotFoundError:
            return SourceStatus(Vendor.AMD, SourceState.ABSENT, "no AMD GPU (no /sys/class/drm: no DRM driver loaded)"), ()
        except OSError as exc:
            return SourceStatus(Vendor.AMD, SourceState.ERROR, f"cannot list /sys/class/drm: {exc.strerror or exc}"), ()
        found: dict[str, Path] = {}
        unknown_bus: list[Path] = []
        for card in cards:
            device = card / "device"
            try:
                vendor = int(_read_text(device / "vendor"), 16)
            except (OSError, ValueError):
                continue
            if vendor != AMD_PCI_VENDOR:
                continue
            bus = _bus_id(device)
            if bus is None:
                unknown_bus.append(device)
            elif bus not in found:  # one PCI device can have several card nodes
                found[bus] = device
        devices = [found[b] for b in sorted(found)] + unknown_bus
        if not devices:
            return SourceStatus(Vendor.AMD, SourceState.ABSENT, "no AMD GPU (no card with vendor 0x1002 in /sys/class/drm)"), ()
        gpus = tuple(self._read_card(i, device) for i, device in enumerate(devices))
        version = None
        try:
            version = _read_text(self.root / "sys/module/amdgpu/version") or None
        except OSError:
            pass
        detail = f"amdgpu sysfs, driver {version}" if version else "amdgpu sysfs"
        return SourceStatus(Vendor.AMD, SourceState.OK, detail, version), gpus

    @staticmethod
    def _read_card(index: int, device: Path) -> Gpu:
        f = _Fields()
        total = f.integer(("memory_total_bytes", "memory_free_bytes"), device / "mem_info_vram_total")
        used = f.integer(("memory_used_bytes", "memory_free_bytes"), device / "mem_info_vram_used")
        busy = f.integer(("utilization_percent",), device / "gpu_busy_percent")
        hwmon = _hwmon_dir(device)
        power_uw = None
        if hwmon is not None and (hwmon / "power1_average").exists():
            power_uw = f.integer(("power_watts",), hwmon / "power1_average")
        else:
            # Newer kernels publish the instantaneous reading as power1_input only.
            power_uw = f.integer(("power_watts",), hwmon / "power1_input" if hwmon else None)
        temp_mc = f.integer(("temperature_c",), hwmon / "temp1_input" if hwmon else None)
        name = f.text(("name",), device / "product_name") or None
        if name is None:
            f.unread.setdefault("name", "product_name is empty")
        unique_id = f.text(("uuid",), device / "unique_id") or None
        if unique_id is None:
            f.unread.setdefault("uuid", "unique_id is empty")
        f.unread["processes"] = "sysfs lists no processes (placement reads /proc fdinfo)"
        return Gpu(
            vendor=Vendor.AMD,
            index=index,
            # ROCm reports this same id as the agent UUID "GPU-<unique_id>" (rocminfo).
            uuid=f"GPU-{unique_id}" if unique_id else None,
            name=name,
            pci_bus_id=_bus_id(device),
            memory_total_bytes=total,
            memory_used_bytes=used,
            memory_free_bytes=total - used if total is not None and used is not None else None,
            utilization_percent=busy,
            power_watts=None if power_uw is None else power_uw / 1_000_000,
            temperature_c=None if temp_mc is None else temp_mc / 1000,
            processes=None,
            unread=f.unread,
        )


def drm_devices_of_pid(pid: int, proc_root: Path | str = "/proc") -> frozenset[str] | None:
    """PCI bus ids of the DRM devices process ``pid`` has open (``fd`` links into /dev/dri,
    and each one's ``fdinfo`` ``drm-pdev``).

    Returns None when the process's fdinfo cannot be read (gone, or no permission), and
    an empty set when it has no DRM device open.
    """
    base = Path(proc_root) / str(pid)
    try:
        fds = os.listdir(base / "fd")
    except OSError:
        return None
    found: set[str] = set()
    for fd in fds:
        try:
            # Only DRM nodes carry drm-* keys; the link avoids reading every socket's fdinfo.
            if not os.readlink(base / "fd" / fd).startswith("/dev/dri/"):
                continue
            text = (base / "fdinfo" / fd).read_text(encoding="ascii", errors="replace")
        except OSError:
            continue  # closed between listdir and open
        for line in text.splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "drm-pdev":
                bus = normalize_bus_id(value.strip())
                if bus:
                    found.add(bus)
    return frozenset(found)
