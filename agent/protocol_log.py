"""Log requests that aiohttp's HTTP parser refuses once, not once per request with a traceback.

A request that aiohttp's parser cannot take (a request line over 8 KiB, ``Content-Length:
-1``, a bad or overflowing chunk size, a ``Content-Encoding`` it cannot decode such as ``br``
without Brotli) is answered 400 text/plain by aiohttp before any of our handlers runs
(docs/routing.md, "Status codes"), and aiohttp logs it on the ``aiohttp.server`` logger at
ERROR with a full traceback: about 20 journal lines for a 100-byte request any client can send.

:class:`ProtocolErrorLog`, a :class:`logging.Filter` on that logger, turns such a record
(its ``exc_info`` is an :class:`aiohttp.http.HttpProcessingError`) into one line: the first
at WARNING, every later one at DEBUG (dropped unless ``aiohttp.server`` logs DEBUG), all
counted in ``count``. Any other record of that logger (an unhandled exception in a handler)
passes unchanged.
"""

from __future__ import annotations

import logging

from aiohttp.http import HttpProcessingError

SERVER_LOGGER = "aiohttp.server"


class ProtocolErrorLog(logging.Filter):
    """Filter for ``aiohttp.server``: protocol errors become one line, WARNING once then DEBUG.

    count: protocol errors seen since install (an int, one per refused request).
    """

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        if not isinstance(exc, HttpProcessingError):
            return True
        self.count += 1
        first = self.count == 1
        remote = record.args[0] if isinstance(record.args, tuple) and record.args else "?"
        reason = (exc.message.strip().splitlines() or [type(exc).__name__])[0][:200]
        record.msg = "client %s: refused a request the HTTP parser cannot take: %s (HTTP %s)%s"
        record.args = (remote, reason, exc.code or 400, "; further ones are logged at DEBUG" if first else "")
        record.exc_info = None
        record.exc_text = None
        record.levelno = logging.WARNING if first else logging.DEBUG
        record.levelname = logging.getLevelName(record.levelno)
        return first or logging.getLogger(SERVER_LOGGER).isEnabledFor(logging.DEBUG)


def install() -> ProtocolErrorLog:
    """Put a :class:`ProtocolErrorLog` on ``aiohttp.server`` (once; the same one after) and return it."""
    logger = logging.getLogger(SERVER_LOGGER)
    for existing in logger.filters:
        if isinstance(existing, ProtocolErrorLog):
            return existing
    installed = ProtocolErrorLog()
    logger.addFilter(installed)
    return installed
