"""On-GPU verification: is a backend's process tree on exactly the GPUs it was given?

The decision (``verify_placement``) is a pure function over observed facts; the readers
around it (``process_tree``, ``gpu_pids``) are thin and read /proc and the inventory.
The verdict is reported (``/v1/status``, the log), never acted on: a wrong placement is
the operator's to fix, and killing a backend on this evidence alone would be worse.

Verdicts: ``ok``; ``mismatch`` (the tree is on a GPU it was not given, or absent from one it
was given); ``unknown`` (nothing could be read: process gone, process lists unreadable,
GPU process ids from another PID namespace).
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path
from typing import Any

from viiwork.agent.host.gpus.amd import drm_devices_of_pid
from viiwork.agent.host.gpus.inventory import GpuInventory, Vendor


class PlacementVerdict(StrEnum):
    OK = "ok"
    MISMATCH = "mismatch"
    UNKNOWN = "unknown"


@dataclass(frozen=True, slots=True)
class GpuPlacement:
    """The outcome for one backend. GPU lists hold inventory keys (UUID, else ``pci:<bus id>``).

    expected: the GPUs the backend was given. seen_on: GPUs whose process list holds a pid of
    its tree. missing_on: given, readable, and the tree is not on it. unexpected_on: not
    given and the tree is on it. unreadable: GPUs whose process list could not be read.
    """

    verdict: PlacementVerdict
    reason: str
    expected: tuple[str, ...] = ()
    seen_on: tuple[str, ...] = ()
    missing_on: tuple[str, ...] = ()
    unexpected_on: tuple[str, ...] = ()
    unreadable: tuple[str, ...] = ()

    def to_json(self) -> dict[str, Any]:
        return {"verdict": self.verdict.value, "reason": self.reason, "expected": list(self.expected),
                "seen_on": list(self.seen_on), "missing_on": list(self.missing_on),
                "unexpected_on": list(self.unexpected_on), "unreadable": list(self.unreadable)}


def verify_placement(
    tree: frozenset[int],
    expected: Iterable[str],
    gpu_pids: Mapping[str, frozenset[int] | None],
    host_pids: frozenset[int] | None = None,
) -> GpuPlacement:
    """Decide where a backend runs, from facts only.

    tree: pids of the backend process and its descendants (empty: the process is gone).
    expected: keys of the GPUs it was given (empty: a CPU backend).
    gpu_pids: every GPU of the host -> pids using it, or None when unreadable.
    host_pids: pids that exist in this PID namespace; when the GPUs list only pids that do
        not, NVML is answering from another namespace (a container) and absence proves nothing.
    """
    expected_t = tuple(dict.fromkeys(expected))
    if not tree:
        return GpuPlacement(PlacementVerdict.UNKNOWN, "the backend process is not running", expected_t)
    readable = {k: v for k, v in gpu_pids.items() if v is not None}
    unreadable = tuple(k for k, v in gpu_pids.items() if v is None)
    gone = tuple(k for k in expected_t if k not in gpu_pids)
    seen_on = tuple(k for k, pids in readable.items() if pids & tree)
    missing_on = tuple(k for k in expected_t if k in readable and k not in seen_on) + gone
    unexpected_on = tuple(k for k in seen_on if k not in expected_t)
    facts = dict(expected=expected_t, seen_on=seen_on, missing_on=missing_on,
                 unexpected_on=unexpected_on, unreadable=unreadable)
    if gone:
        return GpuPlacement(PlacementVerdict.MISMATCH, f"assigned GPU(s) not on this host any more: {', '.join(gone)}",
                            **facts)
    if not seen_on and host_pids is not None and missing_on:
        listed = frozenset().union(*readable.values()) if readable else frozenset()
        if listed and not listed & host_pids:
            return GpuPlacement(PlacementVerdict.UNKNOWN,
                                "the GPU process lists hold no pid of this PID namespace (container?)", **facts)
    if unexpected_on or missing_on:
        parts = []
        if unexpected_on:
            parts.append(f"runs on GPU(s) it was not given: {', '.join(unexpected_on)}")
        if missing_on:
            parts.append(f"absent from GPU(s) it was given: {', '.join(missing_on)}")
        return GpuPlacement(PlacementVerdict.MISMATCH, "; ".join(parts), **facts)
    unread_expected = tuple(k for k in expected_t if k in unreadable)
    if unread_expected:
        return GpuPlacement(PlacementVerdict.UNKNOWN,
                            f"process list unreadable for GPU(s) {', '.join(unread_expected)}", **facts)
    if not readable and gpu_pids:
        return GpuPlacement(PlacementVerdict.UNKNOWN, "no GPU process list can be read", **facts)
    if not expected_t:
        return GpuPlacement(PlacementVerdict.OK, "CPU backend on no GPU", **facts)
    return GpuPlacement(PlacementVerdict.OK, "on exactly its assigned GPU(s)", **facts)


def _ppid_map(proc_root: Path) -> dict[int, int]:
    parents: dict[int, int] = {}
    for entry in os.listdir(proc_root):
        if not entry.isdigit():
            continue
        try:
            stat = (proc_root / entry / "stat").read_text(encoding="ascii", errors="replace")
        except OSError:
            continue  # exited while we looked
        # The command name (field 2) may contain spaces and parentheses: split after the last ')'.
        rest = stat[stat.rfind(")") + 2:].split()
        if len(rest) >= 2 and rest[1].lstrip("-").isdigit():
            parents[int(entry)] = int(rest[1])
    return parents


def process_tree(pid: int, proc_root: Path | str = "/proc") -> tuple[frozenset[int], frozenset[int]]:
    """The pids of ``pid`` and all its descendants, and every pid in this namespace.

    Reads each ``/proc/N/stat`` once (blocking: call from a worker thread). The tree is
    empty when ``pid`` does not exist.
    """
    parents = _ppid_map(Path(proc_root))
    if pid not in parents:
        return frozenset(), frozenset(parents)
    children: dict[int, list[int]] = {}
    for child, parent in parents.items():
        children.setdefault(parent, []).append(child)
    tree = {pid}
    todo = [pid]
    while todo:
        for child in children.get(todo.pop(), ()):
            if child not in tree:
                tree.add(child)
                todo.append(child)
    return frozenset(tree), frozenset(parents)


def gpu_pids(inventory: GpuInventory, tree: Iterable[int],
             proc_root: Path | str = "/proc") -> dict[str, frozenset[int] | None]:
    """Every GPU's key -> the pids using it (None when unreadable).

    NVIDIA: NVML's process list from the inventory. AMD: the DRM devices the tree's
    processes have open (``drm_devices_of_pid``), so only tree pids can appear; None
    for every AMD GPU when no tree process's fdinfo can be read.
    """
    out: dict[str, frozenset[int] | None] = {}
    amd = [g for g in inventory.gpus if g.vendor is Vendor.AMD]
    opened: dict[int, frozenset[str]] = {}
    if amd:
        for pid in tree:
            devices = drm_devices_of_pid(pid, proc_root)
            if devices is not None:
                opened[pid] = devices
    for gpu in inventory.gpus:
        if gpu.vendor is Vendor.NVIDIA:
            out[gpu.key] = None if gpu.processes is None else frozenset(p.pid for p in gpu.processes)
        elif not opened or gpu.pci_bus_id is None:
            out[gpu.key] = None
        else:
            out[gpu.key] = frozenset(pid for pid, devices in opened.items() if gpu.pci_bus_id in devices)
    return out
