"""Paths and names in viiworkctl's human output, quoted so the terminal shows them as they are.

A file name may hold any byte but NUL and '/': a newline that forges an output line, a
terminal escape sequence (ESC [ ...) that rewrites the screen, bytes that are not UTF-8 (and
would make ``print`` raise). ``quote_path`` gives a form that is safe to print and that a
POSIX shell reads back as the same bytes, so a line can be copied into a command.
"""

from __future__ import annotations

import os
import shlex

# Inside bash's $'...' quoting only these two need a backslash among printable characters.
_ANSI_C = {"\\": "\\\\", "'": "\\'", "\n": "\\n", "\t": "\\t", "\r": "\\r"}


def quote_path(path: str | os.PathLike[str]) -> str:
    """``path`` as one printable shell word.

    A path of printable characters gets ``shlex.quote`` (``/m/a.gguf`` stays as is,
    ``/m/Tiny Chat.gguf`` becomes ``'/m/Tiny Chat.gguf'``). One with a control or other
    non-printable character, or bytes that are not UTF-8 (held by Python as surrogate
    escapes), gets bash's ANSI-C quoting, each such byte as ``\\xHH``:
    ``$'/m/a\\nb.gguf'``, ``$'/m/\\x1b[2Jx.gguf'``, ``$'/m/\\xff.gguf'``. The result holds
    no control character and always encodes to UTF-8.
    """
    text = os.fspath(path)
    if text.isprintable():
        return shlex.quote(text)
    return "$'" + "".join(_escape(c) for c in text) + "'"


def printable(text: str) -> str:
    """``text`` with each character that is not printable shown as an escape (``\\x1b``,
    ``\\n``, ``\\u202e``: ``_escape``'s forms), the rest as is, for a string from an agent or
    a peer printed in a line or a table cell. Not a shell word (see ``quote_path``)."""
    return text if text.isprintable() else "".join(c if c.isprintable() else _escape(c) for c in text)


def _escape(c: str) -> str:
    if c in _ANSI_C:
        return _ANSI_C[c]
    if c.isprintable():
        return c
    code = ord(c)
    if 0xDC80 <= code <= 0xDCFF:  # os.fsdecode's surrogate escape for a byte that is not UTF-8
        return f"\\x{code - 0xDC00:02x}"
    if 0xD800 <= code <= 0xDFFF:  # a lone surrogate, which stands for no byte (no path holds one)
        return f"\\u{code:04x}"
    return "".join(f"\\x{b:02x}" for b in c.encode("utf-8"))
