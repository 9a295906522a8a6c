"""Serve captured engine responses from a real loopback HTTP server.

A capture file is what ``curl -si`` wrote: a status line, header lines, a blank line and the
body, verbatim (``tests/engines/*/captures/``). :class:`ReplayServer` answers each path with
the captured status, content type and body; it recomputes the length (captures may have a
path redacted from the body), and can hold a response back to provoke a client timeout.
"""

from __future__ import annotations

import asyncio
import socket
from dataclasses import dataclass
from pathlib import Path

from aiohttp import web


@dataclass(frozen=True, slots=True)
class Captured:
    """One captured HTTP response."""

    status: int
    headers: tuple[tuple[str, str], ...]
    body: bytes

    def header(self, name: str) -> str | None:
        for key, value in self.headers:
            if key.lower() == name.lower():
                return value
        return None


def read_capture(path: Path) -> Captured:
    """Parse a ``curl -si`` capture. Raises ValueError when it has no status line or no
    blank line after the headers."""
    data = path.read_bytes()
    for sep in (b"\r\n\r\n", b"\n\n"):
        head, found, body = data.partition(sep)
        if found:
            break
    else:
        raise ValueError(f"{path.name}: no blank line after the headers")
    lines = head.decode("latin-1").splitlines()
    if not lines or not lines[0].startswith("HTTP/"):
        raise ValueError(f"{path.name}: no HTTP status line")
    status = int(lines[0].split()[1])
    headers = tuple((k.strip(), v.strip()) for k, _, v in (line.partition(":") for line in lines[1:]))
    return Captured(status=status, headers=headers, body=body)


@dataclass
class Route:
    """What one path answers: a capture, optionally after ``delay_s``."""

    captured: Captured
    delay_s: float = 0.0


class ReplayServer:
    """A loopback aiohttp server answering GET paths from captures.

    ``routes`` maps a path ("/health") to a Route or Captured; unknown paths answer 404.
    Use as ``async with ReplayServer(routes) as base_url``. ``hits`` counts requests per path.
    """

    def __init__(self, routes: dict[str, Route | Captured]) -> None:
        self.routes = {p: r if isinstance(r, Route) else Route(r) for p, r in routes.items()}
        self.hits: dict[str, int] = {}
        self._runner: web.AppRunner | None = None

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        self.hits[request.path] = self.hits.get(request.path, 0) + 1
        route = self.routes.get(request.path)
        if route is None:
            return web.json_response({"detail": "Not Found"}, status=404)
        if route.delay_s:
            await asyncio.sleep(route.delay_s)
        cap = route.captured
        content_type = cap.header("content-type")
        headers = {"Content-Type": content_type} if content_type else None
        return web.Response(status=cap.status, body=cap.body, headers=headers)

    async def __aenter__(self) -> str:
        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", self._handle)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        port = self._runner.addresses[0][1]
        return f"http://127.0.0.1:{port}"

    async def __aexit__(self, *exc: object) -> None:
        if self._runner is not None:
            await self._runner.cleanup()


def refused_base_url() -> str:
    """A loopback URL whose port nothing listens on (connection refused), as a backend
    that has not bound its port yet looks."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return f"http://127.0.0.1:{port}"
