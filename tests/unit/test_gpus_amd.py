"""The AMD sysfs reader on fake sysfs trees, and DRM fdinfo reading on fake /proc trees."""

from __future__ import annotations

from pathlib import Path

import pytest

from support.gpu_hosts import write_drm_card, write_fake_proc
from viiwork.agent.host.gpus.amd import AmdSysfsReader, drm_devices_of_pid
from viiwork.agent.host.gpus.inventory import SourceState, Vendor


def test_one_card_every_field(tmp_path):
    write_drm_card(tmp_path, 0, "0000:03:00.0", files={"product_name": "AMD Radeon RX 7900 XTX"})
    status, (gpu,) = AmdSysfsReader(tmp_path).read()
    assert status.state is SourceState.OK and status.vendor is Vendor.AMD
    assert gpu.vendor is Vendor.AMD and gpu.index == 0
    assert gpu.pci_bus_id == "0000:03:00.0"
    assert gpu.name == "AMD Radeon RX 7900 XTX"
    assert gpu.uuid == "GPU-7f2c5a1d0b3e4c8a"
    assert gpu.memory_total_bytes == 25753026560
    assert gpu.memory_used_bytes == 1090519040
    assert gpu.memory_free_bytes == 25753026560 - 1090519040
    assert gpu.utilization_percent == 3
    assert gpu.power_watts == 35.0
    assert gpu.temperature_c == 41.0
    assert gpu.processes is None and "processes" in gpu.unread
    assert set(gpu.unread) == {"processes"}


def test_two_cards_indexed_in_bus_order_and_other_vendors_skipped(tmp_path):
    # card numbers run against bus order; card0 is a virtio framebuffer, not a GPU we use.
    write_drm_card(tmp_path, 0, "0000:00:02.0", files={"vendor": "0x1af4", "device": "0x1050"}, driver="virtio-pci")
    write_drm_card(tmp_path, 1, "0000:c3:00.0", files={"unique_id": "aaaa000000000001"})
    write_drm_card(tmp_path, 2, "0000:43:00.0", files={"unique_id": "bbbb000000000002"})
    status, gpus = AmdSysfsReader(tmp_path).read()
    assert status.state is SourceState.OK
    assert [(g.index, g.pci_bus_id, g.uuid) for g in gpus] == [
        (0, "0000:43:00.0", "GPU-bbbb000000000002"),
        (1, "0000:c3:00.0", "GPU-aaaa000000000001"),
    ]


def test_missing_files_degrade_their_own_fields(tmp_path):
    write_drm_card(tmp_path, 0, "0000:03:00.0",
                   files={"mem_info_vram_used": None, "gpu_busy_percent": None, "unique_id": None, "product_name": None},
                   hwmon={"power1_average": None, "temp1_input": "garbage"})
    _, (gpu,) = AmdSysfsReader(tmp_path).read()
    assert gpu.memory_total_bytes == 25753026560
    assert gpu.memory_used_bytes is None and gpu.memory_free_bytes is None
    assert gpu.utilization_percent is None and gpu.power_watts is None and gpu.temperature_c is None
    assert gpu.uuid is None and gpu.name is None
    assert gpu.unread["memory_used_bytes"] == "missing file mem_info_vram_used"
    assert gpu.unread["utilization_percent"] == "missing file gpu_busy_percent"
    assert gpu.unread["power_watts"] == "missing file power1_input"
    assert gpu.unread["temperature_c"] == "temp1_input is not a number: 'garbage'"
    assert gpu.pci_bus_id == "0000:03:00.0"


def test_no_hwmon_directory(tmp_path):
    device = write_drm_card(tmp_path, 0, "0000:03:00.0")
    for f in (device / "hwmon").rglob("*"):
        if f.is_file():
            f.unlink()
    for d in sorted((device / "hwmon").rglob("*"), reverse=True):
        d.rmdir()
    (device / "hwmon").rmdir()
    _, (gpu,) = AmdSysfsReader(tmp_path).read()
    assert gpu.power_watts is None and gpu.temperature_c is None
    assert gpu.unread["power_watts"] == "no hwmon directory"
    assert gpu.memory_total_bytes is not None


def test_power_input_when_no_average(tmp_path):
    write_drm_card(tmp_path, 0, "0000:03:00.0", hwmon={"power1_average": None, "power1_input": "212500000"})
    _, (gpu,) = AmdSysfsReader(tmp_path).read()
    assert gpu.power_watts == 212.5


def test_two_card_nodes_of_one_device_are_one_gpu(tmp_path):
    write_drm_card(tmp_path, 0, "0000:03:00.0")
    write_drm_card(tmp_path, 1, "0000:03:00.0")
    _, gpus = AmdSysfsReader(tmp_path).read()
    assert len(gpus) == 1


def test_bus_id_from_the_device_link_without_uevent(tmp_path):
    device = write_drm_card(tmp_path, 0, "0000:0b:00.0")
    (device / "uevent").unlink()
    _, (gpu,) = AmdSysfsReader(tmp_path).read()
    assert gpu.pci_bus_id == "0000:0b:00.0"


@pytest.mark.parametrize(
    ("layout", "state", "detail"),
    [
        ("none", SourceState.ABSENT, "no AMD GPU (no /sys/class/drm: no DRM driver loaded)"),
        ("empty", SourceState.ABSENT, "no AMD GPU (no card with vendor 0x1002 in /sys/class/drm)"),
        ("other-vendor", SourceState.ABSENT, "no AMD GPU (no card with vendor 0x1002 in /sys/class/drm)"),
    ],
)
def test_no_amd_gpu(tmp_path, layout, state, detail):
    if layout == "empty":
        (tmp_path / "sys/class/drm").mkdir(parents=True)
    elif layout == "other-vendor":
        write_drm_card(tmp_path, 0, "0000:00:02.0", files={"vendor": "0x8086"}, driver="i915")
    status, gpus = AmdSysfsReader(tmp_path).read()
    assert (status.state, status.detail, gpus) == (state, detail, ())


def test_driver_version_when_published(tmp_path):
    write_drm_card(tmp_path, 0, "0000:03:00.0")
    (tmp_path / "sys/module/amdgpu").mkdir(parents=True)
    (tmp_path / "sys/module/amdgpu/version").write_text("6.7.0\n")
    status, _ = AmdSysfsReader(tmp_path).read()
    assert status.driver_version == "6.7.0" and status.detail == "amdgpu sysfs, driver 6.7.0"


def test_real_sysfs_on_this_machine():
    status, gpus = AmdSysfsReader("/").read()
    if not Path("/sys/class/drm").exists():
        assert status.state is SourceState.ABSENT and gpus == ()
    else:
        assert (status.state is SourceState.OK) == bool(gpus)


def test_drm_devices_of_pid(tmp_path):
    proc = write_fake_proc(tmp_path, {
        100: (1, {3: None, 7: "0000:03:00.0", 8: "0000:43:00.0"}),
        101: (100, {4: None}),
    })
    assert drm_devices_of_pid(100, proc) == frozenset({"0000:03:00.0", "0000:43:00.0"})
    assert drm_devices_of_pid(101, proc) == frozenset()
    assert drm_devices_of_pid(999, proc) is None


def test_drm_devices_of_a_real_process_without_gpu():
    import os

    assert drm_devices_of_pid(os.getpid()) == frozenset()
