"""The engine contract: value types, the ``Engine`` protocol and optional capabilities.

An engine adapter is a small stateless strategy object: a command line, a readiness rule,
a load reading and an options model (docs/engines.md, "The contract"). It never spawns,
retries, pins GPUs or routes; the supervisor does. Everything an adapter needs arrives as
arguments.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from typing import TYPE_CHECKING, ClassVar, NewType, Protocol, runtime_checkable

from pydantic import BaseModel

if TYPE_CHECKING:
    import aiohttp

ModelName = NewType("ModelName", str)


class Kind(StrEnum):
    """What a backend serves: llama-server's ``--embedding`` restricts a server to embeddings,
    its ``--reranking`` (vLLM's and SGLang's pooling runners alike) to scoring documents
    against a query (a cross-encoder, or a model with a classification head)."""

    CHAT = "chat"
    EMBEDDING = "embedding"
    RERANK = "rerank"


class Endpoint(StrEnum):
    """An inference endpoint of the client API, by the name the capacity summary carries
    (the ``endpoints`` extension, docs/mesh.md "Extensions"); ``path`` is its HTTP path, the
    same on the agent and on every engine that serves it (docs/routing.md, "Endpoints")."""

    CHAT = "chat"                  # /v1/chat/completions (OpenAI)
    COMPLETIONS = "completions"    # /v1/completions (OpenAI)
    EMBEDDINGS = "embeddings"      # /v1/embeddings (OpenAI)
    MESSAGES = "messages"          # /v1/messages (Anthropic)
    COUNT_TOKENS = "count_tokens"  # /v1/messages/count_tokens (Anthropic)
    RESPONSES = "responses"        # /v1/responses (OpenAI Responses)
    RERANK = "rerank"              # /v1/rerank (Jina/Cohere-style)
    SCORE = "score"                # /v1/score (the engine's own scoring API)
    TOKENIZE = "tokenize"          # /tokenize
    DETOKENIZE = "detokenize"      # /detokenize

    @property
    def path(self) -> str:
        return ENDPOINT_PATHS[self]


ENDPOINT_PATHS: Mapping[Endpoint, str] = {
    Endpoint.CHAT: "/v1/chat/completions",
    Endpoint.COMPLETIONS: "/v1/completions",
    Endpoint.EMBEDDINGS: "/v1/embeddings",
    Endpoint.MESSAGES: "/v1/messages",
    Endpoint.COUNT_TOKENS: "/v1/messages/count_tokens",
    Endpoint.RESPONSES: "/v1/responses",
    Endpoint.RERANK: "/v1/rerank",
    Endpoint.SCORE: "/v1/score",
    Endpoint.TOKENIZE: "/tokenize",
    Endpoint.DETOKENIZE: "/detokenize",
}
ENDPOINT_OF_PATH: Mapping[str, Endpoint] = {path: endpoint for endpoint, path in ENDPOINT_PATHS.items()}

GENERATING_ENDPOINTS: frozenset[Endpoint] = frozenset({Endpoint.CHAT, Endpoint.COMPLETIONS, Endpoint.MESSAGES,
                                                      Endpoint.RESPONSES})
"""The endpoints whose answers generate tokens (a key's token estimate counts a completion)."""

CLASSIC_ENDPOINTS: frozenset[Endpoint] = frozenset({Endpoint.CHAT, Endpoint.COMPLETIONS, Endpoint.EMBEDDINGS})
"""What a backend is taken to serve when nothing says more: a peer that publishes no
``endpoints`` extension (an agent from before it), or an adapter without ``endpoints``. The
model's kind still tells chat from embeddings (400 ``wrong_model_kind``)."""


class EngineError(Exception):
    """Base of the errors an engine adapter raises."""


class EngineUnavailable(EngineError):
    """Transport failure talking to a backend: refused, reset, timed out."""


class LoadUnknown(EngineError):
    """The backend answered, but its load cannot be read honestly (disabled endpoint,
    undecodable body, missing gauge). Never replaced by zeros: the mesh reads numbers as fact."""


class EngineOptionsError(EngineError):
    """An engine's option block is invalid; ``path`` names the field (``models[0].llamacpp.x``)."""

    def __init__(self, path: str, message: str) -> None:
        super().__init__(f"{path}: {message}")
        self.path = path
        self.message = message


class NoOptions(BaseModel):
    """Options model of an engine that takes none (unknown keys are still errors)."""

    model_config = {"extra": "forbid", "frozen": True}


@dataclass(frozen=True, slots=True)
class BackendSpec:
    """Everything an adapter needs to build one backend's command.

    Fields:
        model: the mesh-wide model name the backend must answer to.
        kind: chat, embedding or rerank.
        path: model path (file for GGUF, directory or hub id for vLLM/SGLang).
        gpus: this backend's GPUs as configured (NVML indexes or UUIDs); empty = CPU.
        port: loopback port assigned by the supervisor; 0 when ``socket_path`` is set.
        vendor: "nvidia", "amd", "cpu" or "unknown"; informational.
        ctx_per_slot: tokens of context per sequence, >= 1.
        parallel: sequences the backend admits at once, >= 1.
        backends_on_node: how many backends this model runs on this node, >= 1.
        host_cpus: CPUs available to the agent (sched_getaffinity), >= 1.
        args: operator flags, appended last.
        options: the engine's validated options model instance.
        api_key_file: a file holding the backend's API key (one line), readable only by
            the engine's user; the engine must refuse requests without
            ``Authorization: Bearer <key>`` (docs/engines.md, "The backend's key"). None: no
            key (a spec built only to show a command).
        socket_path: the Unix socket the backend listens on instead of a port, in the
            backend's private directory; only for an engine that declares
            ``unix_socket = True`` (``binds_unix_socket``). Absolute, under
            ``MAX_SOCKET_PATH_BYTES`` bytes (the kernel's sun_path limit).
    """

    model: str
    kind: Kind
    path: str
    port: int
    ctx_per_slot: int
    parallel: int
    options: BaseModel
    gpus: tuple[str, ...] = ()
    vendor: str = "cpu"
    backends_on_node: int = 1
    host_cpus: int = 1
    args: tuple[str, ...] = ()
    api_key_file: str | None = None
    socket_path: str | None = None

    def __post_init__(self) -> None:
        for name in ("ctx_per_slot", "parallel", "backends_on_node", "host_cpus"):
            if getattr(self, name) < 1:
                raise ValueError(f"BackendSpec.{name} must be >= 1, got {getattr(self, name)}")
        if self.socket_path is not None:
            problem = socket_path_problem(self.socket_path)
            if problem:
                raise ValueError(f"BackendSpec.socket_path: {problem}")
            if self.port != 0:
                raise ValueError(f"BackendSpec.port must be 0 with a socket_path, got {self.port}")
        elif not 0 < self.port < 65536:
            raise ValueError(f"BackendSpec.port must be 1..65535, got {self.port}")

    @property
    def address(self) -> str:
        """Where the backend listens, for messages: ``unix:<path>`` or ``127.0.0.1:<port>``."""
        return f"unix:{self.socket_path}" if self.socket_path else f"127.0.0.1:{self.port}"


#: sun_path holds 108 bytes with its terminating NUL: a socket path must be shorter.
MAX_SOCKET_PATH_BYTES = 107


def socket_path_problem(path: str) -> str:
    """Why ``path`` cannot be a backend's Unix socket ("" when it can)."""
    raw = path.encode("utf-8", "surrogateescape")
    if not path.startswith("/"):
        return f"{path!r} is not absolute"
    if b"\0" in raw:
        return f"{path!r} contains a NUL byte"
    if len(raw) > MAX_SOCKET_PATH_BYTES:
        return (f"{path!r} is {len(raw)} bytes, over the {MAX_SOCKET_PATH_BYTES}-byte limit of a Unix "
                "socket path (use a shorter node.state_dir or runtime directory)")
    return ""


def binds_unix_socket(engine: object) -> bool:
    """Whether the adapter binds ``BackendSpec.socket_path`` (class attribute
    ``unix_socket: bool``, absent: False); the supervisor then gives it a socket, not a port."""
    return getattr(engine, "unix_socket", False) is True


def takes_model_directory(engine: object) -> bool:
    """Whether the adapter's engine takes a directory as a local ``BackendSpec.path`` (a
    Hugging Face model folder; class attribute ``model_directory: bool``, absent: False).
    Either way a local path is otherwise a regular file (a GGUF, or a symlink to one), never
    a FIFO or a device; a hub id is not a local path."""
    return getattr(engine, "model_directory", False) is True


def takes_api_key(engine: object) -> bool:
    """Whether the adapter hands ``BackendSpec.api_key_file`` to its engine (class attribute
    ``api_key: bool``, absent: False). Without it the engine answers any local user
    (docs/security.md, "Local users")."""
    return getattr(engine, "api_key", False) is True


@dataclass(frozen=True, slots=True)
class LaunchCommand:
    """argv to execute and environment added on top of what the supervisor sets.

    key_env: for an engine that reads its key from an environment variable (vLLM's
    ``VLLM_API_KEY``), that variable's name; never the key in ``env``, which ``ps``-like
    tools and ``systemctl show`` reveal. The supervisor writes ``<name>=<key>`` to the
    backend's environment file (agent/supervision/engine_keys.py) and the runner sets it from there.
    """

    argv: tuple[str, ...]
    env: Mapping[str, str] = field(default_factory=dict)
    key_env: str | None = None


@dataclass(frozen=True, slots=True)
class Probe:
    """One readiness probe.

    ready: the backend serves requests now. phase: "" if none (e.g. "loading model").
    progress: 0..1, or -1.0 when unknown (never 0 for unknown). reason: human text.
    """

    ready: bool
    phase: str = ""
    progress: float = -1.0
    reason: str = ""


@dataclass(frozen=True, slots=True)
class TokenCounters:
    """The engine's cumulative token counters since it started (never reset while it runs):
    prompt tokens it processed (cached ones left out) and the seconds it spent on them,
    generated tokens and the seconds it spent generating. Floats >= 0; the agent turns the
    difference of two readings into speeds (agent/supervision/speeds.py)."""

    prompt_tokens: float
    prompt_seconds: float
    decode_tokens: float
    decode_seconds: float


@dataclass(frozen=True, slots=True)
class Load:
    """Occupancy of one backend.

    slots: sequences it will actually admit. busy: sequences running now.
    waiting: requests queued inside the engine, or None when the engine publishes no queue
    (unknown is never 0). ctx_per_slot: context per sequence it will actually serve.
    tokens: the engine's token counters, or None when it publishes none (speed unknown).
    """

    slots: int
    busy: int
    waiting: int | None
    ctx_per_slot: int
    tokens: TokenCounters | None = None


@runtime_checkable
class Engine(Protocol):
    """The contract every engine adapter implements (docs/engines.md, "Methods and attributes")."""

    name: ClassVar[str]
    display_name: ClassVar[str]
    options_model: ClassVar[type[BaseModel]]
    default_startup_timeout_s: ClassVar[float]
    command_version: ClassVar[int]

    def build_command(self, spec: BackendSpec) -> LaunchCommand:
        """The backend's argv and extra environment; pure."""
        ...

    async def probe(self, http: aiohttp.ClientSession, base_url: str) -> Probe:
        """Readiness; raises EngineUnavailable only on a transport failure."""
        ...

    async def read_load(self, http: aiohttp.ClientSession, spec: BackendSpec, base_url: str) -> Load:
        """Occupancy; raises EngineUnavailable or LoadUnknown rather than guessing."""
        ...

    def client_fault(self, status: int, body: bytes) -> str | None:
        """Whether the engine's error answer (HTTP ``status``, raw ``body``) is the client's fault.

        Returns None when it is not (or cannot be told), else an OpenAI-style code from
        ``CLIENT_FAULT_CODES``: "context_length_exceeded" (the prompt does not fit),
        "unsupported_content" (a content part the model cannot read, e.g. an image sent to a
        text-only model), "invalid_request" (any other request the engine refuses as
        malformed). The agent answers 400 with that code instead of 502 when an engine
        answers 5xx for it (docs/routing.md, errors). Optional: this default says None;
        an adapter overrides it only with rules read from its engine's real error bodies
        (docs/engines.md). Pure, fast, never raises: any body (not JSON, deeply nested,
        huge, not UTF-8) that is not recognised is None.
        """
        return None


CLIENT_FAULT_CODES: frozenset[str] = frozenset({"context_length_exceeded", "unsupported_content", "invalid_request"})
"""The codes ``Engine.client_fault`` may return (OpenAI's error ``code`` strings)."""


def classify_client_fault(engine: object, status: int, body: bytes) -> str | None:
    """``engine.client_fault(status, body)``, made safe for the request path.

    None when the adapter has no ``client_fault`` (it is optional), when it raises, or when
    it returns anything but a code from ``CLIENT_FAULT_CODES``: a broken classifier must
    never turn an engine error into the agent's own 500.
    """
    method = getattr(engine, "client_fault", None)
    if method is None:
        return None
    try:
        code = method(status, body)
    except Exception:  # noqa: BLE001 - an adapter bug is "cannot tell", not a crash
        return None
    return code if isinstance(code, str) and code in CLIENT_FAULT_CODES else None


def stops_nonstream_on_disconnect(engine: object) -> bool:
    """Whether closing the connection of a non-streamed request stops its generation.

    Read from the adapter's optional class attribute ``nonstream_stops_on_disconnect: bool``
    (absent, or ``engine`` None: True). An adapter sets it False only from a measurement of
    its engine (docs/engines.md, "When the client goes away"); the agent then asks that
    engine for a stream and assembles the non-streamed answer itself (agent/serving/assemble.py),
    so a client that leaves frees its slot. Anything but a bool counts as True.
    """
    value = getattr(engine, "nonstream_stops_on_disconnect", True)
    return value if isinstance(value, bool) else True


# Optional capabilities: implemented only where the engine can answer honestly.


@runtime_checkable
class ServesEndpoints(Protocol):
    """The endpoints a backend of ``kind`` started with the operator's ``args`` serves (read
    from the engine's own routes: docs/engines.md, "Endpoints")."""

    def endpoints(self, kind: Kind, args: tuple[str, ...]) -> frozenset[Endpoint]: ...


def served_endpoints(engine: object, kind: Kind, args: tuple[str, ...] = ()) -> frozenset[Endpoint]:
    """What a backend of ``engine`` serves: its adapter's ``endpoints(kind, args)`` when it has
    one, else :data:`CLASSIC_ENDPOINTS`. An adapter that raises or answers anything but a set
    of :class:`Endpoint` counts as having none (a broken declaration never takes a model off
    the classic endpoints)."""
    method = getattr(engine, "endpoints", None)
    if method is None:
        return CLASSIC_ENDPOINTS
    try:
        declared = method(kind, args)
    except Exception:  # noqa: BLE001 - an adapter bug is "cannot tell", not a crash
        return CLASSIC_ENDPOINTS
    if not isinstance(declared, (set, frozenset)) or not all(isinstance(e, Endpoint) for e in declared):
        return CLASSIC_ENDPOINTS
    return frozenset(declared)


@runtime_checkable
class RunsOnCPU(Protocol):
    """The engine can serve a model with no GPU (spec.gpus empty)."""

    def supports_cpu(self) -> bool: ...


@runtime_checkable
class WarmUp(Protocol):
    """Ready-but-not-yet-safe period after the first successful probe, in seconds."""

    def warmup_s(self, spec: BackendSpec) -> float: ...


@runtime_checkable
class UsageReporting(Protocol):
    """The engine reports token usage in streams (and cached tokens where it can)."""

    def stream_usage_supported(self) -> bool: ...


@runtime_checkable
class BoundGPU(Protocol):
    """The engine selects devices by its own flags/variables (the environment is not enough)."""

    def device_env(self, spec: BackendSpec) -> Mapping[str, str]: ...


@runtime_checkable
class Version(Protocol):
    """Installed version of the engine binary, compared with the adapter's minimum."""

    minimum_version: ClassVar[str]

    def version_command(self, options: BaseModel) -> tuple[str, ...]: ...

    def parse_version(self, output: str) -> str | None: ...


@runtime_checkable
class ReasoningSeparation(Protocol):
    """The engine separates reasoning content from the answer."""

    def reasoning_args(self, spec: BackendSpec) -> tuple[str, ...]: ...
