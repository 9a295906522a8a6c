"""Local model files (exist, readable) and the free space of the file systems the agent writes to."""

from __future__ import annotations

import os
import stat
from dataclasses import dataclass
from pathlib import Path

from viiwork.agent.config.gang import GangConfigError, needs_model_file
from viiwork.agent.config.load import file_kind
from viiwork.agent.config.schema import Config
from viiwork.engines.contract import takes_model_directory
from viiwork.engines.registry import get_engine


@dataclass(frozen=True, slots=True)
class ModelPathFact:
    """A model's ``path`` when it is a local path (absolute, or starting with ./ ~/):
    ``exists``/``readable`` by the user running the gathering. Hub ids are not local.

    kind: ``"file"`` (regular, after symlinks), ``"directory"``, what else it is in words
    (``file_kind``: "a FIFO (named pipe)", "a character device"...), ``""`` when missing.
    size_bytes: a file's size (0 for /proc files such as /proc/self/mem), -1 otherwise.
    directory_ok: the model's engine takes a directory (``takes_model_directory``)."""

    model: str
    index: int
    path: str
    exists: bool
    readable: bool
    kind: str = "file"
    size_bytes: int = -1
    directory_ok: bool = False


def _is_local(path: str) -> bool:
    return path.startswith(("/", "./", "../", "~"))


def read_model_paths(config: Config, node_id: str | None = None) -> tuple[ModelPathFact, ...]:
    """One fact per model whose ``path`` is local and that this host reads, in config order
    (``index`` is its place). A gang's entry is left out on a host that does not read the file
    (``needs_model_file``: a llama.cpp worker, a host the entry does not name); ``node_id``:
    this node's id, None when unknown (a gang's hosts are then matched by name only).
    Only ``stat``s the path (following symlinks): never opens it, so a FIFO cannot block."""
    out = []
    for i, model in enumerate(config.models):
        if not _is_local(model.path):
            continue
        try:
            if not needs_model_file(model, node_id, config.node.name):
                continue
        except GangConfigError:
            pass  # named twice: checked as if read (the agent reports the hosts error)
        p = Path(model.path).expanduser()
        try:
            st = p.stat()
        except (OSError, ValueError):  # missing, a dangling symlink, a loop, a name too long
            out.append(ModelPathFact(model.name, i, model.path, False, False, kind=""))
            continue
        kind = "file" if stat.S_ISREG(st.st_mode) else "directory" if stat.S_ISDIR(st.st_mode) \
            else file_kind(st.st_mode)
        out.append(ModelPathFact(model.name, i, model.path, True, os.access(p, os.R_OK), kind=kind,
                                 size_bytes=st.st_size if kind == "file" else -1,
                                 directory_ok=takes_model_directory(get_engine(model.engine))))
    return tuple(out)


@dataclass(frozen=True, slots=True)
class DiskFact:
    """Free space of one filesystem: ``roles`` say what lives there ("state dir /var/lib/viiwork").

    path: the existing directory measured (the nearest existing ancestor of the configured one).
    free_bytes: available to unprivileged users (statvfs f_bavail). total_bytes: size.
    """

    roles: tuple[str, ...]
    path: str
    free_bytes: int
    total_bytes: int


def _existing_ancestor(path: Path) -> Path:
    path = path.expanduser()
    if not path.is_absolute():
        path = Path.cwd() / path
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def read_disks(config: Config) -> tuple[DiskFact, ...]:
    """Free space where the agent keeps state and logs and where local models live."""
    places: list[tuple[str, Path]] = [(f"state dir {config.node.state_dir}", config.node.state_dir)]
    if config.supervisor.log_dir is not None:
        places.append((f"log dir {config.supervisor.log_dir}", config.supervisor.log_dir))
    for model in config.models:
        if _is_local(model.path):
            p = Path(model.path).expanduser()
            places.append((f"model {model.name}", p if p.is_dir() else p.parent))
    by_device: dict[int, tuple[list[str], Path, os.statvfs_result]] = {}
    for role, place in places:
        existing = _existing_ancestor(Path(place))
        device = existing.stat().st_dev
        if device not in by_device:
            by_device[device] = ([], existing, os.statvfs(existing))
        by_device[device][0].append(role)
    return tuple(
        DiskFact(tuple(roles), str(path), st.f_bavail * st.f_frsize, st.f_blocks * st.f_frsize)
        for roles, path, st in by_device.values()
    )
