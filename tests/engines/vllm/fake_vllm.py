"""A stand-in for ``vllm serve`` as far as the agent's key and socket go (tests only).

usage: fake_vllm.py serve PATH --served-model-name NAME (--uds SOCK | --host H --port P) ...

Like vLLM 0.32's API server (vllm/entrypoints/openai/api_server.py): ``--uds`` binds a Unix
socket and ignores ``--host``/``--port``; the key comes from ``--api-key`` or the
``VLLM_API_KEY`` environment variable, and when set every path under ``/v1`` answers 401
without ``Authorization: Bearer <key>`` while ``/health`` and ``/metrics`` stay open. It
writes what it was given (argv, whether it had a key) to ``$FAKE_VLLM_REPORT`` when set.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from aiohttp import web


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("command")
    p.add_argument("path")
    p.add_argument("--served-model-name", required=True)
    p.add_argument("--uds")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--api-key", nargs="+")
    p.add_argument("--max-model-len", type=int, default=1024)
    args, _ = p.parse_known_args()
    key = (args.api_key or [os.environ.get("VLLM_API_KEY", "")])[0] or None
    if os.environ.get("FAKE_VLLM_REPORT"):
        with open(os.environ["FAKE_VLLM_REPORT"], "w") as f:
            json.dump({"argv": sys.argv, "has_key": key is not None}, f)
    name = args.served_model_name

    @web.middleware
    async def auth(request: web.Request, handler):  # type: ignore[no-untyped-def]
        if key and request.path.startswith("/v1") and request.headers.get("Authorization") != f"Bearer {key}":
            return web.json_response({"error": "Unauthorized"}, status=401)
        return await handler(request)

    async def health(_: web.Request) -> web.Response:
        return web.Response(status=200)

    async def metrics(_: web.Request) -> web.Response:
        return web.Response(text=f'vllm:num_requests_running{{model_name="{name}"}} 0.0\n'
                                 f'vllm:num_requests_waiting{{model_name="{name}"}} 0.0\n')

    async def models(_: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [
            {"id": name, "object": "model", "max_model_len": args.max_model_len}]})

    async def chat(_: web.Request) -> web.Response:
        return web.json_response({"id": "cmpl-fake", "object": "chat.completion", "created": 0, "model": name,
                                  "choices": [{"index": 0, "finish_reason": "stop",
                                               "message": {"role": "assistant", "content": "hi"}}],
                                  "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}})

    app = web.Application(middlewares=[auth])
    app.router.add_get("/health", health)
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/v1/models", models)
    app.router.add_post("/v1/chat/completions", chat)
    if args.uds:
        web.run_app(app, path=args.uds, print=None, access_log=None)
    else:
        web.run_app(app, host=args.host, port=args.port, print=None, access_log=None)


if __name__ == "__main__":
    main()
