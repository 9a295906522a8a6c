"""Mesh counters: messages and bytes in/out, accepted summaries, and drops by reason.

Every message or summary the mesh refuses increments exactly one :class:`DropReason`
counter; nothing a peer sends raises out of the mesh (docs/mesh.md).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from enum import Enum
from typing import Any


class DropReason(str, Enum):
    """Why a message or summary was dropped.

    - ``bad_signature``: the origin's signature does not verify.
    - ``unknown_signer``: no certificate came with a summary of a node this node does not know.
    - ``expired_certificate``: the certificate is outside its validity (local clock + tolerance).
    - ``wrong_ca``: the certificate was not issued by this mesh's CA.
    - ``invalid_certificate``: undecodable, not Ed25519, a CA, or a SAN that disagrees.
    - ``name_conflict``: open mode: the node name is pinned to another node id.
    - ``identity_mismatch``: the payload's node id is not the certificate's.
    - ``replay``: the same (generation, seq) is already held.
    - ``old_seq``: an older (generation, seq) than the one held.
    - ``stale``: a first summary of an unknown node that is already older than ``dead_after``.
    - ``malformed``: undecodable or mis-shaped message or summary.
    - ``oversized``: message or summary beyond its size bound.
    - ``wrong_mesh``: another mesh id.
    - ``unsupported_protocol``: a protocol version that is neither current nor previous.
    - ``rate_limited``: the sending peer is over its per-peer message rate.
    - ``too_many_peers``: the peer table is full (``max_peers``) and holds no tombstone to evict.
    """

    BAD_SIGNATURE = "bad_signature"
    UNKNOWN_SIGNER = "unknown_signer"
    EXPIRED_CERTIFICATE = "expired_certificate"
    WRONG_CA = "wrong_ca"
    INVALID_CERTIFICATE = "invalid_certificate"
    NAME_CONFLICT = "name_conflict"
    IDENTITY_MISMATCH = "identity_mismatch"
    REPLAY = "replay"
    OLD_SEQ = "old_seq"
    STALE = "stale"
    MALFORMED = "malformed"
    OVERSIZED = "oversized"
    WRONG_MESH = "wrong_mesh"
    UNSUPPORTED_PROTOCOL = "unsupported_protocol"
    RATE_LIMITED = "rate_limited"
    TOO_MANY_PEERS = "too_many_peers"


@dataclass
class MeshCounters:
    """Plain counters (single-threaded: the event loop or the simulator owns them)."""

    messages_in: Counter[str] = field(default_factory=Counter)  # by message type
    messages_out: Counter[str] = field(default_factory=Counter)
    bytes_in: int = 0
    bytes_out: int = 0
    summaries_accepted: int = 0
    summaries_published: int = 0
    drops: Counter[str] = field(default_factory=Counter)  # by DropReason value
    transport: Counter[str] = field(default_factory=Counter)  # handshake_failed, exchange_failed, ...

    def drop(self, reason: DropReason | str, n: int = 1) -> None:
        self.drops[reason.value if isinstance(reason, DropReason) else reason] += n

    def as_dict(self) -> dict[str, Any]:
        """A JSON-ready copy: every drop reason listed (zeros included) so dashboards see the set."""
        drops = {r.value: 0 for r in DropReason}
        drops.update(self.drops)
        return {
            "messages_in": dict(self.messages_in),
            "messages_out": dict(self.messages_out),
            "bytes_in": self.bytes_in,
            "bytes_out": self.bytes_out,
            "summaries_accepted": self.summaries_accepted,
            "summaries_published": self.summaries_published,
            "drops": drops,
            "transport": dict(self.transport),
        }
