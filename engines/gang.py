"""Gangs: one model served by several hosts, each running one part (docs/engines.md, "Gangs").

The engines split a model across machines with their own distributed runtimes; an adapter
only says which of three **launch shapes** its engine follows and builds each part's command
from the backend's spec plus the gang's addresses. Pure values and one optional capability
(``GangEngine``); the order in which parts start and the readiness rule are the sans-IO plan
of :mod:`viiwork.engines.gang_plan`.

Shapes (the engines' own documentation: SGLang's multi-node ``--nnodes/--node-rank/
--dist-init-addr``; llama.cpp's ``tools/rpc/README.md``; vLLM's "Distributed inference and
serving" with Ray):

- ``RANKS``: every host runs the same server with its rank; rank 0 serves HTTP (SGLang, torch).
- ``WORKERS_THEN_HEAD``: the other hosts run a worker program first, then the head starts the
  server that uses them (llama.cpp: ``rpc-server`` workers, ``llama-server --rpc`` head).
- ``CLUSTER_RUNTIME``: the head starts a cluster runtime, workers join it, then the server
  starts on the head and places its workers through the runtime (vLLM on Ray).
"""

from __future__ import annotations

import ipaddress
import re
import secrets
from dataclasses import dataclass
from enum import StrEnum
from typing import TYPE_CHECKING, ClassVar, NewType, Protocol, runtime_checkable

from viiwork.engines.contract import EngineOptionsError

if TYPE_CHECKING:
    from pydantic import BaseModel

    from viiwork.engines.contract import BackendSpec, LaunchCommand

GangId = NewType("GangId", str)

#: A gang id: 12 characters of lowercase base32 (60 random bits), fresh for every gang start.
GANG_ID_CHARS = 12
_GANG_ID_RE = re.compile(rf"[a-z2-7]{{{GANG_ID_CHARS}}}")
_B32 = "abcdefghijklmnopqrstuvwxyz234567"

#: Most hosts one gang spans: llama.cpp's GGML_RPC_MAX_SERVERS is 16 RPC servers per head.
MAX_GANG_HOSTS = 17
#: The largest tensor- or pipeline-parallel size an entry may set: 17 hosts of 60 GPUs stay
#: under it; a larger number is a typo.
MAX_PARALLEL_SIZE = 1024


class LaunchShape(StrEnum):
    """How a multi-host engine's parts are started (module docstring)."""

    RANKS = "ranks"
    WORKERS_THEN_HEAD = "workers_then_head"
    CLUSTER_RUNTIME = "cluster_runtime"


class PartRole(StrEnum):
    """What a part runs.

    SERVER: the part that serves HTTP on the head (rank 0); its readiness is the gang's.
    RANK: a non-serving rank of a ``RANKS`` gang (ranks 1..n-1; the same server program).
    WORKER: a worker program of a ``WORKERS_THEN_HEAD`` gang (ranks 1..n-1).
    RUNTIME: the cluster runtime of a ``CLUSTER_RUNTIME`` gang, on every host (rank 0 is its head).
    """

    SERVER = "server"
    RANK = "rank"
    WORKER = "worker"
    RUNTIME = "runtime"


@dataclass(frozen=True, slots=True, order=True)
class GangPart:
    """One part of a gang: ``rank`` is its host's index in the entry's ``hosts`` (0 = head)."""

    rank: int
    role: PartRole

    def __str__(self) -> str:
        return f"r{self.rank}-{self.role.value}"


def new_gang_id(token: bytes | None = None) -> GangId:
    """A fresh gang id: 12 lowercase base32 characters from 60 bits of ``token`` (default:
    ``secrets.token_bytes(8)``). A gang gets a new id at every start, so the units of a gang
    that is being replaced never share a name with the new one's."""
    raw = int.from_bytes(token if token is not None else secrets.token_bytes(8), "big")
    return GangId("".join(_B32[(raw >> (5 * i)) & 31] for i in range(GANG_ID_CHARS)))


def is_gang_id(value: object) -> bool:
    """True for a string of the shape ``new_gang_id`` makes."""
    return isinstance(value, str) and _GANG_ID_RE.fullmatch(value) is not None


def hostport(host: str, port: int) -> str:
    """``host:port``, an IPv6 literal in brackets (``[fd00::1]:29500``)."""
    try:
        if ipaddress.ip_address(host).version == 6:
            return f"[{host}]:{port}"
    except ValueError:
        pass
    return f"{host}:{port}"


@dataclass(frozen=True, slots=True)
class GangAddresses:
    """Where a gang's parts are, as the agent's gang launcher gives them to an adapter.

    gang_id: the gang's id (``new_gang_id``), in unit names and environment.
    rank: this host's rank, 0..size-1 (its index in the entry's ``hosts``; 0 = head).
    size: how many hosts the gang spans, 2..MAX_GANG_HOSTS.
    node_addresses: each rank's address on the network the engines' own traffic uses (an IP
        address or a DNS name, no port), index = rank; ``node_addresses[0]`` is the head's.
    port: the gang's port (the entry's ``gang_port``): what the head's rendezvous listens on
        (SGLang's ``--dist-init-addr``, Ray's GCS) and, on a llama.cpp worker, rpc-server's
        loopback port. 1..65535.
    worker_endpoints: ``host:port`` per worker rank 1..size-1, in rank order, where the
        HEAD reaches that worker's part (llama.cpp: the local end of the agents' tunnel to
        that worker's rpc-server); () when the shape needs none or on a worker.

    Raises ValueError naming the field on any inconsistency.
    """

    gang_id: str
    rank: int
    size: int
    node_addresses: tuple[str, ...]
    port: int
    worker_endpoints: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if not is_gang_id(self.gang_id):
            raise ValueError(f"GangAddresses.gang_id must be {GANG_ID_CHARS} characters of a-z, 2-7, "
                             f"got {self.gang_id!r}")
        if not 2 <= self.size <= MAX_GANG_HOSTS:
            raise ValueError(f"GangAddresses.size must be 2..{MAX_GANG_HOSTS}, got {self.size}")
        if not 0 <= self.rank < self.size:
            raise ValueError(f"GangAddresses.rank must be 0..{self.size - 1}, got {self.rank}")
        if len(self.node_addresses) != self.size or not all(_is_address(a) for a in self.node_addresses):
            raise ValueError(f"GangAddresses.node_addresses must be {self.size} addresses without a port, "
                             f"got {self.node_addresses!r}")
        if not 0 < self.port < 65536:
            raise ValueError(f"GangAddresses.port must be 1..65535, got {self.port}")
        if self.worker_endpoints and len(self.worker_endpoints) != self.size - 1:
            raise ValueError(f"GangAddresses.worker_endpoints must list the {self.size - 1} workers (ranks 1.."
                             f"{self.size - 1}) or be empty, got {len(self.worker_endpoints)}")
        for endpoint in self.worker_endpoints:
            host, sep, port = endpoint.rpartition(":")
            if not sep or not host or not (port.isascii() and port.isdigit() and 0 < int(port) < 65536):
                raise ValueError(f"GangAddresses.worker_endpoints: {endpoint!r} is not host:port")

    @property
    def head_address(self) -> str:
        """The head's address (rank 0)."""
        return self.node_addresses[0]

    @property
    def self_address(self) -> str:
        """This host's address (``node_addresses[rank]``)."""
        return self.node_addresses[self.rank]

    @property
    def head_endpoint(self) -> str:
        """``head:port``: where the head's rendezvous (SGLang) or runtime (Ray GCS) listens."""
        return hostport(self.head_address, self.port)


@dataclass(frozen=True, slots=True, order=True)
class PortRange:
    """TCP ports ``first..last`` (both included, 1..65535) that a gang's part binds on its
    host's gang address (``GangEngine.gang_ports``). Raises ValueError when out of range or
    reversed."""

    first: int
    last: int

    def __post_init__(self) -> None:
        if not 0 < self.first <= self.last < 65536:
            raise ValueError(f"PortRange must be 1 <= first <= last <= 65535, got {self.first}..{self.last}")

    def __str__(self) -> str:
        return str(self.first) if self.first == self.last else f"{self.first}-{self.last}"


def port_block(port: int, span: int) -> tuple[PortRange, ...]:
    """The gang's whole block ``port..port+span-1`` as one range; () when ``span`` is 0."""
    return (PortRange(port, port + span - 1),) if span > 0 else ()


def _is_address(address: object) -> bool:
    """An IP address (IPv6 without brackets) or a DNS name: no port, no spaces."""
    if not isinstance(address, str) or not address or any(c.isspace() for c in address):
        return False
    try:
        ipaddress.ip_address(address)
    except ValueError:
        return ":" not in address and "/" not in address
    return True


@runtime_checkable
class GangEngine(Protocol):
    """An engine that can serve one model across hosts (optional capability).

    launch_shape: its ``LaunchShape``.
    per_host_options: the keys of its options block that each host sets for itself
        (binaries, threads, device selection); every other key is part of the entry all the
        gang's hosts must agree on (viiwork.agent.config.gang, "shared part").
    workers_load_model: whether a non-head part reads the model file itself (SGLang ranks
        and Ray workers do; llama.cpp's rpc-server workers get tensors from the head and do not).
    gang_port_span: how many ports from ``gang_port`` up the engine's parts may bind on a
        host (``gang_port..gang_port+span-1`` must be free on every host); 1 for an engine
        that binds ``gang_port`` only. The config refuses a ``gang_port`` whose block passes 65535.
    """

    launch_shape: ClassVar[LaunchShape]
    per_host_options: ClassVar[frozenset[str]]
    workers_load_model: ClassVar[bool]
    gang_port_span: ClassVar[int]

    def check_gang(self, options: BaseModel, hosts: int, gpus: int) -> None:
        """Validate a model entry's parallelism for a gang of ``hosts`` hosts (1: not a gang)
        where this host lends ``gpus`` GPUs (0: CPU). Raises ``EngineOptionsError`` whose
        ``path`` is relative to the model entry (``"vllm.tensor_parallel"``, ``"gpus"``)."""
        ...

    def gang_shared(self, options: BaseModel, hosts: int, gpus: int) -> dict[str, object]:
        """The part of the options block all of a gang's hosts must agree on, as JSON values:
        every key but ``per_host_options`` (``shared_options``), with the values in force
        (parallel sizes resolved: two hosts that leave ``tensor_parallel`` unset but lend
        different GPU counts disagree)."""
        ...

    def gang_command(self, spec: BackendSpec, role: PartRole, gang: GangAddresses) -> LaunchCommand:
        """The command of this host's part ``role`` (rank ``gang.rank``); pure. ``spec`` is the
        host's backend spec (its own GPUs and options); its port (or socket) is where the
        SERVER part (and an SGLang rank's health server) listens, unused by other parts.
        Raises ``EngineOptionsError`` for a role the engine's shape does not have at that rank."""
        ...

    def gang_listen(self, role: PartRole, gang: GangAddresses) -> str | None:
        """``host:port`` where part ``role`` of rank ``gang.rank`` accepts TCP connections once
        it is up, checked from its own host (the plan's ``Ready.PORT``); None when it listens
        on nothing the plan waits for."""
        ...

    def gang_ports(self, role: PartRole, gang: GangAddresses) -> tuple[PortRange, ...]:
        """The TCP ports part ``role`` of rank ``gang.rank`` binds on its host's gang address
        (``gang.self_address``) for the other hosts to reach, all inside ``gang.port ..
        gang.port + gang_port_span - 1``; () when it binds none there (loopback only, or
        ports the engine cannot pin, which docs/security.md lists). The agent admits only
        the gang's hosts to these (agent/gang/firewall.py); pure."""
        ...


def gang_shape(engine: object) -> LaunchShape | None:
    """The engine's launch shape, or None when it cannot run as a gang (no ``GangEngine``, or a
    ``launch_shape`` that is not a ``LaunchShape``)."""
    shape = getattr(engine, "launch_shape", None)
    if not isinstance(shape, LaunchShape) or not isinstance(engine, GangEngine):
        return None
    return shape


def roles_at(shape: LaunchShape, rank: int) -> tuple[PartRole, ...]:
    """The parts a host of ``rank`` runs in a gang of ``shape``, in start order:
    RANKS: (SERVER,) at rank 0, (RANK,) elsewhere; WORKERS_THEN_HEAD: (SERVER,) at 0,
    (WORKER,) elsewhere; CLUSTER_RUNTIME: (RUNTIME, SERVER) at 0, (RUNTIME,) elsewhere."""
    if rank < 0:
        raise ValueError(f"rank must be >= 0, got {rank}")
    if shape is LaunchShape.CLUSTER_RUNTIME:
        return (PartRole.RUNTIME, PartRole.SERVER) if rank == 0 else (PartRole.RUNTIME,)
    if rank == 0:
        return (PartRole.SERVER,)
    return (PartRole.RANK,) if shape is LaunchShape.RANKS else (PartRole.WORKER,)


def parallel_sizes(tensor_parallel: int | None, pipeline_parallel: int | None, hosts: int, gpus: int) -> tuple[int, int]:
    """The (tensor, pipeline) parallel sizes of a gang of ``hosts`` hosts lending ``gpus`` GPUs
    each: the options' values, or by default tensor-parallel over each host's GPUs and
    pipeline-parallel over the hosts (vLLM's advice for multi-node serving: tensor parallelism
    inside a node, pipeline parallelism across nodes)."""
    return (tensor_parallel or max(1, gpus), pipeline_parallel or hosts)


def check_parallelism(block: str, tensor_parallel: int | None, pipeline_parallel: int | None,
                      hosts: int, gpus: int) -> None:
    """The rule vLLM and SGLang gangs share: ``tensor_parallel`` and ``pipeline_parallel`` only
    with ``hosts``; a gang runs on GPUs; tensor x pipeline = hosts x gpus (every host lends the
    same number of GPUs: SGLang places tp x pp / nnodes on each node, and vLLM's placement over
    Ray fills each node's GPUs). ``block``: the engine block's name, for the error path.
    Raises EngineOptionsError with a path relative to the model entry."""
    if hosts < 2:
        for key, value in (("tensor_parallel", tensor_parallel), ("pipeline_parallel", pipeline_parallel)):
            if value is not None:
                raise EngineOptionsError(f"{block}.{key}", (
                    "is for a model served by a gang (set hosts); on one host a backend is "
                    "tensor-parallel over its gpus_per_backend GPUs"))
        return
    if gpus < 1:
        raise EngineOptionsError("gpus", f"a {block} gang runs on GPUs: list this host's GPUs in gpus")
    tp, pp = parallel_sizes(tensor_parallel, pipeline_parallel, hosts, gpus)
    if tp * pp != hosts * gpus:
        key = "tensor_parallel" if tensor_parallel is not None else "pipeline_parallel"
        raise EngineOptionsError(f"{block}.{key}", (
            f"tensor_parallel x pipeline_parallel = {tp} x {pp} = {tp * pp} must equal the gang's GPUs, "
            f"hosts x gpus = {hosts} x {gpus} = {hosts * gpus} (every host lends the same number of GPUs)"))


def shared_options(options: BaseModel, per_host: frozenset[str]) -> dict[str, object]:
    """``options`` as JSON values (defaults filled in), without the ``per_host`` keys."""
    return {k: v for k, v in options.model_dump(mode="json").items() if k not in per_host}


def parallel_shared(options: BaseModel, per_host: frozenset[str], hosts: int, gpus: int) -> dict[str, object]:
    """:func:`shared_options` of an engine block with ``tensor_parallel`` and
    ``pipeline_parallel`` (vLLM, SGLang), those two replaced by the sizes in force
    (:func:`parallel_sizes`)."""
    shared = shared_options(options, per_host)
    shared["tensor_parallel"], shared["pipeline_parallel"] = parallel_sizes(
        getattr(options, "tensor_parallel", None), getattr(options, "pipeline_parallel", None), hosts, gpus)
    return shared
