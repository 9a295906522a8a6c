"""How a hint names one of viiwork's commands (viiworkctl, viiwork-agent), so that it runs when pasted.

In a clone the scripts are in ``.venv/bin``, which is not on PATH: a bare ``viiworkctl`` in a
hint would not run. ``command("viiworkctl")`` is the bare name when PATH finds the same file
as the one beside this interpreter (or the running script), else that file's full path.
"""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

from viiwork.agent.cli.quoting import quote_path


def _beside(name: str) -> Path | None:
    for folder in (Path(sys.executable).parent, Path(sys.argv[0]).parent if sys.argv and sys.argv[0] else None):
        if folder is not None and (folder / name).is_file():
            return (folder / name).absolute()
    return None


def command(name: str) -> str:
    """``name`` ("viiworkctl", "viiwork-agent") as a hint should print it: the bare name when
    ``shutil.which(name)`` is the same file as the script next to ``sys.executable`` (or
    ``sys.argv[0]``); else that script's path, shell-quoted; the bare name when neither exists
    (an installed package whose scripts are elsewhere on PATH)."""
    mine = _beside(name)
    if mine is None:
        return name
    found = shutil.which(name)
    if found is not None and os.path.realpath(found) == os.path.realpath(mine):
        return name
    return quote_path(mine)
