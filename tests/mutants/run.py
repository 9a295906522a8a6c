"""``make mutants``: each patch in this folder breaks the code on purpose; the tests it names
must notice.

A patch is a unified diff (``git diff`` of the mutated file, applied with ``patch -p1`` from
the repository root) whose first two lines are comments::

    # tests: tests/mesh/test_x.py::test_one tests/unit/test_y.py::test_two
    # why: what the mutation breaks, in one line

For each patch the working tree (without .git, .venv and caches) is copied to a scratch
folder, the patch is applied there (exactly: its context lines must match, at any offset; a
patch that needs fuzz has drifted from the code and could mutate the wrong line, so it does
not apply) and the named tests are run against the copy; the mutant
is **killed** when at least one of them fails, **survived** when they all pass. pytest
imports ``viiwork`` from the copy, not from the editable install (which points at the
original ``agent/``, ``mesh/`` and ``engines/`` folders): the copy's ``viiwork/`` folder gets
links ``agent``, ``mesh``, ``engines`` to the copy's folders and the copy goes first on
PYTHONPATH, which the agents the tests start inherit (and the copy is the working directory,
which ``python -m`` puts first). setuptools' editable finder sits at the end of
``sys.meta_path``, after the path finder, so the copy wins; each run checks that it does.

First (unless ``--no-baseline``) the named tests of every selected patch run once on an
unpatched copy: they must pass there, or a "killed" would prove nothing.

Prints a table (patch, result, seconds, first failing test) and exits 1 when any mutant
survived, did not apply, or could not be run (no such test, a timeout, a baseline failure).

``--check`` only tries each patch against the working tree (no copy, no tests: seconds) and
lists those that do not apply.

Usage: ``python tests/mutants/run.py [--only NAME,...] [--jobs N] [--timeout S] [--no-baseline] [--check]``
"""

from __future__ import annotations

import argparse
import concurrent.futures
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
#: What the scratch copy leaves out (besides the ignored names below, at any depth).
TOP_LEVEL_EXCLUDED = {".git", ".venv", ".bench-venv", "build", "dist", ".cache", ".whl", ".gl", ".hypothesis",
                      ".mutants"}
#: Where the scratch copies go: inside the checkout, not under /tmp, because engine units with
#: PrivateTmp= and containers with a fresh /tmp cannot see /tmp (the systemd tiers would skip).
SCRATCH_PARENT = REPO / ".mutants"
SKIPPED = re.compile(r"(\d+) skipped")
IGNORED = shutil.ignore_patterns("__pycache__", "*.pyc", "*.egg-info", ".pytest_cache")
#: The import packages mapped from top-level folders (pyproject.toml, [tool.setuptools] package-dir).
MAPPED = ("agent", "mesh", "engines")
FAILED_LINE = re.compile(r"^(?:FAILED|ERROR) (\S+)", re.MULTILINE)


class PatchError(ValueError):
    """A patch file without its two header lines."""


@dataclass(frozen=True)
class Mutant:
    path: Path
    tests: tuple[str, ...]
    why: str

    @property
    def name(self) -> str:
        return self.path.stem

    @classmethod
    def read(cls, path: Path) -> Mutant:
        """Parse the header; raises PatchError naming the file when a line is missing or empty."""
        lines = path.read_text().splitlines()
        first = lines[0] if lines else ""
        second = lines[1] if len(lines) > 1 else ""
        if not first.startswith("# tests:") or not first.removeprefix("# tests:").split():
            raise PatchError(f"{path.name}: the first line must be '# tests: <node ids>', got {first!r}")
        if not second.startswith("# why:") or not second.removeprefix("# why:").strip():
            raise PatchError(f"{path.name}: the second line must be '# why: <one line>', got {second!r}")
        return cls(path, tuple(first.removeprefix("# tests:").split()), second.removeprefix("# why:").strip())


@dataclass
class Outcome:
    name: str
    result: str  # killed | survived | not applied | error | timeout
    seconds: float
    detail: str = ""


def copy_tree(dest: Path) -> Path:
    """The working tree (tracked and untracked files, not .git/.venv/caches) at ``dest/tree``,
    its ``viiwork/`` folder completed with links to the mapped folders. Returns the tree."""
    tree = dest / "tree"
    tree.mkdir(parents=True)
    for entry in REPO.iterdir():
        if entry.name in TOP_LEVEL_EXCLUDED or entry.name.endswith(".egg-info"):
            continue
        target = tree / entry.name
        if entry.is_dir() and not entry.is_symlink():
            shutil.copytree(entry, target, symlinks=True, ignore=IGNORED)
        else:
            shutil.copy2(entry, target, follow_symlinks=False)
    for folder in MAPPED:
        (tree / "viiwork" / folder).symlink_to(tree / folder, target_is_directory=True)
    return tree


def test_env(tree: Path) -> dict[str, str]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tree), *filter(None, [os.environ.get("PYTHONPATH")])])}
    env.pop("PYTEST_ADDOPTS", None)
    return env


def check_imports_from(tree: Path) -> None:
    """Raise RuntimeError unless ``viiwork.agent/.mesh/.engines`` import from ``tree``."""
    probe = "import viiwork.agent, viiwork.mesh, viiwork.engines as e, sys; " \
            "print('\\n'.join(m.__file__ for m in (viiwork.agent, viiwork.mesh, e)))"
    done = subprocess.run([sys.executable, "-c", probe], cwd=tree, env=test_env(tree), capture_output=True,
                          text=True, timeout=60)
    files = done.stdout.split()
    if done.returncode != 0 or len(files) != 3 or not all(Path(f).is_relative_to(tree) for f in files):
        raise RuntimeError(f"the scratch copy's code is not what imports: {done.stdout.strip()} {done.stderr.strip()}")


def run_tests(tree: Path, tests: tuple[str, ...], timeout_s: float) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pytest", *tests, "-x", "-q", "--no-header", "-rfEs"],
                          cwd=tree, env=test_env(tree), capture_output=True, text=True, timeout=timeout_s)


def apply_patch(tree: Path, patch: Path, *, dry_run: bool = False) -> str | None:
    """Apply ``patch`` in ``tree`` without fuzz (``dry_run``: only check that it would);
    None on success, else patch's complaint."""
    done = subprocess.run(["patch", "-p1", "--batch", "--forward", "--fuzz=0", "--no-backup-if-mismatch",
                           *(["--dry-run"] if dry_run else []), "-i", str(patch)],
                          cwd=tree, capture_output=True, text=True, timeout=60)
    if done.returncode != 0:
        return (done.stdout + done.stderr).strip().splitlines()[-1] if (done.stdout + done.stderr).strip() else \
            f"patch exited {done.returncode}"
    return None


def try_mutant(mutant: Mutant, scratch: Path, timeout_s: float) -> Outcome:
    started = time.monotonic()
    work = Path(tempfile.mkdtemp(prefix=f"{mutant.name}-", dir=scratch))
    try:
        tree = copy_tree(work)
        try:
            check_imports_from(tree)
        except RuntimeError as exc:
            return Outcome(mutant.name, "error", time.monotonic() - started, str(exc))
        complaint = apply_patch(tree, mutant.path)
        if complaint is not None:
            return Outcome(mutant.name, "not applied", time.monotonic() - started, complaint)
        try:
            run = run_tests(tree, mutant.tests, timeout_s)
        except subprocess.TimeoutExpired:
            return Outcome(mutant.name, "timeout", time.monotonic() - started, f"tests still running after {timeout_s:.0f} s")
        seconds = time.monotonic() - started
        if run.returncode == 0:
            return Outcome(mutant.name, "survived", seconds, "every named test passed")
        if run.returncode == 1:
            failed = FAILED_LINE.findall(run.stdout)
            return Outcome(mutant.name, "killed", seconds, failed[0] if failed else "a test failed")
        tail = (run.stdout + run.stderr).strip().splitlines()[-3:]
        return Outcome(mutant.name, "error", seconds, f"pytest exited {run.returncode}: " + " | ".join(tail))
    finally:
        shutil.rmtree(work, ignore_errors=True)


def baseline(mutants: list[Mutant], scratch: Path, timeout_s: float) -> Outcome:
    """The union of the named tests on an unpatched copy: they must all pass."""
    started = time.monotonic()
    tests = tuple(dict.fromkeys(t for m in mutants for t in m.tests))
    work = Path(tempfile.mkdtemp(prefix="baseline-", dir=scratch))
    try:
        tree = copy_tree(work)
        try:
            check_imports_from(tree)
        except RuntimeError as exc:
            return Outcome("(unpatched)", "error", time.monotonic() - started, str(exc))
        try:
            done = run_tests(tree, tests, timeout_s)
        except subprocess.TimeoutExpired:
            return Outcome("(unpatched)", "timeout", time.monotonic() - started)
        seconds = time.monotonic() - started
        skipped = SKIPPED.search(done.stdout)
        if done.returncode == 0 and skipped:
            # A named test that skips here would "survive" every mutant without running.
            return Outcome("(unpatched)", "error", seconds, f"{skipped.group(1)} named test(s) skipped: "
                           "run where their tier can run (root, systemd, netns)")
        if done.returncode == 0:
            return Outcome("(unpatched)", "passed", seconds, f"{len(tests)} tests")
        failed = FAILED_LINE.findall(done.stdout)
        tail = (done.stdout + done.stderr).strip().splitlines()[-3:]
        return Outcome("(unpatched)", "error", seconds,
                       f"fails without a mutation: {failed[0]}" if failed else " | ".join(tail))
    finally:
        shutil.rmtree(work, ignore_errors=True)


def print_table(rows: list[Outcome]) -> None:
    width = max([len("patch"), *(len(r.name) for r in rows)])
    print(f"{'patch':<{width}}  {'result':<11}  {'seconds':>7}  detail")
    for r in rows:
        print(f"{r.name:<{width}}  {r.result:<11}  {r.seconds:7.1f}  {r.detail}")


def check_only(mutants: list[Mutant]) -> int:
    """``--check``: each patch tried (dry run) against the working tree; 1 when any does not apply."""
    rows = []
    for m in mutants:
        started = time.monotonic()
        complaint = apply_patch(REPO, m.path, dry_run=True)
        rows.append(Outcome(m.name, "applies" if complaint is None else "not applied", time.monotonic() - started,
                            complaint or ""))
    bad = [r.name for r in rows if r.result != "applies"]
    if bad:
        print_table([r for r in rows if r.result != "applies"])
        print(f"\n{len(bad)} of {len(mutants)} patches do not apply: {', '.join(bad)}", file=sys.stderr)
        return 1
    print(f"all {len(mutants)} patches apply")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", default="", help="comma-separated patch names (without .patch)")
    parser.add_argument("--jobs", type=int, default=1, help="mutants run at once (default 1)")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds per mutant's test run (default 600)")
    parser.add_argument("--no-baseline", action="store_true", help="skip the run on the unpatched tree")
    parser.add_argument("--check", action="store_true", help="only check that each patch applies (no tests)")
    args = parser.parse_args(argv)

    paths = sorted(HERE.glob("*.patch"))
    if args.only:
        wanted = {n.strip().removesuffix(".patch") for n in args.only.split(",") if n.strip()}
        unknown = wanted - {p.stem for p in paths}
        if unknown:
            print(f"no such patch in {HERE}: {', '.join(sorted(unknown))}", file=sys.stderr)
            return 2
        paths = [p for p in paths if p.stem in wanted]
    if not paths:
        print(f"no patches in {HERE}", file=sys.stderr)
        return 2
    try:
        mutants = [Mutant.read(p) for p in paths]
    except PatchError as exc:
        print(exc, file=sys.stderr)
        return 2

    if args.check:
        return check_only(mutants)
    rows: list[Outcome] = []
    SCRATCH_PARENT.mkdir(exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="viiwork-mutants-", dir=SCRATCH_PARENT) as tmp:
        scratch = Path(tmp)
        if not args.no_baseline:
            base = baseline(mutants, scratch, args.timeout)
            rows.append(base)
            if base.result != "passed":
                print_table(rows)
                print("the named tests fail without any mutation: fix them first", file=sys.stderr)
                return 1
        with concurrent.futures.ThreadPoolExecutor(max(1, args.jobs)) as pool:
            futures = [pool.submit(try_mutant, m, scratch, args.timeout) for m in mutants]
            for m, future in zip(mutants, futures, strict=True):
                outcome = future.result()
                rows.append(outcome)
                print(f"{outcome.name}: {outcome.result} ({outcome.seconds:.1f} s) - {m.why}", flush=True)
    print()
    print_table(rows)
    bad = [r for r in rows if r.result not in ("killed", "passed")]
    if bad:
        print(f"\n{len(bad)} of {len(mutants)} mutants not killed: {', '.join(r.name for r in bad)}", file=sys.stderr)
        return 1
    print(f"\nall {len(mutants)} mutants killed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
