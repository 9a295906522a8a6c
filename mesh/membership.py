"""The pure protocol core: which summaries to accept, who is alive, whom to gossip with.

One module (over 950 lines) because :class:`Membership` is one state machine: every handler
below (accept, tick, digest, reply, push, peer selection) reads and writes the same table of
records, liveness, tombstones and candidates under one clock. What needs no table is apart
already (candidates, clones, counters, ratelimit, messages, boot).

No sockets, no asyncio, no timers: a :class:`Membership` is fed messages (objects, or bytes
through the ``*_bytes`` methods) and reads an injected monotonic clock (milliseconds) and
an injected wall clock (used for certificate validity only). The agent's transport
(:mod:`viiwork.mesh.transport`) and the simulator (:mod:`viiwork.mesh.sim`) drive the same
code. Nothing a peer sends raises out of it: every refusal is a counted
:class:`~viiwork.mesh.counters.DropReason`.

Rules (docs/mesh.md; docs/architecture.md, rule 7):

- **Ordering** of one node's summaries is by ``(generation, seq)`` (see
  :mod:`viiwork.mesh.boot`): newer is accepted, equal is a ``replay``, older is ``old_seq``.
  A restarted node has a higher generation, so its first summary is accepted at once,
  whatever its seq. A node that sees a genuine summary of its own that is at least as new as
  its current one (its previous run, after the generation file was lost) raises
  :attr:`Membership.required_generation` so that its next publication outranks it.
- **Verification** happens after the cheap checks (mesh id, ordering, table bound): the
  certificate (chain, validity with tolerance, cached by bytes) and then the origin's
  signature. A summary without a certificate uses the certificate held for that node.
- **Freshness** is the receiver's: each record keeps ``heard_at``, the local monotonic time
  at which the origin published the newest held version, estimated as receive time minus
  the relay's ``age_ms``; a newer version never moves it backwards. Liveness from
  ``now - heard_at``: below ``suspect_after_ms`` ``alive``, below ``dead_after_ms``
  ``suspect``, else ``dead``; a published ``leaving`` state is ``left`` at once; a peer
  whose newest summary says ``restarting`` (protocol 3) stays ``suspect`` for
  ``restart_grace_ms`` of silence (its agent is coming back) before it is ``dead``.
- **Probe mode** (:mod:`viiwork.mesh.probing`, issue 16): with :attr:`Membership.liveness_hook`
  set, liveness is the failure detector's (``left`` still from a published ``leaving``),
  silence is ``suspect`` or ``dead`` there, and an unknown node's first summary is taken
  whatever its age (publication is on change only, so a live node's summary may be old).
- **Silence** is apart from liveness: a peer is ``silent`` once nothing newer of it was
  heard for ``suspect_after_ms``, whatever state it publishes (``serving``, ``draining``,
  ``leaving``, ``restarting``). A node that drains or leaves keeps publishing heartbeats
  until it stops, so its silence means it froze or was cut off; ``on_silent`` fires once
  per silence, and work in flight on that peer is given up (docs/routing.md).
- **Tombstones**: dead and left nodes stay in the table (and in digests, so nobody resends
  their old summaries) for ``tombstone_ttl_ms``; only a newer (generation, seq) that is
  itself fresh brings a node back. A stale relay's copy is older (dropped) or carries its
  age (stays dead). Dead nodes' summaries are never relayed. A first summary of an unknown
  node that is older than ``dead_after_ms`` is dropped as ``stale``.
- **Exchange** (see :mod:`viiwork.mesh.messages`): digest first, then only what the other
  side lacks, both ways; certificates travel only to peers that lack them.
- **Peer selection** per round: ``fanout`` distinct random live peers (alive or suspect);
  discovered addresses (mDNS, seeds) not yet known as live nodes, each with its own backoff
  (:mod:`viiwork.mesh.candidates`): while no peer is alive every due one is dialed (the
  first round dials every seed), else due ones fill the remaining places, and one of them
  is retried every ``reseed_every_rounds`` rounds; with probability
  ``probe_dead_per_round`` one random dead node is probed too, so partitions heal (both
  sides of a partition declare the other dead, and nobody would gossip across otherwise).
- **Versions**: a node accepts its protocol and the two before it (so protocol 4 reads
  99079c7's protocol 2, the last release before 3). It speaks to a known
  peer in the newest version both speak (the peer's summary says which it ``speaks``), to
  an unknown address in its own, and answers in the version it was asked in; a message in
  a version it does not speak gets an empty reply in its own version, from which the
  sender learns to speak down (remembered for a minute, then retried, in case the address
  was upgraded). A node publishes in the newest version that every live peer speaks
  (never below the oldest it accepts), so during a rolling upgrade everyone reads everyone's
  summaries, and the last old node's departure switches the fleet to the new version.
- **One node per identity** (:mod:`viiwork.mesh.clones`): each boot of a node id is tracked
  by the span of its publication times; two boots that both keep publishing, at once, for
  ``dead_after_ms`` are a ``conflict``. This node reports its own (``identity_conflict``,
  ``on_identity_conflict``; the higher boot must leave); a peer in conflict shows liveness
  ``conflict`` in :meth:`Membership.peers` (a view state, never published) and is not routed
  to while it lasts. A restart or an address change never overlaps.
- **Bounds**: ``max_peers`` table entries (a tombstone is evicted first, else
  ``too_many_peers``), per-peer message rate (``peer_rate_per_s``, ``peer_burst``), message
  size (``max_message_bytes``; replies fill up to it and leave the rest to later rounds).
"""

from __future__ import annotations

import datetime as dt
import logging
import math
import random
from collections.abc import Callable, Collection
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from viiwork.mesh.candidates import DROPPED_REPLY, Candidate, CandidateView, backoff_ms
from viiwork.mesh.clones import BootTracker, IdentityConflict
from viiwork.mesh.counters import DropReason, MeshCounters
from viiwork.mesh.extensions import EMPTY as EMPTY_EXTENSIONS
from viiwork.mesh.extensions import Extensions
from viiwork.mesh.identity import NodeId
from viiwork.mesh.load_record import LoadRecord, apply_load
from viiwork.mesh.messages import (
    MAX_AGE_MS,
    MAX_MESSAGE_BYTES,
    Digest,
    Entries,
    Order,
    Push,
    RelayedSummary,
    Reply,
    decode_message,
    encode_message,
)
from viiwork.mesh.ratelimit import PeerRateLimiter
from viiwork.mesh.signing import CertificateView, TrustPolicy
from viiwork.mesh.summary import (
    IMPLEMENTED_PROTOCOLS,
    PROTOCOL_VERSION,
    GpuCapacity,
    ModelCapacity,
    PublishedState,
    SignedSummary,
    SummaryError,
    UnsupportedProtocol,
    signing_input,
)
from viiwork.mesh.trust import CertificateExpired, CertificateInvalid, NameConflict, TrustError, WrongCa

log = logging.getLogger(__name__)


class Liveness(str, Enum):
    """What this node observes of a peer (not what the peer publishes)."""

    ALIVE = "alive"
    SUSPECT = "suspect"
    DEAD = "dead"
    LEFT = "left"
    # View only (PeerView, never a record's liveness): two running boots publish this node
    # id at once (mesh/clones.py); not routed to while it lasts.
    CONFLICT = "conflict"


@dataclass(frozen=True)
class GossipSettings:
    """Protocol parameters. Durations in milliseconds, rates per second.

    ``gossip_interval_ms`` (500): one round (exchanges with ``fanout`` peers, and a new
    heartbeat publication every ``heartbeat_interval_ms``, default one round).
    ``suspect_after_ms`` (2000) / ``dead_after_ms`` (10000): silence (no newer summary)
    before a peer is suspect (not routed to) / dead. A summary needs about
    log_fanout(N) + 1 rounds to reach N nodes, so suspect_after should cover a few rounds
    more than that: see docs/mesh.md for measured figures. ``max_peers`` (1024): table
    bound. ``peer_rate_per_s`` / ``peer_burst``: messages accepted per sending peer; by
    default 20 rounds' worth (at least 40/s) and twice that as burst: a well-behaved peer
    sends about 2 per round to any one node. ``tombstone_ttl_ms``
    (1 h): how long dead and left nodes are remembered. ``probe_dead_per_round`` (0.1) and
    ``reseed_every_rounds`` (20): see the module doc. ``restart_grace_ms`` (30000): how
    long a silent peer whose newest summary says ``restarting`` stays ``suspect`` before
    it is ``dead`` (never less than ``dead_after_ms``; docs/mesh.md, "Failure detection").
    ``seed_backoff_min_ms`` (1000) / ``seed_backoff_max_ms`` (60000): the backoff of a
    discovered address that does not answer, doubling from the one to the other
    (:mod:`viiwork.mesh.candidates`; docs/mesh.md, "Seeds").
    """

    gossip_interval_ms: int = 500
    fanout: int = 3
    suspect_after_ms: int = 2000
    dead_after_ms: int = 10_000
    max_peers: int = 1024
    peer_rate_per_s: float | None = None
    peer_burst: int | None = None
    max_message_bytes: int = MAX_MESSAGE_BYTES
    tombstone_ttl_ms: int = 3_600_000
    probe_dead_per_round: float = 0.1
    reseed_every_rounds: int = 20
    heartbeat_interval_ms: int | None = None
    scale_with_size: bool = True
    restart_grace_ms: int = 30_000
    seed_backoff_min_ms: int = 1000
    seed_backoff_max_ms: int = 60_000

    def __post_init__(self) -> None:
        problems = []
        if self.gossip_interval_ms < 1:
            problems.append("gossip_interval_ms must be >= 1")
        if self.fanout < 1:
            problems.append("fanout must be >= 1")
        if not 0 < self.suspect_after_ms < self.dead_after_ms:
            problems.append("need 0 < suspect_after_ms < dead_after_ms")
        if self.max_peers < 1:
            problems.append("max_peers must be >= 1")
        if self.max_message_bytes < 4096:
            problems.append("max_message_bytes must be >= 4096")
        if not 0.0 <= self.probe_dead_per_round <= 1.0:
            problems.append("probe_dead_per_round must be within 0..1")
        if not 1 <= self.seed_backoff_min_ms <= self.seed_backoff_max_ms:
            problems.append("need 1 <= seed_backoff_min_ms <= seed_backoff_max_ms")
        if problems:
            raise ValueError("; ".join(problems))

    @property
    def heartbeat_ms(self) -> int:
        return self.heartbeat_interval_ms or self.gossip_interval_ms

    def timeouts_for(self, n: int) -> tuple[float, float]:
        """(suspect, dead) thresholds in ms for a mesh of ``n`` live nodes.

        A heartbeat needs about log_(fanout+1)(n) rounds to reach everyone, and the newest
        one a node holds is up to one heartbeat older still. With ``scale_with_size`` the
        configured values are floors and the suspect threshold is at least
        ``gossip_interval_ms * (log_(fanout+1)(n) + 2)`` (the dead threshold keeps its
        distance above it), which the simulator measured to keep live nodes from being
        suspected under 5% message loss up to 1,000 nodes (docs/mesh.md). memberlist scales
        its suspicion timeout with log(n) for the same reason.
        """
        suspect, dead = float(self.suspect_after_ms), float(self.dead_after_ms)
        if self.scale_with_size and n > 1:
            floor = self.gossip_interval_ms * (math.log(n) / math.log(self.fanout + 1) + 2.0)
            if floor > suspect:
                dead += floor - suspect
                suspect = floor
        return suspect, dead


@dataclass(frozen=True)
class GossipTarget:
    """Whom to gossip with: a mesh ``address`` (host:port), the node id when known, and the
    protocol version to speak to it. ``candidate``: a discovered address (seed, mDNS) that
    is not a live node: the caller reports how its dial ended (:meth:`Membership.note_dial`)."""

    address: str
    node_id: NodeId | None
    protocol: int
    candidate: bool = False


@dataclass(frozen=True)
class PeerView:
    """One peer as this node sees it. ``age_ms``: estimated time since the peer published
    its newest summary, by this node's clock. ``rtt_ms``: last exchange round trip (None
    until measured)."""

    node_id: NodeId
    name: str
    api: str
    mesh: str
    liveness: Liveness
    state: PublishedState
    age_ms: int
    protocol: int
    version: str
    generation: int
    boot: str
    seq: int
    models: tuple[ModelCapacity, ...]
    rtt_ms: float | None
    certificate_not_after: dt.datetime | None
    gpus: tuple[GpuCapacity, ...] = ()
    conflict: IdentityConflict | None = None  # while liveness is ``conflict``
    # Protocol 4's ``ext`` (mesh/extensions.py): typed values through ``extensions.get(SPEC)``.
    extensions: Extensions = EMPTY_EXTENSIONS


@dataclass(slots=True)
class _Record:
    summary: SignedSummary  # stored without its certificate
    with_cert: SignedSummary  # the same with the verified certificate, for peers that lack it
    cert: CertificateView
    order: Order
    heard_at: float
    received_at: float
    liveness: Liveness = Liveness.ALIVE
    silent: bool = False  # heard_at older than suspect_ms at the last tick
    need_cert: bool = False
    rtt_ms: float | None = None
    boots: BootTracker = field(default_factory=BootTracker)
    conflict: IdentityConflict | None = None


_TRUST_REASONS: dict[type, DropReason] = {
    WrongCa: DropReason.WRONG_CA,
    CertificateExpired: DropReason.EXPIRED_CERTIFICATE,
    CertificateInvalid: DropReason.INVALID_CERTIFICATE,
    NameConflict: DropReason.NAME_CONFLICT,
}


PROTOCOL_MEMORY_MS = 60_000

_ROUTINE = frozenset({DropReason.REPLAY, DropReason.OLD_SEQ, DropReason.STALE, DropReason.RATE_LIMITED})


def _trust_reason(exc: Exception) -> DropReason:
    for cls, reason in _TRUST_REASONS.items():
        if isinstance(exc, cls):
            return reason
    return DropReason.INVALID_CERTIFICATE


class Membership:
    """The mesh table of one node and the decisions about it (see the module doc).

    ``node_id``/``certificate_der``: this node; ``policy``: certificate and signature
    checks; ``clock()``: monotonic milliseconds; ``wall_clock()``: aware UTC datetime (for
    certificate validity only); ``rng``: peer selection and reply order; ``protocol``: the
    newest version this node speaks (the two before it are accepted too).

    Callbacks in ``on_update`` are called with a node id after a newer summary of it was
    accepted, and ``on_liveness`` with (node id, old, new) on liveness transitions; both are
    called synchronously and must not block or raise. Callbacks in ``on_silent`` are called
    with a node id when, at a :meth:`tick`, nothing newer of it was heard for
    ``suspect_after_ms`` (see :meth:`silent`); once per silence, whatever its liveness.
    Callbacks in ``on_identity_conflict`` are called once per other boot found publishing
    this node's id at once (:attr:`identity_conflict`, :mod:`viiwork.mesh.clones`), under the
    same rules.
    """

    def __init__(self, node_id: NodeId, mesh_id: str, certificate_der: bytes, policy: TrustPolicy,
                 settings: GossipSettings, clock: Callable[[], float], wall_clock: Callable[[], dt.datetime],
                 rng: random.Random, protocol: int = PROTOCOL_VERSION):
        if protocol not in IMPLEMENTED_PROTOCOLS:
            raise ValueError(f"protocol {protocol} not implemented")
        self.node_id = node_id
        self.mesh_id = mesh_id
        self.certificate_der = certificate_der
        self.policy = policy
        self.settings = settings
        self.clock = clock
        self.wall_clock = wall_clock
        self.rng = rng
        self.protocol = protocol
        self.accepted: tuple[int, ...] = tuple(v for v in IMPLEMENTED_PROTOCOLS if protocol - 2 <= v <= protocol)
        self.records: dict[NodeId, _Record] = {}
        # What a digest says: node id -> (generation, seq), (0, 0) where a certificate is needed.
        # Kept in step with ``records`` and ``self_summary`` so a digest is one dict copy.
        self.orders: Entries = {}
        self._self_with_cert: SignedSummary | None = None
        self.candidates: dict[str, Candidate] = {}
        # Backoff jitter and the order of a round's candidate dials: a generator of its own,
        # so that they leave the draws of ``rng`` (peer selection, the simulator) as they were.
        self._dial_rng = random.Random(str(node_id))
        # address -> (version it answered in, when): learned from an empty reply in an older
        # version; forgotten after PROTOCOL_MEMORY_MS so an address upgraded in place is retried.
        self.peer_protocols: dict[str, tuple[int, float]] = {}
        self.counters = MeshCounters()
        self.self_summary: SignedSummary | None = None
        self.self_published_at = 0.0
        self.required_generation = 0
        self.suspect_ms, self.dead_ms = float(settings.suspect_after_ms), float(settings.dead_after_ms)
        self.rounds = 0
        self.on_update: list[Callable[[NodeId], None]] = []
        self.on_liveness: list[Callable[[NodeId, Liveness, Liveness], None]] = []
        self.on_silent: list[Callable[[NodeId], None]] = []
        # This node's boots and the other boots seen publishing its id (mesh/clones.py).
        self.self_boots = BootTracker()
        self.identity_conflict: IdentityConflict | None = None
        self.on_identity_conflict: list[Callable[[IdentityConflict], None]] = []
        self._conflicts_reported: set[str] = set()
        rate = settings.peer_rate_per_s or max(40.0, 20 * 1000.0 / settings.gossip_interval_ms)
        burst = settings.peer_burst or int(2 * rate)
        self._limiter = PeerRateLimiter(rate, burst, max_buckets=2 * settings.max_peers)
        self._warned: set[str] = set()
        # Probe mode (mesh/probing.py): liveness comes from the failure detector, not from the
        # age of the newest summary (change-only publishing leaves a live peer's summary old).
        self.liveness_hook: Callable[[NodeId], Liveness] | None = None
        # Probe mode's newest load record per peer (mesh/load_record.py), kept only while it
        # is newer than the summary held; :meth:`peers` shows its load. Written by ProbeNode.
        self.loads: dict[NodeId, LoadRecord] = {}

    # --- this node ----------------------------------------------------------------------------

    def publish(self, summary: SignedSummary) -> None:
        """Install this node's newest summary (made by :class:`~viiwork.mesh.publisher.LocalPublisher`)."""
        if summary.payload.node_id != self.node_id:
            raise ValueError("publish() takes this node's own summary")
        self.self_summary = summary.without_certificate()
        self._self_with_cert = SignedSummary(summary.payload, summary.payload_bytes, summary.signature,
                                             self.certificate_der)
        self.orders[self.node_id] = summary.payload.order
        self.self_published_at = self.clock()
        self.counters.summaries_published += 1
        p = summary.payload
        self.self_boots.see(p.boot, p.mesh, p.order, self.self_published_at)

    def emit_protocol(self) -> int:
        """The version to publish in: the newest one every live peer speaks (by the
        ``speaks`` of its summary), never below the oldest version it accepts."""
        low = self.protocol
        for rec in self.records.values():
            if rec.liveness in (Liveness.ALIVE, Liveness.SUSPECT):
                low = min(low, rec.summary.payload.speaks)
        return max(low, self.accepted[0])

    # --- liveness -----------------------------------------------------------------------------

    def _liveness_of(self, rec: _Record, now: float) -> Liveness:
        state = rec.summary.payload.state
        if state is PublishedState.LEAVING:
            return Liveness.LEFT
        if self.liveness_hook is not None:
            return self.liveness_hook(rec.summary.payload.node_id)
        age = now - rec.heard_at
        dead_ms = self.dead_ms
        if state is PublishedState.RESTARTING:  # back soon: not a tombstone for the grace period
            dead_ms = max(dead_ms, float(self.settings.restart_grace_ms))
        if age >= dead_ms:
            return Liveness.DEAD
        if age >= self.suspect_ms:
            return Liveness.SUSPECT
        return Liveness.ALIVE

    def tick(self) -> None:
        """Update liveness (firing ``on_liveness`` on transitions) and reap old tombstones."""
        now = self.clock()
        reap = []
        live = 1 + sum(1 for rec in self.records.values() if rec.liveness in (Liveness.ALIVE, Liveness.SUSPECT))
        self.suspect_ms, self.dead_ms = self.settings.timeouts_for(live)
        for node_id, rec in self.records.items():
            new = self._liveness_of(rec, now)
            if new is not rec.liveness:
                self._transition(node_id, rec, new)
            silent = self._silent(rec, new, now)
            was_silent, rec.silent = rec.silent, silent
            if silent and not was_silent:
                for cb in self.on_silent:
                    cb(node_id)
            if rec.conflict is not None:
                self._check_peer_identity(node_id, rec, now)
            if new in (Liveness.DEAD, Liveness.LEFT) and now - rec.heard_at > self.settings.tombstone_ttl_ms:
                reap.append(node_id)
        for node_id in reap:
            del self.records[node_id]
            self.orders.pop(node_id, None)
            self.loads.pop(node_id, None)
        if self.identity_conflict is not None or len(self.self_boots.boots) > 1:
            self._check_identity(now)

    # --- one node per identity (mesh/clones.py) -----------------------------------------------

    def _check_identity(self, now: float) -> None:
        """Is another boot publishing this node's id at once? Report each such boot once."""
        own = self.self_summary
        if own is None:
            return
        found = self.self_boots.conflict(self.node_id, now, self.dead_ms, of=own.payload.boot,
                                         min_overlap_ms=self.suspect_ms)
        if found is not None and found.leaves == own.payload.boot and found.overlap_ms < self.dead_ms:
            # The boot that leaves waits for dead_after_ms of overlap; the one that stays (and
            # peers) report it from suspect_after_ms, so it has said so before the other goes.
            found = None
        self.identity_conflict = found
        if found is None or found.boot in self._conflicts_reported or len(self._conflicts_reported) >= 64:
            return
        self._conflicts_reported.add(found.boot)
        self.counters.transport["identity_conflicts"] += 1
        log.error("mesh: this node's id %s is also published by another running agent at %s (boot %s; this "
                  "boot %s) for %.1f s: two machines run from one state dir; the one with the higher boot "
                  "(%s) stops (docs/mesh.md, \"One node per identity\")", self.node_id, found.address or "?",
                  found.boot, found.other_boot, found.overlap_ms / 1000.0, found.leaves,
                  extra={"other_address": found.address, "other_boot": found.boot})
        for cb in self.on_identity_conflict:
            cb(found)

    def _check_peer_identity(self, node_id: NodeId, rec: _Record, now: float) -> None:
        found = rec.boots.conflict(node_id, now, self.dead_ms, min_overlap_ms=self.suspect_ms)
        if found is not None and rec.conflict is None:
            self.counters.transport["peer_identity_conflicts"] += 1
            log.warning("mesh: peer %s (%s) is published by two running agents at once, at %s and %s: not "
                        "routed to while it lasts (docs/mesh.md, \"One node per identity\")",
                        rec.summary.payload.name, node_id, found.address or "?", found.other_address or "?")
        elif found is None and rec.conflict is not None:
            log.info("mesh: peer %s (%s) is published by one agent again", rec.summary.payload.name, node_id)
        rec.conflict = found

    def _transition(self, node_id: NodeId, rec: _Record, new: Liveness) -> None:
        old, rec.liveness = rec.liveness, new
        log.info("peer %s (%s) %s -> %s", rec.summary.payload.name, node_id, old.value, new.value)
        for cb in self.on_liveness:
            cb(node_id, old, new)

    def liveness(self, node_id: NodeId) -> Liveness | None:
        rec = self.records.get(node_id)
        return None if rec is None else self._liveness_of(rec, self.clock())

    def silent(self, node_id: NodeId) -> bool:
        """True when nothing newer of ``node_id`` was heard for ``suspect_after_ms`` (by
        this node's clock, for the current fleet size), or the node is not known: whatever
        state it publishes, it is not answering. A node that drains, leaves or restarts
        still publishes until it stops (module doc, "Silence")."""
        rec = self.records.get(node_id)
        if rec is None:
            return True
        now = self.clock()
        return self._silent(rec, self._liveness_of(rec, now), now)

    def _silent(self, rec: _Record, liveness: Liveness, now: float) -> bool:
        if self.liveness_hook is not None:  # probe mode: silence is the detector's suspicion,
            # whatever the peer publishes (a leaving peer is probed until it has gone)
            return self.liveness_hook(rec.summary.payload.node_id) in (Liveness.SUSPECT, Liveness.DEAD)
        return now - rec.heard_at >= self.suspect_ms

    # --- accepting summaries ------------------------------------------------------------------

    def _admit(self, sender: str | None, kind: str) -> bool:
        self.counters.messages_in[kind] += 1
        if sender is not None and not self._limiter.allow(sender, self.clock()):
            self._drop(DropReason.RATE_LIMITED, sender)
            return False
        return True

    def _drop(self, reason: DropReason, about: str | None = None, detail: str = "") -> None:
        self.counters.drop(reason)
        key = f"{reason.value}:{about}"
        # Replays, old and stale copies and rate limits are routine in gossip (concurrent
        # exchanges carry the same news): DEBUG. Anything else is a fault that can repeat per
        # message: WARNING once per (reason, peer), then DEBUG.
        if reason not in _ROUTINE and key not in self._warned and len(self._warned) < 10_000:
            self._warned.add(key)
            log.warning("mesh: dropped (%s) from/about %s %s", reason.value, about or "?", detail)
        else:
            log.debug("mesh: dropped (%s) from/about %s %s", reason.value, about or "?", detail)

    def _evict_tombstone(self) -> bool:
        now = self.clock()
        victims = [(rec.heard_at, nid) for nid, rec in self.records.items()
                   if self._liveness_of(rec, now) in (Liveness.DEAD, Liveness.LEFT)]
        if not victims:
            return False
        victim = min(victims)[1]
        del self.records[victim]
        self.orders.pop(victim, None)
        self.loads.pop(victim, None)
        return True

    def accept(self, item: RelayedSummary, now: float | None = None, wall: dt.datetime | None = None) -> bool:
        """Consider one relayed summary; True when accepted (the table changed). ``now`` and
        ``wall`` default to the clocks (a caller handling a batch reads them once)."""
        s = item.summary
        p = s.payload
        order = (p.generation, p.seq)
        if p.mesh_id != self.mesh_id:
            self._drop(DropReason.WRONG_MESH, p.node_id)
            return False
        if p.protocol not in self.accepted:
            self._drop(DropReason.UNSUPPORTED_PROTOCOL, p.node_id)
            return False
        if p.node_id == self.node_id:
            self._own_echo(s, item.age_ms)
            return False
        age = min(max(item.age_ms, 0), MAX_AGE_MS)
        rec = self.records.get(p.node_id)
        cert_refresh = False
        if rec is not None:
            if order < rec.order:
                self._drop(DropReason.OLD_SEQ, p.node_id)
                return False
            if order == rec.order:
                if not (rec.need_cert and s.certificate is not None):
                    self._drop(DropReason.REPLAY, p.node_id)
                    return False
                cert_refresh = True
        else:
            # Probe mode publishes on change only: an old summary of a live node is current.
            if age >= self.dead_ms and self.liveness_hook is None:
                self._drop(DropReason.STALE, p.node_id)
                return False
            if len(self.records) >= self.settings.max_peers and not self._evict_tombstone():
                self._drop(DropReason.TOO_MANY_PEERS, p.node_id)
                return False
        if now is None:
            now = self.clock()
        if wall is None:
            wall = self.wall_clock()
        if s.certificate is not None:
            try:
                cert = self.policy.verify_certificate(s.certificate, wall)
            except (TrustError, NameConflict) as exc:
                self._drop(_trust_reason(exc), p.node_id, str(exc))
                return False
        elif rec is not None:
            cert = rec.cert
            try:
                self.policy.verify_certificate(cert.der, wall)
            except (TrustError, NameConflict) as exc:
                rec.need_cert = True
                self.orders[p.node_id] = (0, 0)
                self._drop(_trust_reason(exc), p.node_id, str(exc))
                return False
        else:
            self._drop(DropReason.UNKNOWN_SIGNER, p.node_id)
            return False
        if cert.node_id != p.node_id:
            self._drop(DropReason.IDENTITY_MISMATCH, p.node_id, f"certificate is {cert.node_id}'s")
            return False
        if not self.policy.verify_signature(cert, signing_input(s.payload_bytes), s.signature):
            self._drop(DropReason.BAD_SIGNATURE, p.node_id)
            return False
        heard = now - age
        if s.certificate is None:
            stored, with_cert = s, SignedSummary(p, s.payload_bytes, s.signature, cert.der)
        else:
            stored, with_cert = s.without_certificate(), s
        if rec is None:
            rec = _Record(summary=stored, with_cert=with_cert, cert=cert, order=order, heard_at=heard, received_at=now)
            rec.liveness = self._liveness_of(rec, now)
            self.records[p.node_id] = rec
            log.info("peer %s (%s) joined the table: %s", p.name, p.node_id, rec.liveness.value)
        else:
            rec.summary, rec.with_cert, rec.cert, rec.order = stored, with_cert, cert, order
            rec.need_cert = False
            rec.heard_at = max(rec.heard_at, heard)
            rec.received_at = now
            if rec.liveness is not Liveness.ALIVE and self._liveness_of(rec, now) is Liveness.ALIVE:
                self._transition(p.node_id, rec, Liveness.ALIVE)
        rec.boots.see(p.boot, p.mesh, order, heard, now)  # the span starts at receive time (mesh/clones.py)
        if len(rec.boots.boots) > 1:
            self._check_peer_identity(p.node_id, rec, now)
        self.orders[p.node_id] = order
        held = self.loads.get(p.node_id)
        if held is not None and held.order <= order:
            del self.loads[p.node_id]  # the summary is newer: it holds the load now
        if cert_refresh:
            return True
        self.counters.summaries_accepted += 1
        if p.extensions.ignored:  # kept and relayed unchanged, not understood here (docs/mesh.md, "Extensions")
            self.counters.transport["extensions_ignored"] += len(p.extensions.ignored)
        for cb in self.on_update:
            cb(p.node_id)
        return True

    def _own_echo(self, s: SignedSummary, age_ms: int = 0) -> None:
        own = self.self_summary
        if own is None:
            return
        if s.payload.order < own.payload.order or (s.payload.order == own.payload.order
                                                   and s.payload_bytes == own.payload_bytes):
            return  # our own summary coming back: nothing to do
        try:
            cert = self.policy.verify_certificate(self.certificate_der, self.wall_clock())
        except (TrustError, NameConflict):
            return
        if not self.policy.verify_signature(cert, signing_input(s.payload_bytes), s.signature):
            self._drop(DropReason.BAD_SIGNATURE, self.node_id, "a forged summary of this node")
            return
        if s.payload.boot != own.payload.boot:
            # Another boot of ours that outranks this one: a previous run (published before
            # this one began) or a clone (keeps publishing): mesh/clones.py tells them apart.
            now = self.clock()
            self.self_boots.see(s.payload.boot, s.payload.mesh, s.payload.order,
                                now - min(max(age_ms, 0), MAX_AGE_MS), now)
            self._check_identity(now)
        # A genuine summary of ours at least as new as the current one: our previous run
        # (the generation file was lost), or a clone. Outrank it at the next publication.
        if s.payload.generation + 1 > self.required_generation:
            level = logging.DEBUG if self._conflicts_reported else logging.WARNING
            log.log(level, "mesh: peers hold a summary of this node at generation %d seq %d (previous run); "
                        "moving to generation %d", s.payload.generation, s.payload.seq, s.payload.generation + 1)
            self.required_generation = s.payload.generation + 1

    # --- exchanges ----------------------------------------------------------------------------

    def make_digest(self, target: GossipTarget | None = None) -> Digest:
        """The digest to open an exchange with ``target`` (in the version it speaks)."""
        protocol = self.protocol if target is None else target.protocol
        self.counters.messages_out["digest"] += 1
        return Digest(protocol, self.mesh_id, dict(self.orders))

    def _outgoing(self, nid: NodeId, with_cert: bool, protocol: int, now: float) -> tuple[RelayedSummary, int] | None:
        """The relayed form of what we hold of ``nid`` and its size, or None when it must not
        be sent (unknown, dead, or in a newer version than the message)."""
        if nid == self.node_id:
            summary = self._self_with_cert if with_cert else self.self_summary
            if summary is None:
                return None
            heard_at = self.self_published_at
        else:
            rec = self.records.get(nid)
            # Never spread a dead node's last summary: receivers that never knew the node
            # have no use for it, and it would look fresh to nobody.
            if rec is None or rec.need_cert or rec.liveness is Liveness.DEAD:
                return None
            summary = rec.with_cert if with_cert else rec.summary
            heard_at = rec.heard_at
        if summary.payload.protocol > protocol:
            return None
        item = RelayedSummary(summary, int(min(max(now - heard_at, 0), MAX_AGE_MS)))
        return item, summary.wire_size() + 14

    def _fill(self, wanted: list[tuple[NodeId, bool]], protocol: int,
              max_bytes: int | None = None) -> tuple[RelayedSummary, ...]:
        """Relayed summaries for ``wanted`` (node id, with certificate) within the message
        budget (``max_bytes``, default ``max_message_bytes``); when they do not all fit, this
        node's own first, then a random subset (the rest goes in later rounds)."""
        now = self.clock()
        out = [o for nid, wc in wanted if (o := self._outgoing(nid, wc, protocol, now)) is not None]
        budget = min(self.settings.max_message_bytes, max_bytes or self.settings.max_message_bytes) - 1024
        if sum(size for _, size in out) > budget:
            own = [o for o in out if o[0].summary.payload.node_id == self.node_id]
            rest = [o for o in out if o[0].summary.payload.node_id != self.node_id]
            self.rng.shuffle(rest)
            kept = []
            for item, size in own + rest:
                if size <= budget:
                    budget -= size
                    kept.append((item, size))
            out = kept
        return tuple(item for item, _ in out)

    def relay(self, wants: Entries, protocol: int, max_bytes: int | None = None) -> tuple[RelayedSummary, ...]:
        """The summaries this node holds newer than ``wants`` (node id -> the version the
        asker holds, (0, 0) when it lacks the node: sent with the certificate), in
        ``protocol``, within ``max_bytes`` (default ``max_message_bytes``; probe mode's
        channel frames are smaller): probe mode's pull (mesh/probing.py)."""
        mine = self.orders
        send = [(nid, t[0] == 0) for nid, t in wants.items() if (m := mine.get(nid)) is not None and m > t]
        return self._fill(send, protocol, max_bytes)

    def handle_digest(self, sender: str | None, digest: Digest) -> Reply | None:
        """Answer a peer's digest: the summaries it lacks and the entries we want. None when
        the message is dropped (counted)."""
        if not self._admit(sender, "digest"):
            return None
        if digest.mesh_id != self.mesh_id:
            self._drop(DropReason.WRONG_MESH, sender)
            return None
        if digest.protocol not in self.accepted:
            self._drop(DropReason.UNSUPPORTED_PROTOCOL, sender)
            return self._empty_reply()
        theirs, mine = digest.entries, self.orders
        send: list[tuple[NodeId, bool]] = []
        for nid, order in mine.items():
            t = theirs.get(nid)
            if t is None or t[0] == 0:
                send.append((nid, True))
            elif t < order:
                send.append((nid, False))
        wants: Entries = {}
        room = self.settings.max_peers - len(self.records)
        for nid, t in theirs.items():
            if t[0] == 0:
                continue
            m = mine.get(nid)
            if m is None:
                if room > 0 and nid != self.node_id:
                    room -= 1
                    wants[nid] = (0, 0)
            elif t > m:
                wants[nid] = m
        self.counters.messages_out["reply"] += 1
        return Reply(digest.protocol, self.mesh_id, self._fill(send, digest.protocol), wants)

    def _empty_reply(self) -> Reply:
        self.counters.messages_out["reply"] += 1
        return Reply(self.protocol, self.mesh_id, (), {})

    def handle_reply(self, sender: str | None, reply: Reply, target: GossipTarget | None = None) -> Push | None:
        """Take a peer's reply to our digest: accept its summaries and return the push of what
        it wants (None when it wants nothing or the reply is dropped)."""
        self.counters.messages_in["reply"] += 1
        if reply.mesh_id != self.mesh_id:
            self._drop(DropReason.WRONG_MESH, sender)
            return None
        if reply.protocol not in self.accepted:
            self._drop(DropReason.UNSUPPORTED_PROTOCOL, sender)
            return None
        if target is not None and reply.protocol < target.protocol:
            self.peer_protocols[target.address] = (reply.protocol, self.clock())
        for reason in reply.rejected:
            self._drop(DropReason(reason), sender)
        now, wall = self.clock(), self.wall_clock()
        for item in reply.summaries:
            self.accept(item, now, wall)
        cand = None if target is None else self.candidates.get(target.address)
        if cand is not None:
            if cand.node_id is None and sender is not None:
                cand.node_id = NodeId(sender)
            cand.answered(now)  # an answer resets the address's backoff
        if not reply.wants:
            return None
        mine = self.orders
        send = [(nid, t[0] == 0) for nid, t in reply.wants.items() if (m := mine.get(nid)) is not None and m > t]
        summaries = self._fill(send, reply.protocol)
        if not summaries:
            return None
        self.counters.messages_out["push"] += 1
        return Push(reply.protocol, self.mesh_id, summaries)

    def handle_push(self, sender: str | None, push: Push) -> None:
        """Take the summaries a peer pushed after our reply."""
        if not self._admit(sender, "push"):
            return
        if push.mesh_id != self.mesh_id:
            self._drop(DropReason.WRONG_MESH, sender)
            return
        if push.protocol not in self.accepted:
            self._drop(DropReason.UNSUPPORTED_PROTOCOL, sender)
            return
        for reason in push.rejected:
            self._drop(DropReason(reason), sender)
        now, wall = self.clock(), self.wall_clock()
        for item in push.summaries:
            self.accept(item, now, wall)

    # --- the same over bytes (what the transport uses) ----------------------------------------

    def _decode(self, sender: str | None, data: bytes, kind: str) -> Any:
        self.counters.bytes_in += len(data)
        try:
            return decode_message(data, self.accepted, kind, self.settings.max_message_bytes)
        except UnsupportedProtocol:
            self.counters.messages_in[kind] += 1
            self._drop(DropReason.UNSUPPORTED_PROTOCOL, sender)
            return UnsupportedProtocol
        except SummaryError as exc:
            self.counters.messages_in[kind] += 1
            self._drop(DropReason(exc.reason), sender, str(exc))
            return None

    def _encode(self, msg: Any) -> bytes:
        data = encode_message(msg)
        self.counters.bytes_out += len(data)
        return data

    def digest_bytes(self, target: GossipTarget | None = None) -> bytes:
        return self._encode(self.make_digest(target))

    def on_digest_bytes(self, sender: str | None, data: bytes) -> bytes | None:
        """A digest arrived: the reply's bytes, or None when dropped (answer 400)."""
        msg = self._decode(sender, data, "digest")
        if msg is UnsupportedProtocol:
            return self._encode(self._empty_reply())
        if msg is None:
            return None
        reply = self.handle_digest(sender, msg)
        return None if reply is None else self._encode(reply)

    def on_reply_bytes(self, sender: str | None, data: bytes, target: GossipTarget | None = None) -> bytes | None:
        """Our digest's reply arrived: the push's bytes, or None when there is nothing to push."""
        msg = self._decode(sender, data, "reply")
        if msg is None or msg is UnsupportedProtocol:
            return None
        push = self.handle_reply(sender, msg, target)
        return None if push is None else self._encode(push)

    def on_push_bytes(self, sender: str | None, data: bytes) -> bool:
        """A push arrived; False when the message was dropped."""
        msg = self._decode(sender, data, "push")
        if msg is None or msg is UnsupportedProtocol:
            return False
        self.handle_push(sender, msg)
        return True

    # --- peer selection -----------------------------------------------------------------------

    def add_candidate(self, address: str, node_id: NodeId | None = None, source: str = "seed") -> None:
        """Remember a mesh address found by discovery (``source`` "seed" or "mdns"). An
        address already known keeps its dial history; an mDNS announcement of it (the node
        there just said it is up) makes it due at once."""
        if node_id == self.node_id:
            return
        cand = self.candidates.get(address)
        if cand is None:
            if len(self.candidates) >= self.settings.max_peers:
                return
            self.candidates[address] = Candidate(node_id=node_id, source=source)
            return
        if node_id is not None:
            cand.node_id = node_id
        cand.source = source
        if source == "mdns":
            cand.failures, cand.next_try_at = 0, -math.inf

    def remove_candidate(self, address: str) -> None:
        self.candidates.pop(address, None)

    def _target_protocol(self, address: str, rec: _Record | None) -> int:
        if rec is not None:
            return max(min(self.protocol, rec.summary.payload.speaks), self.accepted[0])
        learned = self.peer_protocols.get(address)
        if learned is not None and self.clock() - learned[1] < PROTOCOL_MEMORY_MS:
            return learned[0]
        return self.protocol

    def select_targets(self, dialing: Collection[str] = ()) -> list[GossipTarget]:
        """This round's gossip partners (see the module doc). ``dialing``: candidate
        addresses whose dial is still in flight (not dialed again meanwhile). Candidate
        targets (``candidate`` True) come last; while no peer is alive they are every due
        candidate, in random order: the caller bounds how many it dials at once."""
        self.tick()
        self.rounds += 1
        fanout = self.settings.fanout
        live, dead, live_addresses = [], [], set()
        for nid, rec in self.records.items():
            if rec.liveness in (Liveness.ALIVE, Liveness.SUSPECT):
                live.append(nid)
                live_addresses.add(rec.summary.payload.mesh)
            elif rec.liveness is Liveness.DEAD:
                dead.append(nid)
        chosen = self.rng.sample(live, min(fanout, len(live)))
        targets = [self._target_of(nid) for nid in chosen]
        now = self.clock()
        live_ids = set(live)
        cands = [addr for addr, c in self.candidates.items()
                 if addr not in live_addresses and not (c.node_id is not None and c.node_id in live_ids)
                 and addr not in dialing and c.due(now)]
        if cands:
            picked: list[str] = []
            if not live:  # nobody to learn the mesh from: try every address that is due
                picked = cands
                self._dial_rng.shuffle(picked)
            elif len(targets) < fanout:
                picked = self.rng.sample(cands, min(fanout - len(targets), len(cands)))
            elif self.rounds % self.settings.reseed_every_rounds == 0:
                picked = [self.rng.choice(cands)]
            targets += [self._dial_candidate(addr, now) for addr in picked]
        if dead and self.rng.random() < self.settings.probe_dead_per_round:
            targets.append(self._target_of(self.rng.choice(dead)))
        return targets

    def _dial_candidate(self, address: str, now: float) -> GossipTarget:
        cand = self.candidates[address]
        s = self.settings
        cand.dialed(now, backoff_ms(cand.failures + 1, s.seed_backoff_min_ms, s.seed_backoff_max_ms, self._dial_rng))
        return GossipTarget(address, cand.node_id, self._target_protocol(address, None), candidate=True)

    def note_dial(self, address: str, error: str | None) -> None:
        """How the dial of a candidate target ended (the transport): ``error`` None when
        the exchange completed, else what it met ("connection refused", "timed out", ...).
        A failure restarts the address's backoff from now; an answer already reset it
        (:meth:`handle_reply`), and a completed exchange whose reply was dropped counts as
        a failure."""
        cand = self.candidates.get(address)
        if cand is None:
            return
        if error is None:
            if cand.answered_last_dial():
                return
            error = DROPPED_REPLY
        s = self.settings
        cand.failed(self.clock(), error,
                    backoff_ms(cand.failures, s.seed_backoff_min_ms, s.seed_backoff_max_ms, self._dial_rng))

    def candidate_views(self, source: str | None = None) -> list[CandidateView]:
        """The discovered addresses (those of ``source`` only, when given) with their dial
        history, in the order they were added."""
        now = self.clock()
        return [c.view(addr, now) for addr, c in self.candidates.items() if source is None or c.source == source]

    def _target_of(self, nid: NodeId) -> GossipTarget:
        rec = self.records[nid]
        address = rec.summary.payload.mesh
        return GossipTarget(address, nid, self._target_protocol(address, rec))

    def target_of(self, node_id: NodeId) -> GossipTarget:
        """The exchange target of a node in the table (KeyError when unknown): probe mode
        runs exchanges with heartbeat-mode peers itself (:mod:`viiwork.mesh.probing`)."""
        return self._target_of(node_id)

    def note_rtt(self, node_id: str, rtt_ms: float) -> None:
        """Record an exchange's round trip time (transport)."""
        rec = self.records.get(NodeId(node_id))
        if rec is not None:
            rec.rtt_ms = rtt_ms if rec.rtt_ms is None else 0.7 * rec.rtt_ms + 0.3 * rtt_ms

    # --- views --------------------------------------------------------------------------------

    def peers(self) -> list[PeerView]:
        """Every node in the table (not this node), with liveness and age by this node's clock."""
        now = self.clock()
        return [self._view(nid, rec, now) for nid, rec in self.records.items()]

    def peer(self, node_id: NodeId) -> PeerView | None:
        """One node of the table as :meth:`peers` shows it (None: not in the table)."""
        rec = self.records.get(node_id)
        return None if rec is None else self._view(node_id, rec, self.clock())

    def _view(self, nid: NodeId, rec: _Record, now: float) -> PeerView:
        p = rec.summary.payload
        models, seq = p.models, p.seq
        load = self.loads.get(nid)
        if load is not None and load.order > rec.order and load.base == rec.order:
            models, seq = apply_load(models, load), load.seq  # the newer of summary and record
        return PeerView(
            node_id=nid, name=p.name, api=p.api, mesh=p.mesh, liveness=self._view_liveness(rec, now),
            state=p.state, age_ms=int(max(0.0, now - rec.heard_at)), protocol=p.protocol, version=p.version,
            generation=p.generation, boot=p.boot, seq=seq, models=models, rtt_ms=rec.rtt_ms,
            certificate_not_after=getattr(rec.cert, "not_after", None), gpus=p.gpus, conflict=rec.conflict,
            extensions=p.extensions,
        )

    def _view_liveness(self, rec: _Record, now: float) -> Liveness:
        liveness = self._liveness_of(rec, now)
        if rec.conflict is not None and liveness in (Liveness.ALIVE, Liveness.SUSPECT):
            return Liveness.CONFLICT
        return liveness

    def model_conflicts(self) -> dict[str, dict[NodeId, str]]:
        """Models served under one name with different fingerprints by this node and its live
        peers: ``{model: {node_id: fingerprint}}`` (unknown fingerprints are not conflicts)."""
        seen: dict[str, dict[NodeId, str]] = {}
        now = self.clock()
        sources: list[tuple[NodeId, SignedSummary]] = []
        if self.self_summary is not None:
            sources.append((self.node_id, self.self_summary))
        sources += [(nid, rec.summary) for nid, rec in self.records.items()
                    if self._liveness_of(rec, now) in (Liveness.ALIVE, Liveness.SUSPECT)]
        for nid, summary in sources:
            for m in summary.payload.models:
                if m.fingerprint is not None:
                    seen.setdefault(m.name, {})[nid] = m.fingerprint
        return {name: fps for name, fps in seen.items() if len(set(fps.values())) > 1}


__all__ = ["GossipSettings", "GossipTarget", "Liveness", "Membership", "PeerView"]
