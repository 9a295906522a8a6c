"""llama.cpp's llama-server as an engine (the reference adapter).

Readiness (captured from llama-server builds, tests/engines/llamacpp/captures/): ``/health``
refuses connections before the port is bound, answers 503
``{"error":{"message":"Loading model",...}}`` while loading and 200 ``{"status":"ok"}`` once
ready, also while busy. Load: ``/slots`` lists one entry per slot with ``n_ctx`` (the context
per slot) and ``is_processing``; ``/metrics`` (with ``--metrics``) has
``llamacpp:requests_deferred``, the requests waiting for a slot, and the token counters
(``llamacpp:prompt_tokens_total``, ``prompt_seconds_total``, ``tokens_predicted_total``,
``tokens_predicted_seconds_total``) that give its speeds. The gauges
``llamacpp:prompt_tokens_seconds`` / ``predicted_tokens_seconds`` are not used: llama-server
computes them over the tokens since the previous /metrics read (0 after an idle read), so
they depend on who else scrapes.

Pooling (docs/engines.md, "llama.cpp: pooling"): an embedding backend gets ``--pooling mean``
when its GGUF declares no ``<arch>.pooling_type`` (llama-server then pools with "none" and
refuses every OpenAI ``/v1/embeddings`` call with 400), unless the operator's args name
``--pooling``. Client faults (docs/engines.md, "llama.cpp: error bodies"): ``client_fault``
reads llama-server's error bodies (``errors.py``).
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, ClassVar

from viiwork.engines.contract import (
    BackendSpec,
    Endpoint,
    EngineOptionsError,
    Kind,
    LaunchCommand,
    Load,
    LoadUnknown,
    Probe,
    TokenCounters,
)
from viiwork.engines.gang import GangAddresses, LaunchShape, PartRole, PortRange, shared_options
from viiwork.engines.http import fetch
from viiwork.engines.llamacpp.errors import client_fault
from viiwork.engines.llamacpp.gguf_metadata import read_pooling
from viiwork.engines.llamacpp.options import LlamaCppOptions
from viiwork.engines.prometheus import parse_gauges, token_counters

if TYPE_CHECKING:
    from collections.abc import Mapping

    import aiohttp
    from pydantic import BaseModel

__all__ = ["LlamaCppEngine", "LlamaCppOptions"]


class LlamaCppEngine:
    """Adapter for llama.cpp's ``llama-server``."""

    name: ClassVar[str] = "llamacpp"
    display_name: ClassVar[str] = "llama.cpp (llama-server)"
    options_model: ClassVar[type[LlamaCppOptions]] = LlamaCppOptions
    default_startup_timeout_s: ClassVar[float] = 600.0
    # 2: --pooling mean for an embedding GGUF that declares no pooling type.
    command_version: ClassVar[int] = 3
    # 3: --api-key-file (the agent's per-backend key), CORS limited to localhost, and a Unix
    # socket (--host <path>.sock) instead of a loopback port.
    # Binds BackendSpec.socket_path (llama-server: a --host ending in ".sock").
    unix_socket: ClassVar[bool] = True
    # Takes BackendSpec.api_key_file (--api-key-file).
    api_key: ClassVar[bool] = True
    # A non-streamed generation is not reliably stopped by a closed connection (measured:
    # tests/bench/bench_disconnect.py, docs/engines.md "When the client goes away").
    nonstream_stops_on_disconnect: ClassVar[bool] = False
    # A gang: rpc-server workers, then the head's llama-server --rpc (docs/engines.md, "Gangs").
    launch_shape: ClassVar[LaunchShape] = LaunchShape.WORKERS_THEN_HEAD
    per_host_options: ClassVar[frozenset[str]] = frozenset(
        {"binary", "rpc_binary", "threads", "device_selection", "metrics"})
    # rpc-server gets the tensors from the head: a worker host needs no model file.
    workers_load_model: ClassVar[bool] = False
    # rpc-server binds gang_port on loopback only.
    gang_port_span: ClassVar[int] = 1

    def build_command(self, spec: BackendSpec) -> LaunchCommand:
        """llama-server's argv for ``spec``.

        ``--ctx-size`` is the total over slots (ctx_per_slot * parallel); ``--threads`` a fair
        share of host_cpus over the model's backends unless set; all layers on the GPU when
        the backend has GPUs, and ``--n-gpu-layers 0 --device none`` (no device at all) when
        it has none, so a GPU build never grabs a GPU the model was not given. An embedding
        backend whose GGUF declares no pooling type gets ``--pooling mean`` (``pooling_args``).
        The options' ``split_mode`` and ``tensor_split`` follow the layers, when set.
        """
        return LaunchCommand(argv=self._server_argv(spec, rpc=()), env=self.device_env(spec))

    def _server_argv(self, spec: BackendSpec, rpc: tuple[str, ...]) -> tuple[str, ...]:
        """llama-server's argv; ``rpc``: a gang head's RPC servers (``--rpc``), () for one host."""
        opts = _options(spec)
        threads = opts.threads or max(1, spec.host_cpus // spec.backends_on_node)
        argv: list[str] = [
            opts.binary,
            "--model", spec.path,
            "--alias", spec.model,
            *bind_args(spec),
            "--ctx-size", str(spec.ctx_per_slot * spec.parallel),
            "--parallel", str(spec.parallel),
            "--threads", str(threads),
        ]
        if rpc:
            # A gang head offloads to its RPC servers (and its own GPUs, if any): never
            # --device none, which would turn the RPC devices off too.
            argv += ["--rpc", ",".join(rpc), "--n-gpu-layers", str(opts.gpu_layers)]
        elif spec.gpus:
            argv += ["--n-gpu-layers", str(opts.gpu_layers)]
        else:
            argv += ["--n-gpu-layers", "0", "--device", "none"]
        if opts.split_mode is not None:
            argv += ["--split-mode", opts.split_mode]
        if opts.tensor_split is not None:
            argv += ["--tensor-split", ",".join(f"{x:g}" for x in opts.tensor_split)]
        if spec.kind is Kind.EMBEDDING:
            argv.append("--embedding")
            argv += pooling_args(spec)
        elif spec.kind is Kind.RERANK and not _reranking(spec.args):
            argv.append("--reranking")  # it also sets pooling "rank" (the GGUF's classification head)
        if opts.metrics:
            argv.append("--metrics")
        argv += key_args(spec)
        argv += list(spec.args)
        return tuple(argv)

    # --- gangs (engines/gang.py): workers then head, over llama.cpp's RPC ------------------

    def check_gang(self, options: BaseModel, hosts: int, gpus: int) -> None:
        """Nothing to refuse: any host count and any GPUs (a CPU worker serves its CPU). How
        layers split is ``split_mode``/``tensor_split``, valid on one host too."""

    def gang_shared(self, options: BaseModel, hosts: int, gpus: int) -> dict[str, object]:
        """The block but ``per_host_options`` (binaries, threads, device selection, metrics)."""
        return shared_options(options, self.per_host_options)

    def gang_command(self, spec: BackendSpec, role: PartRole, gang: GangAddresses) -> LaunchCommand:
        """A worker (rank >= 1, WORKER): ``<rpc_binary> -H 127.0.0.1 -p <gang port>`` (loopback
        only: the agents carry its stream between hosts; rpc-server has no authentication), with
        ``-t <threads>`` when the host lends no GPU (the threads of its CPU device). The head
        (rank 0, SERVER): llama-server's command with ``--rpc <worker_endpoints>`` and all
        layers offloaded (``--n-gpu-layers <gpu_layers>``, never ``--device none``). A host
        without GPUs on a Vulkan build (``device_selection = "vulkan"``) gets
        ``GGML_VK_VISIBLE_DEVICES=""``: no local Vulkan device (the other builds see none
        through the agent's pinning). The operator's args are llama-server's: the head's only.
        Raises EngineOptionsError for another role, or a head without worker endpoints."""
        opts = _options(spec)
        env = dict(self.device_env(spec))
        if not spec.gpus and opts.device_selection == "vulkan":
            env["GGML_VK_VISIBLE_DEVICES"] = ""
        if gang.rank == 0 and role is PartRole.SERVER:
            if len(gang.worker_endpoints) != gang.size - 1:
                raise EngineOptionsError("hosts", "a llama.cpp gang head needs the endpoints of its "
                                                  f"{gang.size - 1} rpc-server workers")
            return LaunchCommand(argv=self._server_argv(spec, rpc=gang.worker_endpoints), env=env)
        if gang.rank > 0 and role is PartRole.WORKER:
            argv = [opts.rpc_binary, "-H", "127.0.0.1", "-p", str(gang.port)]
            if not spec.gpus:
                argv += ["-t", str(opts.threads or max(1, spec.host_cpus // spec.backends_on_node))]
            return LaunchCommand(argv=tuple(argv), env=env)
        raise EngineOptionsError("hosts", f"a llama.cpp gang has no {role.value} part at rank {gang.rank} "
                                          "(rank 0 serves, the others run rpc-server)")

    def gang_listen(self, role: PartRole, gang: GangAddresses) -> str | None:
        """A worker's rpc-server listens on 127.0.0.1:<gang port>; the head's server on nothing
        the plan waits for (its probe is its readiness)."""
        return f"127.0.0.1:{gang.port}" if role is PartRole.WORKER else None

    def gang_ports(self, role: PartRole, gang: GangAddresses) -> tuple[PortRange, ...]:
        """None on the gang's address: rpc-server listens on loopback and the agents carry
        its stream over mutual TLS (agent/gang/tunnel.py)."""
        return ()

    def device_env(self, spec: BackendSpec) -> Mapping[str, str]:
        """Vulkan builds ignore CUDA_VISIBLE_DEVICES: they read GGML_VK_VISIBLE_DEVICES."""
        opts = _options(spec)
        if opts.device_selection == "vulkan" and spec.gpus:
            return {"GGML_VK_VISIBLE_DEVICES": ",".join(spec.gpus)}
        return {}

    def supports_cpu(self) -> bool:
        return True

    def endpoints(self, kind: Kind, args: tuple[str, ...]) -> frozenset[Endpoint]:
        """llama-server's routes (tools/server/server.cpp; checked against the demo package's
        build, tests/real/test_endpoints_real.py). A chat server: chat, completions, Anthropic's
        messages and count_tokens, Responses; ``--embedding`` restricts it to embeddings (chat
        answers 501); ``--reranking`` (kind rerank, or the operator's args) adds rerank, which
        any other server answers 501. Tokenize and detokenize work on every server."""
        served = {Endpoint.TOKENIZE, Endpoint.DETOKENIZE}
        if kind is Kind.CHAT:
            served |= {Endpoint.CHAT, Endpoint.COMPLETIONS, Endpoint.MESSAGES, Endpoint.COUNT_TOKENS,
                       Endpoint.RESPONSES}
        elif kind is Kind.EMBEDDING:
            served.add(Endpoint.EMBEDDINGS)
        if kind is Kind.RERANK or _reranking(args):
            served.add(Endpoint.RERANK)
        return frozenset(served)

    def client_fault(self, status: int, body: bytes) -> str | None:
        """llama-server's error bodies that are the client's fault, as an OpenAI code
        ("context_length_exceeded", "unsupported_content"); None otherwise (``errors.py``)."""
        return client_fault(status, body)

    async def probe(self, http: aiohttp.ClientSession, base_url: str) -> Probe:
        """GET /health: 200 = ready; 503 = loading (phase from the message); other = not ready.

        Raises EngineUnavailable on refused/reset/timeout.
        """
        answer = await fetch(http, base_url, "/health")
        if answer.status == 200:
            return Probe(ready=True)
        message = _error_message(answer.body)
        if answer.status == 503:
            return Probe(ready=False, phase=(message or "loading").lower(), reason=message)
        return Probe(ready=False, reason=f"/health answered {answer.status}: {message or answer.body[:200]!r}")

    async def read_load(self, http: aiohttp.ClientSession, spec: BackendSpec, base_url: str) -> Load:
        """Read occupancy from /slots, and waiting requests and token counters from /metrics.

        Returns Load(slots=len(entries), busy=entries with is_processing,
        waiting=llamacpp:requests_deferred or None when /metrics is off or lacks the gauge,
        ctx_per_slot=n_ctx of the first entry, tokens=the token counters or None when
        /metrics is off or lacks one). Raises EngineUnavailable on a transport failure and
        LoadUnknown when /slots is disabled (501) or undecodable.
        """
        answer = await fetch(http, base_url, "/slots")
        if answer.status != 200:
            raise LoadUnknown(f"/slots answered {answer.status}: {_error_message(answer.body) or answer.body[:200]!r}")
        try:
            entries = json.loads(answer.body)
            if not isinstance(entries, list) or not entries:
                raise ValueError("not a non-empty list")
            busy = sum(1 for e in entries if e["is_processing"] is True)
            ctx = int(entries[0]["n_ctx"])
            if ctx < 1:
                raise ValueError(f"n_ctx {ctx} < 1")
        except (ValueError, KeyError, TypeError) as exc:
            raise LoadUnknown(f"/slots undecodable: {exc}") from exc
        waiting, tokens = None, None
        opts = _options(spec)
        if opts.metrics:
            waiting, tokens = await self._read_metrics(http, base_url)
        return Load(slots=len(entries), busy=busy, waiting=waiting, ctx_per_slot=ctx, tokens=tokens)

    async def _read_metrics(self, http: aiohttp.ClientSession, base_url: str) -> tuple[int | None, TokenCounters | None]:
        answer = await fetch(http, base_url, "/metrics")
        if answer.status != 200:
            return None, None
        gauges = parse_gauges(answer.text())
        value = gauges.get("llamacpp:requests_deferred")
        return None if value is None else int(value), token_counters(gauges, *TOKEN_COUNTERS)


#: llama-server's cumulative counters: prompt tokens, prompt seconds, generated tokens, generation seconds.
TOKEN_COUNTERS = ("llamacpp:prompt_tokens_total", "llamacpp:prompt_seconds_total", "llamacpp:tokens_predicted_total",
                  "llamacpp:tokens_predicted_seconds_total")


def _options(spec: BackendSpec) -> LlamaCppOptions:
    return spec.options if isinstance(spec.options, LlamaCppOptions) else LlamaCppOptions()


def bind_args(spec: BackendSpec) -> tuple[str, ...]:
    """``--host <socket>`` (llama-server binds a Unix socket when --host ends in ".sock")
    for a spec with a socket path, else ``--host 127.0.0.1 --port <port>``."""
    if spec.socket_path:
        return ("--host", spec.socket_path)
    return ("--host", "127.0.0.1", "--port", str(spec.port))


def key_args(spec: BackendSpec) -> tuple[str, ...]:
    """``--api-key-file`` for the agent's per-backend key (docs/security.md, "Local users"),
    and CORS cut down from llama-server's default ``*`` (any web page may read answers) to
    ``--cors-origins localhost --no-cors-credentials``: llama-server has no flag that turns
    CORS off, and the key is needed on every request anyway."""
    args: tuple[str, ...] = ("--cors-origins", "localhost", "--no-cors-credentials")
    if spec.api_key_file:
        args += ("--api-key-file", spec.api_key_file)
    return args


def _reranking(args: tuple[str, ...]) -> bool:
    """The operator's args turn llama-server's reranking on (``--reranking``, ``--rerank``)."""
    return any(arg in ("--reranking", "--rerank") for arg in args)


def pooling_args(spec: BackendSpec) -> tuple[str, ...]:
    """``("--pooling", "mean")`` for an embedding spec whose GGUF declares no pooling type.

    Empty for a chat spec, when the operator's args already name ``--pooling`` (they win),
    when the file declares a pooling type (llama-server uses it), and when the file cannot
    be read (llama-server will say why it cannot load it; the adapter does not guess).
    Reads the file's key/value header only (``gguf_metadata.read_pooling``, milliseconds).
    """
    if spec.kind is not Kind.EMBEDDING:
        return ()
    if any(arg == "--pooling" or arg.startswith("--pooling=") for arg in spec.args):
        return ()
    try:
        declared = read_pooling(spec.path)
    except (OSError, ValueError):  # GGUFMetadataError, or a path os.stat refuses (NUL byte)
        return ()
    if declared.pooling_type is not None:
        return ()
    return ("--pooling", "mean")


def _error_message(body: bytes) -> str:
    try:
        data = json.loads(body)
        return str(data["error"]["message"])
    except (ValueError, KeyError, TypeError):
        return ""
