"""The config loader: TOML read with ``tomllib``, validated by the models of viiwork.agent.config.schema.

Every problem is reported, not just the first: ``ConfigError.issues`` lists each one as a
``ConfigIssue`` naming its path, counting array indexes from 0 (``models[1].llamacpp.thread``),
and the line where it can be found: ``models[1].llamacpp.thread: unknown key (line 23)``.
``viiworkctl config check``, ``config show``, the doctor and the agent (``--config`` and
``reload``) share ``load_config``, which reads the file through ``read_config_text``: a
regular file (a symlink to one is fine) of at most ``MAX_CONFIG_BYTES``; anything else (a
FIFO, a device such as /dev/zero, a directory, a larger file) is one ConfigError issue,
found without blocking on it or reading it whole.
"""

from __future__ import annotations

import os
import re
import stat
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from viiwork.agent.config.schema import BlockError, Config, PathError, short_repr
from viiwork.agent.config.toml_lines import line_of

DEFAULT_CONFIG_PATH = Path("/etc/viiwork/viiwork.toml")
# The largest config file read, in bytes: a config with hundreds of models is tens of KiB, so
# a larger file is a wrong path (a log, a model file, a device), refused before it is read.
MAX_CONFIG_BYTES = 1 << 20


@dataclass(frozen=True)
class ConfigIssue:
    """One problem: ``path`` as a tuple, ``message``, ``line`` (1-based) or None."""

    path: tuple[str | int, ...]
    message: str
    line: int | None = None

    @property
    def dotted(self) -> str:
        return format_path(self.path)

    def __str__(self) -> str:
        where = f" (line {self.line})" if self.line else ""
        prefix = f"{self.dotted}: " if self.path else ""
        return f"{prefix}{self.message}{where}"


class ConfigError(Exception):
    """The config cannot be used; ``issues`` lists every problem found."""

    def __init__(self, source: str, issues: list[ConfigIssue]) -> None:
        self.source = source
        # In the file's line order (sorted is stable: issues on one line keep theirs); issues
        # without a line (the whole file) come first.
        self.issues = sorted(issues, key=lambda i: i.line or 0)
        text = "\n".join(f"  {i}" for i in self.issues)
        count = f"{len(issues)} error{'' if len(issues) == 1 else 's'}"
        super().__init__(f"{source}: {count} in config\n{text}")


def format_path(path: tuple[str | int, ...]) -> str:
    """``("models", 1, "llamacpp")`` -> ``models[1].llamacpp``; ``()`` -> ``""``."""
    out = ""
    for part in path:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += f".{part}" if out else str(part)
    return out


_MESSAGES = {
    "extra_forbidden": "unknown key",
    "missing": "required key is missing",
    "model_type": "must be a table",
    "model_attributes_type": "must be a table",
    "dict_type": "must be a table",
    "list_type": "must be an array",
}


def _issues_from(exc: ValidationError, text: str, prefix: tuple[str | int, ...] = ()) -> list[ConfigIssue]:
    issues = []
    for err in exc.errors(include_url=False):
        loc = prefix + tuple(err["loc"])
        ctx = err.get("ctx") or {}
        inner = ctx.get("error")
        if isinstance(inner, PathError):
            loc, message = loc + inner.path, inner.message
        elif isinstance(inner, BlockError):
            # Reported at models[i].options; the operator wrote models[i].<engine>.
            for name in inner.mismatched:
                where = loc[:-1] + (name,)
                issues.append(ConfigIssue(where, f"block '{name}' does not match engine = {inner.engine!r}",
                                          line_of(text, where) if text else None))
            if inner.error is not None:
                issues.extend(_issues_from(inner.error, text, loc[:-1] + (inner.engine,)))
            continue
        else:
            message = _MESSAGES.get(err["type"], err["msg"])
            if message.startswith("Value error, "):
                message = message[len("Value error, "):]
            if err["type"] == "literal_error" and "expected" in ctx:
                message = f"must be one of {ctx['expected']}, got {err.get('input')!r}"
            elif err["type"] not in ("missing", "extra_forbidden", "value_error") and isinstance(
                err.get("input"), (str, int, float, bool)
            ):
                message += f", got {short_repr(err['input'])}"
        loc = _fix_engine_loc(loc)
        issues.append(ConfigIssue(loc, message, line_of(text, loc) if text else None))
    return issues


def _fix_engine_loc(loc: tuple[str | int, ...]) -> tuple[str | int, ...]:
    # pydantic puts engine option errors under "options" only if validated as a field; the
    # before-validator raises a nested ValidationError, reported at models[i] with the
    # options model's own loc. Keep loc as is; engine blocks are re-pathed in _validate.
    return tuple(p for p in loc if p not in ("function-after[_shape(), ModelConfig]",))


def _nul_issues(value: Any, text: str, path: tuple[str | int, ...] = ()) -> list[ConfigIssue]:
    """Every string (key or value) holding a NUL byte: one check for all of them, engine
    blocks included. Strings become argv, environment entries and paths, where a NUL is an
    error only when the backend starts (``ValueError: embedded null byte``)."""
    issues: list[ConfigIssue] = []
    if isinstance(value, str):
        if "\0" in value:
            issues.append(ConfigIssue(path, "may not contain a NUL character (\\u0000)", line_of(text, path) if text else None))
    elif isinstance(value, dict):
        for key, item in value.items():
            if "\0" in key:
                issues.extend(_nul_issues(key, text, path))
            else:
                issues.extend(_nul_issues(item, text, path + (key,)))
    elif isinstance(value, list):
        for i, item in enumerate(value):
            issues.extend(_nul_issues(item, text, path + (i,)))
    return issues


def _validate(data: dict[str, Any], text: str) -> Config:
    nul = _nul_issues(data, text)
    try:
        config = Config.model_validate(data)
    except ValidationError as exc:
        raise ConfigError("config", nul + _issues_from(exc, text)) from None
    except PathError as exc:
        raise ConfigError("config", nul + [ConfigIssue(exc.path, exc.message, line_of(text, exc.path))]) from None
    if nul:
        raise ConfigError("config", nul)
    return config


def parse_config(text: str, source: str = "<config>") -> Config:
    """Parse and validate TOML text; ConfigError listing every problem.

    What else ``tomllib`` raises is one issue too: RecursionError (arrays or inline tables
    nested a few hundred deep: it recurses per level; the validation's walk then goes no
    deeper than tomllib did) and
    ValueError (a decimal integer of more than ``sys.get_int_max_str_digits()`` digits, 4300
    by default, which ``int()`` refuses)."""
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(source, [_toml_issue(exc)]) from None
    except RecursionError:
        raise ConfigError(source, [_TOO_DEEP]) from None
    except ValueError as exc:
        # int()'s digit limit; its advice (sys.set_int_max_str_digits) is not the reader's to take.
        raise ConfigError(source, [ConfigIssue((), f"not valid TOML: {str(exc).split(';')[0]}")]) from None
    try:
        return _validate(data, text)
    except ConfigError as exc:
        raise ConfigError(source, exc.issues) from None


_TOO_DEEP = ConfigIssue((), "not valid TOML here: arrays or inline tables nested too deep to read "
                        "(a config nests a few levels)")


def _toml_issue(exc: tomllib.TOMLDecodeError) -> ConfigIssue:
    # Python 3.11's TOMLDecodeError has no lineno attribute; the position is in the text.
    text = str(exc)
    where = re.search(r"\s*\(at line (\d+), column (\d+)\)", text)
    if where:
        detail = text[:where.start()] + text[where.end():]
        return ConfigIssue((), f"not valid TOML: {detail} (column {where.group(2)})", int(where.group(1)))
    return ConfigIssue((), f"not valid TOML: {text}", getattr(exc, "lineno", None))


_KINDS = ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO (named pipe)"),
          (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"))


def file_kind(mode: int) -> str:
    """What a non-regular ``st_mode`` is, in words: "a FIFO (named pipe)", "a directory"..."""
    return next((words for test, words in _KINDS if test(mode)), "not a regular file")


def read_config_text(path: str | Path) -> str:
    """The text of the config file at ``path``, decoded as UTF-8.

    Reads only a regular file (``stat`` decides, following symlinks; the opened descriptor is
    checked again, so a file swapped in between is caught) of at most MAX_CONFIG_BYTES bytes.
    Raises ConfigError with one issue (no line) when the file is missing or unreadable, is
    not a regular file ("not a regular file: a FIFO (named pipe)"), is larger than the cap,
    or is not UTF-8. Never blocks on a FIFO and never reads past the cap.
    """
    p = Path(path)

    def refuse(message: str) -> ConfigError:
        return ConfigError(str(p), [ConfigIssue((), message)])

    def check(st: os.stat_result) -> None:
        if not stat.S_ISREG(st.st_mode):
            raise refuse(f"cannot read config: not a regular file: {file_kind(st.st_mode)}")
        if st.st_size > MAX_CONFIG_BYTES:
            raise refuse(f"cannot read config: {st.st_size} bytes, more than the {MAX_CONFIG_BYTES} "
                         "a config may have (MAX_CONFIG_BYTES): is this the config file?")

    try:
        check(os.stat(p))
        # O_NONBLOCK: a FIFO swapped in after the stat opens without waiting for a writer.
        fd = os.open(p, os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC)
        with os.fdopen(fd, "rb") as f:
            check(os.fstat(f.fileno()))
            data = f.read(MAX_CONFIG_BYTES + 1)
    except OSError as exc:
        raise refuse(f"cannot read config: {exc.strerror or exc}") from None
    if len(data) > MAX_CONFIG_BYTES:  # it grew after the fstat
        raise refuse(f"cannot read config: more than the {MAX_CONFIG_BYTES} bytes a config may have "
                     "(MAX_CONFIG_BYTES): is this the config file?")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        raise refuse("config is not UTF-8 text") from None
    # Newlines as text-mode reading gives them (Path.read_text, which this replaces).
    return text.replace("\r\n", "\n").replace("\r", "\n")


def load_config(path: str | Path) -> Config:
    """Read (``read_config_text``) and validate a config file; ConfigError listing every
    problem, or the one that stopped the read."""
    return parse_config(read_config_text(path), str(Path(path)))
