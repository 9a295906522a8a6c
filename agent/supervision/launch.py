"""What a backend's launch is made of: its config hash, names, paths, address, spec and runner request.

Pure functions (but for a bind test and a warning): the backend's task
(agent/supervision/backend_task.py) writes the key files and starts the runner;
``viiworkctl logs`` (agent/cli/logs.py) finds a backend's log with ``backend_log_path``.
"""

from __future__ import annotations

import hashlib
import json
import logging
import socket
from collections.abc import Mapping
from pathlib import Path

from viiwork.agent.config.schema import Config, ModelConfig
from viiwork.agent.supervision.backends import Backend
from viiwork.agent.supervision.pinning import engine_environment
from viiwork.agent.supervision.runners.base import LaunchRequest
from viiwork.engines.contract import BackendSpec, Engine, LaunchCommand, binds_unix_socket, socket_path_problem
from viiwork.engines.registry import ENGINES

log = logging.getLogger("viiwork.agent.supervision.supervisor")


# Keys added after a release (issue 21's gangs): left out of the hash while at their default.
ADDED_ENTRY_KEYS: dict[str, object] = {"hosts": [], "gang_port": None, "gang_firewall": True}
ADDED_OPTION_KEYS = frozenset({"rpc_binary", "split_mode", "tensor_split", "tensor_parallel", "pipeline_parallel",
                               "ray_binary"})


def config_hash(model: ModelConfig) -> str:
    """sha256 (hex) of a model entry, normalised, plus its engine's name and command_version.

    Normalised: the entry as JSON with sorted keys, GPUs as strings, the engine's options
    with their defaults filled in. Two configs that launch the same command hash the same,
    and an adapter that changes its command (bumps ``command_version``) changes every hash,
    so an adopted backend is kept exactly when a fresh launch would run the same thing.
    Keys added to the config after a release (:data:`ADDED_ENTRY_KEYS`,
    :data:`ADDED_OPTION_KEYS`) count only when set away from their default, so an entry that
    does not use them hashes as before they existed and an upgrade adopts its engines
    (tests/unit/test_config_hash.py pins hashes of earlier releases).
    """
    data = model.model_dump(mode="json", exclude={"options"})
    data["gpus"] = [str(g) for g in model.gpus]
    options = model.options
    data["options"] = options.model_dump(mode="json") if options is not None else None
    for key, unset in ADDED_ENTRY_KEYS.items():
        if data.get(key) == unset:
            del data[key]
    if options is not None:
        fields = type(options).model_fields
        for key in ADDED_OPTION_KEYS & fields.keys():
            if getattr(options, key) == fields[key].get_default(call_default_factory=True):
                del data["options"][key]
    engine = ENGINES[model.engine]
    payload = {"model": data, "engine": engine.name, "command_version": engine.command_version}
    text = json.dumps(payload, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()


def escape_name(text: str) -> str:
    """``text`` safe for a file name or unit name: [A-Za-z0-9._-] kept, others as _xx hex."""
    out = []
    for ch in text:
        if ch.isascii() and (ch.isalnum() or ch in "._-"):
            out.append(ch)
        else:
            out.extend(f"_{b:02x}" for b in ch.encode())
    return "".join(out)


def backend_log_path(config: Config, model: str, index: int) -> Path:
    """Where the process runner writes backend ``index`` of ``model``'s output."""
    log_dir = config.supervisor.log_dir or (config.node.state_dir / "logs")
    return Path(log_dir) / f"{escape_name(model)}-{index}.log"


def backend_key_dir(engine_dir: Path, model: str, index: int) -> Path:
    """Backend ``index`` of ``model``'s private directory (its key file) under the engine dir:
    agent/supervision/engine_keys.py."""
    return engine_dir / f"{escape_name(model)}-{index}"


def backend_socket_path(engine: Engine, key_dir: Path, backend: Backend) -> str:
    """The backend's socket in its private directory ``key_dir``, or "" for an engine that
    binds a port only, or when the path would be too long (then a port, with a warning)."""
    if not binds_unix_socket(engine):
        return ""
    path = str(key_dir / "engine.sock")
    problem = socket_path_problem(path)
    if problem:
        log.warning("backend %s: no Unix socket (%s): listening on a loopback port, with its key",
                    backend.id, problem)
        return ""
    return path


def free_loopback_port(avoid: set[int] | frozenset[int] = frozenset()) -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (bind to port 0), not in ``avoid``."""
    return free_port_on("127.0.0.1", avoid)


def free_port_on(host: str, avoid: set[int] | frozenset[int] = frozenset()) -> int:
    """A TCP port on ``host`` (an address of this machine; "" or "0.0.0.0": every IPv4 one,
    "::" every IPv6 one) that was free a moment ago, not in ``avoid``. Raises OSError when
    ``host`` cannot be bound."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    for _ in range(64):
        with socket.socket(family, socket.SOCK_STREAM) as sock:
            sock.bind((host, 0))
            port = sock.getsockname()[1]
        if port not in avoid:
            return int(port)
    raise RuntimeError(f"no free port on {host or '0.0.0.0'} found in 64 tries")


def backend_spec(model: ModelConfig, backend: Backend, *, port: int, socket_path: str, key_dir: Path,
                 vendor: str, host_cpus: int) -> BackendSpec:
    """What the adapter builds ``backend``'s command from: ``port`` (0 with a socket),
    ``socket_path`` ("" for none), the key file in ``key_dir``. Raises ValueError on a
    field out of range (BackendSpec)."""
    return BackendSpec(
        model=model.name,
        kind=model.kind,
        path=model.path,
        port=port,
        ctx_per_slot=model.ctx_per_slot,
        parallel=model.parallel,
        options=model.options,
        gpus=backend.gpus,
        vendor=vendor,
        backends_on_node=model.backend_count,
        host_cpus=host_cpus,
        args=tuple(model.args),
        api_key_file=str(key_dir / "key"),
        socket_path=socket_path or None,
    )


def launch_request(config: Config, node_name: str, model: ModelConfig, backend: Backend, *, digest: str,
                   spec: BackendSpec, command: LaunchCommand, environ: Mapping[str, str], key_dir: Path,
                   env_file: str | None) -> LaunchRequest:
    """What the runner is asked to run for ``backend``: ``command`` in the engine environment
    built on ``environ`` (agent/supervision/pinning.py), labelled with the owner node, model,
    index, config hash ``digest``, port and socket (read back on adoption), with the model's
    limits, its private dir ``key_dir`` and its environment file ``env_file`` (None: none)."""
    env = engine_environment(environ, vendor=spec.vendor, gpus=spec.gpus, model_env=model.env,
                             engine_env=command.env)
    return LaunchRequest(
        name=f"viiwork-engine-{node_name}-{model.name}-{backend.index}",
        argv=command.argv,
        env=env,
        description=f"viiwork engine {model.engine} for {model.name} #{backend.index}",
        labels={
            "owner": node_name,
            "model": model.name,
            "index": str(backend.index),
            "config_hash": digest,
            "port": str(spec.port),
            "socket": spec.socket_path or "",
        },
        log_path=str(backend_log_path(config, model.name, backend.index)),
        stop_timeout_s=config.supervisor.stop_timeout_s,
        memory_max_bytes=model.memory_max_bytes,
        cpu_weight=model.cpu_weight,
        tasks_max=model.tasks_max,
        sandbox=model.sandbox,
        private_dir=str(key_dir),
        environment_file=env_file,
    )
