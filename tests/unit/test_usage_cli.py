"""``viiworkctl usage`` as a subprocess, on a ledger a running Ledger writes (agent/cli/usage.py)."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from viiwork.agent.cli.usage import _print_table
from viiwork.agent.usage.ledger import Ledger
from viiwork.agent.usage.query import Grouping, SummaryRow
from viiwork.agent.usage.store import UsageRow


def usage(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "viiwork.agent.cli", "usage", *args], capture_output=True,
                          text=True, timeout=60, env={**__import__("os").environ, "COLUMNS": "200"})


def row(i: int, tenant: str, model: str, age_s: float = 0.0, status: int = 200) -> UsageRow:
    return UsageRow(finished_at_ms=int((time.time() - age_s) * 1000), request_id=f"r{i}", tenant=tenant, jti="k",
                    model=model, origin_node="", serving_node="node-a", prompt_tokens=100, completion_tokens=20,
                    cached_tokens=None, status=status, queued_ms=1.0, ttft_ms=5.0, duration_ms=float(10 * (i + 1)))


@pytest.fixture
async def running_ledger(tmp_path: Path):
    path = tmp_path / "usage.sqlite3"
    ledger = Ledger(path)
    ledger.start()
    rows = [row(0, "acme", "llama"), row(1, "acme", "llama"), row(2, "acme", "qwen", status=500),
            row(3, "a-tenant-with-a-rather-long-name-indeed", "qwen"), row(4, "acme", "llama", age_s=7200)]
    for r in rows:
        await ledger.record(r)
    yield path
    await ledger.close()


async def test_json_by_tenant_while_the_ledger_writes(running_ledger: Path) -> None:
    done = await asyncio.to_thread(usage, "--db", str(running_ledger), "--since", "1h", "--json")
    assert done.returncode == 0, done.stderr
    doc = json.loads(done.stdout)
    groups = {g["key"]: g for g in doc["groups"]}
    assert groups["acme"]["requests"] == 3  # the 2-hour-old row is outside --since 1h
    assert groups["acme"]["errors"] == 1
    assert groups["acme"]["prompt_tokens"] == 300 and groups["acme"]["completion_tokens"] == 60
    assert groups["acme"]["cached_tokens"] is None
    assert groups["acme"]["p50_duration_ms"] == 20.0


async def test_table_by_model_fits_100_columns(running_ledger: Path) -> None:
    done = await asyncio.to_thread(usage, "--db", str(running_ledger), "--since", "all", "--by", "model")
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0].split()[:2] == ["MODEL", "REQUESTS"]
    assert any(line.split()[:2] == ["llama", "3"] for line in lines)
    assert all(len(line) <= 100 for line in lines), max(lines, key=len)
    assert "5 request(s) in all time" in done.stdout
    wide = await asyncio.to_thread(usage, "--db", str(running_ledger), "--by", "tenant")
    assert all(len(line) <= 100 for line in wide.stdout.splitlines())


@pytest.mark.parametrize(("args", "code", "message"), [
    (["--since", "1y"], 2, "not a duration"),
    (["--by", "colour"], 2, "invalid choice"),
    (["--db", "/nonexistent/usage.sqlite3"], 1, "no usage file at /nonexistent/usage.sqlite3"),
], ids=["bad-since", "bad-by", "no-file"])
def test_bad_input_is_one_clear_line(args: list[str], code: int, message: str) -> None:
    done = usage(*args)
    assert done.returncode == code
    assert message in done.stderr
    assert "Traceback" not in done.stderr


def test_not_a_database_is_a_clear_error(tmp_path: Path) -> None:
    bogus = tmp_path / "usage.sqlite3"
    bogus.write_text("not sqlite at all, just text " * 100)
    done = usage("--db", str(bogus))
    assert done.returncode == 1
    assert f"cannot read {bogus}" in done.stderr and "Traceback" not in done.stderr


def test_the_file_is_found_from_the_config(tmp_path: Path) -> None:
    state = tmp_path / "state"
    state.mkdir()
    config = tmp_path / "viiwork.toml"
    config.write_text(f'[node]\nstate_dir = "{state}"\n', encoding="utf-8")
    done = usage("--config", str(config))
    assert done.returncode == 1
    assert f"no usage file at {state / 'usage.sqlite3'}" in done.stderr


def test_group_names_print_as_text_never_markup(capsys: pytest.CaptureFixture[str]) -> None:
    """A group name from a peer (``--mesh``) is shown as it is: ``[/red]`` does not raise, a
    ``[link=...]`` makes no hyperlink, an escape sequence is shown escaped."""
    names = ["[/red]", "[link=https://e.vil]a[/link]", "\x1b[2Jwiped", "[bold]loud[/bold]"]
    _print_table([SummaryRow(n, 1, 0, 1, 1, 0, 5.0) for n in names], Grouping("tenant"), 3600)
    out = capsys.readouterr().out
    assert "[/red]" in out and "[link=https://e.vil]a[/link]" in out and "[bold]loud[/bold]" in out
    assert "\x1b" not in out and "\\x1b[2Jwiped" in out
    assert "\x1b]8;" not in out  # no OSC 8 hyperlink
