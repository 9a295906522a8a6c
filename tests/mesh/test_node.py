"""MeshNode in one process: three nodes over real mutual TLS on 127.0.0.1."""

from __future__ import annotations

import pytest

from support.mesh_crypto import chat_model
from support.mesh_nodes import enrol, gossip_ok, loopback_settings, make_ca, wait_for
from viiwork.mesh.membership import Liveness
from viiwork.mesh.node import MeshNode
from viiwork.mesh.summary import PublishedState


def alive_peers(node):
    return {p.name for p in node.peers() if p.liveness is Liveness.ALIVE}


async def start_three(tmp_path, trust, discovery=("seeds",)):
    ca = make_ca(tmp_path / "ca") if trust == "ca" else None
    nodes = []
    seeds: tuple[str, ...] = ()
    for i in range(3):
        state = tmp_path / f"n{i}"
        if ca is not None:
            enrol(state, ca, f"n{i}")
        node = MeshNode(loopback_settings(state, f"n{i}", trust=trust, ca_dir=ca, mesh_id="lab" if trust == "open" else None,
                                          seeds=seeds, discovery=discovery))
        node.set_local_summary([chat_model(f"model-{i}")])
        await node.start()
        nodes.append(node)
        if "seeds" in discovery:
            seeds = (f"127.0.0.1:{nodes[0].listen_port}",)
    return nodes


@pytest.fixture(params=["ca", "open"])
async def three(request, tmp_path):
    nodes = await start_three(tmp_path, request.param)
    yield nodes
    for node in nodes:
        await node.stop(leave=False)


async def test_three_nodes_find_each_other_and_publish_views(three):
    a, b, c = three
    await wait_for(lambda: all(len(alive_peers(n)) == 2 for n in three), 10, "all three to see each other")
    doc = a.view()
    assert doc["self"]["name"] == "n0" and doc["self"]["id"] == a.node_id
    assert {n["name"] for n in doc["nodes"]} == {"n1", "n2"}
    for entry in doc["nodes"]:
        assert entry["liveness"] == "alive" and entry["state"] == "serving"
        assert entry["trust"] == a.settings.trust and entry["api"] == "127.0.0.1:8086"
        assert entry["models"][0]["name"] in ("model-1", "model-2") and entry["models"][0]["waiting"] is None
        assert 0 <= entry["age_ms"] < 2000
    assert doc["counters"]["drops"]["bad_signature"] == 0


async def test_capacity_change_reaches_the_others(three):
    a, b, c = three
    await wait_for(lambda: all(len(alive_peers(n)) == 2 for n in three), 10, "convergence")
    seen = []
    a.subscribe(seen.append)
    c.set_local_summary([chat_model("model-2", busy=4)], PublishedState.DRAINING)

    def c_busy_everywhere():
        for n in (a, b):
            (pc,) = [p for p in n.peers() if p.node_id == c.node_id]
            if pc.models[0].busy != 4 or pc.state is not PublishedState.DRAINING:
                return False
        return True

    await wait_for(c_busy_everywhere, 5, "c's new capacity on a and b")
    assert c.node_id in seen


async def test_graceful_stop_is_left_at_once_and_silence_is_suspect_then_dead(three):
    a, b, c = three
    await wait_for(lambda: all(len(alive_peers(n)) == 2 for n in three), 10, "convergence")
    await c.stop(leave=True)
    await wait_for(lambda: a.membership.liveness(c.node_id) is Liveness.LEFT
                   and b.membership.liveness(c.node_id) is Liveness.LEFT, 3, "c to be left on a and b")
    await b.stop(leave=False)  # b goes silent without a word
    # In probe mode a is left with two silent members: c said it was leaving, so its misses
    # cost a's health nothing and it is no relay (mesh/detector.py); b's first missed probe
    # makes it suspect. (Before, c's misses stretched a's probe interval: b took up to 8 s.)
    await wait_for(lambda: a.membership.liveness(b.node_id) is Liveness.SUSPECT, 3, "b suspect on a")
    await wait_for(lambda: a.membership.liveness(b.node_id) is Liveness.DEAD, 10, "b dead on a")
    assert a.view()["nodes"][-1]["liveness"] in ("dead", "left")


async def test_model_conflicts_are_flagged_in_the_view(three):
    a, b, c = three
    b.set_local_summary([chat_model("shared", fingerprint="weights-1")])
    c.set_local_summary([chat_model("shared", fingerprint="weights-2")])

    def flagged():
        return a.view()["conflicts"] == [{"model": "shared", "nodes": {b.node_id: "weights-1", c.node_id: "weights-2"}}]

    await wait_for(flagged, 10, "the conflict to be flagged on a")
    assert all(m["conflict"] for n in a.view()["nodes"] for m in n["models"])


async def test_mdns_on_loopback_finds_peers_without_seeds(tmp_path):
    nodes = await start_three(tmp_path, "open", discovery=("mdns",))
    try:
        assert all(not n.settings.seeds for n in nodes)
        await wait_for(lambda: all(len(alive_peers(n)) == 2 for n in nodes), 15, "mDNS discovery")
    finally:
        for node in nodes:
            await node.stop(leave=False)


async def test_another_open_mesh_on_the_same_lan_is_ignored(tmp_path):
    ours = await start_three(tmp_path / "ours", "open", discovery=("mdns",))
    other = MeshNode(loopback_settings(tmp_path / "other", "other", trust="open", mesh_id="another-lab",
                                       discovery=("mdns", "seeds"),
                                       seeds=(f"127.0.0.1:{ours[0].listen_port}",)))
    await other.start()
    try:
        await wait_for(lambda: all(len(alive_peers(n)) == 2 for n in ours), 15, "our mesh to form")
        # The other mesh dials our seed: the TLS handshake fails (different CA), counted.
        await wait_for(lambda: ours[0].membership.counters.transport["handshake_failed"] >= 1, 5,
                       "the other mesh's handshake to fail")
        assert all("other" not in {p.name for p in n.peers()} for n in ours)
        assert other.peers() == []
    finally:
        for node in ours + [other]:
            await node.stop(leave=False)


def test_settings_come_from_the_agents_config(tmp_path):
    from viiwork.agent.config.load import load_config
    from viiwork.mesh.node import MeshSettings

    path = tmp_path / "viiwork.toml"
    path.write_text(f"""
[node]
name = "gpu-01"
state_dir = "{tmp_path / 'state'}"

[mesh]
trust = "ca"
ca_certificate = "{tmp_path / 'ca.crt'}"
seeds = ["10.0.0.2:8087"]
gossip_interval_ms = 250
fanout = 4
probe_interval_ms = 800
probe_timeout_ms = 300
indirect_checks = 2
suspicion_mult = 5
""")
    cfg = load_config(path)
    s = MeshSettings.from_config(cfg.mesh, cfg.node, cfg.api.listen, "1.2.3")
    d = s.probe.detector
    assert s.detector == "probe"  # the default
    assert (d.probe_interval_ms, d.probe_timeout_ms, d.indirect_checks, d.suspicion_mult) == (800, 300, 2, 5)
    assert d.indirect_timeout_ms == 900  # the relays' two pings and a round trip
    assert (s.name, s.trust, s.seeds, s.listen, s.api_listen) == ("gpu-01", "ca", ("10.0.0.2:8087",), "0.0.0.0:8087",
                                                                  "0.0.0.0:8086")
    assert s.gossip.gossip_interval_ms == 250 and s.gossip.fanout == 4 and s.gossip.dead_after_ms == 10_000
    assert s.discovery == ("mdns", "seeds") and s.version == "1.2.3"


async def test_a_peer_that_never_answers_does_not_stall_gossip(tmp_path):
    import asyncio

    held: list[asyncio.StreamWriter] = []

    async def swallow(reader, writer):  # accepts TCP, never speaks TLS
        held.append(writer)

    blackhole = await asyncio.start_server(swallow, "127.0.0.1", 0)
    hole = f"127.0.0.1:{blackhole.sockets[0].getsockname()[1]}"
    b = MeshNode(loopback_settings(tmp_path / "b", "b", trust="open", mesh_id="lab"))
    await b.start()
    a = MeshNode(loopback_settings(tmp_path / "a", "a", trust="open", mesh_id="lab",
                                   seeds=(hole, f"127.0.0.1:{b.listen_port}")))
    await a.start()
    try:
        await wait_for(lambda: alive_peers(a) == {"b"} and alive_peers(b) == {"a"}, 5, "a and b despite the hole")
        await wait_for(lambda: a.membership.counters.transport["exchange_timeout"] >= 1, 5, "the hole to time out")
        before = gossip_ok(a)
        await wait_for(lambda: gossip_ok(a) >= before + 5, 5, "gossip with b to keep going")
    finally:
        await a.stop(leave=False)
        await b.stop(leave=False)
        for w in held:
            w.close()
        blackhole.close()
        await blackhole.wait_closed()


async def test_idle_tls_connections_in_an_open_mesh_are_capped_and_closed(tmp_path):
    """Anyone who knows an open mesh's id can make a certificate and complete handshakes:
    established connections are capped (overall and per source address) and one that sends
    no request within the first-request deadline is closed, its place given back; a real
    peer's gossip goes on meanwhile."""
    import asyncio
    import ssl

    from cryptography.hazmat.primitives import serialization

    from viiwork.mesh.identity import load_or_create_identity
    from viiwork.mesh.tls import client_context
    from viiwork.mesh.trust import issue_open_certificate, open_mesh_ca

    rogue = tmp_path / "rogue"
    rogue.mkdir()
    ident = load_or_create_identity(rogue)
    (rogue / "node.crt").write_bytes(issue_open_certificate(ident, "rogue", "lab"))
    ctx = client_context(rogue / "node.crt", ident.key_path,
                         open_mesh_ca("lab")[1].public_bytes(serialization.Encoding.PEM))
    b = MeshNode(loopback_settings(tmp_path / "b", "b", trust="open", mesh_id="lab"))
    await b.start()
    site = b._site
    site.first_request_timeout_s, site.max_connections, site.max_connections_per_address = 1.0, 50, 30
    held: list[asyncio.StreamWriter] = []
    a = None

    async def one(source: str) -> asyncio.StreamReader | None:
        try:
            reader, writer = await asyncio.wait_for(asyncio.open_connection(
                "127.0.0.1", b.listen_port, ssl=ctx, server_hostname="x", local_addr=(source, 0)), 5)
        except (OSError, ssl.SSLError):
            return None
        held.append(writer)
        return reader

    try:
        readers = [await one("127.0.2.1") for _ in range(35)] + [await one("127.0.2.2") for _ in range(35)]
        established = [r for r in readers if r is not None]
        # 30 from the first address, 20 from the second (50 in all): the rest closed at accept.
        assert site.connections_open == 50 and len(established) <= 50
        assert b.membership.counters.transport["connection_refused"] == 20
        # Sending nothing: all closed after the deadline, every place given back.
        ends = await asyncio.gather(*(asyncio.wait_for(r.read(), 5) for r in established), return_exceptions=True)
        assert all(e == b"" or isinstance(e, (OSError, ssl.SSLError)) for e in ends), ends[:3]
        await wait_for(lambda: site.connections_open == 0, 2, "every place to be given back")
        assert b.membership.counters.transport["first_request_timeout"] == 50
        # A real peer gossips with b under the same deadline.
        a = MeshNode(loopback_settings(tmp_path / "a", "a", trust="open", mesh_id="lab",
                                       seeds=(f"127.0.0.1:{b.listen_port}",)))
        await a.start()
        await wait_for(lambda: alive_peers(a) == {"b"} and alive_peers(b) == {"a"}, 5, "a and b to gossip")
        before = gossip_ok(a)
        await wait_for(lambda: gossip_ok(a) >= before + 5, 5, "gossip to go on")
        assert a.membership.counters.transport["exchange_failed"] == 0
    finally:
        for w in held:
            w.close()
        if a is not None:
            await a.stop(leave=False)
        await b.stop(leave=False)
