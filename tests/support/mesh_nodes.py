"""Helpers for mesh tests with real state dirs: a CA, enrolled nodes, settings on loopback."""

from __future__ import annotations

import asyncio
import datetime as dt
import ssl
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path

from cryptography.hazmat.primitives import serialization

from viiwork.mesh import tls
from viiwork.mesh.identity import load_or_create_identity
from viiwork.mesh.membership import GossipSettings
from viiwork.mesh.node import MeshNode, MeshSettings
from viiwork.mesh.probe_transport import ProbeTransport
from viiwork.mesh.trust import (
    init_ca,
    install_certificate,
    issue_open_certificate,
    load_ca,
    make_signing_request,
    open_mesh_ca,
    sign_request,
)

FAST = GossipSettings(gossip_interval_ms=100, suspect_after_ms=600, dead_after_ms=1500, scale_with_size=False)


def make_ca(directory: Path) -> Path:
    init_ca(directory)
    return directory


def enrol(state_dir: Path, ca_dir: Path, name: str, days: int = 30, now: dt.datetime | None = None) -> Path:
    """Enrol a node the way the CLI does (request, sign, install); returns the cert path."""
    ident = load_or_create_identity(state_dir)
    key, cert = load_ca(ca_dir)
    pem = sign_request(key, cert, make_signing_request(ident, name), days=days, now=now)
    if now is not None:  # an intentionally dated certificate: skip the validity check
        path = state_dir / "node.crt"
        path.write_bytes(pem)
        return path
    return install_certificate(state_dir, pem, ident, cert)


def loopback_settings(state_dir: Path, name: str, *, trust: str = "ca", ca_dir: Path | None = None,
                      mesh_id: str | None = None, seeds: tuple[str, ...] = (),
                      discovery: tuple[str, ...] = ("seeds",), gossip: GossipSettings = FAST,
                      listen: str = "127.0.0.1:0", detector: str = "probe") -> MeshSettings:
    """Settings for a node on 127.0.0.1 only (mDNS, when enabled, bound to 127.0.0.1);
    ``detector`` as ``[mesh] detector`` (the default's, probe)."""
    return MeshSettings(
        state_dir=state_dir, name=name, trust=trust, listen=listen, advertise="127.0.0.1",
        api_listen="127.0.0.1:8086", interfaces=("127.0.0.1",), discovery=discovery, seeds=seeds,
        mesh_id=mesh_id, ca_certificate=None if ca_dir is None else ca_dir / "ca.crt", gossip=gossip,
        version="test", connect_timeout_s=0.5, exchange_timeout_s=1.0, detector=detector)  # type: ignore[arg-type]


def gossip_ok(node: MeshNode) -> int:
    """Completed round trips with peers in either mode: digest exchanges (heartbeat mode's
    rounds) plus probe requests answered (probe mode's pings, pulls, gossip)."""
    assert node.membership is not None
    transport = node.membership.counters.transport
    return transport["exchanges_ok"] + transport["probe_ok"]


async def wait_for(predicate: Callable[[], bool], timeout_s: float, what: str, poll_s: float = 0.02) -> None:
    """Poll ``predicate`` until true; AssertionError naming ``what`` after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return
        await asyncio.sleep(poll_s)
    if not predicate():
        raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")


def outsider_tls(node_dir: Path, mesh_id: str, server: bool = False) -> ssl.SSLContext:
    """TLS of a member of the open mesh ``mesh_id`` that is no node of any table (a test-made
    identity in ``node_dir`` named "forger", with its open-mesh certificate): a client
    context, or a server one with ``server``. What anyone who knows the mesh id can make."""
    identity = load_or_create_identity(node_dir)
    cert = node_dir / "node.crt"
    cert.write_bytes(issue_open_certificate(identity, "forger", mesh_id))
    ca_pem = open_mesh_ca(mesh_id)[1].public_bytes(serialization.Encoding.PEM)
    return (tls.server_context if server else tls.client_context)(cert, identity.key_path, ca_pem)


def probe_wire(node: MeshNode) -> ProbeTransport:
    """A probe-mode node's channels (its ProbeTransport)."""
    transport = node._probe_wire
    assert transport is not None, "not a probe-mode node"
    return transport


@asynccontextmanager
async def probe_pair(tmp_path: Path, mesh_id: str) -> AsyncIterator[tuple[MeshNode, MeshNode]]:
    """Two probe-mode nodes on 127.0.0.1 in open trust, ``a`` seeded with ``b``, once each
    holds the other alive; both stopped (no leave) at the end."""
    b = MeshNode(loopback_settings(tmp_path / "b", "b", trust="open", mesh_id=mesh_id))
    await b.start()
    a = MeshNode(loopback_settings(tmp_path / "a", "a", trust="open", mesh_id=mesh_id,
                                   seeds=(f"127.0.0.1:{b.listen_port}",)))
    await a.start()
    try:
        await wait_for(lambda: {p.name for p in a.peers() if p.liveness.value == "alive"} == {"b"}
                       and {p.name for p in b.peers() if p.liveness.value == "alive"} == {"a"}, 10, "a and b to meet")
        yield a, b
    finally:
        await a.stop(leave=False)
        await b.stop(leave=False)
