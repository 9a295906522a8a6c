"""viiworkctl logs MODEL [--backend N] [-f]: an engine's output.

Under the systemd runner each backend is a unit, and its output is in the journal
(``journalctl -u UNIT``); under the process runner the agent writes it to
``<state_dir>/logs/<model>-<n>.log`` (or ``supervisor.log_dir``).
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import time
from pathlib import Path

from viiwork.agent.cli.agent_http import api_key, fetch_json
from viiwork.agent.cli.target import add_target_args, agent_url, find_config
from viiwork.agent.config.load import ConfigError, load_config
from viiwork.agent.supervision.launch import backend_log_path


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("logs", help="an engine's log (the unit's journal, or the process runner's file)",
                                   description="Show a backend's engine output: journalctl -u UNIT under the systemd "
                                   "runner, the log file under the process runner.")
    parser.add_argument("model", metavar="MODEL")
    parser.add_argument("--backend", type=int, default=0, metavar="N", help="backend index (default 0)")
    parser.add_argument("-f", "--follow", action="store_true", help="keep printing new lines")
    parser.add_argument("-n", "--lines", type=int, default=100, help="lines of history (default 100)")
    add_target_args(parser)
    parser.set_defaults(func=run)


def _unit_from_agent(args: argparse.Namespace) -> tuple[str | None, bool]:
    """(unit name or None, whether the agent answered)."""
    try:
        doc = fetch_json(agent_url(args, require_running=False) + "/v1/status", 3.0, api_key(args))
    except ConnectionError:
        return None, False
    for model in doc.get("models", []):
        if model.get("name") == args.model:
            for b in model.get("backends", []):
                if str(b.get("id", "")).endswith(f"-{args.backend}"):
                    return b.get("unit"), True
            raise LookupError(f"model {args.model!r} has no backend {args.backend}")
    known = ", ".join(m.get("name", "?") for m in doc.get("models", [])) or "none"
    raise LookupError(f"the agent serves no model {args.model!r}; known models: {known}")


def _tail(path: Path, lines: int, follow: bool) -> int:
    try:
        handle = open(path, "rb")
    except OSError as exc:
        print(f"viiworkctl logs: cannot read {path}: {exc.strerror}", file=sys.stderr)
        return 1
    with handle:
        data = handle.read()
        for line in data.splitlines()[-lines:]:
            sys.stdout.write(line.decode(errors="replace") + "\n")
        sys.stdout.flush()
        while follow:
            chunk = handle.read()
            if chunk:
                sys.stdout.write(chunk.decode(errors="replace"))
                sys.stdout.flush()
            else:
                time.sleep(0.25)
    return 0


def run(args: argparse.Namespace) -> int:
    try:
        unit, answered = _unit_from_agent(args)
    except LookupError as exc:
        print(f"viiworkctl logs: {exc}", file=sys.stderr)
        return 1
    if unit:
        journalctl = shutil.which("journalctl")
        if journalctl is None:
            print("viiworkctl logs: journalctl not found; the engine's output is in the journal of unit "
                  f"{unit}", file=sys.stderr)
            return 1
        argv = [journalctl, "-u", unit, "-n", str(args.lines), "--no-pager"] + (["-f"] if args.follow else [])
        os.execv(journalctl, argv)
    path, how = find_config(args)
    if not answered and not path.exists():
        print(f"viiworkctl logs: no agent runs here ({how}: {path} does not exist), so no log to show; "
              "start one, or point at it with --url URL or --config FILE", file=sys.stderr)
        return 1
    try:
        config = load_config(path)
    except ConfigError as exc:
        print(f"viiworkctl logs: {'the agent is not reachable and ' if not answered else ''}"
              f"the config cannot be read to find the log file:\n{exc}", file=sys.stderr)
        return 1
    return _tail(backend_log_path(config, args.model, args.backend), args.lines, args.follow)
