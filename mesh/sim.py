"""In-process simulator: N nodes running the real protocol core in virtual time.

One module (over 400 lines) because it is one test harness: the event loop, the scenarios
and the observations share one :class:`Simulator`'s state, and the fake cryptography exists
only for it (chosen by its ``crypto`` argument).

Every simulated node is a real :class:`~viiwork.mesh.membership.Membership` with a real
:class:`~viiwork.mesh.publisher.LocalPublisher`; the simulator replaces only the network
(an event queue with latency, random loss, partitions and dead nodes) and, by default, the
cryptography: :class:`FakeTrust`/:class:`FakeSigner` stand in for Ed25519 and X.509 with
keyed hashes and count every verification, so a thousand nodes fit in one process (one
real Ed25519 verification costs ~60 µs here). ``crypto="real"`` uses real keys,
certificates and :class:`~viiwork.mesh.trust.CaTrust` instead (slower; for small N).

Messages pass as objects (``wire=False``, sizes from
:func:`~viiwork.mesh.messages.estimate_size`) or as encoded bytes through the same
``*_bytes`` entry points the transport uses (``wire=True``, exact sizes).

Every node has its own monotonic clock (``clock_skew_ms``: a random offset per node) and
wall clock (same offset), and starts its rounds at a random phase with a little jitter, as
real timers do. Time is in milliseconds.
"""

from __future__ import annotations

import base64
import datetime as dt
import functools
import hashlib
import heapq
import itertools
import random
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from viiwork.mesh.boot import Boot
from viiwork.mesh.identity import NodeId
from viiwork.mesh.membership import GossipSettings, GossipTarget, Liveness, Membership
from viiwork.mesh.messages import Digest, estimate_size
from viiwork.mesh.probe_codec import encode_any
from viiwork.mesh.probing import ProbeNode, ProbeSettings
from viiwork.mesh.publisher import LocalPublisher
from viiwork.mesh.signing import CertificateView
from viiwork.mesh.summary import PROTOCOL_VERSION, ModelCapacity, PublishedState
from viiwork.mesh.trust import CertificateExpired, CertificateInvalid, WrongCa

SIM_MESH_ID = "simmesh"
FAR_FUTURE = dt.datetime(9999, 1, 1, tzinfo=dt.UTC)
EPOCH = dt.datetime(2026, 1, 1, tzinfo=dt.UTC)


def sim_node_id(i: int, salt: str = "") -> NodeId:
    """A valid, deterministic node id for simulated node ``i``."""
    digest = hashlib.sha256(f"sim-node-{salt}{i}".encode()).digest()[:10]
    return NodeId(base64.b32encode(digest).decode("ascii").lower())


# --- counting fake crypto ---------------------------------------------------------------------


@dataclass(frozen=True)
class FakeCert:
    node_id: NodeId
    name: str
    ca: str
    not_before: dt.datetime
    not_after: dt.datetime
    der: bytes
    public_key: Any = None


def fake_certificate(node_id: str, name: str, ca: str = "sim-ca", not_after: dt.datetime = FAR_FUTURE,
                     not_before: dt.datetime = EPOCH - dt.timedelta(days=365)) -> bytes:
    """A stand-in certificate (~80 bytes; a real Ed25519 one is ~300)."""
    return "\0".join(["fakecert", ca, node_id, name, not_before.isoformat(), not_after.isoformat()]).encode()


def fake_signature(node_id: str, data: bytes) -> bytes:
    """A keyed hash standing in for an Ed25519 signature (64 bytes). Not secure: any
    simulated node could forge another's; the security tests use real crypto."""
    return hashlib.blake2b(data, key=node_id.encode(), digest_size=64).digest()


class FakeSigner:
    """Counting stand-in for :class:`~viiwork.mesh.signing.NodeSigner`."""

    def __init__(self, node_id: NodeId, name: str, ca: str = "sim-ca", not_after: dt.datetime = FAR_FUTURE):
        self.node_id = node_id
        self.certificate_der = fake_certificate(node_id, name, ca, not_after)
        self.signatures = 0

    def sign(self, data: bytes) -> bytes:
        self.signatures += 1
        return fake_signature(self.node_id, data)


class FakeTrust:
    """Counting stand-in for :class:`~viiwork.mesh.trust.CaTrust`: same errors, same cache
    behaviour (chain checked once per certificate, validity on every use)."""

    mode = "ca"

    def __init__(self, mesh_id: str = SIM_MESH_ID, ca: str = "sim-ca", tolerance_s: float = 300.0):
        self.mesh_id = mesh_id
        self.ca = ca
        self.tolerance = dt.timedelta(seconds=tolerance_s)
        self._cache: dict[bytes, FakeCert] = {}
        self.chain_verifications = 0
        self.signature_verifications = 0

    def verify_certificate(self, der: bytes, now: dt.datetime) -> FakeCert:
        cert = self._cache.get(der)
        if cert is None:
            self.chain_verifications += 1
            try:
                tag, ca, node_id, name, nb, na = bytes(der).decode().split("\0")
                if tag != "fakecert":
                    raise ValueError(tag)
                cert = FakeCert(NodeId(node_id), name, ca, dt.datetime.fromisoformat(nb), dt.datetime.fromisoformat(na),
                                bytes(der))
            except (ValueError, UnicodeDecodeError):
                raise CertificateInvalid("not a simulated certificate") from None
            if cert.ca != self.ca:
                raise WrongCa(f"issued by {cert.ca}, not {self.ca}")
            self._cache[bytes(der)] = cert
        if now + self.tolerance < cert.not_before or now - self.tolerance > cert.not_after:
            raise CertificateExpired(f"valid until {cert.not_after}")
        return cert

    def verify_signature(self, cert: CertificateView, data: bytes, signature: bytes) -> bool:
        self.signature_verifications += 1
        return signature == fake_signature(cert.node_id, data)


# --- the simulated network --------------------------------------------------------------------


@dataclass
class SimNode:
    """One simulated node. ``offset_ms``: its clocks' offset from virtual time."""

    index: int
    node_id: NodeId
    name: str
    address: str
    offset_ms: float
    protocol: int
    signer: Any
    policy: Any
    membership: Membership = field(init=False)
    publisher: LocalPublisher = field(init=False)
    up: bool = True
    generation: int = 0
    incarnation: int = 0  # bumps on restart; stale scheduled rounds check it
    bytes_sent: int = 0
    messages_sent: int = 0
    models: tuple[ModelCapacity, ...] = ()
    probe: ProbeNode | None = None  # probe mode only
    next_poll_at: float = float("inf")
    bytes_by_kind: dict[str, int] = field(default_factory=dict)


def default_models(i: int) -> tuple[ModelCapacity, ...]:
    """One chat model per node, with a little variety."""
    return (ModelCapacity(name=f"model-{i % 5}", engine="llamacpp", kind="chat", slots=4, busy=i % 4, waiting=None,
                          ctx_per_slot=4096, healthy=1, total=1, fingerprint=f"fp-{i % 5}"),)


class Simulator:
    """N nodes, one event queue, virtual milliseconds (see the module doc).

    ``seeds_per_node``: random other nodes each node starts with as seed candidates (node 0
    is always one, as a shared seed); ``loss``: probability that any one message is lost;
    ``latency_ms``: one-way delay (uniform in [latency_ms/2, latency_ms*1.5]);
    ``protocols``: per-node protocol version (default all current); ``mode``: "heartbeat"
    (protocols 2-4's all-to-all heartbeats, what the transport runs) or "probe"
    (:mod:`viiwork.mesh.probing`, with ``probe_settings``).
    """

    def __init__(self, n: int, settings: GossipSettings | None = None, seed: int = 0, loss: float = 0.0,
                 latency_ms: float = 1.0, wire: bool = False, clock_skew_ms: float = 0.0,
                 protocols: list[int] | None = None, crypto: str = "fake", seeds_per_node: int = 2,
                 models: Callable[[int], tuple[ModelCapacity, ...]] = default_models, mode: str = "heartbeat",
                 probe_settings: ProbeSettings | None = None):
        if mode not in ("heartbeat", "probe"):
            raise ValueError(f"mode must be heartbeat or probe, got {mode!r}")
        self.mode = mode
        self.probe_settings = probe_settings or ProbeSettings()
        self.settings = settings or GossipSettings()
        self.rng = random.Random(seed)
        self.loss = loss
        self.latency_ms = latency_ms
        self.wire = wire
        self.now = 0.0
        self._events: list[tuple[float, int, Callable[[], None]]] = []
        self._seq = itertools.count()
        self._groups: dict[int, int] | None = None
        self.crypto = crypto
        self.watchers: list[Callable[[SimNode, NodeId], None]] = []
        self.liveness_watchers: list[Callable[[SimNode, NodeId, Liveness, Liveness], None]] = []
        self.delivered = 0
        self.lost = 0
        if crypto == "real":
            self._real = _RealCrypto()
        self.nodes: list[SimNode] = []
        # Clock offsets come from their own generator, so the same seed with and without skew
        # makes the same random choices everywhere else.
        skew_rng = random.Random(seed + 1)
        for i in range(n):
            protocol = protocols[i] if protocols else PROTOCOL_VERSION
            node_id, signer, policy = self._crypto_for(i)
            node = SimNode(index=i, node_id=node_id, name=f"node-{i}", address=f"sim-{i}:8087",
                           offset_ms=skew_rng.uniform(-clock_skew_ms, clock_skew_ms), protocol=protocol,
                           signer=signer, policy=policy)
            node.models = models(i)
            self.nodes.append(node)
        self.by_address = {node.address: node for node in self.nodes}
        for node in self.nodes:
            self._boot(node, generation=1)
            others = [j for j in self.rng.sample(range(n), min(n, seeds_per_node + 1)) if j != node.index]
            for j in ([0] if node.index != 0 else []) + others[:seeds_per_node]:
                node.membership.add_candidate(self.nodes[j].address, source="seed")
            self._start_timers(node)

    # --- setup ---------------------------------------------------------------------------------

    def _crypto_for(self, i: int) -> tuple[NodeId, Any, Any]:
        if self.crypto == "real":
            return self._real.node(i)
        node_id = sim_node_id(i)
        return node_id, FakeSigner(node_id, f"node-{i}"), FakeTrust()

    def _boot(self, node: SimNode, generation: int) -> None:
        node.generation = generation
        node.incarnation += 1

        def clock() -> float:
            return self.now + node.offset_ms

        def wall() -> dt.datetime:
            return EPOCH + dt.timedelta(milliseconds=self.now + node.offset_ms)

        def store_generation(g: int) -> None:
            node.generation = g

        m = Membership(node.node_id, SIM_MESH_ID if self.crypto != "real" else self._real.mesh_id,
                       node.signer.certificate_der, node.policy, self.settings, clock, wall,
                       random.Random(self.rng.random()), protocol=node.protocol)
        m.on_update.append(lambda origin: self._notify(node, origin))
        m.on_liveness.append(lambda origin, old, new: self._notify_liveness(node, origin, old, new))
        probing = self.mode == "probe"
        pub = LocalPublisher(m, node.signer, node.name, api=f"sim-{node.index}:8086", mesh=node.address,
                             version="sim", boot=Boot(generation, f"{node.index:04x}{node.incarnation:012x}"),
                             heartbeat_ms=self.probe_settings.republish_ms if probing else self.settings.heartbeat_ms,
                             store_generation=store_generation)
        node.membership, node.publisher = m, pub
        if probing:
            node.probe = ProbeNode(m, pub, self.probe_settings, random.Random(self.rng.random()))
            node.probe.on_load.append(lambda origin, record: self._notify(node, origin))
            node.probe.set_load(node.models)
            node.probe.publish()
        else:
            pub.set_local(node.models)
            pub.maybe_publish()

    def _notify(self, node: SimNode, origin: NodeId) -> None:
        for w in self.watchers:
            w(node, origin)

    def _notify_liveness(self, node: SimNode, origin: NodeId, old: Liveness, new: Liveness) -> None:
        for w in self.liveness_watchers:
            w(node, origin, old, new)

    # --- the event loop --------------------------------------------------------------------------

    def at(self, when: float, fn: Callable[[], None]) -> None:
        heapq.heappush(self._events, (when, next(self._seq), fn))

    def run_until(self, when: float) -> None:
        """Process events up to virtual time ``when`` (ms) and stop the clock there."""
        while self._events and self._events[0][0] <= when:
            t, _, fn = heapq.heappop(self._events)
            self.now = t
            fn()
        self.now = when

    def run_for(self, ms: float) -> None:
        self.run_until(self.now + ms)

    def run_until_true(self, predicate: Callable[[], bool], timeout_ms: float, step_ms: float = 50.0) -> bool:
        """Run in steps until ``predicate()`` holds; False when ``timeout_ms`` passes first."""
        deadline = self.now + timeout_ms
        while self.now < deadline:
            if predicate():
                return True
            self.run_for(min(step_ms, deadline - self.now))
        return predicate()

    def _start_timers(self, node: SimNode) -> None:
        delay = self.rng.uniform(0, self.settings.gossip_interval_ms)
        if self.mode == "probe":
            node.next_poll_at = float("inf")
            self._schedule_poll(node, self.now + delay)
        else:
            self._schedule_round(node, delay)

    # --- probe mode ------------------------------------------------------------------------------

    def _schedule_poll(self, node: SimNode, when: float) -> None:
        if when >= node.next_poll_at:
            return
        node.next_poll_at = when
        incarnation = node.incarnation
        self.at(when, lambda: self._poll(node, incarnation, when))

    def _poll(self, node: SimNode, incarnation: int, when: float) -> None:
        if node.next_poll_at != when or node.incarnation != incarnation:
            return  # superseded by an earlier poll, or a restart
        node.next_poll_at = float("inf")
        if not node.up:
            return
        assert node.probe is not None
        self._send_all(node, node.probe.poll())
        self._reschedule(node)

    def _reschedule(self, node: SimNode) -> None:
        assert node.probe is not None
        wake = node.probe.next_wakeup() - node.offset_ms
        self._schedule_poll(node, max(wake, self.now + 1.0))

    def _send_all(self, node: SimNode, out: list[tuple[str, Any]]) -> None:
        for address, msg in out:
            dst = self.by_address.get(address)
            if dst is not None and dst is not node:
                data = encode_any(msg) if self.wire and not isinstance(msg, bytes) else msg
                self._send(node, dst, data, functools.partial(self._deliver, node, dst))

    def _deliver(self, src: SimNode, dst: SimNode, msg: Any) -> None:
        assert dst.probe is not None
        if isinstance(msg, bytes):
            self._send_all(dst, list(dst.probe.receive_bytes(src.node_id, src.address, msg)))
        else:
            self._send_all(dst, dst.probe.receive(src.node_id, src.address, msg))
        self._reschedule(dst)

    def freeze(self, i: int) -> None:
        """SIGSTOP-like: node ``i`` stops answering and its timers stop (messages to it are
        lost) until :meth:`thaw`; its state is kept."""
        self.nodes[i].up = False

    def thaw(self, i: int) -> None:
        """SIGCONT after :meth:`freeze`: node ``i`` runs again with the state it had."""
        node = self.nodes[i]
        node.up = True
        node.next_poll_at = float("inf")
        if self.mode == "probe":
            self._schedule_poll(node, self.now)
        else:
            self._schedule_round(node, 0.0)

    def _schedule_round(self, node: SimNode, delay: float) -> None:
        incarnation = node.incarnation
        self.at(self.now + delay, lambda: self._round(node, incarnation))

    def _round(self, node: SimNode, incarnation: int) -> None:
        if not node.up or node.incarnation != incarnation:
            return
        node.publisher.maybe_publish()
        for target in node.membership.select_targets():
            self._exchange(node, target)
        jitter = self.rng.uniform(-0.02, 0.02) * self.settings.gossip_interval_ms
        self._schedule_round(node, self.settings.gossip_interval_ms + jitter)

    def _reachable(self, a: SimNode, b: SimNode) -> bool:
        if not b.up or not a.up:
            return False
        if self._groups is not None and self._groups.get(a.index) != self._groups.get(b.index):
            return False
        return True

    def _send(self, src: SimNode, dst: SimNode, msg: Any, deliver: Callable[[Any], None]) -> None:
        """Count, maybe lose, and deliver ``msg`` after the latency."""
        size = len(msg) if isinstance(msg, bytes) else estimate_size(msg)
        # The message type: the class, or the "type" our encoders write first ({"type":"ping",...).
        kind = msg.split(b'"', 4)[3].decode("ascii", "replace").replace("-", "") if isinstance(
            msg, bytes) else type(msg).__name__.lower()
        src.bytes_by_kind[kind] = src.bytes_by_kind.get(kind, 0) + size
        src.bytes_sent += size
        src.messages_sent += 1
        if self.loss and self.rng.random() < self.loss:
            self.lost += 1
            return
        delay = self.rng.uniform(0.5, 1.5) * self.latency_ms
        inc_src, inc_dst = src.incarnation, dst.incarnation

        def arrive() -> None:
            if src.incarnation != inc_src or dst.incarnation != inc_dst or not self._reachable(src, dst):
                self.lost += 1
                return
            self.delivered += 1
            deliver(msg)

        self.at(self.now + delay, arrive)

    def _exchange(self, a: SimNode, target: GossipTarget) -> None:
        b = self.by_address.get(target.address)
        if b is None or b is a:
            return
        ma = a.membership
        digest: Digest | bytes = ma.digest_bytes(target) if self.wire else ma.make_digest(target)

        def at_b(msg: Any) -> None:
            mb = b.membership
            reply = mb.on_digest_bytes(a.node_id, msg) if self.wire else mb.handle_digest(a.node_id, msg)
            if reply is not None:
                self._send(b, a, reply, at_a)

        def at_a(msg: Any) -> None:
            push = ma.on_reply_bytes(b.node_id, msg, target) if self.wire else ma.handle_reply(b.node_id, msg, target)
            if push is not None:
                self._send(a, b, push, at_b_push)

        def at_b_push(msg: Any) -> None:
            mb = b.membership
            if self.wire:
                mb.on_push_bytes(a.node_id, msg)
            else:
                mb.handle_push(a.node_id, msg)

        self._send(a, b, digest, at_b)

    # --- scenarios -----------------------------------------------------------------------------

    def set_models(self, i: int, models: tuple[ModelCapacity, ...]) -> tuple[int, int]:
        """Change node ``i``'s capacity and publish at once; returns the (generation, seq) that
        carries the change."""
        node = self.nodes[i]
        node.models = models
        if node.probe is not None:
            node.probe.set_load(models)
            summary = node.probe.publish(force=True)
            self._reschedule(node)
        else:
            node.publisher.set_local(models)
            summary = node.publisher.maybe_publish()
        assert summary is not None
        return summary.payload.order

    def set_load(self, i: int, models: tuple[ModelCapacity, ...]) -> None:
        """Node ``i``'s true capacity changed (a request started or ended): published by the
        mode's own rule (heartbeat: at its next round; probe: quantised, rate-limited)."""
        node = self.nodes[i]
        node.models = models
        if node.probe is not None:
            node.probe.set_load(models)
            if node.up:
                self._schedule_poll(node, self.now)
        else:
            node.publisher.set_local(models)

    def kill(self, i: int) -> None:
        """Node ``i`` stops dead: no more rounds, messages to it are lost."""
        self.nodes[i].up = False

    def leave(self, i: int) -> None:
        """Graceful stop: publish ``leaving``, push it to ``fanout`` peers, then stop."""
        node = self.nodes[i]
        if node.probe is not None:
            self._send_all(node, node.probe.leave())
            self.at(self.now + 4 * self.latency_ms + 1, lambda: setattr(node, "up", False))
            return
        node.publisher.set_local(node.models, PublishedState.LEAVING)
        node.publisher.maybe_publish(force=True)
        for target in node.membership.select_targets():
            self._exchange(node, target)
        self.at(self.now + 4 * self.latency_ms + 1, lambda: setattr(node, "up", False))

    def restart(self, i: int, lose_generation: bool = False) -> None:
        """Node ``i`` comes back with a new boot (generation + 1, or 1 when its generation
        file was lost) and an empty table, starting from its seeds."""
        node = self.nodes[i]
        seeds = {a: c for a, c in node.membership.candidates.items() if c.source == "seed"}
        generation = 1 if lose_generation else node.generation + 1
        node.up = True
        self._boot(node, generation)
        for addr in seeds:
            node.membership.add_candidate(addr, source="seed")
        self._start_timers(node)

    def partition(self, groups: list[list[int]]) -> None:
        """Split the network: messages cross no group boundary until :meth:`heal`."""
        self._groups = {i: g for g, members in enumerate(groups) for i in members}

    def heal(self) -> None:
        self._groups = None

    # --- observations --------------------------------------------------------------------------

    def up_nodes(self) -> list[SimNode]:
        return [n for n in self.nodes if n.up]

    def knows(self, observer: SimNode, origin: SimNode, order: tuple[int, int] | None = None,
              liveness: tuple[Liveness, ...] = (Liveness.ALIVE,)) -> bool:
        """Whether ``observer`` holds ``origin`` (at ``order`` or newer) with that liveness."""
        rec = observer.membership.records.get(origin.node_id)
        if rec is None:
            return False
        if order is not None and rec.order < order:
            return False
        return observer.membership.liveness(origin.node_id) in liveness

    def converged(self) -> bool:
        """Every up node holds every other up node as alive."""
        ups = self.up_nodes()
        return all(self.knows(a, b) for a in ups for b in ups if a is not b)

    def view_of(self, observer: int, origin: int) -> Liveness | None:
        return self.nodes[observer].membership.liveness(self.nodes[origin].node_id)

    def version_of(self, observer: SimNode, origin: NodeId) -> tuple[int, int] | None:
        """The newest version of ``origin`` that ``observer`` holds: its summary's, or in
        probe mode its load record's when newer."""
        if observer.probe is not None:
            return observer.probe.version_of(origin)
        rec = observer.membership.records.get(origin)
        return None if rec is None else rec.order

    def heard_at_global(self, observer: SimNode, origin: SimNode) -> float | None:
        """When (virtual ms) ``observer`` believes ``origin`` last published."""
        rec = observer.membership.records.get(origin.node_id)
        return None if rec is None else rec.heard_at - observer.offset_ms

    def totals(self) -> dict[str, float]:
        """Bytes, messages, signatures and verifications summed over nodes."""
        out = {"bytes": 0.0, "messages": 0.0, "signatures": 0.0, "signature_verifications": 0.0,
               "chain_verifications": 0.0}
        for n in self.nodes:
            out["bytes"] += n.bytes_sent
            out["messages"] += n.messages_sent
            out["signatures"] += n.signer.signatures
            out["signature_verifications"] += n.policy.signature_verifications
            out["chain_verifications"] += n.policy.chain_verifications
        return out


class _RealCrypto:
    """Real Ed25519 keys, a real CA and real certificates for small simulations."""

    def __init__(self) -> None:
        from cryptography.hazmat.primitives import serialization
        from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

        from viiwork.mesh import trust

        self._trust = trust
        self._serialization = serialization
        self._key_cls = Ed25519PrivateKey
        now = EPOCH
        self.ca_key = Ed25519PrivateKey.generate()
        self.ca_cert = trust._ca_certificate(self.ca_key, "sim CA", now - dt.timedelta(days=365),
                                             now + dt.timedelta(days=3650), 1)
        self.mesh_id = trust.mesh_id_for_ca(self.ca_cert)

    def node(self, i: int) -> tuple[NodeId, Any, Any]:
        from viiwork.mesh.identity import NodeIdentity, node_id_from_public_key
        from viiwork.mesh.signing import NodeSigner

        key = self._key_cls.generate()
        node_id = node_id_from_public_key(key.public_key())
        identity = NodeIdentity(private_key=key, node_id=node_id, key_path=None)  # type: ignore[arg-type]
        cert = self._trust._node_certificate(key.public_key(), f"node-{i}", node_id, self.ca_key, self.ca_cert,
                                             EPOCH - dt.timedelta(days=1), EPOCH + dt.timedelta(days=365))
        der = cert.public_bytes(self._serialization.Encoding.DER)
        return node_id, NodeSigner(identity, der), self._trust.CaTrust(self.ca_cert)


__all__ = ["FakeSigner", "FakeTrust", "SIM_MESH_ID", "SimNode", "Simulator", "fake_certificate", "sim_node_id"]
