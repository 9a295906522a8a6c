"""viiworkctl status: the local agent's /v1/status as a table, or ``--json``."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from rich.console import Console
from rich.table import Table
from rich.text import Text

from viiwork.agent.cli.agent_http import api_key, fetch_json
from viiwork.agent.cli.tables import cell, shown, table_console
from viiwork.agent.cli.target import add_target_args, agent_url


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "status", help="models and backends of an agent (table, or --json)",
        description="Show an agent's models and backends: state, phase/progress while loading, slots busy/total.")
    add_target_args(parser)
    parser.add_argument("--json", action="store_true", help="print the agent's /v1/status document")
    parser.add_argument("--wide", action="store_true",
                    help="every column: engine, ctx/slot, pid, port; no wrapping to the terminal's width")
    parser.add_argument("--timeout", type=float, default=5.0, help="seconds to wait for the agent (default 5)")
    parser.set_defaults(func=run)


def _state_cell(backend: dict[str, Any]) -> Text:
    state = shown(backend.get("state", "?"))
    phase = backend.get("phase") or ""
    progress = backend.get("progress")
    if state == "starting" and phase:
        state += f" ({shown(phase)}"
        if isinstance(progress, (int, float)) and progress >= 0:
            state += f" {progress * 100:.0f}%"
        state += ")"
    if backend.get("reason") and state in ("dead", "unhealthy", "starting"):
        state += f": {shown(backend['reason'])}"
    text = Text(state)
    if backend.get("ejected"):
        text.append(" (ejected)", style="yellow")
    return text


def outlier_lines(section: Any) -> list[str]:
    """One line per backend or peer that is ejected or half-open, from /v1/status "outliers"
    (docs/routing.md, "Outlier ejection"); none when nothing is."""
    if not isinstance(section, dict):
        return []
    lines = []
    for t in section.get("targets") or []:
        if not isinstance(t, dict) or t.get("state") in (None, "ok"):
            continue
        what = (f"peer {t.get('node', '?')} for {t.get('model', '?')}" if t.get("kind") == "peer"
                else f"backend {t.get('backend', t.get('key', '?'))}")
        left = f", {t.get('ejected_remaining_s', 0):.1f} s left" if t.get("state") == "ejected" else ""
        lines.append(f"{what}: {t.get('state')}{left} (ejection {t.get('ejected_in_row', '?')} in a row): "
                     f"{t.get('reason', '')}")
    return lines


def gang_lines(section: Any) -> list[str]:
    """One line per gang this host heads and per gang part it runs, from /v1/status "gangs"
    (docs/mesh.md, "Gangs"); none when the config has no gang entry. Strings are escaped
    (``shown``): host names come from the config, gang ids from the head."""
    if not isinstance(section, dict):
        return []
    lines = []
    heads = section.get("heads")
    for model, head in sorted(heads.items()) if isinstance(heads, dict) else []:
        if not isinstance(head, dict):
            continue
        parts = [p for p in head.get("parts") or [] if isinstance(p, dict)]
        line = (f"{shown(model)}: head of gang {shown(head.get('gang') or 'none (not running)')}, parts: "
                + (", ".join(f"{shown(p.get('host', '?'))} rank {shown(p.get('rank', '?'))}" for p in parts) or "-")
                + f"; starts {shown(head.get('starts', 0))}, failures {shown(head.get('failures', 0))}, "
                  f"parts lost {shown(head.get('parts_lost', 0))}")
        if head.get("last_failure"):
            line += f"; last failure: {shown(head['last_failure'])}"
        lines.append(line)
    for part in section.get("parts") or []:
        if not isinstance(part, dict):
            continue
        size = f" of {shown(part['size'])}" if "size" in part else ""
        running = "running" if part.get("running") is True else "not running"
        pids = ", ".join(f"{shown(p.get('role', '?'))} pid {shown(p.get('pid', '?'))}"
                         for p in part.get("parts") or [] if isinstance(p, dict))
        gpus = part.get("gpus")
        lent = (f", GPUs {', '.join(shown(g) for g in gpus)}" if isinstance(gpus, list) and gpus
                else ", CPU" if isinstance(gpus, list) else "")
        lines.append(f"{shown(part.get('model', '?'))}: part of gang {shown(part.get('gang', '?'))}, "
                     f"rank {shown(part.get('rank', '?'))}{size}{lent}, {running}" + (f" ({pids})" if pids else ""))
    refused = section.get("refused")
    if isinstance(refused, dict) and refused:
        lines.append("requests refused: " + ", ".join(f"{shown(k)} {shown(v)}" for k, v in sorted(refused.items())))
    return lines


def render(doc: dict[str, Any], console: Console, *, wide: bool = False) -> None:
    """Print /v1/status: a node line, a table of models and backends (slots busy/total),
    then outlier lines and gang lines. ``wide``: every column."""
    node = doc.get("node", {})
    console.print(Text.assemble("node ", cell(node.get("name", "?"), "bold"),
                                f"  version {shown(node.get('version', '?'))}  uptime {shown(node.get('uptime_s', '?'))} s"))
    # The default columns fit 100 (and mostly 80) columns; --wide adds engine, ctx/slot, pid and
    # port. Cells wrap (overflow="fold") rather than end in "…".
    table = Table(show_lines=False)
    cols = ["model", "state", "backend", "backend state", "slots", "waiting", "respawns"]
    if wide:
        cols[1:1] = ["engine"]
        cols[-1:-1] = ["ctx/slot", "pid", "port"]
    for col in cols:
        table.add_column(col, overflow="fold")
    for model in doc.get("models", []):
        waiting = model.get("waiting")
        first = True
        backends = model.get("backends") or [{}]
        for b in backends:
            cells: dict[str, Any] = {
                "model": model.get("name", "?") if first else "",
                "engine": model.get("engine", "") if first else "",
                "state": model.get("state", "") if first else "",
                "backend": str(b.get("id", "")),
                "backend state": _state_cell(b) if b else "",
                "slots": f"{b.get('busy', '-')}/{b.get('slots', '-')}" if b else "",
                "waiting": ("unknown" if waiting is None else str(waiting)) if first else "",
                "ctx/slot": str(model.get("ctx_per_slot", "")) if first else "",
                "pid": str(b.get("pid") or "-"),
                "port": str(b.get("port") or ("socket" if b.get("socket") else "-")),
                "respawns": str(b.get("respawns", "")),
            }
            table.add_row(*(c if isinstance(c, Text) else cell(c) for c in (cells[c] for c in cols)))
            first = False
    console.print(table)
    for line in outlier_lines(doc.get("outliers")):
        console.print(Text.assemble(("outlier", "yellow"), " ", cell(line)))
    for line in gang_lines(doc.get("gangs")):
        console.print(Text.assemble(("gang", "cyan"), " ", Text(line)))


def run(args: argparse.Namespace) -> int:
    url = agent_url(args) + "/v1/status"
    try:
        doc = fetch_json(url, args.timeout, api_key(args))
    except ConnectionError as exc:
        print(f"viiworkctl status: {exc}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(doc, indent=2))
    else:
        render(doc, table_console(wide=args.wide), wide=args.wide)
    return 0
