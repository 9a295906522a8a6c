"""How viiworkctl finds the agent: ``--url``, else $VIIWORK_URL, else the config's api.listen."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from viiwork.agent.config.load import DEFAULT_CONFIG_PATH, ConfigError, load_config
from viiwork.agent.config.schema import parse_hostport

DEFAULT_URL = "http://127.0.0.1:8086"


def add_target_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--url", help="agent API URL (default: $VIIWORK_URL, else from the config's api.listen)")
    parser.add_argument("--config", type=Path, default=None, help=f"agent config (default {DEFAULT_CONFIG_PATH})")


def agent_url(args: argparse.Namespace) -> str:
    """The agent's base URL, without a trailing slash."""
    if getattr(args, "url", None):
        return args.url.rstrip("/")
    if os.environ.get("VIIWORK_URL"):
        return os.environ["VIIWORK_URL"].rstrip("/")
    path = getattr(args, "config", None) or DEFAULT_CONFIG_PATH
    try:
        config = load_config(path)
    except ConfigError:
        return DEFAULT_URL
    host, port = parse_hostport(config.api.listen)
    if host in ("0.0.0.0", "::", ""):
        host = "127.0.0.1"
    if ":" in host:
        host = f"[{host}]"
    return f"http://{host}:{port}"
