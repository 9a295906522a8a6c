"""The config file as the doctor sees it: loaded by the agent's own loader, or the issues that stopped it."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from viiwork.agent.config.load import ConfigError, ConfigIssue, load_config
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
        config = load_config(p)
    except ConfigError as exc:
        return ConfigFacts(str(p), p.exists(), None, tuple(exc.issues), _read_text(p))
    return ConfigFacts(str(p), True, config, (), _read_text(p))


def _read_text(path: Path) -> str | None:
    try:
        return path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError):
        return None
