"""A 3 s /health blip on every backend while completions flow: requests failed, respawns, throughput.

usage: .venv/bin/python tests/bench/bench_health_blip.py [-n 1] [--blip-s 3] [--out FILE]

One real ``viiwork-agent`` (process runner) with one model on 3 fake llama-servers (2 slots
each, a completion takes about 0.2 s, a load 0.5 s) and 6 clients sending non-streamed
completions through it for 2 s before the blip, during it, and 3 s after
(tests/support/health_blip.py). Health settings of the report (issue 22): ``interval_s`` 1,
``timeout_s`` 1, ``max_failures`` 3. Each scenario runs ``-n`` rounds:

- **before**: the new rules off by config: ``health.success_counts_as_probe_s`` 0,
  ``supervisor.max_concurrent_respawns`` 3 (one per backend), ``respawn_jitter_s`` 0: the
  ladder as it was before issue 22;
- **staggering only**: ``success_counts_as_probe_s`` 0, the cap and jitter at their defaults (1, 1 s):
  what staggering alone does when no request contradicts the probes;
- **after**: every default (``success_counts_as_probe_s`` 10, cap 1, jitter 1 s).

Figures per round: requests failed (not 200) of those sent; respawns (all backends);
completions per second in the 2 s before the blip and in the blip plus 3 s after it; the
slowest request. Prints a Markdown section (and writes it to --out when given).
"""

from __future__ import annotations

import argparse
import platform
import statistics
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))  # tests/ for support.*

from support.health_blip import BlipResult, run_blip  # noqa: E402

BEFORE_S = 2.0
AFTER_S = 3.0
SCENARIOS = [
    ("before (rules off by config)",
     {"success_counts_as_probe_s": 0.0}, {"max_concurrent_respawns": 3, "respawn_jitter_s": 0.0}),
    ("staggering only (`success_counts_as_probe_s` 0)", {"success_counts_as_probe_s": 0.0}, {}),
    ("after (defaults)", {}, {}),
]


def spread(values: list[float], fmt: str = "{:.0f}") -> str:
    if len(values) == 1:
        return fmt.format(values[0])
    return " / ".join(fmt.format(v) for v in (min(values), statistics.median(values), max(values)))


def row(name: str, results: list[BlipResult]) -> str:
    blip_s = results[0].blip_s
    failed = [float(r.failed) for r in results]
    sent = [float(len(r.requests)) for r in results]
    respawns = [float(sum(r.respawns.values())) for r in results]
    rate_before = [r.completed_between(-BEFORE_S, 0.0) / BEFORE_S for r in results]
    rate_after = [r.completed_between(0.0, blip_s + AFTER_S) / (blip_s + AFTER_S) for r in results]
    slowest = [r.slowest_s() for r in results]
    return (f"| {name} | {spread(failed)} of {spread(sent)} | {spread(respawns)} | {spread(rate_before, '{:.1f}')} "
            f"| {spread(rate_after, '{:.1f}')} | {spread(slowest, '{:.2f}')} |")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-n", type=int, default=1, help="rounds per scenario (about 36 s each on 2 cores)")
    ap.add_argument("--blip-s", type=float, default=3.0)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench-blip-") as tmp:
        for i, (name, health, supervisor) in enumerate(SCENARIOS):
            results = [run_blip(Path(tmp) / f"s{i}r{n}", health=health, supervisor=supervisor, blip_s=args.blip_s,
                                before_s=BEFORE_S, after_s=AFTER_S) for n in range(args.n)]
            rows.append(row(name, results))
            print(rows[-1], file=sys.stderr, flush=True)
    spec = "min / median / max" if args.n > 1 else "one round"
    text = "\n".join([
        f"{args.n} round(s) per scenario ({spec}); {platform.machine()}, Python {platform.python_version()}.",
        "",
        f"| scenario | requests failed (of sent) | respawns | completions/s before | "
        f"completions/s blip + {AFTER_S:g} s | slowest request, s |",
        "|---|---|---|---|---|---|",
        *rows,
    ])
    print(text)
    if args.out:
        args.out.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
