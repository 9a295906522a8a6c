"""viiworkctl usage [--since 1h] [--by tenant|model|node] [--mesh] [--json] [--db PATH]: the usage ledger.

Reads the usage file (``usage.path``, else ``<state_dir>/usage.sqlite3`` of the target's
config; ``--db`` names one) read-only, so it works while the agent writes it, and prints one
line per tenant, model or serving node: requests, errors, token sums and the median
duration. ``--mesh`` asks the running agent instead (its admin socket), which gathers every
live node's ledger over mutual TLS (agent/peering/mesh_usage.py), each row once. docs/usage.md.

Exit codes: 0 done, 1 the file cannot be read (or the agent not reached), 2 a usage error.
"""

from __future__ import annotations

import argparse
import json
import re
import sqlite3
import sys
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

from viiwork.agent.cli.control import send
from viiwork.agent.cli.tables import cell, shown
from viiwork.agent.cli.target import config_path
from viiwork.agent.config.load import ConfigError, load_config
from viiwork.agent.control import BY_NAME
from viiwork.agent.usage.query import Grouping, SummaryRow, summarise
from viiwork.agent.usage.store import SchemaNewer, open_read_only

SINCE = re.compile(r"([1-9][0-9]{0,6})([smhd])")
UNIT_S = {"s": 1, "m": 60, "h": 3600, "d": 86400}
MAX_SINCE_S = 3650 * 86400
TABLE_WIDTH = 100


def _since(text: str) -> int:
    """``--since``: a duration (90s, 30m, 1h, 7d; at most 3650d) or ``all``; returns seconds (0: all)."""
    if text == "all":
        return 0
    match = SINCE.fullmatch(text)
    if not match or int(match[1]) * UNIT_S[match[2]] > MAX_SINCE_S:
        raise argparse.ArgumentTypeError(f"{text!r} is not a duration like 30m, 1h, 7d (at most 3650d), or 'all'")
    return int(match[1]) * UNIT_S[match[2]]


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "usage", help="requests and tokens served by this node, by tenant, model or node (the usage ledger)",
        description="Summarise this node's usage ledger (docs/usage.md): requests, errors, token sums and the "
                    "median duration per tenant, model or serving node. Reads the file read-only; works while "
                    "the agent runs.")
    parser.add_argument("--since", type=_since, default=86400, metavar="DURATION",
                        help="rows finished within this long (30m, 1h, 7d) or 'all' (default 1d)")
    parser.add_argument("--by", choices=[g.value for g in Grouping], default="tenant",
                        help="group by (default tenant)")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    parser.add_argument("--db", type=Path, default=None, metavar="PATH",
                        help="the usage file (default: usage.path of the agent's config, else "
                             "<state_dir>/usage.sqlite3)")
    parser.add_argument("--config", type=Path, default=None, help="agent config to find the usage file in")
    parser.add_argument("--mesh", action="store_true",
                        help="every live node's ledger, gathered by the running agent over mutual TLS (each row "
                             "counted once; the median from 5%% duration buckets)")
    parser.add_argument("--socket", type=Path, help="with --mesh: the agent's admin socket (default: "
                                                     "api.admin_socket of the config)")
    parser.add_argument("--timeout", type=float, default=60.0, help="with --mesh: seconds to wait (default 60)")
    parser.set_defaults(func=run)


def _db_path(args: argparse.Namespace) -> Path:
    if args.db is not None:
        return Path(args.db)
    config = load_config(config_path(args))
    return config.usage.file(config.node.state_dir)


def _tokens(value: int | None) -> str:
    return "-" if value is None else f"{value:,}"


def _window(since_s: int) -> str:
    if since_s == 0:
        return "all time"
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if since_s % size == 0:
            return f"the last {since_s // size}{unit}"
    return f"the last {since_s}s"


def _print_table(rows: list[SummaryRow], by: Grouping, since_s: int) -> None:
    window = _window(since_s)
    if not rows:
        print(f"no requests recorded in {window}")
        return
    table = Table(box=None, pad_edge=False, title=None)
    table.add_column(by.value.upper(), overflow="fold", max_width=28)
    for column in ("REQUESTS", "ERRORS", "PROMPT", "COMPLETION", "CACHED", "P50 MS"):
        table.add_column(column, justify="right", no_wrap=True)
    for r in rows:
        # A key may come from a peer (--mesh): text, never markup, control characters escaped.
        table.add_row(cell(r.key or "(none)"), f"{r.requests:,}", f"{r.errors:,}", _tokens(r.prompt_tokens),
                      _tokens(r.completion_tokens), _tokens(r.cached_tokens), f"{r.p50_duration_ms:,.0f}")
    console = Console(width=TABLE_WIDTH, highlight=False, soft_wrap=False)
    console.print(table)
    print(f"{sum(r.requests for r in rows):,} request(s) in {window}")


def _run_mesh(args: argparse.Namespace, by: Grouping, since_ms: int) -> int:
    if args.db is not None:
        print("viiworkctl usage: --mesh asks the running agent; --db reads one file (choose one)", file=sys.stderr)
        return 2
    sent = send(BY_NAME["usage"], args, query={"since_ms": str(since_ms), "by": by.value})
    if sent is None:
        return 1
    status, doc = sent
    if status >= 400:
        print(f"viiworkctl usage: {doc.get('error', {}).get('message', doc)}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(doc, indent=2))
        return 0
    nodes: dict[str, str] = doc.get("nodes") or {}
    rows = [SummaryRow(**g) for g in doc.get("groups") or []]
    _print_table(rows, by, args.since)
    missing = {n: why for n, why in nodes.items() if why != "ok"}
    print(f"from {len(nodes) - len(missing)} node(s): {', '.join(sorted(shown(n) for n in nodes if n not in missing))}")
    for name, why in sorted(missing.items()):
        print(f"viiworkctl usage: incomplete: {shown(name)} did not answer ({shown(why)}); its rows are missing", file=sys.stderr)
    if doc.get("refused_groups"):
        print(f"viiworkctl usage: {shown(doc['refused_groups'])} group(s) from peers dropped: their name held a "
              "control character or was over 256 characters", file=sys.stderr)
    if doc.get("left_out"):
        print(f"viiworkctl usage: {doc['left_out']} group(s) left out (at most 2000 a node)", file=sys.stderr)
    return 0


def run(args: argparse.Namespace) -> int:
    by = Grouping(args.by)
    since_ms = 0 if args.since == 0 else int((time.time() - args.since) * 1000)
    if args.mesh:
        return _run_mesh(args, by, since_ms)
    try:
        path = _db_path(args)
    except ConfigError as exc:
        print(f"viiworkctl usage: cannot read the config to find the usage file (give --db PATH):\n{exc}",
              file=sys.stderr)
        return 1
    try:
        conn = open_read_only(path)
        try:
            rows = summarise(conn, since_ms, by)
        finally:
            conn.close()
    except (sqlite3.Error, SchemaNewer) as exc:
        print(f"viiworkctl usage: cannot read {path}: {exc}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps({"since_ms": since_ms, "by": by.value, "path": str(path),
                          "groups": [r.as_dict() for r in rows]}, indent=2))
        return 0
    _print_table(rows, by, args.since)
    return 0
