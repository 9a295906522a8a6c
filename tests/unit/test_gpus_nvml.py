"""The NVML reader on recorded answers (incl. per-field Not Supported) and on the real library."""

from __future__ import annotations

import copy
import ctypes.util

import pynvml
import pytest

from support.gpu_hosts import nvml_recording
from viiwork.agent.host.gpus.inventory import SourceState, Vendor, normalize_bus_id
from viiwork.agent.host.gpus.nvml import NvmlReader
from viiwork.agent.host.gpus.nvml_record import FORMAT, RecordingError, ReplayNvml, record_nvml


def read(name_or_recording):
    rec = nvml_recording(name_or_recording) if isinstance(name_or_recording, str) else name_or_recording
    return NvmlReader(ReplayNvml(rec)).read()


def test_two_h100_every_field_read():
    status, gpus = read("nvml-2x-h100")
    assert status.state is SourceState.OK
    assert status.driver_version == "550.54.15"
    assert [g.index for g in gpus] == [0, 1]
    g0, g1 = gpus
    assert g0.vendor is Vendor.NVIDIA
    assert g0.uuid == "GPU-5b1c7a4e-91f3-2d6e-8a0b-3c4d5e6f7a8b"
    assert g0.name == "NVIDIA H100 80GB HBM3"
    assert g0.pci_bus_id == "0000:17:00.0"
    assert g1.pci_bus_id == "0000:ca:00.0"
    assert g0.memory_total_bytes == 85520809984
    assert g0.memory_used_bytes == 72313143296
    assert g0.memory_free_bytes == 85520809984 - 72313143296
    assert g0.utilization_percent == 87
    assert g0.power_watts == pytest.approx(612.345)
    assert g0.temperature_c == 61.0
    assert [(p.pid, p.used_memory_bytes) for p in g0.processes] == [(41234, 71777124352)]
    assert g1.processes == ()
    assert not g0.lost and g0.unread == {}


def test_not_supported_fields_are_none_each_alone():
    status, (gpu,) = read("nvml-consumer-not-supported")
    assert status.state is SourceState.OK
    assert gpu.utilization_percent is None
    assert gpu.power_watts is None
    # The fields next to them are still read.
    assert gpu.temperature_c == 48.0
    assert gpu.memory_total_bytes == 11811160064
    assert gpu.unread["utilization_percent"].startswith("Not Supported")
    assert gpu.unread["power_watts"].startswith("Not Supported")
    assert "temperature_c" not in gpu.unread
    # Process memory the driver does not report is None, not 0; the graphics list being
    # unsupported does not make the compute list unknown.
    assert [(p.pid, p.used_memory_bytes) for p in gpu.processes] == [(3124, None)]
    assert "graphics_processes" in gpu.unread


def test_a_lost_gpu_is_marked_and_reads_nothing():
    status, (ok, lost) = read("nvml-gpu-lost")
    assert status.state is SourceState.OK
    assert not ok.lost and ok.uuid
    assert lost.lost
    assert lost.uuid is None and lost.memory_total_bytes is None and lost.processes is None
    assert lost.unread["uuid"].startswith("GPU is lost")
    assert lost.key == "nvidia#1"


@pytest.mark.parametrize(
    ("fixture", "state", "detail"),
    [
        ("nvml-driver-not-loaded", SourceState.ABSENT, "no NVIDIA driver (the nvidia kernel module is not loaded)"),
        ("nvml-init-version-mismatch", SourceState.ERROR,
         "NVML cannot be read: RM has detected an NVML/RM version mismatch. (NVML code 18)"),
    ],
    ids=["driver-not-loaded", "version-mismatch"],
)
def test_init_failures(fixture, state, detail):
    status, gpus = read(fixture)
    assert (status.state, status.detail, gpus) == (state, detail, ())


def test_library_missing_is_absent_not_error():
    rec = {"format": FORMAT, "nvmlInit": {"nvml_error": "NVML_ERROR_LIBRARY_NOT_FOUND"}}
    status, gpus = read(rec)
    assert status.state is SourceState.ABSENT
    assert status.detail == "no NVIDIA driver (libnvidia-ml.so.1 not found)"


def test_count_unreadable_is_an_error_source():
    rec = copy.deepcopy(nvml_recording("nvml-2x-h100"))
    rec["nvmlDeviceGetCount"] = {"nvml_error": "NVML_ERROR_NO_PERMISSION"}
    status, gpus = read(rec)
    assert status.state is SourceState.ERROR and "Insufficient Permissions" in status.detail and gpus == ()


def test_unreadable_handle_keeps_the_index():
    rec = copy.deepcopy(nvml_recording("nvml-2x-h100"))
    rec["devices"][1]["nvmlDeviceGetHandleByIndex"] = {"nvml_error": "NVML_ERROR_UNKNOWN"}
    _, (g0, g1) = read(rec)
    assert g0.uuid and g1.index == 1 and g1.uuid is None and "handle" in g1.unread and not g1.lost


def test_driver_version_unreadable_still_lists_gpus():
    rec = copy.deepcopy(nvml_recording("nvml-2x-h100"))
    rec["nvmlSystemGetDriverVersion"] = {"nvml_error": "NVML_ERROR_NOT_SUPPORTED"}
    status, gpus = read(rec)
    assert status.state is SourceState.OK and status.driver_version is None and len(gpus) == 2


def test_reset_makes_the_next_read_enumerate_again():
    api = ReplayNvml(nvml_recording("nvml-2x-h100"))
    reader = NvmlReader(api)
    reader.read()
    reader.read()
    assert api.init_calls == 1
    reader.reset()
    api.recording["nvmlDeviceGetCount"] = 1
    _, gpus = reader.read()
    assert api.init_calls == 2 and api.shutdown_calls == 1 and len(gpus) == 1


@pytest.mark.parametrize("fixture", ["nvml-2x-h100", "nvml-consumer-not-supported", "nvml-gpu-lost",
                                     "nvml-init-version-mismatch", "nvml-driver-not-loaded"])
def test_recording_a_replay_gives_the_recording_back(fixture):
    rec = nvml_recording(fixture)
    again = record_nvml(ReplayNvml(rec), provenance=rec["provenance"])
    assert again == rec


def test_replay_rejects_another_format():
    with pytest.raises(RecordingError, match="format"):
        ReplayNvml({"format": "something-else"})


def test_replay_unknown_error_name_is_a_recording_error():
    rec = copy.deepcopy(nvml_recording("nvml-2x-h100"))
    rec["devices"][0]["nvmlDeviceGetName"] = {"nvml_error": "NVML_ERROR_NO_SUCH_THING"}
    with pytest.raises(RecordingError, match="NVML_ERROR_NO_SUCH_THING"):
        read(rec)


def test_real_library_on_this_machine():
    """The real pynvml: here (no driver) a clean ABSENT fact; on a GPU box, its GPUs."""
    reader = NvmlReader()
    try:
        status, gpus = reader.read()
    finally:
        reader.close()
    if ctypes.util.find_library("nvidia-ml") is None:
        assert status.state is SourceState.ABSENT
        assert status.detail == "no NVIDIA driver (libnvidia-ml.so.1 not found)"
        assert gpus == ()
        rec = record_nvml()
        assert rec["nvmlInit"] == {"nvml_error": "NVML_ERROR_LIBRARY_NOT_FOUND"}
    else:
        assert status.state in (SourceState.OK, SourceState.ABSENT, SourceState.ERROR)
        if status.state is SourceState.OK:
            pynvml.nvmlInit()
            try:
                assert len(gpus) == pynvml.nvmlDeviceGetCount()
            finally:
                pynvml.nvmlShutdown()


@pytest.mark.parametrize(
    ("raw", "expected"),
    [
        ("00000000:17:00.0", "0000:17:00.0"),
        ("00000000:CA:00.0", "0000:ca:00.0"),
        ("0000:03:00.0", "0000:03:00.0"),
        ("03:00.1", "0000:03:00.1"),
        ("0001:0a:1f.7", "0001:0a:1f.7"),
        ("not a bus id", None),
        ("", None),
        (None, None),
    ],
)
def test_normalize_bus_id(raw, expected):
    assert normalize_bus_id(raw) == expected
