"""The doctor's machinery: verdicts, results, the check registry and running it.

A check is a pure function of a ``HostFacts`` (``viiwork.agent.host.facts``) registered with
``@check(id, title)``; it returns one ``CheckResult`` or several. ``run_check`` turns a
``Skip`` into ``skipped`` and anything else a check raises into ``fail`` (docs/architecture.md,
rule 14). The checks themselves live in the subject modules of this package
(``config``, ``gpu``, ``engines``, ``disk``, ``mesh``, ``auth``, ``agent``); importing the package
registers them all, in the order they are shown.
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from viiwork.agent.config.schema import Config
from viiwork.agent.host.facts import FactUnavailable, HostFacts

log = logging.getLogger(__name__)


class Verdict(StrEnum):
    OK = "ok"
    DEGRADED = "degraded"
    FAIL = "fail"
    SKIPPED = "skipped"


@dataclass(frozen=True, slots=True)
class CheckResult:
    """One finding. ``subject`` names what it is about when a check has several ("GPU 1",
    "llamacpp: llama-server"); ``consequence`` and ``remedy`` are set when not ok."""

    check: str
    verdict: Verdict
    summary: str
    consequence: str = ""
    remedy: str = ""
    subject: str = ""

    def to_json(self) -> dict[str, str]:
        return {"check": self.check, "subject": self.subject, "verdict": self.verdict.value,
                "summary": self.summary, "consequence": self.consequence, "remedy": self.remedy}


class Skip(Exception):
    """Raised inside a check: it does not apply here; the message says why."""


CheckFunc = Callable[[HostFacts], "CheckResult | Iterable[CheckResult]"]


@dataclass(frozen=True, slots=True)
class Check:
    """A registered check: ``id`` (stable, used in --json and docs), ``title``, the function,
    and ``agent`` (True when it judges what the running agent reports)."""

    id: str
    title: str
    func: CheckFunc
    agent: bool = False

    @property
    def doc(self) -> str:
        return inspect.cleandoc(self.func.__doc__ or "")


REGISTRY: list[Check] = []


def check(check_id: str, title: str, *, agent: bool = False) -> Callable[[CheckFunc], CheckFunc]:
    """Register a check function under ``check_id`` (unique)."""

    def register(func: CheckFunc) -> CheckFunc:
        if any(c.id == check_id for c in REGISTRY):
            raise ValueError(f"doctor check {check_id!r} registered twice")
        REGISTRY.append(Check(check_id, title, func, agent))
        return func

    return register


# -- helpers the checks share ---------------------------------------------------------------


def result_for(check_id: str) -> Callable[..., CheckResult]:
    """A maker of ``check_id``'s results: ``r(verdict, summary, consequence, remedy, subject=)``."""

    def make(verdict: Verdict, summary: str, consequence: str = "", remedy: str = "", subject: str = "") -> CheckResult:
        return CheckResult(check_id, verdict, summary, consequence, remedy, subject)

    return make


def config_or_skip(facts: HostFacts) -> Config:
    """The loaded config; Skip when there is none (the config check says why)."""
    if facts.config.config is None:
        raise Skip("no valid config (see the config check)")
    return facts.config.config


def agent_status_or_skip(facts: HostFacts) -> Mapping[str, Any]:
    """The running agent's ``/v1/status`` document; Skip when it was not asked or did not answer."""
    agent = facts.agent
    if agent is None:
        raise Skip("the running agent was not asked")
    if agent.status is None:
        raise Skip("the running agent's status is not available (see agent.reachable)")
    return agent.status


def plural(n: int, word: str) -> str:
    """``plural(2, "GPU")`` is "2 GPUs"."""
    return f"{n} {word}{'' if n == 1 else 's'}"


# -- running the registry -------------------------------------------------------------------


@dataclass(frozen=True)
class DoctorReport:
    """All results in registry order. ``exit_code``: 1 any fail, 2 degraded only, else 0."""

    results: tuple[CheckResult, ...]
    context: Mapping[str, Any] = field(default_factory=dict)

    @property
    def exit_code(self) -> int:
        return exit_code_for(r.verdict for r in self.results)

    def counts(self) -> dict[str, int]:
        out = {v.value: 0 for v in Verdict}
        for result in self.results:
            out[result.verdict.value] += 1
        return out

    def to_json(self) -> dict[str, Any]:
        return {"exit_code": self.exit_code, "counts": self.counts(), **self.context,
                "results": [x.to_json() for x in self.results]}


def exit_code_for(verdicts: Iterable[Verdict]) -> int:
    """1 when any verdict is fail, 2 when any is degraded, else 0 (skipped counts as ok)."""
    seen = set(verdicts)
    if Verdict.FAIL in seen:
        return 1
    if Verdict.DEGRADED in seen:
        return 2
    return 0


def run_check(item: Check, facts: HostFacts) -> list[CheckResult]:
    """Run one check; a Skip becomes ``skipped``, anything else it raises becomes ``fail``."""
    try:
        out = item.func(facts)
    except Skip as exc:
        return [CheckResult(item.id, Verdict.SKIPPED, str(exc))]
    except FactUnavailable as exc:
        return [CheckResult(item.id, Verdict.FAIL, str(exc), "this part of the host could not be inspected",
                            "run the doctor as root; if it persists, report it with `viiworkctl doctor --json`")]
    except Exception as exc:  # a crashing check is a fail, never a crash of the doctor
        log.debug("doctor check %s crashed", item.id, exc_info=True)
        return [CheckResult(item.id, Verdict.FAIL, f"check crashed: {type(exc).__name__}: {exc}",
                            "this check could not judge the host",
                            "report it as a bug, with the output of `viiworkctl doctor --json`")]
    return [out] if isinstance(out, CheckResult) else list(out)


def run_checks(facts: HostFacts, registry: Sequence[Check] | None = None, *, agent: bool = True,
               context: Mapping[str, Any] | None = None) -> DoctorReport:
    """Run every check of ``registry`` (default: all) on ``facts``; ``agent=False`` leaves out
    the checks of the running agent."""
    checks = REGISTRY if registry is None else registry
    results: list[CheckResult] = []
    for item in checks:
        if item.agent and not agent:
            continue
        results.extend(run_check(item, facts))
    return DoctorReport(tuple(results), dict(context or {}))
