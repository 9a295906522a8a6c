"""``make bench``: run every benchmark under tests/bench/ and write docs/benchmarks.md.

usage: .venv/bin/python tests/bench/run_all.py [--only NAME[,NAME]] [--out docs/benchmarks.md]
       [--budget-s 1140] [--no-install] [--baseline REV]

Each ``tests/bench/bench_*.py`` runs as its own process with its own time budget (the table
below; 90 s for a script not listed), in the order listed, under one overall budget (19 min
by default, so the whole stays under 20 minutes with the venv already built). A benchmark
that fails or runs out of time is recorded in the document with its exit status and the tail
of its output, and the runner goes on. Output of a benchmark: the file it was told to write
with ``--out`` when it takes one, else what it printed. ``docs/benchmarks-*.md`` (documents
kept by the owners of the mesh, routing and packaging work) are appended, each with its date.

A/B (issue 15): when the working tree has uncommitted changes, ``bench_overhead.py`` also runs
HEAD's agent (``--baseline HEAD``, from a git worktree) in the same rounds as this tree's, so
one run compares the change with the commit before it; ``--baseline REV`` names another commit
(e.g. ``HEAD~1`` once the change is committed), ``--baseline ''`` turns it off.

Tools only the benchmarks need are kept out of the product's dependencies:
- ``.bench-venv/`` (created here): LiteLLM's proxy (``litellm[proxy]==1.108.7``) and py-spy;
- Debian packages ``wrk`` and ``nginx`` (``nginx-light`` is enough): installed with apt-get
  when missing and running as root, with service starts blocked by a temporary
  ``policy-rc.d`` (the host's nginx service is never started or touched); otherwise the
  rows that need them say so.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
BENCH_VENV = ROOT / ".bench-venv"
# sglang-router: the cache-aware router bench_prefix_routing.py compares against (issue 18).
BENCH_REQUIREMENTS = ["litellm[proxy]==1.108.7", "py-spy==0.4.3", "sglang-router==0.3.2"]


@dataclass
class Bench:
    script: str
    budget_s: int
    args: list[str] = field(default_factory=list)
    takes_out: bool = True  # accepts --out FILE
    title: str = ""


# Order: the issue-9 tables first, then the figures of the other issues.
KNOWN: list[Bench] = [
    # With a baseline (A/B, issue 15): one more agent in every round, and the loadgen.py rows (~60 s more).
    # --keys (issue 17): two more agents (keys on, and keys off again as the A/A control), ~50 s more.
    Bench("bench_overhead.py", 390, ["-n", "1000", "--stream-n", "300", "--wrk-s", "4", "--profile", "--keys"],
          title="Proxy overhead, memory and start-up (issue 9)"),
    Bench("bench_proxy.py", 200, ["-n", "600"], title="Added latency of one agent, fake engine and llama-server (issue 2)"),
    # Sized for the 20-minute total on 2 cores: the mesh simulation's default (1000 simulated
    # nodes) takes longer than its whole budget here (300 nodes alone take ~100 s of CPU per
    # row). The routing simulation runs its default (40000 requests x 2 seeds, ~1 minute):
    # one seed of 20000 requests moves the p99 by tens of milliseconds, the size of the goal.
    Bench("bench_mesh_sim.py", 150, ["--sizes", "10,100"], takes_out=False, title="Mesh simulation"),
    Bench("bench_routing_sim.py", 240, [], takes_out=False, title="Routing simulation"),
    # The prefix model at 8 and 64 nodes, 70% load, the five policies: ~1 minute here (issue 18); the
    # 512-node table in docs/benchmarks-routing.md takes ~5 minutes of CPU, so it is left to its command.
    Bench("bench_prefix_sim.py", 180, ["--nodes", "8,64", "--requests", "2000"], takes_out=False,
          title="Prefix-aware routing in simulation (issue 18)"),
    # Both protocols at 10 and 100 nodes, 0% and 5% loss: ~80 s of CPU here (issue 16).
    Bench("bench_swim_sim.py", 150, ["--sizes", "10,100", "--steady-s", "20"], takes_out=False,
          title="Probe mode against heartbeats (issue 16)"),
    # Two runs of 60 s of arrivals on 3 real agents (offers on, then off): ~130 s in all here.
    Bench("bench_offers_agents.py", 200, [], takes_out=False, title="Slot offers with real agents"),
    # Ten real agents in CA trust with keys on, 8 rows x 2 trials of 60 requests: ~2.5 min here.
    Bench("bench_mesh_limits.py", 240, ["--trials", "2"], takes_out=True, title="Mesh-wide limit accuracy (issue 17)"),
    Bench("bench_mesh_processes.py", 120, ["--nodes", "10", "--steady-s", "15"], takes_out=False,
          title="Mesh with real processes"),
    # Two MeshNodes in one process, 2 x 1000 pings at 80/s: ~30 s here.
    Bench("bench_probe_wire.py", 90, [], takes_out=False, title="Probe mode's wire: a ping over mutual TLS (issue 16)"),
    Bench("bench_crash_detection.py", 120, ["-n", "10"], title="Crash detection"),
    # Three real agents (SIGTERM, SIGSTOP, client disconnects x 3 rounds) and one on llama-server: ~40 s here.
    Bench("bench_reliability.py", 120, ["-n", "3"], title="Reliability: faults and bad inputs (issue 13)"),
    # An in-process listener (2,000 silent connections, 20 s kept up) and one real agent: ~55 s here.
    Bench("bench_floods.py", 150, [], title="Connection floods (issue 14)"),
    # Four runs of 2000 rows on a temporary SQLite file: ~5 s here.
    Bench("bench_usage.py", 60, ["-n", "2000"], title="Usage ledger"),
    # Three real agents in CA mode, 20 lists pushed at one, a node restarted: ~15 s here.
    Bench("bench_revocations.py", 120, ["--rounds", "20"], takes_out=False, title="Revocation spread time"),
    # Five minimal apps and four agents, 2000 requests each at c=1: ~90 s here (issue 17).
    Bench("bench_auth_ab.py", 200, ["-n", "200", "--rounds", "10"], takes_out=False,
          title="Client keys: the gate alone, then whole agents (issue 17)"),
    # One process: 5 modes x 5 rounds x 20000 requests, the SDK's import: ~40 s here (issue 19).
    Bench("bench_trace_context.py", 90, ["-n", "20000", "--rounds", "5"], takes_out=False,
          title="Trace context per request (issue 19)"),
    # Five processes on loopback, 3 x 256 MiB per path, 2000 echoes each, then llama.cpp RPC direct and
    # through the tunnel (SmolLM2, 3 x 64 tokens each): ~40 s here (issue 21).
    Bench("bench_gang_tunnel.py", 120, ["--llama"], title="Gang tunnel (issue 21)"),
    # Three agents in turn (one host, then a gang of two), 6 x 48 tokens each, 3 gang restarts:
    # ~1 min here (issue 21).
    Bench("bench_gang.py", 300, ["--requests", "6", "--max-tokens", "48", "--restarts", "3"], takes_out=False,
          title="A model split over two agents against one host (issue 21)"),
    # One process, 3 x 20000 timings: ~10 s here (issue 18).
    Bench("bench_prefix_hashing.py", 60, ["-n", "20000"], takes_out=False,
          title="Prefix routing: hashing and scoring cost (issue 18)"),
    # Four real llama-servers behind viiwork (prefix routing on, off), sglang-router and round robin,
    # sized down for make bench's total: 24 requests a system (~10 min here); the figures in
    # docs/benchmarks-routing.md are from the larger run its command gives.
    Bench("bench_prefix_routing.py", 900, ["--requests", "24", "--saturation-requests", "8", "--system-tokens", "600",
                                           "--no-prefix-workload"], takes_out=False,
          title="Prefix-aware routing on real llama-servers (issue 18)"),
]
DEFAULT_BUDGET_S = 90


@dataclass
class Outcome:
    bench: Bench
    command: str
    status: str
    seconds: float
    text: str


def sh(cmd: list[str], **kw) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True, **kw)


def ensure_debian_tools(notes: list[str], install: bool) -> None:
    missing = [pkg for pkg, binary in (("wrk", "wrk"), ("nginx-light", "nginx"))
               if not (shutil.which(binary) or Path(f"/usr/sbin/{binary}").exists())]
    if not missing:
        return
    if not install or os.geteuid() != 0 or not shutil.which("apt-get"):
        notes.append(f"missing Debian packages {', '.join(missing)} (apt-get install {' '.join(missing)}); "
                     "their rows are skipped")
        return
    print(f"==> installing Debian packages {' '.join(missing)} (service starts blocked)", flush=True)
    policy = Path("/usr/sbin/policy-rc.d")
    created = False
    if not policy.exists():
        policy.write_text("#!/bin/sh\n# temporary, from viiwork's tests/bench/run_all.py\nexit 101\n")
        policy.chmod(0o755)
        created = True
    try:
        env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
        r = sh(["apt-get", "install", "-y", "-q", *missing], env=env, timeout=300)
        if r.returncode != 0:
            sh(["apt-get", "update", "-q"], env=env, timeout=300)
            r = sh(["apt-get", "install", "-y", "-q", *missing], env=env, timeout=300)
        if r.returncode != 0:
            notes.append(f"apt-get install {' '.join(missing)} failed: {r.stderr.strip()[-300:]}")
    finally:
        if created:
            policy.unlink()


def ensure_bench_venv(notes: list[str], install: bool) -> str | None:
    """The interpreter of .bench-venv with LiteLLM's proxy and py-spy, or None."""
    python = BENCH_VENV / "bin" / "python"
    stamp = BENCH_VENV / (".installed-" + "-".join(r.replace("[", "_").replace("]", "_") for r in BENCH_REQUIREMENTS))
    tools = [BENCH_VENV / "bin" / name for name in ("python", "litellm", "py-spy")]
    if stamp.exists() and all(t.exists() for t in tools):
        return str(python)
    if not install:
        notes.append(".bench-venv missing and --no-install given: LiteLLM not measured")
        return None
    print(f"==> creating {BENCH_VENV.name} with {' '.join(BENCH_REQUIREMENTS)} (benchmark-only tools)", flush=True)
    base = getattr(sys, "_base_executable", None) or sys.executable
    try:
        if not python.exists():
            r = sh([base, "-m", "venv", str(BENCH_VENV)], timeout=120)
            if r.returncode != 0:
                raise RuntimeError(r.stderr.strip()[-300:])
        r = sh([str(python), "-m", "pip", "install", "-q", "--disable-pip-version-check", "--force-reinstall",
                *BENCH_REQUIREMENTS],
               timeout=600)
        if r.returncode != 0:
            raise RuntimeError(r.stderr.strip()[-500:])
    except (RuntimeError, subprocess.TimeoutExpired, OSError) as exc:
        notes.append(f"could not build {BENCH_VENV.name}: {exc}; LiteLLM not measured")
        return None
    stamp.touch()
    return str(python)


def discover(only: set[str] | None) -> list[Bench]:
    known = {b.script: b for b in KNOWN}
    present = sorted(p.name for p in HERE.glob("bench_*.py"))
    ordered = [known[name] for name in known if name in present]
    ordered += [Bench(name, DEFAULT_BUDGET_S, [], takes_out=False, title=name) for name in present if name not in known]
    if only:
        ordered = [b for b in ordered if b.script.removesuffix(".py") in only or b.script in only]
    return ordered


def run_one(bench: Bench, budget_s: float, bench_python: str | None, work: Path,
            baseline: str | None = None) -> Outcome:
    args = list(bench.args)
    if bench.script == "bench_overhead.py" and bench_python:
        args += ["--litellm-python", bench_python]
    if bench.script == "bench_prefix_routing.py" and bench_python:
        args += ["--sglang-python", bench_python]
    if bench.script == "bench_overhead.py" and baseline:
        args += ["--baseline", baseline, "--other-client"]
    out_file = work / (bench.script + ".md")
    if bench.takes_out:
        args += ["--out", str(out_file)]
    cmd = [sys.executable, str(HERE / bench.script), *args]
    shown = " ".join([".venv/bin/python", f"tests/bench/{bench.script}", *[
        a if not a.startswith(str(work)) else "FILE" for a in args]]).replace(str(ROOT) + "/", "")
    env = dict(os.environ)
    if bench_python:  # py-spy for profiles
        env["PATH"] = f"{Path(bench_python).parent}:{env.get('PATH', '')}"
    print(f"==> {bench.script} (budget {budget_s:.0f} s)", flush=True)
    started = time.monotonic()
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=env, start_new_session=True)
    try:
        output, _ = proc.communicate(timeout=budget_s)
        status = "ok" if proc.returncode == 0 else f"failed (exit status {proc.returncode})"
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, 15)
        try:
            output, _ = proc.communicate(timeout=15)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 9)
            output, _ = proc.communicate()
        status = f"timed out after its budget of {budget_s:.0f} s"
    seconds = time.monotonic() - started
    if status == "ok" and bench.takes_out and out_file.exists():
        text = out_file.read_text()
    elif status == "ok":
        text = output
    else:
        text = "Output (tail):\n\n```\n" + "\n".join(output.splitlines()[-40:]) + "\n```\n"
    print(f"    {status} in {seconds:.0f} s", flush=True)
    return Outcome(bench, shown, status, seconds, text)


def default_baseline() -> str | None:
    """HEAD when the working tree has uncommitted changes (A/B of the change against its commit), else None."""
    try:
        dirty = sh(["git", "status", "--porcelain"], cwd=ROOT, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return "HEAD" if dirty.returncode == 0 and dirty.stdout.strip() else None


def machine() -> str:
    cpu = "unknown CPU"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    mem = ""
    try:
        kb = int(Path("/proc/meminfo").read_text().split()[1])
        mem = f", {kb / 1024 / 1024:.0f} GiB RAM"
    except (OSError, ValueError, IndexError):
        pass
    return (f"{cpu}, {os.cpu_count()} CPUs{mem}, Linux {platform.release()} ({platform.machine()}), "
            f"Python {platform.python_version()}")


def as_section(text: str) -> str:
    """Demote a benchmark's headings so they sit under its ``##`` section."""
    lines = []
    in_code = False
    for line in text.splitlines():
        if line.startswith("```"):
            in_code = not in_code
        if not in_code and line.startswith("#"):
            hashes = len(line) - len(line.lstrip("#"))
            line = "#" * max(3, hashes) + line[hashes:]
        lines.append(line)
    return "\n".join(lines).strip() + "\n"


def looks_like_markdown(text: str) -> bool:
    return any(line.startswith(("|", "#")) for line in text.splitlines())


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--only", help="comma-separated benchmark names (bench_overhead,...)")
    ap.add_argument("--out", type=Path, default=ROOT / "docs" / "benchmarks.md")
    ap.add_argument("--budget-s", type=float, default=19 * 60, help="overall budget")
    ap.add_argument("--no-install", action="store_true", help="do not install wrk, nginx or .bench-venv")
    ap.add_argument("--baseline", default=None, metavar="REV",
                    help="commit whose agent bench_overhead.py measures beside this tree's (A/B, issue 15); "
                         "default HEAD when the tree has uncommitted changes, else none; '' for none")
    args = ap.parse_args()
    t0 = time.monotonic()
    run_started = time.time()
    notes: list[str] = []
    load0 = os.getloadavg()
    ensure_debian_tools(notes, not args.no_install)
    bench_python = ensure_bench_venv(notes, not args.no_install)
    only = set(args.only.split(",")) if args.only else None
    baseline = args.baseline if args.baseline is not None else default_baseline()
    outcomes: list[Outcome] = []
    with tempfile.TemporaryDirectory(prefix="vw-bench-all-") as tmp:
        for bench in discover(only):
            left = args.budget_s - (time.monotonic() - t0)
            if left < 20:
                outcomes.append(Outcome(bench, f".venv/bin/python tests/bench/{bench.script}", "not run: the overall "
                                        "budget was spent", 0.0, ""))
                continue
            outcomes.append(run_one(bench, min(bench.budget_s, left), bench_python, Path(tmp), baseline))
    load1 = os.getloadavg()
    total = time.monotonic() - t0
    now = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    try:
        commit = sh(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT).stdout.strip() or "unknown"
        dirty = " (with uncommitted changes)" if sh(["git", "status", "--porcelain"], cwd=ROOT).stdout.strip() else ""
    except OSError:
        commit, dirty = "unknown", ""
    doc = ["# Benchmarks", "",
           "Written by `make bench` (`tests/bench/run_all.py`); do not edit by hand. Every figure below "
           "comes from the run described here; comparisons are made within one run, as ratios, because "
           "the host is shared and absolute figures move with its load.", "",
           f"- Run: {now}, commit {commit}{dirty}, {total / 60:.1f} minutes in all.",
           f"- Machine: {machine()}.",
           f"- Load average (1 min): {load0[0]:.2f} at the start, {load1[0]:.2f} at the end "
           "(other work was running on this host; read ratios, not absolute figures).", "",
           "| benchmark | status | seconds | command |", "|---|---|---|---|"]
    for o in outcomes:
        doc.append(f"| {o.bench.title or o.bench.script} | {o.status} | {o.seconds:.0f} | `{o.command}` |")
    if notes:
        doc += ["", "Notes: " + "; ".join(notes)]
    for o in outcomes:
        doc += ["", f"## {o.bench.title or o.bench.script}", "", f"Command: `{o.command}`; {o.status}, "
                f"{o.seconds:.0f} s.", ""]
        if o.text:
            body = o.text if looks_like_markdown(o.text) or o.status != "ok" else "```\n" + o.text.strip() + "\n```\n"
            doc.append(as_section(body))
    for extra in sorted((ROOT / "docs").glob("benchmarks-*.md")):
        when = datetime.datetime.fromtimestamp(extra.stat().st_mtime, datetime.UTC)
        fresh = "during this run" if extra.stat().st_mtime >= run_started else "before this run"
        doc += ["", f"## `docs/{extra.name}`", "",
                f"Included as written by its owners (last written {when:%Y-%m-%d %H:%M} UTC, {fresh}); the "
                "figures re-measured by this run are in the sections above.", "", as_section(extra.read_text())]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text("\n".join(doc).rstrip() + "\n")
    print(f"==> wrote {args.out} in {total / 60:.1f} minutes", flush=True)
    failed = [o for o in outcomes if o.status != "ok"]
    for o in failed:
        print(f"    {o.bench.script}: {o.status}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
