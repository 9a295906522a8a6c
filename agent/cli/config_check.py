"""viiworkctl config check [FILE] | config show [FILE]: validate a config, show it whole.

FILE may also be given as ``--config FILE``; without either, both take the config of the
agent the other commands talk to (agent/cli/target.py: the one running local agent, found
through its admin socket, else /etc/viiwork/viiwork.toml) and say on stderr which file that is.

``check`` runs the agent's own loader and, unless ``--offline``, asks this host what the
agent will need of it (viiwork.agent.host.config_host: GPUs, model files, engine binaries,
free ports). ``show`` prints the effective config, every default filled in, each value
marked as from the file or a default (viiwork.agent.config.effective).
"""

from __future__ import annotations

import argparse
import json
import sys
import tomllib
from pathlib import Path

from viiwork.agent.cli.quoting import quote_path
from viiwork.agent.cli.target import candidates, find_config
from viiwork.agent.config.effective import effective, render_toml, sources
from viiwork.agent.config.load import (
    DEFAULT_CONFIG_PATH,
    MAX_CONFIG_BYTES,
    ConfigError,
    ConfigIssue,
    parse_config,
    read_config_text,
)
from viiwork.agent.config.schema import Config
from viiwork.agent.host.doctor.registry import plural


def register(subparsers: argparse._SubParsersAction) -> None:
    config = subparsers.add_parser("config", help="configuration tools: check, show")
    sub = config.add_subparsers(dest="config_command", metavar="SUBCOMMAND")
    check = sub.add_parser(
        "check",
        help="validate a config file and this host for it (exit 1 with every error, 2 if it has no models)",
        description=(
            "Validate FILE with the agent's own loader, then check this host for it: the GPUs "
            "named exist, model files exist and are readable, engine binaries are found, listen "
            "ports are free (or held by this config's own running agent, found through its admin "
            "socket). Errors name the field path and line; every one is reported. "
            "--offline checks the file only (a config meant for another machine). "
            f"FILE must be a regular file of at most {MAX_CONFIG_BYTES // 2**20} MiB. "
            "A valid file with no [[models]] (an empty file too) gets a warning and exit 2: "
            "the agent accepts it but serves nothing. "
            "Keys deprecated by the mesh's detector are named in a warning too (exit status unchanged). "
            f"Without FILE: the running local agent's config (as `viiworkctl status` finds it), else {DEFAULT_CONFIG_PATH}."
        ),
    )
    _file_args(check)
    check.add_argument("--offline", action="store_true", help="check the file only, not this host")
    check.add_argument("--json", action="store_true", help="machine-readable result")
    check.set_defaults(func=run_check)
    show = sub.add_parser(
        "show",
        help="print the effective config, every default filled in, marking what came from the file",
        description=(
            "Print the config the agent would run: every key, defaults filled in, as TOML with a "
            "'# from file' or '# default' comment on each key (an unset key as a comment line), "
            "or with --json as {\"config\": ..., \"sources\": {\"api.listen\": \"file\", ...}}. "
            f"Without FILE: the running local agent's config (as `viiworkctl status` finds it), else {DEFAULT_CONFIG_PATH}."
        ),
    )
    _file_args(show)
    show.add_argument("--json", action="store_true", help="JSON with a parallel sources map")
    show.set_defaults(func=run_show)
    config.set_defaults(func=lambda args: (config.print_help(), 2)[1])


def _file_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("file", type=Path, nargs="?", metavar="FILE",
                        help="the config file (default: the running local agent's, else "
                             f"{DEFAULT_CONFIG_PATH})")
    parser.add_argument("--config", type=Path, default=None, metavar="FILE", help="the same as FILE")


def config_file(args: argparse.Namespace, command: str) -> Path | None:
    """FILE or ``--config FILE``, else the target agent's config (agent/cli/target.py), named
    on stderr with how it was found. None (after one error line) when FILE and --config name
    different files. Raises TargetAmbiguous."""
    if args.file and args.config and args.file != args.config:
        print(f"viiworkctl config {command}: FILE {args.file} and --config {args.config} differ: give one",
              file=sys.stderr)
        return None
    if args.file or args.config:
        return Path(args.file or args.config)
    path, how = find_config(args)
    print(f"viiworkctl config {command}: using {path} ({how})", file=sys.stderr)
    return path


NO_MODELS = "no [[models]] configured: the agent starts but serves nothing"


def _errors(file: Path, issues: list[ConfigIssue], as_json: bool) -> int:
    error = ConfigError(quote_path(file), issues)  # its issues in the file's line order
    if as_json:
        print(json.dumps({"ok": False, "file": str(file), "errors": [
            {"path": i.dotted, "line": i.line, "message": i.message} for i in error.issues]}))
    else:
        print(str(error), file=sys.stderr)
    return 1


def _load(file: Path) -> tuple[Config, str]:
    """The config and its text, read once (ConfigError as load_config gives it)."""
    text = read_config_text(file)
    return parse_config(text, str(file)), text


def run_check(args: argparse.Namespace) -> int:
    """Exit 0: valid, with models; 1: errors (each on stderr); 2: valid but no models, or
    FILE and --config differ."""
    file = config_file(args, "check")
    if file is None:
        return 2
    args.file = file
    try:
        cfg, text = _load(args.file)
    except ConfigError as exc:
        return _errors(args.file, exc.issues, args.json)
    if not args.offline:
        from viiwork.agent.host.config_host import host_issues

        others = [(c.what, c.admin_socket) for c in candidates() if c.config.resolve() != args.file.resolve()]
        issues = host_issues(args.file, cfg, text, other_agents=others)
        if issues:
            return _errors(args.file, issues, args.json)
    backends = sum(m.backend_count for m in cfg.models)
    summary = (
        f"{quote_path(args.file)}: ok{' (file only)' if args.offline else ''}: node {cfg.node.name!r}, "
        f"{plural(len(cfg.models), 'model')}, {plural(backends, 'backend')}, "
        f"api {cfg.api.listen}, {'mesh ' + cfg.mesh.trust if cfg.mesh else 'standalone'}"
    )
    warnings = [] if cfg.models else [NO_MODELS]
    # Keys that still load but no longer do what they did (the agent logs the same at start);
    # they do not change the exit status: the file is valid and serves.
    deprecations = cfg.mesh.deprecations() if cfg.mesh else []
    if args.json:
        print(json.dumps({"ok": True, "file": str(args.file), "host_checked": not args.offline,
                          "models": [m.name for m in cfg.models],
                          "backends": backends, "summary": summary, "warnings": warnings,
                          "deprecations": deprecations}))
    else:
        print(summary)
        for warning in warnings + deprecations:
            print(f"{quote_path(args.file)}: warning: {warning}", file=sys.stderr)
    return 2 if warnings else 0


def run_show(args: argparse.Namespace) -> int:
    """Exit 0 with the effective config on stdout; 1 with the file's errors on stderr; 2 when
    FILE and --config differ."""
    file = config_file(args, "show")
    if file is None:
        return 2
    args.config = file
    try:
        cfg, text = _load(args.config)
    except ConfigError as exc:
        return _errors(args.config, exc.issues, args.json)
    raw = tomllib.loads(text)
    data = effective(cfg)
    marks = sources(data, raw)
    if args.json:
        print(json.dumps({"file": str(args.config), "config": data, "sources": marks}, indent=2))
    else:
        print(f"# effective config of {quote_path(args.config)}: every key, defaults filled in")
        print(render_toml(data, marks), end="")
    return 0
