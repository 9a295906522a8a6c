"""A streamed client that stays connected but stops reading frees its slot (one agent).

Finding F2 of issue 13: a client with a tiny receive buffer that never reads kept the agent's
relay waiting on one write forever, the engine's slot busy with it (the engine's own timer
pauses: the agent stops reading from it too). With ``api.client_stall_timeout_s`` the write
is given up after that long: the agent closes its connection to the engine and aborts the
client's (docs/routing.md, "Forwarding and retries before the first byte"). The same relay
runs on a peer's mesh listener, where the "client" is a frozen origin.
"""

from __future__ import annotations

import json
import socket
import time
import urllib.request
from collections.abc import Iterator

import pytest

from support.agent import Agent, run_agent
from support.engines import fake_engine_binary

pytestmark = pytest.mark.timeout(90)

# A long, fast stream: far more bytes than the socket buffers between the agent and a client
# that does not read can hold (about 100 bytes per chunk).
ENGINE_ENV = {"FAKE_LOAD_S": "0.1", "FAKE_TOKENS": "400000", "FAKE_TOKEN_DELAY_S": "0"}


@pytest.fixture(scope="module")
def agent(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Agent]:
    tmp = tmp_path_factory.mktemp("stall")
    binary = fake_engine_binary(tmp / "bin")
    model = {"name": "long", "engine": "llamacpp", "path": "/dev/null", "parallel": 1, "backends": 1,
             "llamacpp": {"binary": str(binary)}, "env": ENGINE_ENV}
    with run_agent(tmp, [model], extra={"api": {"client_stall_timeout_s": 1}}) as a:
        a.wait_healthy("long")
        yield a


def engine_stats(agent: Agent) -> dict:
    return agent.engine_stats("long")


def test_stream_client_that_stops_reading_frees_the_slot(agent: Agent) -> None:
    host, port = agent.url.removeprefix("http://").split(":")
    body = json.dumps({"model": "long", "stream": True, "messages": [{"role": "user", "content": "hi"}]}).encode()
    client = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    client.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # before connect: the window stays small
    try:
        client.connect((host, int(port)))
        client.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
                       b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
        before = engine_stats(agent)["cancelled"]
        deadline = time.monotonic() + 20
        while engine_stats(agent)["busy"] == 0:
            assert time.monotonic() < deadline, "the request never reached the engine"
            time.sleep(0.05)
        # The client never reads. Without the stall bound the slot stays busy as long as the
        # socket is open (here: until the test ends); with it, about the time to fill the
        # socket buffers plus client_stall_timeout_s (1 s).
        started = time.monotonic()
        while (stats := engine_stats(agent))["busy"]:
            assert time.monotonic() - started < 30, f"the slot stayed busy with a client that does not read: {stats}"
            time.sleep(0.1)
        assert stats["cancelled"] == before + 1 and stats["in_flight"] == 0, stats
        # The agent gave up on the client: its connection is aborted (reset) or closed.
        client.settimeout(10)
        with pytest.raises((ConnectionResetError, EOFError)):
            while client.recv(1 << 20):
                pass
            raise EOFError
    finally:
        client.close()
    assert "api.client_stall_timeout_s" in agent.log_text()
    # The agent still serves the next client.
    req = urllib.request.Request(agent.url + "/v1/chat/completions", data=json.dumps(
        {"model": "long", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}).encode(),
        headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as r:
        assert r.status == 200
