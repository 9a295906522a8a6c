"""Facts about this host and its config, as observed: the input of the doctor's checks.

Gathering (``gather_facts``) reads the config file, the GPUs (NVML, sysfs, udev), device
nodes, engine binaries and their versions, disk space, mesh trust files, network
interfaces and, when asked, the running agent's ``/v1/status``. It works with the agent down.
Each section is gathered on its own: one that raises is recorded in ``HostFacts.errors`` and
left ``None``, so one broken reader never hides the others.

Judging the facts is not done here: ``viiwork.agent.host.doctor`` holds the checks, pure
functions of a ``HostFacts``. Every reader takes its root (``sysfs_root``, ``dev_root``,
``net_root``) or source as a parameter so the same gathering runs on recorded hosts.
"""

from __future__ import annotations

import datetime as dt
import ipaddress
import json
import logging
import os
import re
import socket
import stat
import subprocess
import urllib.error
import urllib.request
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path
from typing import Any

from viiwork.agent.config.schema import Config, ConfigError, ConfigIssue, ModelConfig, load_config
from viiwork.agent.host.gpus.amd import AmdSysfsReader
from viiwork.agent.host.gpus.inventory import GpuInventory, GpuSource, read_inventory
from viiwork.agent.host.gpus.nvml import NvmlReader
from viiwork.agent.host.gpus.udev import PciGpu, enumerate_pci_gpus
from viiwork.engines.contract import BackendSpec, Version
from viiwork.engines.registry import ENGINES

log = logging.getLogger(__name__)

VERSION_TIMEOUT_S = 10.0


class FactUnavailable(Exception):
    """A check needs a section that could not be gathered; the message says why."""


# -- config ---------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class ConfigFacts:
    """The config file: ``config`` when it loaded, else the ``issues`` that stopped it."""

    path: str
    exists: bool
    config: Config | None
    issues: tuple[ConfigIssue, ...] = ()
    text: str | None = None


def read_config_facts(path: str | Path) -> ConfigFacts:
    p = Path(path)
    try:
        config = load_config(p)
    except ConfigError as exc:
        return ConfigFacts(str(p), p.exists(), None, tuple(exc.issues), _read_text(p))
    return ConfigFacts(str(p), True, config, (), _read_text(p))


def _read_text(path: Path) -> str | None:
    try:
        return path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError):
        return None


# -- device nodes ---------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class DeviceNodes:
    """GPU device nodes in /dev: ``nvidia`` (nvidiaN, nvidiactl), ``kfd`` (/dev/kfd, ROCm),
    ``dri_render`` (/dev/dri/renderD*)."""

    nvidia: tuple[str, ...] = ()
    kfd: bool = False
    dri_render: tuple[str, ...] = ()


_NVIDIA_NODE = re.compile(r"^nvidia(\d+|ctl)$")


def read_device_nodes(dev_root: str | Path = "/dev") -> DeviceNodes:
    dev = Path(dev_root)
    try:
        nvidia = tuple(sorted(str(dev / n) for n in os.listdir(dev) if _NVIDIA_NODE.match(n)))
    except OSError:
        nvidia = ()
    try:
        render = tuple(sorted(str(dev / "dri" / n) for n in os.listdir(dev / "dri") if n.startswith("renderD")))
    except OSError:
        render = ()
    return DeviceNodes(nvidia, (dev / "kfd").exists(), render)


# -- engine binaries ------------------------------------------------------------------------


class BinaryState(StrEnum):
    OK = "ok"
    MISSING = "missing"
    NOT_EXECUTABLE = "not_executable"
    UNKNOWN = "unknown"          # the engine could not say which binary it runs


@dataclass(frozen=True, slots=True)
class BinaryFact:
    """One engine binary the config uses, shared by the models listed.

    binary: argv[0] of the engine's command for these models. resolved: the file it names
    (PATH searched for a bare name), or None. option_path: the config field that sets it,
    when the engine's options have a ``binary`` field (``models[0].llamacpp.binary``).
    version: what the binary reports (parsed by the engine's ``Version`` capability when
    it has one, else the first version line of ``BINARY --version``); version_source says
    which ("engine", "--version"); minimum_version: the engine's minimum, when it has one.
    """

    engine: str
    display_name: str
    binary: str
    models: tuple[str, ...]
    state: BinaryState
    detail: str = ""
    resolved: str | None = None
    option_path: str | None = None
    version: str | None = None
    version_source: str | None = None
    minimum_version: str | None = None
    version_error: str | None = None


def backend_spec_for(model: ModelConfig) -> BackendSpec:
    """The spec of the model's first backend with a placeholder port: enough to ask an
    engine which command it would run (nothing is started)."""
    return BackendSpec(
        model=model.name, kind=model.kind, path=model.path, port=1, ctx_per_slot=model.ctx_per_slot,
        parallel=model.parallel, options=model.options, gpus=model.backend_gpus(0),
        backends_on_node=model.backend_count, args=tuple(model.args),
    )


def resolve_binary(binary: str, path_env: str | None = None) -> tuple[BinaryState, str | None, str]:
    """Where ``binary`` is and whether it can run: (state, resolved path or None, detail).

    A name without "/" is searched on ``path_env`` (default $PATH) like execvp does; a file
    found there that cannot be executed is NOT_EXECUTABLE rather than missing.
    """
    if "/" in binary:
        candidates = [Path(binary)]
    else:
        search = path_env if path_env is not None else os.environ.get("PATH", os.defpath)
        candidates = [Path(d or ".") / binary for d in search.split(os.pathsep)]
    not_executable: Path | None = None
    for candidate in candidates:
        if candidate.is_file():
            if os.access(candidate, os.X_OK):
                return BinaryState.OK, str(candidate), f"{candidate}"
            not_executable = not_executable or candidate
        elif candidate.exists() and "/" in binary:
            return BinaryState.NOT_EXECUTABLE, str(candidate), f"{candidate} is not a regular file"
    if not_executable is not None:
        return BinaryState.NOT_EXECUTABLE, str(not_executable), f"{not_executable} is not executable"
    if "/" in binary:
        return BinaryState.MISSING, None, f"{binary} does not exist"
    return BinaryState.MISSING, None, f"{binary!r} is not on PATH"


VersionRunner = Callable[[Sequence[str]], tuple[str | None, str | None]]


def run_version_command(argv: Sequence[str], timeout_s: float = VERSION_TIMEOUT_S) -> tuple[str | None, str | None]:
    """Run a version command: (combined stdout+stderr, or None; error text, or None). Blocking."""
    try:
        done = subprocess.run(list(argv), stdin=subprocess.DEVNULL, capture_output=True, timeout=timeout_s,
                              check=False)
    except subprocess.TimeoutExpired:
        return None, f"`{' '.join(argv)}` did not finish within {timeout_s:g} s"
    except OSError as exc:
        return None, f"`{' '.join(argv)}` could not run: {exc.strerror or exc}"
    output = (done.stdout + done.stderr).decode("utf-8", "replace")
    if done.returncode != 0:
        lines = [line.strip() for line in output.splitlines() if line.strip()]
        said = f": {lines[-1][:200]}" if lines else ""
        return output, f"`{' '.join(argv)}` exited with status {done.returncode}{said}"
    return output, None


def first_version_line(output: str, strict: bool = False) -> str | None:
    """The line that states a version ("version: 4520 (1d1ccce6)"), else the first non-empty
    line (None with ``strict``, used when the command failed: its output is an error).

    Builds print device enumeration before the version (ggml_cuda_init: ...), so the first
    line mentioning "version" wins.
    """
    lines = [line.strip() for line in output.splitlines() if line.strip()]
    for line in lines:
        if "version" in line.lower():
            return line[:200]
    return lines[0][:200] if lines and not strict else None


def _version_tuple(text: str) -> tuple[int, ...] | None:
    m = re.match(r"^\D*(\d+(?:\.\d+)*)", text)
    return tuple(int(p) for p in m.group(1).split(".")) if m else None


def version_at_least(version: str, minimum: str) -> bool | None:
    """True/False when both read as dotted numbers, else None (cannot compare)."""
    have, need = _version_tuple(version), _version_tuple(minimum)
    if have is None or need is None:
        return None
    width = max(len(have), len(need))
    return have + (0,) * (width - len(have)) >= need + (0,) * (width - len(need))


def read_binary_facts(config: Config, *, read_versions: bool = True, runner: VersionRunner = run_version_command,
                      path_env: str | None = None, engines: Mapping[str, Any] = ENGINES) -> tuple[BinaryFact, ...]:
    """One fact per distinct (engine, binary) among the configured models (blocking).

    ``engines``: the adapters by name (the registry; a test passes one with a capability added).
    """
    groups: dict[tuple[str, str], list[tuple[int, ModelConfig]]] = {}
    unknown: list[BinaryFact] = []
    for i, model in enumerate(config.models):
        engine = engines[model.engine]
        try:
            binary = engine.build_command(backend_spec_for(model)).argv[0]
        except Exception as exc:  # an engine that cannot build a command for this model
            unknown.append(BinaryFact(model.engine, engine.display_name, "?", (model.name,), BinaryState.UNKNOWN,
                                      f"the engine cannot build a command: {type(exc).__name__}: {exc}"))
            continue
        groups.setdefault((model.engine, binary), []).append((i, model))
    facts: list[BinaryFact] = []
    for (engine_name, binary), members in groups.items():
        engine = engines[engine_name]
        first_index, first = members[0]
        state, resolved, detail = resolve_binary(binary, path_env)
        option_path = None
        fields = getattr(type(first.options), "model_fields", {})
        if "binary" in fields:
            option_path = f"models[{first_index}].{engine_name}.binary"
        version = source = minimum = error = None
        if state is BinaryState.OK and read_versions:
            if isinstance(engine, Version):
                minimum = engine.minimum_version
                output, error = runner(engine.version_command(first.options))
                version = engine.parse_version(output) if output is not None else None
                source = "engine"
                if version is None and error is None:
                    error = "the engine's version command gave no version"
            elif not Path(resolved or binary).name.startswith("python"):
                # No Version capability: the binary's own --version line, reported as said.
                # (A python interpreter as argv[0] would report Python's version.)
                output, error = runner([resolved or binary, "--version"])
                version = first_version_line(output, strict=error is not None) if output is not None else None
                source = "--version"
        facts.append(BinaryFact(engine_name, engine.display_name, binary, tuple(m.name for _, m in members), state,
                                detail, resolved, option_path, version, source, minimum, error))
    return tuple(facts + unknown)


# -- model paths and disks ------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class ModelPathFact:
    """A model's ``path`` when it is a local path (absolute, or starting with ./ ~/):
    ``exists``/``readable`` by the user running the gathering. Hub ids are not local."""

    model: str
    index: int
    path: str
    exists: bool
    readable: bool


def _is_local(path: str) -> bool:
    return path.startswith(("/", "./", "../", "~"))


def read_model_paths(config: Config) -> tuple[ModelPathFact, ...]:
    out = []
    for i, model in enumerate(config.models):
        if not _is_local(model.path):
            continue
        p = Path(model.path).expanduser()
        exists = p.exists()
        out.append(ModelPathFact(model.name, i, model.path, exists, exists and os.access(p, os.R_OK)))
    return tuple(out)


@dataclass(frozen=True, slots=True)
class DiskFact:
    """Free space of one filesystem: ``roles`` say what lives there ("state dir /var/lib/viiwork").

    path: the existing directory measured (the nearest existing ancestor of the configured one).
    free_bytes: available to unprivileged users (statvfs f_bavail). total_bytes: size.
    """

    roles: tuple[str, ...]
    path: str
    free_bytes: int
    total_bytes: int


def _existing_ancestor(path: Path) -> Path:
    path = path.expanduser()
    if not path.is_absolute():
        path = Path.cwd() / path
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def read_disks(config: Config) -> tuple[DiskFact, ...]:
    """Free space where the agent keeps state and logs and where local models live."""
    places: list[tuple[str, Path]] = [(f"state dir {config.node.state_dir}", config.node.state_dir)]
    if config.supervisor.log_dir is not None:
        places.append((f"log dir {config.supervisor.log_dir}", config.supervisor.log_dir))
    for model in config.models:
        if _is_local(model.path):
            p = Path(model.path).expanduser()
            places.append((f"model {model.name}", p if p.is_dir() else p.parent))
    by_device: dict[int, tuple[list[str], Path, os.statvfs_result]] = {}
    for role, place in places:
        existing = _existing_ancestor(Path(place))
        device = existing.stat().st_dev
        if device not in by_device:
            by_device[device] = ([], existing, os.statvfs(existing))
        by_device[device][0].append(role)
    return tuple(
        DiskFact(tuple(roles), str(path), st.f_bavail * st.f_frsize, st.f_blocks * st.f_frsize)
        for roles, path, st in by_device.values()
    )


# -- mesh -----------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class CertFact:
    """A certificate file: ``error`` when it cannot be read or does not verify; ``not_after`` UTC."""

    role: str
    path: str
    exists: bool
    error: str | None = None
    subject: str | None = None
    not_after: dt.datetime | None = None


@dataclass(frozen=True, slots=True)
class KeyFact:
    """The node key file: ``mode`` (permission bits) and whether it matches the certificate."""

    path: str
    exists: bool
    mode: int | None = None
    matches_certificate: bool | None = None
    error: str | None = None


@dataclass(frozen=True, slots=True)
class InterfaceFact:
    """A network interface as configured (``entry``: a name or an address) and as found.

    up/multicast/loopback: from the kernel's interface flags; None when not known (an
    address that is local but whose interface could not be named).
    """

    entry: str
    name: str | None
    exists: bool
    up: bool | None = None
    multicast: bool | None = None
    loopback: bool | None = None


@dataclass(frozen=True, slots=True)
class MeshFacts:
    """The ``[mesh]`` section's trust files and discovery interfaces.

    interfaces: the configured ``mesh.interfaces`` (empty: all). all_interfaces: every
    interface of the host (what "all" means).
    """

    trust: str
    discovery: tuple[str, ...]
    seeds: tuple[str, ...]
    interfaces: tuple[InterfaceFact, ...]
    all_interfaces: tuple[InterfaceFact, ...]
    ca: CertFact | None = None
    node_certificate: CertFact | None = None
    node_key: KeyFact | None = None


IFF_UP, IFF_LOOPBACK, IFF_MULTICAST = 0x1, 0x8, 0x1000


def read_interface(name: str, net_root: Path) -> InterfaceFact:
    base = net_root / name
    try:
        flags = int((base / "flags").read_text().strip(), 16)
    except (OSError, ValueError):
        return InterfaceFact(name, name, False)
    try:
        operstate = (base / "operstate").read_text().strip()
    except OSError:
        operstate = "unknown"
    up = bool(flags & IFF_UP) and operstate in ("up", "unknown")
    return InterfaceFact(name, name, True, up, bool(flags & IFF_MULTICAST), bool(flags & IFF_LOOPBACK))


def _interface_of_address(address: str, net_root: Path) -> InterfaceFact:
    """An address entry: the interface holding it (IPv6 from /proc/net/if_inet6; IPv4 by a
    bind test, which proves it is local but not which interface holds it)."""
    ip = ipaddress.ip_address(address)
    if ip.version == 6:
        try:
            for line in Path("/proc/net/if_inet6").read_text().splitlines():
                parts = line.split()
                if len(parts) >= 6 and ipaddress.ip_address(int(parts[0], 16)) == ip:
                    fact = read_interface(parts[5], net_root)
                    return InterfaceFact(address, fact.name, fact.exists, fact.up, fact.multicast, fact.loopback)
        except OSError:
            pass
    family = socket.AF_INET6 if ip.version == 6 else socket.AF_INET
    with socket.socket(family, socket.SOCK_DGRAM) as sock:
        try:
            sock.bind((address, 0))
        except OSError:
            return InterfaceFact(address, None, False)
    return InterfaceFact(address, None, True, True, None, ip.is_loopback)


def read_interfaces(entries: Sequence[str], net_root: str | Path = "/sys/class/net") -> tuple[
        tuple[InterfaceFact, ...], tuple[InterfaceFact, ...]]:
    """(the configured entries, every interface of the host)."""
    root = Path(net_root)
    try:
        names = sorted(os.listdir(root))
    except OSError:
        names = []
    all_ifaces = tuple(read_interface(n, root) for n in names)
    chosen = []
    for entry in entries:
        try:
            ipaddress.ip_address(entry)
        except ValueError:
            chosen.append(read_interface(entry, root))
        else:
            chosen.append(_interface_of_address(entry, root))
    return tuple(chosen), all_ifaces


def read_mesh_facts(config: Config, net_root: str | Path = "/sys/class/net",
                    now: dt.datetime | None = None) -> MeshFacts | None:
    """Trust files and interfaces of the ``[mesh]`` section; None for a standalone node."""
    mesh = config.mesh
    if mesh is None:
        return None
    from viiwork.mesh import identity, trust  # the mesh package owns the file names and rules

    now = now or dt.datetime.now(dt.UTC)
    chosen, all_ifaces = read_interfaces(mesh.interfaces, net_root)
    state_dir = Path(config.node.state_dir)
    ca_fact = node_fact = None
    key_path = Path(mesh.node_key) if mesh.node_key else state_dir / identity.KEY_FILE
    node_cert_obj = None
    if mesh.trust == "ca":
        ca_path = Path(mesh.ca_certificate) if mesh.ca_certificate else state_dir / trust.CA_CERT_FILE
        try:
            loaded_ca = trust.load_certificate(ca_path)
            trust.mesh_id_for_ca(loaded_ca)  # refuses a CA whose key is not Ed25519
        except trust.TrustError as exc:
            ca_obj = None
            ca_fact = CertFact("CA certificate", str(ca_path), ca_path.exists(), str(exc))
        else:
            ca_obj = loaded_ca
            ca_fact = CertFact("CA certificate", str(ca_path), True, None, loaded_ca.subject.rfc4514_string(),
                               loaded_ca.not_valid_after_utc)
        node_path = Path(mesh.node_certificate) if mesh.node_certificate else state_dir / trust.NODE_CERT_FILE
        if not node_path.exists():
            node_fact = CertFact("node certificate", str(node_path), False, f"{node_path} does not exist")
        else:
            try:
                node_cert_obj = trust.load_certificate(node_path)
                error = None
                if ca_obj is not None:
                    try:
                        trust.CaTrust(ca_obj).verify_certificate(trust.certificate_der(node_path.read_bytes()), now)
                    except trust.TrustError as exc:
                        error = f"{type(exc).__name__}: {exc}"
                node_fact = CertFact("node certificate", str(node_path), True, error,
                                     node_cert_obj.subject.rfc4514_string(), node_cert_obj.not_valid_after_utc)
            except (trust.TrustError, OSError) as exc:
                node_fact = CertFact("node certificate", str(node_path), True, str(exc))
    key_fact = _key_fact(key_path, node_cert_obj)
    return MeshFacts(mesh.trust, tuple(mesh.discovery), tuple(mesh.seeds), chosen, all_ifaces,
                     ca_fact, node_fact, key_fact)


def _key_fact(path: Path, cert: Any) -> KeyFact:
    from cryptography.hazmat.primitives import serialization

    try:
        mode = stat.S_IMODE(path.stat().st_mode)
    except FileNotFoundError:
        return KeyFact(str(path), False)
    except OSError as exc:
        return KeyFact(str(path), True, None, None, f"cannot stat: {exc.strerror or exc}")
    matches = None
    error = None
    if cert is not None:
        try:
            key = serialization.load_pem_private_key(path.read_bytes(), password=None)
            raw = serialization.Encoding.Raw, serialization.PublicFormat.Raw
            matches = key.public_key().public_bytes(*raw) == cert.public_key().public_bytes(*raw)
        except (OSError, ValueError, TypeError) as exc:
            error = f"cannot read the key: {exc}"
    return KeyFact(str(path), True, mode, matches, error)


# -- the running agent ----------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class AgentFacts:
    """What ``GET {url}/v1/status`` answered: ``status`` (the JSON document) or ``error``."""

    url: str
    reachable: bool
    status: Mapping[str, Any] | None = None
    error: str | None = None


def read_agent(url: str, timeout_s: float = 3.0) -> AgentFacts:
    """GET /v1/status from the agent (blocking, bounded by ``timeout_s``)."""
    try:
        with urllib.request.urlopen(f"{url.rstrip('/')}/v1/status", timeout=timeout_s) as resp:
            body = resp.read(8 * 1024 * 1024)
    except urllib.error.HTTPError as exc:
        return AgentFacts(url, True, None, f"/v1/status answered HTTP {exc.code}")
    except (urllib.error.URLError, OSError, TimeoutError) as exc:
        reason = getattr(exc, "reason", exc)
        return AgentFacts(url, False, None, str(reason))
    try:
        doc = json.loads(body)
        if not isinstance(doc, dict):
            raise ValueError("not a JSON object")
    except ValueError as exc:
        return AgentFacts(url, True, None, f"/v1/status is not valid JSON: {exc}")
    return AgentFacts(url, True, doc)


# -- all of it ------------------------------------------------------------------------------


@dataclass(frozen=True)
class HostFacts:
    """Everything the checks look at. A section is None when it was not gathered (see ``errors``)."""

    observed_at: dt.datetime
    config: ConfigFacts
    gpus: GpuInventory | None = None
    pci_gpus: tuple[PciGpu, ...] | None = None
    device_nodes: DeviceNodes | None = None
    binaries: tuple[BinaryFact, ...] | None = None
    model_paths: tuple[ModelPathFact, ...] | None = None
    disks: tuple[DiskFact, ...] | None = None
    mesh: MeshFacts | None = None
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
) -> HostFacts:
    """Observe this host and its config (blocking: run it in a worker thread from async code).

    url: the agent's base URL; None skips the running-agent section. gpu_sources: the GPU
    readers (default NVML + sysfs at /). Each section that raises is recorded in ``errors``.
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
        try:
            return read_inventory(sources)
        finally:
            for s in sources:
                close = getattr(s, "close", None)
                if close is not None:
                    close()

    section("gpus", gpus)
    section("pci_gpus", pci_gpus)
    section("device_nodes", lambda: read_device_nodes(dev_root))
    if config is not None:
        section("binaries", lambda: read_binary_facts(config, read_versions=read_versions, runner=version_runner))
        section("model_paths", lambda: read_model_paths(config))
        section("disks", lambda: read_disks(config))
        section("mesh", lambda: read_mesh_facts(config, net_root, now))
    if url is not None:
        section("agent", lambda: read_agent(url, agent_timeout_s))
    return HostFacts(now, config_facts, errors=errors, **values)
