"""The llama.cpp adapter: golden command lines, and probe/load against replayed captures.

Captures are verbatim responses of llama-server build b1 / commit 7e4c0a9
(``captures/README.md``); the servers replaying them listen on 127.0.0.1:0.
"""

from __future__ import annotations

import socket
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field, replace

import aiohttp
import pytest
from aiohttp import web
from pydantic import ValidationError

from support.llamacpp_replays import capture, llamacpp_replays
from viiwork.engines.conformance import HttpReplay, assert_conforms
from viiwork.engines.contract import BackendSpec, EngineUnavailable, Kind, Load, LoadUnknown, Probe, TokenCounters
from viiwork.engines.llamacpp import LlamaCppEngine, LlamaCppOptions

ENGINE = LlamaCppEngine()


def make_spec(**overrides: object) -> BackendSpec:
    base = BackendSpec(
        model="smollm2", kind=Kind.CHAT, path="/models/smollm2.gguf", port=8101,
        ctx_per_slot=2048, parallel=2, options=LlamaCppOptions(), host_cpus=8,
    )
    return replace(base, **overrides)  # type: ignore[arg-type]


# --- golden command lines ------------------------------------------------------------------

HEAD = (
    "llama-server", "--model", "/models/smollm2.gguf", "--alias", "smollm2",
    "--host", "127.0.0.1", "--port", "8101", "--ctx-size", "4096", "--parallel", "2",
)

# llama-server's CORS default is "*": cut to localhost (it has no flag that turns CORS off).
CORS = ("--cors-origins", "localhost", "--no-cors-credentials")

GOLDEN: list[tuple[str, BackendSpec, tuple[str, ...], dict[str, str]]] = [
    (
        "cpu",
        make_spec(),
        (*HEAD, "--threads", "8", "--n-gpu-layers", "0", "--device", "none", "--metrics", *CORS),
        {},
    ),
    (
        "one-gpu",
        make_spec(gpus=("0",), vendor="nvidia"),
        (*HEAD, "--threads", "8", "--n-gpu-layers", "all", "--metrics", *CORS),
        {},
    ),
    (
        "two-gpu-backend-of-two",
        make_spec(gpus=("2", "3"), vendor="nvidia", backends_on_node=2),
        (*HEAD, "--threads", "4", "--n-gpu-layers", "all", "--metrics", *CORS),
        {},
    ),
    (
        "embedding",
        make_spec(kind=Kind.EMBEDDING, gpus=("0",)),
        (*HEAD, "--threads", "8", "--n-gpu-layers", "all", "--embedding", "--metrics", *CORS),
        {},
    ),
    (
        "operator-args-last",
        make_spec(args=("--n-gpu-layers", "20", "--flash-attn", "on")),
        (*HEAD, "--threads", "8", "--n-gpu-layers", "0", "--device", "none", "--metrics", *CORS,
         "--n-gpu-layers", "20", "--flash-attn", "on"),
        {},
    ),
    (
        "fair-thread-share",
        make_spec(host_cpus=8, backends_on_node=3),
        (*HEAD, "--threads", "2", "--n-gpu-layers", "0", "--device", "none", "--metrics", *CORS),
        {},
    ),
    (
        "thread-share-never-below-one",
        make_spec(host_cpus=2, backends_on_node=5),
        (*HEAD, "--threads", "1", "--n-gpu-layers", "0", "--device", "none", "--metrics", *CORS),
        {},
    ),
    (
        "explicit-threads-option",
        make_spec(options=LlamaCppOptions(threads=3), backends_on_node=4),
        (*HEAD, "--threads", "3", "--n-gpu-layers", "0", "--device", "none", "--metrics", *CORS),
        {},
    ),
    (
        "vulkan-device-selection",
        make_spec(gpus=("1", "3"), options=LlamaCppOptions(device_selection="vulkan")),
        (*HEAD, "--threads", "8", "--n-gpu-layers", "all", "--metrics", *CORS),
        {"GGML_VK_VISIBLE_DEVICES": "1,3"},
    ),
    (
        "vulkan-on-cpu-selects-no-device",
        make_spec(options=LlamaCppOptions(device_selection="vulkan")),
        (*HEAD, "--threads", "8", "--n-gpu-layers", "0", "--device", "none", "--metrics", *CORS),
        {},
    ),
    (
        "options-binary-layers-no-metrics",
        make_spec(gpus=("0",), options=LlamaCppOptions(binary="/opt/llama/llama-server", gpu_layers=20, metrics=False)),
        ("/opt/llama/llama-server", *HEAD[1:], "--threads", "8", "--n-gpu-layers", "20", *CORS),
        {},
    ),
    (
        # What the supervisor launches: a Unix socket instead of host:port, and the key file.
        "socket-and-key",
        make_spec(port=0, socket_path="/run/viiwork/engines/smollm2-0/engine.sock",
                  api_key_file="/run/viiwork/engines/smollm2-0/key"),
        ("llama-server", "--model", "/models/smollm2.gguf", "--alias", "smollm2",
         "--host", "/run/viiwork/engines/smollm2-0/engine.sock", "--ctx-size", "4096", "--parallel", "2",
         "--threads", "8", "--n-gpu-layers", "0", "--device", "none", "--metrics", *CORS,
         "--api-key-file", "/run/viiwork/engines/smollm2-0/key"),
        {},
    ),
]


@pytest.mark.parametrize(("spec", "argv", "env"), [g[1:] for g in GOLDEN], ids=[g[0] for g in GOLDEN])
def test_golden_command(spec: BackendSpec, argv: tuple[str, ...], env: dict[str, str]) -> None:
    cmd = ENGINE.build_command(spec)
    assert cmd.argv == argv
    assert dict(cmd.env) == env


def test_ctx_size_is_the_total_over_slots() -> None:
    argv = ENGINE.build_command(make_spec(ctx_per_slot=3000, parallel=4)).argv
    assert argv[argv.index("--ctx-size") + 1] == "12000"


# --- options -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("block", "named"),
    [
        ({"thread": 4}, "thread"),
        ({"gpu_memory_utilisation": 0.9}, "gpu_memory_utilisation"),
        ({"threads": 0}, "threads"),
        ({"device_selection": "cuda"}, "device_selection"),
        ({"gpu_layers": "most"}, "gpu_layers"),
        ({"binary": ""}, "binary"),
    ],
    ids=["unknown-key-thread", "unknown-key-other-engine", "threads-zero", "device-selection-unknown", "gpu-layers-word",
         "binary-empty"],
)
def test_bad_options_name_the_field(block: dict[str, object], named: str) -> None:
    with pytest.raises(ValidationError) as caught:
        LlamaCppEngine.options_model.model_validate(block)
    assert named in str(caught.value)


def test_empty_options_block_is_the_defaults() -> None:
    assert LlamaCppEngine.options_model.model_validate({}) == LlamaCppOptions()


# --- replay servers ------------------------------------------------------------------------


@dataclass
class Replayer:
    """A loopback server answering each path from a capture; records the paths asked."""

    routes: dict[str, HttpReplay]
    asked: list[str] = field(default_factory=list)

    async def handle(self, request: web.Request) -> web.Response:
        self.asked.append(request.path)
        found = self.routes.get(request.path)
        if found is None:
            return web.Response(status=404)
        headers = {k: v for k, v in found.headers if k.lower() in ("content-type", "server")}
        return web.Response(status=found.status, body=found.body, headers=headers)


Serve = Callable[..., Awaitable[tuple[str, Replayer]]]


@pytest.fixture
async def serve() -> AsyncIterator[Serve]:
    """serve(**{"/path": "capture-name" or HttpReplay}) -> (base_url, replayer)."""
    runners: list[web.AppRunner] = []

    async def start(**routes: str | HttpReplay) -> tuple[str, Replayer]:
        table = {
            "/" + key: value if isinstance(value, HttpReplay) else capture(value) for key, value in routes.items()
        }
        replayer = Replayer(table)
        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", replayer.handle)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        runners.append(runner)
        await web.TCPSite(runner, "127.0.0.1", 0).start()
        host, port = runner.addresses[0][:2]
        return f"http://{host}:{port}", replayer

    yield start
    for runner in runners:
        await runner.cleanup()


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5)) as session:
        yield session


def refused_url() -> str:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    return f"http://127.0.0.1:{port}"


# --- probe ---------------------------------------------------------------------------------


async def test_probe_loading_503_is_not_ready_with_phase(serve: Serve, http: aiohttp.ClientSession) -> None:
    base, _ = await serve(health="smollm2-health_loading")
    assert await ENGINE.probe(http, base) == Probe(ready=False, phase="loading model", progress=-1.0, reason="Loading model")


@pytest.mark.parametrize("health", ["smollm2-health_ready", "smollm2-health_busy", "tiny-health_np1_busy"])
async def test_probe_200_is_ready_also_while_busy(serve: Serve, http: aiohttp.ClientSession, health: str) -> None:
    base, _ = await serve(health=health)
    assert await ENGINE.probe(http, base) == Probe(ready=True)


async def test_probe_other_status_is_not_ready_with_reason(serve: Serve, http: aiohttp.ClientSession) -> None:
    base, _ = await serve(health=HttpReplay.json(500, '{"error":{"message":"Model crashed","code":500}}'))
    result = await ENGINE.probe(http, base)
    assert not result.ready and result.phase == ""
    assert "500" in result.reason and "Model crashed" in result.reason


async def test_probe_refused_is_engine_unavailable(http: aiohttp.ClientSession) -> None:
    with pytest.raises(EngineUnavailable, match="/health"):
        await ENGINE.probe(http, refused_url())


async def test_non_http_answer_is_engine_unavailable_not_an_aiohttp_error(http: aiohttp.ClientSession) -> None:
    """Regression: aiohttp's ClientResponseError ("Bad status line") escaped the adapter."""
    import asyncio

    async def garbage(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.read(1024)
        writer.write(b"SSH-2.0-OpenSSH_9.2\r\n\r\n")
        await writer.drain()
        writer.close()

    server = await asyncio.start_server(garbage, "127.0.0.1", 0)
    try:
        base = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
        with pytest.raises(EngineUnavailable):
            await ENGINE.probe(http, base)
        with pytest.raises(EngineUnavailable):
            await ENGINE.read_load(http, make_spec(), base)
    finally:
        server.close()
        await server.wait_closed()


# --- read_load -----------------------------------------------------------------------------


async def test_idle_two_slots_reads_engine_figures(serve: Serve, http: aiohttp.ClientSession) -> None:
    base, _ = await serve(slots="smollm2-slots_idle", metrics="smollm2-metrics")
    assert await ENGINE.read_load(http, make_spec(ctx_per_slot=1024, parallel=2), base) == Load(
        slots=2, busy=0, waiting=0, ctx_per_slot=1024, tokens=TokenCounters(66, 0.165827, 571, 5.68063)
    )


async def test_one_of_two_slots_busy(serve: Serve, http: aiohttp.ClientSession) -> None:
    base, _ = await serve(slots="smollm2-slots_busy", metrics="smollm2-metrics_busy")
    assert await ENGINE.read_load(http, make_spec(ctx_per_slot=1024), base) == Load(
        slots=2, busy=1, waiting=0, ctx_per_slot=1024, tokens=TokenCounters(66, 0.165827, 171, 1.50951)
    )


async def test_deferred_requests_are_waiting(serve: Serve, http: aiohttp.ClientSession) -> None:
    """parallel=1 with three long requests: one runs, two are deferred (llamacpp:requests_deferred)."""
    base, _ = await serve(slots="tiny-slots_np1_busy", metrics="tiny-metrics_np1_deferred")
    load = await ENGINE.read_load(http, make_spec(ctx_per_slot=2048, parallel=1), base)
    assert (load.slots, load.busy, load.waiting) == (1, 1, 2)


async def test_ctx_per_slot_is_what_the_engine_serves_not_the_spec(serve: Serve, http: aiohttp.ClientSession) -> None:
    """Asked for 4096 tokens on one slot, llama-server clamped to the model's trained 2048."""
    base, _ = await serve(slots="tiny-slots_np1_idle", metrics="tiny-metrics_np1_deferred")
    load = await ENGINE.read_load(http, make_spec(ctx_per_slot=4096, parallel=1), base)
    assert (load.slots, load.ctx_per_slot) == (1, 2048)


async def test_four_slots_with_metrics_off_leave_waiting_unknown(serve: Serve, http: aiohttp.ClientSession) -> None:
    base, _ = await serve(slots="tiny-slots_np4_idle", metrics="tiny-metrics_disabled")
    assert await ENGINE.read_load(http, make_spec(ctx_per_slot=1024, parallel=4), base) == Load(
        slots=4, busy=0, waiting=None, ctx_per_slot=1024
    )


async def test_metrics_option_off_does_not_ask_for_metrics(serve: Serve, http: aiohttp.ClientSession) -> None:
    base, replayer = await serve(slots="smollm2-slots_idle", metrics="smollm2-metrics")
    spec = make_spec(options=LlamaCppOptions(metrics=False))
    assert (await ENGINE.read_load(http, spec, base)).waiting is None
    assert replayer.asked == ["/slots"]


async def test_embedding_server_slots(serve: Serve, http: aiohttp.ClientSession) -> None:
    base, _ = await serve(slots="tiny-slots_embedding", metrics="tiny-metrics_disabled")
    load = await ENGINE.read_load(http, make_spec(kind=Kind.EMBEDDING, ctx_per_slot=512), base)
    assert (load.slots, load.busy, load.ctx_per_slot) == (2, 0, 512)


@pytest.mark.parametrize(
    ("slots", "says"),
    [
        ("tiny-slots_disabled", "501"),
        ("smollm2-slots_loading", "503"),
        (HttpReplay.json(200, "[]"), "undecodable"),
        (HttpReplay.json(200, "{}"), "undecodable"),
        (HttpReplay.json(200, '[{"id":0,"n_ctx":1024}]'), "is_processing"),
        (HttpReplay.json(200, '[{"id":0,"n_ctx":0,"is_processing":false}]'), "n_ctx"),
        (HttpReplay(status=200, body=b"<html>proxy error</html>"), "undecodable"),
    ],
    ids=["no-slots-501", "loading-503", "empty-list", "object", "no-is_processing", "n_ctx-zero", "html"],
)
async def test_unreadable_slots_raise_load_unknown_never_zeros(
    serve: Serve, http: aiohttp.ClientSession, slots: str | HttpReplay, says: str
) -> None:
    base, _ = await serve(slots=slots, metrics="smollm2-metrics")
    with pytest.raises(LoadUnknown, match=says):
        await ENGINE.read_load(http, make_spec(), base)


async def test_read_load_refused_is_engine_unavailable(http: aiohttp.ClientSession) -> None:
    with pytest.raises(EngineUnavailable, match="/slots"):
        await ENGINE.read_load(http, make_spec(), refused_url())


# --- the contract --------------------------------------------------------------------------


async def test_conformance() -> None:
    await assert_conforms(LlamaCppEngine(), llamacpp_replays(), check_registered=True, timeout_s=0.3, grace_s=1.0)
