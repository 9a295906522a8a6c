"""CI cannot pass by skipping: under CI=true an unlisted skip, skipif, xfail or xpass fails
(tests/conftest.py hooks, tests/skip-allowlist.toml), run in a real inner pytest."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import REPO, SKIP_ALLOWLIST, load_skip_allowlist, skip_allowed

INNER = '''
import pytest
def test_runs(): pass
def test_skip_call(): pytest.skip("no tier here")
@pytest.mark.skipif(True, reason="never here")
def test_skipif(): pass
@pytest.mark.xfail(reason="broken")
def test_xfail(): assert 0
@pytest.mark.xfail(reason="flaky")
def test_xpass(): pass
'''


def run_inner(tmp_path: Path, ci: str | None) -> subprocess.CompletedProcess:
    (tmp_path / "test_inner.py").write_text(INNER)
    env = {k: v for k, v in os.environ.items() if k != "CI"}
    if ci is not None:
        env["CI"] = ci
    # The project's conftest as a plugin, on a test file outside tests/ (its node ids are
    # relative to tmp_path, so none of them is in the allowlist).
    return subprocess.run([sys.executable, "-m", "pytest", "-p", "conftest", "-c", str(REPO / "pyproject.toml"),
                           "--rootdir", str(tmp_path), str(tmp_path / "test_inner.py"), "-q", "--no-header", "-rA"],
                          capture_output=True, text=True, env=env, cwd=tmp_path, timeout=60)


def test_unlisted_skips_and_xfails_fail_under_ci(tmp_path: Path) -> None:
    run = run_inner(tmp_path, "true")
    assert run.returncode == 1, run.stdout + run.stderr
    # A skipif is decided at setup, so it is reported as an error there; the rest as failures.
    assert "3 failed, 1 passed, 1 error" in run.stdout, run.stdout
    for name, what in (("test_skip_call", "skipped (no tier here)"), ("test_skipif", "skipped (never here)"),
                       ("test_xfail", "xfail (broken)"), ("test_xpass", "marked xfail (flaky) and passed")):
        assert f"CI=true: {what}, and test_inner.py::{name} is not listed in tests/skip-allowlist.toml" in run.stdout


def test_without_ci_skips_stay_skips(tmp_path: Path) -> None:
    run = run_inner(tmp_path, None)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "1 passed, 2 skipped, 1 xfailed, 1 xpassed" in run.stdout


def test_the_allowlist_names_existing_tests_with_reasons() -> None:
    allowed = load_skip_allowlist()
    assert allowed, "the opt-in vLLM test is listed"
    for nodeid in allowed:
        path, name = nodeid.split("::", 1)
        source = (REPO / path).read_text()
        assert f"def {name.split('[', 1)[0]}(" in source, f"{SKIP_ALLOWLIST.name} names a missing test: {nodeid}"
    assert skip_allowed(next(iter(allowed)) + "[case]", allowed)
    assert not skip_allowed("tests/x.py::other", allowed)


@pytest.mark.parametrize("text, problem", [
    ("[[allow]]\ntest = 'tests/a.py::t'\n", "non-empty `reason`"),
    ("[[allow]]\ntest = 'tests/a.py'\nreason = 'r'\n", "a node id with ::"),
    ("[[allow]]\ntest = 'tests/a.py::t'\nreason = 'r'\n[[allow]]\ntest = 'tests/a.py::t'\nreason = 'r'\n",
     "listed twice"),
    ("allow = 3 x", "cannot read"),
])
def test_a_malformed_allowlist_is_an_error_naming_the_file(tmp_path: Path, text: str, problem: str) -> None:
    path = tmp_path / "allow.toml"
    path.write_text(text)
    with pytest.raises(ValueError, match=problem) as exc:
        load_skip_allowlist(path)
    assert str(path) in str(exc.value)
