"""Browser safety of the client API (agent/serving/browser_guard.py): DNS rebinding, cross-site
requests and preflight-free POSTs, over a real ClientApi app on loopback (and on a LAN address in
a network namespace) and a real HTTP client; the decision functions for any address with
hypothesis; the config keys' bounds through the real loader; and a whole agent's wiring.
"""

from __future__ import annotations

import asyncio
import json
import os
import socket
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from conftest import require
from hypothesis import given
from hypothesis import strategies as st

from support.agent import run_agent
from support.api_app import agent_api
from support.netns import bridged_hosts, in_netns, netns_available
from viiwork.agent.config.load import ConfigError, parse_config
from viiwork.agent.serving.browser_guard import (
    BrowserGuard,
    BrowserPolicy,
    content_type_refused,
    fetch_site_refused,
    host_allowed,
    origin_allowed,
)

CHAT = {"model": "nope", "messages": [{"role": "user", "content": "hi"}]}
# One request per route family: (method, path, body).
ROUTES = [("POST", "/v1/chat/completions", CHAT), ("POST", "/v1/completions", {"model": "nope", "prompt": "x"}),
          ("POST", "/v1/embeddings", {"model": "nope", "input": "x"}), ("GET", "/v1/models", None),
          ("GET", "/v1/status", None), ("GET", "/metrics", None), ("GET", "/v1/mesh", None),
          ("GET", "/ui", None), ("GET", "/ui/api/state", None), ("GET", "/no/such/path", None)]


async def _call(http: aiohttp.ClientSession, method: str, url: str, body: Any = None,
                **headers: str) -> tuple[int, dict[str, Any] | None]:
    data = json.dumps(body).encode() if body is not None else None
    hdrs = {k.replace("_", "-"): v for k, v in headers.items()}
    if data is not None:
        hdrs.setdefault("Content-Type", "application/json")
    async with http.request(method, url, data=data, headers=hdrs) as r:
        doc = await r.json() if r.content_type == "application/json" else None
        return r.status, doc


def _code(doc: dict[str, Any] | None) -> str | None:
    return ((doc or {}).get("error") or {}).get("code")


async def test_a_rebinding_host_is_refused_on_every_route_family() -> None:
    async with agent_api({}) as (url, api), aiohttp.ClientSession() as http:
        port = url.rsplit(":", 1)[1]
        for method, path, body in ROUTES:
            status, doc = await _call(http, method, url + path, body, Host=f"evil.example:{port}")
            assert (status, _code(doc)) == (403, "host_not_allowed"), (method, path)
            assert "api.allowed_hosts" in doc["error"]["message"] and "\n" not in doc["error"]["message"]
            for host in (f"localhost:{port}", "localhost:9000", "127.0.0.1", f"[::1]:{port}", "app.localhost:1"):
                status, doc = await _call(http, method, url + path, body, Host=host)
                assert status != 403, (method, path, host, doc)
        status, doc = await _call(http, "GET", url + "/v1/status")
    assert doc is not None and doc["browser"]["refused_host"] == len(ROUTES)
    assert api.browser.refused["host"] == len(ROUTES)


async def test_allowed_hosts_let_a_name_in_by_port_or_any_port_and_star_turns_the_check_off() -> None:
    guard = BrowserGuard(BrowserPolicy(allowed_hosts=frozenset({"box.example", "proxy.example:8443"})))
    async with agent_api({}, browser=guard) as (url, _api), aiohttp.ClientSession() as http:
        for host, expected in (("box.example", 200), ("BOX.example:1234", 200), ("proxy.example:8443", 200),
                               ("proxy.example:8444", 403), ("proxy.example", 403), ("evil.example", 403)):
            status, _doc = await _call(http, "GET", url + "/v1/status", Host=host)
            assert status == expected, host
    async with agent_api({}, browser=BrowserGuard(BrowserPolicy(allowed_hosts=frozenset({"*"})))) as (url, _), \
            aiohttp.ClientSession() as http:
        status, _doc = await _call(http, "GET", url + "/v1/models", Host="evil.example")
        assert status == 200


async def test_a_cross_site_origin_is_refused_and_same_origin_or_none_passes() -> None:
    grafana = "https://grafana.example:3000"
    guard = BrowserGuard(BrowserPolicy(allowed_origins=frozenset({grafana})))
    async with agent_api({}, browser=guard) as (url, api), aiohttp.ClientSession() as http:
        port = url.rsplit(":", 1)[1]
        for method, path, body in ROUTES:
            for origin in ("http://evil.example", f"http://evil.example:{port}", f"http://127.0.0.1:{int(port) + 1}",
                           f"http://localhost:{port}", "null", "file://"):
                status, doc = await _call(http, method, url + path, body, Origin=origin)
                assert (status, _code(doc)) == (403, "origin_not_allowed"), (path, origin)
                assert "api.allowed_origins" in doc["error"]["message"]
        for origin, host in ((url, None), (f"http://localhost:{port}", f"localhost:{port}"), (grafana, None)):
            extra = {"Host": host} if host else {}
            status, _doc = await _call(http, "GET", url + "/v1/status", Origin=origin, **extra)
            assert status == 200, origin
            status, doc = await _call(http, "POST", url + "/v1/chat/completions", CHAT, Origin=origin, **extra)
            assert (status, _code(doc)) == (404, "model_not_found"), origin
        status, _doc = await _call(http, "GET", url + "/v1/status")
        assert status == 200
    assert api.browser.refused["origin"] == len(ROUTES) * 6


async def test_a_browsers_form_post_is_refused_and_curls_passes() -> None:
    async with agent_api({}) as (url, api), aiohttp.ClientSession() as http:
        chat = url + "/v1/chat/completions"
        text = json.dumps(CHAT)
        for ctype in ("text/plain;charset=UTF-8", "application/x-www-form-urlencoded", "multipart/form-data; b=x"):
            # A form's submission is a navigation (Sec-Fetch-Mode: navigate), past the fetch_site check.
            for headers in ({"Origin": url}, {"Sec-Fetch-Site": "cross-site", "Sec-Fetch-Mode": "navigate"},
                            {"Sec-Fetch-Site": "same-site", "Sec-Fetch-Mode": "navigate"}):
                async with http.post(chat, data=text, headers={"Content-Type": ctype, **headers}) as r:
                    doc = await r.json()
                    assert (r.status, _code(doc)) == (415, "unsupported_media_type"), (ctype, headers)
                    assert "application/json" in doc["error"]["message"]
        # curl -d '{...}' URL: form-urlencoded, no Origin; the body is still read as JSON.
        for headers in ({"Content-Type": "application/x-www-form-urlencoded", "User-Agent": "curl/8.14.1"},
                        {"Content-Type": "text/plain", "Sec-Fetch-Site": "same-origin"},
                        {"Content-Type": "application/json", "Origin": url}):
            async with http.post(chat, data=text, headers=headers) as r:
                assert (r.status, _code(await r.json())) == (404, "model_not_found"), headers
        async with http.get(url + "/metrics") as r:
            metrics = await r.text()
    assert api.browser.refused["content_type"] == 9
    assert 'viiwork_api_browser_refused_total{check="content_type"} 9.0' in metrics
    assert 'viiwork_api_browser_refused_total{check="host"} 0.0' in metrics


async def test_another_sites_img_or_no_cors_fetch_is_refused_and_a_link_passes() -> None:
    """``<img src=http://127.0.0.1:8086/v1/chat/completions>`` on any page: a GET without Origin.
    Refused before any route runs, so the dashboard's errors stay empty; a navigation (a peer
    dashboard's link), a same-origin fetch and a client without Sec-Fetch headers pass."""
    grafana = "https://grafana.example:3000"
    guard = BrowserGuard(BrowserPolicy(allowed_origins=frozenset({grafana})))
    async with agent_api({}, browser=guard) as (url, api), aiohttp.ClientSession() as http:
        refused = 0
        for method, path, _body in ROUTES:
            for site in ("cross-site", "same-site"):
                for mode in ("no-cors", "cors", "same-origin", ""):
                    headers = {"Sec-Fetch-Site": site, **({"Sec-Fetch-Mode": mode} if mode else {})}
                    status, doc = await _call(http, "GET" if method == "POST" else method, url + path, **headers)
                    assert (status, _code(doc)) == (403, "cross_site_not_allowed"), (path, headers)
                    assert "as a link" in doc["error"]["message"]
                    refused += 1
        for headers in ({"Sec-Fetch-Site": "cross-site", "Sec-Fetch-Mode": "navigate", "Sec-Fetch-Dest": "document"},
                        {"Sec-Fetch-Site": "same-site", "Sec-Fetch-Mode": "navigate"},
                        {"Sec-Fetch-Site": "same-origin", "Sec-Fetch-Mode": "cors"},
                        {"Sec-Fetch-Site": "none", "Sec-Fetch-Mode": "navigate"}, {},
                        {"Sec-Fetch-Site": "cross-site", "Sec-Fetch-Mode": "cors", "Origin": grafana}):
            status, _doc = await _call(http, "GET", url + "/v1/status", **headers)
            assert status == 200, headers
        status, doc = await _call(http, "GET", url + "/v1/chat/completions", Sec_Fetch_Site="cross-site",
                                  Sec_Fetch_Mode="navigate")
        assert (status, _code(doc)) == (405, "method_not_allowed")  # a link to it: the route answers
        status, state = await _call(http, "GET", url + "/ui/api/state", Sec_Fetch_Site="same-origin")
        async with http.get(url + "/metrics") as r:
            metrics = await r.text()
    assert status == 200 and state is not None and len(state["errors"]) == 1  # the navigation's 405 only
    assert api.browser.refused["fetch_site"] == refused == len(ROUTES) * 8
    assert f'viiwork_api_browser_refused_total{{check="fetch_site"}} {float(refused)}' in metrics


async def test_a_second_loopback_address_is_a_loopback_listener() -> None:
    async with agent_api({}, host="127.0.0.2") as (url, _api), aiohttp.ClientSession() as http:
        port = url.rsplit(":", 1)[1]
        assert (await _call(http, "GET", url + "/v1/status"))[0] == 200  # Host 127.0.0.2:PORT
        assert (await _call(http, "GET", url + "/v1/status", Host=f"localhost:{port}"))[0] == 200
        assert (await _call(http, "GET", url + "/v1/status", Host="192.0.2.7"))[0] == 403


@pytest.mark.netns
def test_a_listener_on_a_lan_address_takes_ip_literals_and_its_own_names() -> None:
    """A real non-loopback listener: 10.99.0.1 in a network namespace of its own (the machine's
    network untouched), the client in the same namespace."""
    ok, reason = netns_available()
    require(ok, reason)
    hostname = socket.gethostname().lower()

    async def exchange(address: str) -> dict[str, int]:
        guard = BrowserGuard(BrowserPolicy.of_this_host(allowed_hosts=["proxy.example"]))
        async with agent_api({}, host=address, browser=guard) as (url, _api), aiohttp.ClientSession() as http:
            port = url.rsplit(":", 1)[1]
            return {host: (await _call(http, "GET", url + "/v1/status", Host=host))[0]
                    for host in (f"{address}:{port}", "192.0.2.7", hostname, f"{hostname}.local:{port}",
                                 "proxy.example", "localhost:9000", "evil.example", f"evil.example:{port}",
                                 f"{hostname}.evil.example")}

    with bridged_hosts(f"vwb{os.getpid() % 10000}", 1) as hosts:
        found = in_netns(hosts.ns(1), lambda: asyncio.run(exchange(hosts.address(1))), 30)
    assert [h for h, status in found.items() if status == 200] == list(found)[:6], found
    assert {status for status in list(found.values())[6:]} == {403}, found


# --- the pure decisions, for any local address -----------------------------------------------

OWN = BrowserPolicy(own_names=frozenset({"gpu-box", "gpu-box.local", "gpu-box.lab.example"}))
LAN = "192.0.2.10"


def test_on_a_non_loopback_address_ip_literals_and_this_machines_names_pass() -> None:
    for host in ("192.0.2.10:8086", "198.51.100.1", "[2001:db8::1]:8086", "gpu-box", "GPU-BOX.local:8086",
                 "gpu-box.lab.example.", "localhost:8086"):
        assert host_allowed(host, LAN, OWN), host
    for host in ("evil.example", "gpu-box.evil.example", "gpu-box.local.evil", "", ":8086", "a:b:c", "[::1",
                 "gpu-box:0", "gpu-box:99999"):
        assert not host_allowed(host, LAN, OWN), host
    # The same names on a loopback address: loopback names only.
    assert not host_allowed("gpu-box", "127.0.0.1", OWN) and not host_allowed("192.0.2.10", "::1", OWN)
    assert not host_allowed("gpu-box", "::ffff:127.0.0.1", OWN)  # IPv4 loopback on a dual-stack listener
    assert host_allowed("gpu-box", "::ffff:192.0.2.10", OWN)
    assert host_allowed(None, LAN, OWN) and host_allowed(None, "127.0.0.1", OWN)  # no Host: no browser


_label = st.from_regex(r"[a-z0-9]([a-z0-9-]{0,10}[a-z0-9])?", fullmatch=True)
_name = st.lists(_label, min_size=1, max_size=4).map(".".join).filter(
    lambda n: n != "localhost" and not n.endswith(".localhost") and not n.replace(".", "").isdigit())
_port = st.one_of(st.none(), st.integers(1, 65535))


def _with_port(host: str, port: int | None) -> str:
    return host if port is None else f"{host}:{port}"


@given(_name, _port, st.sampled_from(["127.0.0.1", "127.9.9.9", "::1", LAN, "2001:db8::5"]))
def test_a_name_not_of_this_machine_nor_allowed_never_passes(name: str, port: int | None, local: str) -> None:
    assert not host_allowed(_with_port(name, port), local, BrowserPolicy(own_names=frozenset({"other"})))
    allowed = BrowserPolicy(allowed_hosts=frozenset({name}))
    assert host_allowed(_with_port(name, port), local, allowed)


@given(st.ip_addresses(), _port, st.sampled_from(["127.0.0.1", "::1", LAN]))
def test_an_ip_literal_host_passes_off_loopback_and_a_loopback_one_everywhere(ip: Any, port: int | None,
                                                                             local: str) -> None:
    host = _with_port(f"[{ip}]" if ip.version == 6 else str(ip), port)
    assert host_allowed(host, local, BrowserPolicy()) == (ip.is_loopback or local == LAN)


@given(st.sampled_from(["localhost", "127.0.0.1", "[::1]", "x.localhost"]), _port)
def test_a_loopback_name_passes_with_any_port_on_a_loopback_listener(host: str, port: int | None) -> None:
    assert host_allowed(_with_port(host, port), "127.0.0.1", BrowserPolicy())


@given(_name, st.integers(1, 65535), st.integers(1, 65535), st.sampled_from(["http", "https"]))
def test_origin_is_same_only_with_the_same_host_and_port(name: str, port: int, other: int, scheme: str) -> None:
    policy = BrowserPolicy()
    assert origin_allowed(f"{scheme}://{name}:{port}", f"{name}:{port}", policy)
    assert origin_allowed(f"{scheme}://{name}:{port}", f"{name}:{other}", policy) == (port == other)
    assert not origin_allowed(f"{scheme}://{name}x:{port}", f"{name}:{port}", policy)


def test_origin_default_ports_null_and_the_allowed_list() -> None:
    policy = BrowserPolicy(allowed_origins=frozenset({"https://grafana.example:3000"}))
    assert origin_allowed("https://api.example", "api.example", policy)  # a TLS proxy: 443 both
    assert origin_allowed("http://api.example:80", "api.example", policy)
    assert not origin_allowed("http://api.example:8080", "api.example", policy)
    assert origin_allowed("https://GRAFANA.example:3000", "api.example", policy)
    assert not origin_allowed("https://grafana.example", "api.example", policy)
    assert not origin_allowed("null", "api.example", policy)
    assert not origin_allowed("null", "x", BrowserPolicy(allowed_origins=frozenset({"*"})))
    assert origin_allowed("https://anything.example", "x", BrowserPolicy(allowed_origins=frozenset({"*"})))
    assert not origin_allowed("http://api.example/path", "api.example", policy)
    assert not origin_allowed("http://api.example", None, policy)
    assert origin_allowed(None, "evil.example", policy)


def test_content_type_rule() -> None:
    assert content_type_refused("POST", None, "http://x", None)  # no Content-Type: a browser's text/plain
    assert not content_type_refused("POST", "application/json", "http://x", "cross-site")
    assert not content_type_refused("GET", "text/plain", "http://x", "cross-site")
    assert not content_type_refused("POST", "application/x-www-form-urlencoded", None, None)  # curl -d
    assert not content_type_refused("POST", "text/plain", None, "none")  # typed in the address bar


def test_fetch_site_rule() -> None:
    none = BrowserPolicy()
    for site in ("cross-site", "same-site", " Cross-Site "):
        for mode in ("no-cors", "cors", "same-origin", "websocket", None):
            assert fetch_site_refused(site, mode, None, none), (site, mode)
        assert not fetch_site_refused(site, "navigate", None, none)  # a link, a typed URL
        assert not fetch_site_refused(site, "no-cors", "https://g.example", none)  # the Origin check's
        assert not fetch_site_refused(site, "no-cors", None, BrowserPolicy(allowed_origins=frozenset({"*"})))
    for site in ("same-origin", "none", None, "bogus"):
        assert not fetch_site_refused(site, "no-cors", None, none), site


# --- config -----------------------------------------------------------------------------

def _api_issues(key: str, value: list[str]) -> list[str]:
    try:
        parse_config(f"[api]\n{key} = {json.dumps(value)}\n", "browser.toml")
    except ConfigError as exc:
        return [str(i) for i in exc.issues]
    return []


def test_allowed_lists_are_bounded_and_checked_with_the_path() -> None:
    assert _api_issues("allowed_hosts", ["box.example", "box.example:8443", "[::1]:9", "10.0.0.1", "*"]) == []
    assert _api_issues("allowed_origins", ["https://grafana.example:3000", "http://[::1]:8", "*"]) == []
    for key, bad, says in (("allowed_hosts", "Box.example", "lowercase"), ("allowed_hosts", "a b", "DNS name"),
                           ("allowed_hosts", "box:99999", "1..65535"), ("allowed_hosts", "x" * 256, "255"),
                           ("allowed_origins", "grafana.example", "http://"),
                           ("allowed_origins", "https://g.example/", "no path"),
                           ("allowed_origins", "ftp://g.example", "http://")):
        [issue] = _api_issues(key, ["ok.example" if key == "allowed_hosts" else "https://ok.example", bad])
        assert f"api.{key}[1]" in issue and says in issue, issue
    [issue] = _api_issues("allowed_hosts", ["h.example"] * 65)
    assert "api.allowed_hosts" in issue and "at most 64" in issue


def test_a_whole_agent_reads_the_allowed_hosts(tmp_path: Path) -> None:
    with run_agent(tmp_path, [], extra={"api": {"allowed_hosts": ["box.example"]}}) as agent:
        for host, expected in (("box.example:8086", 200), ("evil.example", 403)):
            req = urllib.request.Request(agent.url + "/v1/status", headers={"Host": host})
            try:
                with urllib.request.urlopen(req, timeout=10) as r:
                    status, doc = r.status, json.load(r)
            except urllib.error.HTTPError as exc:
                status, doc = exc.code, json.load(exc)
            assert status == expected, (host, doc)
    assert doc["error"]["code"] == "host_not_allowed"


async def test_a_health_probe_passes_under_any_host_and_nothing_else_does() -> None:
    """A load balancer may probe /health by any alias of the box (docs/security.md); the same Host
    on /v1/status, or a POST to /health, is still refused."""
    async with agent_api({}) as (url, api), aiohttp.ClientSession() as http:
        status, doc = await _call(http, "GET", f"{url}/health", Host="lb-alias.example:8086")
        assert status in (200, 503) and doc is not None and "status" in doc
        status, doc = await _call(http, "GET", f"{url}/v1/status", Host="lb-alias.example:8086")
        assert (status, _code(doc)) == (403, "host_not_allowed")
        status, doc = await _call(http, "POST", f"{url}/health", {}, Host="lb-alias.example:8086")
        assert (status, _code(doc)) == (403, "host_not_allowed")
