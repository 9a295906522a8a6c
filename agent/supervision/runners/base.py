"""The runner interface: start, watch and stop one backend process (docs/architecture.md, "A backend's life").

Two runners implement it: ``ProcessRunner`` (asyncio subprocess in its own process group,
dies with the agent) and ``SystemdRunner`` (transient units over D-Bus, survive the agent).
The supervisor only speaks this interface; nothing above it knows which runner it has.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable


@dataclass(frozen=True, slots=True)
class ExitInfo:
    """How a backend ended.

    result: systemd's vocabulary ("success", "exit-code", "signal", "core-dump", "timeout",
    "watchdog", "oom-kill", "start-failed", "resources"); returncode: exit status when it
    exited, else None; signal: the terminating signal number, else None.
    """

    result: str
    returncode: int | None = None
    signal: int | None = None
    detail: str = ""

    def describe(self) -> str:
        if self.signal is not None:
            text = f"{self.result} (signal {self.signal})"
        elif self.returncode is not None:
            text = f"{self.result} (status {self.returncode})"
        else:
            text = self.result
        return f"{text}: {self.detail}" if self.detail else text


@dataclass(frozen=True, slots=True)
class NftTable:
    """An nftables table of a unit's own: ``family`` and ``name`` (what ``nft delete table``
    takes) and ``ruleset``, nft's input that creates it, replacing a table of that name."""

    family: str
    name: str
    ruleset: str

    def apply_argv(self, nft: str) -> tuple[str, ...]:
        """``nft <ruleset>``: nft parses its arguments as one script, atomically."""
        return (nft, self.ruleset)

    def delete_argv(self, nft: str) -> tuple[str, ...]:
        return (nft, "delete", "table", self.family, self.name)


@dataclass(frozen=True, slots=True)
class LaunchRequest:
    """What to run for one backend.

    name: the unit name stem (``viiwork-engine-<node>-<model>-<n>``, escaped by the runner).
    labels: recorded with the process/unit and returned on adoption (owner node, model,
    backend index, config hash). log_path: where the process runner writes output.
    Limits are applied where the runner can (systemd), else ignored and reported.
    private_dir: the backend's own directory (its key file and socket: agent/supervision/engine_keys.py),
    which the engine must be able to write even in a sandbox that makes the rest read-only.
    environment_file: a file of ``NAME=value`` lines (the backend's key for an engine that
    reads it from the environment: agent/supervision/engine_keys.py) that the runner adds to the engine's
    environment without showing it: systemd's ``EnvironmentFile=`` (read by the manager, as
    root for the system one), the process runner in the child's environment only.
    firewall: nftables rules the unit owns (a gang part's: agent/gang/firewall.py): created
    before the engine starts and deleted when it stops, whichever way (the systemd runner's
    privileged ``ExecStartPre=``/``ExecStopPost=``; the process runner around its child).
    """

    name: str
    argv: tuple[str, ...]
    env: Mapping[str, str]
    description: str
    labels: Mapping[str, str] = field(default_factory=dict)
    log_path: str | None = None
    stop_timeout_s: float = 10.0
    memory_max_bytes: int | None = None
    cpu_weight: int | None = None
    tasks_max: int | None = None
    sandbox: str | None = None
    private_dir: str | None = None
    environment_file: str | None = None
    firewall: NftTable | None = None


@runtime_checkable
class RunHandle(Protocol):
    """A running (or finished) backend.

    ``pid``: main PID as the runner reports it, or None. ``unit``: unit name or None.
    """

    pid: int | None
    unit: str | None
    labels: Mapping[str, str]

    async def wait(self) -> ExitInfo:
        """Resolve when the backend has ended (any reason). Safe to call many times."""
        ...

    async def stop(self, grace_s: float) -> ExitInfo:
        """SIGTERM to the whole tree, SIGKILL after ``grace_s``; returns how it ended."""
        ...

    def running(self) -> bool: ...


@runtime_checkable
class Runner(Protocol):
    """Starts backends; lists the ones still running from an earlier agent (adoption)."""

    name: str

    async def start(self, request: LaunchRequest) -> RunHandle:
        """Launch; raises RunnerError when it cannot start at all (binary missing...)."""
        ...

    async def adoptable(self, owner: str, prefix: str = "viiwork-engine-") -> Sequence[RunHandle]:
        """Running backends labelled with ``owner`` left by an earlier agent, among the units
        whose names start with ``prefix`` (a gang's parts: ``viiwork-gang-``); [] if none."""
        ...

    async def close(self) -> None:
        """Release the runner's own resources (not the backends)."""
        ...


#: Where a binary the runner cannot find is set: the engine's table of the model's entry.
BINARY_OPTIONS = ("the model's [models.<engine>] `binary`; a gang's llama.cpp worker part: `rpc_binary`, "
                  "a vLLM gang's Ray runtime: `ray_binary`")


class RunnerError(Exception):
    """A backend could not be started; the message names the cause and the fix."""
