"""The doctor: a registry of checks over observed host facts, each a pure function.

A check takes a ``HostFacts`` (``viiwork.agent.host.facts``) and returns ``CheckResult``s: a
verdict (``ok``, ``degraded``, ``fail``, or ``skipped`` when it does not apply), a one-line
summary, and for anything not ok the consequence and the remedy. A check that raises
becomes a ``fail`` naming the error (docs/architecture.md, rule 14): the doctor never crashes on a strange
host. A check's docstring is its documentation: ``docs/doctor.md`` is generated from this
registry (``python -m viiwork.agent.host.doctor --markdown``), so the list cannot drift.

The same checks give the agent its loud start-up conflicts (``derive_conflicts``): the
non-ok results of the host checks, computed from facts alone.

Exit codes (``DoctorReport.exit_code``): 0 all ok (or skipped), 2 degraded only, 1 any fail.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import inspect
import logging
import sys
import urllib.parse
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path
from typing import Any

from viiwork.agent.config.schema import Config, is_loopback
from viiwork.agent.host.facts import BinaryState, FactUnavailable, HostFacts, gather_facts, version_at_least
from viiwork.agent.host.gpus.inventory import GpuInventory, SourceState, Vendor
from viiwork.agent.host.gpus.udev import PciGpu
from viiwork.agent.host.gpus.validate import gpu_config_issues

log = logging.getLogger(__name__)

MiB = 1024 * 1024
GiB = 1024 * MiB
DISK_DEGRADED_BELOW_BYTES = 2 * GiB
DISK_FAIL_BELOW_BYTES = 100 * MiB
CERT_WARN_DAYS = 14


class Verdict(StrEnum):
    OK = "ok"
    DEGRADED = "degraded"
    FAIL = "fail"
    SKIPPED = "skipped"


@dataclass(frozen=True, slots=True)
class CheckResult:
    """One finding. ``subject`` names what it is about when a check has several ("GPU 1",
    "llamacpp: llama-server"); ``consequence`` and ``remedy`` are set when not ok."""

    check: str
    verdict: Verdict
    summary: str
    consequence: str = ""
    remedy: str = ""
    subject: str = ""

    def to_json(self) -> dict[str, str]:
        return {"check": self.check, "subject": self.subject, "verdict": self.verdict.value,
                "summary": self.summary, "consequence": self.consequence, "remedy": self.remedy}


class Skip(Exception):
    """Raised inside a check: it does not apply here; the message says why."""


CheckFunc = Callable[[HostFacts], "CheckResult | Iterable[CheckResult]"]


@dataclass(frozen=True, slots=True)
class Check:
    """A registered check: ``id`` (stable, used in --json and docs), ``title``, the function,
    and ``agent`` (True when it judges what the running agent reports)."""

    id: str
    title: str
    func: CheckFunc
    agent: bool = False

    @property
    def doc(self) -> str:
        return inspect.cleandoc(self.func.__doc__ or "")


REGISTRY: list[Check] = []


def check(check_id: str, title: str, *, agent: bool = False) -> Callable[[CheckFunc], CheckFunc]:
    """Register a check function under ``check_id`` (unique)."""

    def register(func: CheckFunc) -> CheckFunc:
        if any(c.id == check_id for c in REGISTRY):
            raise ValueError(f"doctor check {check_id!r} registered twice")
        REGISTRY.append(Check(check_id, title, func, agent))
        return func

    return register


# -- helpers the checks share ---------------------------------------------------------------


def _result(check_id: str) -> Callable[..., CheckResult]:
    def make(verdict: Verdict, summary: str, consequence: str = "", remedy: str = "", subject: str = "") -> CheckResult:
        return CheckResult(check_id, verdict, summary, consequence, remedy, subject)

    return make


def _config(facts: HostFacts) -> Config:
    if facts.config.config is None:
        raise Skip("no valid config (see the config check)")
    return facts.config.config


def _agent_status(facts: HostFacts) -> Mapping[str, Any]:
    agent = facts.agent
    if agent is None:
        raise Skip("the running agent was not asked")
    if agent.status is None:
        raise Skip("the running agent's status is not available (see agent.reachable)")
    return agent.status


def _plural(n: int, word: str) -> str:
    return f"{n} {word}{'' if n == 1 else 's'}"


def _pci_of(facts: HostFacts, vendor: Vendor) -> list[PciGpu]:
    return [g for g in (facts.pci_gpus or ()) if g.vendor is vendor]


# -- the checks, in the order they are shown ------------------------------------------------


@check("config", "Configuration file")
def check_config(facts: HostFacts) -> CheckResult:
    """The config file exists and passes the agent's own loader (the one
    `viiworkctl config check` uses).

    - **fail**: the file is missing, unreadable or invalid. Every error names its field
      path and line. The agent refuses to start with it.
    """
    r = _result("config")
    cf = facts.config
    if cf.config is None:
        if not cf.exists:
            return r(Verdict.FAIL, f"{cf.path} does not exist", "the agent cannot start without a config",
                     f"create {cf.path} from the example config, or pass --config FILE")
        errors = "; ".join(str(i) for i in cf.issues[:5])
        more = f" (and {len(cf.issues) - 5} more)" if len(cf.issues) > 5 else ""
        return r(Verdict.FAIL, f"{cf.path}: {errors}{more}", "the agent refuses to start with this config",
                 f"fix the fields named; re-check with `viiworkctl config check {cf.path}`")
    config = cf.config
    backends = sum(m.backend_count for m in config.models)
    mode = f"mesh (trust {config.mesh.trust})" if config.mesh else "standalone"
    return r(Verdict.OK, f"{cf.path}: {_plural(len(config.models), 'model')}, {_plural(backends, 'backend')}, {mode}")


@check("config.gpus", "Configured GPUs exist on this host")
def check_config_gpus(facts: HostFacts) -> list[CheckResult]:
    """Every `models[].gpus` entry names a GPU of this host: an NVML index in PCI bus order
    (what `nvidia-smi` shows), or a GPU UUID. Two spellings of one GPU (`0` and its UUID)
    in two models are caught here too.

    - **fail**: an entry names no GPU here (the message lists the GPUs that exist), or one
      GPU is given to two models. The agent refuses the config at start.
    - **skipped**: no model lists GPUs.
    """
    r = _result("config.gpus")
    config = _config(facts)
    if not any(m.gpus for m in config.models):
        raise Skip("no model lists GPUs")
    inventory: GpuInventory = facts.need("gpus")
    issues = gpu_config_issues(config, inventory, facts.config.text)
    if not issues:
        refs = sum(len(m.gpus) for m in config.models)
        return [r(Verdict.OK, f"{_plural(refs, 'GPU reference')} resolve to GPUs of this host")]
    return [r(Verdict.FAIL, str(issue), "the agent refuses this config at start",
              "name GPUs that exist (`nvidia-smi -L` or `rocm-smi --showuniqueid` list indexes and UUIDs)",
              subject=issue.dotted) for issue in issues]


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
    r = _result("gpu.nvidia")
    inventory: GpuInventory = facts.need("gpus")
    source = inventory.source(Vendor.NVIDIA)
    nodes = facts.device_nodes.nvidia if facts.device_nodes else ()
    on_bus = _pci_of(facts, Vendor.NVIDIA)
    unusable = ("NVIDIA GPUs cannot be checked, placed or reported; models given NVIDIA GPUs fail to start")
    if source is None or source.state is not SourceState.OK:
        detail = source.detail if source else "NVML was not read"
        seen = []
        if on_bus:
            seen.append(f"{_plural(len(on_bus), 'NVIDIA GPU')} on the PCI bus")
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
        results.append(r(Verdict.OK, f"{_plural(len(gpus), 'NVIDIA GPU')}, {source.detail}"))
    return results


@check("gpu.amd", "AMD GPUs (amdgpu sysfs)")
def check_gpu_amd(facts: HostFacts) -> list[CheckResult]:
    """The amdgpu driver's sysfs files can be read wherever AMD GPUs exist.

    - **degraded**: an AMD GPU is on the PCI bus, or `/dev/kfd` (ROCm) exists, but no amdgpu
      card is in `/sys/class/drm` (driver not loaded, or the GPU bound to another driver).
    - **ok**: every AMD GPU is read (single figures may still be unknown), or there is none.
    """
    r = _result("gpu.amd")
    inventory: GpuInventory = facts.need("gpus")
    source = inventory.source(Vendor.AMD)
    on_bus = _pci_of(facts, Vendor.AMD)
    kfd = bool(facts.device_nodes and facts.device_nodes.kfd)
    remedy = "load the amdgpu driver (`modprobe amdgpu`; see `dmesg | grep amdgpu`)"
    consequence = "AMD GPUs cannot be checked, placed or reported; models given AMD GPUs fail to start"
    if source is None or source.state is not SourceState.OK:
        detail = source.detail if source else "sysfs was not read"
        if on_bus:
            return [r(Verdict.DEGRADED, f"{_plural(len(on_bus), 'AMD GPU')} on the PCI bus, but {detail}",
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
    return results or [r(Verdict.OK, f"{_plural(len(gpus), 'AMD GPU')}, {source.detail}")]


@check("gpu.cpu_only", "GPUs used by the configured models")
def check_gpu_cpu_only(facts: HostFacts) -> CheckResult:
    """GPUs are visible but every configured model runs on the CPU.

    - **degraded**: at least one GPU is visible and no model lists any GPU: the GPUs sit
      idle while every model runs far slower on the CPU.
    - **skipped**: no model is configured (as right after install).
    - **ok**: a model uses GPUs (idle GPUs are named in the summary), or there is no GPU.
    """
    r = _result("gpu.cpu_only")
    config = _config(facts)
    if not config.models:
        raise Skip("no model configured")
    inventory: GpuInventory = facts.need("gpus")
    visible = [g for g in inventory.gpus if not g.lost]
    if not visible:
        return r(Verdict.OK, "no GPU visible: models run on the CPU")
    if not any(m.gpus for m in config.models):
        return r(Verdict.DEGRADED,
                 f"{_plural(len(visible), 'GPU')} visible, but every configured model runs on the CPU "
                 f"({_plural(len(config.models), 'model')})",
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
    return r(Verdict.OK, f"{len(used)} of {_plural(len(visible), 'GPU')} given to models{note}")


@check("engine.binary", "Engine binaries")
def check_engine_binary(facts: HostFacts) -> list[CheckResult]:
    """Each engine binary the config uses exists and is executable. A bare name is searched
    on the PATH of the user running the doctor.

    - **fail**: missing, not executable, or the engine cannot say which binary it runs; the
      models using it cannot start (every backend fails at launch and ends `dead`).
    - **skipped**: no model configured.
    """
    r = _result("engine.binary")
    config = _config(facts)
    if not config.models:
        raise Skip("no model configured")
    results = []
    for b in facts.need("binaries"):
        subject = f"{b.engine}: {b.binary}"
        models = ", ".join(b.models)
        if b.state is BinaryState.OK:
            results.append(r(Verdict.OK, b.resolved or b.binary, subject=subject))
            continue
        consequence = f"model(s) {models} cannot start: every backend fails at launch and ends dead"
        option = f" or set {b.option_path} to its full path" if b.option_path else ""
        if b.state is BinaryState.MISSING:
            remedy = f"install {b.display_name}{option}"
        elif b.state is BinaryState.NOT_EXECUTABLE:
            remedy = f"`chmod +x {b.resolved}`{option}"
        else:
            remedy = f"fix the engine options of model(s) {models}"
        results.append(r(Verdict.FAIL, b.detail, consequence, remedy, subject=subject))
    return results


@check("engine.version", "Engine versions")
def check_engine_version(facts: HostFacts) -> list[CheckResult]:
    """The installed engine's version, where the engine can say. Engines with a minimum
    version (the adapter's `Version` capability) are compared with it; others show the
    binary's own `--version` line as reported.

    - **fail**: below the adapter's minimum.
    - **degraded**: the version command failed or printed no version (a binary that fails
      `--version` often fails at start too), or the version cannot be compared.
    - **skipped**: the binary is missing (see engine.binary) or no model is configured.
    """
    r = _result("engine.version")
    config = _config(facts)
    if not config.models:
        raise Skip("no model configured")
    results = []
    for b in facts.need("binaries"):
        subject = f"{b.engine}: {b.binary}"
        if b.state is not BinaryState.OK:
            results.append(r(Verdict.SKIPPED, "binary not usable (see engine.binary)", subject=subject))
            continue
        if b.version_source is None:
            results.append(r(Verdict.SKIPPED, "version not read", subject=subject))
            continue
        if b.version is None:
            results.append(r(Verdict.DEGRADED, b.version_error or "no version printed",
                             "the installed version is unknown; the binary may not run at all",
                             f"run `{b.resolved or b.binary} --version` by hand and fix what it reports",
                             subject=subject))
            continue
        if b.minimum_version:
            ok = version_at_least(b.version, b.minimum_version)
            if ok is False:
                results.append(r(Verdict.FAIL, f"{b.version} is older than the minimum {b.minimum_version}",
                                 "the adapter relies on behaviour this version lacks: backends may fail or misreport load",
                                 f"upgrade {b.display_name} to {b.minimum_version} or newer", subject=subject))
                continue
            if ok is None:
                results.append(r(Verdict.DEGRADED, f"{b.version} cannot be compared with the minimum {b.minimum_version}",
                                 "the version may be too old", f"check {b.display_name} is {b.minimum_version} or newer",
                                 subject=subject))
                continue
        results.append(r(Verdict.OK, b.version, subject=subject))
    return results


@check("model.path", "Model files")
def check_model_path(facts: HostFacts) -> list[CheckResult]:
    """Local model paths (absolute, or starting with `./` or `~`) exist and can be read by
    the user running the doctor (engines run as the `viiwork` user, which needs read access
    too). Hub ids (`org/name`) are not checked.

    - **fail**: missing or unreadable: the backend fails at load and, after its respawns, ends `dead`.
    - **skipped**: no model has a local path.
    """
    r = _result("model.path")
    _config(facts)
    paths = facts.need("model_paths")
    if not paths:
        raise Skip("no model has a local path")
    results = []
    for p in paths:
        subject = f"models[{p.index}].path"
        if not p.exists:
            results.append(r(Verdict.FAIL, f"{p.path} does not exist (model {p.model})",
                             f"model {p.model} cannot load: its backends end dead",
                             f"put the model file at {p.path} or fix {subject}", subject=subject))
        elif not p.readable:
            results.append(r(Verdict.FAIL, f"{p.path} is not readable (model {p.model})",
                             f"model {p.model} cannot load: its backends end dead",
                             f"make it readable by the viiwork user (`chmod a+r {p.path}`)", subject=subject))
        else:
            results.append(r(Verdict.OK, p.path, subject=subject))
    return results


def _bytes(n: int) -> str:
    return f"{n / GiB:.1f} GiB" if n >= GiB else f"{n / MiB:.0f} MiB"


@check("disk.space", "Free disk space")
def check_disk_space(facts: HostFacts) -> list[CheckResult]:
    """Free space on the filesystems holding the state dir, the log dir and local models.
    Fixed floors, not shares of the disk: what runs out is bytes for keys, logs and
    engine caches.

    - **fail**: under 100 MiB free: state and certificates cannot be written, engines
      crash writing caches.
    - **degraded**: under 2 GiB free.
    """
    r = _result("disk.space")
    _config(facts)
    results = []
    for d in facts.need("disks"):
        subject = ", ".join(d.roles)
        summary = f"{_bytes(d.free_bytes)} free of {_bytes(d.total_bytes)} at {d.path}"
        remedy = f"free space on the filesystem of {d.path} (old models, engine caches, logs: `journalctl --vacuum-size`)"
        if d.free_bytes < DISK_FAIL_BELOW_BYTES:
            results.append(r(Verdict.FAIL, summary, "state, certificates and engine caches cannot be written; "
                             "engines and the agent fail in odd ways", remedy, subject=subject))
        elif d.free_bytes < DISK_DEGRADED_BELOW_BYTES:
            results.append(r(Verdict.DEGRADED, summary, "close to running out: writes of state, logs and "
                             "engine caches will start failing", remedy, subject=subject))
        else:
            results.append(r(Verdict.OK, summary, subject=subject))
    return results


@check("mesh.trust", "Mesh trust and certificates")
def check_mesh_trust(facts: HostFacts) -> list[CheckResult]:
    """The mesh's trust material. A `[mesh]` without `trust` is refused by the config check.

    - **fail** (`trust = "ca"`): the CA certificate cannot be read or is not an Ed25519 CA;
      this node has no certificate (not enrolled), or it was not issued by this CA, or it
      expired; the node key is missing, readable by group or others, or does not match the
      certificate. The node cannot join the mesh.
    - **degraded**: `trust = "open"` (any host that knows the mesh id can join and receive
      forwarded prompts); a certificate expires within 14 days.
    - **skipped**: a standalone node (no `[mesh]`).
    """
    r = _result("mesh.trust")
    config = _config(facts)
    if config.mesh is None:
        raise Skip("standalone node (no [mesh])")
    mesh = facts.need("mesh")
    results: list[CheckResult] = []
    cannot_join = "this node cannot join the mesh: no gossip, no forwarding to or from it"
    enrol = ("enrol: `viiworkctl mesh request` here, `viiworkctl mesh sign` on the CA host, "
             "`viiworkctl mesh install` here")
    if mesh.trust == "open":
        results.append(r(Verdict.DEGRADED, f"trust = \"open\" (mesh id {config.mesh.mesh_id!r})",
                         "any host that knows the mesh id (it is in the mDNS record) can join and receive prompts",
                         "create a mesh CA (`viiworkctl mesh ca init`) and enrol each node; then set trust = \"ca\""))
    for cert in (mesh.ca, mesh.node_certificate):
        if cert is None:
            continue
        if cert.error:
            remedy = enrol if cert.role == "node certificate" else \
                "point mesh.ca_certificate at the mesh CA's ca.crt (made by `viiworkctl mesh ca init`)"
            results.append(r(Verdict.FAIL, f"{cert.path}: {cert.error}", cannot_join, remedy, subject=cert.role))
            continue
        if cert.not_after is not None:
            left = cert.not_after - facts.observed_at
            if left <= dt.timedelta(0):
                results.append(r(Verdict.FAIL, f"{cert.path} expired {cert.not_after:%Y-%m-%d}", cannot_join,
                                 enrol if cert.role == "node certificate" else "renew the CA certificate",
                                 subject=cert.role))
                continue
            if left < dt.timedelta(days=CERT_WARN_DAYS):
                results.append(r(Verdict.DEGRADED, f"{cert.path} expires {cert.not_after:%Y-%m-%d} ({left.days} days)",
                                 "the node drops out of the mesh when it expires",
                                 f"renew it now ({enrol})" if cert.role == "node certificate" else "renew the CA certificate",
                                 subject=cert.role))
                continue
        until = f", valid until {cert.not_after:%Y-%m-%d}" if cert.not_after else ""
        results.append(r(Verdict.OK, f"{cert.path}: {cert.subject}{until}", subject=cert.role))
    key = mesh.node_key
    if key is not None:
        if not key.exists:
            if mesh.trust == "ca":
                results.append(r(Verdict.FAIL, f"{key.path} does not exist", cannot_join,
                                 f"start the agent once (it creates the key), then {enrol}", subject="node key"))
        elif key.mode is not None and key.mode & 0o077:
            results.append(r(Verdict.FAIL, f"{key.path} has mode {key.mode:04o}",
                             "the agent refuses a key others can read: whoever reads it can impersonate this node",
                             f"`chmod 600 {key.path}` (and re-enrol with a new key if others may have read it)",
                             subject="node key"))
        elif key.matches_certificate is False:
            results.append(r(Verdict.FAIL, f"{key.path} does not match the node certificate", cannot_join,
                             f"install the certificate signed for this node's key ({enrol})", subject="node key"))
        elif key.error:
            results.append(r(Verdict.DEGRADED, f"{key.path}: {key.error}", "the key could not be checked",
                             "run the doctor as root (the state dir is private)", subject="node key"))
        else:
            results.append(r(Verdict.OK, f"{key.path} (mode {key.mode:04o})", subject="node key"))
    return results


@check("mesh.discovery", "Peer discovery (mDNS and seeds)")
def check_mesh_discovery(facts: HostFacts) -> list[CheckResult]:
    """Peers can be found: mDNS is possible on the chosen interfaces (`mesh.interfaces`:
    names or addresses; empty means every non-loopback interface), or static `mesh.seeds`
    are listed.

    - **fail**: no way to find peers: mDNS impossible everywhere and no seeds (or seeds-only
      discovery with an empty seed list).
    - **degraded**: mDNS impossible on a chosen interface (missing, down, no MULTICAST flag),
      or only on loopback (which reaches agents on this host only).
    - **skipped**: a standalone node.
    """
    r = _result("mesh.discovery")
    config = _config(facts)
    if config.mesh is None:
        raise Skip("standalone node (no [mesh])")
    mesh = facts.need("mesh")
    seeds = bool(mesh.seeds) and "seeds" in mesh.discovery
    alone = "this node finds no peers: it serves alone and nobody forwards to it"
    results: list[CheckResult] = []
    if "mdns" not in mesh.discovery:
        if seeds:
            return [r(Verdict.OK, f"seeds only: {_plural(len(mesh.seeds), 'seed')}")]
        return [r(Verdict.FAIL, "mDNS is off and mesh.seeds is empty", alone,
                  "list peers in mesh.seeds (host:port of their mesh listeners), or add \"mdns\" to mesh.discovery")]
    if mesh.interfaces:
        targets = list(mesh.interfaces)
        for i in targets:
            problem = None
            if not i.exists:
                problem = "does not exist on this host" if i.name else "is not an address of this host"
            elif i.up is False:
                problem = "is down"
            elif i.multicast is False:
                problem = "has no MULTICAST flag"
            elif i.loopback:
                problem = "is loopback: mDNS there reaches agents on this host only"
            if problem:
                results.append(r(Verdict.DEGRADED, f"{i.entry} {problem}", "mDNS finds no peers through it",
                                 "choose interfaces that are up and multicast-capable in mesh.interfaces "
                                 "(`ip link` shows MULTICAST and UP)", subject=i.entry))
    else:
        targets = [i for i in mesh.all_interfaces if not i.loopback]
    usable = [i for i in targets if i.exists and i.up is not False and i.multicast is not False and not i.loopback]
    if not usable:
        where = ", ".join(i.entry for i in targets) or "no non-loopback interface"
        if seeds:
            results.append(r(Verdict.DEGRADED, f"mDNS impossible on {where}; relying on {_plural(len(mesh.seeds), 'seed')}",
                             "new peers are found only through the seeds",
                             "add an interface that is up and multicast-capable to mesh.interfaces"))
        else:
            results.append(r(Verdict.FAIL, f"mDNS impossible on {where} and no seeds", alone,
                             "choose an interface that is up and multicast-capable (mesh.interfaces), "
                             "or list peers in mesh.seeds"))
    elif not results:
        extra = f" and {_plural(len(mesh.seeds), 'seed')}" if seeds else ""
        results.append(r(Verdict.OK, f"mDNS on {', '.join(i.entry for i in usable)}{extra}"))
    return results


@check("agent.reachable", "The running agent", agent=True)
def check_agent_reachable(facts: HostFacts) -> CheckResult:
    """The agent answers `GET /v1/status` at the target URL (`--url`, `$VIIWORK_URL`, or the
    config's `api.listen`).

    - **degraded**: nothing answers: this box serves nothing and its capacity is missing
      from the mesh.
    - **fail**: something answers, but not with a readable status.
    """
    r = _result("agent.reachable")
    agent = facts.agent
    if agent is None:
        raise Skip("the running agent was not asked")
    if not agent.reachable:
        return r(Verdict.DEGRADED, f"no agent at {agent.url}: {agent.error}",
                 "this box serves nothing and peers route around it",
                 "start it: `systemctl enable --now viiwork`; see why it stopped: `journalctl -u viiwork -e`")
    if agent.status is None:
        return r(Verdict.FAIL, f"{agent.url}: {agent.error}", "the agent's state cannot be read",
                 "check the URL points at a viiwork agent; see `journalctl -u viiwork -e`")
    node = agent.status.get("node") or {}
    return r(Verdict.OK, f"{node.get('name', '?')} (viiwork {node.get('version', '?')}) at {agent.url}, "
                         f"up {node.get('uptime_s', '?')} s")


@check("agent.backends", "Models and backends the agent runs", agent=True)
def check_agent_backends(facts: HostFacts) -> list[CheckResult]:
    """What the running agent reports for each model.

    - **fail**: every backend of a model is dead: this node cannot serve it until
      `viiworkctl up MODEL`.
    - **degraded**: some backends dead or unhealthy (capacity reduced; unhealthy ones are
      respawned, dead ones are not).
    - **ok**: healthy, starting (phase and progress shown), or down on purpose.
    """
    r = _result("agent.backends")
    status = _agent_status(facts)
    models = status.get("models")
    if not isinstance(models, list):
        raise ValueError("/v1/status has no models list")
    if not models:
        return [r(Verdict.OK, "the agent serves no model")]
    results = []
    for model in models:
        name = str(model.get("name", "?"))
        backends = [b for b in model.get("backends") or [] if isinstance(b, dict)]
        states = [str(b.get("state")) for b in backends]
        logs = f"see why: `viiworkctl logs {name}`"
        if model.get("state") == "down":
            results.append(r(Verdict.OK, "down (parked by the operator; `viiworkctl up` brings it back)", subject=name))
        elif model.get("state") == "dead" or (backends and all(s == "dead" for s in states)):
            reasons = "; ".join(sorted({str(b.get("reason")) for b in backends if b.get("reason")}))[:300]
            results.append(r(Verdict.FAIL, f"every backend dead{': ' + reasons if reasons else ''}",
                             f"this node cannot serve {name} (peers may still)",
                             f"{logs}; fix it, then `viiworkctl up {name}`", subject=name))
        elif any(s in ("dead", "unhealthy") for s in states):
            bad = [b for b in backends if b.get("state") in ("dead", "unhealthy")]
            detail = "; ".join(f"{b.get('id')}: {b.get('state')} {b.get('reason') or ''}".strip() for b in bad)[:300]
            results.append(r(Verdict.DEGRADED, f"{len(bad)} of {_plural(len(backends), 'backend')} not serving: {detail}",
                             "reduced capacity: unhealthy backends are respawned, dead ones are not", logs, subject=name))
        else:
            starting = [b for b in backends if b.get("state") == "starting"]
            healthy = sum(1 for s in states if s == "healthy")
            summary = f"{healthy}/{len(backends)} healthy, {model.get('busy', '?')}/{model.get('slots', '?')} slots busy"
            if starting:
                b = starting[0]
                progress = b.get("progress")
                pct = f" {progress * 100:.0f}%" if isinstance(progress, (int, float)) and progress >= 0 else ""
                summary += f"; starting: {b.get('phase') or 'loading'}{pct}"
            results.append(r(Verdict.OK, summary, subject=name))
    return results


@check("agent.config", "The agent runs the config on disk", agent=True)
def check_agent_config(facts: HostFacts) -> CheckResult:
    """The models the local agent serves are the models the config on disk names.

    - **degraded**: they differ: the config was edited and not reloaded.
    - **skipped**: the agent asked is not on this host (`--url` elsewhere), or no valid config.
    """
    r = _result("agent.config")
    config = _config(facts)
    status = _agent_status(facts)
    assert facts.agent is not None  # _agent_status skips otherwise
    host = urllib.parse.urlsplit(facts.agent.url).hostname or ""
    if not is_loopback(host):
        raise Skip(f"the agent at {facts.agent.url} is not this host")
    serving = {str(m.get("name")) for m in status.get("models") or [] if isinstance(m, dict)}
    configured = {m.name for m in config.models}
    if serving == configured:
        return r(Verdict.OK, f"serves the {_plural(len(configured), 'model')} of {facts.config.path}")
    parts = []
    if configured - serving:
        parts.append(f"configured but not served: {', '.join(sorted(configured - serving))}")
    if serving - configured:
        parts.append(f"served but not configured: {', '.join(sorted(serving - configured))}")
    return r(Verdict.DEGRADED, "; ".join(parts), "the agent runs an older config than the file on disk",
             "`viiworkctl reload` (or `systemctl reload viiwork`) after `viiworkctl config check`")


@check("agent.state_dir", "Writes into the state dir the agent could not make", agent=True)
def check_agent_state_dir(facts: HostFacts) -> CheckResult:
    """What the running agent could not persist into `node.state_dir` (a disk that filled or
    turned read-only while it ran): the boot generation, open-mode name pins, and engine key
    files a backend's launch could not write (that backend waits, spending no respawn). The
    agent keeps them in memory and retries every 5 s; it never stops over them.

    - **degraded**: writes are pending: they are lost if the agent stops before the disk
      is fixed (a lower boot generation is corrected by the mesh; lost pins are pinned afresh).
    - **skipped**: an agent too old to report it.
    """
    r = _result("agent.state_dir")
    section = _agent_status(facts).get("state_dir")
    if not isinstance(section, Mapping):
        raise Skip("the agent does not report its state dir (older version)")
    pending = [p for p in section.get("pending_writes") or [] if isinstance(p, Mapping)]
    path = section.get("path", "?")
    if not pending:
        return r(Verdict.OK, f"every write into {path} succeeded")
    detail = "; ".join(f"{p.get('what')}: {p.get('error')} ({p.get('errno')}, {p.get('attempts')} attempt(s))"
                       for p in pending)[:300]
    return r(Verdict.DEGRADED, f"{_plural(len(pending), 'write')} into {path} pending: {detail}",
             "kept in memory and retried every 5 s; lost if the agent stops first",
             f"free space on (or remount read-write) the file system holding {path}: `df -h {path}`")


@check("agent.gpus", "GPU problems the agent has seen", agent=True)
def check_agent_gpus(facts: HostFacts) -> list[CheckResult]:
    """The running agent's GPU section: backends on a GPU that vanished, and backends whose
    processes are not on exactly their GPUs (on-GPU verification).

    - **fail**: a backend's GPU vanished (hot-removed or fallen off the bus).
    - **degraded**: a backend runs on a GPU it was not given, or not on one it was given.
    - **skipped**: the agent reports no GPU section.
    """
    r = _result("agent.gpus")
    section = _agent_status(facts).get("gpus")
    if not isinstance(section, dict):
        raise Skip("the agent reports no GPU section")
    results = []
    for lost in section.get("lost_backends") or []:
        results.append(r(Verdict.FAIL, f"its GPU {lost.get('gpu')} vanished {lost.get('age_s', '?')} s ago",
                         "the backend cannot work; the model has less capacity",
                         "check `dmesg` (Xid 79 = fallen off the bus); reset the GPU or reboot",
                         subject=str(lost.get("backend"))))
    for p in section.get("placements") or []:
        if p.get("verdict") == "mismatch":
            results.append(r(Verdict.DEGRADED, str(p.get("reason")),
                             "it competes with another model for GPU memory, or its own GPU sits idle",
                             "check the backend's device variables (`systemctl show UNIT -p Environment`) and the "
                             "engine's device flags", subject=str(p.get("backend"))))
    if not results:
        gpus = section.get("gpus") or []
        verified = sum(1 for p in section.get("placements") or [] if p.get("verdict") == "ok")
        results.append(r(Verdict.OK, f"{_plural(len(gpus), 'GPU')}, {verified} backend placement(s) verified"))
    return results


@check("agent.mesh_identity", "One agent per node identity in the mesh", agent=True)
def check_agent_mesh_identity(facts: HostFacts) -> CheckResult:
    """Whether another running agent publishes this node's id (its state dir was copied to a
    second machine, so both hold one key): docs/mesh.md, "One node per identity".

    - **fail**: two agents run this node id; peers route to neither while it lasts, and the
      one with the higher boot stops (exit 78).
    - **skipped**: no mesh, or an agent too old to report it.
    """
    r = _result("agent.mesh_identity")
    mesh = _agent_status(facts).get("mesh")
    if not isinstance(mesh, Mapping) or not isinstance(mesh.get("self"), Mapping):
        raise Skip("the agent runs no mesh")
    me = mesh["self"]
    if "identity_conflict" not in me:
        raise Skip("the agent does not report identity conflicts (older version)")
    conflict = me.get("identity_conflict")
    if not isinstance(conflict, Mapping):
        return r(Verdict.OK, f"no other agent publishes node id {me.get('id', '?')}")
    fate = "this agent stops" if conflict.get("this_boot_leaves") else "the other agent stops"
    return r(Verdict.FAIL, f"node id {me.get('id', '?')} is also run by the agent at "
                           f"{conflict.get('other_address') or '?'} (boot {conflict.get('other_boot', '?')}; this "
                           f"boot {conflict.get('this_boot', '?')}): {fate}",
             "peers route to neither while both run; the two raise their boot generations against each other",
             "give each machine its own node.state_dir: start the copy from an empty state dir (a new key, so a new "
             "node id) and, with trust = \"ca\", enrol it (`viiworkctl mesh request`, `mesh sign`, `mesh install`)")


# -- running the registry -------------------------------------------------------------------


@dataclass(frozen=True)
class DoctorReport:
    """All results in registry order. ``exit_code``: 1 any fail, 2 degraded only, else 0."""

    results: tuple[CheckResult, ...]
    context: Mapping[str, Any] = field(default_factory=dict)

    @property
    def exit_code(self) -> int:
        return exit_code_for(r.verdict for r in self.results)

    def counts(self) -> dict[str, int]:
        out = {v.value: 0 for v in Verdict}
        for result in self.results:
            out[result.verdict.value] += 1
        return out

    def to_json(self) -> dict[str, Any]:
        return {"exit_code": self.exit_code, "counts": self.counts(), **self.context,
                "results": [x.to_json() for x in self.results]}


def exit_code_for(verdicts: Iterable[Verdict]) -> int:
    """1 when any verdict is fail, 2 when any is degraded, else 0 (skipped counts as ok)."""
    seen = set(verdicts)
    if Verdict.FAIL in seen:
        return 1
    if Verdict.DEGRADED in seen:
        return 2
    return 0


def run_check(item: Check, facts: HostFacts) -> list[CheckResult]:
    """Run one check; a Skip becomes ``skipped``, anything else it raises becomes ``fail``."""
    try:
        out = item.func(facts)
    except Skip as exc:
        return [CheckResult(item.id, Verdict.SKIPPED, str(exc))]
    except FactUnavailable as exc:
        return [CheckResult(item.id, Verdict.FAIL, str(exc), "this part of the host could not be inspected",
                            "run the doctor as root; if it persists, report it with `viiworkctl doctor --json`")]
    except Exception as exc:  # a crashing check is a fail, never a crash of the doctor
        log.debug("doctor check %s crashed", item.id, exc_info=True)
        return [CheckResult(item.id, Verdict.FAIL, f"check crashed: {type(exc).__name__}: {exc}",
                            "this check could not judge the host",
                            "report it as a bug, with the output of `viiworkctl doctor --json`")]
    return [out] if isinstance(out, CheckResult) else list(out)


def run_checks(facts: HostFacts, registry: Sequence[Check] | None = None, *, agent: bool = True,
               context: Mapping[str, Any] | None = None) -> DoctorReport:
    """Run every check of ``registry`` (default: all) on ``facts``; ``agent=False`` leaves out
    the checks of the running agent."""
    checks = REGISTRY if registry is None else registry
    results: list[CheckResult] = []
    for item in checks:
        if item.agent and not agent:
            continue
        results.extend(run_check(item, facts))
    return DoctorReport(tuple(results), dict(context or {}))


def derive_conflicts(facts: HostFacts) -> list[CheckResult]:
    """The host's conflicts: every degraded or failed result of the host checks (pure)."""
    report = run_checks(facts, agent=False)
    return [r for r in report.results if r.verdict in (Verdict.DEGRADED, Verdict.FAIL)]


async def async_startup_conflicts(config_path: str | Path, **gather: Any) -> list[CheckResult]:
    """Gather host facts (in a worker thread, without asking the agent) and log each conflict
    at WARNING: the agent calls this once at start. ``gather`` passes through to gather_facts."""
    facts = await asyncio.to_thread(gather_facts, config_path, url=None, **gather)
    conflicts = derive_conflicts(facts)
    for c in conflicts:
        log.warning("host conflict %s %s%s: %s; %s; fix: %s", c.check, c.verdict.value,
                    f" ({c.subject})" if c.subject else "", c.summary, c.consequence, c.remedy)
    return conflicts


# -- the generated documentation ------------------------------------------------------------

_DOC_HEADER = """\
# `viiworkctl doctor`

<!-- Generated by `python -m viiwork.agent.host.doctor --markdown` from the check registry in
agent/host/doctor.py. Do not edit by hand: change a check's docstring and regenerate. -->

`viiworkctl doctor [--config FILE] [--url URL] [--json]` inspects this box and tells you,
for each problem, what it breaks (the consequence) and how to fix it (the remedy). It
reads the config and the host directly, so it works with the agent stopped; when the agent
answers (at `--url`, `$VIIWORK_URL`, or the config's `api.listen`) it also checks what
the agent reports.

Each check gives one or more results with a verdict:

| verdict | meaning |
|---|---|
| `ok` | fine |
| `degraded` | works, but worse than it should: something idles, is missing, or is at risk |
| `fail` | something that should work cannot; a check that crashes is also a `fail` |
| `skipped` | the check does not apply here (and says why) |

Exit status: `0` when every result is `ok` or `skipped`, `2` when the worst is `degraded`,
`1` when any is `fail`. `--json` prints the same results as JSON
(`{"exit_code", "counts", "results": [{"check", "subject", "verdict", "summary",
"consequence", "remedy"}]}`).

Run it as root for the full picture: the state dir and node key are private.

## Checks
"""


def render_markdown(registry: Sequence[Check] | None = None) -> str:
    """docs/doctor.md: the header above, then each check's id, title and docstring."""
    checks = REGISTRY if registry is None else registry
    parts = [_DOC_HEADER]
    for item in checks:
        scope = " (asks the running agent)" if item.agent else ""
        parts.append(f"\n### `{item.id}`: {item.title}{scope}\n\n{item.doc}\n")
    return "".join(parts)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m viiwork.agent.host.doctor",
                                     description="Doctor tools: print docs/doctor.md from the check registry.")
    parser.add_argument("--markdown", action="store_true", help="print the generated docs/doctor.md")
    args = parser.parse_args(argv)
    if not args.markdown:
        parser.print_help()
        return 2
    sys.stdout.write(render_markdown())
    return 0


if __name__ == "__main__":
    sys.exit(main())
