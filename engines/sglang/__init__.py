"""SGLang's server (``python -m sglang.launch_server``) as an engine.

SGLang does not run on the machines this project is developed on, so this adapter is
written from SGLang's source, release 0.5.23 (the wheel's ``srt/entrypoints/http_server.py``,
``srt/observability/metrics_collector.py`` and ``srt/arg_groups/fields/``), checked against
the 0.5.3 source for what older releases do. The fixtures in tests/engines/sglang/captures/
are reconstructed from that source, not captured, and say so in their names.

- Readiness: ``launch_server`` starts the scheduler processes and blocks until they have
  loaded the model; only then does uvicorn bind the port (connection refused before). Until
  the server's own warm-up request has completed, ``/health`` and ``/health_generate``
  answer 503 (``ServerStatus.Starting``); afterwards ``/health_generate`` sends a one-token
  generation through the scheduler and answers 200 as soon as the scheduler produces
  anything (at the earliest after one second), 503 when it has answered nothing for
  ``SGLANG_HEALTH_CHECK_TIMEOUT`` (20 s) or the server is shutting down. ``/health_generate``
  is used rather than ``/health`` because older releases (0.4.x) answered ``/health`` with a
  bare 200 during warm-up.
- Load: with ``--enable-metrics`` (always passed), ``/metrics`` has the scheduler gauges
  ``sglang:num_running_reqs`` and ``sglang:num_queue_reqs`` (the names of SGLang's first
  metrics collector, unchanged since), ``sglang:num_grammar_queue_reqs`` (requests waiting
  for a grammar to compile, also waiting) and, where published, ``sglang:context_len``. The
  gauges are set when the scheduler logs its statistics (each prefill batch, every
  ``decode_log_interval`` decode steps, and at least every 30 s when idle), so they can
  trail the truth by that much. How label sets are combined:
  :mod:`viiwork.engines.sglang.metrics`.
"""

from __future__ import annotations

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
from viiwork.engines.prometheus import request_count
from viiwork.engines.sglang.metrics import parse_samples, scheduler_constant, scheduler_total
from viiwork.engines.sglang.options import SglangOptions

if TYPE_CHECKING:
    import aiohttp
    from pydantic import BaseModel

__all__ = ["SglangEngine", "SglangOptions"]

RUNNING_GAUGE = "sglang:num_running_reqs"
QUEUE_GAUGE = "sglang:num_queue_reqs"
GRAMMAR_QUEUE_GAUGE = "sglang:num_grammar_queue_reqs"
CONTEXT_GAUGE = "sglang:context_len"


class SglangEngine:
    """Adapter for SGLang's HTTP server."""

    name: ClassVar[str] = "sglang"
    display_name: ClassVar[str] = "SGLang"
    options_model: ClassVar[type[SglangOptions]] = SglangOptions
    # One GPU, a mid-sized model, JIT kernel caches cold: 20 minutes. Tensor-parallel
    # backends of large models need models[].startup_timeout_s (docs/engines.md).
    default_startup_timeout_s: ClassVar[float] = 1200.0
    command_version: ClassVar[int] = 1
    # A non-streamed request's disconnect is checked only when its 4 s wait for output
    # times out (docs/engines.md, "When the client goes away").
    nonstream_stops_on_disconnect: ClassVar[bool] = False
    # --model-path takes a Hugging Face folder (or a hub id).
    model_directory: ClassVar[bool] = True
    # A gang: every host runs the server with its rank (docs/engines.md, "Gangs").
    launch_shape: ClassVar[LaunchShape] = LaunchShape.RANKS
    per_host_options: ClassVar[frozenset[str]] = frozenset({"python"})
    # Every rank loads its shard of the checkpoint.
    workers_load_model: ClassVar[bool] = True
    # --dist-init-addr's port (torch's TCPStore on rank 0) and the ports SGLang derives from
    # it with DP attention (PortArgs.init_new: dist-init port + 1 and up, one more per DP rank).
    gang_port_span: ClassVar[int] = 16

    def build_command(self, spec: BackendSpec) -> LaunchCommand:
        """SGLang's argv for ``spec``.

        ``--context-length`` is ctx_per_slot (SGLang's limit is per request) and
        ``--max-running-requests`` is parallel; ``--enable-metrics`` always, since the load
        comes from /metrics. A GPU backend gets ``--tp-size len(gpus)`` and the options'
        ``--mem-fraction-static``; SGLang numbers GPUs from 0 inside what the supervisor made
        visible (CUDA_VISIBLE_DEVICES / HIP_VISIBLE_DEVICES), so no device flag is needed. A
        CPU backend gets ``--device cpu``, ``SGLANG_USE_CPU_ENGINE=1`` (SGLang's CPU backend) and
        ``CUDA_VISIBLE_DEVICES=""``.
        An embedding backend gets ``--is-embedding``. Operator args go last.
        """
        return self._server_command(spec, gang=None)

    def _server_command(self, spec: BackendSpec, gang: GangAddresses | None) -> LaunchCommand:
        """SGLang's server command; ``gang``: this rank's place in a gang, None on one host."""
        opts = _options(spec)
        argv: list[str] = [
            opts.python, "-m", "sglang.launch_server",
            "--model-path", spec.path,
            "--served-model-name", spec.model,
            "--host", "127.0.0.1",
            "--port", str(spec.port),
            "--max-running-requests", str(spec.parallel),
            "--context-length", str(spec.ctx_per_slot),
            "--enable-metrics",
        ]
        env: dict[str, str] = {}
        if gang is not None:
            tp, pp = parallel_sizes(opts.tensor_parallel, opts.pipeline_parallel, gang.size, len(spec.gpus))
            argv += ["--tp-size", str(tp)]
            if pp > 1:  # --pp-size is newer than multi-node tensor parallelism: only when needed
                argv += ["--pp-size", str(pp)]
            argv += ["--nnodes", str(gang.size), "--node-rank", str(gang.rank), "--dist-init-addr", gang.head_endpoint]
            if opts.mem_fraction_static is not None:
                argv += ["--mem-fraction-static", f"{opts.mem_fraction_static:g}"]
        elif spec.gpus:
            argv += ["--tp-size", str(len(spec.gpus))]
            if opts.mem_fraction_static is not None:
                argv += ["--mem-fraction-static", f"{opts.mem_fraction_static:g}"]
        else:
            # 0.5.23 takes its CPU code paths only with SGLANG_USE_CPU_ENGINE=1 (srt/platforms,
            # srt/utils/common.py is_cpu()); --device cpu alone is not enough.
            argv += ["--device", "cpu"]
            env["SGLANG_USE_CPU_ENGINE"] = "1"
            env["CUDA_VISIBLE_DEVICES"] = ""
        if spec.kind in (Kind.EMBEDDING, Kind.RERANK):  # a cross-encoder reranks as an "embedding" model
            argv.append("--is-embedding")
        argv += list(spec.args)
        return LaunchCommand(argv=tuple(argv), env=env)

    # --- gangs (engines/gang.py): every host runs the server with its rank -----------------

    def check_gang(self, options: BaseModel, hosts: int, gpus: int) -> None:
        """``tensor_parallel``/``pipeline_parallel`` only with hosts; a gang on GPUs; tp x pp =
        hosts x gpus (``check_parallelism``: SGLang puts tp x pp / nnodes GPUs on each node)."""
        opts = options if isinstance(options, SglangOptions) else SglangOptions()
        check_parallelism(self.name, opts.tensor_parallel, opts.pipeline_parallel, hosts, gpus)

    def gang_shared(self, options: BaseModel, hosts: int, gpus: int) -> dict[str, object]:
        """The block but ``per_host_options``, with the parallel sizes in force."""
        opts = options if isinstance(options, SglangOptions) else SglangOptions()
        return parallel_shared(opts, self.per_host_options, hosts, gpus)

    def gang_command(self, spec: BackendSpec, role: PartRole, gang: GangAddresses) -> LaunchCommand:
        """Every rank (SERVER at 0, RANK elsewhere) runs the one-host command with ``--tp-size
        T [--pp-size P] --nnodes N --node-rank <rank> --dist-init-addr <head>:<gang port>``
        (``parallel_sizes``; ``--pp-size`` only when P > 1). Rank 0 serves HTTP on the spec's
        port; the other ranks run the schedulers of their GPUs (given the same --host/--port
        shape, on their own host's spec port). Raises EngineOptionsError for another role at that rank."""
        if (gang.rank == 0) != (role is PartRole.SERVER) or role not in (PartRole.SERVER, PartRole.RANK):
            raise EngineOptionsError("hosts", f"an SGLang gang has no {role.value} part at rank {gang.rank} "
                                              "(rank 0 serves, the others are ranks)")
        return self._server_command(spec, gang=gang)

    def gang_listen(self, role: PartRole, gang: GangAddresses) -> str | None:
        """None: ranks start together and meet at the head's --dist-init-addr themselves."""
        return None

    def gang_ports(self, role: PartRole, gang: GangAddresses) -> tuple[PortRange, ...]:
        """Every rank: ``gang port .. gang port + 15`` (``gang_port_span``): rank 0 binds the
        rendezvous (torch's TCPStore at --dist-init-addr), and with DP attention SGLang binds
        its ZMQ sockets at the ports after it. torch's NCCL and Gloo sockets take ephemeral
        ports, which no flag pins (docs/security.md)."""
        return port_block(gang.port, self.gang_port_span)

    def endpoints(self, kind: Kind, args: tuple[str, ...]) -> frozenset[Endpoint]:
        """SGLang's routes (python/sglang/srt/entrypoints/http_server.py): a generating model
        serves chat, completions, Responses and its own decoder-only scoring API (/v1/score);
        an embedding model embeddings; a cross-encoder (kind rerank) rerank. Tokenize and
        detokenize on every model. No Anthropic messages. No capture of these yet:
        tests/engines/sglang checks this declaration only."""
        served = {Endpoint.TOKENIZE, Endpoint.DETOKENIZE}
        if kind is Kind.CHAT:
            served |= {Endpoint.CHAT, Endpoint.COMPLETIONS, Endpoint.RESPONSES, Endpoint.SCORE}
        elif kind is Kind.EMBEDDING:
            served.add(Endpoint.EMBEDDINGS)
        else:
            served.add(Endpoint.RERANK)
        return frozenset(served)

    def supports_cpu(self) -> bool:
        """SGLang has a CPU backend on x86-64 and arm64 hosts (``--device cpu`` with
        ``SGLANG_USE_CPU_ENGINE=1``), which needs SGLang's CPU kernel build installed."""
        return True

    def client_fault(self, status: int, body: bytes) -> str | None:
        """None for every answer: no SGLang error body has been captured yet
        (docs/engines.md, "SGLang: error bodies"); a rule is added only from a real one."""
        return None

    def stream_usage_supported(self) -> bool:
        """SGLang's OpenAI chat and completion streams end with a usage chunk when the
        request sets ``stream_options.include_usage`` (0.5.23 ``serving_chat.py``); cached
        prompt tokens are reported only with ``--enable-cache-report``."""
        return True

    async def probe(self, http: aiohttp.ClientSession, base_url: str) -> Probe:
        """GET /health_generate: 200 = ready; 503 = not ready, phase "warming up" (its
        warm-up request has not finished; later: shutting down, or the scheduler produced
        nothing for 20 s); any other status = not ready.

        A 200 takes at least a second (SGLang waits one second before checking the
        scheduler). Raises EngineUnavailable on refused/reset/timeout; a loading SGLang
        refuses connections, since it binds its port only after the model is loaded.
        """
        # While a backend starts, 503 is SGLang's warm-up (ServerStatus.Starting): a failed
        # warm-up ends the process instead. Later it is a shutdown or a stuck scheduler.
        return await probe_status(http, base_url, "/health_generate", engine=self.display_name,
                                  phase="warming up", not_ready="warming up, shutting down, or the scheduler "
                                  "did not answer a one-token generation")

    async def read_load(self, http: aiohttp.ClientSession, spec: BackendSpec, base_url: str) -> Load:
        """Occupancy from /metrics.

        Returns Load(slots=spec.parallel (SGLang publishes no max-running-requests gauge),
        busy=sglang:num_running_reqs, waiting=sglang:num_queue_reqs plus
        sglang:num_grammar_queue_reqs where published, ctx_per_slot=sglang:context_len where
        published, else spec.ctx_per_slot), each combined over label sets as
        :func:`~viiwork.engines.sglang.metrics.scheduler_total` says.

        Raises EngineUnavailable on a transport failure, and LoadUnknown when /metrics does
        not answer 200 (404 without ``--enable-metrics``) or lacks the running or the queue
        gauge (a fresh scheduler that has not logged its statistics yet, or a release with
        other names): never a zero for unknown.
        """
        answer = await fetch(http, base_url, "/metrics")
        if answer.status != 200:
            raise LoadUnknown(f"/metrics answered {answer.status} (SGLang serves it only with --enable-metrics)")
        samples = parse_samples(answer.text())
        running = scheduler_total(samples, RUNNING_GAUGE)
        queued = scheduler_total(samples, QUEUE_GAUGE)
        if running is None or queued is None:
            missing = RUNNING_GAUGE if running is None else QUEUE_GAUGE
            raise LoadUnknown(f"/metrics has no {missing} sample")
        waiting = queued + (scheduler_total(samples, GRAMMAR_QUEUE_GAUGE) or 0.0)
        context = scheduler_constant(samples, CONTEXT_GAUGE)
        return Load(
            slots=spec.parallel,
            busy=request_count(running, RUNNING_GAUGE),
            waiting=request_count(waiting, QUEUE_GAUGE),
            ctx_per_slot=int(context) if context is not None and context >= 1 else spec.ctx_per_slot,
        )


def _options(spec: BackendSpec) -> SglangOptions:
    return spec.options if isinstance(spec.options, SglangOptions) else SglangOptions()
