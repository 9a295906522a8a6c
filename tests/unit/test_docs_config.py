"""docs/configuration.md documents exactly the keys the loader accepts, with their defaults.

The pydantic models of viiwork.agent.config.schema (and each registered engine's options model)
are the source of truth; this test fails when a key is added, renamed or removed, or a
default changed, without the docs following. The docs keep one heading per section
(``## `[api]` ``, ``## `[[models]]` ``, ``### `[models.llamacpp]` ``) with a table whose
rows start ``| `key` | type | default | meaning |``.
"""

from __future__ import annotations

import enum
import re
import tomllib
import typing
from pathlib import Path

import pytest
from pydantic import BaseModel
from pydantic_core import PydanticUndefined

from viiwork.agent.config.schema import Config, ModelConfig
from viiwork.engines.registry import ENGINES

DOC = Path(__file__).resolve().parents[2] / "docs" / "configuration.md"

# Defaults computed at run time: documented in words.
DYNAMIC_DEFAULTS = {("node", "name")}
# ModelConfig fields that are not keys of the file (the engine block lands in `options`);
# a section's sub-table (``[routing.outliers]``) is a section of its own, added by _sections.
NOT_KEYS = {("models", "options")}

_HEADING = re.compile(r"^#{2,3} `\[{1,2}([a-z_.]+)\]{1,2}`\s*$")
_ROW = re.compile(r"^\|\s*`([a-z_]+)`\s*\|")


def _doc_tables() -> dict[str, dict[str, list[str]]]:
    """section -> key -> cells of its row."""
    tables: dict[str, dict[str, list[str]]] = {}
    section = None
    for line in DOC.read_text(encoding="utf-8").splitlines():
        heading = _HEADING.match(line)
        if heading:
            section = heading.group(1)
            tables.setdefault(section, {})
            continue
        if line.startswith("#"):
            section = None
            continue
        row = _ROW.match(line)
        if row and section is not None:
            cells = [c.strip() for c in line.strip().strip("|").split("|")]
            tables[section][row.group(1)] = cells
    return tables


def _model_of(annotation: object) -> type[BaseModel]:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    for arg in typing.get_args(annotation):
        try:
            return _model_of(arg)
        except LookupError:
            continue
    raise LookupError(annotation)


def _sections() -> dict[str, type[BaseModel]]:
    sections = {name: _model_of(field.annotation) for name, field in Config.model_fields.items()}
    assert sections["models"] is ModelConfig
    for engine_name, engine in ENGINES.items():
        sections[f"models.{engine_name}"] = engine.options_model
    for name, model in list(sections.items()):
        for key, field in model.model_fields.items():
            if isinstance(field.annotation, type) and issubclass(field.annotation, BaseModel):
                sections[f"{name}.{key}"] = field.annotation
                NOT_KEYS.add((name, key))
    return sections


SECTIONS = _sections()
TABLES = _doc_tables()


def _keys(section: str) -> list[str]:
    return [k for k in SECTIONS[section].model_fields if (section, k) not in NOT_KEYS]


@pytest.mark.parametrize("section", sorted(SECTIONS))
def test_every_key_is_documented(section: str) -> None:
    assert section in TABLES, f"docs/configuration.md has no heading for [{section}]"
    missing = [k for k in _keys(section) if k not in TABLES[section]]
    assert not missing, f"docs/configuration.md [{section}] lacks: {', '.join(missing)}"


@pytest.mark.parametrize("section", sorted(TABLES))
def test_no_documented_key_is_unknown(section: str) -> None:
    assert section in SECTIONS, f"docs/configuration.md documents a section [{section}] the loader does not have"
    stale = [k for k in TABLES[section] if k not in _keys(section)]
    assert not stale, f"docs/configuration.md [{section}] documents keys the loader rejects: {', '.join(stale)}"


def _plain(value: object) -> object:
    if isinstance(value, enum.Enum):
        return value.value
    if isinstance(value, Path):
        return str(value)
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    return value


DEFAULT_CASES = [
    (section, key) for section in sorted(SECTIONS) for key in _keys(section)
    if (section, key) not in DYNAMIC_DEFAULTS
]


@pytest.mark.parametrize(("section", "key"), DEFAULT_CASES, ids=[f"{s}.{k}" for s, k in DEFAULT_CASES])
def test_documented_default_matches_the_model(section: str, key: str) -> None:
    row = TABLES.get(section, {}).get(key)
    if row is None:
        pytest.fail(f"[{section}] {key} is not documented")
    cell = row[2]
    field = SECTIONS[section].model_fields[key]
    if field.is_required():
        assert cell.startswith("required"), f"[{section}] {key} is required; the docs say {cell!r}"
        return
    default = field.default if field.default is not PydanticUndefined else field.default_factory()
    if default is None:
        assert cell.startswith("unset"), f"[{section}] {key} defaults to unset; the docs say {cell!r}"
        return
    literal = re.match(r"`([^`]+)`", cell)
    assert literal, f"[{section}] {key}: the default cell should start with the TOML value, got {cell!r}"
    documented = tomllib.loads(f"v = {literal.group(1)}")["v"]
    assert documented == _plain(default), f"[{section}] {key}: docs say {documented!r}, the loader {default!r}"


def test_the_documented_error_example_is_the_loaders_format() -> None:
    text = DOC.read_text(encoding="utf-8")
    assert "models[1].llamacpp.thread: unknown key (line 23)" in text
