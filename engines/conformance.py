"""The engine conformance kit: the rules every engine adapter obeys, checked in one call.

One module (over 400 lines) because it is one kit an adapter's tests call once: every check
reports into the same list of violations, and its replay servers (captured answers, and ones
that refuse, reset, hang or talk garbage) serve all of them.

Every engine's tests call it (docs/engines.md, "Rules" 1-6)::

    replays = EngineReplays(ready=..., busy=..., loading=..., load_unknown=(...,))
    await assert_conforms(MyEngine(), replays)

It needs no GPU, no engine binary and no network: the command line is checked on spec
shapes built here (or given), and ``probe``/``read_load`` run against aiohttp servers on
127.0.0.1:0 that the kit starts itself, replaying the engine's captured HTTP responses, plus
servers of its own that refuse, reset, hang or talk garbage. It reports every violation at
once (``run_conformance`` returns them; ``assert_conforms`` raises ``ConformanceError``
listing them), each tagged with the check that failed, so a test can tell which rule broke.

What it checks (check id: rule):

- ``name``: non-empty, lowercase ``[a-z][a-z0-9_]*`` (it is the registry key and the config
  block name); ``registered``: the registry maps it to this class (opt-in).
- ``display_name``: 1..40 characters, no control characters.
- ``options``: ``options_model()`` builds with defaults, is frozen (it lives in a frozen
  ``BackendSpec``), and rejects an unknown key with an error naming the key (rule 5).
- ``startup_timeout``: ``default_startup_timeout_s`` finite and > 0.
- ``command_version``: an int >= 1.
- ``command.*`` (rule 1), per spec shape (CPU shapes only when the engine implements
  ``RunsOnCPU``; without it a CPU spec must raise an ``EngineError``, never quietly build a
  command): ``command.model`` argv or env carries ``spec.model``; ``command.path`` carries
  ``spec.path``; ``command.bind`` binds 127.0.0.1 and ``spec.port`` and no wildcard address,
  or, for an engine that declares ``unix_socket = True``, a spec's ``socket_path`` (and no
  port); ``command.key`` an engine that declares ``api_key = True`` has
  ``spec.api_key_file`` in its argv or names the variable it reads the key from
  (``LaunchCommand.key_env``, then absent from ``env``): never the key itself
  (docs/engines.md);
  ``command.args_last`` the operator args are argv's tail; ``command.shape`` argv is a
  non-empty tuple of strings and env maps str to str.
- ``command.pure`` (rule 4): the same spec gives the same command, before and after other
  specs, and on a fresh instance; ``state``: no attribute of the instance or its class
  changes across every call the kit makes.
- ``probe.*`` (rule 2): ``probe.ready`` the ready and busy replays are ready;
  ``probe.loading`` the loading replay is not ready and names a phase;
  ``probe.answer`` any HTTP answer (garbage bodies, 404s) is a successful probe, never an
  exception; ``probe.transport`` refused, reset, non-HTTP bytes and a hanging server raise
  ``EngineUnavailable`` within the session's timeout; ``probe.shape`` progress is -1 or in
  0..1.
- ``load.*`` (rule 3): ``load.busy`` the busy replay reads busy >= 1, slots >= 1,
  ctx_per_slot >= 1; ``load.unknown`` captured load-unknown replays and the kit's own garbage
  raise ``LoadUnknown`` (never zeros); ``load.transport`` refused/reset/hang raise
  ``EngineUnavailable``; ``load.shape`` every Load read has int fields, slots and ctx >= 1,
  busy >= 0, waiting None or >= 0.
- ``capability.*``: the optional capabilities an engine implements answer with the right
  shapes (WarmUp, UsageReporting, BoundGPU, Version, ReasoningSeparation);
  ``capability.client_fault``: ``client_fault`` returns None or a code of
  ``CLIENT_FAULT_CODES`` and never raises, and returns None for a 2xx and for bodies that
  say nothing (not JSON, 50,000 and 100,000 nested brackets, 8 MiB, not UTF-8, JSON of
  other shapes).
  ``capability.endpoints``: ``endpoints(kind, args)`` answers a set of ``Endpoint`` for every
  kind, never raises, and includes the kind's own endpoint (docs/engines.md, "Endpoints").
- ``gang.*``: an engine that declares a ``launch_shape`` builds every part of a 3-host gang
  (``gang.shape``, ``gang.options``, ``gang.command``: engines/conformance_gang.py).
- ``embedding.answers``: an embedding backend answers ``POST /v1/embeddings`` with 200 and
  an OpenAI embeddings list (``data[0].embedding`` a non-empty list of finite numbers).
  Offline against ``EngineReplays.embeddings`` (a capture of the engine's embedding
  backend, as ``build_command`` starts it); live with ``check_embeddings`` against a real
  backend (the real-engine tests do).

Source of the rules: docs/engines.md ("The contract", "Rules"), and the engine-porting
lessons of viiwork v2 (a 200 is not readiness; absent is not zero; an adapter is a
stateless singleton).
"""

from __future__ import annotations

import asyncio
import math
import re
import socket
from collections.abc import Awaitable, Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import AsyncExitStack
from dataclasses import dataclass, field, replace
from json import loads as json_loads
from pathlib import Path
from typing import TypedDict, TypeGuard, Unpack

import aiohttp
from aiohttp import web
from pydantic import BaseModel, ValidationError

from viiwork.engines.conformance_gang import check_gang
from viiwork.engines.contract import (
    CLIENT_FAULT_CODES,
    BackendSpec,
    BoundGPU,
    Endpoint,
    Engine,
    EngineError,
    EngineOptionsError,
    EngineUnavailable,
    Kind,
    LaunchCommand,
    Load,
    LoadUnknown,
    Probe,
    ReasoningSeparation,
    RunsOnCPU,
    ServesEndpoints,
    UsageReporting,
    Version,
    WarmUp,
    binds_unix_socket,
    takes_api_key,
)

__all__ = [
    "ConformanceError",
    "EngineReplays",
    "HttpReplay",
    "ReplaySet",
    "Violation",
    "assert_conforms",
    "check_embeddings",
    "default_spec_shapes",
    "run_conformance",
]

_NAME_RE = re.compile(r"^[a-z][a-z0-9_]*$")
_WILDCARD_HOSTS = ("0.0.0.0", "::", "[::]", "*")
# Headers the replay server must not copy: aiohttp frames the body itself.
_HOP_HEADERS = frozenset({"content-length", "connection", "keep-alive", "transfer-encoding", "date"})
# Distinctive values, so "the model name is on the command line" cannot pass by accident.
_MODEL = "conformance-model-x7"
_PORT = 38517
_KEY_FILE = "/run/viiwork/engines/conformance-x7-0/key"
_SOCKET = "/run/viiwork/engines/conformance-x7-0/engine.sock"
_OPERATOR_ARGS = ("--conformance-operator-flag", "operator-value-x7")
_UNKNOWN_OPTION = "conformance_unknown_key_x7"


@dataclass(frozen=True, slots=True)
class Violation:
    """One broken rule: ``check`` is the stable id (``command.bind``), ``message`` says how."""

    check: str
    message: str

    def __str__(self) -> str:
        return f"[{self.check}] {self.message}"


class ConformanceError(AssertionError):
    """An engine broke at least one rule; ``violations`` lists every one."""

    def __init__(self, engine_name: str, violations: Sequence[Violation]) -> None:
        self.violations = tuple(violations)
        lines = "\n".join(f"  - {v}" for v in self.violations)
        super().__init__(f"engine {engine_name!r} breaks {len(self.violations)} conformance rule(s):\n{lines}")


@dataclass(frozen=True, slots=True)
class HttpReplay:
    """One captured HTTP response: status, headers (as sent) and body bytes."""

    status: int
    body: bytes = b""
    headers: tuple[tuple[str, str], ...] = ()

    @classmethod
    def parse(cls, raw: bytes) -> HttpReplay:
        """Parse a verbatim capture as ``curl -i`` writes it: status line, headers, a blank
        line, then the body. Raises ValueError when ``raw`` does not start with HTTP/."""
        head, sep, body = raw.partition(b"\r\n\r\n")
        if not sep:
            head, sep, body = raw.partition(b"\n\n")
        lines = head.decode("latin-1").splitlines()
        if not lines or not lines[0].startswith("HTTP/"):
            raise ValueError(f"not an HTTP response capture: {raw[:40]!r}")
        parts = lines[0].split(None, 2)
        if len(parts) < 2 or not parts[1].isdigit():
            raise ValueError(f"bad status line {lines[0]!r}")
        headers = []
        for line in lines[1:]:
            name, colon, value = line.partition(":")
            if colon:
                headers.append((name.strip(), value.strip()))
        return cls(status=int(parts[1]), body=body, headers=tuple(headers))

    @classmethod
    def from_file(cls, path: str | Path) -> HttpReplay:
        """``parse`` of a capture file; the error names the file."""
        try:
            return cls.parse(Path(path).read_bytes())
        except ValueError as exc:
            raise ValueError(f"{path}: {exc}") from None

    @classmethod
    def json(cls, status: int, text: str) -> HttpReplay:
        """A synthetic JSON answer (for the kit's own garbage, not for engine captures)."""
        return cls(status=status, body=text.encode(), headers=(("Content-Type", "application/json"),))


# Request path (no query) -> the response served for it; any other path answers 404.
ReplaySet = Mapping[str, HttpReplay]


@dataclass(frozen=True, slots=True)
class EngineReplays:
    """Captured responses of one engine in each state the kit exercises.

    ready: idle and ready to serve. busy: ready with at least one sequence running.
    loading: still loading, answering; None for an engine that refuses connections until
    it is ready (vLLM), whose loading state is the refused port the kit always checks.
    load_unknown: answers from which load cannot be read honestly (a disabled /slots, a
    missing gauge); each must make ``read_load`` raise LoadUnknown. embeddings: the
    engine's embedding backend (started from ``build_command`` of an embedding spec)
    answering ``POST /v1/embeddings``; None when no capture exists yet (not checked).
    """

    ready: ReplaySet
    busy: ReplaySet
    loading: ReplaySet | None = None
    load_unknown: tuple[ReplaySet, ...] = ()
    embeddings: HttpReplay | None = None


# --- spec shapes ---------------------------------------------------------------------------


def default_spec_shapes(engine: Engine, options: BaseModel | None = None) -> list[BackendSpec]:
    """The spec shapes the kit checks by default: a CPU backend, one GPU, two GPUs of a
    node's two backends, and an embedding backend, all with operator args. The kit builds
    the CPU shape only for an engine that implements ``RunsOnCPU`` and requires any other
    engine to refuse it. ``options`` defaults to ``engine.options_model()``.
    """
    opts = options if options is not None else engine.options_model()
    base = BackendSpec(
        model=_MODEL, kind=Kind.CHAT, path="/models/conformance-x7.gguf", port=_PORT,
        ctx_per_slot=4096, parallel=4, options=opts, gpus=("0",), vendor="nvidia",
        backends_on_node=1, host_cpus=8, args=_OPERATOR_ARGS, api_key_file=_KEY_FILE,
    )
    shapes = [
        replace(base, gpus=(), vendor="cpu"),
        base,
        replace(base, gpus=("1", "2"), backends_on_node=2, port=_PORT + 1, parallel=2),
        replace(base, kind=Kind.EMBEDDING, port=_PORT + 2, parallel=1),
    ]
    if binds_unix_socket(engine):  # the shape the supervisor launches it with
        shapes.append(replace(base, port=0, socket_path=_SOCKET))
    return shapes


def _runs_on_cpu(engine: Engine) -> bool:
    return isinstance(engine, RunsOnCPU) and bool(engine.supports_cpu())


def _argv_has(argv: Sequence[str], value: str) -> bool:
    """``value`` is an argv token, or the value of a ``--flag=value`` token."""
    return any(tok == value or tok.endswith("=" + value) for tok in argv)


def _check_command(engine: Engine, spec: BackendSpec, out: list[Violation]) -> LaunchCommand | None:
    label = f"{'CPU' if not spec.gpus else f'{len(spec.gpus)}-GPU'} {spec.kind.value} spec"
    try:
        cmd = engine.build_command(spec)
    except Exception as exc:  # noqa: BLE001 - any exception is the finding
        out.append(Violation("command.shape", f"build_command({label}) raised {_exc(exc)}"))
        return None
    if not isinstance(cmd, LaunchCommand):
        out.append(Violation(
            "command.shape", f"build_command({label}) returned {type(cmd).__name__}, not LaunchCommand",
        ))
        return None
    argv, env = cmd.argv, cmd.env
    if not isinstance(argv, tuple) or not argv or not all(isinstance(a, str) for a in argv) or not argv[0]:
        out.append(Violation("command.shape", f"{label}: argv must be a non-empty tuple of str, got {argv!r}"))
        return None
    if not all(isinstance(k, str) and isinstance(v, str) for k, v in dict(env).items()):
        out.append(Violation("command.shape", f"{label}: env must map str to str, got {dict(env)!r}"))
    n_args = len(spec.args)
    head = argv[: len(argv) - n_args] if n_args else argv
    env_values = [str(v) for v in dict(env).values()]
    if not (_argv_has(head, spec.model) or spec.model in env_values):
        out.append(Violation(
            "command.model", f"{label}: the backend must answer to spec.model {spec.model!r}; not in argv {list(argv)}",
        ))
    if not (_argv_has(head, spec.path) or spec.path in env_values):
        out.append(Violation("command.path", f"{label}: spec.path {spec.path!r} is not in argv {list(argv)}"))
    if spec.socket_path:
        if not _argv_has(head, spec.socket_path):
            out.append(Violation(
                "command.bind", f"{label}: argv does not bind spec.socket_path {spec.socket_path}: {list(argv)}",
            ))
        if _argv_has(head, "127.0.0.1") or any(tok == "--port" or tok.startswith("--port=") for tok in head):
            out.append(Violation(
                "command.bind", f"{label}: a socket backend must not also bind a TCP port: {list(argv)}",
            ))
    else:
        if not _argv_has(head, "127.0.0.1"):
            out.append(Violation("command.bind", f"{label}: argv does not bind 127.0.0.1: {list(argv)}"))
        if not _argv_has(head, str(spec.port)):
            out.append(Violation("command.bind", f"{label}: argv does not bind spec.port {spec.port}: {list(argv)}"))
    wild = [tok for tok in head if any(tok == w or tok.endswith("=" + w) for w in _WILDCARD_HOSTS)]
    if wild:
        out.append(Violation(
            "command.bind",
            f"{label}: argv binds a wildcard address {wild}: a backend must never listen beyond loopback",
        ))
    key_env = getattr(cmd, "key_env", None)
    if key_env is not None and (not isinstance(key_env, str) or not key_env):
        out.append(Violation("command.key", f"{label}: key_env must be a variable name or None, got {key_env!r}"))
    elif key_env is not None and key_env in dict(env):
        out.append(Violation(
            "command.key",
            f"{label}: key_env {key_env} is also in env, which `systemctl show` reveals: the runner "
            "sets it from the environment file",
        ))
    if takes_api_key(engine) and spec.api_key_file and not (_argv_has(argv, spec.api_key_file) or key_env):
        out.append(Violation(
            "command.key",
            f"{label}: the engine declares api_key but neither passes spec.api_key_file {spec.api_key_file} "
            f"in argv nor names a key_env: {list(argv)}",
        ))
    if n_args:
        if tuple(argv[-n_args:]) != tuple(spec.args):
            out.append(Violation(
                "command.args_last",
                f"{label}: operator args {list(spec.args)} must be argv's tail (so they win), argv is "
                f"{list(argv)}",
            ))
        elif any(a in head for a in spec.args):
            out.append(Violation(
                "command.args_last", f"{label}: operator args also appear before the tail: {list(argv)}",
            ))
    return cmd


# --- state snapshot (rule 4) ---------------------------------------------------------------


def _snapshot(engine: Engine) -> dict[str, object]:
    """Every data attribute of the instance and of its classes (not methods or descriptors)."""
    snap: dict[str, object] = {}
    for key, value in getattr(engine, "__dict__", {}).items():
        snap[f"self.{key}"] = value
    for slot_owner in type(engine).__mro__:
        slots = getattr(slot_owner, "__slots__", ())
        for slot in (slots,) if isinstance(slots, str) else slots:
            if hasattr(engine, slot):
                snap[f"self.{slot}"] = getattr(engine, slot)
    for cls in type(engine).__mro__:
        if cls is object:
            continue
        for key, value in vars(cls).items():
            if key.startswith("__") or callable(value):
                continue
            if isinstance(value, (property, classmethod, staticmethod)) or hasattr(value, "__get__"):
                continue
            snap.setdefault(f"{cls.__name__}.{key}", value)
    return {key: _fingerprint(value) for key, value in snap.items()}


def _fingerprint(value: object, depth: int = 0) -> object:
    """A comparable structural copy: containers recursed, objects by type and attributes.

    (A deep copy would not do: two copies of an object without ``__eq__`` never compare equal.)
    """
    if depth > 8:
        return "<deep>"
    if value is None or isinstance(value, (bool, int, float, str, bytes)):
        return value
    if isinstance(value, Mapping):
        return ("map", tuple(sorted(((repr(k), _fingerprint(v, depth + 1)) for k, v in value.items()))))
    if isinstance(value, (list, tuple)):
        return (type(value).__name__, tuple(_fingerprint(v, depth + 1) for v in value))
    if isinstance(value, (set, frozenset)):
        return ("set", tuple(sorted(repr(_fingerprint(v, depth + 1)) for v in value)))
    if isinstance(value, BaseModel):
        return (type(value).__qualname__, _fingerprint(value.model_dump(), depth + 1))
    attrs = getattr(value, "__dict__", None)
    if isinstance(attrs, dict):
        return (type(value).__qualname__, _fingerprint(attrs, depth + 1))
    return (type(value).__qualname__, repr(value))


def _state_changes(before: Mapping[str, object], after: Mapping[str, object]) -> list[str]:
    changed = []
    for key in sorted(set(before) | set(after)):
        if key not in before:
            changed.append(f"{key} appeared")
        elif key not in after:
            changed.append(f"{key} disappeared")
        elif before[key] != after[key]:
            changed.append(f"{key} changed")
    return changed


# --- loopback servers ----------------------------------------------------------------------


@dataclass
class _Servers:
    """Loopback servers the kit starts; every one is torn down by the exit stack."""

    stack: AsyncExitStack
    release: asyncio.Event = field(default_factory=asyncio.Event)

    async def replay(self, replays: ReplaySet) -> str:
        async def handler(request: web.Request) -> web.Response:
            found = replays.get(request.path)
            if found is None:
                return web.Response(status=404, text="no replay for this path")
            headers = {k: v for k, v in found.headers if k.lower() not in _HOP_HEADERS}
            return web.Response(status=found.status, body=found.body, headers=headers)

        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", handler)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        self.stack.push_async_callback(runner.cleanup)
        await web.TCPSite(runner, "127.0.0.1", 0).start()
        host, port = runner.addresses[0][:2]
        return f"http://{host}:{port}"

    async def raw(self, behaviour: str) -> str:
        """A TCP server that resets ("reset"), hangs ("hang") or answers non-HTTP ("garbage")."""

        async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            try:
                if behaviour == "hang":
                    await self.release.wait()
                elif behaviour == "garbage":
                    await reader.read(1024)
                    writer.write(b"this is not HTTP\r\n\r\n")
                    await writer.drain()
            except (ConnectionError, asyncio.CancelledError):
                pass
            finally:
                writer.close()

        server = await asyncio.start_server(handle, "127.0.0.1", 0)

        async def close() -> None:
            self.release.set()
            server.close()
            await server.wait_closed()

        self.stack.push_async_callback(close)
        return f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"

    @staticmethod
    def refused() -> str:
        """A loopback port with nothing listening: bound, then closed."""
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        return f"http://127.0.0.1:{port}"


# The kit's own "answered, but nothing readable" servers: every engine must read these as
# an answer (probe does not raise) and as unknown load (read_load raises LoadUnknown).
class _AnyPath(Mapping[str, HttpReplay]):
    """A ReplaySet answering every path with one response (``get`` finds it for any path)."""

    def __init__(self, replay: HttpReplay) -> None:
        self._replay = replay

    def __getitem__(self, key: str) -> HttpReplay:
        return self._replay

    def __iter__(self) -> Iterator[str]:
        return iter(())

    def __len__(self) -> int:
        return 0


_GARBAGE: dict[str, ReplaySet] = {
    "404 everywhere": _AnyPath(HttpReplay(status=404, body=b"Not Found", headers=(("Content-Type", "text/plain"),))),
    "200 html everywhere": _AnyPath(
        HttpReplay(status=200, body=b"<html>hello</html>", headers=(("Content-Type", "text/html"),))
    ),
    "200 empty JSON object everywhere": _AnyPath(HttpReplay.json(200, "{}")),
    "200 empty body everywhere": _AnyPath(HttpReplay(status=200)),
}


# --- probe and load checks -----------------------------------------------------------------


def _check_probe_shape(probe: object, where: str, out: list[Violation]) -> TypeGuard[Probe]:
    if not isinstance(probe, Probe):
        out.append(Violation("probe.shape", f"{where}: probe returned {type(probe).__name__}, not Probe"))
        return False
    ok = True
    if not isinstance(probe.ready, bool):
        out.append(Violation("probe.shape", f"{where}: ready must be a bool, got {probe.ready!r}"))
        ok = False
    if not (probe.progress == -1.0 or 0.0 <= probe.progress <= 1.0) or math.isnan(probe.progress):
        out.append(Violation(
            "probe.shape", f"{where}: progress must be -1 (unknown) or in 0..1, got {probe.progress!r}",
        ))
        ok = False
    if not isinstance(probe.phase, str) or not isinstance(probe.reason, str):
        out.append(Violation(
            "probe.shape", f"{where}: phase and reason must be str, got {probe.phase!r}, {probe.reason!r}",
        ))
        ok = False
    return ok


def _check_load_shape(load: object, where: str, out: list[Violation]) -> TypeGuard[Load]:
    if not isinstance(load, Load):
        out.append(Violation("load.shape", f"{where}: read_load returned {type(load).__name__}, not Load"))
        return False
    problems = []
    for name in ("slots", "busy", "ctx_per_slot"):
        value = getattr(load, name)
        if not isinstance(value, int) or isinstance(value, bool):
            problems.append(f"{name} must be an int, got {value!r}")
    if not problems:
        if load.slots < 1:
            problems.append(
                f"slots {load.slots} < 1 (0 slots takes the model out of routing: raise LoadUnknown instead)",
            )
        if load.ctx_per_slot < 1:
            problems.append(f"ctx_per_slot {load.ctx_per_slot} < 1")
        if load.busy < 0:
            problems.append(f"busy {load.busy} < 0")
    waiting = load.waiting
    if waiting is not None and (not isinstance(waiting, int) or isinstance(waiting, bool) or waiting < 0):
        problems.append(f"waiting must be None (unknown) or an int >= 0, got {load.waiting!r}")
    for p in problems:
        out.append(Violation("load.shape", f"{where}: {p}"))
    return not problems


def _exc(exc: object) -> str:
    text = str(exc).replace("\n", " ")
    return f"{type(exc).__name__}({text[:160]}{'...' if len(text) > 160 else ''})"


async def _call(
    check: str, where: str, coro_fn: Callable[[], Awaitable[object]], deadline_s: float, out: list[Violation]
) -> tuple[str, object]:
    """Run one adapter call under a deadline: ("ok", value) / ("raised", exc) / ("hung", None)."""
    guard = asyncio.timeout(deadline_s)
    try:
        async with guard:
            return "ok", await coro_fn()
    except TimeoutError as exc:
        if guard.expired():
            out.append(Violation(
                check, f"{where}: no answer within {deadline_s:.1f}s (the adapter ignored the session's timeout)",
            ))
            return "hung", None
        return "raised", exc  # the adapter's own TimeoutError escaped
    except Exception as exc:  # noqa: BLE001 - classified by the caller
        return "raised", exc


# --- capabilities --------------------------------------------------------------------------


def _check_capabilities(engine: Engine, specs: Sequence[BackendSpec], out: list[Violation]) -> None:
    for spec in specs:
        if isinstance(engine, WarmUp):
            try:
                w = engine.warmup_s(spec)
                if not isinstance(w, (int, float)) or isinstance(w, bool) or not math.isfinite(w) or w < 0:
                    out.append(Violation("capability.warmup", f"warmup_s must be a finite number >= 0, got {w!r}"))
            except Exception as exc:  # noqa: BLE001
                out.append(Violation("capability.warmup", f"warmup_s raised {_exc(exc)}"))
        if isinstance(engine, BoundGPU):
            try:
                env = engine.device_env(spec)
                if not all(isinstance(k, str) and isinstance(v, str) for k, v in dict(env).items()):
                    out.append(Violation("capability.bound_gpu", f"device_env must map str to str, got {env!r}"))
                if not spec.gpus and dict(env):
                    out.append(Violation(
                        "capability.bound_gpu",
                        "device_env of a CPU spec must be empty (no device for a CPU backend), got "
                        f"{dict(env)}",
                    ))
            except Exception as exc:  # noqa: BLE001
                out.append(Violation("capability.bound_gpu", f"device_env raised {_exc(exc)}"))
        if isinstance(engine, ReasoningSeparation):
            try:
                args = engine.reasoning_args(spec)
                if not isinstance(args, tuple) or not all(isinstance(a, str) for a in args):
                    out.append(Violation(
                        "capability.reasoning", f"reasoning_args must be a tuple of str, got {args!r}",
                    ))
            except Exception as exc:  # noqa: BLE001
                out.append(Violation("capability.reasoning", f"reasoning_args raised {_exc(exc)}"))
    if isinstance(engine, UsageReporting):
        try:
            if not isinstance(engine.stream_usage_supported(), bool):
                out.append(Violation("capability.usage", "stream_usage_supported must return a bool"))
        except Exception as exc:  # noqa: BLE001
            out.append(Violation("capability.usage", f"stream_usage_supported raised {_exc(exc)}"))
    _check_client_fault(engine, out)
    _check_endpoints(engine, out)
    if isinstance(engine, Version):
        try:
            if not isinstance(engine.minimum_version, str):
                out.append(Violation(
                    "capability.version", f"minimum_version must be a str, got {engine.minimum_version!r}",
                ))
            cmd = engine.version_command(engine.options_model())
            if not isinstance(cmd, tuple) or not cmd or not all(isinstance(a, str) and a for a in cmd):
                out.append(Violation(
                    "capability.version", f"version_command must be a non-empty tuple of str, got {cmd!r}",
                ))
            for garbage in ("", "\x00\x01 not a version"):
                if engine.parse_version(garbage) is not None:
                    out.append(Violation(
                        "capability.version", f"parse_version({garbage!r}) must be None (unknown), not a guess",
                    ))
        except Exception as exc:  # noqa: BLE001
            out.append(Violation("capability.version", f"Version capability raised {_exc(exc)}"))


# Bodies from which no engine can tell a client fault: each must classify as None.
_FAULT_GARBAGE: dict[str, bytes] = {
    "empty": b"",
    "not JSON": b"<html>502 Bad Gateway</html>",
    "not UTF-8": b"\xff\xfe\x00{\"error\"",
    "50,000 nested arrays": b"[" * 50_000,
    "100,000 nested arrays": b"[" * 100_000,
    "100,000 nested error objects": b'{"error":' * 100_000,
    "8 MiB message": b'{"error":{"message":"' + b"x" * (8 << 20) + b'","type":"server_error","code":500}}',
    "JSON list": b"[1, 2, 3]",
    "error is a string": b'{"error":"boom"}',
    "error message is a number": b'{"error":{"message":5,"type":7,"code":"x"}}',
    "null": b"null",
}


# The endpoint a backend of each kind must serve whatever else it declares.
_KIND_ENDPOINT = {Kind.CHAT: Endpoint.CHAT, Kind.EMBEDDING: Endpoint.EMBEDDINGS, Kind.RERANK: Endpoint.RERANK}


def _check_endpoints(engine: Engine, out: list[Violation]) -> None:
    """``capability.endpoints``: ``endpoints(kind, args)`` never raises, answers a set of
    ``Endpoint`` for every kind (with and without operator args), and includes the kind's
    own endpoint (chat, embeddings, rerank)."""
    if not isinstance(engine, ServesEndpoints):
        return
    for kind in Kind:
        for args in ((), _OPERATOR_ARGS):
            try:
                served = engine.endpoints(kind, args)
            except Exception as exc:  # noqa: BLE001
                out.append(Violation("capability.endpoints", f"endpoints({kind.value}, {args!r}) raised {_exc(exc)}"))
                continue
            if not isinstance(served, (set, frozenset)) or not all(isinstance(e, Endpoint) for e in served):
                out.append(Violation("capability.endpoints",
                                     f"endpoints({kind.value}, ...) must be a set of Endpoint, got {served!r}"))
            elif _KIND_ENDPOINT[kind] not in served:
                out.append(Violation("capability.endpoints", f"a {kind.value} backend must serve "
                                     f"{_KIND_ENDPOINT[kind].path}, got {sorted(e.value for e in served)}"))


def _check_client_fault(engine: Engine, out: list[Violation]) -> None:
    method = getattr(engine, "client_fault", None)
    if method is None:
        return
    if not callable(method):
        out.append(Violation("capability.client_fault", f"client_fault must be a method, got {method!r}"))
        return
    for label, body in _FAULT_GARBAGE.items():
        for status in (400, 500, 503):
            try:
                code = method(status, body)
            except Exception as exc:  # noqa: BLE001 - RecursionError, MemoryError: all findings
                out.append(Violation(
                    "capability.client_fault",
                    f"client_fault({status}, {label}) raised {_exc(exc)}: it must return None",
                ))
                break
            if code is not None:
                out.append(Violation(
                    "capability.client_fault",
                    f"client_fault({status}, {label}) = {code!r}: a body that says nothing is None",
                ))
                break
    # Error-shaped bodies: any answer must be None or a known code. A 2xx is nobody's fault,
    # whatever its body says.
    for status, body in _FAULT_SHAPED:
        try:
            code = method(status, body)
        except Exception as exc:  # noqa: BLE001
            out.append(Violation(
                "capability.client_fault", f"client_fault({status}, {body[:60]!r}) raised {_exc(exc)}",
            ))
            continue
        if not (code is None or (isinstance(code, str) and code in CLIENT_FAULT_CODES)):
            out.append(Violation(
                "capability.client_fault",
                f"client_fault({status}, ...) = {code!r}: not None nor one of {sorted(CLIENT_FAULT_CODES)}",
            ))
        elif status < 400 and code is not None:
            out.append(Violation(
                "capability.client_fault", f"client_fault({status}, ...) = {code!r}: a {status} is not an error",
            ))


_FAULT_SHAPED: tuple[tuple[int, bytes], ...] = tuple(
    (status, body)
    for status in (200, 400, 500)
    for body in (
        b'{"error":{"message":"the request exceeds the available context size, try increasing it",'
        b'"type":"exceed_context_size_error","code":400}}',
        b'{"error":{"message":"image input is not supported","type":"server_error","code":500}}',
        b'{"object":"error","message":"This model\'s maximum context length is 2048 tokens.",'
        b'"type":"BadRequestError","param":null,"code":400}',
        b'{"detail":"Not Found"}',
    )
)


# --- embeddings ----------------------------------------------------------------------------


async def check_embeddings(
    http: aiohttp.ClientSession, base_url: str, model: str, *, deadline_s: float = 30.0
) -> list[Violation]:
    """POST ``{"input": "hello world", "model": model}`` to ``base_url``/v1/embeddings and
    check the answer: 200, a JSON object whose ``data`` is a non-empty list and whose
    ``data[0].embedding`` is a non-empty list of finite numbers (OpenAI's embeddings shape).

    Returns the violations (check ``embedding.answers``), empty when the backend answers.
    Transport failures and a call longer than ``deadline_s`` are violations too.
    """
    where = f"POST {base_url}/v1/embeddings"
    try:
        async with asyncio.timeout(deadline_s):
            async with http.post(f"{base_url}/v1/embeddings", json={"input": "hello world", "model": model}) as resp:
                status, body = resp.status, await resp.read()
    except (aiohttp.ClientError, TimeoutError) as exc:
        return [Violation("embedding.answers", f"{where}: no answer ({_exc(exc)})")]
    if status != 200:
        return [Violation(
            "embedding.answers",
            f"{where} answered {status}: {body[:300]!r}; an embedding backend must serve embeddings",
        )]
    try:
        data = json_loads(body)
        vector = data["data"][0]["embedding"]
        ok = (
            isinstance(data["data"], list) and isinstance(vector, list) and vector
            and all(isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) for x in vector)
        )
    except (ValueError, KeyError, IndexError, TypeError, RecursionError):
        ok = False
    if not ok:
        return [Violation(
            "embedding.answers",
            f"{where} answered 200 without an embeddings list (data[0].embedding of numbers): {body[:300]!r}",
        )]
    return []


# --- the run -------------------------------------------------------------------------------


def _check_metadata(engine: Engine, check_registered: bool, out: list[Violation]) -> None:
    name = getattr(engine, "name", None)
    if not isinstance(name, str) or not _NAME_RE.match(name):
        out.append(Violation(
            "name", f"name must be non-empty lowercase [a-z][a-z0-9_]* (registry key and config block), got {name!r}",
        ))
    elif check_registered:
        from viiwork.engines.registry import ENGINES  # the registry imports every engine

        if type(ENGINES.get(name)) is not type(engine):
            out.append(Violation(
                "registered",
                f"registry has {type(ENGINES.get(name)).__name__} under {name!r}, not {type(engine).__name__}",
            ))
    display = getattr(engine, "display_name", None)
    if not isinstance(display, str) or not 1 <= len(display) <= 40 or any(not c.isprintable() for c in display):
        out.append(Violation("display_name", f"display_name must be 1..40 printable characters, got {display!r}"))
    timeout = getattr(engine, "default_startup_timeout_s", None)
    if not isinstance(timeout, (int, float)) or isinstance(timeout, bool) or not math.isfinite(timeout) or timeout <= 0:
        out.append(Violation(
            "startup_timeout", f"default_startup_timeout_s must be a finite number > 0, got {timeout!r}",
        ))
    version = getattr(engine, "command_version", None)
    if not isinstance(version, int) or isinstance(version, bool) or version < 1:
        out.append(Violation("command_version", f"command_version must be an int >= 1, got {version!r}"))


def _check_options(engine: Engine, out: list[Violation]) -> None:
    model = getattr(engine, "options_model", None)
    if not (isinstance(model, type) and issubclass(model, BaseModel)):
        out.append(Violation("options", f"options_model must be a pydantic model class, got {model!r}"))
        return
    try:
        model()
    except ValidationError as exc:
        out.append(Violation("options", f"options_model() must build with defaults (an empty block is valid): {exc}"))
    if not model.model_config.get("frozen"):
        out.append(Violation("options", "options_model must be frozen (it lives in a frozen BackendSpec)"))
    try:
        model.model_validate({_UNKNOWN_OPTION: 1})
    except (ValidationError, EngineOptionsError) as exc:
        if _UNKNOWN_OPTION not in str(exc):
            out.append(Violation("options", f"the error for an unknown key must name it ({_UNKNOWN_OPTION}): {exc}"))
    else:
        out.append(Violation(
            "options", f"options_model accepted the unknown key {_UNKNOWN_OPTION!r}: unknown keys are errors",
        ))


def _check_commands(engine: Engine, specs: Sequence[BackendSpec], out: list[Violation]) -> None:
    cpu_ok = _runs_on_cpu(engine)
    firsts: list[tuple[BackendSpec, LaunchCommand]] = []
    for spec in specs:
        if not spec.gpus and not cpu_ok:
            try:
                engine.build_command(spec)
            except EngineError:
                continue
            except Exception as exc:  # noqa: BLE001
                out.append(Violation(
                    "command.shape", f"CPU spec on an engine without RunsOnCPU raised {_exc(exc)}, not an EngineError",
                ))
                continue
            out.append(Violation(
                "command.cpu",
                "the engine does not implement RunsOnCPU but built a command for a CPU spec: raise "
                "EngineOptionsError",
            ))
            continue
        cmd = _check_command(engine, spec, out)
        if cmd is not None:
            firsts.append((spec, cmd))
    # Purity: every spec again, in reverse order (after the others ran), then on a fresh instance.
    try:
        fresh = type(engine)()
    except Exception as exc:  # noqa: BLE001
        out.append(Violation(
            "command.pure",
            f"{type(engine).__name__}() must construct with no arguments (the registry does): {_exc(exc)}",
        ))
        fresh = None
    for spec, first in reversed(firsts):
        for who, eng in (("again", engine), ("on a fresh instance", fresh)):
            if eng is None:
                continue
            try:
                again = eng.build_command(spec)
            except Exception as exc:  # noqa: BLE001
                out.append(Violation("command.pure", f"build_command {who} raised {_exc(exc)}"))
                continue
            if again != first:
                out.append(Violation(
                    "command.pure",
                    f"build_command is not deterministic ({who}): {list(first.argv)} then {list(again.argv)}"
                    + ("" if dict(first.env) == dict(again.env) else f", env {dict(first.env)} then {dict(again.env)}"),
                ))


async def run_conformance(
    engine: Engine,
    replays: EngineReplays,
    *,
    specs: Iterable[BackendSpec] | None = None,
    load_spec: BackendSpec | None = None,
    check_registered: bool = False,
    timeout_s: float = 0.5,
    grace_s: float = 5.0,
) -> list[Violation]:
    """Check ``engine`` against every rule; return the violations (empty when it conforms).

    specs: the spec shapes to build commands for (default ``default_spec_shapes(engine)``;
    give your own when the default options do not suit the engine). load_spec: the spec
    ``read_load`` is called with (default: the first GPU shape). check_registered: also
    require the registry to hold this class under ``engine.name``. timeout_s: the
    ``aiohttp.ClientTimeout(total=...)`` of the session the kit passes for the hanging-server
    checks; each such call must end, raising EngineUnavailable, within it plus ``grace_s``
    (and every other call within 10 s plus ``grace_s``).
    """
    out: list[Violation] = []
    before = _snapshot(engine)
    _check_metadata(engine, check_registered, out)
    _check_options(engine, out)
    if specs is not None:
        shapes = list(specs)
    else:
        try:
            shapes = default_spec_shapes(engine)
        except Exception as exc:  # noqa: BLE001
            shapes = []
            out.append(Violation(
                "command.shape", f"command checks skipped: no default spec shapes ({_exc(exc)}); pass specs=",
            ))
    _check_commands(engine, shapes, out)
    _check_capabilities(engine, shapes, out)
    check_gang(engine, shapes, lambda check, message: out.append(Violation(check, message)))

    spec = load_spec or next((s for s in shapes if s.gpus), shapes[0] if shapes else None)
    if spec is not None:
        await _check_http(engine, replays, spec, timeout_s, grace_s, out)
    if replays.embeddings is not None:
        async with AsyncExitStack() as stack:
            base = await _Servers(stack).replay({"/v1/embeddings": replays.embeddings})
            http = await stack.enter_async_context(aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10.0)))
            found = await check_embeddings(http, base, _MODEL)
            out += [replace(v, message=f"embeddings replay: {v.message}") for v in found]

    changes = _state_changes(before, _snapshot(engine))
    if changes:
        out.append(Violation(
            "state",
            "the adapter kept per-backend state across calls (everything must arrive as arguments): "
            + ", ".join(changes),
        ))
    return out


async def _check_http(
    engine: Engine, replays: EngineReplays, spec: BackendSpec, timeout_s: float, grace_s: float, out: list[Violation]
) -> None:
    normal_timeout_s = 10.0
    async with AsyncExitStack() as stack:
        servers = _Servers(stack)
        http = await stack.enter_async_context(
            aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=normal_timeout_s))
        )
        short = await stack.enter_async_context(aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout_s)))

        async def probe(where: str, base: str, session: aiohttp.ClientSession = http) -> tuple[str, object]:
            deadline = (timeout_s if session is short else normal_timeout_s) + grace_s
            return await _call("probe.transport", where, lambda: engine.probe(session, base), deadline, out)

        async def load(where: str, base: str, session: aiohttp.ClientSession = http) -> tuple[str, object]:
            deadline = (timeout_s if session is short else normal_timeout_s) + grace_s
            return await _call("load.transport", where, lambda: engine.read_load(session, spec, base), deadline, out)

        # Rule 2: ready and busy are ready; loading is an answer, not ready, with a phase.
        for state, rs in (("ready", replays.ready), ("busy", replays.busy)):
            kind, value = await probe(f"probe({state} replay)", await servers.replay(rs))
            if kind == "raised":
                out.append(Violation(
                    "probe.ready", f"probe({state} replay) raised {_exc(value)}; a {state} backend answered",
                ))
            elif kind == "ok" and _check_probe_shape(value, f"probe({state} replay)", out) and not value.ready:
                out.append(Violation(
                    "probe.ready", f"probe({state} replay) is not ready ({value}); a {state} backend serves",
                ))
        if replays.loading is not None:
            base = await servers.replay(replays.loading)
            kind, value = await probe("probe(loading replay)", base)
            if kind == "raised":
                out.append(Violation(
                    "probe.loading",
                    f"probe(loading replay) raised {_exc(value)}: an engine that answers 'loading' is "
                    "a successful probe",
                ))
            elif kind == "ok" and _check_probe_shape(value, "probe(loading replay)", out):
                if value.ready:
                    out.append(Violation(
                        "probe.loading",
                        f"probe(loading replay) says ready ({value}): a loading engine is not ready, "
                        "whatever the status code",
                    ))
                elif not value.phase:
                    out.append(Violation(
                        "probe.loading",
                        f"probe(loading replay) names no phase ({value}): report what the engine says "
                        "it is doing",
                    ))
            kind, value = await load("read_load(loading replay)", base)
            if kind == "ok":
                _check_load_shape(value, "read_load(loading replay)", out)
            elif kind == "raised" and not isinstance(value, (LoadUnknown, EngineUnavailable)):
                out.append(Violation(
                    "load.unknown", f"read_load(loading replay) raised {_exc(value)}, not LoadUnknown",
                ))

        # Rule 3: busy reads as busy; ready reads as a valid Load (or honestly unknown).
        kind, value = await load("read_load(busy replay)", await servers.replay(replays.busy))
        if kind == "raised":
            out.append(Violation("load.busy", f"read_load(busy replay) raised {_exc(value)}"))
        elif kind == "ok" and _check_load_shape(value, "read_load(busy replay)", out):
            if value.busy < 1:
                out.append(Violation(
                    "load.busy", f"read_load(busy replay) reads busy={value.busy}; the backend was running a sequence",
                ))
        kind, value = await load("read_load(ready replay)", await servers.replay(replays.ready))
        if kind == "ok":
            _check_load_shape(value, "read_load(ready replay)", out)
        elif kind == "raised" and not isinstance(value, LoadUnknown):
            out.append(Violation("load.shape", f"read_load(ready replay) raised {_exc(value)}"))

        unknowns = [(f"captured load-unknown replay #{i}", rs) for i, rs in enumerate(replays.load_unknown)]
        unknowns += [(f"kit garbage: {label}", rs) for label, rs in _GARBAGE.items()]
        for label, rs in unknowns:
            base = await servers.replay(rs)
            kind, value = await load(f"read_load({label})", base)
            if kind == "ok":
                out.append(Violation(
                    "load.unknown",
                    f"read_load({label}) returned {value}: unknown load must raise LoadUnknown, never "
                    "a guess",
                ))
            elif kind == "raised" and not isinstance(value, LoadUnknown):
                out.append(Violation(
                    "load.unknown", f"read_load({label}) raised {_exc(value)}, not LoadUnknown (the backend answered)",
                ))
            if label.startswith("kit garbage"):
                kind, value = await probe(f"probe({label})", base)
                if kind == "raised":
                    out.append(Violation(
                        "probe.answer",
                        f"probe({label}) raised {_exc(value)}: an HTTP answer is not a transport failure",
                    ))
                elif kind == "ok":
                    _check_probe_shape(value, f"probe({label})", out)

        # Transport failures: refused, reset, non-HTTP bytes, a server that never answers.
        failures = [
            ("refused port", servers.refused(), http),
            ("connection reset", await servers.raw("reset"), http),
            ("non-HTTP bytes", await servers.raw("garbage"), http),
            ("hanging server", await servers.raw("hang"), short),
        ]
        calls = [
            (label, check, call(f"{check.split('.')[0]}({label})", base, session))
            for label, base, session in failures
            for check, call in (("probe.transport", probe), ("load.transport", load))
        ]
        # Concurrently: the hanging-server pair then costs one timeout, not two.
        results = await asyncio.gather(*(c for _, _, c in calls))
        for (label, check, _), (kind, value) in zip(calls, results, strict=True):
            if kind == "ok":
                out.append(Violation(check, f"{label}: returned {value} instead of raising EngineUnavailable"))
            elif kind == "raised" and not isinstance(value, EngineUnavailable):
                out.append(Violation(check, f"{label}: raised {_exc(value)}, not EngineUnavailable"))


class _RunOptions(TypedDict, total=False):
    """The keyword arguments of ``run_conformance``, for ``assert_conforms`` to pass on."""

    specs: Iterable[BackendSpec] | None
    load_spec: BackendSpec | None
    check_registered: bool
    timeout_s: float
    grace_s: float


async def assert_conforms(engine: Engine, replays: EngineReplays, **kwargs: Unpack[_RunOptions]) -> None:
    """``run_conformance`` that raises ConformanceError listing every violation."""
    violations = await run_conformance(engine, replays, **kwargs)
    if violations:
        raise ConformanceError(getattr(engine, "name", type(engine).__name__), violations)
