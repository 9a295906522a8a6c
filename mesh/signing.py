"""The two seams between the protocol core and cryptography.

- :class:`Signer`: signs this node's summaries (:class:`NodeSigner` with the real Ed25519
  key and certificate).
- :class:`TrustPolicy`: decides whether a certificate belongs to the mesh and whether a
  signature is valid (:class:`~viiwork.mesh.trust.CaTrust`,
  :class:`~viiwork.mesh.trust.OpenTrust`).

The simulator substitutes counting fakes for both (:mod:`viiwork.mesh.sim`) so a thousand
nodes fit in one process; everything else in the core is the code that runs in the agent.
"""

from __future__ import annotations

import datetime as dt
from typing import Any, Protocol

from viiwork.mesh.identity import NodeId, NodeIdentity


class Signer(Protocol):
    """Signs this node's summaries. ``certificate_der`` travels with them."""

    node_id: NodeId
    certificate_der: bytes

    def sign(self, data: bytes) -> bytes: ...


class CertificateView(Protocol):
    """What the core needs from a verified certificate (read-only: implementations are frozen).

    ``public_key`` is the policy's own key object (an Ed25519 public key, or the simulator's
    stand-in); only the policy that returned the certificate reads it."""

    @property
    def node_id(self) -> NodeId: ...
    @property
    def name(self) -> str: ...
    @property
    def not_after(self) -> dt.datetime: ...
    @property
    def der(self) -> bytes: ...
    @property
    def public_key(self) -> Any: ...


class TrustPolicy(Protocol):
    """``verify_certificate(der, now)`` returns the verified certificate or raises WrongCa,
    CertificateExpired, CertificateInvalid or NameConflict (:mod:`viiwork.mesh.trust`);
    ``verify_signature(cert, data, signature)`` returns whether the signature is valid.
    ``mode`` is "ca" or "open"; ``mesh_id`` names the mesh."""

    @property
    def mode(self) -> str: ...
    @property
    def mesh_id(self) -> str: ...

    def verify_certificate(self, der: bytes, now: dt.datetime) -> CertificateView: ...

    def verify_signature(self, cert: CertificateView, data: bytes, signature: bytes) -> bool: ...


class NodeSigner:
    """The real signer: this node's Ed25519 key and certificate (DER)."""

    def __init__(self, identity: NodeIdentity, certificate_der: bytes):
        self.identity = identity
        self.node_id = identity.node_id
        self.certificate_der = certificate_der
        self.signatures = 0

    def sign(self, data: bytes) -> bytes:
        self.signatures += 1
        return self.identity.sign(data)
