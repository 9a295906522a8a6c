"""Engine adapters and their contract (docs/engines.md, "The contract").

Public surface: the contract types, the gang types (``gang``: one model across hosts; the
launch plan is ``gang_plan``), and ``registry`` (``get_engine``, ``engine_names``).
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
from viiwork.engines.gang import GangAddresses, GangEngine, GangPart, LaunchShape, PartRole

__all__ = [
    "BackendSpec",
    "BoundGPU",
    "Engine",
    "EngineError",
    "EngineOptionsError",
    "EngineUnavailable",
    "GangAddresses",
    "GangEngine",
    "GangPart",
    "Kind",
    "LaunchShape",
    "LaunchCommand",
    "Load",
    "LoadUnknown",
    "NoOptions",
    "PartRole",
    "Probe",
    "ReasoningSeparation",
    "RunsOnCPU",
    "UsageReporting",
    "Version",
    "WarmUp",
]
