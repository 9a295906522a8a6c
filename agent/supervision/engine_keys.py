"""Per-backend API keys: engines answer only the agent (docs/security.md, "Local users").

Every launch of a backend gets a fresh random key (``secrets.token_urlsafe(32)``), written
to ``<engine dir>/<model>-<index>/key`` before the engine starts. The directory is mode
0700 and the file 0600, both owned by the user the engine runs as (the systemd runner's
``viiwork`` user when the agent is root, else the agent's own user), so no other local
user can read the key. The engine dir itself belongs to the agent (0711, checked at every
launch), so the engine user can replace nothing in it but what is inside its own backend
dir; there the agent writes only to a fresh name (``O_CREAT | O_EXCL | O_NOFOLLOW``, then a
rename) and reads with ``O_NOFOLLOW``, a regular file of one link only, so a symlink, FIFO or
hard link the engine user leaves there is never followed, waited on or read by the agent.
The environment file of an engine that reads its key from a variable (vLLM) is read by
systemd as root: it lives in the agent's own engine dir (``<model>-<index>.env``), where the
engine user cannot swap it for a link to a root-only file. The engine is given the file (llama-server ``--api-key-file``;
``BackendSpec.api_key_file``), and the agent sends ``Authorization: Bearer <key>`` on
every request it makes to that backend (probes, load reads, proxied requests). A client's
own ``Authorization`` header never reaches an engine (agent/serving/proxy.py passes only
``Content-Type`` and ``Accept``), and the key is never in an answer, a log or /v1/status.

The engine dir is ``$RUNTIME_DIRECTORY/engines`` under systemd (the agent unit keeps its
runtime directory across restarts, so an adopted engine's key is read back from it), else
``<node.state_dir>/engines``.
"""

from __future__ import annotations

import contextlib
import os
import pwd
import re
import secrets
import stat
from collections.abc import Iterator, Mapping
from pathlib import Path

#: Bytes of randomness in a key (token_urlsafe: 43 characters).
KEY_BYTES = 32
KEY_FILE = "key"
#: Where versions before issue 14 wrote the environment file: in the backend dir (now env_file_path).
ENV_FILE = "key.env"
_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


class EngineKeyError(Exception):
    """The key file could not be written or read; the message names the path and the cause.
    ``errno``: the OSError's errno when a write failed (ENOSPC: a full disk), else None."""

    def __init__(self, message: str, errno: int | None = None, path: Path | None = None) -> None:
        super().__init__(message)
        self.errno = errno
        self.path = path


def engine_dir(state_dir: Path, environ: Mapping[str, str] | None = None) -> Path:
    """Where the per-backend directories live (module docstring)."""
    env = os.environ if environ is None else environ
    runtime = env.get("RUNTIME_DIRECTORY", "").split(":")[0]
    return Path(runtime) / "engines" if runtime else Path(state_dir) / "engines"


def backend_dir(root: Path, name: str) -> Path:
    return root / name


def _owner(user: str | None) -> tuple[int, int] | None:
    """(uid, gid) to chown to when the agent is root and the engine runs as another user."""
    if not user or os.geteuid() != 0:
        return None
    try:
        entry = pwd.getpwnam(user)
    except KeyError as exc:
        raise EngineKeyError(f"engine user {user!r} does not exist") from exc
    return entry.pw_uid, entry.pw_gid


def env_file_path(directory: Path) -> Path:
    """Where write_env_file puts the environment file of the backend dir ``directory``."""
    return directory.parent / f"{directory.name}.env"


def _agent_dir(root: Path) -> None:
    """Make sure the engine dir ``root`` exists and is the agent's: a real directory (not a
    symlink) owned by the agent's user, mode 0711 (the engine user may only traverse it)."""
    root.mkdir(mode=0o711, parents=True, exist_ok=True)
    info = root.lstat()
    if not stat.S_ISDIR(info.st_mode):
        raise EngineKeyError(f"the engine dir {root} is not a directory (a symlink or a file: remove it)")
    if info.st_uid != os.geteuid():
        raise EngineKeyError(f"the engine dir {root} is owned by uid {info.st_uid}, not by the agent's user "
                             f"{os.geteuid()}: its owner could swap the engines' keys; fix: chown {os.geteuid()} {root}")
    if stat.S_IMODE(info.st_mode) != 0o711:
        os.chmod(root, 0o711, follow_symlinks=False)


def _private_dir(path: Path, owner: tuple[int, int] | None) -> None:
    _agent_dir(path.parent)
    with contextlib.suppress(FileExistsError):
        path.mkdir(mode=0o700)
    info = path.lstat()
    if not stat.S_ISDIR(info.st_mode):
        raise EngineKeyError(f"{path} is not a directory (remove it)")
    if owner is not None and (info.st_uid, info.st_gid) != owner:
        os.chown(path, *owner, follow_symlinks=False)
    os.chmod(path, 0o700, follow_symlinks=False)


def _write_fresh(path: Path, data: bytes, owner: tuple[int, int] | None) -> None:
    """Create ``path`` (which must not exist: never a link someone left there), 0600, owned by
    ``owner`` (None: the agent), holding ``data``. Raises OSError."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
        if owner is not None:
            os.fchown(fd, *owner)
        os.fchmod(fd, 0o600)
    finally:
        os.close(fd)


def _replace_fresh(path: Path, tmp: Path, data: bytes, owner: tuple[int, int] | None) -> None:
    """Put ``data`` at ``path`` whole or not at all: written to the fresh name ``tmp``
    (``_write_fresh``, after removing a ``tmp`` an earlier attempt left), then renamed over
    ``path``. Raises OSError."""
    with contextlib.suppress(FileNotFoundError):
        tmp.unlink()
    _write_fresh(tmp, data, owner)
    os.replace(tmp, path)


@contextlib.contextmanager
def _writing(what: str, path: Path, tmp: Path) -> Iterator[None]:
    """Around the writing of the engine's ``what`` (``"key"``) at ``path`` through ``tmp``:
    an OSError removes ``tmp`` and becomes EngineKeyError("cannot write the engine <what>
    <path>: <cause>", errno, path)."""
    try:
        yield
    except OSError as exc:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise EngineKeyError(f"cannot write the engine {what} {path}: {exc.strerror or exc}", exc.errno, path) from exc


def write_key(directory: Path, engine_user: str | None = None) -> tuple[str, Path]:
    """A fresh key written to ``directory/key`` (0600, in a 0700 dir, owned by ``engine_user``
    when the agent is root); returns (key, file path). Raises EngineKeyError."""
    key = secrets.token_urlsafe(KEY_BYTES)
    return key, write_private(directory, KEY_FILE, f"{key}\n".encode(), engine_user, what="key")


def write_private(directory: Path, name: str, data: bytes, engine_user: str | None = None, *,
                  what: str = "file") -> Path:
    """``data`` written whole to ``directory/name`` (0600, in a 0700 dir under the agent's
    engine dir, both owned by ``engine_user`` when the agent is root; a fresh name then a
    rename, as the key); returns the path. Raises EngineKeyError naming ``what``."""
    path = directory / name
    tmp = directory / f".{name}.{os.getpid()}"
    with _writing(what, path, tmp):
        owner = _owner(engine_user)
        _private_dir(directory, owner)
        # The dir may belong to the engine user: a fresh name, never a link it left there.
        _replace_fresh(path, tmp, data, owner)
    return path


def write_env_file(directory: Path, name: str, key: str) -> Path:
    """``<engine dir>/<backend>.env`` (env_file_path of the backend dir ``directory``) holding
    ``name=key``, for an engine that reads its key from the environment
    (``LaunchCommand.key_env``). 0600, owned by the agent (root under the system manager, which
    reads an ``EnvironmentFile=`` as root), in the agent's engine dir, not in the backend dir
    that the engine user owns (module docstring). Raises EngineKeyError."""
    if not _ENV_NAME.fullmatch(name) or "\n" in key:
        raise EngineKeyError(f"cannot put the engine key in variable {name!r}")
    path = env_file_path(directory)
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    with _writing("environment file", path, tmp):
        _agent_dir(path.parent)
        with contextlib.suppress(OSError):  # where an earlier version wrote it: the engine user's dir
            os.unlink(directory / ENV_FILE)
        _replace_fresh(path, tmp, f"{name}={key}\n".encode(), None)
    return path


def read_env_file(path: str | Path) -> dict[str, str]:
    """The ``NAME=value`` lines of an environment file written by write_env_file (blank
    lines and ``#`` comments skipped). Raises EngineKeyError naming the path and the cause."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
        with os.fdopen(fd, "rb") as f:
            text = f.read(65536).decode("utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise EngineKeyError(f"cannot read the engine environment file {path}: {getattr(exc, 'strerror', None) or exc}") from exc
    out: dict[str, str] = {}
    for line in text.splitlines():
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        name, sep, value = line.partition("=")
        if not sep or not _ENV_NAME.fullmatch(name):
            raise EngineKeyError(f"{path}: not a NAME=value line")
        out[name] = value
    return out


def read_key(directory: Path) -> str | None:
    """The key an earlier launch wrote to ``directory/key``; None when missing, unreadable or
    not a regular file of one link (``directory`` may belong to the engine user: a symlink, a
    FIFO or a hard link it put there is neither followed, waited on nor read)."""
    raw = read_private(directory / KEY_FILE, 4096)
    try:
        text = raw.decode("ascii").strip() if raw is not None else ""
    except UnicodeDecodeError:
        return None
    return text or None


def read_private(path: Path, limit: int) -> bytes | None:
    """At most ``limit`` bytes of ``path``, a file in a directory the engine user may own;
    None when missing, unreadable, larger than ``limit``, or not a regular file of one link
    (a symlink, a FIFO or a hard link put there is neither followed, waited on nor read)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC)
        with os.fdopen(fd, "rb") as f:
            info = os.fstat(f.fileno())
            if not stat.S_ISREG(info.st_mode) or info.st_nlink != 1:
                return None
            raw = f.read(limit + 1)
    except OSError:
        return None
    return raw if len(raw) <= limit else None


def auth_headers(key: str | None) -> dict[str, str]:
    """The header that carries ``key`` to its engine; empty when there is none."""
    return {"Authorization": f"Bearer {key}"} if key else {}
