"""Prometheus' promtool, unpacked from Debian's `prometheus` package (docs/metrics.md)."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path


def promtool_cache() -> Path:
    """Where Debian's `prometheus` package is unpacked for promtool (docs/metrics.md): a user
    cache, so copies of the tree (tests/mutants/run.py) find it too."""
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "viiwork" / "prometheus"


def find_promtool() -> Path | None:
    """$VIIWORK_PROMTOOL, else promtool in :func:`promtool_cache`, else promtool on PATH;
    None when none exists."""
    env = os.environ.get("VIIWORK_PROMTOOL")
    if env:
        return Path(env) if Path(env).exists() else None
    cached = promtool_cache() / "usr" / "bin" / "promtool"
    if cached.exists():
        return cached
    found = shutil.which("promtool")
    return Path(found) if found else None


def check_metrics(promtool: Path, text: str) -> subprocess.CompletedProcess[str]:
    """`promtool check metrics` on ``text``: its exit status and what it printed."""
    return subprocess.run([str(promtool), "check", "metrics"], input=text, capture_output=True, text=True, timeout=60)
