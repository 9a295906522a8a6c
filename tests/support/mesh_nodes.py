"""Helpers for mesh tests with real state dirs: a CA, enrolled nodes, settings on loopback."""

from __future__ import annotations

import asyncio
import datetime as dt
import time
from collections.abc import Callable
from pathlib import Path

from viiwork.mesh.identity import load_or_create_identity
from viiwork.mesh.membership import GossipSettings
from viiwork.mesh.node import MeshNode, MeshSettings
from viiwork.mesh.trust import init_ca, install_certificate, load_ca, make_signing_request, sign_request

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
