"""Facts about this host and its config, as observed: the input of the doctor's checks.

Gathering (``gather_facts``) reads the config file, the GPUs (NVML, sysfs, udev), device
nodes, engine binaries and their versions, disk space, mesh trust files, network
interfaces and, when asked, the running agent's ``/v1/status``. It works with the agent down.
Each section is gathered on its own: one that raises is recorded in ``HostFacts.errors`` and
left ``None``, so one broken reader never hides the others.

Judging the facts is not done here: ``viiwork.agent.host.doctor`` holds the checks, pure
functions of a ``HostFacts``. Every reader takes its root (``sysfs_root``, ``dev_root``,
``net_root``) or source as a parameter so the same gathering runs on recorded hosts.

Layout: one module per section (``config``, ``devices``, ``engines``, ``disks``, ``mesh``,
``auth``, ``agent``), each with its fact types and its reader; this package holds ``HostFacts`` (every
section together) and ``gather_facts``, and re-exports the sections' public names.
"""

from __future__ import annotations

import datetime as dt
import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from viiwork.agent.host.facts.agent import AgentFacts, read_agent
from viiwork.agent.host.facts.auth import IssuerKeysFact, read_issuer_keys
from viiwork.agent.host.facts.config import ConfigFacts, read_config_facts
from viiwork.agent.host.facts.devices import DeviceNodes, read_device_nodes
from viiwork.agent.host.facts.disks import DiskFact, ModelPathFact, read_disks, read_model_paths
from viiwork.agent.host.facts.engines import (
    VERSION_TIMEOUT_S,
    BinaryFact,
    BinaryState,
    GangFirewallFact,
    VersionRunner,
    backend_spec_for,
    first_version_line,
    read_binary_facts,
    read_gang_firewall,
    resolve_binary,
    run_version_command,
    version_at_least,
)
from viiwork.agent.host.facts.mesh import (
    CertFact,
    InterfaceFact,
    KeyFact,
    MeshFacts,
    read_interface,
    read_interfaces,
    read_mesh_facts,
    read_node_id,
)
from viiwork.agent.host.gpus.amd import AmdSysfsReader
from viiwork.agent.host.gpus.inventory import GpuInventory, GpuSource, read_inventory_once
from viiwork.agent.host.gpus.nvml import NvmlReader
from viiwork.agent.host.gpus.udev import PciGpu, enumerate_pci_gpus

__all__ = [
    "VERSION_TIMEOUT_S",
    "AgentFacts",
    "BinaryFact",
    "BinaryState",
    "CertFact",
    "ConfigFacts",
    "DeviceNodes",
    "DiskFact",
    "FactUnavailable",
    "GangFirewallFact",
    "HostFacts",
    "InterfaceFact",
    "IssuerKeysFact",
    "KeyFact",
    "MeshFacts",
    "ModelPathFact",
    "VersionRunner",
    "backend_spec_for",
    "first_version_line",
    "gather_facts",
    "read_agent",
    "read_binary_facts",
    "read_config_facts",
    "read_device_nodes",
    "read_gang_firewall",
    "read_disks",
    "read_interface",
    "read_interfaces",
    "read_issuer_keys",
    "read_mesh_facts",
    "read_node_id",
    "read_model_paths",
    "resolve_binary",
    "run_version_command",
    "version_at_least",
]

log = logging.getLogger(__name__)


class FactUnavailable(Exception):
    """A check needs a section that could not be gathered; the message says why."""


@dataclass(frozen=True)
class HostFacts:
    """Everything the checks look at. A section is None when it was not gathered (see ``errors``)."""

    observed_at: dt.datetime
    config: ConfigFacts
    gpus: GpuInventory | None = None
    pci_gpus: tuple[PciGpu, ...] | None = None
    device_nodes: DeviceNodes | None = None
    binaries: tuple[BinaryFact, ...] | None = None
    gang_firewall: GangFirewallFact | None = None
    model_paths: tuple[ModelPathFact, ...] | None = None
    disks: tuple[DiskFact, ...] | None = None
    mesh: MeshFacts | None = None
    issuer_keys: IssuerKeysFact | None = None  # None also when client keys are off
    agent: AgentFacts | None = None
    errors: Mapping[str, str] = field(default_factory=dict)

    def need(self, section: str) -> Any:
        """The section's value; FactUnavailable when it could not be gathered."""
        if section in self.errors:
            raise FactUnavailable(f"could not read {section}: {self.errors[section]}")
        value = getattr(self, section)
        if value is None:
            raise FactUnavailable(f"{section} was not gathered")
        return value


def gather_facts(
    config_path: str | Path,
    *,
    url: str | None = None,
    gpu_sources: Sequence[GpuSource] | None = None,
    pci_gpus: Callable[[], tuple[PciGpu, ...]] = enumerate_pci_gpus,
    dev_root: str | Path = "/dev",
    net_root: str | Path = "/sys/class/net",
    read_versions: bool = True,
    version_runner: VersionRunner = run_version_command,
    now: dt.datetime | None = None,
    agent_timeout_s: float = 3.0,
    api_key: str | None = None,
) -> HostFacts:
    """Observe this host and its config (blocking: run it in a worker thread from async code).

    url: the agent's base URL; None skips the running-agent section. api_key: a client key
    sent to it (an agent with client keys on). gpu_sources: the GPU readers (default NVML +
    sysfs at /). Each section that raises is recorded in ``errors``.
    """
    now = now or dt.datetime.now(dt.UTC)
    errors: dict[str, str] = {}
    values: dict[str, Any] = {}

    def section(name: str, fn: Callable[[], Any]) -> None:
        try:
            values[name] = fn()
        except Exception as exc:  # one broken reader must not hide the others
            log.debug("gathering %s failed", name, exc_info=True)
            errors[name] = f"{type(exc).__name__}: {exc}"

    config_facts = read_config_facts(config_path)
    config = config_facts.config

    def gpus() -> GpuInventory:
        sources: list[GpuSource] = list(gpu_sources) if gpu_sources is not None else [NvmlReader(), AmdSysfsReader("/")]
        return read_inventory_once(sources)

    section("gpus", gpus)
    section("pci_gpus", pci_gpus)
    section("device_nodes", lambda: read_device_nodes(dev_root))
    if config is not None:
        section("binaries", lambda: read_binary_facts(config, read_versions=read_versions, runner=version_runner))
        section("gang_firewall", lambda: read_gang_firewall(config))
        section("model_paths", lambda: read_model_paths(config, read_node_id(config)))
        section("disks", lambda: read_disks(config))
        section("mesh", lambda: read_mesh_facts(config, net_root, now))
        section("issuer_keys", lambda: read_issuer_keys(config))
    if url is not None:
        section("agent", lambda: read_agent(url, agent_timeout_s, api_key))
    return HostFacts(now, config_facts, errors=errors, **values)
