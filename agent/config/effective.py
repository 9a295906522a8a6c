"""The effective config: every key with its value after defaults, and where each value came from.

``effective(config)`` is the loaded ``Config`` as plain data (the shape of the file: each
model's engine options under the engine's name, paths as strings, unset keys as None).
``sources(effective, raw)`` marks each leaf key ``"file"`` (written in the file) or
``"default"``, by dotted path (``models[0].llamacpp.binary``). ``render_toml`` writes the
effective config as TOML, each value through tomli-w and followed by a ``# from file`` or
``# default`` comment; an unset key (TOML has no null) becomes a comment line
``# key: unset  # default``. Reading the TOML back gives the same Config (tests check it).
"""

from __future__ import annotations

import json
import re
from typing import Any

import tomli_w

from viiwork.agent.config.load import format_path
from viiwork.agent.config.schema import Config

Path_ = tuple[str | int, ...]
_BARE_KEY = re.compile(r"[A-Za-z0-9_-]+")


def effective(config: Config) -> dict[str, Any]:
    """The config as the file would spell it, every default filled in (JSON types; None: unset)."""
    data = config.model_dump(mode="json")
    for model, dumped in zip(config.models, data["models"], strict=True):
        options = dumped.pop("options")
        dumped[model.engine] = options if options is not None else {}
    return data


def sources(value: Any, raw: Any, path: Path_ = ()) -> dict[str, str]:
    """Dotted path of each leaf of ``value`` -> ``"file"`` when ``raw`` (the parsed file) has
    it, else ``"default"``. Tables and arrays of tables are walked; other values are leaves."""
    out: dict[str, str] = {}
    if isinstance(value, dict) and value:
        for key, item in value.items():
            inner = raw.get(key, _ABSENT) if isinstance(raw, dict) else _ABSENT
            out.update(sources(item, inner, path + (key,)))
    elif isinstance(value, list) and value and all(isinstance(v, dict) for v in value):
        for i, item in enumerate(value):
            inner = raw[i] if isinstance(raw, list) and i < len(raw) else _ABSENT
            out.update(sources(item, inner, path + (i,)))
    else:
        out[format_path(path)] = "default" if raw is _ABSENT else "file"
    return out


_ABSENT = object()


def _key(key: str) -> str:
    return key if _BARE_KEY.fullmatch(key) else json.dumps(key)


def _inline(value: Any) -> str:
    """One TOML value on one line, through tomli-w (which writes arrays one item a line)."""
    if isinstance(value, list):
        return "[" + ", ".join(_inline(v) for v in value) + "]"
    return tomli_w.dumps({"v": value}).strip()[len("v = "):]


def _is_table(value: Any) -> bool:
    return isinstance(value, dict) and bool(value)


def _is_table_array(value: Any) -> bool:
    return isinstance(value, list) and bool(value) and all(isinstance(v, dict) for v in value)


def render_toml(data: dict[str, Any], marks: dict[str, str]) -> str:
    """TOML text of ``data`` (from ``effective``), each key line marked from ``marks`` (from ``sources``)."""
    lines: list[str] = []
    _render_table(data, (), (), lines, marks, header=None)
    return "\n".join(lines).strip("\n") + "\n"


def _render_table(table: dict[str, Any], path: Path_, keys: tuple[str, ...], lines: list[str],
                  marks: dict[str, str], header: str | None) -> None:
    if header is not None:
        lines.extend(["", header])
    nested = []
    for key, value in table.items():
        if _is_table(value) or _is_table_array(value):
            nested.append(key)
            continue
        mark = marks.get(format_path(path + (key,)), "default")
        comment = "# from file" if mark == "file" else "# default"
        if value is None:
            lines.append(f"# {_key(key)}: unset  {comment}")
        elif isinstance(value, dict):  # an empty table, written inline
            lines.append(f"{_key(key)} = {{}}  {comment}")
        else:
            lines.append(f"{_key(key)} = {_inline(value)}  {comment}")
    for key in nested:
        value = table[key]
        dotted = ".".join(_key(k) for k in keys + (key,))
        if _is_table(value):
            _render_table(value, path + (key,), keys + (key,), lines, marks, f"[{dotted}]")
        else:
            for i, item in enumerate(value):
                _render_table(item, path + (key, i), keys + (key,), lines, marks, f"[[{dotted}]]")
