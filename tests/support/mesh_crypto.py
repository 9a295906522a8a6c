"""Real keys, a real CA and real node certificates in memory, plus a manual clock, for
driving the mesh protocol core in tests."""

from __future__ import annotations

import datetime as dt
import random
from dataclasses import dataclass

from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from viiwork.mesh import trust
from viiwork.mesh.boot import Boot
from viiwork.mesh.identity import NodeIdentity, node_id_from_public_key
from viiwork.mesh.membership import GossipSettings, Membership
from viiwork.mesh.publisher import LocalPublisher
from viiwork.mesh.signing import NodeSigner
from viiwork.mesh.summary import ModelCapacity

T0 = dt.datetime(2026, 6, 1, 12, 0, tzinfo=dt.UTC)


class ManualClock:
    """Monotonic milliseconds that move only when told; ``wall()`` moves with it."""

    def __init__(self, start_ms: float = 5_000_000.0, wall_start: dt.datetime = T0):
        self.ms = start_ms
        self._start = start_ms
        self._wall_start = wall_start

    def __call__(self) -> float:
        return self.ms

    def wall(self) -> dt.datetime:
        return self._wall_start + dt.timedelta(milliseconds=self.ms - self._start)

    def advance(self, ms: float) -> None:
        self.ms += ms


@dataclass
class TestNode:
    identity: NodeIdentity
    signer: NodeSigner
    name: str

    @property
    def node_id(self):
        return self.identity.node_id


class TestCA:
    """A real Ed25519 CA; ``node()`` issues real node certificates."""

    __test__ = False

    def __init__(self, name: str = "test CA"):
        self.key = Ed25519PrivateKey.generate()
        self.cert = trust._ca_certificate(self.key, name, T0 - dt.timedelta(days=30), T0 + dt.timedelta(days=3650), 1)
        self.mesh_id = trust.mesh_id_for_ca(self.cert)

    def trust(self) -> trust.CaTrust:
        return trust.CaTrust(self.cert)

    def node(self, name: str, not_before: dt.datetime | None = None, not_after: dt.datetime | None = None,
             key: Ed25519PrivateKey | None = None) -> TestNode:
        key = key or Ed25519PrivateKey.generate()
        node_id = node_id_from_public_key(key.public_key())
        identity = NodeIdentity(private_key=key, node_id=node_id, key_path=None)  # type: ignore[arg-type]
        cert = trust._node_certificate(key.public_key(), name, node_id, self.key, self.cert,
                                       not_before or T0 - dt.timedelta(days=1),
                                       not_after or T0 + dt.timedelta(days=365))
        return TestNode(identity, NodeSigner(identity, cert.public_bytes(serialization.Encoding.DER)), name)


def chat_model(name: str = "llama", busy: int = 0, slots: int = 4, fingerprint: str | None = "fp-a") -> ModelCapacity:
    return ModelCapacity(name=name, engine="llamacpp", kind="chat", slots=slots, busy=busy, waiting=None,
                         ctx_per_slot=4096, healthy=1, total=1, fingerprint=fingerprint)


def core(node: TestNode, ca: TestCA, clock: ManualClock, settings: GossipSettings | None = None,
         generation: int = 1, protocol: int = 2, seed: int = 0, policy=None) -> tuple[Membership, LocalPublisher]:
    """A membership core and publisher for ``node``, published once (models: one chat model)."""
    m = Membership(node.node_id, ca.mesh_id, node.signer.certificate_der, policy or ca.trust(),
                   settings or GossipSettings(scale_with_size=False), clock, clock.wall, random.Random(seed),
                   protocol=protocol)
    pub = LocalPublisher(m, node.signer, node.name, api=f"{node.name}:8086", mesh=f"{node.name}:8087",
                         version="test", boot=Boot(generation, f"{generation:016x}"), heartbeat_ms=500)
    pub.set_local([chat_model()])
    pub.maybe_publish()
    return m, pub


def exchange(a: Membership, b: Membership, address: str = "b:8087") -> dict[str, int]:
    """One full exchange a -> b over the byte codec (digest, reply, push), as the transport
    does it, with the TLS identities as senders. Returns the byte sizes of the messages."""
    from viiwork.mesh.membership import GossipTarget

    rec = a.records.get(b.node_id)
    target = GossipTarget(address, b.node_id, a._target_protocol(address, rec))
    digest = a.digest_bytes(target)
    reply = b.on_digest_bytes(a.node_id, digest)
    sizes = {"digest": len(digest), "reply": 0, "push": 0}
    if reply is None:
        return sizes
    sizes["reply"] = len(reply)
    push = a.on_reply_bytes(b.node_id, reply, target)
    if push is not None:
        sizes["push"] = len(push)
        b.on_push_bytes(a.node_id, push)
    return sizes
