"""Local model files (exist, readable) and the free space of the file systems the agent writes to."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from viiwork.agent.config.schema import Config


@dataclass(frozen=True, slots=True)
class ModelPathFact:
    """A model's ``path`` when it is a local path (absolute, or starting with ./ ~/):
    ``exists``/``readable`` by the user running the gathering. Hub ids are not local."""

    model: str
    index: int
    path: str
    exists: bool
    readable: bool


def _is_local(path: str) -> bool:
    return path.startswith(("/", "./", "../", "~"))


def read_model_paths(config: Config) -> tuple[ModelPathFact, ...]:
    """One fact per model whose ``path`` is local, in config order (``index`` is its place)."""
    out = []
    for i, model in enumerate(config.models):
        if not _is_local(model.path):
            continue
        p = Path(model.path).expanduser()
        exists = p.exists()
        out.append(ModelPathFact(model.name, i, model.path, exists, exists and os.access(p, os.R_OK)))
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
