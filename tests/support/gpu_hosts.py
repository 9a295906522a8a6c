"""GPU hosts that are not here: NVML recordings and fake sysfs/proc trees.

NVML recordings live in ``tests/unit/fixtures/gpus`` (``nvml-*.json``; shapes as pynvml
returns them, see viiwork.agent.host.gpus.nvml_record). Fake sysfs trees mirror the kernel's
layout: ``sys/class/drm/cardN`` links into ``sys/devices/pci0000:00/<bus>/drm/cardN``, whose
``device`` link points back at the PCI device directory holding the amdgpu files.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

FIXTURES = Path(__file__).resolve().parent.parent / "unit" / "fixtures" / "gpus"


def nvml_recording(name: str) -> dict[str, Any]:
    """A recording by file stem, e.g. ``nvml-2x-h100``."""
    return json.loads((FIXTURES / f"{name}.json").read_text())


AMD_FILES: dict[str, str] = {
    "vendor": "0x1002",
    "device": "0x744c",
    "mem_info_vram_total": "25753026560",
    "mem_info_vram_used": "1090519040",
    "gpu_busy_percent": "3",
    "product_name": "",
    "unique_id": "7f2c5a1d0b3e4c8a",
}
AMD_HWMON: dict[str, str] = {
    "name": "amdgpu",
    "power1_average": "35000000",
    "temp1_input": "41000",
    "temp1_label": "edge",
}


def write_drm_card(root: Path, card: int, bus_id: str, *, files: dict[str, str | None] | None = None,
                   hwmon: dict[str, str | None] | None = None, pci_class: str = "30000",
                   driver: str = "amdgpu") -> Path:
    """Create ``cardN`` for the PCI device ``bus_id`` under ``root``; returns the device dir.

    ``files``/``hwmon`` override the AMD defaults; a value of None leaves that file out;
    ``hwmon={}`` with every key None still creates the directory, ``hwmon=None`` keeps defaults.
    """
    merged = {**AMD_FILES, **(files or {})}
    device = root / "sys/devices/pci0000:00" / bus_id
    device.mkdir(parents=True, exist_ok=True)
    vendor = merged.get("vendor") or "0x1002"
    ident = merged.get("device") or "0x0000"
    (device / "uevent").write_text(
        f"DRIVER={driver}\nPCI_CLASS={pci_class}\nPCI_ID={vendor[2:].upper()}:{ident[2:].upper()}\n"
        f"PCI_SLOT_NAME={bus_id}\n")
    for name, value in merged.items():
        if value is not None:
            (device / name).write_text(value + "\n")
    hw = {**AMD_HWMON, **(hwmon or {})}
    hwdir = device / "hwmon" / f"hwmon{card + 2}"
    hwdir.mkdir(parents=True, exist_ok=True)
    for name, value in hw.items():
        if value is not None:
            (hwdir / name).write_text(value + "\n")
    node = device / "drm" / f"card{card}"
    node.mkdir(parents=True, exist_ok=True)
    if not (node / "device").is_symlink():
        os.symlink(f"../../../{bus_id}", node / "device")
    cls = root / "sys/class/drm"
    cls.mkdir(parents=True, exist_ok=True)
    link = cls / f"card{card}"
    if not link.is_symlink():
        os.symlink(f"../../devices/pci0000:00/{bus_id}/drm/card{card}", link)
    return device


def write_fake_proc(root: Path, processes: dict[int, tuple[int, dict[int, str | None]]]) -> Path:
    """A /proc with ``stat``, ``fd`` links and ``fdinfo`` per pid.

    processes: pid -> (ppid, {fd: drm-pdev bus id for a /dev/dri node, or None for a socket}).
    """
    proc = root / "proc"
    for pid, (ppid, fds) in processes.items():
        base = proc / str(pid)
        (base / "fd").mkdir(parents=True, exist_ok=True)
        (base / "fdinfo").mkdir(parents=True, exist_ok=True)
        (base / "stat").write_text(f"{pid} (eng ine) S {ppid} {pid} {pid} 0 -1 4194560 0 0\n")
        for fd, bus in fds.items():
            target = f"/dev/dri/renderD{128 + fd}" if bus else "socket:[12345]"
            os.symlink(target, base / "fd" / str(fd))
            info = "pos:\t0\nflags:\t02100002\nmnt_id:\t25\n"
            if bus:
                info += f"drm-driver:\tamdgpu\ndrm-pdev:\t{bus}\ndrm-client-id:\t{fd}\ndrm-memory-vram:\t1024 KiB\n"
            (base / "fdinfo" / str(fd)).write_text(info)
    return proc
