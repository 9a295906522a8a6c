"""viiworkctl's tables fit 100 columns, wrapping at word boundaries, and ``--wide`` is not cut
to a width; the docs' examples of them and of `config check` are what the commands print.

Rendering runs the commands' own render functions on documents; `config check` runs as a
process on files in a temporary state dir (no demo of this user is a candidate there).
"""

from __future__ import annotations

import io
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from rich.console import Console

from viiwork.agent.cli import mesh as mesh_cli
from viiwork.agent.cli.doctor import print_report
from viiwork.agent.cli.tables import PIPE_WIDTH, UNBOUNDED_WIDTH, table_console
from viiwork.agent.host.doctor import CheckResult, DoctorReport, Verdict

DOCS = Path(__file__).resolve().parents[2] / "docs"

GPU = {"index": 0, "name": "NVIDIA H100 80GB HBM3", "memory_total_mib": 81559, "memory_free_mib": 61440}
MODELS = [{"name": "llama-3-8b", "busy": 1, "slots": 4, "waiting": 0}]
# The document behind docs/mesh.md's `viiworkctl mesh` example.
MESH_DOC = {
    "self": {"name": "gpu-01", "id": "3ghn454fuwny6ciq", "mesh_id": "ak625idbqbigbnys", "trust": "ca",
             "state": "serving", "models": MODELS, "gpus": [GPU]},
    "nodes": [{"name": "gpu-02", "id": "nog2lle7uqx6krzp", "api": "10.0.0.2:8086", "liveness": "alive",
               "state": "serving", "age_ms": 400, "trust": "ca", "models": MODELS, "gpus": [GPU]}],
    "conflicts": [],
}


def _lines(text: str) -> list[str]:
    return [line.rstrip() for line in text.rstrip("\n").splitlines()]


def test_mesh_docs_example_is_the_command_at_100_columns() -> None:
    doc = (DOCS / "mesh.md").read_text(encoding="utf-8")
    start = doc.index("$ viiworkctl mesh\nthis node ") + len("$ viiworkctl mesh\n")
    shown = doc[start:doc.index("```", start)]
    out = io.StringIO()
    mesh_cli.render(MESH_DOC, Console(file=out, width=100, color_system=None))
    assert _lines(shown) == _lines(out.getvalue())
    assert max(len(line) for line in _lines(shown)) <= 100


def _report() -> DoctorReport:
    long_path = "/var/lib/viiwork/models/meta-llama/Llama-3.1-8B-Instruct-Q4_K_M.gguf"
    results = [
        CheckResult("model.path", Verdict.OK, f"{long_path} readable, 4692.8 MiB", subject="models[0].path"),
        CheckResult("disk.space", Verdict.DEGRADED,
                    "only 1.2 GiB free of 252.0 GiB at /var/lib/viiwork, where engine logs and state are written",
                    consequence="engine logs stop", remedy="free space", subject="state dir /var/lib/viiwork"),
        CheckResult("gpu.cpu_only", Verdict.OK, "no GPU visible: models run on the CPU"),
    ]
    return DoctorReport(tuple(results))


def test_doctor_table_fits_100_columns_and_wraps_at_words() -> None:
    out = io.StringIO()
    print_report(_report(), Console(file=out, width=100, color_system=None))
    text = out.getvalue()
    assert max(len(line) for line in text.splitlines()) <= 100
    words = text.split()
    for word in "only 1.2 GiB free of 252.0 GiB at /var/lib/viiwork, where engine logs and state are written".split():
        assert word in words  # whole: wrapped between words, not inside one
    assert "/var/lib/viiwork/models/meta-llama/Llama-3.1-8B-Instruct-Q4_K_M.gguf" in words


def test_doctor_wide_has_every_column_unwrapped() -> None:
    out = io.StringIO()
    print_report(_report(), table_console(wide=True, highlight=False, file=out), wide=True)
    rows = out.getvalue().splitlines()
    assert rows[0].split() == ["verdict", "check", "subject", "summary"]
    row = next(line for line in rows if "disk.space" in line)
    assert row.rstrip().endswith("where engine logs and state are written")  # one line, whole
    assert max(len(line) for line in rows) > 100


def test_table_console_widths(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("COLUMNS", raising=False)
    assert table_console(file=io.StringIO()).width == PIPE_WIDTH  # a pipe: 100, not rich's 80
    assert table_console(wide=True, file=io.StringIO()).width == UNBOUNDED_WIDTH
    monkeypatch.setenv("COLUMNS", "90")
    assert table_console(file=io.StringIO()).width == 90


def _check(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("VIIWORK_URL",)}
    env["XDG_STATE_HOME"] = str(tmp_path / "xdg")  # no demo of this user is a candidate
    return subprocess.run([sys.executable, "-m", "viiwork.agent.cli", "config", "check", *args],
                          capture_output=True, text=True, env=env, timeout=60)


WARNING = "warning: no [[models]] configured: the agent starts but serves nothing"


def test_documented_no_models_outcomes(tmp_path: Path) -> None:
    """docs/configuration.md: no [[models]] and no other error: the warning and exit 2;
    the listen port held by another process: that error and exit 1; --offline: 2."""
    empty = tmp_path / "empty.toml"
    empty.write_text("")
    offline = _check(tmp_path, "--offline", str(empty))
    assert offline.returncode == 2 and WARNING in offline.stderr, offline.stderr
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        cfg = tmp_path / "held.toml"
        cfg.write_text(f'[api]\nlisten = "127.0.0.1:{port}"\nadmin_socket = "{tmp_path / "admin.sock"}"\n')
        busy = _check(tmp_path, str(cfg))
    assert busy.returncode == 1, busy.stderr
    assert f"api.listen: port {port} is in use on this host" in busy.stderr
    assert WARNING not in busy.stderr  # an error first: no summary, no warning
    free = _check(tmp_path, str(cfg))  # the port is free now
    assert free.returncode == 2 and WARNING in free.stderr, free.stderr
