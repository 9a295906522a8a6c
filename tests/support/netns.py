"""Several "hosts" on one machine: network namespaces on a bridge that lives in a namespace
of its own, so the machine's own network is never touched (needs root and iproute2).

Host i has 10.99.0.i/24 on eth0 with multicast on (mDNS works between the hosts). Run a
process in one with ``hosts.popen(i, argv)``; every process started that way is killed and
every namespace deleted on exit. ``hosts.cut(i)`` / ``hosts.heal(i)`` pull and plug host i's
cable (its veth on the bridge goes down/up: a partition, the host itself keeps running), and
``in_netns(ns, fn)`` runs ``fn`` in a thread whose sockets live in namespace ``ns`` (the test
process itself stays in the machine's namespace).

``hosts.host(i)`` is host i as one object (:class:`NetnsHost`: its address, ``popen``, ``call``,
``pids``), what ``support.agent.run_agent(host=...)`` takes to run an agent there;
:class:`LoopbackHost` is the same on this machine's loopback, for a test that must still run
where namespaces are unavailable.
"""

from __future__ import annotations

import ctypes
import os
import shutil
import subprocess
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, TypeVar

T = TypeVar("T")
CLONE_NEWNET = 0x40000000  # <sched.h>; setns(2)


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

    @property
    def hub(self) -> str:
        return f"{self.prefix}-hub"

    def cut(self, i: int) -> None:
        """Partition host ``i``: its port on the bridge goes down (no carrier; packets to and
        from it are lost, no reset or ICMP reaches either side)."""
        _ip("-n", self.hub, "link", "set", f"veth{i}", "down")

    def heal(self, i: int) -> None:
        _ip("-n", self.hub, "link", "set", f"veth{i}", "up")

    def address(self, i: int) -> str:
        return f"10.99.0.{i}"

    def popen(self, i: int, argv: list[str], **kwargs) -> subprocess.Popen:
        proc = subprocess.Popen(["ip", "netns", "exec", self.ns(i), *argv], **kwargs)
        self.procs.append(proc)
        return proc

    def run(self, i: int, argv: list[str], timeout: float = 30) -> subprocess.CompletedProcess:
        return subprocess.run(["ip", "netns", "exec", self.ns(i), *argv], capture_output=True, text=True,
                              timeout=timeout)

    def host(self, i: int) -> NetnsHost:
        return NetnsHost(self, i)


@dataclass(frozen=True)
class NetnsHost:
    """Host ``i`` of ``hosts``: ``address`` (10.99.0.i), ``popen`` (a process in its namespace,
    killed when the hosts go), ``call(fn)`` (``fn`` with its sockets in that namespace) and
    ``pids()`` (every process in the namespace, ``ip netns pids``)."""

    hosts: Hosts
    i: int

    @property
    def address(self) -> str:
        return self.hosts.address(self.i)

    @property
    def ns(self) -> str:
        return self.hosts.ns(self.i)

    def popen(self, argv: list[str], **kwargs: Any) -> subprocess.Popen:
        return self.hosts.popen(self.i, argv, **kwargs)

    def call(self, fn: Callable[[], T], timeout_s: float = 60) -> T:
        return in_netns(self.ns, fn, timeout_s)

    def pids(self) -> set[int] | None:
        out = subprocess.run(["ip", "netns", "pids", self.ns], capture_output=True, text=True, check=True, timeout=30)
        return {int(p) for p in out.stdout.split()}


class LoopbackHost:
    """A "host" that is this machine's loopback (where namespaces are unavailable): the same
    interface as :class:`NetnsHost`; ``pids()`` is None (no namespace to list)."""

    address = "127.0.0.1"

    def popen(self, argv: list[str], **kwargs: Any) -> subprocess.Popen:
        return subprocess.Popen(argv, **kwargs)

    def call(self, fn: Callable[[], T], timeout_s: float = 60) -> T:
        return fn()

    def pids(self) -> set[int] | None:
        return None


Host = NetnsHost | LoopbackHost


def in_netns(ns: str, fn: Callable[[], T], timeout_s: float) -> T:
    """Run ``fn()`` in a new thread that first joins network namespace ``ns`` (setns(2) moves
    only the calling thread); returns its result or raises its exception, or TimeoutError
    after ``timeout_s``."""
    result: dict[str, object] = {}

    def body() -> None:
        try:
            fd = os.open(f"/run/netns/{ns}", os.O_RDONLY)
            try:
                if ctypes.CDLL(None, use_errno=True).setns(fd, CLONE_NEWNET) != 0:
                    raise OSError(ctypes.get_errno(), f"setns into {ns} failed")
            finally:
                os.close(fd)
            result["value"] = fn()
        except BaseException as exc:  # handed to the caller's thread
            result["error"] = exc

    thread = threading.Thread(target=body, name=f"in-{ns}", daemon=True)
    thread.start()
    thread.join(timeout_s)
    if thread.is_alive():
        raise TimeoutError(f"{fn} did not return within {timeout_s} s in {ns}")
    if "error" in result:
        raise result["error"]  # type: ignore[misc]
    return result["value"]  # type: ignore[return-value]


@contextmanager
def bridged_hosts(prefix: str, n: int) -> Iterator[Hosts]:
    """``n`` hosts named ``<prefix>-ns1..n`` on a bridge in ``<prefix>-hub``."""
    hosts = Hosts(prefix, n)
    hub = hosts.hub
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
