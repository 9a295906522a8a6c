"""The adapters' shared HTTP read (engines/http.py): over the session the supervisor builds
for a socket backend with a key, a real aiohttp server on a Unix socket standing for the
engine; transport failures as EngineUnavailable chained from their cause (docs/engines.md,
"Methods and attributes")."""

from __future__ import annotations

import ast
import asyncio
import tempfile
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import aiohttp
import pytest
from aiohttp import web

from viiwork.agent.supervision.engine_keys import auth_headers
from viiwork.engines.contract import EngineUnavailable
from viiwork.engines.http import Answer, fetch
from viiwork.engines.registry import ENGINES

KEY = "k-3f9a1c"
ENGINES_DIR = Path(__file__).resolve().parents[2] / "engines"


@pytest.fixture
def sock_dir() -> Iterator[Path]:
    # Short: a Unix socket path must fit in 107 bytes, and pytest's tmp_path can be long.
    with tempfile.TemporaryDirectory(prefix="vw-eh-", dir="/tmp") as d:
        yield Path(d)


@pytest.fixture
async def keyed_socket_engine(sock_dir: Path) -> AsyncIterator[tuple[str, list[tuple[str, str]]]]:
    """An engine on a Unix socket that answers 200 {} to the right key and 401 otherwise;
    yields (socket path, [(request path, Authorization header)] as seen)."""
    seen: list[tuple[str, str]] = []

    async def handler(request: web.Request) -> web.Response:
        got = request.headers.get("Authorization", "")
        seen.append((request.path, got))
        if got != f"Bearer {KEY}":
            return web.json_response({"error": {"message": "Invalid API Key", "type": "authentication_error"}},
                                     status=401)
        return web.json_response({})

    app = web.Application()
    app.router.add_route("GET", "/{tail:.*}", handler)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    path = str(sock_dir / "engine.sock")
    await web.UnixSite(runner, path).start()
    try:
        yield path, seen
    finally:
        await runner.cleanup()


def _socket_session(path: str, key: str | None, total_s: float = 10.0) -> aiohttp.ClientSession:
    # As agent/supervision/backend_task.py builds a socket backend's session: its own UnixConnector, the
    # launch's key as a default header.
    return aiohttp.ClientSession(connector=aiohttp.UnixConnector(path=path),
                                 timeout=aiohttp.ClientTimeout(total=total_s), headers=auth_headers(key))


async def test_fetch_reads_over_the_socket_with_the_sessions_key(keyed_socket_engine) -> None:
    path, seen = keyed_socket_engine
    async with _socket_session(path, KEY) as http:
        answer = await fetch(http, "http://localhost", "/slots")
    assert answer == Answer(status=200, body=b"{}")
    assert seen == [("/slots", f"Bearer {KEY}")]


async def test_a_refused_key_is_an_answer_not_a_transport_failure(keyed_socket_engine) -> None:
    path, _ = keyed_socket_engine
    async with _socket_session(path, None) as http:
        answer = await fetch(http, "http://localhost", "/health")
    assert answer.status == 401 and b"Invalid API Key" in answer.body


@pytest.mark.parametrize("name", sorted(ENGINES))
async def test_every_adapter_probes_a_socket_backend_through_the_given_session(name, keyed_socket_engine) -> None:
    """No adapter opens a connection or adds auth of its own: with the key the backend is
    ready, without it every probe is an answered 401 (not ready), never EngineUnavailable."""
    path, seen = keyed_socket_engine
    engine = ENGINES[name]
    async with _socket_session(path, KEY) as http:
        assert (await engine.probe(http, "http://localhost")).ready
    async with _socket_session(path, None) as http:
        refused = await engine.probe(http, "http://localhost")
    assert not refused.ready and "401" in refused.reason
    assert [auth for _, auth in seen] == [f"Bearer {KEY}", ""]


async def test_a_missing_socket_is_engine_unavailable_naming_the_read(sock_dir: Path) -> None:
    async with _socket_session(str(sock_dir / "gone.sock"), KEY) as http:
        with pytest.raises(EngineUnavailable, match=r"^GET /metrics: UnixClientConnectorError") as err:
            await fetch(http, "http://localhost", "/metrics")
    assert isinstance(err.value.__cause__, aiohttp.ClientConnectorError)


async def test_a_timed_out_read_keeps_its_timeout_cause(sock_dir: Path) -> None:
    """The supervisor tells a timed-out probe from a refused one by the cause's class."""
    release = asyncio.Event()

    async def hang(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await release.wait()
        writer.close()

    path = str(sock_dir / "hang.sock")
    server = await asyncio.start_unix_server(hang, path)
    try:
        async with _socket_session(path, KEY, total_s=0.2) as http:
            with pytest.raises(EngineUnavailable, match=r"^GET /health: ") as err:
                await fetch(http, "http://localhost", "/health")
        assert isinstance(err.value.__cause__, TimeoutError)
    finally:
        release.set()
        server.close()
        await server.wait_closed()


def test_answer_text_replaces_bytes_that_are_not_utf8() -> None:
    assert Answer(status=200, body=b"gauge 1\n\xff").text() == "gauge 1\n\ufffd"


def test_no_adapter_makes_its_own_http_calls() -> None:
    """Adapters read through engines/http.py: no ``http.get(...)`` and no ``except`` of
    aiohttp errors in an engine package (the helper is where that lives)."""
    offenders = []
    for source in sorted(ENGINES_DIR.glob("*/*.py")):
        for node in ast.walk(ast.parse(source.read_text(), str(source))):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                    and node.func.attr in {"get", "post", "request", "head"}
                    and isinstance(node.func.value, ast.Name) and node.func.value.id == "http"):
                offenders.append(f"{source.relative_to(ENGINES_DIR)}:{node.lineno} http.{node.func.attr}()")
            if isinstance(node, ast.ExceptHandler) and node.type is not None and "aiohttp" in ast.unparse(node.type):
                offenders.append(f"{source.relative_to(ENGINES_DIR)}:{node.lineno} except {ast.unparse(node.type)}")
    assert offenders == []
