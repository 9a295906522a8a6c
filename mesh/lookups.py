"""The mesh's name lookups: aiohttp's resolver for the connectors that dial peers.

A seed can be a name (``gpu-box-3:8087``). aiohttp's default ``ThreadedResolver`` runs each
``getaddrinfo`` on the event loop's default executor, which ``asyncio.to_thread`` shares
(GPU reads, name pins, state-dir writes), and a lookup holds its thread until the system
resolver answers: a dial that gives up does not end it. With 200 seeds whose names did not
resolve, their lookups held every thread of that executor: the live seed was seen after
43.7 s (0.6 s with 20 such seeds), and a GPU read waiting for a thread was reported as a
hung driver. Measured here, the DNS server drops queries (names that do not exist: 3 % of
the lookups made one at a time, 16 % of those made 4 at once, 46 % of 16 at once, waited
glibc's 5 s retry), so a pool of a few threads was all held within the first second too,
and a seed named ``localhost`` (no DNS query at all) waited behind them (not seen within
5 s: tests/mesh/test_dead_seeds.py). Hence :class:`MeshResolver`:

- lookups run on threads of their own (:class:`LookupThreads`, at most
  :data:`LOOKUP_THREADS`, none kept idle, none waited for when the process exits);
- one lookup per name at a time: a dial of a name whose lookup still runs (its callers gave
  up) waits on it, taking no other thread, so the threads held are at most the names that
  hang;
- each caller has a deadline (``timeout_s``): past it the dial fails as
  :class:`NameLookupTimeout`, "name lookup timed out" in ``last_error`` (a
  ``TimeoutError`` would read as the exchange's "timed out"); a lookup whose callers all
  gave up before it started never runs;
- a failed lookup raises its own ``socket.gaierror`` ("name lookup failed: ..."). An IP
  literal is never looked up (aiohttp's connector).
"""

from __future__ import annotations

import asyncio
import functools
import socket
import threading
from collections import Counter, deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from typing import Any, TypeVar

from aiohttp.abc import AbstractResolver, ResolveResult

T = TypeVar("T")

#: Lookups running at once in the process: at most one per name, so 200 seeds whose names
#: all hang hold 200 threads for a few seconds, and a live one still gets its own.
LOOKUP_THREADS = 256
#: A name lookup's deadline (seconds) unless the connector is given another.
NAME_LOOKUP_TIMEOUT_S = 2.0
# As aiohttp's ThreadedResolver: only the address families this host has configured.
_AI_ADDRCONFIG = socket.AI_ADDRCONFIG & getattr(socket, "AI_MASK", ~0)
_threads: LookupThreads | None = None


class NameLookupTimeout(OSError):
    """A name lookup of ``host`` had no answer within ``timeout_s``. An OSError with no
    errno and not a TimeoutError: aiohttp's connector raises it as a
    ``ClientConnectorDNSError`` (a TimeoutError would pass as the whole request's timeout)."""

    def __init__(self, host: str, timeout_s: float) -> None:
        super().__init__(None, "name lookup timed out")
        self.host, self.timeout_s = host, timeout_s

    def __str__(self) -> str:
        return f"name lookup of {self.host} timed out after {self.timeout_s:g} s"


class LookupThreads:
    """Runs jobs on at most ``max_threads`` daemon threads, each started for a job and ending
    when no job waits; a job beyond them waits its turn. Unlike a ``ThreadPoolExecutor``,
    no thread stays idle after a burst and the process's exit does not wait for a lookup
    that hangs."""

    def __init__(self, max_threads: int = LOOKUP_THREADS) -> None:
        self.max_threads = max_threads
        self.running = 0  # threads alive
        self._lock = threading.Lock()
        self._jobs: deque[tuple[Future[Any], Callable[[], Any]]] = deque()

    def submit(self, job: Callable[[], T]) -> Future[T]:
        """``job()`` on a thread; its future (cancelled before it starts: it never runs)."""
        future: Future[T] = Future()
        with self._lock:
            self._jobs.append((future, job))
            if self.running >= self.max_threads:
                return future
            self.running += 1
        try:
            threading.Thread(target=self._work, name="viiwork-mesh-lookup", daemon=True).start()
        except RuntimeError:  # no thread to be had now: the job waits for a running one (or its deadline)
            with self._lock:
                self.running -= 1
        return future

    def _work(self) -> None:
        while True:
            with self._lock:
                if not self._jobs:
                    self.running -= 1
                    return
                future, job = self._jobs.popleft()
            if not future.set_running_or_notify_cancel():
                continue
            try:
                result = job()
            except BaseException as exc:  # noqa: BLE001 - the caller's to see, as ThreadPoolExecutor does
                future.set_exception(exc)
            else:
                future.set_result(result)


def lookup_threads() -> LookupThreads:
    """The process's threads for the mesh's name lookups (made on first use)."""
    global _threads
    if _threads is None:
        _threads = LookupThreads()
    return _threads


class MeshResolver(AbstractResolver):
    """aiohttp's resolver for the mesh's connectors (see the module doc): ``lookup``
    (``socket.getaddrinfo``'s signature) run on ``threads`` (default :func:`lookup_threads`),
    never on the loop's default executor, within ``timeout_s`` seconds (else
    :class:`NameLookupTimeout`). Answers as aiohttp's ``ThreadedResolver`` does
    (``ResolveResult`` dicts, numeric host and port)."""

    def __init__(self, *, timeout_s: float = NAME_LOOKUP_TIMEOUT_S,
                 lookup: Callable[..., Sequence[tuple[Any, ...]]] = socket.getaddrinfo,
                 threads: LookupThreads | None = None) -> None:
        self.timeout_s = timeout_s
        self._lookup = lookup
        self._threads = threads
        # By (host, port, family): the lookup in flight and its callers waiting.
        self._lookups: dict[tuple[str, int, int], Future[list[ResolveResult]]] = {}
        self._callers: Counter[tuple[str, int, int]] = Counter()

    async def resolve(self, host: str, port: int = 0,
                      family: socket.AddressFamily = socket.AF_INET) -> list[ResolveResult]:
        key = (host, port, int(family))
        job = self._lookups.get(key)
        if job is None:
            job = self._lookups[key] = (self._threads or lookup_threads()).submit(
                functools.partial(_addresses, self._lookup, host, port, family))
            job.add_done_callback(functools.partial(self._finished, asyncio.get_running_loop(), key))
        self._callers[key] += 1
        try:
            async with asyncio.timeout(self.timeout_s):
                return await asyncio.shield(asyncio.wrap_future(job))
        except TimeoutError:
            raise NameLookupTimeout(host, self.timeout_s) from None
        finally:
            self._callers[key] -= 1
            if not self._callers[key]:
                del self._callers[key]
                # Still waiting for a thread: it never runs. One that runs runs on, and the
                # next caller of that name waits on it.
                if job.cancel() and self._lookups.get(key) is job:
                    del self._lookups[key]

    def _finished(self, loop: asyncio.AbstractEventLoop, key: tuple[str, int, int],
                  job: Future[list[ResolveResult]]) -> None:
        """The lookup ended (called on its thread): on the loop, the next caller of its
        name starts another one."""
        try:
            loop.call_soon_threadsafe(self._forget, key, job)
        except RuntimeError:  # the loop is closed: nothing to forget
            pass

    def _forget(self, key: tuple[str, int, int], job: Future[list[ResolveResult]]) -> None:
        if self._lookups.get(key) is job:
            del self._lookups[key]

    async def close(self) -> None:
        """Nothing to close: the threads are the process's (they end with their lookups)."""


def _addresses(lookup: Callable[..., Sequence[tuple[Any, ...]]], host: str, port: int,
               family: socket.AddressFamily) -> list[ResolveResult]:
    """``lookup``'s answer for ``host`` as aiohttp's ``ResolveResult`` dicts (on a lookup thread)."""
    out: list[ResolveResult] = []
    for fam, _, proto, _, address in lookup(host, port, type=socket.SOCK_STREAM, family=family,
                                            flags=_AI_ADDRCONFIG):
        if fam == socket.AF_INET6:
            if len(address) < 3:  # IPv6 not supported by this Python build
                continue
            if address[3]:  # a link-local address's scope id: only getnameinfo writes it
                resolved, service = socket.getnameinfo(address, socket.NI_NUMERICHOST | socket.NI_NUMERICSERV)
                resolved_port = int(service)
            else:
                resolved, resolved_port = address[0], address[1]
        elif fam == socket.AF_INET:
            resolved, resolved_port = address[0], address[1]
        else:
            continue
        out.append(ResolveResult(hostname=host, host=resolved, port=resolved_port, family=fam, proto=proto,
                                 flags=socket.AI_NUMERICHOST | socket.AI_NUMERICSERV))
    return out
