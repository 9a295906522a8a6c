"""The agent runs its usage ledger: the file in the state dir and its stats on /v1/status."""

from __future__ import annotations

import os
from pathlib import Path

from support.agent import run_agent


def test_the_agent_opens_its_ledger_and_reports_it(tmp_path: Path) -> None:
    with run_agent(tmp_path, [], name="node-u") as agent:
        section = agent.status()["usage"]
        state = tmp_path / "node-u"
        assert section["path"] == str(state / "usage.sqlite3")
        assert (section["rows_written"], section["backlog"], section["dropped"], section["last_error"]) == (0, 0, 0, "")
        assert os.stat(state / "usage.sqlite3").st_mode & 0o777 == 0o600
