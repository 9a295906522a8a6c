"""How viiworkctl finds the agent it talks to.

Explicit choices win: ``--url`` (else $VIIWORK_URL) for the HTTP API, ``--socket`` for the
admin socket, ``--config FILE`` for both. Without them, each local agent viiworkctl knows of
is a candidate:

- the system agent, when /etc/viiwork/viiwork.toml exists;
- a running demo of this user (``viiwork-agent --demo``), which writes its config into its
  state dir (agent/config/demo.py).

A candidate runs when its admin socket accepts a connection (or refuses us for permission:
someone listens there). One running candidate is the target; two are ambiguous, and the
command stops with one line naming both and the flag to choose; none: the system config
when it exists (its errors then say what is wrong), else the defaults (127.0.0.1:8086).

``add_target_args`` also adds ``--api-key`` (else $VIIWORK_API_KEY): the read key an agent with
client keys on asks for (agent/cli/agent_http.py).

``--config FILE`` names an agent, not only an address: a command that talks to the running
agent (``agent_url(args)``) stops with one line when nothing answers on that config's admin
socket, rather than show whichever agent holds its ``api.listen`` port.
"""

from __future__ import annotations

import argparse
import os
import socket
from dataclasses import dataclass
from pathlib import Path

from viiwork.agent.cli.agent_http import add_api_key_arg
from viiwork.agent.config.demo import DEMO_CONFIG_FILE, demo_admin_socket, demo_state_dir
from viiwork.agent.config.load import DEFAULT_CONFIG_PATH, ConfigError, load_config
from viiwork.agent.config.schema import ApiConfig, Config, parse_hostport

DEFAULT_URL = "http://127.0.0.1:8086"


class TargetError(Exception):
    """viiworkctl cannot tell which agent to talk to, or the one asked for does not run; the
    message says why and which flag chooses."""


class TargetAmbiguous(TargetError):
    """More than one local agent runs and no flag says which; the message lists them."""


class TargetNotRunning(TargetError):
    """``--config FILE`` was given, and no agent answers on that config's admin socket (or
    the file cannot be read)."""


@dataclass(frozen=True)
class Candidate:
    """A local agent viiworkctl may talk to: ``what`` names it in messages; ``config`` is its
    config file; ``admin_socket`` where it listens when it runs."""

    what: str
    config: Path
    admin_socket: Path


def add_target_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--url", help="agent API URL (default: $VIIWORK_URL, else the api.listen of the agent "
                                      "found: the system config's, or a running demo's)")
    parser.add_argument("--config", type=Path, default=None,
                        help=f"agent config (default {DEFAULT_CONFIG_PATH}, or a running demo's)")
    add_api_key_arg(parser)


def socket_answers(path: Path) -> bool:
    """Whether something listens on the Unix socket ``path`` (a permission refusal counts:
    the socket is live, we may not use it)."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(1.0)
        try:
            sock.connect(str(path))
        except PermissionError:
            return True
        except OSError:
            return False
    return True


def candidates() -> list[Candidate]:
    """The local agents viiworkctl knows of (running or not): the system agent when its
    config exists, and this user's demo when its state dir holds the demo's config file."""
    found = []
    if DEFAULT_CONFIG_PATH.exists():
        try:
            sock = load_config(DEFAULT_CONFIG_PATH).api.admin_socket
        except ConfigError:
            sock = ApiConfig().admin_socket
        found.append(Candidate(f"the system agent ({DEFAULT_CONFIG_PATH})", DEFAULT_CONFIG_PATH, sock))
    demo_file = demo_state_dir() / DEMO_CONFIG_FILE
    if demo_file.exists():
        found.append(Candidate(f"the demo ({demo_file})", demo_file, demo_admin_socket()))
    return found


def find_config(args: argparse.Namespace) -> tuple[Path, str]:
    """The config file of the agent to talk to, and how it was found, in words for a message:
    ``--config``, else the one running local agent (see the module docstring), else
    DEFAULT_CONFIG_PATH. Raises TargetAmbiguous."""
    explicit = getattr(args, "config", None)
    if explicit:
        return Path(explicit), "given with --config"
    known = candidates()
    running = [c for c in known if socket_answers(c.admin_socket)]
    if len(running) > 1:
        raise TargetAmbiguous("several agents run here: " + "; ".join(
            f"{c.what}, admin socket {c.admin_socket}" for c in running) + ": choose one with --config FILE")
    if running:
        name = running[0].what.partition(" (")[0].removeprefix("the ")
        return running[0].config, f"the running {name}'s config, found through its admin socket " \
            f"{running[0].admin_socket}"
    return DEFAULT_CONFIG_PATH, "the default: no local agent runs"


def config_path(args: argparse.Namespace) -> Path:
    """``find_config(args)``'s path. Raises TargetAmbiguous."""
    return find_config(args)[0]


def load_target_config(args: argparse.Namespace) -> Config | None:
    """The target's config (see ``config_path``), or None when it cannot be read and was not
    asked for with ``--config`` (then ConfigError is raised). Raises TargetAmbiguous."""
    path = config_path(args)
    try:
        return load_config(path)
    except ConfigError:
        if getattr(args, "config", None):
            raise
        return None


def agent_url(args: argparse.Namespace, *, require_running: bool = True) -> str:
    """The agent's base URL, without a trailing slash. With ``--config FILE`` (and no
    ``--url``/$VIIWORK_URL) and ``require_running``, the agent of FILE must answer on its
    admin socket. Raises TargetAmbiguous; TargetNotRunning (FILE unreadable, or its agent not
    running while ``require_running``)."""
    if getattr(args, "url", None):
        return args.url.rstrip("/")
    if os.environ.get("VIIWORK_URL"):
        return os.environ["VIIWORK_URL"].rstrip("/")
    try:
        config = load_target_config(args)
    except ConfigError as exc:
        if require_running:
            raise TargetNotRunning(f"cannot use --config {args.config}: {exc}") from None
        return DEFAULT_URL
    if config is None:
        return DEFAULT_URL
    if getattr(args, "config", None) and require_running and not socket_answers(config.api.admin_socket):
        raise TargetNotRunning(
            f"the agent of {args.config} does not run: nothing answers on its admin socket "
            f"{config.api.admin_socket} (so whatever may answer on its api.listen {config.api.listen} is "
            "another agent); start it, or choose another agent with --config or --url")
    host, port = parse_hostport(config.api.listen)
    if host in ("0.0.0.0", "::", ""):
        host = "127.0.0.1"
    if ":" in host:
        host = f"[{host}]"
    return f"http://{host}:{port}"
