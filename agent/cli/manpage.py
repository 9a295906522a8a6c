"""Man pages (roff, man(7) macros) generated from the argparse definitions.

``python -m viiwork.agent.cli.manpage --out DIR`` writes ``DIR/viiworkctl.1`` and
``DIR/viiwork-agent.1``; debian/rules runs it at package build time, so the pages always list
the options the programs have. Each page has NAME, SYNOPSIS, DESCRIPTION, OPTIONS, then one
COMMANDS subsection per sub-command (nested ones such as ``mesh ca init`` included), with
that command's description and options, and SEE ALSO.
"""

from __future__ import annotations

import argparse
import datetime as dt
import os
import sys
from collections.abc import Iterator
from pathlib import Path

from viiwork import __version__

SOURCE = f"viiwork {__version__}"
MANUAL = "viiwork manual"


def roff_text(text: str) -> str:
    """``text`` safe in roff: backslashes doubled, hyphens as minus signs where options use
    them, and a line that would start with ``.`` or ``'`` (a request) escaped."""
    out = text.replace("\\", "\\e").replace("-", "\\-")
    lines = []
    for line in out.splitlines():
        lines.append("\\&" + line if line.startswith((".", "'")) else line)
    return "\n".join(lines)


def _subparsers(parser: argparse.ArgumentParser) -> Iterator[tuple[str, str, argparse.ArgumentParser]]:
    """(name, one-line help, parser) of each direct sub-command, in definition order."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            helps = {a.dest: a.help or "" for a in action._choices_actions}
            for name, sub in action.choices.items():
                yield name, helps.get(name, ""), sub


def commands(parser: argparse.ArgumentParser, prefix: str = "") -> Iterator[tuple[str, str, argparse.ArgumentParser]]:
    """Every sub-command, depth first: ("mesh ca init", help, parser)."""
    for name, help_text, sub in _subparsers(parser):
        full = f"{prefix}{name}"
        yield full, help_text, sub
        yield from commands(sub, full + " ")


def _option_items(parser: argparse.ArgumentParser) -> Iterator[str]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction) or action.help == argparse.SUPPRESS:
            continue
        if action.option_strings:
            metavar = ""
            if action.nargs != 0:
                shown = action.metavar or (action.dest.upper() if not action.choices
                                           else "{" + ",".join(map(str, action.choices)) + "}")
                metavar = " " + (shown if isinstance(shown, str) else " ".join(shown))
            head = ", ".join(f"\\fB{roff_text(o)}\\fR" for o in action.option_strings)
            if metavar:
                head += f"\\fI{roff_text(metavar)}\\fR"
        else:
            head = f"\\fI{roff_text(str(action.metavar or action.dest))}\\fR"
        help_text = (action.help or "").replace("%(default)s", str(action.default)).replace("%%", "%")
        yield f".TP\n{head}\n{roff_text(help_text)}"


USAGE_PREFIX = "usage: "


def _usage(parser: argparse.ArgumentParser) -> str:
    """argparse's usage without its ``usage: `` prefix, the continuation lines moved left by
    as much (argparse aligns them under the program name, after the prefix)."""
    first, *rest = parser.format_usage().strip().splitlines()
    indent = " " * len(USAGE_PREFIX)
    return "\n".join([first.removeprefix(USAGE_PREFIX)] + [line.removeprefix(indent) for line in rest])


def render_manpage(parser: argparse.ArgumentParser, *, summary: str, date: dt.date, see_also: list[str]) -> str:
    """The man page of ``parser`` (section 1) as roff text."""
    prog = parser.prog
    parts = [
        f'.TH {prog.upper()} 1 "{date.isoformat()}" "{SOURCE}" "{MANUAL}"',
        ".SH NAME", f"{roff_text(prog)} \\- {roff_text(summary)}",
        ".SH SYNOPSIS", ".nf", roff_text(_usage(parser)), ".fi",
        ".SH DESCRIPTION", roff_text(parser.description or summary),
        ".SH OPTIONS", *_option_items(parser),
    ]
    subs = list(commands(parser))
    if subs:
        parts.append(".SH COMMANDS")
        for name, help_text, sub in subs:
            parts += [f".SS {roff_text(name)}", ".nf", roff_text(_usage(sub)), ".fi"]
            if sub.description or help_text:
                parts += [".PP", roff_text(sub.description or help_text)]
            parts += list(_option_items(sub))
    if see_also:
        parts += [".SH SEE ALSO", ", ".join(f"\\fB{roff_text(s.split('(')[0])}\\fR({s.split('(')[1]}" for s in see_also)]
    return "\n".join(parts) + "\n"


def _date() -> dt.date:
    # SOURCE_DATE_EPOCH: the same page from the same source, whenever it is built.
    epoch = os.environ.get("SOURCE_DATE_EPOCH")
    return dt.datetime.fromtimestamp(int(epoch), dt.UTC).date() if epoch and epoch.isdigit() else dt.date.today()


def write_pages(out: Path) -> list[Path]:
    """Write viiworkctl.1 and viiwork-agent.1 into ``out`` (created); returns their paths."""
    from viiwork.agent.cli import build_parser as ctl_parser
    from viiwork.agent.main import build_parser as agent_parser

    out.mkdir(parents=True, exist_ok=True)
    os.environ["COLUMNS"] = "78"  # argparse wraps usage lines at the terminal's width: not the builder's
    pages = {
        "viiworkctl": render_manpage(ctl_parser(), summary="inspect and control the viiwork agent and its mesh",
                                     date=_date(), see_also=["viiwork-agent(1)"]),
        "viiwork-agent": render_manpage(agent_parser(), summary="the viiwork host agent for GPU inference",
                                        date=_date(), see_also=["viiworkctl(1)", "systemctl(1)"]),
    }
    written = []
    for name, text in pages.items():
        path = out / f"{name}.1"
        path.write_text(text, encoding="utf-8")
        written.append(path)
    return written


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m viiwork.agent.cli.manpage",
                                     description="Write the man pages of viiworkctl and viiwork-agent.")
    parser.add_argument("--out", type=Path, required=True, metavar="DIR", help="directory for the .1 files")
    args = parser.parse_args(argv)
    try:
        for path in write_pages(args.out):
            print(path)
    except OSError as exc:
        print(f"cannot write the man pages to {args.out}: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
