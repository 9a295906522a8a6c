"""Log requests that aiohttp's HTTP parser refuses once, not once per request with a traceback.

A request that aiohttp's parser cannot take (a request line over 8 KiB, ``Content-Length:
-1``, a bad or overflowing chunk size, a ``Content-Encoding`` it cannot decode such as ``br``
without Brotli) is answered 400 text/plain by aiohttp before any of our handlers runs
(docs/routing.md, "Status codes"), and aiohttp logs it on the ``aiohttp.server`` logger at
ERROR with a full traceback: about 20 journal lines for a 100-byte request any client can send.

A body whose ``Content-Encoding`` (gzip, deflate) does not decode, or whose chunked framing
breaks mid-body, is refused by our handlers (400, agent/serving/body.py), but aiohttp then drains the
rest of the body after the handler returned, meets the payload's error again and logs it as
``Unhandled exception`` at ERROR with a three-part traceback (a
:class:`aiohttp.web_protocol.RequestPayloadError` whose ``__cause__`` is the parser's
``ContentEncodingError``): the same cheap flood of the journal, by another path.

:class:`ProtocolErrorLog`, a :class:`logging.Filter` on that logger, turns such a record
(its ``exc_info``, or that exception's ``__cause__``/``__context__``, is an
:class:`aiohttp.http.HttpProcessingError` or a ``RequestPayloadError``) into one line without
a traceback: at WARNING for the first from a source address in :data:`WARN_INTERVAL_S`, every
other one at DEBUG (dropped unless ``aiohttp.server`` logs DEBUG), all counted in ``count``
(``viiwork_http_malformed_requests_total`` on /metrics). Any other record of that logger
(an unhandled exception in a handler) passes unchanged.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from types import TracebackType

from aiohttp.http import HttpProcessingError
from aiohttp.web_protocol import RequestHandler, RequestPayloadError
from prometheus_client.core import CounterMetricFamily

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
        exc = _protocol_error(record.exc_info[1] if record.exc_info else None)
        if exc is None:
            return True
        self.count += 1
        if isinstance(record.args, tuple) and record.args:  # "Error handling request from %s"
            remote = str(record.args[0])
        else:  # "Unhandled exception" (no arguments): the handler's peer, from the traceback
            remote = _remote_from_traceback(record.exc_info[2] if record.exc_info else None)
        first = self._first_in_window(remote)
        text = exc.message if isinstance(exc, HttpProcessingError) else str(exc)
        reason = (text.strip().splitlines() or [type(exc).__name__])[0][:200]
        code = (exc.code or 400) if isinstance(exc, HttpProcessingError) else 400
        record.msg = "client %s: refused a request the HTTP parser cannot take: %s (HTTP %s)%s"
        record.args = (remote, reason, code,
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

    def metric_families(self) -> list[CounterMetricFamily]:
        """The refusals' counter for /metrics (read now)."""
        return [CounterMetricFamily("viiwork_http_malformed_requests", "Requests the HTTP parser refused (400) "
                                    "on any listener of the agent.", value=self.count)]


def _protocol_error(exc: BaseException | None) -> HttpProcessingError | RequestPayloadError | None:
    """The parser's error behind ``exc``: itself, or its ``__cause__``/``__context__`` chain
    (a few links deep), an HttpProcessingError first; None when it is none of them."""
    found: RequestPayloadError | None = None
    for _ in range(4):
        if exc is None:
            break
        if isinstance(exc, HttpProcessingError):
            return exc
        if isinstance(exc, RequestPayloadError) and found is None:
            found = exc
        exc = exc.__cause__ or exc.__context__
    return found


def _remote_from_traceback(tb: TracebackType | None) -> str:
    """The peer address of the aiohttp RequestHandler whose frame is in ``tb`` ("?" if none)."""
    while tb is not None:
        handler = tb.tb_frame.f_locals.get("self")
        if isinstance(handler, RequestHandler):
            transport = handler.transport
            peer = transport.get_extra_info("peername") if transport is not None else None
            return str(peer[0]) if isinstance(peer, tuple) and peer else "?"
        tb = tb.tb_next
    return "?"


def install() -> ProtocolErrorLog:
    """Put a :class:`ProtocolErrorLog` on ``aiohttp.server`` (once; the same one after) and return it."""
    logger = logging.getLogger(SERVER_LOGGER)
    for existing in logger.filters:
        if isinstance(existing, ProtocolErrorLog):
            return existing
    installed = ProtocolErrorLog()
    logger.addFilter(installed)
    return installed
