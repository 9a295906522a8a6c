"""The dashboard's server side (agent/serving/dashboard.py): a real ClientApi app on loopback.

Its page in a real browser: tests/mesh/test_dashboard_browser.py.
"""

from __future__ import annotations

import json
import re
import time
import urllib.request
from pathlib import Path

import aiohttp

from support.agent import run_agent
from support.api_app import agent_api
from support.engines import fake_engine_binary
from viiwork.agent.serving.dashboard import BUCKET_S, WINDOW_S, RequestStats

UI = Path(__file__).resolve().parents[2] / "agent" / "serving" / "ui"
CSP = "default-src 'self'; frame-ancestors 'none'"


def test_static_files_never_write_html() -> None:
    files = [p for p in UI.rglob("*") if p.suffix in (".js", ".html", ".css")]
    assert {p.name for p in files} >= {"index.html", "dashboard.js", "dashboard.css", "uPlot.iife.min.js"}
    for path in files:
        text = path.read_text()
        found = re.findall(r"innerHTML|outerHTML|insertAdjacentHTML|document\.write|\beval\b|new Function", text)
        assert not found, f"{path.relative_to(UI)} uses {sorted(set(found))}"


def test_vendored_uplot_records_its_source_and_licence() -> None:
    readme = (UI / "vendor" / "uplot" / "README.md").read_text()
    assert "1.6.32" in readme and "npm" in readme
    assert "MIT License" in (UI / "vendor" / "uplot" / "LICENSE").read_text()


async def test_pages_carry_the_security_headers_and_loopback_host_is_checked() -> None:
    async with agent_api({}) as (url, _api), aiohttp.ClientSession() as http:
        port = url.rsplit(":", 1)[1]
        for path, ctype in (("/ui", "text/html"), ("/ui/static/dashboard.js", "text/javascript"),
                            ("/ui/static/uPlot.iife.min.js", "text/javascript"), ("/ui/api/state", "application/json")):
            async with http.get(url + path) as r:
                assert r.status == 200, path
                assert r.content_type == ctype
                assert r.headers["Content-Security-Policy"] == CSP
                assert r.headers["X-Content-Type-Options"] == "nosniff"
            # A loopback name with any port or none: a tunnel (ssh -L 9000:localhost:PORT) keeps its own port.
            for host in (f"localhost:{port}", f"[::1]:{port}", "127.0.0.1", "localhost:1"):
                async with http.get(url + path, headers={"Host": host}) as r:
                    assert r.status == 200, (path, host)
            # DNS rebinding: a page of evil.example resolved to 127.0.0.1 sends its own name.
            for host in (f"evil.example:{port}", "evil.example", f"localhost.evil.example:{port}"):
                async with http.get(url + path, headers={"Host": host}) as r:
                    assert r.status == 403, (path, host)
                    assert r.headers["Content-Security-Policy"] == CSP
        async with http.get(url + "/ui/static/../api.py") as r:
            assert r.status == 404
        async with http.get(url + "/ui/static/nothing.js") as r:
            assert r.status == 404


async def test_a_refusal_is_counted_and_listed_without_the_prompt() -> None:
    async with agent_api({}) as (url, _api), aiohttp.ClientSession() as http:
        body = {"model": "nope", "messages": [{"role": "user", "content": "SECRET-PROMPT"}]}
        async with http.post(url + "/v1/chat/completions", json=body) as r:
            assert r.status == 404
        async with http.get(url + "/ui/api/state") as r:
            state = await r.json()
    assert state["standalone"] is True
    assert [n["name"] for n in state["nodes"]] == ["test-node"]
    assert sum(b["requests"] for b in state["buckets"]) == 1
    assert sum(b["errors"] for b in state["buckets"]) == 1
    [error] = state["errors"]
    assert (error["model"], error["status"]) == ("-", 404)
    assert "nope" in error["message"]
    assert "SECRET-PROMPT" not in str(state)


def test_ring_keeps_fifteen_minutes_of_ten_second_buckets() -> None:
    now = [1_000_000.0]
    stats = RequestStats(clock=lambda: now[0])
    stats.observe("m", 200, 0.010, 0.050, 0.2)
    stats.observe("m", 200, None, 0.030, 0.1)
    stats.observe("m", 503, None, 0.001, 0.001, "no backend")
    [*_, last] = stats.buckets()
    assert len(stats.buckets()) == WINDOW_S // BUCKET_S
    assert (last["requests"], last["errors"], last["queued_ms_avg"], last["queued_ms_max"]) == (3, 1, 10.0, 10.0)
    # TTFT over the answers below 400 only (the 503 carries no token), as the Prometheus histogram.
    assert last["ttft_ms_avg"] == 40.0 and last["ttft_ms_max"] == 50.0
    assert last["rate_per_s"] == 3 / BUCKET_S
    now[0] += WINDOW_S - BUCKET_S  # still the window's oldest bucket
    assert stats.buckets()[0]["requests"] == 3
    now[0] += BUCKET_S  # gone from the window, and its slot reused afresh
    assert sum(b["requests"] for b in stats.buckets()) == 0
    stats.observe("m", 200, 0.0, 0.001, 0.001)
    assert stats.buckets()[-1]["requests"] == 1


def test_a_stream_is_charted_with_its_first_chunk_and_its_queue_time(tmp_path: Path) -> None:
    # 10 tokens 0.2 s apart: the first chunk leaves at least 1.8 s before the stream ends.
    model = {"name": "m", "engine": "llamacpp", "path": "/dev/null", "parallel": 1, "backends": 1,
             "llamacpp": {"binary": str(fake_engine_binary(tmp_path / "bin"))},
             "env": {"FAKE_LOAD_S": "0.1", "FAKE_TOKENS": "10", "FAKE_TOKEN_DELAY_S": "0.2"}}
    with run_agent(tmp_path, [model]) as agent:
        agent.wait_healthy("m", timeout_s=30)
        body = json.dumps({"model": "m", "stream": True, "messages": [{"role": "user", "content": "hi"}]}).encode()
        req = urllib.request.Request(f"{agent.url}/v1/chat/completions", data=body,
                                     headers={"Content-Type": "application/json"})
        began = time.monotonic()
        with urllib.request.urlopen(req, timeout=30) as r:
            assert r.status == 200
            r.read()
        whole_ms = (time.monotonic() - began) * 1000
        with urllib.request.urlopen(f"{agent.url}/ui/api/state", timeout=5) as r:
            state = json.load(r)
    [bucket] = [b for b in state["buckets"] if b["requests"]]
    assert bucket["requests"] == 1 and bucket["errors"] == 0
    assert bucket["queued_ms_avg"] is not None and 0 <= bucket["queued_ms_avg"] <= bucket["ttft_ms_max"]
    # The first chunk, not the end of the stream: nine token gaps (1.8 s) come after it.
    assert bucket["ttft_ms_max"] < whole_ms - 1500, (bucket, whole_ms)


def test_every_ui_file_is_package_data() -> None:
    """The wheel (and so the .deb's venv) carries each file the page loads."""
    import fnmatch
    import tomllib

    pyproject = tomllib.loads((UI.parents[2] / "pyproject.toml").read_text())
    globs = pyproject["tool"]["setuptools"]["package-data"]["viiwork.agent.serving"]
    for path in UI.rglob("*"):
        if path.is_file():
            rel = str(path.relative_to(UI.parent))
            assert any(fnmatch.fnmatch(rel, g) and rel.count("/") == g.count("/") for g in globs), rel
