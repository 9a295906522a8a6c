"""The request path records each finished request in the usage ledger (issue 17 item 8; docs/usage.md).

A real agent with the fake llama-server: a stream whose client did not ask for usage gets no
usage event, while its row has the engine's real counts; a client that asked gets the event;
a non-streamed (assembled) answer has its row before the client gets it; /metrics counts the
same rows per tenant and model. Then kill -9 of the agent while streams run: every request
whose client received its complete answer (``[DONE]``) has its row in the file.
"""

from __future__ import annotations

import http.client
import json
import os
import signal
import sqlite3
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from support.agent import Agent, run_agent
from support.engines import fake_engine_binary
from support.ledger_rows import rows

pytestmark = pytest.mark.timeout(90)

MESSAGES = [{"role": "user", "content": "count the rows"}]
# The fake engine's prompt count (tests/support/fake_engine.py): the messages' JSON length / 4.
PROMPT_TOKENS = max(1, len(json.dumps(MESSAGES)) // 4)


def model(binary: Path, name: str = "m", parallel: int = 2, **env: str) -> dict:
    return {"name": name, "engine": "llamacpp", "path": "/dev/null", "parallel": parallel, "backends": 1,
            "llamacpp": {"binary": str(binary)}, "env": {"FAKE_LOAD_S": "0.1", **env}}


def post(agent: Agent, doc: dict, request_id: str, timeout_s: float = 20) -> tuple[int, bytes]:
    req = urllib.request.Request(agent.url + "/v1/chat/completions", data=json.dumps(doc).encode(), method="POST",
                                 headers={"Content-Type": "application/json", "X-Request-Id": request_id})
    with urllib.request.urlopen(req, timeout=timeout_s) as r:
        return r.status, r.read()


def events(raw: bytes) -> list[str]:
    return [line[6:] for line in raw.decode().split("\n") if line.startswith("data: ")]


@pytest.fixture(scope="module")
def agent(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Agent]:
    """One agent, three models: ``m`` for the counts, ``l`` for the test that locks the file,
    ``slow`` (50 tokens, 50 ms apart) for a client that leaves."""
    tmp = tmp_path_factory.mktemp("usage-rows")
    binary = fake_engine_binary(tmp / "bin")
    with run_agent(tmp, [model(binary), model(binary, "l"),
                         model(binary, "slow", FAKE_TOKENS="50", FAKE_TOKEN_DELAY_S="0.05")], name="node-u") as a:
        for name in ("m", "l", "slow"):
            a.wait_healthy(name)
        yield a


def test_rows_have_the_real_counts_and_a_stream_gets_usage_only_when_asked(agent: Agent) -> None:
    status, raw = post(agent, {"model": "m", "messages": MESSAGES, "stream": True, "max_tokens": 5}, "plain")
    data = events(raw)
    assert status == 200 and data[-1] == "[DONE]", data
    # The agent asked the engine for usage; the client, who did not, gets none.
    assert not any("usage" in json.loads(d) for d in data[:-1]), data
    assert "".join(json.loads(d)["choices"][0]["delta"].get("content") or "" for d in data[:-1])
    status, raw = post(agent, {"model": "m", "messages": MESSAGES, "stream": True,
                               "stream_options": {"include_usage": True}}, "asked")
    usage_events = [json.loads(d) for d in events(raw)[:-1] if "usage" in json.loads(d)]
    assert [e["usage"]["completion_tokens"] for e in usage_events] == [8], usage_events
    status, raw = post(agent, {"model": "m", "messages": MESSAGES, "max_tokens": 3}, "whole")
    assert status == 200 and json.loads(raw)["usage"]["completion_tokens"] == 3
    got = {k: v for k, v in rows(agent).items() if v.model == "m"}
    assert set(got) == {"plain", "asked", "whole"}, got
    for request_id, completion in (("plain", 5), ("asked", 8), ("whole", 3)):
        row = got[request_id]
        assert (row.prompt_tokens, row.completion_tokens, row.cached_tokens) == (PROMPT_TOKENS, completion, 0)
        assert (row.status, row.model, row.tenant, row.jti, row.origin_node, row.serving_node) == \
            (200, "m", "", "", "", "node-u"), row
        assert row.duration_ms > 0 and row.queued_ms >= 0
    assert got["plain"].ttft_ms is not None and got["whole"].ttft_ms is None
    assert agent.status()["usage"]["rows_written"] >= 3
    with urllib.request.urlopen(agent.url + "/metrics", timeout=10) as r:
        metrics = r.read().decode()
    assert 'viiwork_usage_requests_total{model="m",status="2xx",tenant="-"} 3.0' in metrics, metrics
    assert f'viiwork_usage_tokens_total{{kind="prompt",model="m",tenant="-"}} {3.0 * PROMPT_TOKENS}' in metrics
    assert 'viiwork_usage_tokens_total{kind="completion",model="m",tenant="-"} 16.0' in metrics


def test_the_end_waits_for_the_rows_commit(agent: Agent) -> None:
    """A stream's [DONE] and a whole answer are held while the usage file is locked (its row
    cannot be committed yet), and come once it is: the row is committed before the end."""
    post(agent, {"model": "l", "messages": MESSAGES}, "warm")  # the file exists, its schema made
    assert agent.state_dir is not None
    lock = sqlite3.connect(agent.state_dir / "usage.sqlite3", isolation_level=None)
    seen: dict[str, float] = {}

    def stream() -> None:
        req = urllib.request.Request(agent.url + "/v1/chat/completions", method="POST",
                                     data=json.dumps({"model": "l", "messages": MESSAGES, "stream": True}).encode(),
                                     headers={"Content-Type": "application/json", "X-Request-Id": "held"})
        with urllib.request.urlopen(req, timeout=20) as r:
            for line in r:
                if line.startswith(b"data: {") and "first" not in seen:
                    seen["first"] = time.monotonic()
                if line.startswith(b"data: [DONE]"):
                    seen["done"] = time.monotonic()

    def whole() -> None:
        post(agent, {"model": "l", "messages": MESSAGES}, "held-whole")
        seen["whole"] = time.monotonic()

    lock.execute("BEGIN IMMEDIATE")  # the agent's writer waits for this lock (usage.md)
    try:
        threads = [threading.Thread(target=stream), threading.Thread(target=whole)]
        for t in threads:
            t.start()
        time.sleep(1.5)
        released = time.monotonic()
    finally:
        lock.execute("ROLLBACK")
        lock.close()
    for t in threads:
        t.join(20)
    assert seen["first"] < released, seen  # the answer streamed meanwhile
    assert seen["done"] >= released and seen["whole"] >= released, (seen, released)
    assert {"held", "held-whole"} <= set(rows(agent))


def test_a_client_that_leaves_mid_stream_has_a_499_row_with_what_was_relayed(agent: Agent) -> None:
    req = urllib.request.Request(agent.url + "/v1/chat/completions", method="POST",
                                 data=json.dumps({"model": "slow", "messages": MESSAGES, "stream": True}).encode(),
                                 headers={"Content-Type": "application/json", "X-Request-Id": "left"})
    with urllib.request.urlopen(req, timeout=20) as r:
        seen = 0
        while seen < 20:  # 20 of the 50 content events; the client leaves
            line = r.readline()
            assert line, "the stream ended early"
            seen += b'"content":"' in line
    deadline = time.monotonic() + 10
    while "left" not in rows(agent):
        assert time.monotonic() < deadline, "no row for the request whose client left"
        time.sleep(0.1)
    row = rows(agent)["left"]
    # No usage event came: the completion is the events relayed (the role event, 20 content
    # events or a few more), the prompt unknown (docs/usage.md, "Estimated counts").
    assert row.status == 499 and row.prompt_tokens is None and row.ttft_ms is not None, row
    assert row.completion_tokens is not None and 21 <= row.completion_tokens <= 30, row
    with urllib.request.urlopen(agent.url + "/metrics", timeout=10) as m:
        metrics = m.read().decode()
    counted = [line for line in metrics.splitlines()
               if line.startswith('viiwork_usage_tokens_total{') and 'model="slow"' in line and 'completion' in line]
    assert counted and float(counted[0].rsplit(" ", 1)[1]) >= row.completion_tokens, counted


def test_a_negative_max_tokens_is_refused_with_keys_off(agent: Agent) -> None:
    try:
        post(agent, {"model": "m", "messages": MESSAGES, "max_tokens": -100}, "negative")
        raise AssertionError("admitted")
    except urllib.error.HTTPError as exc:
        assert exc.code == 400
        error = json.loads(exc.read())["error"]
    assert error["param"] == "max_tokens" and error["type"] == "invalid_request_error", error
    assert "negative" not in rows(agent)


def test_kill_9_while_streams_run_loses_no_row_of_a_finished_request(tmp_path: Path) -> None:
    binary = fake_engine_binary(tmp_path / "bin")
    finished: list[str] = []
    lock = threading.Lock()
    stop = threading.Event()

    def client(agent: Agent, n: int) -> None:
        i = 0
        while not stop.is_set():
            request_id = f"c{n}-{i}"
            i += 1
            try:
                status, raw = post(agent, {"model": "m", "messages": MESSAGES, "stream": True}, request_id, 5)
            except (OSError, http.client.HTTPException):  # the agent died mid-answer
                return
            if status == 200 and raw.rstrip().endswith(b"data: [DONE]"):
                with lock:
                    finished.append(request_id)

    with run_agent(tmp_path, [model(binary, parallel=4, FAKE_TOKENS="4", FAKE_TOKEN_DELAY_S="0.01")],
                   name="node-k") as agent:
        agent.wait_healthy("m")
        threads = [threading.Thread(target=client, args=(agent, n), daemon=True) for n in range(6)]
        for t in threads:
            t.start()
        deadline = time.monotonic() + 20
        while len(finished) < 40 and time.monotonic() < deadline:
            time.sleep(0.05)
        os.kill(agent.proc.pid, signal.SIGKILL)
        agent.proc.wait(10)
        stop.set()
        for t in threads:
            t.join(10)
        got = rows(agent)
    assert len(finished) >= 40, len(finished)
    missing = [r for r in finished if r not in got]
    assert not missing, f"{len(missing)} of {len(finished)} finished requests have no row: {missing[:5]}"
    assert all(got[r].completion_tokens == 4 for r in finished)


def test_a_client_request_id_is_kept_only_when_short_visible_ascii(agent: Agent) -> None:
    """X-Request-Id (docs/routing.md, "Response headers"): 1..128 visible ASCII characters are
    kept (echoed, in the row); anything else (too long, a space, a control or non-ASCII
    character) gets a fresh id, echoed, and that is the row's."""
    host, port = agent.url.removeprefix("http://").rsplit(":", 1)
    body = json.dumps({"model": "m", "messages": MESSAGES, "max_tokens": 1}).encode()

    def send(request_id: str) -> str:
        conn = http.client.HTTPConnection(host, int(port), timeout=20)
        try:
            conn.putrequest("POST", "/v1/chat/completions")
            conn.putheader("Content-Type", "application/json")
            conn.putheader("Content-Length", str(len(body)))
            conn.putheader("X-Request-Id", request_id.encode("utf-8"))
            conn.endheaders(body)
            resp = conn.getresponse()
            resp.read()
            assert resp.status == 200, (request_id[:20], resp.status)
            echoed = resp.getheader("X-Request-Id")
            assert echoed
            return echoed
        finally:
            conn.close()

    kept = "k" * 127 + "~"
    assert send(kept) == kept
    # (An ESC or other control character but tab is refused by aiohttp's parser before: 400.)
    fresh = {send(bad) for bad in ("k" * 129, "x" * 6000, "caf\u00e9-1", "two words", "tab\there")}
    assert len(fresh) == 5 and all(len(f) == 32 and int(f, 16) >= 0 for f in fresh), fresh
    got = rows(agent)
    assert kept in got and fresh <= set(got)
    assert not any(len(k) > 128 or not k.isascii() for k in got)
