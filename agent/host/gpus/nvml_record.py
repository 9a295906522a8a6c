"""Record what NVML answers on one box, and replay a recording through ``NvmlApi``.

A recording is JSON that keeps NVML's own shapes: per call, either the value (structs as
objects with pynvml's field names, process lists as lists of ``{pid, usedGpuMemory}``) or
``{"nvml_error": "NVML_ERROR_NOT_SUPPORTED"}``. ``python -m viiwork.agent.host.gpus --record-nvml``
writes one from a real GPU box (attach it to a bug report); ``ReplayNvml`` answers the same
calls from it, raising real ``pynvml.NVMLError``s, so readers and the doctor can be run
against boxes that are not here.

Shape::

    {"format": "viiwork-nvml-recording/1", "provenance": "...",
     "nvmlInit": null | {"nvml_error": ...},
     "nvmlSystemGetDriverVersion": "550.54.15" | {"nvml_error": ...},
     "nvmlDeviceGetCount": 2 | {"nvml_error": ...},
     "devices": [{"nvmlDeviceGetHandleByIndex": null | {"nvml_error": ...},
                  "nvmlDeviceGetUUID": "GPU-...", ...}]}
"""

from __future__ import annotations

import copy
from types import SimpleNamespace
from typing import Any

import pynvml

from viiwork.agent.host.gpus.nvml import TEMPERATURE_GPU, NvmlApi

FORMAT = "viiwork-nvml-recording/1"

DEVICE_CALLS: tuple[str, ...] = (
    "nvmlDeviceGetUUID",
    "nvmlDeviceGetName",
    "nvmlDeviceGetPciInfo",
    "nvmlDeviceGetMemoryInfo",
    "nvmlDeviceGetUtilizationRates",
    "nvmlDeviceGetPowerUsage",
    "nvmlDeviceGetTemperature",
    "nvmlDeviceGetComputeRunningProcesses",
    "nvmlDeviceGetGraphicsRunningProcesses",
)
# The struct fields kept per call (pynvml's attribute names).
_STRUCT_FIELDS: dict[str, tuple[str, ...]] = {
    "nvmlDeviceGetPciInfo": ("busId",),
    "nvmlDeviceGetMemoryInfo": ("total", "free", "used"),
    "nvmlDeviceGetUtilizationRates": ("gpu", "memory"),
}
_PROCESS_CALLS = ("nvmlDeviceGetComputeRunningProcesses", "nvmlDeviceGetGraphicsRunningProcesses")
_PROCESS_FIELDS = ("pid", "usedGpuMemory")

_CODE_NAMES: dict[int, str] = {
    value: name for name, value in vars(pynvml).items()
    if name.startswith("NVML_ERROR_") and isinstance(value, int)
}


class RecordingError(ValueError):
    """A recording that is not in the format above; the message names the key."""


def _error(exc: pynvml.NVMLError) -> dict[str, str]:
    code = getattr(exc, "value", None)
    name = _CODE_NAMES.get(code) if isinstance(code, int) else None
    return {"nvml_error": name or f"NVML_ERROR_{code}"}


def _plain(call: str, value: Any) -> Any:
    if isinstance(value, bytes):
        return value.decode("utf-8", "replace")
    if call in _STRUCT_FIELDS:
        return {f: _plain("", getattr(value, f, None)) for f in _STRUCT_FIELDS[call]}
    if call in _PROCESS_CALLS:
        return [{f: getattr(p, f, None) for f in _PROCESS_FIELDS} for p in value]
    return value


def record_nvml(api: NvmlApi | None = None, provenance: str = "") -> dict[str, Any]:
    """Call every function the reader uses and keep each answer or error (blocking)."""
    api = api if api is not None else pynvml
    out: dict[str, Any] = {"format": FORMAT, "provenance": provenance}

    def call(name: str, fn: Any, *args: Any) -> Any:
        try:
            return _plain(name, fn(*args))
        except pynvml.NVMLError as exc:
            return _error(exc)

    try:
        api.nvmlInit()
    except pynvml.NVMLError as exc:
        out["nvmlInit"] = _error(exc)
        return out
    out["nvmlInit"] = None
    try:
        out["nvmlSystemGetDriverVersion"] = call("nvmlSystemGetDriverVersion", api.nvmlSystemGetDriverVersion)
        count = call("nvmlDeviceGetCount", api.nvmlDeviceGetCount)
        out["nvmlDeviceGetCount"] = count
        devices: list[dict[str, Any]] = []
        for index in range(count if isinstance(count, int) else 0):
            device: dict[str, Any] = {}
            try:
                handle = api.nvmlDeviceGetHandleByIndex(index)
            except pynvml.NVMLError as exc:
                device["nvmlDeviceGetHandleByIndex"] = _error(exc)
                devices.append(device)
                continue
            device["nvmlDeviceGetHandleByIndex"] = None
            for name in DEVICE_CALLS:
                fn = getattr(api, name)
                args = (handle, TEMPERATURE_GPU) if name == "nvmlDeviceGetTemperature" else (handle,)
                device[name] = call(name, fn, *args)
            devices.append(device)
        out["devices"] = devices
    finally:
        try:
            api.nvmlShutdown()
        except pynvml.NVMLError:
            pass
    return out


def _is_error(value: Any) -> bool:
    return isinstance(value, dict) and set(value) == {"nvml_error"}


def _raise(value: dict[str, str]) -> None:
    name = value["nvml_error"]
    code = getattr(pynvml, name, None)
    if not isinstance(code, int):
        raise RecordingError(f"unknown NVML error name {name!r}")
    raise pynvml.NVMLError(code)


class ReplayNvml:
    """``NvmlApi`` answered from a recording; a call it lacks raises Function Not Found.

    ``recording`` may be replaced while in use (a hot-plug in a test swaps in a recording
    with one device fewer); handles are device indexes.
    """

    def __init__(self, recording: dict[str, Any]) -> None:
        if recording.get("format") != FORMAT:
            raise RecordingError(f"format: expected {FORMAT!r}, got {recording.get('format')!r}")
        self.recording = copy.deepcopy(recording)
        self.init_calls = 0
        self.shutdown_calls = 0

    def _top(self, name: str) -> Any:
        if name not in self.recording:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_FUNCTION_NOT_FOUND)
        value = self.recording[name]
        if _is_error(value):
            _raise(value)
        return value

    def _device(self, handle: int, name: str) -> Any:
        devices = self.recording.get("devices", [])
        if not isinstance(handle, int) or not 0 <= handle < len(devices):
            raise pynvml.NVMLError(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        device = devices[handle]
        if name not in device:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_FUNCTION_NOT_FOUND)
        value = device[name]
        if _is_error(value):
            _raise(value)
        if name in _STRUCT_FIELDS:
            return SimpleNamespace(**value)
        if name in _PROCESS_CALLS:
            return [SimpleNamespace(**p) for p in value]
        return value

    def nvmlInit(self) -> None:
        self.init_calls += 1
        self._top("nvmlInit")

    def nvmlShutdown(self) -> None:
        self.shutdown_calls += 1

    def nvmlSystemGetDriverVersion(self) -> str:
        return self._top("nvmlSystemGetDriverVersion")

    def nvmlDeviceGetCount(self) -> int:
        return self._top("nvmlDeviceGetCount")

    def nvmlDeviceGetHandleByIndex(self, index: int) -> int:
        devices = self.recording.get("devices", [])
        if not 0 <= index < len(devices):
            raise pynvml.NVMLError(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        value = devices[index].get("nvmlDeviceGetHandleByIndex")
        if _is_error(value):
            _raise(value)
        return index

    def nvmlDeviceGetUUID(self, handle: int) -> str:
        return self._device(handle, "nvmlDeviceGetUUID")

    def nvmlDeviceGetName(self, handle: int) -> str:
        return self._device(handle, "nvmlDeviceGetName")

    def nvmlDeviceGetPciInfo(self, handle: int) -> Any:
        return self._device(handle, "nvmlDeviceGetPciInfo")

    def nvmlDeviceGetMemoryInfo(self, handle: int) -> Any:
        return self._device(handle, "nvmlDeviceGetMemoryInfo")

    def nvmlDeviceGetUtilizationRates(self, handle: int) -> Any:
        return self._device(handle, "nvmlDeviceGetUtilizationRates")

    def nvmlDeviceGetPowerUsage(self, handle: int) -> int:
        return self._device(handle, "nvmlDeviceGetPowerUsage")

    def nvmlDeviceGetTemperature(self, handle: int, sensor: int) -> int:
        if sensor != TEMPERATURE_GPU:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_SUPPORTED)
        return self._device(handle, "nvmlDeviceGetTemperature")

    def nvmlDeviceGetComputeRunningProcesses(self, handle: int) -> list[Any]:
        return self._device(handle, "nvmlDeviceGetComputeRunningProcesses")

    def nvmlDeviceGetGraphicsRunningProcesses(self, handle: int) -> list[Any]:
        return self._device(handle, "nvmlDeviceGetGraphicsRunningProcesses")
