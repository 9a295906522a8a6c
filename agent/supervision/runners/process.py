"""ProcessRunner: backends as child processes of the agent (hosts without systemd).

Each backend runs in its own session and process group (``start_new_session``), so a stop
signals the engine's whole group, not just its main process. A parent-death signal
(``prctl(PR_SET_PDEATHSIG, SIGKILL)``) makes the engine die with the agent: under this runner
nothing survives an agent restart, so ``adoptable`` is always empty (the systemd runner is
the one whose engines outlive the agent).

Limits of a plain process tree, which the systemd runner does not share: the parent-death
signal reaches the engine's main process only (children it forks survive an agent killed by
SIGKILL until the next stop of their group), and it fires when the *thread* that started the
engine ends, so the runner must be used from the agent's long-lived event-loop thread.

A request's ``firewall`` table is created (``nft``, which needs root: CAP_NET_ADMIN) before
the child starts and deleted once it has ended, whichever way; a start fails when it cannot
be created. An agent killed by SIGKILL leaves its tables behind: they admit only the gang's
hosts to the gang's ports (closed, not open), and the next start of that part replaces them.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import logging
import os
import shutil
import signal
import time
from collections.abc import Mapping
from pathlib import Path

from viiwork.agent.supervision.engine_keys import EngineKeyError, read_env_file
from viiwork.agent.supervision.runners.base import (
    BINARY_OPTIONS,
    ExitInfo,
    LaunchRequest,
    NftTable,
    RunHandle,
    RunnerError,
)
from viiwork.agent.supervision.runners.nft import nft_binary, run_nft

log = logging.getLogger(__name__)

_PR_SET_PDEATHSIG = 1
# After SIGKILL a process is gone within milliseconds unless it is stuck in the kernel
# (uninterruptible I/O); this bounds how long stop() waits for that before giving up.
_KILL_WAIT_S = 10.0


def _exit_info(returncode: int) -> ExitInfo:
    """asyncio's returncode (negative = killed by that signal) in systemd's vocabulary."""
    if returncode < 0:
        return ExitInfo(result="signal", signal=-returncode)
    if returncode == 0:
        return ExitInfo(result="success", returncode=0)
    return ExitInfo(result="exit-code", returncode=returncode)


def _parent_death_signal(parent_pid: int):
    """preexec_fn for the child: SIGKILL when the parent dies; exits if it already has."""
    libc = ctypes.CDLL(None, use_errno=True)

    def preexec() -> None:
        if libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
            os._exit(127)
        # The parent may have died between fork() and prctl(): then nobody will signal us.
        if os.getppid() != parent_pid:
            os._exit(127)

    return preexec


def _resolve_binary(argv0: str, env: Mapping[str, str]) -> str:
    """The executable's path; RunnerError naming the binary and the fix when it cannot run."""
    if "/" in argv0:
        path = Path(argv0)
        if not path.exists():
            raise RunnerError(f"binary not found: {argv0} ({BINARY_OPTIONS})")
        if path.is_dir() or not os.access(path, os.X_OK):
            raise RunnerError(f"binary not executable: {argv0} (check its permissions)")
        return argv0
    found = shutil.which(argv0, path=env.get("PATH", os.defpath))
    if found is None:
        raise RunnerError(
            f"binary not found: {argv0} is not on PATH (install it, or give its full path: {BINARY_OPTIONS})"
        )
    return found


class ProcessHandle:
    """One engine process started by ``ProcessRunner`` (a ``RunHandle``)."""

    unit: str | None = None

    def __init__(self, proc: asyncio.subprocess.Process, labels: Mapping[str, str], name: str,
                 firewall: tuple[NftTable, str] | None = None) -> None:
        self._proc = proc
        self._firewall = firewall
        self.pid: int | None = proc.pid
        self.labels: Mapping[str, str] = dict(labels)
        self.name = name
        self.started_at = time.monotonic()
        self._info: ExitInfo | None = None
        self._reaper = asyncio.create_task(self._reap(), name=f"reap {name} pid {proc.pid}")

    async def _reap(self) -> ExitInfo:
        returncode = await self._proc.wait()
        self._info = _exit_info(returncode)
        # The group outlives its leader when the engine forked workers: they die with it.
        self._signal_group(signal.SIGKILL)
        if self._firewall is not None:  # the unit's rules end with it
            table, nft = self._firewall
            try:
                await run_nft(table.delete_argv(nft))
            except RunnerError as exc:
                log.warning("engine %s: could not delete its nftables table %s: %s", self.name, table.name, exc)
        log.info("engine %s (pid %s) ended: %s", self.name, self.pid, self._info.describe())
        return self._info

    def _signal_group(self, sig: int) -> None:
        # start_new_session made the engine a session and group leader: pgid == pid.
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self._proc.pid, sig)

    def running(self) -> bool:
        return self._info is None

    async def wait(self) -> ExitInfo:
        """How the process ended; waits for it. Safe to call many times, and to cancel."""
        return await asyncio.shield(self._reaper)

    async def stop(self, grace_s: float) -> ExitInfo:
        """SIGTERM to the group, SIGKILL to the group after ``grace_s``; always reaped.

        Raises RunnerError when the process survives SIGKILL for 10 s (stuck in the kernel).
        """
        if self._info is not None:
            return self._info
        self._signal_group(signal.SIGTERM)
        try:
            async with asyncio.timeout(grace_s):
                return await self.wait()
        except TimeoutError:
            log.warning("engine %s (pid %s) ignored SIGTERM for %.1f s: SIGKILL", self.name, self.pid, grace_s)
        self._signal_group(signal.SIGKILL)
        try:
            async with asyncio.timeout(_KILL_WAIT_S):
                return await self.wait()
        except TimeoutError:
            raise RunnerError(
                f"engine {self.name} (pid {self.pid}) survived SIGKILL for {_KILL_WAIT_S:.0f} s"
            ) from None

    async def aclose(self) -> None:
        """Cancel the reaper (only for a handle whose process is known gone)."""
        if not self._reaper.done():
            self._reaper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._reaper


class ProcessRunner:
    """Runs backends as child processes (see the module docstring). Implements ``Runner``."""

    name = "process"

    async def start(self, request: LaunchRequest) -> RunHandle:
        """Start ``request.argv`` with exactly ``request.env``, output appended to ``log_path``.

        Raises RunnerError when the binary is missing or not executable, or the log file or
        the process cannot be created; the message names the cause.
        """
        if not request.argv:
            raise RunnerError(f"{request.name}: empty command line")
        binary = _resolve_binary(request.argv[0], request.env)
        env = dict(request.env)
        if request.environment_file:  # the key, in the child's environment only
            try:
                env.update(read_env_file(request.environment_file))
            except EngineKeyError as exc:
                raise RunnerError(f"{request.name}: {exc}") from exc
        log_file = None
        if request.log_path is not None:
            try:
                Path(request.log_path).parent.mkdir(parents=True, exist_ok=True)
                log_file = open(request.log_path, "ab")  # noqa: SIM115 - closed below
                stamp = time.strftime("%Y-%m-%d %H:%M:%S")
                log_file.write(f"--- viiwork: {stamp} starting {' '.join(request.argv)}\n".encode())
                log_file.flush()
            except OSError as exc:
                if log_file is not None:
                    log_file.close()
                raise RunnerError(f"cannot open engine log {request.log_path}: {exc.strerror or exc}") from exc
        out = log_file if log_file is not None else asyncio.subprocess.DEVNULL
        firewall = None
        if request.firewall is not None:
            try:
                firewall = (request.firewall, nft_binary())
                await run_nft(request.firewall.apply_argv(firewall[1]))
            except RunnerError as exc:
                if log_file is not None:
                    log_file.close()
                hint = ("" if os.geteuid() == 0 else " (the process runner loads them as the agent's user, which "
                        "must be root: use the systemd runner, or set the model's gang_firewall = false)")
                raise RunnerError(f"{request.name}: its nftables rules: {exc}{hint}") from None
        try:
            proc = await asyncio.create_subprocess_exec(
                binary, *request.argv[1:],
                stdin=asyncio.subprocess.DEVNULL,
                stdout=out,
                stderr=asyncio.subprocess.STDOUT,
                env=env,
                start_new_session=True,
                preexec_fn=_parent_death_signal(os.getpid()),
            )
        except OSError as exc:
            if firewall is not None:
                with contextlib.suppress(RunnerError):
                    await run_nft(firewall[0].delete_argv(firewall[1]))
            raise RunnerError(f"cannot start {request.argv[0]}: {exc.strerror or exc}") from exc
        finally:
            if log_file is not None:
                log_file.close()
        log.info("started engine %s: pid %s, log %s", request.name, proc.pid, request.log_path)
        return ProcessHandle(proc, request.labels, request.name, firewall)

    async def adoptable(self, owner: str, prefix: str = "viiwork-engine-") -> list[RunHandle]:
        """Always []: process backends die with the agent (parent-death signal)."""
        return []

    async def close(self) -> None:
        """Nothing to release: the backends are stopped through their handles."""
