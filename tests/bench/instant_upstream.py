"""An instant OpenAI-style upstream for the proxy benchmarks: raw asyncio, no framework.

usage: python tests/bench/instant_upstream.py --port PORT [-np SLOTS] [--chunks 20] [...]
       python tests/bench/instant_upstream.py --host PATH.sock [--port PORT] [--api-key-file F]

It takes llama-server's command line (unknown options are ignored), so a viiwork agent can
start it as its llama.cpp engine: like llama-server, a ``--host`` ending in ``.sock`` is a
Unix socket (the agent's ``engine.sock``), and ``--api-key-file`` makes every request but
``/health`` need ``Authorization: Bearer <key>`` (else 401). With a socket, ``--port`` (an
operator arg in the benchmark's config) also listens on that loopback port, for the clients
that speak only TCP (wrk, LiteLLM), with the same key. Answers, over HTTP/1.1 keep-alive:

- ``GET /health`` -> 200 ``{"status":"ok"}``; ``GET /slots`` -> SLOTS idle slot entries;
  ``GET /v1/models`` -> one model;
- ``POST /v1/chat/completions`` (any POST): ``"stream": true`` in the body -> an SSE answer
  of ``--chunks`` ``chat.completion.chunk`` events, each written on its own (the loop is
  yielded between writes, so each leaves as its own send), chunked encoding; otherwise one
  ``chat.completion`` object with Content-Length.

Costs a few microseconds per request, so what a proxy in front of it adds is what shows.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from pathlib import Path

_COMPLETION = json.dumps({
    "id": "chatcmpl-bench", "object": "chat.completion", "created": 1700000000, "model": "m",
    "choices": [{"index": 0, "message": {"role": "assistant", "content": "Hello."}, "finish_reason": "stop"}],
    "usage": {"prompt_tokens": 5, "completion_tokens": 1, "total_tokens": 6},
}).encode()


def _chunk_event(i: int, last: bool) -> bytes:
    delta = {"content": f" t{i}"} if not last else {}
    doc = {"id": "chatcmpl-bench", "object": "chat.completion.chunk", "created": 1700000000, "model": "m",
           "choices": [{"index": 0, "delta": delta, "finish_reason": "stop" if last else None}]}
    return b"data: " + json.dumps(doc).encode() + b"\n\n"


def _http_chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


def _response(status: str, body: bytes, content_type: bytes = b"application/json") -> bytes:
    return (b"HTTP/1.1 " + status.encode() + b"\r\nContent-Type: " + content_type +
            b"\r\nContent-Length: " + str(len(body)).encode() + b"\r\nConnection: keep-alive\r\n\r\n" + body)


class _Conn(asyncio.Protocol):
    def __init__(self, server: _Server) -> None:
        self.server = server
        self.buf = b""
        self.transport: asyncio.Transport | None = None
        self.busy = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        self.buf += data
        if not self.busy:
            self._parse()

    def _parse(self) -> None:
        while True:
            end = self.buf.find(b"\r\n\r\n")
            if end < 0:
                return
            head = self.buf[:end].decode("latin-1")
            lines = head.split("\r\n")
            method, path = lines[0].split(" ")[:2]
            length = 0
            authorized = self.server.key is None or path == "/health"
            for line in lines[1:]:
                name, _, value = line.partition(":")
                name = name.strip().lower()
                if name == "content-length":
                    length = int(value.strip())
                elif name == "authorization" and not authorized:
                    authorized = value.strip() == f"Bearer {self.server.key}"
            if len(self.buf) < end + 4 + length:
                return
            body = self.buf[end + 4:end + 4 + length]
            self.buf = self.buf[end + 4 + length:]
            if not authorized:
                self.transport.write(_UNAUTHORIZED)  # type: ignore[union-attr]
                continue
            if method == "POST" and self.server.wants_stream(body):
                self.busy = True
                asyncio.get_running_loop().create_task(self._stream(b'"include_usage":true' in body))
                return
            self.transport.write(self.server.answer(method, path))  # type: ignore[union-attr]

    async def _stream(self, usage: bool) -> None:
        t = self.transport
        assert t is not None
        t.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nCache-Control: no-cache\r\n"
                b"Transfer-Encoding: chunked\r\nConnection: keep-alive\r\n\r\n")
        events = self.server.events
        for i, event in enumerate(events):
            await asyncio.sleep(0)
            if t.is_closing():
                return
            if i == len(events) - 1:  # with the usage event when asked (stream_options.include_usage)
                t.write(_http_chunk(event + (_USAGE_EVENT if usage else b"") + b"data: [DONE]\n\n") + b"0\r\n\r\n")
            else:
                t.write(_http_chunk(event))
        self.busy = False
        if self.buf:
            self._parse()


_USAGE_EVENT = b"data: " + json.dumps({
    "id": "chatcmpl-bench", "object": "chat.completion.chunk", "created": 1700000000, "model": "m", "choices": [],
    "usage": {"prompt_tokens": 5, "completion_tokens": 20, "total_tokens": 25}}).encode() + b"\n\n"
_UNAUTHORIZED = _response("401 Unauthorized", b'{"error":{"message":"Invalid API Key","code":401}}')


class _Server:
    def __init__(self, slots: int, chunks: int, key: str | None = None) -> None:
        self.key = key
        self.slots_body = json.dumps([{"id": i, "n_ctx": 512, "is_processing": False} for i in range(slots)]).encode()
        self.events = [_chunk_event(i, i == chunks - 1) for i in range(chunks)]
        self.models_body = json.dumps({"object": "list", "data": [{"id": "m", "object": "model"}]}).encode()
        self.completion = _response("200 OK", _COMPLETION)

    @staticmethod
    def wants_stream(body: bytes) -> bool:
        if b'"stream"' not in body:
            return False
        try:
            return json.loads(body).get("stream") is True
        except ValueError:
            return False

    def answer(self, method: str, path: str) -> bytes:
        if method == "POST":
            return self.completion
        if path == "/health":
            return _response("200 OK", b'{"status":"ok"}')
        if path == "/slots":
            return _response("200 OK", self.slots_body)
        if path in ("/v1/models", "/models"):
            return _response("200 OK", self.models_body)
        return _response("404 Not Found", b'{"error":{"message":"not found","code":404}}')


async def amain(args: argparse.Namespace) -> None:
    key = Path(args.api_key_file).read_text().strip() if args.api_key_file else None
    server = _Server(args.parallel, args.chunks, key)
    loop = asyncio.get_running_loop()
    servers = []
    if args.host.endswith(".sock"):
        servers.append(await loop.create_unix_server(lambda: _Conn(server), args.host, backlog=1024))
        host = "127.0.0.1"
    else:
        host = args.host
    if args.port is not None:
        servers.append(await loop.create_server(lambda: _Conn(server), host, args.port, reuse_address=True,
                                                backlog=1024))
    if not servers:
        raise SystemExit("instant-upstream: give --port, or a --host ending in .sock")
    await asyncio.gather(*(srv.serve_forever() for srv in servers))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="instant-upstream")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=None)
    p.add_argument("--api-key-file", default=None)
    p.add_argument("-np", "--parallel", type=int, default=64)
    p.add_argument("--chunks", type=int, default=20)
    args, _unknown = p.parse_known_args(argv)
    try:
        asyncio.run(amain(args))
    except KeyboardInterrupt:
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
