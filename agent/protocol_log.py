"""Log requests that aiohttp's HTTP parser refuses once, not once per request with a traceback.

A request that aiohttp's parser cannot take (a request line over 8 KiB, ``Content-Length:
-1``, a bad or overflowing chunk size, a ``Content-Encoding`` it cannot decode such as ``br``
without Brotli) is answered 400 text/plain by aiohttp before any of our handlers runs
(docs/routing.md, "Status codes"), and aiohttp logs it on the ``aiohttp.server`` logger at
ERROR with a full traceback: about 20 journal lines for a 100-byte request any client can send.

:class:`ProtocolErrorLog`, a :class:`logging.Filter` on that logger, turns such a record
(its ``exc_info`` is an :class:`aiohttp.http.HttpProcessingError`) into one line without a
traceback: at WARNING for the first from a source address in :data:`WARN_INTERVAL_S`, every
other one at DEBUG (dropped unless ``aiohttp.server`` logs DEBUG), all counted in ``count``
(``viiwork_http_malformed_requests_total`` on /metrics). Any other record of that logger
(an unhandled exception in a handler) passes unchanged.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from aiohttp.http import HttpProcessingError

SERVER_LOGGER = "aiohttp.server"
WARN_INTERVAL_S = 60.0  # one WARNING per source address per minute
MAX_SOURCES = 10_000  # addresses remembered at once (a flood from many cannot grow it further)


class ProtocolErrorLog(logging.Filter):
    """Filter for ``aiohttp.server``: protocol errors become one line, WARNING once then DEBUG.

    count: protocol errors seen since install (an int, one per refused request). ``clock``:
    monotonic seconds (injected by tests).
    """

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        super().__init__()
        self.count = 0
        self._clock = clock
        self._warned_at: dict[str, float] = {}  # source address -> when it was last logged at WARNING

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        if not isinstance(exc, HttpProcessingError):
            return True
        self.count += 1
        remote = record.args[0] if isinstance(record.args, tuple) and record.args else "?"
        first = self._first_in_window(str(remote))
        reason = (exc.message.strip().splitlines() or [type(exc).__name__])[0][:200]
        record.msg = "client %s: refused a request the HTTP parser cannot take: %s (HTTP %s)%s"
        record.args = (remote, reason, exc.code or 400,
                       f"; further ones from it within {WARN_INTERVAL_S:g} s are logged at DEBUG" if first else "")
        record.exc_info = None
        record.exc_text = None
        record.levelno = logging.WARNING if first else logging.DEBUG
        record.levelname = logging.getLevelName(record.levelno)
        return first or logging.getLogger(SERVER_LOGGER).isEnabledFor(logging.DEBUG)

    def _first_in_window(self, remote: str) -> bool:
        """True when ``remote`` was not logged at WARNING in the last :data:`WARN_INTERVAL_S`."""
        now = self._clock()
        last = self._warned_at.get(remote)
        if last is not None and now - last < WARN_INTERVAL_S:
            return False
        if last is None and len(self._warned_at) >= MAX_SOURCES:
            self._warned_at = {a: t for a, t in self._warned_at.items() if now - t < WARN_INTERVAL_S}
            if len(self._warned_at) >= MAX_SOURCES:
                return False  # more sources than that in a minute: the count still says how many
        self._warned_at[remote] = now
        return True

    def metrics_lines(self) -> list[str]:
        """Prometheus text lines for /metrics."""
        return ["# HELP viiwork_http_malformed_requests_total Requests the HTTP parser refused (400) "
                "on any listener of the agent.",
                "# TYPE viiwork_http_malformed_requests_total counter",
                f"viiwork_http_malformed_requests_total {self.count}"]


def install() -> ProtocolErrorLog:
    """Put a :class:`ProtocolErrorLog` on ``aiohttp.server`` (once; the same one after) and return it."""
    logger = logging.getLogger(SERVER_LOGGER)
    for existing in logger.filters:
        if isinstance(existing, ProtocolErrorLog):
            return existing
    installed = ProtocolErrorLog()
    logger.addFilter(installed)
    return installed
