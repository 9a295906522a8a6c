"""This host's GPUs: inventory (NVML, amdgpu sysfs), hot-plug (udev), validation, placement.

Public surface:
- ``GpuInventory``, ``Gpu``, ``Vendor``, ``SourceState`` (``inventory``): the snapshot model.
- ``NvmlReader`` (``nvml``), ``AmdSysfsReader`` (``amd``): blocking vendor readers.
- ``GpuMonitor`` (``monitor``): the agent's long-lived view; ``status_section()`` is the
  ``gpus`` section of ``/v1/status``.
- ``check_config_gpus`` (``validate``): refuse configs naming GPUs this host lacks.
- ``verify_placement`` (``placement``): is a backend on exactly its GPUs.
"""

from viiwork.agent.host.gpus.amd import AmdSysfsReader
from viiwork.agent.host.gpus.inventory import (
    Gpu,
    GpuInventory,
    GpuProcess,
    GpuRefError,
    SourceState,
    SourceStatus,
    Vendor,
    async_read_inventory,
    read_inventory,
)
from viiwork.agent.host.gpus.monitor import GpuMonitor
from viiwork.agent.host.gpus.nvml import NvmlReader
from viiwork.agent.host.gpus.validate import check_config_gpus, gpu_config_issues

__all__ = [
    "AmdSysfsReader",
    "Gpu",
    "GpuInventory",
    "GpuMonitor",
    "GpuProcess",
    "GpuRefError",
    "NvmlReader",
    "SourceState",
    "SourceStatus",
    "Vendor",
    "async_read_inventory",
    "check_config_gpus",
    "gpu_config_issues",
    "read_inventory",
]
