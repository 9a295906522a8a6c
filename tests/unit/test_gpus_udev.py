"""udev: GPU recognition, a hot-plug remove/add sequence through the monitor, the real netlink path."""

from __future__ import annotations

import asyncio
import copy
import os
from pathlib import Path

import pytest
from conftest import require

from support.gpu_hosts import nvml_recording
from viiwork.agent.host.gpus.amd import AmdSysfsReader
from viiwork.agent.host.gpus.inventory import Vendor
from viiwork.agent.host.gpus.monitor import GpuMonitor
from viiwork.agent.host.gpus.nvml import NvmlReader
from viiwork.agent.host.gpus.nvml_record import ReplayNvml
from viiwork.agent.host.gpus.udev import (
    GpuHotplug,
    UdevEvent,
    UdevGpuEvents,
    enumerate_pci_gpus,
    gpu_hotplug_from,
    pci_gpu_from,
)
from viiwork.agent.supervision.backends import Backend, BackendId, BackendState

UUID0 = "GPU-5b1c7a4e-91f3-2d6e-8a0b-3c4d5e6f7a8b"
UUID1 = "GPU-0e6f2a19-4c7d-8b3a-5f1e-9d2c6b8a4e70"


def props(pci_class="30200", pci_id="10DE:2330", slot="0000:ca:00.0", **extra):
    return {"SUBSYSTEM": "pci", "PCI_CLASS": pci_class, "PCI_ID": pci_id, "PCI_SLOT_NAME": slot,
            "DEVPATH": f"/devices/pci0000:c9/0000:c9:01.0/{slot}", **extra}


@pytest.mark.parametrize(
    ("properties", "expected"),
    [
        (props(), (Vendor.NVIDIA, "0000:ca:00.0")),
        (props(pci_class="30000", pci_id="1002:744C", slot="0000:03:00.0"), (Vendor.AMD, "0000:03:00.0")),
        (props(pci_class="38000", pci_id="1002:740F"), (Vendor.AMD, "0000:ca:00.0")),
        (props(pci_class="30000", pci_id="8086:56A0"), None),           # Intel GPU: not ours
        (props(pci_class="40300", pci_id="10DE:22BA"), None),           # the card's HDMI audio function
        (props(pci_class="60400", pci_id="10DE:1AD8"), None),           # NVIDIA PCI bridge
        ({**props(), "SUBSYSTEM": "drm"}, None),
        ({**props(), "PCI_CLASS": "zz"}, None),
        ({k: v for k, v in props().items() if k != "PCI_SLOT_NAME"}, None),
    ],
    ids=["nvidia-3d", "amd-vga", "amd-display-other", "intel", "nvidia-audio", "nvidia-bridge", "not-pci",
         "bad-class", "no-slot"],
)
def test_pci_gpu_from(properties, expected):
    gpu = pci_gpu_from(properties)
    assert (None if gpu is None else (gpu.vendor, gpu.pci_bus_id)) == expected


@pytest.mark.parametrize(
    ("action", "expected"),
    [("add", "add"), ("bind", "add"), ("remove", "remove"), ("unbind", "remove"), ("change", None), ("", None)],
)
def test_gpu_hotplug_from_actions(action, expected):
    change = gpu_hotplug_from(UdevEvent(action, props()))
    assert (None if change is None else change.action) == expected


def backend(name, gpus, state=BackendState.HEALTHY):
    return Backend(id=BackendId(f"{name}-0"), model=name, index=0, gpus=tuple(gpus), state=state)


def one_device(rec):
    rec = copy.deepcopy(rec)
    rec["nvmlDeviceGetCount"] = 1
    rec["devices"] = rec["devices"][:1]
    return rec


async def test_remove_then_add_changes_inventory_and_marks_backends(tmp_path):
    full = nvml_recording("nvml-2x-h100")
    api = ReplayNvml(full)
    backends = [backend("a", ["0"]), backend("b", ["1"]), backend("c", [UUID1]), backend("cpu", [])]
    lost_calls: list[tuple[str, str]] = []
    monitor = GpuMonitor([NvmlReader(api), AmdSysfsReader(tmp_path)], backends=lambda: backends,
                         on_gpu_lost=lambda b, g: lost_calls.append((b.id, g.key)))
    await monitor.async_refresh()
    assert [g.index for g in monitor.inventory.gpus] == [0, 1]
    assert monitor.losses == {}

    # Not a GPU: nothing happens.
    assert await monitor.async_handle_event(UdevEvent("remove", props(pci_class="40300"))) is None
    assert len(monitor.inventory.gpus) == 2

    # GPU 1 is hot-removed; NVML would now enumerate one device.
    api.recording = one_device(full)
    change = await monitor.async_handle_event(UdevEvent("remove", props(slot="0000:ca:00.0")))
    assert change == GpuHotplug("remove", Vendor.NVIDIA, "0000:ca:00.0")
    assert [g.uuid for g in monitor.inventory.gpus] == [UUID0]
    assert set(monitor.losses) == {"b-0", "c-0"}
    assert sorted(lost_calls) == [("b-0", UUID1), ("c-0", UUID1)]
    section = monitor.status_section()
    assert {lost["backend"] for lost in section["lost_backends"]} == {"b-0", "c-0"}
    assert section["hotplug"]["events"][0]["action"] == "remove"

    # A periodic refresh (NVML re-enumerated: index 0 only) keeps the marks; index refs keep
    # meaning the GPUs present at start.
    await monitor.async_refresh()
    assert set(monitor.losses) == {"b-0", "c-0"}
    assert len(lost_calls) == 2

    # The GPU comes back.
    api.recording = copy.deepcopy(full)
    change = await monitor.async_handle_event(UdevEvent("add", props(slot="0000:ca:00.0")))
    assert change.action == "add"
    assert [g.uuid for g in monitor.inventory.gpus] == [UUID0, UUID1]
    assert monitor.losses == {}
    assert monitor.status_section()["gpus"][1]["backends"] == ["b-0", "c-0"]


async def test_gpu_lost_on_the_bus_marks_its_backends(tmp_path):
    api = ReplayNvml(nvml_recording("nvml-2x-h100"))
    backends = [backend("a", ["0"]), backend("b", ["1"])]
    monitor = GpuMonitor([NvmlReader(api), AmdSysfsReader(tmp_path)], backends=lambda: backends)
    await monitor.async_refresh()
    lost = nvml_recording("nvml-gpu-lost")
    rec = copy.deepcopy(api.recording)
    rec["devices"][1] = lost["devices"][1]
    api.recording = rec
    await monitor.async_refresh()
    assert set(monitor.losses) == {"b-0"}
    assert monitor.status_section()["gpus"][1]["lost"] is True


async def test_marks_of_backends_that_went_away_are_dropped(tmp_path):
    api = ReplayNvml(nvml_recording("nvml-2x-h100"))
    backends = [backend("b", ["1"])]
    monitor = GpuMonitor([NvmlReader(api), AmdSysfsReader(tmp_path)], backends=lambda: backends)
    await monitor.async_refresh()
    api.recording = one_device(api.recording)
    await monitor.async_handle_event(UdevEvent("unbind", props()))
    assert set(monitor.losses) == {"b-0"}
    backends.clear()
    await monitor.async_refresh()
    assert monitor.losses == {}


def test_enumerate_pci_gpus_on_this_machine():
    gpus = enumerate_pci_gpus()
    assert all(g.vendor in (Vendor.NVIDIA, Vendor.AMD) for g in gpus)
    assert [g.pci_bus_id for g in gpus] == sorted(g.pci_bus_id for g in gpus)


def _first_pci_uevent() -> Path | None:
    root = Path("/sys/bus/pci/devices")
    if not root.is_dir():
        return None
    for device in sorted(root.iterdir()):
        if os.access(device / "uevent", os.W_OK):
            return device / "uevent"
    return None


async def test_real_netlink_monitor_delivers_pci_events():
    """A synthetic "change" uevent on a PCI device reaches UdevGpuEvents and is ignored as not-a-GPU
    hot-plug. Needs root (writing a device's uevent file asks the kernel to re-announce it)."""
    uevent = _first_pci_uevent()
    require(os.geteuid() == 0 and uevent is not None, "needs root and a writable /sys/bus/pci/devices/*/uevent")
    slot = uevent.parent.name
    async with UdevGpuEvents() as events:
        uevent.write_text("change")

        async def next_for_slot():
            async for event in events:
                if event.properties.get("PCI_SLOT_NAME") == slot and event.action == "change":
                    return event

        event = await asyncio.wait_for(next_for_slot(), timeout=10)
    assert event.properties["SUBSYSTEM"] == "pci"
    assert gpu_hotplug_from(event) is None


async def test_run_refreshes_verifies_and_follows_udev(tmp_path):
    """The long-lived task: first refresh, verification of a healthy backend, hot-plug state."""
    rec = copy.deepcopy(nvml_recording("nvml-2x-h100"))
    rec["devices"][0]["nvmlDeviceGetComputeRunningProcesses"] = [{"pid": os.getpid(), "usedGpuMemory": 1 << 30}]
    me = Backend(id=BackendId("a-0"), model="a", index=0, gpus=("0",), state=BackendState.HEALTHY, pid=os.getpid())
    monitor = GpuMonitor([NvmlReader(ReplayNvml(rec)), AmdSysfsReader(tmp_path)], backends=lambda: [me])
    task = asyncio.create_task(monitor.async_run(interval_s=0.05))
    try:
        async with asyncio.timeout(10):
            while "a-0" not in monitor.placements or monitor.hotplug_available is None:
                await asyncio.sleep(0.01)
    finally:
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
    assert monitor.placements["a-0"].placement.verdict.value == "ok"
    section = monitor.status_section()
    assert section["hotplug"]["available"] in (True, False)
    assert [g["index"] for g in section["gpus"]] == [0, 1]
    assert section["gpus"][0]["backends"] == ["a-0"]


async def test_a_hung_driver_read_times_out_without_piling_up_threads(tmp_path):
    import threading

    from viiwork.agent.host.gpus.monitor import GpuReadTimeout

    release = threading.Event()
    calls = []

    class HangingNvml(NvmlReader):
        def read(self):
            calls.append(1)
            release.wait(10)
            return super().read()

    monitor = GpuMonitor([HangingNvml(ReplayNvml(nvml_recording("nvml-2x-h100")))], read_timeout_s=0.05)
    with pytest.raises(GpuReadTimeout, match="driver hung"):
        await monitor.async_refresh()
    with pytest.raises(GpuReadTimeout):
        await monitor.async_refresh()
    assert len(calls) == 1 and monitor.status_section()["error"].startswith("reading the GPUs took over")
    release.set()
    monitor.read_timeout_s = 10
    inventory = await monitor.async_refresh()
    assert len(inventory.gpus) == 2 and len(calls) == 1 and monitor.last_error is None


async def test_a_failing_loss_listener_does_not_stop_marking(tmp_path):
    api = ReplayNvml(nvml_recording("nvml-2x-h100"))
    backends = [backend("a", ["1"]), backend("b", ["1"])]

    def listener(b, g):
        raise RuntimeError("listener bug")

    monitor = GpuMonitor([NvmlReader(api)], backends=lambda: backends, on_gpu_lost=listener)
    await monitor.async_refresh()
    api.recording = one_device(api.recording)
    await monitor.async_handle_event(UdevEvent("remove", props()))
    assert set(monitor.losses) == {"a-0", "b-0"}
