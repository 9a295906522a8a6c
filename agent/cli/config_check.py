"""viiworkctl config check FILE: validate a config with the agent's own loader."""

from __future__ import annotations

import argparse
import json
import sys

from viiwork.agent.config.load import ConfigError, load_config


def register(subparsers: argparse._SubParsersAction) -> None:
    config = subparsers.add_parser("config", help="configuration tools")
    sub = config.add_subparsers(dest="config_command", metavar="SUBCOMMAND")
    check = sub.add_parser(
        "check",
        help="validate a config file (exit 1 with every error, 2 if it has no models, 0 with a one-line summary)",
        description=(
            "Validate FILE with the agent's own loader. Errors name the field path and line. "
            "A valid file with no [[models]] (an empty file too) gets a warning and exit 2: "
            "the agent accepts it but serves nothing."
        ),
    )
    check.add_argument("file")
    check.add_argument("--json", action="store_true", help="machine-readable result")
    check.set_defaults(func=run_check)
    config.set_defaults(func=lambda args: (config.print_help(), 2)[1])


NO_MODELS = "no [[models]] configured: the agent starts but serves nothing"


def run_check(args: argparse.Namespace) -> int:
    """Exit 0: valid, with models; 1: errors (each on stderr); 2: valid but no models."""
    try:
        cfg = load_config(args.file)
    except ConfigError as exc:
        if args.json:
            print(json.dumps({"ok": False, "file": args.file, "errors": [
                {"path": i.dotted, "line": i.line, "message": i.message} for i in exc.issues]}))
        else:
            print(str(exc), file=sys.stderr)
        return 1
    backends = sum(m.backend_count for m in cfg.models)
    summary = (
        f"{args.file}: ok: node {cfg.node.name!r}, {len(cfg.models)} model(s), {backends} backend(s), "
        f"api {cfg.api.listen}, {'mesh ' + cfg.mesh.trust if cfg.mesh else 'standalone'}"
    )
    warnings = [] if cfg.models else [NO_MODELS]
    if args.json:
        print(json.dumps({"ok": True, "file": args.file, "models": [m.name for m in cfg.models],
                          "backends": backends, "summary": summary, "warnings": warnings}))
    else:
        print(summary)
        for warning in warnings:
            print(f"{args.file}: warning: {warning}", file=sys.stderr)
    return 2 if warnings else 0
