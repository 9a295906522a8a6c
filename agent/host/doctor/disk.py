"""The check of free disk space where the agent keeps state and logs and where models live."""

from __future__ import annotations

from viiwork.agent.host.doctor.registry import CheckResult, Verdict, check, config_or_skip, result_for
from viiwork.agent.host.facts import HostFacts

MiB = 1024 * 1024
GiB = 1024 * MiB
DISK_DEGRADED_BELOW_BYTES = 2 * GiB
DISK_FAIL_BELOW_BYTES = 100 * MiB


def _bytes(n: int) -> str:
    return f"{n / GiB:.1f} GiB" if n >= GiB else f"{n / MiB:.0f} MiB"


@check("disk.space", "Free disk space")
def check_disk_space(facts: HostFacts) -> list[CheckResult]:
    """Free space on the filesystems holding the state dir, the log dir and local models.
    Fixed floors, not shares of the disk: what runs out is bytes for keys, logs and
    engine caches.

    - **fail**: under 100 MiB free: state and certificates cannot be written, engines
      crash writing caches.
    - **degraded**: under 2 GiB free.
    """
    r = result_for("disk.space")
    config_or_skip(facts)
    results = []
    for d in facts.need("disks"):
        subject = ", ".join(d.roles)
        summary = f"{_bytes(d.free_bytes)} free of {_bytes(d.total_bytes)} at {d.path}"
        remedy = f"free space on the filesystem of {d.path} (old models, engine caches, logs: `journalctl --vacuum-size`)"
        if d.free_bytes < DISK_FAIL_BELOW_BYTES:
            results.append(r(Verdict.FAIL, summary, "state, certificates and engine caches cannot be written; "
                             "engines and the agent fail in odd ways", remedy, subject=subject))
        elif d.free_bytes < DISK_DEGRADED_BELOW_BYTES:
            results.append(r(Verdict.DEGRADED, summary, "close to running out: writes of state, logs and "
                             "engine caches will start failing", remedy, subject=subject))
        else:
            results.append(r(Verdict.OK, summary, subject=subject))
    return results
