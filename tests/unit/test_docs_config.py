"""docs/configuration.md documents exactly the keys the loader accepts, with their defaults,
bounds and allowed values.

The pydantic models of viiwork.agent.config.schema (and each registered engine's options model)
are the source of truth; this test fails when a key is added, renamed or removed, or a
default changed, without the docs following. The docs keep one heading per section
(``## `[api]` ``, ``## `[[models]]` ``, ``### `[models.llamacpp]` ``) with a table whose
rows start ``| `key` | type | default | meaning |``. The type cell states each bound a
field declares (``ge``, ``gt``, ``le``, ``lt``, string lengths) and each allowed value of a
Literal or enum; checks made by validators (ports, cross-key rules) are in the docs' prose.
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


# What the loader enforces on each key, read from its field: bounds (ge, gt, le, lt),
# string lengths, and the allowed values of a Literal or an enum. The Type cell must state
# each one: a bound's number appears in it ("integer, 1-1024", "seconds, > 0, <= 86400"),
# each allowed value as a quoted TOML string.
def _constraints(annotation: object, metadata: list[object]) -> tuple[dict[str, float], set[str]]:
    bounds: dict[str, float] = {}
    allowed: set[str] = set()

    def walk(ann: object, meta: list[object]) -> None:
        for m in meta:
            for attr in ("ge", "gt", "le", "lt", "min_length", "max_length"):
                value = getattr(m, attr, None)
                if value is not None:
                    bounds[attr] = value
        origin = typing.get_origin(ann)
        if origin is typing.Literal:
            allowed.update(str(a) for a in typing.get_args(ann))
            return
        if isinstance(ann, type) and issubclass(ann, enum.Enum):
            allowed.update(str(e.value) for e in ann)
            return
        if origin is typing.Annotated:
            inner, *extra = typing.get_args(ann)
            walk(inner, list(extra))
            return
        for arg in typing.get_args(ann):
            if isinstance(arg, type) and issubclass(arg, BaseModel):
                continue
            walk(arg, [])

    walk(annotation, metadata)
    return bounds, allowed


def _number(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else f"{value:g}"


CONSTRAINT_CASES = [(section, key) for section in sorted(SECTIONS) for key in _keys(section)]


@pytest.mark.parametrize(("section", "key"), CONSTRAINT_CASES, ids=[f"{s}.{k}" for s, k in CONSTRAINT_CASES])
def test_documented_type_states_every_bound_and_allowed_value(section: str, key: str) -> None:
    row = TABLES.get(section, {}).get(key)
    if row is None:
        pytest.fail(f"[{section}] {key} is not documented")
    cell = row[1]
    field = SECTIONS[section].model_fields[key]
    bounds, allowed = _constraints(field.annotation, list(field.metadata))
    numbers = set(re.findall(r"\d+(?:\.\d+)?", cell.replace(",", " ")))
    for kind, value in bounds.items():
        text = _number(value)
        assert text in numbers, f"[{section}] {key}: {kind} {text} is enforced; the docs' type says {cell!r}"
        if kind == "gt":
            assert re.search(rf"(> {text}\b|\({text},)", cell), f"[{section}] {key}: > {text} (exclusive): {cell!r}"
        if kind == "lt":
            assert re.search(rf"(< {text}\b|\b{text}\))", cell), f"[{section}] {key}: < {text} (exclusive): {cell!r}"
    for value in allowed:
        assert f'"{value}"' in cell, f"[{section}] {key}: {value!r} is allowed; the docs' type says {cell!r}"
    documented = set(re.findall(r'`"([^"`]*)"`', cell))
    if allowed:
        assert documented <= allowed, f"[{section}] {key}: the docs allow {documented - allowed}, the loader does not"
