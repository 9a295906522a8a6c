"""Find the source line of a key in a TOML document, for error messages.

``tomllib`` keeps no positions, so this walks the text once, tracking table headers
(``[a.b]``, ``[[models]]`` with per-array counters) and ``key =`` lines, and maps each
error path (``models[1].llamacpp.thread``) to the line that defines it. Keys inside inline
tables or multi-line values map to the line of their enclosing key. Best effort: a path it
cannot place returns None and the message simply has no line.
"""

from __future__ import annotations

import re

_HEADER = re.compile(r"^\s*(\[\[?)\s*([^\]]+?)\s*\]\]?\s*(#.*)?$")
_KEY = re.compile(r"""^\s*((?:[A-Za-z0-9_-]+|"[^"]*"|'[^']*')(?:\s*\.\s*(?:[A-Za-z0-9_-]+|"[^"]*"|'[^']*'))*)\s*=""")


def _split_dotted(text: str) -> list[str]:
    parts = re.findall(r"""[A-Za-z0-9_-]+|"[^"]*"|'[^']*'""", text)
    return [p[1:-1] if p[:1] in "\"'" else p for p in parts]


def key_lines(source: str) -> dict[tuple[str | int, ...], int]:
    """Map each key path to its 1-based line.

    A path is a tuple of keys and array indexes: ``("models", 1, "llamacpp", "thread")``.
    Table headers map too (``("models", 1)`` -> the line of the second ``[[models]]``).
    """
    lines: dict[tuple[str | int, ...], int] = {}
    counters: dict[tuple[str | int, ...], int] = {}
    current: tuple[str | int, ...] = ()
    in_multiline: str | None = None
    for number, raw in enumerate(source.splitlines(), start=1):
        if in_multiline:
            if raw.count(in_multiline) % 2 == 1:
                in_multiline = None
            continue
        header = _HEADER.match(raw)
        if header and not _KEY.match(raw):
            keys = _split_dotted(header.group(2))
            is_array = header.group(1) == "[["
            path: list[str | int] = []
            # Resolve array-of-tables parents to their latest element.
            for key in keys[:-1]:
                path.append(key)
                base = tuple(path)
                if base in counters:
                    path.append(counters[base])
            path.append(keys[-1])
            base = tuple(path)
            if is_array:
                counters[base] = counters.get(base, -1) + 1
                path.append(counters[base])
            current = tuple(path)
            lines.setdefault(current, number)
            continue
        key_match = _KEY.match(raw)
        if key_match:
            full = current + tuple(_split_dotted(key_match.group(1)))
            lines.setdefault(full, number)
            rest = raw[key_match.end():]
            for quote in ('"""', "'''"):
                if rest.count(quote) % 2 == 1:
                    in_multiline = quote
    return lines


def line_of(source: str, path: tuple[str | int, ...]) -> int | None:
    """Line of ``path`` or of its nearest ancestor that has one; None if nothing matches."""
    table = key_lines(source)
    probe = tuple(path)
    while probe:
        if probe in table:
            return table[probe]
        probe = probe[:-1]
    return None
