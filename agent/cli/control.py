"""viiworkctl reload | drain | undrain | down MODEL | up MODEL | models: the admin socket.

One parser per command of ``viiwork.agent.control.COMMANDS``; each talks HTTP over the
agent's Unix admin socket (``--socket``, else ``api.admin_socket`` of ``--config``).
"""

from __future__ import annotations

import argparse
import http.client
import json
import socket
import sys
from pathlib import Path
from typing import Any
from urllib.parse import urlencode

from rich.console import Console
from rich.table import Table

from viiwork.agent.cli.tables import cell, table_console
from viiwork.agent.cli.target import load_target_config
from viiwork.agent.config.load import DEFAULT_CONFIG_PATH, ConfigError
from viiwork.agent.config.schema import ApiConfig
from viiwork.agent.control import COMMANDS, ControlCommand


class _UnixConnection(http.client.HTTPConnection):
    def __init__(self, path: str, timeout: float) -> None:
        super().__init__("localhost", timeout=timeout)
        self.unix_path = path

    def connect(self) -> None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(self.timeout)
        sock.connect(self.unix_path)
        self.sock = sock


def register(subparsers: argparse._SubParsersAction) -> None:
    for command in COMMANDS:
        if command.parent is not None:  # offered by another command (keys, usage)
            continue
        parser = subparsers.add_parser(command.name, help=command.help, description=command.help[0].upper()
                                       + command.help[1:] + ".")
        if command.takes_model:
            parser.add_argument("model", metavar="MODEL")
        add_socket_args(parser, _timeout_help(command.name))
        parser.add_argument("--json", action="store_true", help="print the agent's JSON answer")
        parser.set_defaults(func=lambda args, c=command: run(c, args))


def _timeout_help(name: str) -> str:
    if name in ("drain", "down"):
        return f"seconds to wait for the answer; {name} answers once the requests in flight are done (default 120)"
    return "seconds to wait for the agent's answer (default 120)"


def socket_path(args: argparse.Namespace) -> Path:
    """``--socket``, else the target agent's api.admin_socket (agent/cli/target.py), else the
    default. Raises ConfigError for an unreadable ``--config``, TargetAmbiguous."""
    if args.socket:
        return args.socket
    config = load_target_config(args)
    return config.api.admin_socket if config is not None else ApiConfig().admin_socket


def call(path: Path, command: ControlCommand, model: str | None, timeout: float, *, body: bytes | None = None,
         query: dict[str, str] | None = None) -> tuple[int, dict[str, Any]]:
    """Send one command (``body``: its argument when it takes one; ``query``: its parameters);
    returns (HTTP status, decoded JSON). Raises OSError if unreachable, ValueError for an answer
    that is not JSON."""
    conn = _UnixConnection(str(path), timeout)
    try:
        url = command.url_path(model) + (("?" + urlencode(query)) if query else "")
        conn.request(command.method, url, body=body,
                     headers={"Content-Type": "application/octet-stream"} if body is not None else {})
        resp = conn.getresponse()
        return resp.status, json.loads(resp.read() or b"{}")
    finally:
        conn.close()


def send(command: ControlCommand, args: argparse.Namespace, *, model: str | None = None, body: bytes | None = None,
         query: dict[str, str] | None = None) -> tuple[int, dict[str, Any]] | None:
    """``call`` on the target agent's admin socket (``socket_path``); None when it failed (one
    line on stderr already says why and what to do)."""
    name = " ".join(w for w in (command.parent, command.name) if w)
    try:
        path = socket_path(args)
    except ConfigError as exc:
        print(str(exc), file=sys.stderr)
        return None
    try:
        return call(path, command, model, args.timeout, body=body, query=query)
    except PermissionError:
        print(f"viiworkctl {name}: permission denied on {path}: run as root or as a member of "
              "the viiwork-admin group", file=sys.stderr)
    except (OSError, ValueError) as exc:
        print(f"viiworkctl {name}: cannot reach the agent's admin socket {path}: {exc} "
              "(is viiwork-agent running? use --socket or --config)", file=sys.stderr)
    return None


def add_socket_args(parser: argparse.ArgumentParser, timeout_help: str) -> None:
    """``--socket``, ``--config`` and ``--timeout``: how a command finds and waits for the agent."""
    parser.add_argument("--socket", type=Path, help="admin socket (default: api.admin_socket of the config)")
    parser.add_argument("--config", type=Path, help=f"agent config (default {DEFAULT_CONFIG_PATH}, or a running demo's)")
    parser.add_argument("--timeout", type=float, default=120.0, help=timeout_help)


def run(command: ControlCommand, args: argparse.Namespace) -> int:
    sent = send(command, args, model=getattr(args, "model", None))
    if sent is None:
        return 1
    status, doc = sent
    if args.json:
        print(json.dumps(doc, indent=2))
    elif status >= 400:
        print(f"viiworkctl {command.name}: {doc.get('error', {}).get('message', doc)}", file=sys.stderr)
    elif command.name == "models":
        print_models(doc, table_console())
    else:
        print(_summary(command.name, doc))
    return 0 if status < 400 else 1


def print_models(doc: dict[str, Any], console: Console) -> None:
    """The admin socket's models document as a table: model, engine, state, and each backend
    with its state; "no models configured" when it lists none."""
    models = doc.get("models") or []
    if not models:
        console.print("no models configured")
        return
    table = Table(show_header=True, header_style="bold", box=None, pad_edge=False)
    for col in ("model", "engine", "state"):
        table.add_column(col, no_wrap=True)
    table.add_column("backends", overflow="fold")
    for m in models:
        backends = ", ".join(f"{b.get('id', '?')} {b.get('state', '?')}" for b in m.get("backends") or []) or "-"
        table.add_row(*(cell(v) for v in (m.get("name", "?"), m.get("engine", ""), m.get("state", ""), backends)))
    console.print(table)


def _summary(name: str, doc: dict[str, Any]) -> str:
    if name == "reload":
        parts = [f"{k}: {', '.join(doc.get(k) or []) or '-'}" for k in ("added", "changed", "removed", "unchanged")]
        text = "reloaded; " + "; ".join(parts)
        restart = doc.get("restart_needed") or []
        if restart:  # reload applies [[models]] (and health) only
            text += (f"\nnot applied: changes to [{'], ['.join(restart)}] take effect at the next agent restart "
                     "(systemctl restart viiwork)")
        return text
    return doc.get("message") or f"{name}: done"
