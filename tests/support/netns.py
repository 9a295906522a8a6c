"""Several "hosts" on one machine: network namespaces on a bridge that lives in a namespace
of its own, so the machine's own network is never touched (needs root and iproute2).

Host i has 10.99.0.i/24 on eth0 with multicast on (mDNS works between the hosts). Run a
process in one with ``hosts.popen(i, argv)``; every process started that way is killed and
every namespace deleted on exit.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager


def netns_available() -> tuple[bool, str]:
    if os.geteuid() != 0:
        return False, "network namespaces need root"
    if shutil.which("ip") is None:
        return False, "iproute2 (`ip`) is not installed"
    probe = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True)
    if probe.returncode != 0:
        return False, f"`ip netns` does not work here: {probe.stderr.strip()}"
    return True, ""


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, timeout=30)


class Hosts:
    def __init__(self, prefix: str, n: int):
        self.prefix, self.n = prefix, n
        self.procs: list[subprocess.Popen] = []

    def ns(self, i: int) -> str:
        return f"{self.prefix}-ns{i}"

    def address(self, i: int) -> str:
        return f"10.99.0.{i}"

    def popen(self, i: int, argv: list[str], **kwargs) -> subprocess.Popen:
        proc = subprocess.Popen(["ip", "netns", "exec", self.ns(i), *argv], **kwargs)
        self.procs.append(proc)
        return proc

    def run(self, i: int, argv: list[str], timeout: float = 30) -> subprocess.CompletedProcess:
        return subprocess.run(["ip", "netns", "exec", self.ns(i), *argv], capture_output=True, text=True,
                              timeout=timeout)


@contextmanager
def bridged_hosts(prefix: str, n: int) -> Iterator[Hosts]:
    """``n`` hosts named ``<prefix>-ns1..n`` on a bridge in ``<prefix>-hub``."""
    hosts = Hosts(prefix, n)
    hub = f"{prefix}-hub"
    made: list[str] = []
    try:
        _ip("netns", "add", hub)
        made.append(hub)
        _ip("-n", hub, "link", "add", "br0", "type", "bridge")
        _ip("-n", hub, "link", "set", "br0", "type", "bridge", "mcast_snooping", "0")
        _ip("-n", hub, "link", "set", "br0", "up")
        _ip("-n", hub, "link", "set", "lo", "up")
        for i in range(1, n + 1):
            ns = hosts.ns(i)
            _ip("netns", "add", ns)
            made.append(ns)
            _ip("-n", ns, "link", "set", "lo", "up")
            _ip("-n", hub, "link", "add", f"veth{i}", "type", "veth", "peer", "name", "eth0", "netns", ns)
            _ip("-n", hub, "link", "set", f"veth{i}", "master", "br0", "up")
            _ip("-n", ns, "addr", "add", f"{hosts.address(i)}/24", "dev", "eth0")
            _ip("-n", ns, "link", "set", "eth0", "multicast", "on", "up")
            _ip("-n", ns, "route", "add", "224.0.0.0/4", "dev", "eth0")
        yield hosts
    finally:
        for proc in hosts.procs:
            if proc.poll() is None:
                proc.kill()
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                pass
        for ns in reversed(made):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=30)
