"""Checks of this host's GPUs: the NVIDIA driver (NVML), amdgpu sysfs, and GPUs no model uses."""

from __future__ import annotations

from viiwork.agent.host.doctor.registry import CheckResult, Skip, Verdict, check, config_or_skip, plural, result_for
from viiwork.agent.host.facts import HostFacts
from viiwork.agent.host.gpus.inventory import GpuInventory, SourceState, Vendor
from viiwork.agent.host.gpus.udev import PciGpu


def _pci_of(facts: HostFacts, vendor: Vendor) -> list[PciGpu]:
    return [g for g in (facts.pci_gpus or ()) if g.vendor is vendor]


@check("gpu.nvidia", "NVIDIA driver and NVML")
def check_gpu_nvidia(facts: HostFacts) -> list[CheckResult]:
    """NVML (the NVIDIA driver's management library) can be read wherever NVIDIA hardware
    or device nodes exist.

    - **fail**: the driver reports a GPU lost (fallen off the bus).
    - **degraded**: an NVIDIA GPU is on the PCI bus or `/dev/nvidia*` exists, but NVML cannot
      be read (no driver loaded, driver/library mismatch after an upgrade, permissions);
      or a GPU on the PCI bus is not visible to NVML.
    - **ok**: NVML reads every GPU, or there is no NVIDIA hardware at all.
    """
    r = result_for("gpu.nvidia")
    inventory: GpuInventory = facts.need("gpus")
    source = inventory.source(Vendor.NVIDIA)
    nodes = facts.device_nodes.nvidia if facts.device_nodes else ()
    on_bus = _pci_of(facts, Vendor.NVIDIA)
    unusable = ("NVIDIA GPUs cannot be checked, placed or reported; models given NVIDIA GPUs fail to start")
    if source is None or source.state is not SourceState.OK:
        detail = source.detail if source else "NVML was not read"
        seen = []
        if on_bus:
            seen.append(f"{plural(len(on_bus), 'NVIDIA GPU')} on the PCI bus")
        if nodes:
            seen.append(f"{', '.join(nodes[:3])} exist{'s' if len(nodes) == 1 else ''}")
        if not seen and (source is None or source.state is SourceState.ABSENT):
            return [r(Verdict.OK, "no NVIDIA GPU on this host")]
        where = " and ".join(seen) if seen else "NVML is installed"
        return [r(Verdict.DEGRADED, f"{where}, but {detail}", unusable,
                  "make `nvidia-smi` work: install/load the NVIDIA driver; after a driver upgrade reboot "
                  "(or reload the nvidia modules); give this user access to /dev/nvidia*")]
    results = []
    gpus = inventory.of(Vendor.NVIDIA)
    for gpu in gpus:
        if gpu.lost:
            results.append(r(Verdict.FAIL, "the driver reports this GPU lost (fallen off the bus)",
                             "backends on it have stopped working; its memory and processes cannot be read",
                             "check `dmesg` for Xid errors (79: fallen off the bus); reset the GPU "
                             "(`nvidia-smi -r -i N`) or reboot", subject=f"GPU {gpu.index}"))
    known = {g.pci_bus_id for g in gpus}
    for pci in on_bus:
        if pci.pci_bus_id not in known:
            results.append(r(Verdict.DEGRADED,
                             f"NVIDIA GPU {pci.pci_id} at {pci.pci_bus_id} (driver {pci.driver or 'none'}) "
                             "is not visible to NVML",
                             "it cannot be used by any model",
                             "check `dmesg` for NVRM errors; the GPU may be disabled, or bound to another driver (vfio-pci)",
                             subject=pci.pci_bus_id))
    if not results:
        results.append(r(Verdict.OK, f"{plural(len(gpus), 'NVIDIA GPU')}, {source.detail}"))
    return results


@check("gpu.amd", "AMD GPUs (amdgpu sysfs)")
def check_gpu_amd(facts: HostFacts) -> list[CheckResult]:
    """The amdgpu driver's sysfs files can be read wherever AMD GPUs exist.

    - **degraded**: an AMD GPU is on the PCI bus, or `/dev/kfd` (ROCm) exists, but no amdgpu
      card is in `/sys/class/drm` (driver not loaded, or the GPU bound to another driver).
    - **ok**: every AMD GPU is read (single figures may still be unknown), or there is none.
    """
    r = result_for("gpu.amd")
    inventory: GpuInventory = facts.need("gpus")
    source = inventory.source(Vendor.AMD)
    on_bus = _pci_of(facts, Vendor.AMD)
    kfd = bool(facts.device_nodes and facts.device_nodes.kfd)
    remedy = "load the amdgpu driver (`modprobe amdgpu`; see `dmesg | grep amdgpu`)"
    consequence = "AMD GPUs cannot be checked, placed or reported; models given AMD GPUs fail to start"
    if source is None or source.state is not SourceState.OK:
        detail = source.detail if source else "sysfs was not read"
        if on_bus:
            return [r(Verdict.DEGRADED, f"{plural(len(on_bus), 'AMD GPU')} on the PCI bus, but {detail}",
                      consequence, remedy)]
        if kfd:
            return [r(Verdict.DEGRADED, f"/dev/kfd exists, but {detail}", consequence, remedy)]
        if source is not None and source.state is SourceState.ERROR:
            return [r(Verdict.DEGRADED, detail, consequence, remedy)]
        return [r(Verdict.OK, "no AMD GPU on this host")]
    gpus = inventory.of(Vendor.AMD)
    known = {g.pci_bus_id for g in gpus}
    results = [r(Verdict.DEGRADED, f"AMD GPU {p.pci_id} at {p.pci_bus_id} (driver {p.driver or 'none'}) has no amdgpu card",
                 "it cannot be used by any model", remedy, subject=p.pci_bus_id)
               for p in on_bus if p.pci_bus_id not in known]
    return results or [r(Verdict.OK, f"{plural(len(gpus), 'AMD GPU')}, {source.detail}")]


@check("gpu.cpu_only", "GPUs used by the configured models")
def check_gpu_cpu_only(facts: HostFacts) -> CheckResult:
    """GPUs are visible but every configured model runs on the CPU.

    - **degraded**: at least one GPU is visible and no model lists any GPU: the GPUs sit
      idle while every model runs far slower on the CPU.
    - **skipped**: no model is configured (as right after install).
    - **ok**: a model uses GPUs (idle GPUs are named in the summary), or there is no GPU.
    """
    r = result_for("gpu.cpu_only")
    config = config_or_skip(facts)
    if not config.models:
        raise Skip("no model configured")
    inventory: GpuInventory = facts.need("gpus")
    visible = [g for g in inventory.gpus if not g.lost]
    if not visible:
        return r(Verdict.OK, "no GPU visible: models run on the CPU")
    if not any(m.gpus for m in config.models):
        return r(Verdict.DEGRADED,
                 f"{plural(len(visible), 'GPU')} visible, but every configured model runs on the CPU "
                 f"({plural(len(config.models), 'model')})",
                 "the GPUs sit idle and every model runs far slower than it could",
                 "give models GPUs: `gpus = [0]` (an index from `nvidia-smi -L`, or a UUID) in models[i]")
    used = set()
    for m in config.models:
        for ref in m.gpus:
            try:
                used.add(inventory.resolve(ref).key)
            except ValueError:
                continue
    idle = [g for g in visible if g.key not in used]
    note = f"; idle: {', '.join(g.label() for g in idle)}" if idle else ""
    return r(Verdict.OK, f"{len(used)} of {plural(len(visible), 'GPU')} given to models{note}")
