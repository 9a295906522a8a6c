"""The floor of a Python proxy: a bare aiohttp pass-through, for the overhead benchmark.

usage: python tests/bench/bare_proxy.py --port PORT --upstream http://127.0.0.1:UPORT
       python tests/bench/bare_proxy.py --port PORT --upstream http://localhost \
           --upstream-socket PATH --key-file FILE   (an engine's socket, with its key)

One shared client session with pooled keep-alive connections; the body is forwarded as
received; the answer is relayed with one write per chunk read. No routing, accounting,
queueing, timeouts or error mapping: what any Python proxy costs before doing its job.
"""

from __future__ import annotations

import argparse

import aiohttp
from aiohttp import web


def build_app(upstream: str, socket_path: str | None = None, key: str | None = None) -> web.Application:
    app = web.Application()
    auth = {"Authorization": f"Bearer {key}"} if key else {}

    async def open_session(app: web.Application) -> None:
        connector = (aiohttp.UnixConnector(path=socket_path, limit=0) if socket_path
                     else aiohttp.TCPConnector(limit=0))
        app["http"] = aiohttp.ClientSession(connector=connector, auto_decompress=False)

    async def close_session(app: web.Application) -> None:
        await app["http"].close()

    async def relay(request: web.Request) -> web.StreamResponse:
        body = await request.read()
        headers = {"Content-Type": request.headers.get("Content-Type", "application/json"), **auth}
        async with app["http"].post(upstream + request.path, data=body, headers=headers) as up:
            response = web.StreamResponse(status=up.status)
            response.content_type = up.content_type
            await response.prepare(request)
            async for chunk in up.content.iter_any():
                await response.write(chunk)
            await response.write_eof()
            return response

    app.on_startup.append(open_session)
    app.on_cleanup.append(close_session)
    app.router.add_post("/{tail:.*}", relay)
    return app


def main() -> None:
    p = argparse.ArgumentParser(prog="bare-proxy")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--upstream", required=True)
    p.add_argument("--upstream-socket", default=None)
    p.add_argument("--key-file", default=None)
    args = p.parse_args()
    key = open(args.key_file).read().strip() if args.key_file else None
    web.run_app(build_app(args.upstream, args.upstream_socket, key), host="127.0.0.1", port=args.port,
                access_log=None, print=None)


if __name__ == "__main__":
    main()
