"""The agent's configuration model: pydantic v2 models of every section, and their bounds.

One module because the models are one schema: ``Config`` checks across sections (a GPU in
one model, the mesh summary that all the models make), each section's numbers share the
bounds defined here, and docs/configuration.md documents them as one set of tables (which
tests/unit/test_docs_config.py checks against these models).

Strict: unknown keys are errors, and TOML's types are not coerced. Validators raise
``ValueError`` or, where the problem lies below the value being validated, ``PathError``
with that path; viiwork.agent.config.load turns both into ``ConfigIssue`` lines naming the
path and line. Defaults are docs/configuration.md's tables.
"""

from __future__ import annotations

import ipaddress
import re
import socket
import urllib.parse
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)

from viiwork.agent.config.gang import hosts_problem
from viiwork.engines.contract import EngineOptionsError, Kind
from viiwork.engines.gang import GangEngine, gang_shape
from viiwork.engines.registry import ENGINES, engine_names
from viiwork.mesh.bounds import MAX_INT, MAX_LABEL_CHARS, MAX_MODELS, MAX_NAME_CHARS, model_name_problem
from viiwork.mesh.identity import NodeId, is_node_id
from viiwork.mesh.summary import (
    MAX_ADDRESS_CHARS,
    MAX_SUMMARY_BYTES,
    PROTOCOL_VERSION,
    STATES_OF_PROTOCOL,
    ModelCapacity,
    SummaryPayload,
    canonical_json,
    payload_to_obj,
)

MiB = 1024 * 1024

# Bounds of the numbers in the file; docs/configuration.md gives each key's range. A number
# past them is a typo, and an unbounded one reaches an engine as a flag (``--ctx-size``) or
# the agent as a sleep: every duration is finite and at most a day.
MAX_DURATION_S = 86_400.0
MAX_DURATION_MS = 86_400_000
MAX_PARALLEL = 1024
# ctx_per_slot * parallel stays below this: llama.cpp's n_ctx (the --ctx-size it is given) is
# a 32-bit int.
MAX_CTX_TOTAL = 2**31
MAX_GPU_INDEX = 1023
# Strings that reach the mesh (docs/configuration.md): a mesh id peers compare (mDNS TXT,
# every gossip message), a Linux interface name (IFNAMSIZ - 1 bytes), at most as many
# models as a summary carries. The summary itself must fit MAX_SUMMARY_BYTES (_check_summary_fits).
MAX_MESH_ID_CHARS = 64
_MESH_ID_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")
MAX_IFNAME_BYTES = 15
_ENV_NAME_RE = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


class _Strict(BaseModel):
    # strict: TOML has real types, so "4" for an integer or "yes" for a boolean is a
    # mistake to report, not to coerce. Paths and enums opt out (TOML has no such types).
    # allow_inf_nan: a float key is finite (inf and nan pass no bound; tests/unit/test_config_bounds.py
    # checks every numeric key of every section has an upper bound).
    model_config = ConfigDict(
        extra="forbid", frozen=True, validate_default=True, strict=True, allow_inf_nan=False
    )


def parse_hostport(value: str, field: str = "address", *, allow_port_zero: bool = True) -> tuple[str, int]:
    """Split ``host:port`` (IPv6 as ``[::1]:8086``); ValueError naming the problem.

    Port 0..65535; 1..65535 with ``allow_port_zero=False`` (an address to dial: port 0 is
    only meaningful to bind, as "any free port")."""
    if not isinstance(value, str) or ":" not in value:
        raise ValueError(f"{field} must be host:port, got {value!r}")
    host, _, port_text = value.rpartition(":")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    if not host:
        raise ValueError(f"{field} has an empty host in {value!r}")
    # ASCII digits only: int() also takes "8_0_8_6", " 8086" and other scripts' digits.
    if not (port_text.isascii() and port_text.isdigit()):
        raise ValueError(f"{field} port must be a number, got {port_text!r}")
    port = int(port_text)
    low = 0 if allow_port_zero else 1
    if not low <= port < 65536:
        raise ValueError(f"{field} port must be {low}..65535, got {port}")
    return host, port


def _check_listen(value: str) -> str:
    parse_hostport(value, "listen address")
    return value


# api.allowed_hosts / api.allowed_origins (agent/serving/browser_guard.py): short lists of names.
MAX_ALLOWED_ENTRIES = 64
MAX_ALLOWED_CHARS = 255
_HOST_NAME_RE = re.compile(r"(?=.{1,253}$)[a-z0-9_]([a-z0-9_-]*[a-z0-9_])?(\.[a-z0-9_]([a-z0-9_-]*[a-z0-9_])?)*\.?")


def _check_host_name(host: str) -> bool:
    """A DNS name (letters, digits, '-', '_', dots) or an IP literal (IPv6 in brackets)."""
    if host.startswith("[") and host.endswith("]"):
        try:
            return ipaddress.ip_address(host[1:-1]).version == 6
        except ValueError:
            return False
    return bool(_HOST_NAME_RE.fullmatch(host))


def _check_allowed(values: list[str], what: str, check: Any) -> list[str]:
    """Bounds shared by api.allowed_hosts and api.allowed_origins; ``check(entry)`` -> error text or None."""
    if len(values) > MAX_ALLOWED_ENTRIES:
        raise ValueError(f"at most {MAX_ALLOWED_ENTRIES} entries, got {len(values)}")
    for i, entry in enumerate(values):
        if entry == "*":
            continue
        problem = f"longer than {MAX_ALLOWED_CHARS} characters" if len(entry) > MAX_ALLOWED_CHARS else check(entry)
        if problem is not None:
            raise PathError((i,), f"not {what}: {short_repr(entry)} ({problem}; \"*\" allows any)")
    return values


def _allowed_host_problem(entry: str) -> str | None:
    if entry != entry.lower():
        return "write it in lowercase"
    host, port = entry, None
    if entry.startswith("[") and "]" in entry:
        end = entry.index("]") + 1
        host, rest = entry[:end], entry[end:]
        if rest:
            if not rest.startswith(":"):
                return "[IPv6] may only be followed by :port"
            port = rest[1:]
    elif ":" in entry:
        host, _, port = entry.partition(":")
    if port is not None and not (port.isascii() and port.isdigit() and 0 < int(port) < 65536):
        return "the port must be 1..65535"
    if not _check_host_name(host):
        return "a host is a DNS name, an IPv4 address or [IPv6], optionally with :port"
    return None


def _allowed_origin_problem(entry: str) -> str | None:
    if entry != entry.lower():
        return "write it in lowercase"
    scheme, sep, rest = entry.partition("://")
    if not sep or scheme not in ("http", "https"):
        return "an origin is http:// or https:// followed by host[:port]"
    if "/" in rest or "?" in rest or "#" in rest or "@" in rest:
        return "an origin has no path, query or user part"
    return _allowed_host_problem(rest)


class NodeConfig(_Strict):
    """This node: ``name`` is a label (default: hostname), ``state_dir`` holds keys and state."""

    name: str = Field(default_factory=socket.gethostname, min_length=1, max_length=63)
    state_dir: Path = Field(default=Path("/var/lib/viiwork"), strict=False)

    @field_validator("name")
    @classmethod
    def _name_chars(cls, v: str) -> str:
        if not all(c.isalnum() or c in "-_." for c in v):
            raise ValueError("node name may contain letters, digits, '-', '_' and '.' only")
        return v

    _state_dir = field_validator("state_dir")(classmethod(lambda cls, v: _absolute(v, "state_dir")))


class ApiConfig(_Strict):
    """The client API (HTTP) and the admin socket."""

    listen: str = "0.0.0.0:8086"
    max_body_bytes: int = Field(default=32 * MiB, ge=1024, le=1024 * MiB)
    stream_idle_timeout_s: float = Field(default=120.0, gt=0, le=MAX_DURATION_S)
    client_stall_timeout_s: float = Field(default=10.0, gt=0, le=MAX_DURATION_S)
    # Connection limits (agent/serving/api_listener.py; docs/configuration.md gives the reasons).
    head_timeout_s: float = Field(default=10.0, gt=0, le=3600.0)
    body_read_timeout_s: float = Field(default=30.0, gt=0, le=MAX_DURATION_S)
    body_timeout_s: float = Field(default=60.0, gt=0, le=MAX_DURATION_S)
    keepalive_timeout_s: float = Field(default=75.0, gt=0, le=MAX_DURATION_S)
    max_connections: int = Field(default=4096, ge=1, le=1_000_000)
    max_connections_per_address: int = Field(default=256, ge=0, le=1_000_000)  # 0: no per-address cap
    admin_socket: Path = Field(default=Path("/run/viiwork/admin.sock"), strict=False)
    # Browser safety (agent/serving/browser_guard.py; docs/security.md, "Browsers").
    allowed_hosts: list[str] = Field(default_factory=list)
    allowed_origins: list[str] = Field(default_factory=list)

    _listen = field_validator("listen")(classmethod(lambda cls, v: _check_listen(v)))
    _allowed_hosts = field_validator("allowed_hosts")(classmethod(
        lambda cls, v: _check_allowed(v, "a host or host:port", _allowed_host_problem)))
    _allowed_origins = field_validator("allowed_origins")(classmethod(
        lambda cls, v: _check_allowed(v, "an origin", _allowed_origin_problem)))
    _admin_socket = field_validator("admin_socket")(classmethod(lambda cls, v: _absolute(v, "admin_socket")))


class HealthConfig(_Strict):
    """The health ladder (docs/architecture.md, "A backend's life")."""

    interval_s: float = Field(default=5.0, gt=0, le=MAX_DURATION_S)
    timeout_s: float = Field(default=10.0, gt=0, le=MAX_DURATION_S)
    max_failures: int = Field(default=3, ge=1, le=1000)
    max_respawns: int = Field(default=3, ge=0, le=1000)
    drain_timeout_s: float = Field(default=60.0, ge=0, le=MAX_DURATION_S)
    respawn_backoff_s: float = Field(default=1.0, gt=0, le=MAX_DURATION_S)
    respawn_backoff_max_s: float = Field(default=60.0, gt=0, le=MAX_DURATION_S)
    healthy_refill_s: float = Field(default=600.0, gt=0, le=MAX_DURATION_S)
    success_counts_as_probe_s: float = Field(default=10.0, ge=0, le=MAX_DURATION_S)


class SupervisorConfig(_Strict):
    """How backends are run: ``runner`` auto (systemd when the bus has systemd1), systemd, process."""

    runner: Literal["auto", "systemd", "process"] = "auto"
    bus: Literal["system", "user"] = "system"
    bus_address: str | None = None
    max_parallel_loads: int = Field(default=1, ge=1, le=1024)
    stop_timeout_s: float = Field(default=10.0, gt=0, le=MAX_DURATION_S)
    load_poll_interval_s: float = Field(default=1.0, gt=0, le=MAX_DURATION_S)
    load_stale_after_s: float = Field(default=3.0, gt=0, le=MAX_DURATION_S)
    max_concurrent_respawns: int = Field(default=1, ge=1, le=1024)
    respawn_jitter_s: float = Field(default=1.0, ge=0, le=MAX_DURATION_S)
    log_dir: Path | None = Field(default=None, strict=False)

    _log_dir = field_validator("log_dir")(classmethod(lambda cls, v: v if v is None else _absolute(v, "log_dir")))


class UsageConfig(_Strict):
    """The usage ledger (agent/usage; docs/usage.md): a row per finished request served here."""

    path: Path | None = Field(default=None, strict=False)
    retention_days: int = Field(default=90, ge=1, le=3650)

    _path = field_validator("path")(classmethod(lambda cls, v: v if v is None else _absolute(v, "path")))

    def file(self, state_dir: Path) -> Path:
        """The ledger's file: ``path``, else ``<state_dir>/usage.sqlite3``."""
        return self.path if self.path is not None else Path(state_dir) / "usage.sqlite3"


class OutliersConfig(_Strict):
    """``[routing.outliers]``: outlier ejection (docs/routing.md, "Outlier ejection"); the
    keys after ``enabled`` are viiwork.agent.serving.outliers.OutlierSettings' fields."""

    enabled: bool = True
    consecutive_failures: int = Field(default=5, ge=1, le=1000)
    failure_rate: float = Field(default=0.5, gt=0, le=1)
    min_requests: int = Field(default=10, ge=1, le=100_000)
    window_s: float = Field(default=10.0, gt=0, le=MAX_DURATION_S)
    base_ejection_s: float = Field(default=5.0, gt=0, le=MAX_DURATION_S)
    max_ejection_s: float = Field(default=120.0, gt=0, le=MAX_DURATION_S)
    jitter: float = Field(default=0.1, ge=0, le=0.1)
    probe_timeout_s: float = Field(default=30.0, gt=0, le=MAX_DURATION_S)
    reset_after_successes: int = Field(default=20, ge=1, le=100_000)
    report_after_ejections: int = Field(default=3, ge=1, le=1000)
    max_targets: int = Field(default=4096, ge=1, le=1_000_000)

    @model_validator(mode="after")
    def _ejection_order(self) -> OutliersConfig:
        if self.max_ejection_s < self.base_ejection_s:
            raise PathError(("max_ejection_s",), f"must be at least base_ejection_s ({self.base_ejection_s:g} s), "
                            f"got {self.max_ejection_s:g}")
        return self


class RoutingConfig(_Strict):
    """Admission and routing (docs/routing.md)."""

    queue_max: int = Field(default=64, ge=0, le=65536)
    queue_timeout_s: float = Field(default=20.0, gt=0, le=MAX_DURATION_S)
    forward_retry: int = Field(default=1, ge=0, le=64)
    stale_after_ms: int = Field(default=3000, ge=1, le=MAX_DURATION_MS)
    slot_offers: bool = True
    outliers: OutliersConfig = Field(default_factory=OutliersConfig)
    # Prefix-aware routing (docs/routing.md, "Prefix-aware routing"; agent/serving/prefixes.py).
    prefix_routing: bool = True
    prefix_sharing: Literal["tenant", "model"] = "tenant"
    prefix_index_entries: int = Field(default=16384, ge=16, le=1 << 24)
    prefix_guard_slots: int = Field(default=2, ge=0, le=1 << 16)
    prefix_min_blocks: int = Field(default=1, ge=1, le=1 << 16)


# How a node finds its peers (mesh.discovery); the default is both, in this order.
DiscoveryMethod = Literal["mdns", "seeds"]
DISCOVERY_METHODS: tuple[DiscoveryMethod, ...] = ("mdns", "seeds")


class MeshConfig(_Strict):
    """The mesh (docs/mesh.md). Present means this node joins a mesh; ``trust`` has no default."""

    trust: Literal["ca", "open"]
    listen: str = "0.0.0.0:8087"
    advertise: str | None = None
    interfaces: list[str] = Field(default_factory=list)
    discovery: list[DiscoveryMethod] = Field(default_factory=lambda: list(DISCOVERY_METHODS))
    seeds: list[str] = Field(default_factory=list)
    mesh_id: str | None = None
    ca_certificate: Path | None = Field(default=None, strict=False)
    node_certificate: Path | None = Field(default=None, strict=False)
    node_key: Path | None = Field(default=None, strict=False)
    # Rounds vs timeouts: suspect_after_ms >= 2 rounds, dead_after_ms >= 3 (_trust_needs), so a
    # round is at most a third of a day.
    gossip_interval_ms: int = Field(default=500, ge=10, le=MAX_DURATION_MS // 3)
    fanout: int = Field(default=3, ge=1, le=1024)
    suspect_after_ms: int = Field(default=2000, ge=20, le=MAX_DURATION_MS)
    dead_after_ms: int = Field(default=10000, ge=30, le=MAX_DURATION_MS)
    max_peers: int = Field(default=1024, ge=1, le=65536)
    # How members find out who is alive (docs/mesh.md, "Probe mode"): "heartbeat" (every node
    # re-signs its summary every round; liveness from its age) or "probe" (SWIM probing,
    # summaries re-signed on change only; gossip_interval_ms then paces the capacity reads).
    detector: Literal["heartbeat", "probe"] = "probe"
    # Probe mode's failure detector (docs/mesh.md, "Probe mode"): these time it there, in place
    # of suspect_after_ms / dead_after_ms (which then judge heartbeat-mode peers only).
    probe_interval_ms: int = Field(default=500, ge=10, le=60_000)
    probe_timeout_ms: int = Field(default=200, ge=1, le=60_000)
    indirect_checks: int = Field(default=4, ge=0, le=16)
    suspicion_mult: int = Field(default=4, ge=1, le=64)

    _listen = field_validator("listen")(classmethod(lambda cls, v: _check_listen(v)))

    @field_validator("seeds")
    @classmethod
    def _seeds(cls, v: list[str]) -> list[str]:
        for seed in v:
            parse_hostport(seed, "seed", allow_port_zero=False)
        return v

    @field_validator("advertise")
    @classmethod
    def _advertise(cls, v: str | None) -> str | None:
        if v is not None:
            _check_advertise(v)
        return v

    @field_validator("mesh_id")
    @classmethod
    def _mesh_id(cls, v: str | None) -> str | None:
        if v is not None and not (len(v) <= MAX_MESH_ID_CHARS and _MESH_ID_RE.fullmatch(v)):
            raise ValueError(f"mesh_id must be 1-{MAX_MESH_ID_CHARS} characters: letters, digits, '.', '_', '-' "
                             f"(starting with a letter or digit), got {short_repr(v)}")
        return v

    @field_validator("interfaces")
    @classmethod
    def _interfaces(cls, v: list[str]) -> list[str]:
        for i, name in enumerate(v):
            if not name or len(name.encode()) > MAX_IFNAME_BYTES or name in (".", "..") \
                    or any(c == "/" or c.isspace() or not c.isprintable() for c in name):
                raise PathError((i,), (
                    f"not an interface name or IPv4 address: {short_repr(name)} (a Linux interface name is "
                    f"1-{MAX_IFNAME_BYTES} bytes without '/', whitespace or control characters)"))
        return v

    @model_validator(mode="before")
    @classmethod
    def _trust_present(cls, data: Any) -> Any:
        if isinstance(data, dict) and "trust" not in data:
            raise PathError(("trust",), (
                "not set; a [mesh] section must say how nodes trust each other: set "
                "trust = \"ca\" with ca_certificate (the mesh CA's certificate), or "
                "trust = \"open\" with mesh_id (labs: no CA, peers pinned on first use); "
                "remove [mesh] to run a standalone node"
            ))
        return data

    @model_validator(mode="after")
    def _trust_needs(self) -> MeshConfig:
        if self.trust == "open" and not self.mesh_id:
            raise PathError(("mesh_id",), "trust = \"open\" requires mesh_id (a name shared by the nodes of this mesh)")
        if self.trust == "ca" and self.ca_certificate is None:
            raise PathError(("ca_certificate",), (
                "trust = \"ca\" requires ca_certificate (the mesh CA's certificate; "
                "create one with `viiworkctl mesh ca init --out DIR`)"
            ))
        if self.probe_timeout_ms >= self.probe_interval_ms:
            raise PathError(("probe_timeout_ms",), (
                f"probe_timeout_ms = {self.probe_timeout_ms} must be less than probe_interval_ms "
                f"({self.probe_interval_ms}): one probe's ping must end before the next probe starts"))
        if self.dead_after_ms <= self.suspect_after_ms:
            raise PathError(("dead_after_ms",), "dead_after_ms must be greater than suspect_after_ms")
        # A heartbeat needs rounds to spread (docs/mesh.md, "Larger meshes"): a timeout
        # shorter than a few rounds would mark every peer suspect or dead between two rounds.
        for key, rounds in (("suspect_after_ms", 2), ("dead_after_ms", 3)):
            if getattr(self, key) < rounds * self.gossip_interval_ms:
                raise PathError((key,), (
                    f"{key} = {getattr(self, key)} must be at least {rounds} gossip rounds "
                    f"({rounds} * gossip_interval_ms = {rounds * self.gossip_interval_ms})"))
        return self


    def deprecations(self) -> list[str]:
        """Warnings for heartbeat keys set in the file whose role probe mode took over (issue 16
        item 5): [] in heartbeat mode, or when none of them is set. One line at most: the agent
        logs it once at start and ``viiworkctl config check`` prints it (docs/configuration.md)."""
        if self.detector != "probe":
            return []
        timing = [k for k in ("suspect_after_ms", "dead_after_ms") if k in self.model_fields_set]
        pacing = [k for k in ("gossip_interval_ms", "fanout") if k in self.model_fields_set]
        if not timing and not pacing:
            return []
        parts = []
        if timing:
            parts.append(
                f"failure detection is no longer timed by {' and '.join(timing)} but by probes (probe_interval_ms, "
                "probe_timeout_ms, indirect_checks, suspicion_mult); only heartbeat-mode peers (a rolling upgrade) "
                f"are still judged by {'them' if len(timing) > 1 else 'it'}")
        if pacing:
            parts.append(
                f"gossip is no longer paced by {' and '.join(pacing)}: changes spread as news on probes "
                "(every 200 ms to 3 members); only the capacity reads, the leave announcement and heartbeats "
                f"to heartbeat-mode peers still follow {'them' if len(pacing) > 1 else 'it'}")
        return [f"mesh: deprecated with detector = \"probe\": {'; '.join(parts)} "
                "(docs/configuration.md, \"[mesh]\"; remove the key, or set detector = \"heartbeat\")"]


class AuthConfig(_Strict):
    """Client keys (docs/security.md, "Client keys"). Absent section: ``mode = "none"``."""

    mode: Literal["none", "keys"] = "none"
    issuer_keys: Path = Field(default=Path("/etc/viiwork/issuer.pub"), strict=False)
    issuer: str = Field(default="viiwork-issuer", min_length=1, max_length=253)
    audience: str | None = Field(default=None, min_length=1, max_length=253)
    leeway_s: float = Field(default=60.0, ge=0, le=3600.0)
    open_loopback_reads: bool = False
    allow_open_mesh: bool = False
    max_tracked_keys: int = Field(default=65536, ge=1, le=10_000_000)

    _issuer_keys = field_validator("issuer_keys")(classmethod(lambda cls, v: _absolute(v, "issuer_keys")))


#: The longest ``[tracing] endpoint`` (a URL).
MAX_URL_CHARS = 2048


class TracingConfig(_Strict):
    """OpenTelemetry spans exported over OTLP/HTTP (docs/metrics.md, "Tracing"). Absent
    section: no spans and no SDK loaded; trace context is still carried to peers and engines."""

    endpoint: str = Field(min_length=1, max_length=MAX_URL_CHARS)
    sample_ratio: float = Field(default=1.0, ge=0, le=1)
    service_name: str = Field(default="viiwork", min_length=1, max_length=255)
    timeout_s: float = Field(default=10.0, gt=0, le=300.0)

    @field_validator("endpoint")
    @classmethod
    def _endpoint(cls, v: str) -> str:
        problem = _url_problem(v)
        if problem is not None:
            raise ValueError(f"endpoint must be an http:// or https:// URL of an OTLP/HTTP receiver "
                             f"(e.g. \"http://127.0.0.1:4318/v1/traces\"): {problem}, got {short_repr(v)}")
        return v


def _url_problem(value: str) -> str | None:
    """What makes ``value`` not an absolute http(s) URL with a host (None: it is one)."""
    if any(c.isspace() or not c.isprintable() for c in value):
        return "it holds a space or a control character"
    try:
        parts = urllib.parse.urlsplit(value)
        parts.port  # noqa: B018 (raises ValueError on a port that is not 0-65535)
    except ValueError as exc:
        return str(exc)
    if parts.scheme not in ("http", "https"):
        return "it does not start with http:// or https://"
    if not parts.hostname:
        return "it has no host"
    if parts.username is not None or parts.password is not None:
        return "credentials in the URL are not supported"
    return None


GpuRef = Annotated[int | str, Field(union_mode="left_to_right")]


class ModelConfig(_Strict):
    """One ``[[models]]`` entry.

    ``gpus``: NVML indexes (PCI bus order) or GPU UUIDs; empty = CPU. ``gpus_per_backend``
    splits them into backends; ``backends`` is the count for CPU models. ``ctx_per_slot``
    tokens per sequence; ``parallel`` sequences per backend. The engine's own block is named
    for the engine (``[models.llamacpp]``) and is validated by that engine's options model;
    it is stored in ``options``.
    """

    name: str = Field(min_length=1, max_length=MAX_NAME_CHARS)
    engine: str
    path: str = Field(min_length=1)
    kind: Kind = Field(default=Kind.CHAT, strict=False)
    gpus: list[GpuRef] = Field(default_factory=list)
    gpus_per_backend: int = Field(default=1, ge=1, le=MAX_GPU_INDEX + 1)
    backends: int | None = Field(default=None, ge=1, le=64)
    ctx_per_slot: int = Field(default=4096, ge=1, le=MAX_CTX_TOTAL - 1)
    parallel: int = Field(default=4, ge=1, le=MAX_PARALLEL)
    args: list[str] = Field(default_factory=list)
    env: dict[str, str] = Field(default_factory=dict)
    startup_timeout_s: float | None = Field(default=None, gt=0, le=MAX_DURATION_S)
    # Per-backend limits and sandbox, applied by the systemd runner (MemoryMax=, CPUWeight=,
    # TasksMax=, a profile of systemd.exec(5) options); the process runner ignores them.
    memory_max_bytes: int | None = Field(default=None, ge=MiB, le=2**50)
    cpu_weight: int | None = Field(default=None, ge=1, le=10000)
    tasks_max: int | None = Field(default=None, ge=1, le=4_194_304)
    sandbox: Literal["none", "basic", "strict"] = "basic"
    # A gang (docs/configuration.md, "Gangs"; agent/config/gang.py): the hosts serving this one
    # model together, the head first, and the port of the gang's rendezvous.
    hosts: list[str] = Field(default_factory=list)
    gang_port: int | None = Field(default=None, ge=1024, le=65535)
    # nftables rules admitting only the gang's hosts to the ports its parts bind (Ray, torch):
    # agent/gang/firewall.py, docs/security.md. Off: the ports are open to whoever reaches the host.
    gang_firewall: bool = True
    options: Any = None

    @model_validator(mode="before")
    @classmethod
    def _engine_block(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        data = dict(data)
        engine = data.get("engine")
        if "options" in data:
            raise PathError(("options",), "'options' is not a key here: put engine options in a block named for the engine")
        if isinstance(engine, str) and engine not in ENGINES:
            # Reported by the field validator below with the known names; its block (if
            # any) is not reported again as an unknown key.
            if engine not in cls.model_fields:
                data.pop(engine, None)
            return data
        # A block for another engine is reported with the entry's other errors (by the
        # `options` validator), not instead of them.
        mismatched = tuple(name for name in ENGINES if name in data and name != engine)
        for name in mismatched:
            data.pop(name)
        if isinstance(engine, str):
            block = data.pop(engine, {})
            if not isinstance(block, dict):
                raise PathError((engine,), f"'{engine}' must be a table of engine options")
            try:
                data["options"] = ENGINES[engine].options_model.model_validate(block)
            except ValidationError as exc:
                # Reported by the `options` validator, so the entry's other keys are still checked.
                data["options"] = _InvalidBlock(engine, exc, mismatched)
            else:
                if mismatched:
                    data["options"] = _InvalidBlock(engine, None, mismatched)
        return data

    @field_validator("options")
    @classmethod
    def _options_valid(cls, v: Any) -> Any:
        if isinstance(v, _InvalidBlock):
            raise BlockError(v.engine, v.error, v.mismatched)
        return v

    @field_validator("engine")
    @classmethod
    def _known_engine(cls, v: str) -> str:
        if v not in ENGINES:
            raise ValueError(f"unknown engine {v!r}; known engines: {', '.join(engine_names())}")
        return v

    @field_validator("name")
    @classmethod
    def _name_chars(cls, v: str) -> str:
        problem = model_name_problem(v)  # the summary decoder's rule too (mesh/bounds.py)
        if problem is not None:
            raise ValueError(problem)
        return v

    @field_validator("env")
    @classmethod
    def _env_names(cls, v: dict[str, str]) -> dict[str, str]:
        for key in v:
            if not _ENV_NAME_RE.fullmatch(key):
                raise ValueError(f"invalid environment variable name {short_repr(key)} "
                                 "(letters, digits and '_', not starting with a digit)")
        return v

    @model_validator(mode="after")
    def _shape(self) -> ModelConfig:
        if self.gpus:
            if len(set(map(str, self.gpus))) != len(self.gpus):
                raise PathError(("gpus",), "gpus lists a GPU twice")
            if len(self.gpus) % self.gpus_per_backend:
                raise PathError(("gpus_per_backend",), (
                    f"gpus_per_backend = {self.gpus_per_backend} does not divide the "
                    f"{len(self.gpus)} GPUs listed in gpus"
                ))
            if self.backends is not None and self.backends != len(self.gpus) // self.gpus_per_backend:
                raise PathError(("backends",), "backends is for CPU models; with gpus it is len(gpus) / gpus_per_backend")
        if isinstance(self.gpus, list):
            for g in self.gpus:
                if isinstance(g, int) and g < 0:
                    raise PathError(("gpus",), f"gpu index must be >= 0, got {g}")
                if isinstance(g, int) and g > MAX_GPU_INDEX:
                    raise PathError(("gpus",), f"gpu index must be <= {MAX_GPU_INDEX}, got {g}")
        if self.ctx_per_slot * self.parallel >= MAX_CTX_TOTAL:
            # Named at ctx_per_slot (the line shown); the message names both fields.
            raise PathError(("ctx_per_slot",), (
                f"ctx_per_slot * parallel = {self.ctx_per_slot} * {self.parallel} = "
                f"{self.ctx_per_slot * self.parallel} must be below 2**31 = {MAX_CTX_TOTAL} "
                "(the engine's whole context, llama.cpp's --ctx-size)"
            ))
        return self

    @model_validator(mode="after")
    def _gang(self) -> ModelConfig:
        if self.hosts:
            problem = hosts_problem(self.hosts)
            if problem is not None:
                raise PathError(("hosts", *problem[0]), problem[1])
            if gang_shape(ENGINES[self.engine]) is None:
                raise PathError(("hosts",), f"engine {self.engine!r} cannot serve one model across hosts")
            if self.gang_port is None:
                raise PathError(("gang_port",), (
                    "a gang needs gang_port: the port of its rendezvous (the head's, and a llama.cpp "
                    "worker's rpc-server on loopback), the same in every host's config"))
            for key in ("gpus_per_backend", "backends"):
                if key in self.model_fields_set:
                    raise PathError((key,), "not with hosts: a gang's host runs one part over all its gpus")
            span = getattr(ENGINES[self.engine], "gang_port_span", 1)
            if self.gang_port + span - 1 > 65535:
                raise PathError(("gang_port",), (
                    f"a {self.engine} gang binds gang_port .. gang_port + {span - 1} on every host: "
                    f"gang_port must be at most {65536 - span}, got {self.gang_port}"))
        elif self.gang_port is not None:
            raise PathError(("gang_port",), "is for a model served by a gang (set hosts)")
        engine = ENGINES[self.engine]
        if isinstance(engine, GangEngine) and self.options is not None:
            try:
                engine.check_gang(self.options, max(1, len(self.hosts)), len(self.gpus))
            except EngineOptionsError as exc:
                raise PathError(tuple(exc.path.split(".")), exc.message) from None
        return self

    @property
    def backend_count(self) -> int:
        """How many backends this model runs on this node (a gang's host: one part, 1)."""
        if self.hosts:
            return 1
        if self.gpus:
            return len(self.gpus) // self.gpus_per_backend
        return self.backends or 1

    def backend_gpus(self, index: int) -> tuple[str, ...]:
        """The GPUs of backend ``index`` (0-based), as strings; () for CPU. A gang's host
        lends all its gpus to its one part."""
        if not self.gpus:
            return ()
        if self.hosts:
            return tuple(str(g) for g in self.gpus)
        n = self.gpus_per_backend
        return tuple(str(g) for g in self.gpus[index * n:(index + 1) * n])

    @property
    def effective_startup_timeout_s(self) -> float:
        if self.startup_timeout_s is not None:
            return self.startup_timeout_s
        return float(ENGINES[self.engine].default_startup_timeout_s)


class Config(_Strict):
    """The whole file. Sections: node, api, mesh (optional), routing, health, supervisor, auth, usage,
    tracing (optional), models."""

    node: NodeConfig = Field(default_factory=NodeConfig)
    api: ApiConfig = Field(default_factory=ApiConfig)
    mesh: MeshConfig | None = None
    routing: RoutingConfig = Field(default_factory=RoutingConfig)
    health: HealthConfig = Field(default_factory=HealthConfig)
    supervisor: SupervisorConfig = Field(default_factory=SupervisorConfig)
    auth: AuthConfig = Field(default_factory=AuthConfig)
    usage: UsageConfig = Field(default_factory=UsageConfig)
    tracing: TracingConfig | None = None
    models: list[ModelConfig] = Field(default_factory=list)

    @model_validator(mode="after")
    def _cross(self) -> Config:
        seen: dict[str, int] = {}
        owner: dict[str, str] = {}
        for i, m in enumerate(self.models):
            if m.name in seen:
                raise PathError(("models", i, "name"), f"model {m.name!r} is already defined by models[{seen[m.name]}]")
            seen[m.name] = i
            for g in m.gpus:
                if str(g) in owner:
                    raise PathError(("models", i, "gpus"),
                                     f"GPU {g} already belongs to model {owner[str(g)]!r}; a GPU belongs to one model")
                owner[str(g)] = m.name
            if m.hosts and self.mesh is None:
                raise PathError(("models", i, "hosts"), (
                    "a model served by a gang needs [mesh]: the head asks its workers over the mesh "
                    "(docs/mesh.md, \"Gangs\")"))
            if m.hosts and self.mesh is not None and self.mesh.trust == "open":
                named = [h for h in m.hosts if not is_node_id(h)]
                if named:
                    raise PathError(("models", i, "hosts"), (
                        f"{', '.join(repr(h) for h in named)} "
                        + ("is not a node id" if len(named) == 1 else "are not node ids")
                        + " (16 characters of a-z and 2-7) under mesh trust \"open\", where any member can take a "
                        "name (the first node seen with it is pinned) and so receive the model and its prompts, "
                        "or command a host's GPUs: name every host by node id, the same list on every host "
                        "(`viiworkctl mesh id` prints a node's), or use trust = \"ca\", whose certificates bind "
                        "the names (docs/configuration.md, \"Gangs\")"))
        _check_gang_ports(self)
        if self.mesh is not None:
            _check_summary_fits(self)
        _check_auth(self)
        return self


def _check_gang_ports(config: Config) -> None:
    """A gang's block of ports (``gang_port`` .. + the engine's span) must not hold this host's
    API or mesh port, nor overlap another gang entry's block: its parts could not bind."""
    taken: dict[int, str] = {}
    for name, listen in (("api.listen", config.api.listen),
                         ("mesh.listen", config.mesh.listen if config.mesh is not None else "")):
        digits = listen.rpartition(":")[2]
        if digits.isdigit() and int(digits):
            taken[int(digits)] = name
    blocks: list[tuple[int, int, str]] = []
    for i, m in enumerate(config.models):
        if not m.hosts or m.gang_port is None:
            continue
        span = int(getattr(ENGINES.get(m.engine), "gang_port_span", 1))
        first, last = m.gang_port, m.gang_port + span - 1
        for port, holder in taken.items():
            if first <= port <= last:
                raise PathError(("models", i, "gang_port"), (
                    f"the gang's ports {first}..{last} hold {holder}'s port {port}: pick another gang_port"))
        for other_first, other_last, other in blocks:
            if first <= other_last and other_first <= last:
                raise PathError(("models", i, "gang_port"), (
                    f"the gang's ports {first}..{last} overlap model {other!r}'s {other_first}..{other_last}: "
                    "pick another gang_port"))
        blocks.append((first, last, m.name))


def _check_auth(config: Config) -> None:
    """Keys mode needs a mesh whose members are vetted, and an audience every node shares."""
    if config.auth.mode != "keys" or config.mesh is None:
        return
    if config.mesh.trust == "open" and not config.auth.allow_open_mesh:
        raise PathError(("auth", "mode"), (
            "mode = \"keys\" needs mesh trust = \"ca\": in open mode anyone who knows the mesh id is a member "
            "and receives forwarded keys; set auth.allow_open_mesh = true to run it anyway (labs)"))
    if config.auth.audience is None and not config.mesh.mesh_id:
        raise PathError(("auth", "audience"), (
            "not set and [mesh] has no mesh_id: set auth.audience (or mesh.mesh_id) to the audience "
            "the mesh's keys are issued for (`viiworkctl keys issue --audience`)"))


def auth_audience(config: Config) -> str:
    """The ``aud`` this node accepts: ``auth.audience``, else the mesh id, else the node name."""
    if config.auth.audience is not None:
        return config.auth.audience
    if config.mesh is not None and config.mesh.mesh_id:
        return config.mesh.mesh_id
    return config.node.name


_HOST_LABEL_RE = re.compile(r"(?!-)[A-Za-z0-9-]{1,63}(?<!-)")


def _check_advertise(value: str) -> None:
    """``advertise``: an IP address, or a DNS name or IPv4 address with an optional ``:port``
    (mesh/node.py splits a single colon off as the port). It goes into every summary and
    into mDNS, so it is refused here, not by a resolver at start."""
    try:
        ipaddress.ip_address(value)
        return
    except ValueError:
        pass
    host = value
    if value.count(":") == 1:
        host, _ = parse_hostport(value, "advertise", allow_port_zero=False)
    if len(host) > 253 or not all(_HOST_LABEL_RE.fullmatch(label) for label in host.rstrip(".").split(".")):
        raise ValueError(f"advertise must be an IP address or a host name, optionally with :port, got {short_repr(value)}")


def _absolute(value: Path, field: str) -> Path:
    # An empty or relative path would resolve against the agent's working directory.
    if not str(value) or not value.is_absolute():
        raise ValueError(f"{field} must be an absolute path, got {short_repr(str(value))}")
    return value


def largest_summary_bytes(config: Config) -> int:
    """The canonical size of the largest summary ``config`` can publish, built with the real
    encoder (mesh/summary.py) from the worst case of every value the config does not fix:
    the longest addresses, version and boot nonce, counters at their decoders' bounds, a
    fingerprint for every model. GPUs are not counted: they come from the host, and the
    publisher drops them from a summary that would not fit (mesh/publisher.py)."""
    worst_int = MAX_INT
    models = tuple(ModelCapacity(
        name=m.name, engine=m.engine, kind=m.kind.value, slots=1 << 20, busy=1 << 20, waiting=worst_int,
        ctx_per_slot=1 << 30, healthy=1 << 16, total=1 << 16, fingerprint="f" * 16) for m in config.models)
    payload = SummaryPayload(
        protocol=PROTOCOL_VERSION, mesh_id=(config.mesh.mesh_id if config.mesh and config.mesh.mesh_id else "m" * 16),
        node_id=NodeId("n" * 16), name=config.node.name, api="a" * MAX_ADDRESS_CHARS,
        mesh="a" * MAX_ADDRESS_CHARS, version="v" * MAX_LABEL_CHARS, generation=worst_int,
        boot="b" * MAX_LABEL_CHARS, seq=worst_int, speaks=1 << 16, models=models,
        state=max(STATES_OF_PROTOCOL[PROTOCOL_VERSION], key=lambda st: len(st.value)))
    return len(canonical_json(payload_to_obj(payload)))


def _check_summary_fits(config: Config) -> None:
    if len(config.models) > MAX_MODELS:  # peers refuse a summary with more (mesh/summary.py)
        raise PathError(("models", MAX_MODELS), (
            f"{len(config.models)} [[models]]: a node in a mesh serves at most {MAX_MODELS} "
            "(its summary carries no more)"))
    size = largest_summary_bytes(config)
    if size > MAX_SUMMARY_BYTES:
        longest = max(range(len(config.models)), key=lambda i: len(config.models[i].name))
        raise PathError(("models", longest, "name"), (
            f"the node's mesh summary could reach {size} bytes with these {len(config.models)} models, over the "
            f"{MAX_SUMMARY_BYTES}-byte limit: shorten the model names (this one is "
            f"{len(config.models[longest].name)} characters) or serve fewer models"))


def is_loopback(host: str) -> bool:
    """True for a loopback IP address (127.0.0.0/8, ::1) or the name ``localhost``."""
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def short_repr(value: Any) -> str:
    """``repr(value)`` cut to 60 characters, for messages that quote what the file said."""
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


class PathError(ValueError):
    """An error that knows its path below the object being validated (raised inside
    validators; the loader, viiwork.agent.config.load, prefixes the object's own location).
    ``path``: keys and 0-based array indexes, ``message``: the text shown after it."""

    def __init__(self, path: tuple[str | int, ...], message: str) -> None:
        super().__init__(message)
        self.path = path
        self.message = message


@dataclass(frozen=True)
class _InvalidBlock:
    """An engine block that failed its options model, or blocks named for other engines
    (stands in for ``options``)."""

    engine: str
    error: ValidationError | None
    mismatched: tuple[str, ...] = ()


class BlockError(ValueError):
    """An engine block's own validation errors (``error``, or None), which the loader
    re-paths under ``models[i].<engine>``, and the blocks named for other engines
    (``mismatched``: engine names), each reported at ``models[i].<name>``."""

    def __init__(self, engine: str, error: ValidationError | None, mismatched: tuple[str, ...] = ()) -> None:
        super().__init__(f"invalid '{engine}' block")
        self.engine = engine
        self.error = error
        self.mismatched = mismatched
