"""Engine binaries for tests: an executable wrapper around the fake llama-server.

A config names it as the llama.cpp binary (``[models.llamacpp] binary = "<path>"``), so the
real adapter's command line runs the fake engine (``support/fake_engine.py``).
"""

from __future__ import annotations

import shlex
import sys
from pathlib import Path

FAKE_ENGINE = Path(__file__).resolve().parent / "fake_engine.py"


def fake_engine_binary(directory: Path, name: str = "fake-llama-server") -> Path:
    """Write an executable ``directory/name`` that execs the fake engine with its arguments.

    Returns the script's path. ``exec`` keeps the engine's pid the script's pid, so signals
    and pids seen by the supervisor are the engine's own.
    """
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / name
    path.write_text(
        "#!/bin/sh\n"
        f"exec {shlex.quote(sys.executable)} {shlex.quote(str(FAKE_ENGINE))} \"$@\"\n"
    )
    path.chmod(0o755)
    return path
