"""The console viiworkctl's tables print to: 100 columns unless told otherwise, or unbounded
with ``--wide``.

Without ``--wide`` a table fits the terminal's width (rich reads ``$COLUMNS``, else the
terminal); into a pipe or a file, which has no width, 100 columns (rich would assume 80).
Every string that comes from an agent or a peer (names, states, reasons) is printed through
``cell`` or ``shown``: as text, never read as rich markup (``[/b]`` would raise, ``[link=...]``
make a hyperlink), and with control characters escaped (``\\x1b``), so a peer cannot restyle
or rewrite the operator's terminal.

Cells wrap at word boundaries; only a word longer than its column (a long path) is folded.
With ``--wide`` every column is shown and nothing is wrapped to a width: each row is as wide
as its cells, whatever the terminal (a wider row is the terminal's to wrap or scroll).
"""

from __future__ import annotations

import os
from typing import IO

from rich.console import Console
from rich.text import Text

from viiwork.agent.cli.quoting import printable

PIPE_WIDTH = 100
# rich wraps at the console's width; --wide asks for none, so a width no table reaches.
UNBOUNDED_WIDTH = 10_000


def table_console(*, wide: bool = False, highlight: bool = True, file: IO[str] | None = None) -> Console:
    """A Console for a command's table and lines: ``wide`` False, the terminal's width (or
    ``$COLUMNS``), else PIPE_WIDTH (100 columns) when the output is not a terminal; ``wide``
    True, UNBOUNDED_WIDTH. ``file``: where to print (default stdout)."""
    if wide:
        return Console(width=UNBOUNDED_WIDTH, highlight=highlight, file=file)
    console = Console(highlight=highlight, file=file)
    if not console.is_terminal and "COLUMNS" not in os.environ:
        console.width = PIPE_WIDTH
    return console


def shown(value: object) -> str:
    """``str(value)`` with every character that is not printable escaped (``\\x1b``: see
    agent/cli/quoting.py); still to be printed as text (``cell``), not as markup."""
    return printable(str(value))


def cell(value: object, style: str = "") -> Text:
    """A table cell or line part for a value from an agent or a peer: ``shown(value)`` as
    rich Text in ``style`` (no markup is read in it)."""
    return Text(shown(value), style=style)
