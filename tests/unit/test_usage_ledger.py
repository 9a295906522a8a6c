"""The usage ledger on real SQLite files (agent/usage; docs/usage.md).

The durability rule is tested with a real kill -9 of a writing process, the full disk with a
real RLIMIT_FSIZE in a child (writes past it fail with EFBIG), retention with an injected
clock, the summaries against sums computed here (hypothesis).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from viiwork.agent.config.load import ConfigError, parse_config
from viiwork.agent.usage.ledger import PRUNE_BATCH, Ledger, LedgerClosed, Recorded
from viiwork.agent.usage.query import Grouping, summarise
from viiwork.agent.usage.store import (
    SCHEMA_VERSION,
    SchemaNewer,
    UsageRow,
    insert_rows,
    open_for_writing,
    open_read_only,
    read_rows,
)

CHILD = Path(__file__).resolve().parents[1] / "support" / "ledger_child.py"
DAY_MS = 86_400_000


def row(request_id: str, *, at_ms: int | None = None, tenant: str = "acme", model: str = "m", node: str = "n1",
        prompt: int | None = 10, completion: int | None = 5, cached: int | None = None, status: int = 200,
        duration_ms: float = 9.0) -> UsageRow:
    return UsageRow(finished_at_ms=int(time.time() * 1000) if at_ms is None else at_ms, request_id=request_id,
                    tenant=tenant, jti="k1", model=model, origin_node="", serving_node=node, prompt_tokens=prompt,
                    completion_tokens=completion, cached_tokens=cached, status=status, queued_ms=0.5, ttft_ms=3.0,
                    duration_ms=duration_ms)


def ids_in(path: Path) -> set[str]:
    conn = open_read_only(path)
    try:
        return {r.request_id for r in read_rows(conn)}
    finally:
        conn.close()


async def test_record_returns_after_the_row_is_committed(tmp_path: Path) -> None:
    path = tmp_path / "usage.sqlite3"
    ledger = Ledger(path)
    ledger.start()
    try:
        assert await ledger.record(row("r0")) is Recorded.COMMITTED
        # Another connection holds the write lock: the ledger's commit must wait for it, and so
        # must record().
        blocker = sqlite3.connect(path, isolation_level=None)
        blocker.execute("BEGIN IMMEDIATE")
        task = asyncio.create_task(ledger.record(row("r1")))
        done, _ = await asyncio.wait({task}, timeout=0.5)
        assert not done, "record() returned while its row could not have been committed"
        blocker.execute("COMMIT")
        blocker.close()
        assert await asyncio.wait_for(task, 10) is Recorded.COMMITTED
        assert ids_in(path) == {"r0", "r1"}
        assert ledger.stats().rows_written == 2
    finally:
        await ledger.close()


async def test_concurrent_records_are_all_committed(tmp_path: Path) -> None:
    path = tmp_path / "usage.sqlite3"
    ledger = Ledger(path)
    ledger.start()
    try:
        outcomes = await asyncio.wait_for(
            asyncio.gather(*(ledger.record(row(f"r{i}")) for i in range(500))), 30)
        assert set(outcomes) == {Recorded.COMMITTED}
        assert ids_in(path) == {f"r{i}" for i in range(500)}
    finally:
        await ledger.close()
    assert os.stat(path).st_mode & 0o777 == 0o600


async def test_record_outside_start_and_close_is_refused(tmp_path: Path) -> None:
    ledger = Ledger(tmp_path / "usage.sqlite3")
    with pytest.raises(LedgerClosed):
        await ledger.record(row("r0"))
    ledger.start()
    await ledger.close()
    with pytest.raises(LedgerClosed):
        await ledger.record(row("r1"))


@pytest.mark.parametrize(("field", "value"), [
    ("prompt_tokens", {"n": 1}), ("status", "200"), ("tenant", None), ("completion_tokens", True),
    ("duration_ms", None)], ids=["dict", "str-status", "no-tenant", "bool", "no-duration"])
async def test_a_malformed_row_is_refused_and_the_ledger_goes_on(tmp_path: Path, field: str, value: object) -> None:
    path = tmp_path / "usage.sqlite3"
    ledger = Ledger(path)
    ledger.start()
    try:
        with pytest.raises(TypeError, match=f"UsageRow.{field} must be"):
            await ledger.record(dataclasses.replace(row("bad"), **{field: value}))
        assert await asyncio.wait_for(ledger.record(row("good")), 10) is Recorded.COMMITTED
        assert ids_in(path) == {"good"}
        assert ledger.stats().backlog == 0
    finally:
        await ledger.close()


def test_kill_9_loses_no_committed_row(tmp_path: Path) -> None:
    path = tmp_path / "usage.sqlite3"
    child = subprocess.Popen([sys.executable, str(CHILD), "flood", str(path)], stdout=subprocess.PIPE, text=True)
    printed: list[str] = []
    try:
        assert child.stdout is not None
        deadline = time.monotonic() + 60
        while len(printed) < 2000 and time.monotonic() < deadline:
            line = child.stdout.readline()
            if not line:
                break
            printed.append(line.strip())
        child.send_signal(signal.SIGKILL)
        rest, _ = child.communicate(timeout=10)
        printed += [line for line in rest.splitlines() if line]
    finally:
        if child.poll() is None:
            child.kill()
            child.wait(10)
    assert child.returncode == -signal.SIGKILL
    assert len(printed) >= 2000, "the child recorded too few rows before the deadline"
    conn = open_for_writing(path)  # the next agent's open: recovers the WAL
    try:
        found = {r.request_id for r in read_rows(conn)}
    finally:
        conn.close()
    missing = set(printed) - found
    assert not missing, f"{len(missing)} rows reported recorded are not in the file, e.g. {sorted(missing)[:5]}"


def test_full_disk_backlog_is_bounded_counted_and_written_when_space_returns(tmp_path: Path) -> None:
    path = tmp_path / "usage.sqlite3"
    done = subprocess.run([sys.executable, str(CHILD), "full", str(path)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert report["before"] == ["committed"] * 5
    # The agent-facing API kept answering: every record() returned, backlogged.
    assert report["during"] == ["backlogged"] * 50
    full = report["stats_full"]
    assert full["backlog"] == 30 and full["dropped"] == 20
    assert full["last_error"], "the failure is reported"
    assert report["after"] == "committed"
    after = report["stats_after"]
    assert after["backlog"] == 0 and after["dropped"] == 20 and after["last_error"] == ""
    assert after["rows_written"] == 5 + 30 + 1
    # The newest 30 of the 50 were kept, the oldest 20 dropped.
    assert ids_in(path) == {f"a{i}" for i in range(5)} | {f"b{i}" for i in range(20, 50)} | {"c0"}


async def test_retention_deletes_only_rows_past_it(tmp_path: Path) -> None:
    now_s = 1_800_000_000.0
    now_ms = int(now_s * 1000)
    path = tmp_path / "usage.sqlite3"
    conn = open_for_writing(path)
    old = [row(f"old{i}", at_ms=now_ms - 91 * DAY_MS - i) for i in range(PRUNE_BATCH * 2 + 7)]
    keep = [row("edge", at_ms=now_ms - 90 * DAY_MS + 1000), row("new", at_ms=now_ms - DAY_MS),
            row("future", at_ms=now_ms + DAY_MS)]
    insert_rows(conn, old + keep)
    conn.close()
    ledger = Ledger(path, retention_days=90, clock=lambda: now_s, prune_interval_s=3600)
    ledger.start()
    try:
        # The ledger also prunes by itself when idle, so what this call deletes varies: the
        # counter and the file are the facts.
        await asyncio.wait_for(ledger.prune(), 30)
        assert ids_in(path) == {"edge", "new", "future"}
        assert ledger.stats().pruned == len(old)
        # A row past retention recorded now goes at the next prune.
        await ledger.record(row("late-old", at_ms=now_ms - 200 * DAY_MS))
        await asyncio.wait_for(ledger.prune(), 30)
        assert ids_in(path) == {"edge", "new", "future"}
        assert ledger.stats().pruned == len(old) + 1
    finally:
        await ledger.close()


@pytest.mark.parametrize("days", [0, 3651, -1])
def test_retention_days_out_of_bounds_is_a_config_error(days: int) -> None:
    with pytest.raises(ConfigError, match="retention_days"):
        parse_config(f"[usage]\nretention_days = {days}\n", "t.toml")
    with pytest.raises(ValueError, match="retention_days"):
        Ledger(Path("/nonexistent/usage.sqlite3"), retention_days=days)


def test_usage_path_defaults_to_the_state_dir() -> None:
    config = parse_config('[node]\nstate_dir = "/srv/vw"\n', "t.toml")
    assert config.usage.file(config.node.state_dir) == Path("/srv/vw/usage.sqlite3")
    config = parse_config('[usage]\npath = "/data/u.sqlite3"\n', "t.toml")
    assert config.usage.file(config.node.state_dir) == Path("/data/u.sqlite3")
    with pytest.raises(ConfigError, match="absolute"):
        parse_config('[usage]\npath = "u.sqlite3"\n', "t.toml")


def test_a_newer_schema_is_refused_not_rewritten(tmp_path: Path) -> None:
    path = tmp_path / "usage.sqlite3"
    conn = sqlite3.connect(path)
    conn.execute(f"PRAGMA user_version={SCHEMA_VERSION + 1}")
    conn.close()
    with pytest.raises(SchemaNewer, match="newer"):
        Ledger(path).start()
    with pytest.raises(SchemaNewer):
        open_read_only(path)


ROWS = st.lists(st.builds(
    lambda i, tenant, model, prompt, completion, status, duration: row(
        f"r{i}", at_ms=1_000_000 + i, tenant=tenant, model=model, prompt=prompt, completion=completion,
        status=status, duration_ms=duration),
    st.integers(0, 10_000), st.sampled_from(["", "acme", "globex"]), st.sampled_from(["a", "b"]),
    st.none() | st.integers(0, 100_000), st.none() | st.integers(0, 100_000), st.sampled_from([200, 429, 500]),
    st.floats(0, 1e6, allow_nan=False)), max_size=60)


@settings(max_examples=60, deadline=None)
@given(rows=ROWS, since_offset=st.integers(0, 10_001))
def test_summarise_matches_sums_computed_here(tmp_path_factory: pytest.TempPathFactory, rows: list[UsageRow],
                                               since_offset: int) -> None:
    path = tmp_path_factory.mktemp("sum") / "usage.sqlite3"
    conn = open_for_writing(path)
    try:
        insert_rows(conn, rows)
        since = 1_000_000 + since_offset
        got = {s.key: s for s in summarise(conn, since, Grouping.TENANT)}
        kept = [r for r in rows if r.finished_at_ms >= since]
        assert set(got) == {r.tenant for r in kept}
        for tenant, summary in got.items():
            mine = [r for r in kept if r.tenant == tenant]
            assert summary.requests == len(mine)
            assert summary.errors == sum(r.status >= 400 for r in mine)
            prompts = [r.prompt_tokens for r in mine if r.prompt_tokens is not None]
            assert summary.prompt_tokens == (sum(prompts) if prompts else None)
            completions = [r.completion_tokens for r in mine if r.completion_tokens is not None]
            assert summary.completion_tokens == (sum(completions) if completions else None)
            assert summary.p50_duration_ms == sorted(r.duration_ms for r in mine)[(len(mine) - 1) // 2]
    finally:
        conn.close()
