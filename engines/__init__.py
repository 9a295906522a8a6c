"""Engine adapters and their contract (docs/engines.md, "The contract").

Public surface: the contract types, and ``registry`` (``get_engine``, ``engine_names``).
"""

from viiwork.engines.contract import (
    BackendSpec,
    BoundGPU,
    Engine,
    EngineError,
    EngineOptionsError,
    EngineUnavailable,
    Kind,
    LaunchCommand,
    Load,
    LoadUnknown,
    NoOptions,
    Probe,
    ReasoningSeparation,
    RunsOnCPU,
    UsageReporting,
    Version,
    WarmUp,
)

__all__ = [
    "BackendSpec",
    "BoundGPU",
    "Engine",
    "EngineError",
    "EngineOptionsError",
    "EngineUnavailable",
    "Kind",
    "LaunchCommand",
    "Load",
    "LoadUnknown",
    "NoOptions",
    "Probe",
    "ReasoningSeparation",
    "RunsOnCPU",
    "UsageReporting",
    "Version",
    "WarmUp",
]
