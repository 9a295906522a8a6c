"""Engine binaries the config uses: where each is, whether it runs, and the version it reports."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path
from typing import Any

from viiwork.agent.config.schema import Config, ModelConfig
from viiwork.engines.contract import BackendSpec, Version
from viiwork.engines.registry import ENGINES

VERSION_TIMEOUT_S = 10.0


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


@dataclass(frozen=True, slots=True)
class GangFirewallFact:
    """The nftables rules this host's gang parts need (agent/gang/firewall.py).

    models: the gang entries (``hosts`` set, ``gang_firewall`` on) whose engine binds ports
    the rules confine (vLLM, SGLang); empty when none. nft: nft's path, or None when it is
    not installed."""

    models: tuple[str, ...]
    nft: str | None


def read_gang_firewall(config: Config, path: str | None = None) -> GangFirewallFact:
    """Which gang entries need rules, and where nft is (``path``: where to look, default
    the runners' own, ``NFT_PATH``)."""
    from viiwork.agent.gang.firewall import confines_ports
    from viiwork.agent.supervision.runners.nft import NFT_PATH
    from viiwork.engines.gang import GangEngine

    models: list[str] = []
    for model in config.models:
        engine = ENGINES.get(model.engine)
        if (model.hosts and model.gang_firewall and model.gang_port is not None and isinstance(engine, GangEngine)
                and confines_ports(engine, len(model.hosts), model.gang_port)):
            models.append(model.name)
    return GangFirewallFact(tuple(models), shutil.which("nft", path=path or NFT_PATH))


def own_node_id(config: Config) -> str | None:
    """This node's id when its key exists (the doctor never makes one); None otherwise."""
    from viiwork.mesh.identity import IdentityError, load_or_create_identity

    key = (config.mesh.node_key if config.mesh is not None else None) or Path(config.node.state_dir) / "node.key"
    if not Path(key).is_file():
        return None
    try:
        return str(load_or_create_identity(Path(config.node.state_dir), Path(key)).node_id)
    except (IdentityError, OSError):
        return None


def binaries_here(engine: Any, model: ModelConfig, node_name: str, node_id: str | None) -> list[tuple[str, str]]:
    """(option, binary) of what this host runs for ``model``: its serving command's, or for a
    gang (``hosts``) what its rank runs: the head the serving command, a worker its parts'
    (llama.cpp's ``rpc_binary``, vLLM's ``ray_binary``; engines/gang.py), a host the entry
    does not name nothing (a head named by id while this node's id is unknown: checked as the
    head). Raises what the engine raises for a command it cannot build."""
    from viiwork.agent.config.gang import GangConfigError, gang_rank
    from viiwork.engines.gang import GangAddresses, GangEngine, PartRole, roles_at
    from viiwork.mesh.identity import is_node_id

    spec = backend_spec_for(model)
    serving = [("binary", str(engine.build_command(spec).argv[0]))]
    if not model.hosts or not isinstance(engine, GangEngine):
        return serving
    try:
        rank = gang_rank(model, node_id, node_name)
    except GangConfigError:
        return []
    if rank is None:
        return serving if node_id is None and is_node_id(model.hosts[0]) else []
    if rank == 0:
        return serving
    size = len(model.hosts)
    addresses = GangAddresses("abcdefghijkl", rank, size, tuple("127.0.0.1" for _ in range(size)),
                              model.gang_port or 1024)
    options = {PartRole.WORKER: "rpc_binary", PartRole.RUNTIME: "ray_binary"}
    return [(options.get(role, "binary"), engine.gang_command(spec, role, addresses).argv[0])
            for role in roles_at(engine.launch_shape, rank)]


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
    groups: dict[tuple[str, str, str], list[tuple[int, ModelConfig]]] = {}
    unknown: list[BinaryFact] = []
    node_id = own_node_id(config)
    for i, model in enumerate(config.models):
        engine = engines[model.engine]
        try:
            for option, binary in binaries_here(engine, model, config.node.name, node_id):
                groups.setdefault((model.engine, binary, option), []).append((i, model))
        except Exception as exc:  # an engine that cannot build a command for this model
            unknown.append(BinaryFact(model.engine, engine.display_name, "?", (model.name,), BinaryState.UNKNOWN,
                                      f"the engine cannot build a command: {type(exc).__name__}: {exc}"))
    facts: list[BinaryFact] = []
    for (engine_name, binary, option), members in groups.items():
        engine = engines[engine_name]
        first_index, first = members[0]
        state, resolved, detail = resolve_binary(binary, path_env)
        option_path = None
        fields = getattr(type(first.options), "model_fields", {})
        if option in fields:
            option_path = f"models[{first_index}].{engine_name}.{option}"
        version = source = minimum = error = None
        if state is BinaryState.OK and read_versions and option == "binary":  # a gang part's: no version asked
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
