"""Start and stop real processes for tests: free ports, readiness polling, cleanup."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path

from support.engines import FAKE_ENGINE


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_http(url: str, timeout_s: float = 20.0, want: int = 200, proc: subprocess.Popen | None = None) -> None:
    """Poll ``url`` until it answers ``want``; raises TimeoutError (or if ``proc`` exits)."""
    deadline = time.monotonic() + timeout_s
    last: object = None
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"process exited with {proc.returncode} while waiting for {url}")
        try:
            with urllib.request.urlopen(url, timeout=1) as resp:
                if resp.status == want:
                    return
                last = resp.status
        except urllib.error.HTTPError as exc:
            last = exc.code
            if exc.code == want:
                return
        except (urllib.error.URLError, OSError) as exc:
            last = exc
        time.sleep(0.05)
    raise TimeoutError(f"{url} did not answer {want} within {timeout_s} s (last: {last})")


def stop_process(proc: subprocess.Popen, grace_s: float = 5.0) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(grace_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)


@contextmanager
def fake_engine(alias: str = "m", parallel: int = 2, env: Mapping[str, str] | None = None,
                embedding: bool = False, ctx_size: int = 4096, log: Path | None = None) -> Iterator[int]:
    """Run the fake llama-server on a free loopback port until ready; yields the port."""
    port = free_port()
    argv = [sys.executable, str(FAKE_ENGINE), "--alias", alias, "--port", str(port), "--host", "127.0.0.1",
            "--parallel", str(parallel), "--ctx-size", str(ctx_size), "--metrics"]
    if embedding:
        argv.append("--embedding")
    full_env = {**os.environ, "FAKE_LOAD_S": "0", **(env or {})}
    out = open(log, "ab") if log else subprocess.DEVNULL
    proc = subprocess.Popen(argv, env=full_env, stdout=out, stderr=out)
    try:
        wait_http(f"http://127.0.0.1:{port}/health", proc=proc)
        yield port
    finally:
        stop_process(proc)
        if log:
            out.close()
