"""``MeshNode``: everything the agent needs to join a mesh, wired in a few lines.

One module (over 400 lines) because :class:`MeshNode` is one lifecycle: :meth:`MeshNode.start`
builds identity, trust, listener, publisher, client and discovery in an order that
:meth:`MeshNode.stop` unwinds, and the callbacks between those parts are its methods; the
parts themselves live in their own modules (transport, discovery, publisher, persist).

    node = MeshNode(MeshSettings.from_config(cfg.mesh, cfg.node, cfg.api.listen, __version__),
                    provider=lambda: (models_from_loads(), PublishedState.SERVING))
    await node.start()          # identity, certificates, listener, discovery, gossip
    node.view()                 # the GET /v1/mesh document
    node.peers()                # PeerView list for routing
    await node.stop()           # publishes `leaving` (or `restarting`), tells a few peers, stops

``provider`` (optional) is called once per gossip round on the event loop and returns
``(models, state)``; it must not block. Alternatively call :meth:`MeshNode.set_local_summary`
whenever capacity changes. The agent may add routes (forwarded requests) to
:attr:`MeshNode.app` before :meth:`MeshNode.start`; the peer's node id on such a request is
:func:`viiwork.mesh.transport.peer_of`.

Start-up errors are :class:`MeshStartError` with a message naming the setting and the fix.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import logging
import random
import ssl
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from aiohttp import web
from cryptography.hazmat.primitives import serialization

from viiwork.mesh import tls
from viiwork.mesh.boot import BOOT_FILE, next_boot, store_generation
from viiwork.mesh.candidates import unreachable_line
from viiwork.mesh.clones import IdentityConflict
from viiwork.mesh.detector import DetectorSettings
from viiwork.mesh.discovery import DiscoveryError, MdnsDiscovery, is_advertisable, pick_advertised_host
from viiwork.mesh.extensions import GANGS, PREFIXES, SPEEDS, Extensions, Gangs, Prefixes, Speeds
from viiwork.mesh.identity import IdentityError, NodeId, load_or_create_identity
from viiwork.mesh.load_record import apply_load
from viiwork.mesh.membership import GossipSettings, GossipTarget, Liveness, Membership, PeerView
from viiwork.mesh.persist import PendingWrites, state_dir_fault
from viiwork.mesh.pins import PINS_FILE, PinStore
from viiwork.mesh.probe_transport import PROBE_PATH, ProbeTransport
from viiwork.mesh.probing import ProbeNode, ProbeSettings
from viiwork.mesh.publisher import LocalPublisher
from viiwork.mesh.signing import NodeSigner
from viiwork.mesh.summary import PROTOCOL_VERSION, GpuCapacity, ModelCapacity, PublishedState
from viiwork.mesh.transport import (
    KEEPALIVE_TIMEOUT_S,
    MAX_HEADER_FIELD_BYTES,
    GossipClient,
    MutualTlsSite,
    gossip_routes,
)
from viiwork.mesh.trust import (
    NODE_CERT_FILE,
    OPEN_NODE_CERT_FILE,
    CaTrust,
    OpenTrust,
    TrustError,
    certificate_der,
    issue_open_certificate,
    load_certificate,
    open_mesh_ca,
    utcnow,
)

log = logging.getLogger(__name__)

LEAVE_TIMEOUT_S = 1.5
# Dials of discovered addresses (seeds, mDNS) in flight at once: while no peer is alive every
# seed is dialed in one round (docs/mesh.md, "Seeds"); each holds a socket for at most
# exchange_timeout_s, so 64 get through 200 dead seeds in a few seconds at worst.
SEED_DIALS_AT_ONCE = 64


class MeshStartError(Exception):
    """The mesh cannot start as configured; the message names the setting and the fix."""


def _hostport(value: str, what: str) -> tuple[str, int]:
    host, sep, port = value.rpartition(":")
    if not sep or not host:
        raise MeshStartError(f"{what}: expected host:port, got {value!r}")
    try:
        return host.strip("[]"), int(port)
    except ValueError:
        raise MeshStartError(f"{what}: port must be a number in {value!r}") from None


def _join(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


@dataclass(frozen=True)
class MeshSettings:
    """The mesh's configuration (the agent's ``[mesh]``, ``node`` and ``api.listen``).

    ``listen``: mesh listener ``host:port`` (port 0: any free port, for tests);
    ``advertise``: host or host:port peers should dial (default: picked, never wildcard,
    loopback or link-local); ``api_listen``: the client API's ``host:port`` (its port is
    advertised); ``interfaces``: where mDNS runs (names or IPv4 addresses); ``discovery``:
    any of "mdns", "seeds"; ``trust``: "ca" (``ca_certificate`` required) or "open"
    (``mesh_id`` required); ``node_certificate``/``node_key`` default to the state dir.
    ``connect_timeout_s`` / ``exchange_timeout_s``: one gossip exchange's TCP connect and
    whole deadline; ``seed_dials_at_once``: dials of discovered addresses in flight at once.
    ``detector``: "heartbeat" (all-to-all heartbeats, liveness from their age) or "probe"
    (SWIM probing and change-only dissemination, :mod:`viiwork.mesh.probing`, timed by
    ``probe``; docs/mesh.md, "Probe mode").
    """

    state_dir: Path
    name: str
    trust: Literal["ca", "open"]
    listen: str = "0.0.0.0:8087"
    advertise: str | None = None
    api_listen: str = "0.0.0.0:8086"
    interfaces: tuple[str, ...] = ()
    discovery: tuple[str, ...] = ("mdns", "seeds")
    seeds: tuple[str, ...] = ()
    mesh_id: str | None = None
    ca_certificate: Path | None = None
    node_certificate: Path | None = None
    node_key: Path | None = None
    gossip: GossipSettings = field(default_factory=GossipSettings)
    version: str = "0"
    connect_timeout_s: float = 1.0
    exchange_timeout_s: float = 2.0
    seed_dials_at_once: int = SEED_DIALS_AT_ONCE
    detector: Literal["heartbeat", "probe"] = "probe"
    probe: ProbeSettings = field(default_factory=ProbeSettings)

    @classmethod
    def from_config(cls, mesh: Any, node: Any, api_listen: str, version: str) -> MeshSettings:
        """From the agent's ``MeshConfig`` and ``NodeConfig`` (read by attribute name, so
        the mesh does not import the agent)."""
        return cls(
            state_dir=Path(node.state_dir), name=node.name, trust=mesh.trust, listen=mesh.listen,
            advertise=mesh.advertise, api_listen=api_listen, interfaces=tuple(mesh.interfaces),
            discovery=tuple(mesh.discovery), seeds=tuple(mesh.seeds), mesh_id=mesh.mesh_id,
            ca_certificate=mesh.ca_certificate, node_certificate=mesh.node_certificate, node_key=mesh.node_key,
            gossip=GossipSettings(gossip_interval_ms=mesh.gossip_interval_ms, fanout=mesh.fanout,
                                  suspect_after_ms=mesh.suspect_after_ms, dead_after_ms=mesh.dead_after_ms,
                                  max_peers=mesh.max_peers),
            version=version, detector=mesh.detector,
            probe=ProbeSettings(detector=DetectorSettings(
                probe_interval_ms=mesh.probe_interval_ms, probe_timeout_ms=mesh.probe_timeout_ms,
                indirect_checks=mesh.indirect_checks, suspicion_mult=mesh.suspicion_mult,
                # the relays' pings plus a round trip, as the default (600 for 200)
                indirect_timeout_ms=3 * mesh.probe_timeout_ms)),
        )


# Returns (models, state) or (models, state, gpus); GPUs are published with protocol 2.
Provider = Callable[[], tuple[Any, ...]]


class MeshNode:
    """One node's mesh: identity, trust, listener, discovery and the gossip loop."""

    def __init__(self, settings: MeshSettings, provider: Provider | None = None,
                 rng: random.Random | None = None):
        self.settings = settings
        self.provider = provider
        self.rng = rng or random.Random()
        # client_max_size bounds request.read(), which the gossip routes use: gossip's limit.
        # Routes that take larger bodies (the agent's forwards, up to its api.max_body_bytes)
        # read request.content with their own bound.
        self.app = web.Application(client_max_size=settings.gossip.max_message_bytes + 64 * 1024)
        self.membership: Membership | None = None
        self.publisher: LocalPublisher | None = None
        self.policy: CaTrust | None = None
        self.server_ssl_context: ssl.SSLContext | None = None
        self.client_ssl_context: ssl.SSLContext | None = None
        # (certificate path, key path, CA PEM) once started: for TLS ends of this node's own
        # that need a context of their own (a gang's tunnel exit, agent/gang/tunnel.py).
        self.tls_material: tuple[Path, Path, bytes] | None = None
        self.advertised_mesh: str | None = None
        self.advertised_api: str = ""
        self.listen_port: int | None = None
        self._runner: web.AppRunner | None = None
        self._site: MutualTlsSite | None = None
        self._client: GossipClient | None = None
        self._discovery: MdnsDiscovery | None = None
        self._loop_task: asyncio.Task[None] | None = None
        self._exchanges: set[asyncio.Task[bool]] = set()
        # Dials of discovered addresses (seeds, mDNS): tasks, their addresses while in flight,
        # and the places that bound them (SEED_DIALS_AT_ONCE).
        self._dials: set[asyncio.Task[None]] = set()
        self._dialing: set[str] = set()
        self._dial_places = asyncio.Semaphore(max(1, settings.seed_dials_at_once))
        # The seeds dialed in the first round that dialed any, and those whose dial has not
        # ended yet: when none is left, one line names the ones that did not answer.
        self._first_seeds: list[str] = []
        self._first_seeds_left: set[str] | None = None
        self._round_dials: list[GossipTarget] = []  # probe mode: this round's candidates
        self._pins: PinStore | None = None
        # Writes into the state dir that failed while running, retried (mesh/persist.py).
        self.writes = PendingWrites()
        self._started_at = 0.0
        self._pending: tuple[tuple[ModelCapacity, ...], PublishedState] | None = None
        self._pending_extensions: Extensions | None = None
        # Probe mode (settings.detector == "probe"): the sans-IO core and its wire.
        self.probe: ProbeNode | None = None
        self._probe_wire: ProbeTransport | None = None
        self._provided_at = -float("inf")
        # Set when another running agent publishes this node's id and this boot is the one
        # that leaves (mesh/clones.py): gossip stops at once, stop() announces nothing, and
        # ``on_refuse`` callbacks get the one line to exit with (the agent stops, non-zero).
        self.refused: IdentityConflict | None = None
        self.on_refuse: list[Callable[[str], None]] = []

    # --- identity and trust -------------------------------------------------------------------

    @property
    def node_id(self) -> NodeId:
        if self.membership is None:
            raise RuntimeError("call start() first")
        return self.membership.node_id

    @property
    def mesh_id(self) -> str:
        if self.membership is None:
            raise RuntimeError("call start() first")
        return self.membership.mesh_id

    def _load_trust(self, identity: Any) -> tuple[CaTrust, Path, bytes]:
        """(policy, node certificate path, CA PEM for the TLS contexts)."""
        s = self.settings
        if s.trust == "ca":
            if s.ca_certificate is None:
                raise MeshStartError("mesh.ca_certificate is required with trust = \"ca\" "
                                     "(create a CA with `viiworkctl mesh ca init --out DIR`)")
            try:
                ca_cert = load_certificate(s.ca_certificate)
                policy = CaTrust(ca_cert)
            except TrustError as exc:
                raise MeshStartError(f"mesh.ca_certificate: {exc}") from None
            cert_path = Path(s.node_certificate or Path(s.state_dir) / NODE_CERT_FILE)
            if not cert_path.exists():
                raise MeshStartError(
                    f"no node certificate at {cert_path}: enrol this node with `viiworkctl mesh request` "
                    "(then `mesh sign` on the CA host and `mesh install CERT` here), or `viiworkctl mesh enroll "
                    "--ca DIR` in a lab")
            try:
                info = policy.verify_certificate(certificate_der(cert_path.read_bytes()), utcnow())
            except (TrustError, ValueError) as exc:
                raise MeshStartError(f"node certificate {cert_path}: {exc}") from None
            if info.node_id != identity.node_id:
                raise MeshStartError(f"node certificate {cert_path} is for node {info.node_id}, but this node's key "
                                     f"is {identity.node_id}: enrol again (`viiworkctl mesh request`)")
            return policy, cert_path, policy.ca_pem
        if not s.mesh_id:
            raise MeshStartError("mesh.mesh_id is required with trust = \"open\"")
        log.warning("mesh trust is OPEN: any host that knows mesh id %r (it is broadcast by mDNS) can join this "
                    "mesh and receive forwarded prompts; use trust = \"ca\" outside a lab", s.mesh_id)
        self._pins = PinStore(Path(s.state_dir) / PINS_FILE)
        policy = OpenTrust(s.mesh_id, self._pins)
        cert_path = Path(s.state_dir) / OPEN_NODE_CERT_FILE
        cert_path.write_bytes(issue_open_certificate(identity, s.name, s.mesh_id))
        cert_path.chmod(0o644)
        ca_pem = open_mesh_ca(s.mesh_id)[1].public_bytes(serialization.Encoding.PEM)
        return policy, cert_path, ca_pem

    # --- lifecycle ------------------------------------------------------------------------------

    async def start(self) -> None:
        """Load or create the identity, check certificates, bind the listener, start
        discovery and the gossip loop. Raises MeshStartError naming what to fix."""
        s = self.settings
        try:
            identity = await asyncio.to_thread(load_or_create_identity, Path(s.state_dir), s.node_key)
            boot = await asyncio.to_thread(next_boot, Path(s.state_dir))
            policy, cert_path, ca_pem = await asyncio.to_thread(self._load_trust, identity)
        except IdentityError as exc:
            raise MeshStartError(str(exc)) from None
        except OSError as exc:  # full, read-only, missing: one line naming the file and the fix, no traceback
            if exc.filename and Path(exc.filename).parent != Path(s.state_dir):
                raise MeshStartError(f"{exc.filename}: {exc.strerror or exc}") from None
            raise MeshStartError(str(state_dir_fault(Path(s.state_dir), exc, "write the node's key, boot or "
                                                                             "certificate"))) from None
        self.policy = policy
        key_path = identity.key_path
        try:
            self.server_ssl_context = tls.server_context(cert_path, key_path, ca_pem)
            self.client_ssl_context = tls.client_context(cert_path, key_path, ca_pem)
            self.tls_material = (cert_path, key_path, ca_pem)
        except (OSError, ValueError) as exc:
            raise MeshStartError(f"cannot load the node certificate/key for TLS: {exc}") from None
        cert_der = certificate_der(cert_path.read_bytes())

        membership = Membership(identity.node_id, policy.mesh_id, cert_der, policy, s.gossip, _monotonic_ms, utcnow,
                                random.Random(self.rng.random()), protocol=PROTOCOL_VERSION)
        self.membership = membership
        for route in gossip_routes(membership):
            self.app.router.add_route(route.method, route.path, route.handler)
        membership.on_identity_conflict.append(self._identity_conflict)
        if s.detector == "probe":
            self._probe_wire = ProbeTransport(membership, self.client_ssl_context, self._probe_exchange,
                                              timeout_s=s.exchange_timeout_s, connect_timeout_s=s.connect_timeout_s)
            self.app.router.add_get(PROBE_PATH, self._probe_wire.handle)

        listen_host, listen_port = _hostport(s.listen, "mesh.listen")
        # handler_cancellation: a peer that closes its connection cancels the handler, so a
        # forward whose client went away frees its slot here too (docs/engines.md, "When the
        # client goes away").
        # keepalive_timeout: aiohttp's default is 3630 s; idle established connections are
        # bounded (mesh/transport.py, "Established connections are bounded too").
        # max_field_size/max_line_size: a forward carries the client's key (up to 8 KiB plus
        # its header name), over aiohttp's default of 8190 bytes a header line.
        self._runner = web.AppRunner(self.app, access_log=None, handle_signals=False, handler_cancellation=True,
                                     keepalive_timeout=KEEPALIVE_TIMEOUT_S, max_field_size=MAX_HEADER_FIELD_BYTES,
                                     max_line_size=MAX_HEADER_FIELD_BYTES)
        await self._runner.setup()
        self._site = MutualTlsSite(self._runner, listen_host, listen_port, self.server_ssl_context,
                                   on_handshake_failure=self._handshake_failed,
                                   on_handshake_refused=self._handshake_refused,
                                   on_connection_event=self._connection_event)
        try:
            await self._site.start()
        except OSError as exc:
            await self._runner.cleanup()
            raise MeshStartError(f"mesh.listen {s.listen}: cannot bind: {exc.strerror or exc}") from None
        self.listen_port = self._site.port

        api_host, api_port = _hostport(s.api_listen, "api.listen")
        try:
            adv_host, adv_port = self._advertise(listen_host)
        except DiscoveryError as exc:  # a mesh.interfaces entry that is no interface here
            await self._runner.cleanup()
            raise MeshStartError(str(exc)) from None
        if adv_host is None:
            log.warning("mesh: no advertisable address (wildcard, loopback and link-local are never advertised): "
                        "set mesh.advertise; peers cannot dial this node, it only dials out")
            self.advertised_mesh = ""
        else:
            self.advertised_mesh = _join(adv_host, adv_port or self.listen_port)
            api_adv = api_host if api_host not in ("0.0.0.0", "::", "") else adv_host
            self.advertised_api = _join(api_adv, api_port)

        self.publisher = LocalPublisher(
            membership, NodeSigner(identity, cert_der), s.name, api=self.advertised_api,
            mesh=self.advertised_mesh or _join("0.0.0.0", self.listen_port), version=s.version, boot=boot,
            # Probe mode publishes on change: without one the summary is re-signed every republish_ms.
            heartbeat_ms=s.probe.republish_ms if self._probe_wire is not None else s.gossip.heartbeat_ms,
            store_generation=self._store_generation)
        if self._pending_extensions is not None:
            self.publisher.set_extensions(self._pending_extensions)
            self._pending_extensions = None
        if self._probe_wire is not None:
            self.probe = ProbeNode(membership, self.publisher, s.probe, random.Random(self.rng.random()))
            self._probe_wire.attach(self.probe)
        self._refresh_local()
        if self.probe is not None:
            self.probe.publish(force=True)
        else:
            self.publisher.maybe_publish(force=True)

        self._client = GossipClient(membership, self.client_ssl_context, s.connect_timeout_s, s.exchange_timeout_s)
        await self._client.start()
        if self._probe_wire is not None:
            await self._probe_wire.start()
        if "seeds" in s.discovery:
            for seed in s.seeds:
                membership.add_candidate(seed, source="seed")
        if "mdns" in s.discovery and adv_host is not None:
            self._discovery = MdnsDiscovery(
                node_id=identity.node_id, mesh_id=policy.mesh_id, protocol=PROTOCOL_VERSION, advertise_host=adv_host,
                mesh_port=adv_port or self.listen_port, api_port=api_port, interfaces=list(s.interfaces),
                on_found=lambda address, nid: membership.add_candidate(address, nid, source="mdns"),
                on_lost=membership.remove_candidate)
            try:
                await self._discovery.start()
            except (DiscoveryError, OSError) as exc:
                await self.stop(leave=False)
                raise MeshStartError(f"mDNS: {exc}") from None
        self._started_at = time.monotonic()
        loop = self._probe_loop() if self.probe is not None else self._gossip_loop()
        self._loop_task = asyncio.get_running_loop().create_task(loop, name="mesh-gossip")
        log.info("mesh: node %s (%s) in mesh %s (%s trust, %s detector), listening on %s, advertising %s",
                 s.name, identity.node_id, policy.mesh_id, s.trust, s.detector, _join(listen_host, self.listen_port),
                 self.advertised_mesh or "nothing")

    def _advertise(self, listen_host: str) -> tuple[str | None, int | None]:
        s = self.settings
        adv = s.advertise
        adv_port = None
        if adv and adv.count(":") == 1 and adv.rpartition(":")[2].isdigit():
            adv, adv_port = adv.rpartition(":")[0], int(adv.rpartition(":")[2])
        host = pick_advertised_host(listen_host, adv, list(s.interfaces))
        if host is not None and not s.advertise and not is_advertisable(host):
            host = None
        return host, adv_port

    def _handshake_failed(self, peer: Any, exc: BaseException) -> None:
        if self.membership is not None:
            self.membership.counters.transport["handshake_failed"] += 1

    def _handshake_refused(self, host: str) -> None:
        if self.membership is not None:
            self.membership.counters.transport["handshake_refused"] += 1

    def _connection_event(self, name: str) -> None:
        if self.membership is not None:
            self.membership.counters.transport[name] += 1

    def _identity_conflict(self, conflict: IdentityConflict) -> None:
        """Another running agent publishes this node's id (the membership core logged it).
        The higher boot leaves: stop publishing now (every further summary feeds the race)
        and tell the agent, with the line to exit with."""
        pub = self.publisher
        if pub is None or conflict.leaves != pub.boot_nonce or self.refused is not None:
            return
        self.refused = conflict
        if self._loop_task is not None:
            self._loop_task.cancel()
        remedy = ("give each machine its own node.state_dir: start this one from an empty state dir (a new key, so a "
                  "new node id)")
        if self.settings.trust == "ca":
            remedy += (" and enrol it: `viiworkctl mesh request`, `viiworkctl mesh sign` on the CA host, "
                       "`viiworkctl mesh install CERT` (or `viiworkctl mesh enroll --ca DIR` in a lab)")
        else:
            remedy += f" and a new node.name, or `viiworkctl mesh forget {self.settings.name}` on its peers"
        line = (f"mesh: node id {conflict.node_id} is also run by the agent at {conflict.address or '?'} (a copy of "
                f"this state dir {self.settings.state_dir}); this boot ({conflict.other_boot}) is the higher one and "
                f"stops: {remedy}")
        for cb in self.on_refuse:
            cb(line)

    async def stop(self, leave: bool = True, state: PublishedState = PublishedState.LEAVING) -> None:
        """Stop. With ``leave``, first publish ``state`` (``leaving``, or ``restarting`` when
        this node's agent comes back soon) and push it to up to ``fanout`` peers (bounded by
        LEAVE_TIMEOUT_S), so they see ``left`` (or keep it for the restart grace) at once.
        Then the listener closes: a caller that relays requests over it ends them first
        (the agent's stop path, docs/architecture.md)."""
        if state not in (PublishedState.LEAVING, PublishedState.RESTARTING):
            raise ValueError(f"stop() publishes leaving or restarting, not {state.value}")
        if self.refused is not None:
            leave = False  # the id is the other agent's: a `leaving` under it would be its
        if self._loop_task is not None:
            task = self._loop_task
            while not task.done():  # again if a cancellation was lost in the loop's own awaits
                task.cancel()
                await asyncio.wait({task}, timeout=1.0)
            self._loop_task = None
        if leave and self.publisher is not None and self.membership is not None and self._client is not None:
            self.publisher.set_local(self.publisher.models, state)
            self.publisher.maybe_publish(force=True)
            selected = [t for t in self.membership.select_targets(self._dialing) if t.node_id is not None]
            targets = [t for t in selected if not t.candidate]
            targets += [t for t in selected if t.candidate][:max(0, self.settings.gossip.fanout - len(targets))]
            if targets:
                try:
                    async with asyncio.timeout(LEAVE_TIMEOUT_S):
                        await asyncio.gather(*(self._client.exchange(t) for t in targets))
                except TimeoutError:
                    log.info("mesh: leave announcement timed out; peers will notice by silence")
        if self._probe_wire is not None:
            await self._probe_wire.close()
        pending: list[asyncio.Task[Any]] = [*self._exchanges, *self._dials]
        for task in pending:
            task.cancel()
        if pending:
            await asyncio.gather(*pending, return_exceptions=True)
        if self._discovery is not None:
            await self._discovery.stop()
            self._discovery = None
        if self._client is not None:
            await self._client.close()
            self._client = None
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None
        if self._pins is not None:
            await asyncio.to_thread(self._save_pins)

    def _store_generation(self, generation: int) -> None:
        # A generation raised while running that cannot be stored is kept and retried: the
        # next start then reuses a lower one, which the membership core corrects (mesh/boot.py).
        state_dir = Path(self.settings.state_dir)
        self.writes.attempt("boot generation", state_dir / BOOT_FILE, lambda: store_generation(state_dir, generation))

    def _save_pins(self) -> None:
        pins = self._pins
        if pins is not None and pins.dirty and pins.path is not None:
            self.writes.attempt("name pins", pins.path, pins.save)

    # --- the gossip loop ----------------------------------------------------------------------

    async def _gossip_loop(self) -> None:
        m, pub, client = self.membership, self.publisher, self._client
        assert m is not None and pub is not None and client is not None
        interval_s = self.settings.gossip.gossip_interval_ms / 1000.0
        max_in_flight = 4 * self.settings.gossip.fanout + 4
        while True:
            self._refresh_local()
            pub.maybe_publish()
            targets = m.select_targets(self._dialing)
            # Seeds and mDNS addresses: dialed apart, with their own bound (SEED_DIALS_AT_ONCE).
            self._start_dials([t for t in targets if t.candidate])
            for target in targets:
                if target.candidate:
                    continue
                if len(self._exchanges) >= max_in_flight:
                    m.counters.transport["exchange_skipped_busy"] += 1
                    break
                task = asyncio.get_running_loop().create_task(client.exchange(target))
                self._exchanges.add(task)
                task.add_done_callback(self._exchanges.discard)
            if self._pins is not None and self._pins.dirty and not self.writes.pending("name pins"):
                await asyncio.to_thread(self._save_pins)
            if self.writes.due():  # a write that failed (full disk): retried, never fatal
                await asyncio.to_thread(self.writes.retry_due)
            # Jitter keeps nodes started together from gossiping in lockstep.
            await asyncio.sleep(interval_s * self.rng.uniform(0.9, 1.1))

    async def _probe_loop(self) -> None:
        """Probe mode's loop: the core's timers (:meth:`ProbeNode.poll` at its next wake-up,
        or sooner when a message arrived), the capacity provider once per
        ``gossip_interval_ms``, and the state dir's chores (docs/mesh.md, "Probe mode on the wire")."""
        m, probe, wire = self.membership, self.probe, self._probe_wire
        assert m is not None and probe is not None and wire is not None
        chores_at = 0.0
        while True:
            self._refresh_local()
            wire.send(probe.poll())
            if self._round_dials:  # one round's candidates together: the first round's line names them all
                dials, self._round_dials = self._round_dials, []
                self._start_dials(dials)
            now = time.monotonic()
            if now >= chores_at:
                chores_at = now + self.settings.gossip.gossip_interval_ms / 1000.0
                if self._pins is not None and self._pins.dirty and not self.writes.pending("name pins"):
                    await asyncio.to_thread(self._save_pins)
                if self.writes.due():
                    await asyncio.to_thread(self.writes.retry_due)
            delay_ms = min(probe.next_wakeup() - m.clock(), float(self.settings.gossip.gossip_interval_ms))
            await wire.wait(max(0.0, delay_ms) / 1000.0)

    def _probe_exchange(self, target: GossipTarget) -> None:
        """A digest exchange the probe core asked for (anti-entropy, seeds): seeds and mDNS
        addresses through the dials (their backoff), members as one exchange task."""
        if target.candidate:
            if target.address not in self._dialing and target not in self._round_dials:
                self._round_dials.append(target)  # dialed by _probe_loop once the round is out
            return
        client = self._client
        if client is None or len(self._exchanges) >= 4 * self.settings.gossip.fanout + 4:
            if self.membership is not None:
                self.membership.counters.transport["exchange_skipped_busy"] += 1
            return
        task = asyncio.get_running_loop().create_task(client.exchange(target))
        self._exchanges.add(task)
        task.add_done_callback(self._exchanges.discard)

    def _start_dials(self, targets: list[GossipTarget]) -> None:
        """Start the dials of this round's candidate targets (each a task, bounded by
        ``seed_dials_at_once``); the first round that dials seeds is watched for the line."""
        m = self.membership
        assert m is not None
        loop = asyncio.get_running_loop()
        for target in targets:
            self._dialing.add(target.address)
            task = loop.create_task(self._dial(target))
            self._dials.add(task)
            task.add_done_callback(self._dials.discard)
        if self._first_seeds_left is None:
            seeds = [t.address for t in targets if (c := m.candidates.get(t.address)) is not None and c.source == "seed"]
            if seeds:  # (no dial has ended yet: the tasks above have not run)
                self._first_seeds, self._first_seeds_left = seeds, set(seeds)

    async def _dial(self, target: GossipTarget) -> None:
        """Dial a discovered address (at most ``seed_dials_at_once`` at once) and tell the
        membership core how it ended (docs/mesh.md, "Seeds")."""
        m, client = self.membership, self._client
        assert m is not None and client is not None
        try:
            async with self._dial_places:
                error = await client.try_exchange(target)
        finally:
            self._dialing.discard(target.address)
        m.note_dial(target.address, error)
        left = self._first_seeds_left
        if left is not None and target.address in left:
            left.discard(target.address)
            if not left:
                self._report_first_seeds()

    def _report_first_seeds(self) -> None:
        """Once: the seeds whose first dial got no answer, in one WARNING line."""
        m = self.membership
        assert m is not None
        first = set(self._first_seeds)
        views = [v for v in m.candidate_views("seed") if v.address in first and not v.answered]
        g = self.settings.gossip
        line = unreachable_line(views, len(first), g.seed_backoff_min_ms, g.seed_backoff_max_ms)
        if line is not None:
            log.warning("%s", line, extra={"seeds_unreachable": len(views), "seeds": len(first)})

    def _refresh_local(self) -> None:
        if self.publisher is None:
            return
        if self.provider is not None:
            if self.probe is not None:  # probe mode wakes more often than once a round
                now = time.monotonic()
                if now - self._provided_at < self.settings.gossip.gossip_interval_ms / 1000.0:
                    return
                self._provided_at = now
            try:
                provided = self.provider()
                self._set_local(provided[0], provided[1], provided[2] if len(provided) > 2 else None)
            except Exception:  # noqa: BLE001 - a failing provider must not stop gossip
                log.exception("mesh: the capacity provider failed; publishing the last known capacity")
        elif self._pending is not None:
            self._set_local(*self._pending)
            self._pending = None

    def _set_local(self, models: Iterable[ModelCapacity], state: PublishedState | str,
                   gpus: Iterable[GpuCapacity] | None = None) -> None:
        """New local content. Heartbeat mode: published at the next round. Probe mode: the
        load goes through the core's quantiser and rate limit; a new state or GPU list is
        published at once (a GPU's free memory alone rides on the next publication)."""
        pub, probe = self.publisher, self.probe
        assert pub is not None
        if probe is None:
            pub.set_local(models, state, gpus)
            return
        probe.set_load(tuple(models))
        state = PublishedState(state)
        new_gpus = None if gpus is None else tuple(sorted(gpus, key=lambda g: g.index))
        structural = state is not pub.state or (new_gpus is not None and _gpu_shape(new_gpus) != _gpu_shape(pub.gpus))
        pub.set_local(pub.models, state, new_gpus)
        if structural and pub.last is not None:
            probe.publish(force=True)

    def set_local_summary(self, models: Iterable[ModelCapacity], state: PublishedState | str = "serving") -> None:
        """New local capacity; published at once (before the next round) when started."""
        models, state = tuple(models), PublishedState(state)
        if self.publisher is None:
            self._pending = (models, state)
            return
        self._set_local(models, state)
        if self.probe is not None:
            self.probe.publish()  # now when the quantiser and the rate limit allow, else at a later poll
        else:
            self.publisher.maybe_publish()

    def set_local_extensions(self, extensions: Extensions) -> None:
        """This node's ``ext`` fields (mesh/extensions.py), published with its next summary in
        protocol 4 and later (left out while a live peer speaks only an older version)."""
        if self.publisher is None:
            self._pending_extensions = extensions
            return
        if self.probe is not None:
            if extensions != self.publisher.extensions:
                self.publisher.set_extensions(extensions)
                self.probe.publish(force=True)  # queues the news of the new version
            return
        self.publisher.set_extensions(extensions)
        self.publisher.maybe_publish()

    # --- views ----------------------------------------------------------------------------------

    def peers(self) -> list[PeerView]:
        """Every known peer with liveness and age (for routing: route to ``alive`` peers whose
        ``age_ms`` is below the routing freshness bound)."""
        return [] if self.membership is None else self.membership.peers()

    def subscribe(self, on_update: Callable[[NodeId], None]) -> None:
        """Call ``on_update(node_id)`` (on the loop, must not block) after a newer summary of
        a peer is accepted: the router can dispatch queued requests on fresh capacity."""
        if self.membership is None:
            raise RuntimeError("call start() first")
        self.membership.on_update.append(on_update)

    def seeds(self) -> list[dict[str, Any]]:
        """Each configured seed and its dial history (``GET /v1/mesh`` ``seeds``), in the
        configured order: ``{"address", "node_id", "attempts", "failures", "answered",
        "last_error", "retry_in_ms"}``. ``answered`` false with ``attempts`` > 0: a seed that
        never answered (the doctor lists those); ``node_id``: the node there, when known."""
        if self.membership is None:
            return []
        return [v.doc() for v in self.membership.candidate_views("seed")]

    def counters(self) -> dict[str, Any]:
        """Mesh counters (messages/bytes in and out, drops by reason, transport events)."""
        if self.membership is None:
            return {}
        out = self.membership.counters.as_dict()
        policy = self.policy
        if policy is not None:
            out["verifications"] = {"certificate_chain": policy.chain_verifications,
                                    "signature": policy.signature_verifications}
        if self.probe is not None:
            out["probe"] = {**self.probe.counters, **{f"detector_{k}": v for k, v in self.probe.detector.counters.items()}}
        return out

    def view(self) -> dict[str, Any]:
        """The ``GET /v1/mesh`` document:

        ``{"self": {...}, "nodes": [{"id", "name", "api", "mesh", "liveness", "state",
        "age_ms", "trust", "protocol", "version", "generation", "boot", "seq", "rtt_ms",
        "certificate_not_after", "models": [{"name", "engine", "kind", "slots", "busy",
        "waiting", "ctx_per_slot", "healthy", "total", "fingerprint", "conflict", "speed",
        "prefix_digests"}]}],
        "conflicts": [{"model", "nodes": {node_id: fingerprint}}], "seeds": [...], "counters": {...}}``.
        ``liveness`` (what this node observes) is alive|suspect|dead|left, or conflict while
        two running agents publish that node id (``identity_conflict``: their boots and
        addresses; not routed to meanwhile, docs/mesh.md "One node per identity"); ``state``
        (what the peer publishes) serving|draining|leaving|restarting; ``waiting`` null means
        unknown. ``self.identity_conflict``: another agent publishing this node's id, or null.
        ``seeds``: :meth:`seeds`. ``speed``: ``{"prefill_tps", "decode_tps"}`` (tokens/s, each
        null when not measured) from the ``speeds`` extension of that node's summary, or null.
        ``prefix_digests``: how many prefix digests the node publishes for the model (its
        ``prefixes`` extension), or null when it publishes none (docs/routing.md).
        ``gangs`` (of ``self`` and each node): the memberships its ``gangs`` extension publishes,
        ``[{"model", "gang", "rank", "size", "leader", "leader_name"}]`` (``leader_name`` null
        when this node does not know the leader). Top-level ``gangs``: those memberships grouped
        by gang, ``[{"model", "gang", "size", "leader", "leader_name", "parts": [{"rank",
        "node", "name"}]}]``, parts by rank (a rank missing: that part is not published as
        running; docs/mesh.md, "Gangs").
        """
        m, pub = self.membership, self.publisher
        if m is None or pub is None or pub.last is None:
            return {"self": None, "nodes": [], "conflicts": [], "gangs": [], "seeds": [], "counters": {}}
        conflicts = m.model_conflicts()
        trust = self.settings.trust
        own = pub.last.payload
        # What peers hold of this node: the summary, amended by a newer load record of it
        # (probe mode; docs/mesh.md, "Load records", the freshness rule).
        own_models, own_seq, record = own.models, own.seq, pub.last_load
        if record is not None and (record.generation, record.base_seq) == (own.generation, own.seq):
            own_models, own_seq = apply_load(own.models, record), record.seq
        me = {
            "id": own.node_id, "name": own.name, "api": own.api, "mesh": own.mesh, "mesh_id": m.mesh_id,
            "trust": trust, "protocol": own.protocol, "speaks": own.speaks, "version": own.version,
            "generation": own.generation, "boot": own.boot, "seq": own_seq, "state": own.state.value,
            "listen_port": self.listen_port, "detector": self.settings.detector,
            "suspect_after_ms": round(m.suspect_ms), "dead_after_ms": round(m.dead_ms),
            "identity_conflict": _conflict_doc(m.identity_conflict, self.refused),
            "models": [_model_doc(x, own.node_id, conflicts, own.extensions.get(SPEEDS),
                                  own.extensions.get(PREFIXES)) for x in own_models],
            "gpus": [_gpu_doc(g) for g in own.gpus],
        }
        names = {own.node_id: own.name, **{p.node_id: p.name for p in m.peers()}}
        me["gangs"] = _gang_docs(own.extensions.get(GANGS), names)
        order = {Liveness.ALIVE: 0, Liveness.SUSPECT: 1, Liveness.CONFLICT: 2, Liveness.LEFT: 3, Liveness.DEAD: 4}
        nodes = []
        for p in sorted(m.peers(), key=lambda p: (order[p.liveness], p.name, p.node_id)):
            nodes.append({
                "id": p.node_id, "name": p.name, "api": p.api, "mesh": p.mesh, "liveness": p.liveness.value,
                "state": p.state.value, "age_ms": p.age_ms, "trust": trust, "protocol": p.protocol,
                "version": p.version, "generation": p.generation, "boot": p.boot, "seq": p.seq,
                "rtt_ms": None if p.rtt_ms is None else round(p.rtt_ms, 2),
                "certificate_not_after": _iso(p.certificate_not_after),
                "models": [_model_doc(x, p.node_id, conflicts, p.extensions.get(SPEEDS),
                                      p.extensions.get(PREFIXES)) for x in p.models],
                "gpus": [_gpu_doc(g) for g in p.gpus],
                "gangs": _gang_docs(p.extensions.get(GANGS), names),
                "identity_conflict": None if p.conflict is None else p.conflict.doc(),
            })
        return {
            "self": me, "nodes": nodes, "gangs": _gangs_across(me, nodes),
            "conflicts": [{"model": name, "nodes": fps} for name, fps in sorted(conflicts.items())],
            "seeds": self.seeds(),
            "counters": self.counters(),
        }


def _conflict_doc(current: IdentityConflict | None, refused: IdentityConflict | None) -> dict[str, Any] | None:
    """This node's identity conflict for the view: the one going on, else the one this
    boot left over (it is stopping); None when there is none."""
    conflict = current or refused
    if conflict is None:
        return None
    return {**conflict.doc(), "other_address": conflict.address, "other_boot": conflict.boot,
            "this_boot": conflict.other_boot, "this_boot_leaves": conflict.leaves == conflict.other_boot}


def _model_doc(model: ModelCapacity, node_id: str, conflicts: dict[str, dict[Any, str]],
               speeds: Speeds | None, prefixes: Prefixes | None = None) -> dict[str, Any]:
    measured = None if speeds is None else speeds.of(model.name)
    return {
        "name": model.name, "engine": model.engine, "kind": model.kind, "slots": model.slots, "busy": model.busy,
        "waiting": model.waiting, "ctx_per_slot": model.ctx_per_slot, "healthy": model.healthy,
        "total": model.total, "fingerprint": model.fingerprint,
        "conflict": model.name in conflicts and node_id in conflicts[model.name],
        # The ``speeds`` extension's figures (tokens/s; null: not published or 0, "not measured").
        "speed": None if measured is None else {"prefill_tps": measured.prefill_tps or None,
                                                "decode_tps": measured.decode_tps or None},
        "prefix_digests": None if prefixes is None else len(prefixes.of(model.name)),
    }


def _gang_docs(gangs: Gangs | None, names: dict[NodeId, str]) -> list[dict[str, Any]]:
    """A node's ``gangs`` extension for the view (``names``: node id -> name, as known here)."""
    return [] if gangs is None else [
        {"model": g.model, "gang": g.gang, "rank": g.rank, "size": g.size, "leader": g.leader,
         "leader_name": names.get(g.leader)} for g in gangs.members]


def _gangs_across(me: dict[str, Any], nodes: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Every live node's memberships grouped by (model, gang, leader): one entry per gang with
    its parts by rank (a rank published twice is listed twice: the view shows what is
    published); a peer not ``alive``, or ``leaving``, is left out (its parts have stopped)."""
    out: dict[tuple[str, str, str], dict[str, Any]] = {}
    for node in (me, *nodes):
        if node is not me and (node.get("liveness") != "alive" or node.get("state") == "leaving"):
            continue  # its last summary's memberships are not running any more
        for g in node["gangs"]:
            entry = out.setdefault((g["model"], g["gang"], g["leader"]), {
                "model": g["model"], "gang": g["gang"], "size": g["size"], "leader": g["leader"],
                "leader_name": g["leader_name"], "parts": []})
            entry["parts"].append({"rank": g["rank"], "node": node["id"], "name": node["name"]})
    for entry in out.values():
        entry["parts"].sort(key=lambda p: (p["rank"], p["name"], p["node"]))
    return sorted(out.values(), key=lambda e: (e["model"], e["leader_name"] or "", e["gang"]))


def _gpu_doc(gpu: GpuCapacity) -> dict[str, Any]:
    return {"index": gpu.index, "name": gpu.name, "memory_total_mib": gpu.memory_total_mib,
            "memory_free_mib": gpu.memory_free_mib}


def _gpu_shape(gpus: Iterable[GpuCapacity]) -> list[tuple[int, str, int | None]]:
    """What of a GPU list is structural (probe mode publishes a change of it at once)."""
    return [(g.index, g.name, g.memory_total_mib) for g in gpus]


def _iso(value: dt.datetime | None) -> str | None:
    return None if value is None else value.isoformat()


def _monotonic_ms() -> float:
    return time.monotonic() * 1000.0


__all__ = ["MeshNode", "MeshSettings", "MeshStartError"]
