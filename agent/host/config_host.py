"""What ``viiworkctl config check`` asks of this host: the config's GPUs, model files, engine
binaries and listen ports.

The first three are the doctor's own checks (``config.gpus``, ``model.path``,
``engine.binary`` in viiwork.agent.host.doctor), run on facts gathered for the file; each
failed result becomes one ``ConfigIssue`` naming its field. Ports are checked here: each
listen address of the config (``api.listen``, ``mesh.listen``; port 0 means any free port
and is not checked) must be free to bind, unless the process holding it is this config's
own running agent: the one answering on the config's ``api.admin_socket``, identified by
the socket's peer credentials (SO_PEERCRED) and the listening sockets in its
``/proc/PID/fd`` (when that cannot be read, as another user, the ports in use are taken
as the agent's own).
"""

from __future__ import annotations

import errno
import os
import re
import socket
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from viiwork.agent.config.load import ConfigIssue
from viiwork.agent.config.schema import Config, parse_hostport
from viiwork.agent.config.toml_lines import line_of
from viiwork.agent.host.doctor import REGISTRY, Verdict, run_checks
from viiwork.agent.host.facts import gather_facts

# The doctor's checks that judge the config against the host, by id.
HOST_CHECKS = ("config.gpus", "model.path", "engine.binary")
_LINE_SUFFIX = re.compile(r" \(line \d+\)$")


def host_issues(path: str | Path, config: Config, text: str | None = None, *,
                other_agents: Sequence[tuple[str, Path]] = ()) -> list[ConfigIssue]:
    """Every problem of ``config`` (read from ``path``) on this host; empty when it can run here.
    ``other_agents``: (name in messages, admin socket) of other viiwork agents a port may be
    held by (see ``port_issues``)."""
    facts = gather_facts(path, url=None, read_versions=False)
    report = run_checks(facts, [c for c in REGISTRY if c.id in HOST_CHECKS], agent=False)
    issues = []
    for result in report.results:
        if result.verdict is not Verdict.FAIL:
            continue
        where = _subject_path(result.subject, result.check, config)
        line = line_of(text, where) if text and where else None
        summary = result.summary
        # config.gpus words its summary as a whole issue ("models[0].gpus: ... (line 7)").
        if result.subject and summary.startswith(f"{result.subject}: "):
            summary = _LINE_SUFFIX.sub("", summary[len(result.subject) + 2:])
        issues.append(ConfigIssue(where, f"{summary}; {result.consequence}", line))
    issues.extend(port_issues(config, text, other_agents=other_agents))
    return issues


def _subject_path(subject: str, check_id: str, config: Config) -> tuple[str | int, ...]:
    """The config path a doctor result is about: ``models[1].gpus`` from its subject, the
    engine binary's model for engine.binary (subject ``llamacpp: llama-server``)."""
    if subject.startswith("models["):
        index, _, rest = subject[len("models["):].partition("]")
        if index.isdigit():
            return ("models", int(index), *[p for p in rest.split(".") if p])
    if check_id == "engine.binary":
        engine, _, binary = subject.partition(":")
        binary = binary.strip()
        matches = [(i, m) for i, m in enumerate(config.models) if m.engine == engine]
        # The first model that names this binary (the subject's), else the engine's first.
        named = [(i, m) for i, m in matches if str(getattr(m.options, "binary", "")) == binary]
        for i, model in named or matches:
            fields = getattr(type(model.options), "model_fields", {})
            return ("models", i, engine, "binary") if "binary" in fields else ("models", i, "engine")
    return ()


@dataclass(frozen=True)
class Listener:
    """A listen address of the config: ``path`` names its key."""

    path: tuple[str, ...]
    host: str
    port: int


def listeners(config: Config) -> list[Listener]:
    """The config's listen addresses with a fixed port (port 0 binds any free port)."""
    out = []
    for path, value in ((("api", "listen"), config.api.listen),
                        (("mesh", "listen"), config.mesh.listen if config.mesh else None)):
        if value is None:
            continue
        host, port = parse_hostport(value)
        if port:
            out.append(Listener(path, host, port))
    return out


def port_issues(config: Config, text: str | None = None, *, proc: str | Path = "/proc",
                other_agents: Sequence[tuple[str, Path]] = ()) -> list[ConfigIssue]:
    """Each listen port of the config that another process holds, or that cannot be bound here.
    A port held by one of ``other_agents`` ((name, admin socket): a running viiwork agent, found
    as this config's own is) is named with that agent's name, admin socket and pid."""
    owner = agent_pid(config.api.admin_socket)
    # None: the agent's open files cannot be read (another user): its ports cannot be told
    # from another process's, and are taken as its own.
    held = listening_inodes(owner, proc) if owner is not None else set()
    issues = []
    for listener in listeners(config):
        problem = bind_problem(listener.host, listener.port)
        if problem is None:
            continue
        if problem == "in use" and (held is None or held & port_inodes(listener.port, proc)):
            continue  # this config's own agent holds it
        address = f"{listener.host}:{listener.port}"
        holder = _agent_holding(listener.port, other_agents, proc) if problem == "in use" else None
        if holder is not None:
            name, sock, pid = holder
            message = (f"port {listener.port} ({address}) is held by {name}, a running viiwork agent (admin socket "
                       f"{sock}, pid {pid}): stop it or set {'.'.join(listener.path)} to another port")
        elif problem == "in use":
            message = (f"port {listener.port} is in use on this host ({address}) by another process than "
                       "this config's agent (none answers on its admin socket "
                       f"{config.api.admin_socket})" if owner is None else
                       f"port {listener.port} is in use on this host ({address}) by another process than "
                       f"this config's agent (pid {owner})")
        else:
            message = f"cannot listen on {address}: {problem}"
        issues.append(ConfigIssue(listener.path, message, line_of(text, listener.path) if text else None))
    return issues


def _agent_holding(port: int, agents: Sequence[tuple[str, Path]],
                   proc: str | Path) -> tuple[str, Path, int] | None:
    """(name, admin socket, pid) of the first of ``agents`` that runs and listens on ``port``."""
    for name, sock in agents:
        pid = agent_pid(sock)
        held = listening_inodes(pid, proc) if pid is not None else None
        if pid is not None and held and held & port_inodes(port, proc):
            return name, sock, pid
    return None


def bind_problem(host: str, port: int) -> str | None:
    """None when ``host:port`` can be bound now (TCP, with SO_REUSEADDR like the agent);
    else "in use" or the reason."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        return f"cannot resolve {host!r}: {exc.strerror}"
    family, kind, proto, _, address = infos[0]
    with socket.socket(family, kind, proto) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(address)
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                return "in use"
            if exc.errno == errno.EADDRNOTAVAIL:
                return "the address is not one of this host's"
            return exc.strerror or str(exc)
    return None


def agent_pid(admin_socket: Path, timeout_s: float = 2.0) -> int | None:
    """The pid of the process serving ``admin_socket`` (SO_PEERCRED), or None when none answers."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(timeout_s)
        try:
            sock.connect(str(admin_socket))
            creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
        except OSError:
            return None
    pid, _, _ = struct.unpack("3i", creds)
    return pid or None


def listening_inodes(pid: int, proc: str | Path = "/proc") -> set[str] | None:
    """Socket inodes among ``pid``'s open files; None when they cannot be read."""
    fd_dir = Path(proc) / str(pid) / "fd"
    out: set[str] = set()
    try:
        entries = list(fd_dir.iterdir())
    except OSError:
        return None
    for entry in entries:
        try:
            target = os.readlink(entry)
        except OSError:
            continue
        if target.startswith("socket:["):
            out.add(target[len("socket:["):-1])
    return out


def port_inodes(port: int, proc: str | Path = "/proc") -> set[str]:
    """Inodes of the TCP sockets listening on ``port`` (IPv4 and IPv6), from /proc/net/tcp{,6}."""
    out: set[str] = set()
    for name in ("tcp", "tcp6"):
        try:
            rows = (Path(proc) / "net" / name).read_text().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            fields = row.split()
            if len(fields) > 9 and fields[3] == "0A" and int(fields[1].rpartition(":")[2], 16) == port:
                out.add(fields[9])
    return out
