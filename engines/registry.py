"""The engine registry: engine name -> adapter instance.

Adding an engine is one package under ``engines/`` plus one line in ``_ENGINE_CLASSES``.
A duplicate or empty name fails at import, so a broken registry never reaches a config.
"""

from __future__ import annotations

from collections.abc import Iterable

from viiwork.engines.contract import Engine
from viiwork.engines.llamacpp import LlamaCppEngine
from viiwork.engines.sglang import SglangEngine
from viiwork.engines.vllm import VllmEngine

_ENGINE_CLASSES: tuple[type, ...] = (
    LlamaCppEngine,
    VllmEngine,
    SglangEngine,
)


class RegistryError(Exception):
    """The registry itself is inconsistent (duplicate or empty engine name)."""


def build_registry(classes: Iterable[type]) -> dict[str, Engine]:
    """Instantiate each adapter class and index it by ``name``.

    Raises RegistryError on an empty, non-lowercase or duplicate name.
    """
    registry: dict[str, Engine] = {}
    for cls in classes:
        name = getattr(cls, "name", "")
        if not isinstance(name, str) or not name:
            raise RegistryError(f"engine class {cls.__qualname__} has an empty name")
        if name != name.lower():
            raise RegistryError(f"engine name {name!r} must be lowercase")
        if name in registry:
            raise RegistryError(
                f"engine name {name!r} registered twice "
                f"({type(registry[name]).__qualname__} and {cls.__qualname__})"
            )
        registry[name] = cls()
    return registry


ENGINES: dict[str, Engine] = build_registry(_ENGINE_CLASSES)


def engine_names() -> list[str]:
    """Sorted names of the registered engines."""
    return sorted(ENGINES)


def get_engine(name: str) -> Engine:
    """The adapter for ``name``; KeyError naming the known engines otherwise."""
    try:
        return ENGINES[name]
    except KeyError:
        raise KeyError(f"unknown engine {name!r}; known engines: {', '.join(engine_names())}") from None
