"""The dashboard (/ui) in a real browser: headless Debian chromium through Selenium, against
three real agents on loopback forming a mesh over fake llama-servers (issue 20).

The page on node-a lists the three nodes; node-c's backend killed (its fake engine process,
with respawns held off) shows as down within 10 s; a request sent to node-a appears in its
chart's data, and node-b's measured speeds (its fake engine's token counters, published in
node-b's summary's ``speeds`` extension) appear on node-a's page.
``VIIWORK_SCREENSHOT=FILE`` (``make screenshot``) also saves the page as a PNG.
"""

from __future__ import annotations

import json
import os
import signal
import time
import urllib.request
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path

import pytest

from support.agent import Agent, run_agent
from support.browser import chromium, missing
from support.client_keys import ctl, issue
from support.engines import fake_engine_binary

SNAPSHOT = """
const rows = [...document.querySelectorAll('#nodes tbody tr')];
const models = {};
for (const el of document.querySelectorAll('#nodes [data-model]')) {
  const speed = el.querySelector('.speed');
  models[el.closest('tr').dataset.node + '/' + el.dataset.model] = {state: el.dataset.state, text: el.textContent,
    speed: speed ? speed.textContent : null, prefill: speed ? speed.dataset.prefill : null,
    decode: speed ? speed.dataset.decode : null};
}
const links = {};
for (const a of document.querySelectorAll('[data-peer-link]')) links[a.dataset.peerLink] = a.href;
return {nodes: rows.map(r => r.dataset.node), models, links,
        chart_requests: document.getElementById('chart-rate').dataset.requests || null,
        totals: document.getElementById('totals').textContent,
        canvases: document.querySelectorAll('.chart canvas').length};
"""


def mesh_section(seeds: list[str]) -> dict:
    return {"trust": "open", "mesh_id": "dashboard-mesh", "listen": "127.0.0.1:0", "advertise": "127.0.0.1",
            "discovery": ["seeds"], "seeds": seeds, "gossip_interval_ms": 100,
            "suspect_after_ms": 1000, "dead_after_ms": 3000}


@pytest.fixture
def mesh3(tmp_path: Path) -> Iterator[dict[str, Agent]]:
    binary = fake_engine_binary(tmp_path / "bin")
    agents: dict[str, Agent] = {}
    seeds: list[str] = []
    with ExitStack() as stack:
        for name in "abc":
            model = {"name": f"model-{name}", "engine": "llamacpp", "path": "/dev/null", "parallel": 2,
                     "backends": 1, "llamacpp": {"binary": str(binary)}, "env": {"FAKE_LOAD_S": "0.1"}}
            # node-c's engine, once killed, stays down (no respawn within the test).
            health = {"respawn_backoff_s": 600} if name == "c" else {}
            agents[name] = stack.enter_context(run_agent(
                tmp_path, [model], name=f"node-{name}", extra={"mesh": mesh_section(seeds), "health": health}))
            if not seeds:
                seeds = [agents[name].wait_for(lambda d: bool(d["mesh"]["self"]["mesh"]), 30,
                                               "mesh address")["mesh"]["self"]["mesh"]]
        for agent in agents.values():
            agent.wait_for(lambda d: all(b["state"] == "healthy" for m in d["models"] for b in m["backends"])
                           and d["mesh"]["peers"].get("alive", 0) == 2, 30, "healthy, two alive peers")
        yield agents


def test_dashboard_lists_nodes_shows_a_dead_backend_and_charts_a_request(mesh3: dict[str, Agent]) -> None:
    why = missing()
    if why is not None:
        pytest.skip(why)
    from selenium.webdriver.support.ui import WebDriverWait

    a, c = mesh3["a"], mesh3["c"]
    with chromium() as driver:
        driver.get(f"{a.url}/ui")

        def page(_: object = None) -> dict:
            """What the page shows now, read in one script (it rebuilds its rows on each poll)."""
            return driver.execute_script(SNAPSHOT)

        def until(predicate, timeout_s: float, what: str) -> dict:
            last: dict = {}

            def ok(_: object) -> bool:
                nonlocal last
                last = page()
                return bool(predicate(last))
            try:
                WebDriverWait(driver, timeout_s, poll_frequency=0.2).until(ok)
            except Exception as exc:
                raise AssertionError(f"{what}: the page showed {json.dumps(last)}") from exc
            return last

        shown = until(lambda p: set(p["nodes"]) == {"node-a", "node-b", "node-c"}, 15, "three nodes")
        assert shown["models"]["node-c/model-c"]["state"] == "up"
        assert shown["links"]["node-b"] == f"{mesh3['b'].url}/ui"

        # A request on node-a (served by node-b): in the chart's data within a poll or two.
        body = json.dumps({"model": "model-b", "messages": [{"role": "user", "content": "hi"}]}).encode()
        req = urllib.request.Request(f"{a.url}/v1/chat/completions", data=body,
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=30) as r:
            assert r.status == 200
        shown = until(lambda p: p["chart_requests"] == "1", 10, "the request charted")
        assert shown["canvases"] >= 3, "uPlot drew no charts"
        assert shown["totals"] == "1 request, 0 errors in the window"
        # Node-c has served nothing: its speeds are unknown ("—"). Node-b's engine counted the
        # request's tokens at 600/40 tokens/s (tests/support/fake_engine.py): node-b measures
        # them from two load reads and publishes them; node-a's page shows them.
        assert shown["models"]["node-c/model-c"]["speed"] == "prefill \u2014, decode \u2014"
        shown = until(lambda p: p["models"]["node-b/model-b"]["prefill"] == "600", 10, "node-b's speeds")
        assert shown["models"]["node-b/model-b"]["decode"] == "40"
        assert shown["models"]["node-b/model-b"]["speed"] == "prefill 600 tok/s, decode 40 tok/s"

        # node-c's engine killed: its model shows as down on node-a's page within 10 s.
        pid = c.model("model-c")["backends"][0]["pid"]
        killed = time.monotonic()
        os.kill(pid, signal.SIGKILL)
        shown = until(lambda p: p["models"]["node-c/model-c"]["state"] == "down", 10, "node-c's model down")
        assert time.monotonic() - killed < 10
        assert "backends 0/1" in shown["models"]["node-c/model-c"]["text"]
        assert shown["models"]["node-a/model-a"]["state"] == "up"
        # No CSP violation, no script error (the browser's own favicon.ico probe 404s: not the page's).
        logs = [e for e in driver.get_log("browser")
                if e.get("level") == "SEVERE" and "/favicon.ico" not in e.get("message", "")]
        assert not logs, logs
        shot = os.environ.get("VIIWORK_SCREENSHOT")
        if shot:
            driver.save_screenshot(shot)


def test_with_client_keys_the_page_asks_for_a_read_key_and_shows_the_node_with_it(tmp_path: Path) -> None:
    """Keys on (docs/dashboard.md): the page and its files load without a key, the data does not;
    the page asks for a read key, and once given one it shows the node; an inference-only key is
    refused with the gate's reason shown."""
    why = missing()
    if why is not None:
        pytest.skip(why)
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    ctl("keys", "issuer", "init", "--out", str(tmp_path / "issuer"))
    issuer = tmp_path / "issuer" / "issuer.key"
    reader, inference = issue(issuer, "--scope", "read"), issue(issuer)
    binary = fake_engine_binary(tmp_path / "bin")
    model = {"name": "m", "engine": "llamacpp", "path": "/dev/null", "parallel": 1, "backends": 1,
             "llamacpp": {"binary": str(binary)}}
    with run_agent(tmp_path, [model], extra={"auth": {"mode": "keys", "issuer_keys": str(tmp_path / "issuer" / "issuer.pub")}},
                   api_key=reader) as agent, chromium() as driver:
        driver.get(f"{agent.url}/ui")
        wait = WebDriverWait(driver, 10, poll_frequency=0.2)
        form = driver.find_element(By.ID, "key-form")
        wait.until(lambda _: form.is_displayed())
        assert driver.execute_script("return document.querySelectorAll('#nodes tbody tr').length") == 0

        def give(key: str) -> None:
            field = driver.find_element(By.ID, "key-input")
            field.send_keys(key)
            form.find_element(By.TAG_NAME, "button").click()

        give(inference)  # no read scope: refused, the form comes back with the reason
        wait.until(lambda _: form.is_displayed() and "read" in driver.find_element(By.ID, "key-message").text)
        give(reader)
        wait.until(lambda _: driver.execute_script(
            "return [...document.querySelectorAll('#nodes tbody tr')].map(r => r.dataset.node)") == ["node-a"])
        assert not form.is_displayed()
        assert driver.execute_script("return sessionStorage.getItem('viiwork.readKey')") == reader
        # "forget key" drops it: the next poll asks again.
        driver.find_element(By.ID, "key-forget").click()
        wait.until(lambda _: form.is_displayed())
