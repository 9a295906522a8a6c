"""viiworkctl doctor: check this box and say what is wrong, what it breaks, and how to fix it."""

from __future__ import annotations

import argparse
import json
import os
from dataclasses import replace

from rich.console import Console
from rich.table import Table
from rich.text import Text

from viiwork.agent.cli.agent_http import api_key
from viiwork.agent.cli.tables import table_console
from viiwork.agent.cli.target import add_target_args, agent_url, load_target_config, socket_answers
from viiwork.agent.cli.target import config_path as target_config_path
from viiwork.agent.config.load import ConfigError
from viiwork.agent.host.doctor import DoctorReport, Verdict, run_checks
from viiwork.agent.host.facts import gather_facts
from viiwork.agent.host.facts.agent import AgentFacts

_STYLE = {Verdict.OK: "green", Verdict.DEGRADED: "yellow", Verdict.FAIL: "bold red", Verdict.SKIPPED: "dim"}


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "doctor",
        help="check this box: GPUs, engines, disk, mesh trust, the running agent",
        description=(
            "Check this box and the agent on it. Each result has a verdict (ok, degraded, fail, "
            "skipped), a consequence and a remedy. Works with the agent stopped. "
            "Exit status: 0 all ok, 2 degraded, 1 any fail. The checks are listed in docs/doctor.md."
        ),
    )
    add_target_args(parser)
    parser.add_argument("--json", action="store_true", help="machine-readable results")
    parser.add_argument("--wide", action="store_true",
                        help="the subject in a column of its own, and no wrapping to the terminal's width")
    parser.set_defaults(func=run_doctor)


def run_doctor(args: argparse.Namespace) -> int:
    config_path = target_config_path(args)
    url = agent_url(args, require_running=False)
    stopped: AgentFacts | None = None
    if getattr(args, "config", None) and not (getattr(args, "url", None) or os.environ.get("VIIWORK_URL")):
        # --config X: only X's own agent is asked; another may answer on X's api.listen.
        try:
            config = load_target_config(args)
        except ConfigError:
            config = None
        if config is not None and not socket_answers(config.api.admin_socket):
            stopped = AgentFacts(url, False, None, f"the agent of {args.config} does not run: nothing answers "
                                                   f"on its admin socket {config.api.admin_socket}")
    facts = gather_facts(config_path, url=None if stopped else url, api_key=api_key(args))
    if stopped is not None:
        facts = replace(facts, agent=stopped)
    context = {"config": str(config_path), "url": url,
               "gpus": facts.gpus.to_json() if facts.gpus is not None else None}
    report = run_checks(facts, context=context)
    if args.json:
        print(json.dumps(report.to_json(), indent=2))
    else:
        print_report(report, table_console(wide=args.wide, highlight=False), wide=args.wide)
    return report.exit_code


def print_report(report: DoctorReport, console: Console, *, wide: bool = False) -> None:
    """A table of every result, then the consequence and remedy of each one not ok.

    The table has three columns (verdict, check, and "subject: summary"), whose last one wraps
    at word boundaries to fit the console; ``wide``: the subject in a column of its own."""
    table = Table(show_header=True, header_style="bold", box=None, pad_edge=False)
    table.add_column("verdict", no_wrap=True)
    table.add_column("check", no_wrap=True)
    if wide:
        table.add_column("subject", overflow="fold")
    table.add_column("summary" if wide else "subject: summary", overflow="fold")
    for r in report.results:
        verdict = Text(r.verdict.value, style=_STYLE[r.verdict])
        if wide:
            table.add_row(verdict, r.check, Text(r.subject), Text(r.summary))
        else:
            table.add_row(verdict, r.check, Text(f"{r.subject}: {r.summary}" if r.subject else r.summary))
    console.print(table)
    problems = [r for r in report.results if r.verdict in (Verdict.FAIL, Verdict.DEGRADED)]
    if problems:
        console.print()
    for r in problems:
        head = Text()
        head.append(r.verdict.value, style=_STYLE[r.verdict])
        head.append(f" {r.check}" + (f" ({r.subject})" if r.subject else "") + ": " + r.summary)
        console.print(head)
        console.print(Text(f"    consequence: {r.consequence}"))
        console.print(Text(f"    remedy: {r.remedy}"))
    counts = report.counts()
    tail = ", ".join(f"{counts[v.value]} {v.value}" for v in Verdict if counts[v.value])
    console.print(Text(f"\n{tail}; exit status {report.exit_code}"))

