"""GPU device nodes in /dev (nvidiaN, /dev/kfd, /dev/dri/renderD*), read under a given root."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True, slots=True)
class DeviceNodes:
    """GPU device nodes in /dev: ``nvidia`` (nvidiaN, nvidiactl), ``kfd`` (/dev/kfd, ROCm),
    ``dri_render`` (/dev/dri/renderD*)."""

    nvidia: tuple[str, ...] = ()
    kfd: bool = False
    dri_render: tuple[str, ...] = ()


_NVIDIA_NODE = re.compile(r"^nvidia(\d+|ctl)$")


def read_device_nodes(dev_root: str | Path = "/dev") -> DeviceNodes:
    """The GPU device nodes under ``dev_root``; an unreadable directory reads as no nodes."""
    dev = Path(dev_root)
    try:
        nvidia = tuple(sorted(str(dev / n) for n in os.listdir(dev) if _NVIDIA_NODE.match(n)))
    except OSError:
        nvidia = ()
    try:
        render = tuple(sorted(str(dev / "dri" / n) for n in os.listdir(dev / "dri") if n.startswith("renderD")))
    except OSError:
        render = ()
    return DeviceNodes(nvidia, (dev / "kfd").exists(), render)
