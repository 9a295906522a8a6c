"""The doctor: a registry of checks over observed host facts, each a pure function.

A check takes a ``HostFacts`` (``viiwork.agent.host.facts``) and returns ``CheckResult``s: a
verdict (``ok``, ``degraded``, ``fail``, or ``skipped`` when it does not apply), a one-line
summary, and for anything not ok the consequence and the remedy. A check that raises
becomes a ``fail`` naming the error (docs/architecture.md, rule 14): the doctor never crashes on a strange
host. A check's docstring is its documentation: ``docs/doctor.md`` is generated from this
registry (``python -m viiwork.agent.host.doctor --markdown``), so the list cannot drift.

The same checks give the agent its loud start-up conflicts (``derive_conflicts``): the
non-ok results of the host checks, computed from facts alone.

Exit codes (``DoctorReport.exit_code``): 0 all ok (or skipped), 2 degraded only, 1 any fail.

Layout: ``registry`` (verdicts, results, ``@check``, running the registry), one module per
subject of checks (``config``, ``gpu``, ``engines``, ``disk``, ``mesh``, ``auth``, ``agent``), and
``markdown`` (docs/doctor.md). The start-up conflicts are here because they need the whole
registry, which exists once this package has imported every subject module.
"""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path
from typing import Any

# The subject modules register their checks as they are imported: this order is the order of
# `viiworkctl doctor` and of docs/doctor.md (tests/unit/test_doctor.py compares the doc).
# isort: off
from viiwork.agent.host.doctor import config  # noqa: F401
from viiwork.agent.host.doctor import gpu  # noqa: F401
from viiwork.agent.host.doctor import engines  # noqa: F401
from viiwork.agent.host.doctor import disk  # noqa: F401
from viiwork.agent.host.doctor import mesh  # noqa: F401
from viiwork.agent.host.doctor import auth  # noqa: F401
from viiwork.agent.host.doctor import agent  # noqa: F401
# isort: on
from viiwork.agent.host.doctor.markdown import render_markdown
from viiwork.agent.host.doctor.registry import (
    REGISTRY,
    Check,
    CheckFunc,
    CheckResult,
    DoctorReport,
    Skip,
    Verdict,
    check,
    exit_code_for,
    run_check,
    run_checks,
)
from viiwork.agent.host.facts import HostFacts, gather_facts

__all__ = [
    "REGISTRY",
    "Check",
    "CheckFunc",
    "CheckResult",
    "DoctorReport",
    "Skip",
    "Verdict",
    "async_startup_conflicts",
    "check",
    "derive_conflicts",
    "exit_code_for",
    "render_markdown",
    "run_check",
    "run_checks",
]

log = logging.getLogger(__name__)


def derive_conflicts(facts: HostFacts) -> list[CheckResult]:
    """The host's conflicts: every degraded or failed result of the host checks (pure)."""
    report = run_checks(facts, agent=False)
    return [r for r in report.results if r.verdict in (Verdict.DEGRADED, Verdict.FAIL)]


async def async_startup_conflicts(config_path: str | Path, **gather: Any) -> list[CheckResult]:
    """Gather host facts (in a worker thread, without asking the agent) and log each conflict
    at WARNING: the agent calls this once at start. ``gather`` passes through to gather_facts."""
    facts = await asyncio.to_thread(gather_facts, config_path, url=None, **gather)
    conflicts = derive_conflicts(facts)
    for c in conflicts:
        log.warning("host conflict %s %s%s: %s; %s; fix: %s", c.check, c.verdict.value,
                    f" ({c.subject})" if c.subject else "", c.summary, c.consequence, c.remedy)
    return conflicts
