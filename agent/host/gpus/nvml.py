"""NVIDIA GPUs through NVML (``nvidia-ml-py``, imported as ``pynvml``).

The reader talks to NVML only through ``NvmlApi``: the handful of pynvml functions it calls,
with pynvml's own names and return shapes. The ``pynvml`` module satisfies it as is; a
recording (``viiwork.agent.host.gpus.nvml_record``) replays one box's answers through the same
interface, so the code that runs in tests is the code that runs on a GPU box.

Every field degrades on its own: an ``NVMLError`` (``Not Supported`` on a consumer card's
power reading, ``No Permission`` for another user's processes, ``GPU is lost``) makes that
field ``None`` and records the reason in ``Gpu.unread``; the other fields are still read.
No driver at all (``libnvidia-ml.so.1`` missing, or the kernel module not loaded) is the
source state ABSENT, a clean "no NVIDIA driver" fact rather than an error.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any, Protocol

import pynvml
from pynvml import NVMLError

from viiwork.agent.host.gpus.inventory import Gpu, GpuProcess, SourceState, SourceStatus, Vendor, normalize_bus_id

log = logging.getLogger(__name__)

# Sensor argument of nvmlDeviceGetTemperature: the GPU core sensor (nvml.h NVML_TEMPERATURE_GPU).
TEMPERATURE_GPU = 0
# Return codes that mean "there is no NVIDIA driver here" rather than "it is broken" (nvml.h).
_NO_DRIVER_CODES = {
    pynvml.NVML_ERROR_LIBRARY_NOT_FOUND: "libnvidia-ml.so.1 not found",
    pynvml.NVML_ERROR_DRIVER_NOT_LOADED: "the nvidia kernel module is not loaded",
}
_GPU_IS_LOST = pynvml.NVML_ERROR_GPU_IS_LOST


class NvmlApi(Protocol):
    """The pynvml calls this reader makes; the ``pynvml`` module itself implements it.

    Errors are ``pynvml.NVMLError`` subclasses carrying the nvml.h return code in ``value``.
    Shapes: strings may come back as ``bytes``; ``nvmlDeviceGetPciInfo`` has ``busId``;
    ``nvmlDeviceGetMemoryInfo`` has ``total``/``free``/``used`` in bytes;
    ``nvmlDeviceGetUtilizationRates`` has ``gpu`` in percent; ``nvmlDeviceGetPowerUsage``
    is milliwatts; ``nvmlDeviceGetTemperature`` is °C; process lists hold objects with
    ``pid`` and ``usedGpuMemory`` (bytes, or None when the driver does not say).
    """

    def nvmlInit(self) -> None: ...
    def nvmlShutdown(self) -> None: ...
    def nvmlSystemGetDriverVersion(self) -> str | bytes: ...
    def nvmlDeviceGetCount(self) -> int: ...
    def nvmlDeviceGetHandleByIndex(self, index: int) -> Any: ...
    def nvmlDeviceGetUUID(self, handle: Any) -> str | bytes: ...
    def nvmlDeviceGetName(self, handle: Any) -> str | bytes: ...
    def nvmlDeviceGetPciInfo(self, handle: Any) -> Any: ...
    def nvmlDeviceGetMemoryInfo(self, handle: Any) -> Any: ...
    def nvmlDeviceGetUtilizationRates(self, handle: Any) -> Any: ...
    def nvmlDeviceGetPowerUsage(self, handle: Any) -> int: ...
    def nvmlDeviceGetTemperature(self, handle: Any, sensor: int) -> int: ...
    def nvmlDeviceGetComputeRunningProcesses(self, handle: Any) -> list[Any]: ...
    def nvmlDeviceGetGraphicsRunningProcesses(self, handle: Any) -> list[Any]: ...


def _text(value: Any) -> str | None:
    if value is None:
        return None
    if isinstance(value, bytes):
        value = value.decode("utf-8", "replace")
    value = str(value).strip()
    return value or None


def _int_or_none(value: Any) -> int | None:
    if isinstance(value, bool) or not isinstance(value, int):
        return None
    return value


def nvml_reason(exc: BaseException) -> str:
    """Human text for an NVML error: pynvml's message plus the nvml.h code."""
    code = getattr(exc, "value", None)
    return f"{exc} (NVML code {code})" if code is not None else str(exc)


class NvmlReader:
    """Reads the NVIDIA GPUs; ``read()`` blocks (call it from a worker thread).

    NVML is initialised on the first read and kept; ``reset()`` shuts it down so the next
    read enumerates the devices again (after a hot-plug). Thread-safe.
    """

    vendor = Vendor.NVIDIA

    def __init__(self, api: NvmlApi | None = None) -> None:
        self._api: NvmlApi = api if api is not None else pynvml
        self._initialised = False
        self._lock = threading.Lock()

    def read(self) -> tuple[SourceStatus, tuple[Gpu, ...]]:
        """The source status and one ``Gpu`` per NVML index (0..count-1)."""
        api = self._api
        with self._lock:
            if not self._initialised:
                try:
                    api.nvmlInit()
                except NVMLError as exc:
                    return self._init_failure(exc), ()
                self._initialised = True
            try:
                driver = _text(api.nvmlSystemGetDriverVersion())
            except NVMLError as exc:
                log.debug("NVML driver version unreadable: %s", exc)
                driver = None
            try:
                count = api.nvmlDeviceGetCount()
            except NVMLError as exc:
                return SourceStatus(Vendor.NVIDIA, SourceState.ERROR,
                                    f"NVML cannot count GPUs: {nvml_reason(exc)}", driver), ()
            gpus = tuple(self._read_device(i) for i in range(count))
        detail = f"NVML, driver {driver}" if driver else "NVML (driver version unreadable)"
        return SourceStatus(Vendor.NVIDIA, SourceState.OK, detail, driver), gpus

    def reset(self) -> None:
        """Forget the NVML session so the next ``read`` re-enumerates devices."""
        with self._lock:
            self._shutdown()

    def close(self) -> None:
        with self._lock:
            self._shutdown()

    def _shutdown(self) -> None:
        if self._initialised:
            self._initialised = False
            try:
                self._api.nvmlShutdown()
            except NVMLError as exc:
                log.debug("nvmlShutdown failed: %s", exc)

    @staticmethod
    def _init_failure(exc: NVMLError) -> SourceStatus:
        code = getattr(exc, "value", None)
        if code in _NO_DRIVER_CODES:
            return SourceStatus(Vendor.NVIDIA, SourceState.ABSENT, f"no NVIDIA driver ({_NO_DRIVER_CODES[code]})")
        return SourceStatus(Vendor.NVIDIA, SourceState.ERROR, f"NVML cannot be read: {nvml_reason(exc)}")

    def _read_device(self, index: int) -> Gpu:
        api = self._api
        unread: dict[str, str] = {}
        lost = False

        def get(fields: tuple[str, ...], fn: Callable[..., Any], *args: Any) -> Any:
            nonlocal lost
            try:
                return fn(*args)
            except NVMLError as exc:
                lost = lost or getattr(exc, "value", None) == _GPU_IS_LOST
                for name in fields:
                    unread[name] = nvml_reason(exc)
                return None

        try:
            handle = api.nvmlDeviceGetHandleByIndex(index)
        except NVMLError as exc:
            reason = nvml_reason(exc)
            return Gpu(Vendor.NVIDIA, index, lost=getattr(exc, "value", None) == _GPU_IS_LOST,
                       unread={"handle": reason})

        uuid = _text(get(("uuid",), api.nvmlDeviceGetUUID, handle))
        name = _text(get(("name",), api.nvmlDeviceGetName, handle))
        pci = get(("pci_bus_id",), api.nvmlDeviceGetPciInfo, handle)
        bus_id = normalize_bus_id(_text(getattr(pci, "busId", None))) if pci is not None else None
        memory_fields = ("memory_total_bytes", "memory_used_bytes", "memory_free_bytes")
        memory = get(memory_fields, api.nvmlDeviceGetMemoryInfo, handle)
        util = get(("utilization_percent",), api.nvmlDeviceGetUtilizationRates, handle)
        power_mw = _int_or_none(get(("power_watts",), api.nvmlDeviceGetPowerUsage, handle))
        temperature = _int_or_none(get(("temperature_c",), api.nvmlDeviceGetTemperature, handle, TEMPERATURE_GPU))
        compute = get(("processes",), api.nvmlDeviceGetComputeRunningProcesses, handle)
        graphics = get(("graphics_processes",), api.nvmlDeviceGetGraphicsRunningProcesses, handle)
        return Gpu(
            vendor=Vendor.NVIDIA,
            index=index,
            uuid=uuid,
            name=name,
            pci_bus_id=bus_id,
            memory_total_bytes=_int_or_none(getattr(memory, "total", None)),
            memory_used_bytes=_int_or_none(getattr(memory, "used", None)),
            memory_free_bytes=_int_or_none(getattr(memory, "free", None)),
            utilization_percent=_int_or_none(getattr(util, "gpu", None)),
            power_watts=None if power_mw is None else power_mw / 1000.0,
            temperature_c=None if temperature is None else float(temperature),
            processes=_merge_processes(compute, graphics),
            lost=lost,
            unread=unread,
        )


def _merge_processes(compute: list[Any] | None, graphics: list[Any] | None) -> tuple[GpuProcess, ...] | None:
    """Compute and graphics contexts, one entry per pid; None when the compute list is unreadable.

    Engines hold compute contexts; a graphics list that cannot be read (common on
    datacenter cards) does not make the whole list unknown.
    """
    if compute is None:
        return None
    seen: dict[int, GpuProcess] = {}
    for entry in [*compute, *(graphics or [])]:
        pid = _int_or_none(getattr(entry, "pid", None))
        if pid is None or pid in seen:
            continue
        seen[pid] = GpuProcess(pid, _int_or_none(getattr(entry, "usedGpuMemory", None)))
    return tuple(seen.values())
