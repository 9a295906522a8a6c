"""A real ClientApi app on loopback in front of given runtimes (no supervisor, no mesh):
the client API and proxy exactly as the agent runs them, for tests that supply backends."""

from __future__ import annotations

from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager

from aiohttp import web

from viiwork.agent.serving.api import PARSER_MAX_FIELD_BYTES, ClientApi
from viiwork.agent.serving.browser_guard import BrowserGuard
from viiwork.agent.serving.proxy import Upstream
from viiwork.agent.serving.tracing import Tracing
from viiwork.agent.supervision.backends import ModelRuntime


@asynccontextmanager
async def agent_api(runtimes: Mapping[str, ModelRuntime], *, max_body_bytes: int = 1 << 20, queue_max: int = 8,
                    queue_timeout_s: float = 10, idle_s: float = 10, host: str = "127.0.0.1",
                    browser: BrowserGuard | None = None,
                    tracing: Tracing | None = None) -> AsyncIterator[tuple[str, ClientApi]]:
    """Yields the app's base URL and its ClientApi; ``idle_s``: api.stream_idle_timeout_s;
    ``host``: the address to bind; ``browser``: its browser checks (default: ClientApi's);
    ``tracing``: its trace context and spans (default: ClientApi's, headers only)."""
    async with Upstream(idle_s) as upstream:
        api = ClientApi(node_name="test-node", runtimes=dict(runtimes), upstream=upstream,
                        max_body_bytes=max_body_bytes, queue_max=queue_max, queue_timeout_s=queue_timeout_s,
                        status_source=lambda: [{"name": n} for n in runtimes], browser=browser,
                        tracing=tracing)
        runner = web.AppRunner(api.build_app(), handler_cancellation=True, access_log=None,
                               max_field_size=PARSER_MAX_FIELD_BYTES, max_line_size=PARSER_MAX_FIELD_BYTES)
        await runner.setup()
        site = web.TCPSite(runner, host, 0)
        await site.start()
        try:
            yield f"http://{host}:{runner.addresses[0][1]}", api
        finally:
            await runner.cleanup()
