"""The config file as the doctor sees it: loaded by the agent's own loader, or the issues that stopped it."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from viiwork.agent.config.load import ConfigError, ConfigIssue, parse_config, read_config_text
from viiwork.agent.config.schema import Config


@dataclass(frozen=True, slots=True)
class ConfigFacts:
    """The config file: ``config`` when it loaded, else the ``issues`` that stopped it."""

    path: str
    exists: bool
    config: Config | None
    issues: tuple[ConfigIssue, ...] = ()
    text: str | None = None


def read_config_facts(path: str | Path) -> ConfigFacts:
    """Load ``path`` with the agent's loader. Never raises: a missing or invalid file gives
    ``config=None`` and the issues (each naming its field and line)."""
    p = Path(path)
    try:
        text = read_config_text(p)  # the agent's own read: a regular file, at most 1 MiB
    except ConfigError as exc:
        return ConfigFacts(str(p), p.exists(), None, tuple(exc.issues), None)
    try:
        config = parse_config(text, str(p))
    except ConfigError as exc:
        return ConfigFacts(str(p), True, None, tuple(exc.issues), text)
    return ConfigFacts(str(p), True, config, (), text)
