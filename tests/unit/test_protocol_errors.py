"""Errors outside any route's handler: the admin socket's unknown paths and wrong methods
(JSON, agent/admin.py) and requests aiohttp's HTTP parser refuses (plain 400, logged once by
agent/serving/protocol_log.py). Real aiohttp servers on a Unix socket and on loopback."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from viiwork.agent.admin import AdminActions, build_admin_app, start_admin_site
from viiwork.agent.serving import protocol_log


async def _never(*_: Any) -> dict[str, Any]:
    raise AssertionError("no command should run")


@pytest.fixture
async def admin_socket(tmp_path: Path) -> AsyncIterator[Path]:
    runner = web.AppRunner(build_admin_app(AdminActions(*([_never] * 6))))
    await runner.setup()
    path = tmp_path / "admin.sock"
    await start_admin_site(runner, path)
    yield path
    await runner.cleanup()


@pytest.mark.parametrize("method,path,status,code,allow", [
    ("GET", "/nope", 404, "not_found", None),
    ("POST", "/models/a/sideways", 404, "not_found", None),
    ("GET", "/drain", 405, "method_not_allowed", "POST"),
    ("DELETE", "/models/a/up", 405, "method_not_allowed", "POST"),
    ("POST", "/models", 405, "method_not_allowed", "GET"),
])
async def test_admin_socket_answers_json_for_unknown_paths_and_methods(
        admin_socket: Path, method: str, path: str, status: int, code: str, allow: str | None) -> None:
    async with aiohttp.ClientSession(connector=aiohttp.UnixConnector(path=str(admin_socket)),
                                     timeout=aiohttp.ClientTimeout(total=10)) as session:
        async with session.request(method, f"http://admin{path}") as resp:
            assert resp.status == status
            assert resp.content_type == "application/json"
            error = (await resp.json())["error"]
            assert error["code"] == code and path in error["message"]
            assert resp.headers.get("Allow") == allow


# Each is refused by aiohttp's parser before any handler runs (docs/routing.md, "Status codes").
PARSER_REFUSED = [
    b"POST /x HTTP/1.1\r\nHost: a\r\nContent-Length: -1\r\n\r\n",
    b"POST /x HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n",
    b"POST /x HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\n\r\n" + b"f" * 40 + b"\r\n",
    b"GET /" + b"a" * 9000 + b" HTTP/1.1\r\nHost: a\r\n\r\n",
    b"POST /x HTTP/1.1\r\nHost: a\r\nContent-Encoding: br\r\nContent-Length: 4\r\n\r\nabcd",
]


async def _exchange(port: int, raw: bytes) -> bytes:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(raw)
        await writer.drain()
        return await asyncio.wait_for(reader.read(), 10)
    finally:
        writer.close()
        try:
            await writer.wait_closed()
        except ConnectionError:
            pass


def status_of(answer: bytes) -> int:
    """The status code of a raw HTTP/1.x answer (aiohttp answers a refusal as HTTP/1.0)."""
    return int(answer.split(b"\r\n", 1)[0].split(b" ")[1])


async def test_parser_refusals_are_400_and_logged_once(caplog: pytest.LogCaptureFixture) -> None:
    reached: list[str] = []

    async def handler(request: web.Request) -> web.Response:
        reached.append(request.path)
        if request.path == "/boom":
            raise RuntimeError("a handler bug")
        await request.read()
        return web.Response(text="ok")

    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", handler)
    runner = web.AppRunner(app)
    await runner.setup()
    installed = protocol_log.install()
    try:
        assert protocol_log.install() is installed  # once
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]
        caplog.set_level(logging.INFO, logger=protocol_log.SERVER_LOGGER)
        for raw in PARSER_REFUSED:
            answer = await _exchange(port, raw)
            assert status_of(answer) == 400, (raw[:60], answer[:200])
        assert reached == []  # not even the Content-Encoding: br body reaches a handler
        assert installed.count == len(PARSER_REFUSED)
        server = [r for r in caplog.records if r.name == protocol_log.SERVER_LOGGER]
        assert [(r.levelno, r.exc_info) for r in server] == [(logging.WARNING, None)], \
            [r.getMessage() for r in server]
        assert "127.0.0.1" in server[0].getMessage() and "DEBUG" in server[0].getMessage()
        # A bug in a handler is still an ERROR with its traceback.
        caplog.clear()
        assert status_of(await _exchange(port, b"GET /boom HTTP/1.1\r\nHost: a\r\n\r\n")) == 500
        assert [(r.levelno, r.exc_info is not None) for r in caplog.records
                if r.name == protocol_log.SERVER_LOGGER] == [(logging.ERROR, True)]
    finally:
        logging.getLogger(protocol_log.SERVER_LOGGER).removeFilter(installed)
        await runner.cleanup()


def test_malformed_requests_warn_once_per_address_per_minute() -> None:
    """One WARNING per source address per minute (an injected clock), every one counted."""
    from aiohttp.http_exceptions import BadHttpMessage

    now = [0.0]
    log_filter = protocol_log.ProtocolErrorLog(clock=lambda: now[0])

    def refused(remote: str) -> int:
        record = logging.LogRecord(protocol_log.SERVER_LOGGER, logging.ERROR, __file__, 1,
                                   "Error handling request from %s", (remote,), None)
        record.exc_info = (BadHttpMessage, BadHttpMessage("Invalid header"), None)
        log_filter.filter(record)
        assert record.exc_info is None
        return record.levelno

    assert refused("192.0.2.1") == logging.WARNING
    now[0] = 30.0
    assert refused("192.0.2.1") == logging.DEBUG
    assert refused("192.0.2.2") == logging.WARNING  # another address has its own minute
    now[0] = 60.5
    assert refused("192.0.2.1") == logging.WARNING
    assert refused("192.0.2.2") == logging.DEBUG
    assert log_filter.count == 5
    assert log_filter.metric_families()[0].samples[0].value == 5


async def test_bodies_that_do_not_decode_are_logged_once_without_traceback(caplog: pytest.LogCaptureFixture) -> None:
    """A gzip/deflate body that is not gzip/deflate: the handler answers 400 (agent/serving/body.py),
    then aiohttp's drain after the handler meets the payload error again and logs
    "Unhandled exception" with a traceback: rewritten to one WARNING per address, counted."""
    from viiwork.agent.serving.body import BodyError, read_body

    async def handler(request: web.Request) -> web.Response:
        try:
            await read_body(request, 1024, "test.limit")
        except BodyError as exc:
            return web.Response(status=exc.status)
        return web.Response(text="ok")

    app = web.Application()
    app.router.add_post("/x", handler)
    runner = web.AppRunner(app)
    await runner.setup()
    installed = protocol_log.install()
    try:
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]
        caplog.set_level(logging.INFO, logger=protocol_log.SERVER_LOGGER)
        before = installed.count
        for i in range(12):
            encoding = b"gzip" if i % 2 else b"deflate"
            raw = (b"POST /x HTTP/1.1\r\nHost: a\r\nContent-Encoding: " + encoding +
                   b"\r\nContent-Length: 4\r\n\r\nxxxx")
            assert status_of(await _exchange(port, raw)) == 400
        await asyncio.sleep(0.1)
        assert installed.count - before == 12
        server = [r for r in caplog.records if r.name == protocol_log.SERVER_LOGGER]
        assert [(r.levelno, r.exc_info) for r in server] == [(logging.WARNING, None)], \
            [r.getMessage() for r in server]
        assert "127.0.0.1" in server[0].getMessage() and "content-encoding" in server[0].getMessage()
        assert "Traceback" not in caplog.text
    finally:
        logging.getLogger(protocol_log.SERVER_LOGGER).removeFilter(installed)
        await runner.cleanup()
