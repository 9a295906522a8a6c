"""``viiworkctl``: one sub-command per module in this package.

Each command module defines ``register(subparsers)``, which adds its parser(s) and sets
``func`` (called with the parsed args, returns the exit code). The parser's help text is
the command's docstring. Add a module to ``COMMAND_MODULES`` to add a command.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from viiwork import __version__
from viiwork.agent.cli.target import TargetError

COMMAND_MODULES: tuple[str, ...] = (
    "viiwork.agent.cli.status",
    "viiwork.agent.cli.init",
    "viiwork.agent.cli.config_check",
    "viiwork.agent.cli.doctor",
    "viiwork.agent.cli.mesh",
    "viiwork.agent.cli.control",
    "viiwork.agent.cli.logs",
    "viiwork.agent.cli.keys",
    "viiwork.agent.cli.usage",
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="viiworkctl",
        description="Inspect and control the viiwork agent on this box and its mesh.",
    )
    parser.add_argument("--version", action="version", version=f"viiworkctl {__version__}")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in COMMAND_MODULES:
        importlib.import_module(name).register(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        return int(args.func(args) or 0)
    except TargetError as exc:
        print(f"viiworkctl {args.command}: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        return 0

