"""Fixtures of the systemd tier: a real user manager, a real PID 1, runners connected to them."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
from conftest import require

from support.systemd import (
    Pid1System,
    UserManager,
    checkout_hidden_by_private_tmp,
    missing_pid1,
    missing_user_manager,
    pid1_system,
    user_manager,
)
from viiwork.agent.supervision.runners.systemd.runner import SystemdRunner


@pytest.fixture
def systemd_user(tmp_path: Path) -> Iterator[UserManager]:
    """A fresh ``systemd --user`` (user-manager tier) for one test."""
    reason = missing_user_manager() or checkout_hidden_by_private_tmp()
    require(reason is None, f"systemd user-manager tier: {reason}")
    with user_manager(tmp_path / "um") as manager:
        yield manager


@pytest.fixture
def systemd_pid1(tmp_path: Path) -> Iterator[Pid1System]:
    """A fresh systemd PID 1 in namespaces (system bus, journald, v1 memory/pids)."""
    reason = missing_pid1() or checkout_hidden_by_private_tmp()
    require(reason is None, f"systemd PID 1 tier: {reason}")
    # A short directory: the container's paths appear in unit names and socket paths.
    with pid1_system(tmp_path / "p1") as system:
        yield system


@pytest.fixture
async def user_runner(systemd_user: UserManager) -> AsyncIterator[SystemdRunner]:
    """A SystemdRunner on the user manager's bus; engine output goes to the request's log_path."""
    runner = await SystemdRunner.connect("user", systemd_user.bus_address, engine_user=None, output="file")
    try:
        yield runner
    finally:
        await runner.close()
