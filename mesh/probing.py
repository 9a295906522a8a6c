"""Probe mode: SWIM failure detection and change-only dissemination over a Membership (sans-IO).

Issue 16, items 1-3 and 6, in one composition that the simulator drives today and the
transport can drive next (docs/mesh.md, "Probe mode"). A :class:`ProbeNode` wraps one node's
:class:`~viiwork.mesh.membership.Membership` (the table, verification, the digest-first
exchange) and its :class:`~viiwork.mesh.publisher.LocalPublisher`, and adds:

- **Probing** (:class:`~viiwork.mesh.detector.Detector`): each probe interval one member is
  pinged (``Ping`` -> ``Ack``, tried ``direct_attempts`` times); on a miss ``PingReq`` asks
  ``indirect_checks`` relays, which ping the target and answer ``Ack`` or ``Nack``. No ack:
  this node suspects the target and broadcasts a :class:`~viiwork.mesh.messages.Claim` signed
  with its node key. The member table's liveness is the detector's (``alive``, ``suspect``,
  ``dead``; a published ``leaving`` is ``left``), not the age of the newest summary.
- **Change-only dissemination** (:class:`~viiwork.mesh.broadcasts.BroadcastQueue`): a node
  that accepts a newer summary (or publishes its own) queues a ``News`` item ``(node id,
  generation, seq)``; claims are queued likewise. Every outgoing probe message carries queued
  items within ``piggyback_bytes``, and while any are queued a ``Gossip`` message goes to
  ``gossip_nodes`` random alive members every ``gossip_interval_ms`` (within ``gossip_bytes``); each item is sent
  ``retransmit_mult * ceil(log10(n + 1))`` times by each node that queued it. A receiver
  that holds an older version (or none) asks the sender with one ``Pull`` and gets a
  ``Push`` (the sender holds what it announced): the ~450-byte summary travels to each node
  about once, the ~19-byte news (packed: viiwork.mesh.probe_codec) a few times. Verification stays once per new ``(node,
  generation, seq)``: Membership drops a replay before verifying (a claim is verified once per
  distinct claim, kept in a bounded seen-set).
- **Publication on change** (:mod:`viiwork.mesh.quantise`): the true load goes through the
  :class:`LoadQuantiser`; a structural change is published at once, a load change when the
  :class:`PublishLimiter` allows; besides that only a refutation (a claim suspects this node)
  or the ``republish_ms`` timer re-signs the summary.
- **Load records** (:mod:`viiwork.mesh.load_record`): a load-only change goes out as a
  ~135-byte signed record at the summary's next ``seq`` rather than a new ~500-byte summary
  (while no heartbeat-mode member is live: those read summaries only). Its news is the same
  ``News(node id, order)``; a pull names the *summary* version held, and is answered with a
  ``Push`` (the summary, when the asker's is older) and a ``Loads`` message (the newest
  record, when it is newer than that summary). A record is kept when newer than both the
  summary and the record held (checked before its signature: verified once per version)
  and it amends the summary held; one that comes before its summary is parked until the
  summary comes. The table's load of a peer is the newer of the two
  (:meth:`~viiwork.mesh.membership.Membership.peers`).
- **Anti-entropy** at a low rate: one digest exchange with one random live member (and the
  due seed candidates, so joins work from seeds alone) every ``sync_interval_ms``, every
  probe interval while no member is known.
- **Partitions heal**: every ``dead_probe_ms`` (jittered) a node pings one random member it
  holds ``dead``, or ``suspect`` with a claim held, carrying the claim it holds about it. A
  member that was only cut off or frozen learns it is suspected and refutes (a newer
  summary, whose news rides its ack), so it is ``alive`` again within seconds of the network
  healing, not at its next republication (``republish_ms``); a member that is really gone
  costs one refused connection. A suspect too: a node cut off alone suspects the members it
  probes meanwhile, and every transmission of its claims is lost in the cut; no suspect
  heard of them after the heal, and the node held them suspect for the suspicion's full
  timeout (19 s at 40 nodes), then dead, since its next probe of each comes round only
  every ``n`` probe intervals (found by the attacker pass).
- **Heartbeat-mode peers** (a rolling upgrade, docs/mesh.md "Rolling upgrade"): a member the
  transport reports as not speaking probe mode (:meth:`ProbeNode.heartbeat_only`) is judged
  as heartbeat mode judges it (by the age of its newest summary against the membership's
  ``suspect_after_ms`` / ``dead_after_ms``), never probed, and while one is live this node
  heartbeats for it: re-signs its summary every ``heartbeat_ms`` (without news: probe-mode
  peers need no new version) and runs a digest exchange with ``fanout`` of them each round.

One module (about 830 lines, a third of them docstrings) because :class:`ProbeNode` is one
state machine: the probe in flight, the relays served, the pulls in flight, the claims seen,
the load records parked and the broadcast queue are read and written together by every message handler and timer.

Pure: no sockets, timers or asyncio. The caller calls :meth:`ProbeNode.poll` at
:meth:`ProbeNode.next_wakeup` (or sooner) and :meth:`ProbeNode.receive` for each message,
and sends every returned ``(address, message)``; messages are the objects of
:mod:`viiwork.mesh.messages`, or bytes through :meth:`ProbeNode.receive_bytes`
(:mod:`viiwork.mesh.probe_codec`).
Single-threaded. Counters in :attr:`ProbeNode.counters`.
"""

from __future__ import annotations

import random
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from viiwork.mesh.broadcasts import BroadcastQueue
from viiwork.mesh.counters import DropReason
from viiwork.mesh.detector import Alive, Dead, Detector, DetectorSettings, Probe, Refute, Suspected
from viiwork.mesh.extensions import REFUTED
from viiwork.mesh.identity import NodeId
from viiwork.mesh.load_record import LoadRecord, load_problem, load_signing_input
from viiwork.mesh.membership import GossipTarget, Liveness, Membership
from viiwork.mesh.messages import (
    CLAIM_BYTES,
    NEWS_BYTES,
    Ack,
    Claim,
    Digest,
    Entries,
    Gossip,
    Loads,
    Nack,
    News,
    Order,
    Ping,
    PingReq,
    Pull,
    Push,
    RelayedSummary,
    Reply,
    claim_signing_input,
)
from viiwork.mesh.probe_codec import MAX_PROBE_ITEMS, MAX_PROBE_MESSAGE_BYTES, decode_any, encode_any
from viiwork.mesh.publisher import HEARTBEAT_SLACK, LocalPublisher
from viiwork.mesh.quantise import LoadQuantiser, PublishLimiter, compare_models
from viiwork.mesh.ratelimit import PeerRateLimiter
from viiwork.mesh.summary import ModelCapacity, PublishedState, SignedSummary, SummaryError
from viiwork.mesh.trust import NameConflict, TrustError

Outgoing = tuple[str, Any]
"""``(address, message)`` for the caller to send."""

_LIVENESS = {"alive": Liveness.ALIVE, "suspect": Liveness.SUSPECT, "dead": Liveness.DEAD}
_MAX_SEEN_CLAIMS = 10_000
# Signature checks one sender may cause per second (load records and claims it sends): a peer
# that sends forged ones makes this node spend at most this many checks (~110 us each: ~2% of
# a core), while a mesh of 1,000 needs ~100 a second in all, mostly from different senders.
VERIFY_PER_SENDER_PER_S = 200.0
VERIFY_BURST_PER_SENDER = 1000.0
# News about nodes this node does not know, pulled from one message: a join is found by the
# digest exchange, so news seldom names many unknown nodes; a message naming 1,024 made-up ids
# made this node open 1,024 pulls (~17 ms of work each message).
MAX_UNKNOWN_PULLS_PER_MESSAGE = 16


@dataclass(frozen=True)
class ProbeSettings:
    """Timings of probe mode (ms). Raises ValueError on a value out of range.

    - ``detector``: the probe timings (:class:`~viiwork.mesh.detector.DetectorSettings`).
    - ``gossip_interval_ms`` (200) / ``gossip_nodes`` (3): broadcast-only messages while items
      are queued (memberlist's LAN GossipInterval and GossipNodes).
    - ``piggyback_bytes`` (1024): room for items on a ping, ack, ping-req or nack.
    - ``gossip_bytes`` (4096): room for items on a gossip message. At 1,000 nodes a node
      sends ~1,000 news a second (docs/mesh.md, "Probe mode"); 1 kB gossip messages could
      not carry them and the queue's tail set the publication latency.
    - ``retransmit_mult`` (2): see :class:`~viiwork.mesh.broadcasts.BroadcastQueue`.
    - ``min_transmits`` (6): each item is sent at least this often by each node that queued
      it. A node hears an item about as many times as each holder sends it, and misses every
      copy with a chance of about ``e ** -transmits``: with the product's 4 below 100 nodes
      that is 1.8%, and the 50-process run saw 2-4 of 245 observers wait 3-10 s for
      anti-entropy; with 6 it is 0.25% (docs/benchmarks-mesh.md, "Fifty real processes").
    - ``sync_interval_ms`` (5000): one anti-entropy exchange per node.
    - ``republish_ms`` (60000): the summary is re-signed at least this often.
    - ``pull_timeout_ms`` (100) / ``pull_attempts`` (3): a pull not answered by then is sent
      again, to the same address, up to that many times in all (a LAN round trip is ~1 ms).
    - ``digest_every`` (4): one anti-entropy round in this many is a digest exchange (it finds
      nodes this one lacks altogether), and every round while the table grew since the last;
      the others pull every member at the version held (the only repair of a load record
      that every copy of its news missed).
    - ``dead_probe_ms`` (2500): one member held dead (or suspect) is pinged about this often (0.5x-1.5x
      jitter), with the claim about it: how a partition or a long freeze heals. Heartbeat
      mode's ``probe_dead_per_round`` (0.1 per 500 ms round) is every 5 s on average.
    """

    detector: DetectorSettings = field(default_factory=DetectorSettings)
    gossip_interval_ms: float = 200.0
    gossip_nodes: int = 3
    piggyback_bytes: int = 1024
    gossip_bytes: int = 4096
    retransmit_mult: int = 2
    min_transmits: int = 6
    sync_interval_ms: float = 5000.0
    republish_ms: float = 60_000.0
    pull_timeout_ms: float = 100.0
    pull_attempts: int = 3
    digest_every: int = 4
    dead_probe_ms: float = 2500.0

    def __post_init__(self) -> None:
        for name in ("gossip_interval_ms", "sync_interval_ms", "republish_ms", "pull_timeout_ms", "dead_probe_ms"):
            if not getattr(self, name) > 0:
                raise ValueError(f"probe.{name} must be > 0, got {getattr(self, name)!r}")
        for name in ("gossip_nodes", "piggyback_bytes", "gossip_bytes", "retransmit_mult", "min_transmits",
                     "pull_attempts", "digest_every"):
            if getattr(self, name) < 1:
                raise ValueError(f"probe.{name} must be >= 1, got {getattr(self, name)!r}")


@dataclass(slots=True)
class _Run:
    """The probe in flight: direct pings, then (``relays`` set) the indirect phase."""

    probe: Probe
    address: str
    deadline: float
    attempts_left: int
    relays: tuple[NodeId, ...] | None = None
    pinged_at: float = 0.0  # the last direct ping's time: its ack gives the round trip
    acks: int = 0
    nacks: int = 0
    ping_ids: set[int] = field(default_factory=set)
    relay_of: dict[int, NodeId] = field(default_factory=dict)  # ping-req id -> the relay asked
    answered: set[NodeId] = field(default_factory=set)  # relays that acked or nacked


@dataclass(slots=True)
class _Pull:
    """A pull in flight: ``order`` was announced by ``address``."""

    order: Order
    deadline: float
    address: str
    attempts_left: int


@dataclass(slots=True)
class _Relay:
    """A ping-req this node serves: ping ``address`` for ``requester``'s ``request_id``."""

    requester: str
    request_id: int
    address: str
    deadline: float
    attempts_left: int


class ProbeNode:
    """Probe mode for one node: see the module doc. ``membership`` and ``publisher`` are
    this node's; ``rng`` drives the detector's order and the gossip targets."""

    def __init__(self, membership: Membership, publisher: LocalPublisher, settings: ProbeSettings,
                 rng: random.Random) -> None:
        self.m = membership
        self.pub = publisher
        self.settings = settings
        self.rng = rng
        self.detector = Detector(membership.node_id, settings.detector, membership.clock, rng)
        self.queue: BroadcastQueue[Any, News | Claim] = BroadcastQueue(settings.retransmit_mult,
                                                                       min_transmits=settings.min_transmits)
        self.quantiser = LoadQuantiser()
        self.limiter = PublishLimiter()
        self.counters: Counter[str] = Counter()
        """claims_made, claims_verified, claims_accepted, claims_forged (bad signature, also
        the table's ``bad_signature`` drop), claims_unknown_signer, claims_seen (duplicates and
        this node's own, not verified again), pulls_sent, refutations, heartbeat_peers
        (members found to speak heartbeat mode only), heartbeats (summaries re-signed for them),
        relay_acks / relay_nacks (ping-reqs served: the target answered / did not), dead_probes
        (pings of members held dead or suspect: "Partitions heal"), refutations_resent (the news of a
        refutation queued again for a claim it already refutes: :meth:`_refute`)."""
        self._wanted: tuple[ModelCapacity, ...] | None = None
        self._ping_ids = 0
        self._run: _Run | None = None
        self._pings: dict[int, str] = {}  # ping id -> "direct" | "indirect" (ours in flight)
        self._relays: dict[int, _Relay] = {}
        self._pulls: dict[NodeId, _Pull] = {}
        self._seen_claims: set[tuple[NodeId, Order, NodeId, bytes]] = set()
        # Of those, the claims about this node that verified: only their copies are answered.
        self._verified_own: set[tuple[NodeId, Order, NodeId, bytes]] = set()
        self._claims: dict[NodeId, Claim] = {}  # the latest claim held per suspected member
        self._syncs: dict[str, GossipTarget] = {}
        self._members: list[NodeId] = []
        self._heartbeaters: dict[NodeId, str] = {}  # heartbeat-mode member -> the boot that said so
        self._sync_count = 0
        self._synced_members = 0
        self._parked: dict[NodeId, LoadRecord] = {}  # records that came before the summary they amend
        self._verify_budget = PeerRateLimiter(VERIFY_PER_SENDER_PER_S, VERIFY_BURST_PER_SENDER)
        self.on_load: list[Callable[[NodeId, LoadRecord], None]] = []
        """Called with (node id, record) for each load record published here or accepted."""
        self.on_unanswered: list[Callable[[str], None]] = []
        """Called with an address whose ping (a probe's direct attempt, or a relay's) went
        unanswered within its timeout, before the next attempt is sent: the shell drops the
        connection it holds to it, so the next goes on a new one (a connection that lived
        through a partition sits in TCP's retransmission backoff for seconds after the heal,
        and every ping written on it missed: docs/mesh.md, "Partitions heal")."""
        now = membership.clock()
        self._next_gossip = now
        self._next_sync = now
        self._next_heartbeat = now
        self._next_dead_probe = now + settings.dead_probe_ms
        self._refuted_at = -float("inf")
        self._refute_due = False  # a refutation waits for the probe interval's end (_refute)
        self._resent_at = -float("inf")  # news of a refutation last queued again (_refute)
        self._started = now
        membership.liveness_hook = self._liveness
        membership.on_update.append(self._on_update)

    # --- this node's publications ------------------------------------------------------------

    def set_load(self, models: Sequence[ModelCapacity]) -> None:
        """This node's true capacity now; published quantised, when the rules allow (at the
        next :meth:`poll` or :meth:`publish`)."""
        self._wanted = self.quantiser.quantise(sorted(models, key=lambda m: m.name))

    def publish(self, force: bool = False) -> SignedSummary | None:
        """Publish what is due now (``force``: a new summary whatever changed); the new
        summary or None (also when a load record carried the change: module doc)."""
        now = self.m.clock()
        changed = force or self.m.required_generation > self.pub.generation
        if self._wanted is not None:
            change = compare_models(self.pub.models, self._wanted)
            if (change.structural or change.load) and (force or self.limiter.due(
                    now, self._n_live(), change.structural, change.load)):
                record = None
                if not (changed or change.structural or self._heartbeaters):
                    record = self.pub.publish_load(self._wanted)
                if record is not None:
                    self._published_load(record)
                    return None
                self.pub.set_local(self._wanted, self.pub.state)
                changed = True
        if not (changed or now - self.m.self_published_at >= self.settings.republish_ms * HEARTBEAT_SLACK):
            return None  # nothing due (the protocol version to speak is checked by each sync)
        summary = self.pub.maybe_publish(force)
        if summary is not None:
            self._published(summary)
        return summary

    def _published_load(self, record: LoadRecord) -> None:
        self.limiter.published(self.m.clock())
        self.counters["loads_published"] += 1
        self.queue.put(self.m.node_id, News(self.m.node_id, record.order), NEWS_BYTES, record.order)
        for cb in self.on_load:
            cb(self.m.node_id, record)

    def version_of(self, node_id: NodeId) -> Order | None:
        """The newest version held of ``node_id``: its summary's or its load record's
        ``(generation, seq)``, whichever is newer (this node's own included); None when
        unknown."""
        if node_id == self.m.node_id:
            own, load = self.m.self_summary, self.pub.last_load
            held = None if own is None else own.payload.order
        else:
            rec, load = self.m.records.get(node_id), self.m.loads.get(node_id)
            held = None if rec is None else rec.order
        if load is not None and (held is None or load.order > held):
            return load.order
        return held

    def _publish_now(self) -> None:
        summary = self.pub.maybe_publish()
        if summary is not None:
            self._published(summary)

    def _published(self, summary: SignedSummary) -> None:
        self.limiter.published(self.m.clock())
        order = summary.payload.order
        self.detector.set_incarnation(self.m.node_id, order)
        self.queue.put(self.m.node_id, News(self.m.node_id, order), NEWS_BYTES, order)

    def leave(self) -> list[Outgoing]:
        """Publish ``leaving``: returns its push to ``gossip_nodes`` random alive members
        (the node stops soon after, too soon to answer their pulls); the news spreads it."""
        self.pub.set_local(self.pub.models, PublishedState.LEAVING)
        self.publish(force=True)
        own = self.m.self_summary
        if own is None:
            return []
        push = Push(self.m.protocol, self.m.mesh_id, (RelayedSummary(own, 0),))
        return [(self._address(nid), push) for nid in self._gossip_targets()]

    def _n_live(self) -> int:
        return 1 + self.detector.live_count

    # --- the table's view ---------------------------------------------------------------------

    def heartbeat_only(self, node_id: NodeId) -> None:
        """``node_id`` does not speak probe mode (the transport's probe was answered "no
        such endpoint": an agent from before probe mode, or one with ``detector =
        "heartbeat"``): from now on, until it publishes under another boot, it is judged by
        the age of its summaries and heartbeated to (module doc). Unknown nodes are ignored."""
        rec = self.m.records.get(node_id)
        if rec is None or node_id in self._heartbeaters:
            return
        self._heartbeaters[node_id] = rec.summary.payload.boot
        run = self._run
        if run is not None and run.probe.target == node_id:
            self._finish(run)
        self.detector.remove(node_id)
        self._claims.pop(node_id, None)
        self.counters["heartbeat_peers"] += 1
        self._next_heartbeat = self.m.clock()
        self.m.tick()

    @property
    def heartbeat_peers(self) -> frozenset[NodeId]:
        """The members this node heartbeats for (:meth:`heartbeat_only`)."""
        return frozenset(self._heartbeaters)

    def _age_liveness(self, node_id: NodeId) -> Liveness:
        """Heartbeat mode's rule, for a heartbeat-mode member."""
        age = self.m.clock() - self.m.records[node_id].heard_at
        if age >= self.m.dead_ms:
            return Liveness.DEAD
        return Liveness.SUSPECT if age >= self.m.suspect_ms else Liveness.ALIVE

    def _liveness(self, node_id: NodeId) -> Liveness:
        if node_id in self._heartbeaters:
            return self._age_liveness(node_id)
        state = self.detector.state(node_id)
        return Liveness.ALIVE if state is None else _LIVENESS[state]

    def _on_update(self, node_id: NodeId) -> None:
        rec = self.m.records[node_id]
        order = rec.order
        pending = self._pulls.get(node_id)
        if pending is not None and pending.order <= order:
            del self._pulls[node_id]
        self.queue.put(node_id, News(node_id, order), NEWS_BYTES, order)
        parked = self._parked.pop(node_id, None)
        if parked is not None and parked.base == order:
            self._take_load(parked)
        if rec.summary.payload.state is PublishedState.LEAVING:
            # Still probed while it drains (its requests in flight): a leaving peer that freezes
            # is silent (Membership.silent) like any other; once gone, it is suspected and dead.
            self._heartbeaters.pop(node_id, None)
        boot = self._heartbeaters.get(node_id)
        if boot is not None:
            if boot == rec.summary.payload.boot:
                return  # still the heartbeat-mode boot: judged by age
            del self._heartbeaters[node_id]  # restarted (upgraded?): probed again, until it says otherwise
        if self.detector.state(node_id) is None:
            self._members.append(node_id)
        alive = self.detector.add(node_id, order)
        self.detector.set_leaving(node_id, rec.summary.payload.state is PublishedState.LEAVING)
        if isinstance(alive, Alive):
            self._claims.pop(node_id, None)
            self.m.tick()

    # --- driving ------------------------------------------------------------------------------

    def next_wakeup(self) -> float:
        """Clock time (ms) by which :meth:`poll` should run next."""
        now = self.m.clock()
        times = [now + 250.0, self._next_sync, self._next_dead_probe]
        due = self.detector.due()
        if due is not None:
            times.append(due)
        if self._run is not None:
            times.append(self._run.deadline)
        times += [r.deadline for r in self._relays.values()]
        times += [p.deadline for p in self._pulls.values()]
        if len(self.queue):
            times.append(self._next_gossip)
        if self._refute_due:
            times.append(self._refuted_at + self.settings.detector.probe_interval_ms)
        return max(now, min(times))

    def poll(self) -> list[Outgoing]:
        """Timers: probe timeouts, suspicion timeouts, publication, the next probe, gossip,
        anti-entropy. Returns the messages to send."""
        now = self.m.clock()
        out: list[Outgoing] = []
        for rid, relay in list(self._relays.items()):
            if now >= relay.deadline:
                del self._relays[rid]
                self._unanswered(relay.address)
                if relay.attempts_left > 0:
                    self._relay_ping(relay.requester, relay.request_id, relay.address,
                                     relay.attempts_left - 1, now, out)
                else:
                    self.counters["relay_nacks"] += 1
                    out.append((relay.requester, Nack(self.m.protocol, self.m.mesh_id, relay.request_id,
                                                      self._items(None))))
        run = self._run
        if run is not None and now >= run.deadline:
            self._advance(run, now, out)
        self._retry_pulls(now, out)
        if self.detector.tick(now):
            self.m.tick()  # Dead: liveness transitions fire
        if self._refute_due and now - self._refuted_at >= self.settings.detector.probe_interval_ms:
            self._publish_refutation(now)
        self.publish()
        probe = self.detector.next_probe()
        if probe is not None:
            self._start(probe, now, out)
        if now >= self._next_gossip and len(self.queue):
            self._next_gossip = now + self.settings.gossip_interval_ms
            for nid in self._gossip_targets():
                items = self._items(nid, self.settings.gossip_bytes)
                if items:
                    out.append((self._address(nid), Gossip(self.m.protocol, self.m.mesh_id, items)))
        if now >= self._next_sync:
            self._sync(now, out)
        if now >= self._next_dead_probe:
            self._probe_dead(now, out)
        if self._heartbeaters and now >= self._next_heartbeat:
            self._heartbeat_round(now, out)  # after _sync: its targets are read from _syncs
        return out

    def _heartbeat_round(self, now: float, out: list[Outgoing]) -> None:
        """For heartbeat-mode members: re-sign this node's summary when a heartbeat is due
        and open an exchange with ``fanout`` of the live ones (module doc)."""
        heartbeat_ms = float(self.m.settings.heartbeat_ms)
        self._next_heartbeat = now + heartbeat_ms * self.rng.uniform(0.9, 1.1)
        self.m.tick()  # their liveness moves with time (age), not with the detector's events
        for gone in [nid for nid in self._heartbeaters if nid not in self.m.records]:
            del self._heartbeaters[gone]  # reaped from the table (a tombstone's time ran out)
        live = [nid for nid in self._heartbeaters
                if nid in self.m.records and self._age_liveness(nid) in (Liveness.ALIVE, Liveness.SUSPECT)]
        if not live:
            return
        if now - self.m.self_published_at >= heartbeat_ms * HEARTBEAT_SLACK:
            summary = self.pub.maybe_publish(force=True)
            if summary is not None:
                self.detector.set_incarnation(self.m.node_id, summary.payload.order)
                self.counters["heartbeats"] += 1
        for nid in self.rng.sample(live, min(self.m.settings.fanout, len(live))):
            target = self.m.target_of(nid)
            self._syncs[target.address] = target
            out.append((target.address, self.m.make_digest(target)))

    def _sync(self, now: float, out: list[Outgoing]) -> None:
        self._publish_now()  # a peer that speaks only an older protocol: publish in it
        targets = self.m.select_targets(self._syncs.keys())
        live = [t for t in targets if not t.candidate][:1]
        chosen = live + [t for t in targets if t.candidate]
        alone = not any(self.detector.state(nid) == "alive" for nid in self._members)
        fast = alone or self._racing(now)
        interval = self.settings.detector.probe_interval_ms if fast else self.settings.sync_interval_ms
        self._next_sync = now + interval * self.rng.uniform(0.75, 1.25)
        self._syncs.clear()
        self._sync_count += 1
        # A digest while the table grows (a join spreads through digests' replies), else one
        # round in digest_every.
        joining = len(self.m.records) != self._synced_members
        self._synced_members = len(self.m.records)
        for t in chosen:
            if t.candidate or alone or joining or self._sync_count % self.settings.digest_every == 0:
                self._syncs[t.address] = t
                digest = self.m.make_digest(t)
                out.append((t.address, Digest(digest.protocol, digest.mesh_id, self._self_check(digest.entries))))
            else:
                out.append((t.address, self._version_pull()))

    def _racing(self, now: float) -> bool:
        """This node started lately, or another boot of its id was heard lately (each: within
        two anti-entropy intervals): a previous run, or a clone racing this one. Anti-entropy
        then runs every probe interval, so that the self-check finds a clone soon after a start
        and the race's steps (each boot outranking the other's summary, which reaches it
        through its self-check) come as fast as heartbeats would bring them: the clone rule,
        timed by ``dead_after_ms``, sees both boots publishing at once."""
        window = 2 * self.settings.sync_interval_ms
        if now - self._started < window:
            return True
        own = self.m.self_summary
        boot = None if own is None else own.payload.boot
        return any(b != boot and now - s.last_ms < window for b, s in self.m.self_boots.boots.items())

    def _self_check(self, entries: Entries) -> Entries:
        """``entries`` with this node's own version lowered by one ``seq``, so that the peer
        answers with what it holds of this node at the current version: this node's summary
        (dropped here as our own) or, when another agent runs with this node's key at the same
        ``(generation, seq)``, that one's, which starts the race the clone rule reads
        (mesh/clones.py, docs/mesh.md "One node per identity"). Heartbeats end such a tie at
        the next round; with change-only publishing nothing else would (~500 B per
        anti-entropy round)."""
        own = self.m.self_summary
        if own is None:
            return entries
        generation, seq = own.payload.order
        return {**entries, self.m.node_id: (generation, max(0, seq - 1))}

    def _probe_dead(self, now: float, out: list[Outgoing]) -> None:
        """Ping one random member held dead, or suspect with a claim held, with the claim held
        about it (module doc, "Partitions heal"). Its ack is not awaited: what it carries (the
        refutation's news) is taken as any message's items are."""
        self._next_dead_probe = now + self.settings.dead_probe_ms * self.rng.uniform(0.5, 1.5)
        dead = [nid for nid in self._members if nid in self.m.records and (
            self.detector.state(nid) == "dead" or self.detector.state(nid) == "suspect" and nid in self._claims)]
        if not dead:
            return
        target = self.rng.choice(dead)
        self._ping_ids += 1  # not in _pings: an ack to it finishes nothing
        self.counters["dead_probes"] += 1
        out.append((self._address(target), Ping(self.m.protocol, self.m.mesh_id, self._ping_ids,
                                                self._items(target))))

    def _version_pull(self) -> Pull:
        """Anti-entropy for load records (which digests do not list): a pull of every member
        at the version held, summary or record (at most MAX_PROBE_ITEMS, a random sample
        beyond); the answer brings whatever the target holds newer."""
        wants: Entries = {}
        for nid in self.m.records:
            version = self.version_of(nid)
            wants[nid] = (0, 0) if version is None or self.m.orders.get(nid) == (0, 0) else version
        if len(wants) > MAX_PROBE_ITEMS - 1:
            wants = dict(self.rng.sample(sorted(wants.items()), MAX_PROBE_ITEMS - 1))
        self.counters["version_pulls"] += 1
        return Pull(self.m.protocol, self.m.mesh_id, self._self_check(wants))

    def sync_target(self, address: str) -> GossipTarget | None:
        """The anti-entropy target a ``Digest`` returned by :meth:`poll` for ``address`` was
        made for (once; None when unknown): a transport that runs the digest exchange over
        its own request/response (:mod:`viiwork.mesh.probe_transport`) hands it to
        :meth:`~viiwork.mesh.membership.Membership.on_reply_bytes` with the reply."""
        return self._syncs.pop(address, None)

    def _gossip_targets(self) -> list[NodeId]:
        members = self._members
        picked: dict[NodeId, None] = {}
        for _ in range(4 * self.settings.gossip_nodes):
            if len(picked) >= self.settings.gossip_nodes or not members:
                break
            nid = members[self.rng.randrange(len(members))]
            if self.detector.state(nid) == "alive":
                picked[nid] = None
        return list(picked)

    def _address(self, node_id: NodeId) -> str:
        return self.m.records[node_id].summary.payload.mesh

    def _items(self, to: NodeId | None, room: int | None = None) -> tuple[News | Claim, ...]:
        items = self.queue.take(len(self.m.records) + 1, self.settings.piggyback_bytes if room is None else room)
        if to is not None and self.detector.state(to) in ("suspect", "dead") and to in self._claims:
            # Tell a member it is suspected (memberlist: a dead node learns it and refutes).
            items = [self._claims[to], *items]
        return tuple(items)

    def _new_ping(self, kind: str) -> int:
        self._ping_ids += 1
        self._pings[self._ping_ids] = kind
        return self._ping_ids

    def _start(self, probe: Probe, now: float, out: list[Outgoing]) -> None:
        rec = self.m.records.get(probe.target)
        if rec is None:  # reaped from the table since: forget it
            self.detector.remove(probe.target)
            return
        self._run = run = _Run(probe, rec.summary.payload.mesh, now + probe.timeout_ms, probe.attempts - 1)
        self._ping(run, now, out)

    def _ping(self, run: _Run, now: float, out: list[Outgoing]) -> None:
        run.pinged_at = now
        pid = self._new_ping("direct")
        run.ping_ids.add(pid)
        out.append((run.address, Ping(self.m.protocol, self.m.mesh_id, pid, self._items(run.probe.target))))

    def _advance(self, run: _Run, now: float, out: list[Outgoing]) -> None:
        """A probe's deadline passed: retry, go indirect, or report the indirect answers."""
        if run.relays is None:
            self._unanswered(run.address)
            if run.attempts_left > 0:
                run.attempts_left -= 1
                run.deadline = now + run.probe.timeout_ms
                self._ping(run, now, out)
                return
            plan = self.detector.direct_result(run.probe.probe_id, False)
            if plan is None:
                self._finish(run)
                return
            run.relays = plan.relays
            run.deadline = now + plan.timeout_ms
            for relay in plan.relays:
                pid = self._new_ping("indirect")
                run.ping_ids.add(pid)
                run.relay_of[pid] = relay
                out.append((self._address(relay), PingReq(self.m.protocol, self.m.mesh_id, pid, run.probe.target,
                                                          run.address, self._items(relay))))
            if plan.relays:
                return
        self._report(run, now)

    def _unanswered(self, address: str) -> None:
        for cb in self.on_unanswered:
            cb(address)

    def _report(self, run: _Run, now: float) -> None:
        silent = [r for r in run.relays or () if r not in run.answered]
        event = self.detector.indirect_result(run.probe.probe_id, run.acks, run.nacks, silent)
        self._finish(run)
        if isinstance(event, Suspected):
            self._suspected_here(event.node_id, event.incarnation)

    def _finish(self, run: _Run) -> None:
        for pid in run.ping_ids:
            self._pings.pop(pid, None)
        if self._run is run:
            self._run = None

    def _suspected_here(self, node_id: NodeId, incarnation: Order) -> None:
        data = claim_signing_input(self.m.mesh_id, node_id, incarnation, self.m.node_id)
        claim = Claim(node_id, incarnation, self.m.node_id, self.pub.signer.sign(data))
        self.counters["claims_made"] += 1
        self._claims[node_id] = claim
        self.queue.put(("claim", node_id, self.m.node_id), claim, CLAIM_BYTES, incarnation)
        self.m.tick()

    def _relay_ping(self, requester: str, request_id: int, address: str, attempts_left: int, now: float,
                    out: list[Outgoing]) -> None:
        self._ping_ids += 1
        rid = self._ping_ids
        self._relays[rid] = _Relay(requester, request_id, address, now + self.detector.relay_timeout_ms(),
                                   attempts_left)
        out.append((address, Ping(self.m.protocol, self.m.mesh_id, rid, ())))

    # --- receiving ----------------------------------------------------------------------------

    def receive(self, sender: NodeId, address: str, msg: Any) -> list[Outgoing]:
        """One message from ``sender`` (its node id, from the authenticated channel) at
        ``address``; returns the messages to send. Nothing a peer sends raises: a message of
        another mesh is dropped (counted ``wrong_mesh``)."""
        out: list[Outgoing] = []
        if isinstance(msg, Digest):
            reply = self.m.handle_digest(sender, msg)
            if reply is not None:
                out.append((address, reply))
            return out
        if isinstance(msg, Reply):
            push = self.m.handle_reply(sender, msg, self._syncs.pop(address, None))
            if push is not None:
                out.append((address, push))
            return out
        if isinstance(msg, Push):
            self.m.handle_push(sender, msg)
            return out
        if getattr(msg, "mesh_id", None) != self.m.mesh_id:
            self.m.counters.drop(DropReason.WRONG_MESH)
            return out
        if isinstance(msg, Pull):
            # Within one channel frame (a peer closes one beyond it): the rest on a later pull.
            summaries = self.m.relay(msg.wants, msg.protocol, MAX_PROBE_MESSAGE_BYTES)
            if summaries:
                out.append((address, Push(msg.protocol, self.m.mesh_id, summaries)))
            records = self._loads_for(msg.wants)
            if records:
                out.append((address, Loads(msg.protocol, self.m.mesh_id, records)))
            return out
        if isinstance(msg, Loads):
            for reason in msg.rejected:
                self.counters["loads_rejected"] += 1
                self.m.counters.drop(reason)
            for record in msg.records:
                self._take_load(record, sender)
            return out
        now = self.m.clock()
        self._take_items(sender, address, msg.news, now, out)
        if isinstance(msg, Ping):
            out.append((address, Ack(self.m.protocol, self.m.mesh_id, msg.ping_id, self._items(sender))))
        elif isinstance(msg, PingReq):
            # The target is pinged at the address this node holds for it (its signed summary),
            # never at the one the request names: a member must not make this node connect to
            # any host and port it likes. A target this node does not know (or itself, or the
            # requester) is dropped and counted.
            if msg.target not in self.m.records or msg.target in (self.m.node_id, sender):
                self.counters["ping_req_unknown_target"] += 1
            else:
                self._relay_ping(address, msg.ping_id, self._address(msg.target),
                                 self.settings.detector.relay_attempts - 1, now, out)
        elif isinstance(msg, Ack):
            self._acked(msg.ping_id, now, out)
        elif isinstance(msg, Nack):
            run = self._run
            if self._pings.get(msg.ping_id) == "indirect" and run is not None and msg.ping_id in run.ping_ids:
                self._pings.pop(msg.ping_id)
                run.nacks += 1
                run.answered.add(run.relay_of.get(msg.ping_id, sender))
                if run.relays is not None and run.acks + run.nacks >= len(run.relays):
                    self._report(run, now)
        return out

    def receive_bytes(self, sender: NodeId, address: str, data: bytes) -> list[tuple[str, bytes]]:
        """:meth:`receive` over bytes (:mod:`viiwork.mesh.probe_codec`): what the transport
        uses. A message that does not decode is dropped and counted by its reason."""
        self.m.counters.bytes_in += len(data)
        try:
            msg = decode_any(data, self.m.accepted, self.m.settings.max_message_bytes)
        except SummaryError as exc:
            self.m.counters.messages_in["undecodable"] += 1
            self.m.counters.drop(exc.reason)
            return []
        self.m.counters.messages_in[type(msg).__name__.lower()] += 1
        out = []
        for to, reply in self.receive(sender, address, msg):
            encoded = encode_any(reply)
            self.m.counters.bytes_out += len(encoded)
            self.m.counters.messages_out[type(reply).__name__.lower()] += 1
            out.append((to, encoded))
        return out

    def _acked(self, ping_id: int, now: float, out: list[Outgoing]) -> None:
        relay = self._relays.pop(ping_id, None)
        if relay is not None:
            self.counters["relay_acks"] += 1
            out.append((relay.requester, Ack(self.m.protocol, self.m.mesh_id, relay.request_id, self._items(None))))
            return
        kind = self._pings.get(ping_id)
        run = self._run
        if kind is None or run is None or ping_id not in run.ping_ids:
            return
        if kind == "direct" and run.relays is None:
            self.m.note_rtt(run.probe.target, now - run.pinged_at)  # the router prefers near peers
            self.detector.direct_result(run.probe.probe_id, True)
            self._finish(run)
        elif kind == "indirect":
            self._pings.pop(ping_id)
            run.acks += 1
            run.answered.add(run.relay_of[ping_id])
            self._report(run, now)

    def _take_items(self, sender: NodeId, address: str, items: tuple[News | Claim, ...], now: float,
                    out: list[Outgoing]) -> None:
        wants: Entries = {}
        unknown = 0
        for item in items:
            if isinstance(item, Claim):
                self._take_claim(item, sender)
                continue
            held = self.version_of(item.node_id)
            if item.node_id == self.m.node_id and (held is None or item.order <= held):
                continue  # our own news coming back (a newer one is another boot's: pulled, below)
            if held is not None and held >= item.order:
                continue
            if held is None:
                unknown += 1
                if unknown > MAX_UNKNOWN_PULLS_PER_MESSAGE:
                    self.counters["news_unknown_skipped"] += 1
                    continue
            pending = self._pulls.get(item.node_id)
            if pending is not None and pending.order >= item.order and now < pending.deadline:
                continue
            wants[item.node_id] = (0, 0) if held is None else held
            self._pulls[item.node_id] = _Pull(item.order, now + self.settings.pull_timeout_ms, address,
                                              self.settings.pull_attempts - 1)
        if wants:
            self.counters["pulls_sent"] += 1
            out.append((address, Pull(self.m.protocol, self.m.mesh_id, wants)))

    def _retry_pulls(self, now: float, out: list[Outgoing]) -> None:
        """Pulls unanswered by their deadline go again to the same address (lost on the way
        there or back), ``pull_attempts`` times in all; then anti-entropy repairs."""
        again: dict[str, Entries] = {}
        for nid, pull in list(self._pulls.items()):
            if now < pull.deadline:
                continue
            if pull.attempts_left <= 0:
                del self._pulls[nid]
                self.counters["pulls_abandoned"] += 1  # anti-entropy (or the next news) repairs
                continue
            held = self.version_of(nid)
            if held is not None and held >= pull.order:
                del self._pulls[nid]  # a load record answered it (summaries clear it in _on_update)
                continue
            again.setdefault(pull.address, {})[nid] = (0, 0) if held is None else held
            pull.attempts_left -= 1
            pull.deadline = now + self.settings.pull_timeout_ms
        for address, wants in again.items():
            self.counters["pulls_sent"] += 1
            out.append((address, Pull(self.m.protocol, self.m.mesh_id, wants)))

    def _loads_for(self, wants: Entries) -> tuple[LoadRecord, ...]:
        """The load records to answer a pull with: for each wanted node (the value is the
        newest version the asker holds, summary or record), the newest record held here when
        it is newer than both that and this node's summary of the node (the summary itself,
        when newer than the asker's version, goes in the ``Push``: the record amends it, and a
        record is never newer than a summary it does not amend, as both take their ``seq``
        from one counter)."""
        out = []
        for nid in wants:
            if nid == self.m.node_id:
                load, own = self.pub.last_load, self.m.self_summary
                summary_order = None if own is None else own.payload.order
            else:
                load, rec = self.m.loads.get(nid), self.m.records.get(nid)
                if rec is None or rec.liveness is Liveness.DEAD:
                    continue
                summary_order = rec.order
            if load is not None and summary_order is not None and load.order > summary_order \
                    and load.order > wants[nid]:
                out.append(load)
        return tuple(out)

    def _over_budget(self, sender: NodeId | None) -> bool:
        """True (counted ``verify_budget_exceeded``) when ``sender`` has caused its share of
        signature checks this second (:data:`VERIFY_PER_SENDER_PER_S`); None (a parked record
        taken again) is never over."""
        if sender is None or self._verify_budget.allow(sender, self.m.clock()):
            return False
        self.counters["verify_budget_exceeded"] += 1
        self.m.counters.drop(DropReason.RATE_LIMITED)
        return True

    def _take_load(self, record: LoadRecord, sender: NodeId | None = None) -> None:
        """A load record: kept when it is newer than both the summary and the record held of
        its node (checked before the signature, so each version is verified once), fits the
        summary it amends (held: else parked until that summary comes, or dropped when the
        summary held is newer), and its signature verifies with that summary's certificate."""
        nid = record.node_id
        rec = self.m.records.get(nid)
        if nid == self.m.node_id:
            self.counters["loads_own"] += 1
            return
        if rec is None or record.base > rec.order:
            parked = self._parked.get(nid)
            if rec is not None and (parked is None or parked.order < record.order):
                self._parked[nid] = record  # one per known node: bounded by the table
            self.counters["loads_parked" if rec is not None else "loads_unknown"] += 1
            if rec is None:
                self.m.counters.drop(DropReason.UNKNOWN_SIGNER)
            return
        held = self.version_of(nid)
        if held is not None and record.order <= held:
            self.counters["loads_old"] += 1
            self.m.counters.drop(DropReason.REPLAY if record.order == held else DropReason.OLD_SEQ)
            return
        if record.base != rec.order or load_problem(record, rec.summary.payload) is not None:
            self.counters["loads_unfit"] += 1
            self.m.counters.drop(DropReason.MALFORMED)
            return
        if self._over_budget(sender):
            return
        try:
            self.m.policy.verify_certificate(rec.cert.der, self.m.wall_clock())
        except (TrustError, NameConflict):
            self.counters["loads_untrusted"] += 1
            self.m.counters.drop(DropReason.INVALID_CERTIFICATE)
            return
        data = load_signing_input(self.m.mesh_id, nid, record.generation, record.seq, record.base_seq, record.loads)
        self.counters["loads_verified"] += 1
        if not self.m.policy.verify_signature(rec.cert, data, record.signature):
            self.counters["loads_forged"] += 1
            self.m.counters.drop(DropReason.BAD_SIGNATURE)
            return
        self.m.loads[nid] = record
        self.counters["loads_accepted"] += 1
        pending = self._pulls.get(nid)
        if pending is not None and pending.order <= record.order:
            del self._pulls[nid]
        self.queue.put(nid, News(nid, record.order), NEWS_BYTES, record.order)
        for cb in self.on_load:
            cb(nid, record)

    def _claim_incarnation(self, claim: Claim) -> Order:
        """The incarnation a claim is taken at. A summary's ``(generation, seq)`` moves with
        every load publication, not only with refutations as SWIM's incarnation does, so the
        prober's version is often one behind ours: within one generation a claim stands for
        the newest version held here (the suspect refutes it with a newer one, for this node
        too), while a claim about an older generation stays older and is ignored. A claim
        never stands for more than the newest version held: a member could otherwise sign one
        about a version far ahead (``seq + 10**6``, a generation that never booted) that no
        refutation (one ``seq`` up) ever passes, and every node would hold its node dead.

        A claim at or below the seq the held summary says it **refuted** (``refuted``
        extension) stays at its own version and is ignored, being older than the summary's (a
        claim about the version held is always taken, whatever ``refuted`` says): it was
        made before the refutation (a partitioned prober's, delivered after the partition
        healed) and, taken at the newest version, made a member that had just refuted suspect
        again (CI, tests/mesh/test_partition.py; 3 heals in 200 in the simulator)."""
        if claim.node_id == self.m.node_id:
            summary = self.m.self_summary
        else:
            rec = self.m.records.get(claim.node_id)
            summary = None if rec is None else rec.summary
        if summary is None:
            return claim.order
        held = summary.payload.order
        if claim.order[0] > held[0]:
            return held
        if claim.order[0] == held[0]:
            refuted = summary.payload.extensions.get(REFUTED)
            if refuted is None or claim.order[1] > refuted:
                return held
        return claim.order

    def _refute(self, claim: Claim, again: bool = False) -> None:
        """A verified claim about this node: a newer summary refutes it (a copy of one refuted
        before: not within ``probe_interval_ms`` of the last refutation). At most one
        refutation per probe interval: a new claim within it is refuted at the interval's end
        by one summary with any others (:meth:`poll`): a member can sign claims as fast as
        its verification budget allows, and each summary is verified by every node.

        A claim the current summary already refutes (``refuted``, :meth:`_claim_incarnation`)
        needs no new summary, but whoever sent it may lack the refutation (a member that held
        this node dead pings it with the claim it holds: "Partitions heal"): the news of the
        current version is queued again, so it rides the answer, at most once per probe
        interval (``refutations_resent``)."""
        now = self.m.clock()
        interval = self.settings.detector.probe_interval_ms
        if again and now - self._refuted_at < interval:
            return
        event = self.detector.suspect(claim.node_id, self._claim_incarnation(claim), claim.by)
        if isinstance(event, Refute):
            if now - self._refuted_at < interval:
                self._refute_due = True
                return
            self._publish_refutation(now)
        elif now - self._resent_at >= interval:
            version = self.version_of(self.m.node_id)
            if version is not None:
                self._resent_at = now
                self.counters["refutations_resent"] += 1
                self.queue.put(self.m.node_id, News(self.m.node_id, version), NEWS_BYTES, version)

    def _publish_refutation(self, now: float) -> None:
        self.counters["refutations"] += 1
        self._refuted_at = now
        self._refute_due = False
        self.pub.refute()
        self.publish(force=True)

    def _take_claim(self, claim: Claim, sender: NodeId | None = None) -> None:
        """A claim: verified once (by its signer's certificate), then given to the detector,
        relayed when it is news here, refuted when it is about this node."""
        key = (claim.node_id, claim.order, claim.by, claim.signature)
        if key in self._seen_claims or claim.by == self.m.node_id:
            self.counters["claims_seen"] += 1
            if key in self._verified_own:
                # A copy of a claim about this node, verified before, still travels: whoever
                # sent it may lack the refutation, so it is answered as the claim was (a new
                # refutation, or the news of the one published: _refute), at most once per
                # probe interval (the 50-process run: docs/benchmarks-mesh.md). Only a copy
                # of one that verified: a forged claim is remembered too (its copies are not
                # verified again) and must never make this node publish.
                self._refute(claim, again=True)
            return
        if len(self._seen_claims) >= _MAX_SEEN_CLAIMS:
            self._seen_claims.clear()
            self._verified_own.clear()
        self._seen_claims.add(key)
        signer = self.m.records.get(claim.by)
        if signer is None:
            self.counters["claims_unknown_signer"] += 1
            self.m.counters.drop(DropReason.UNKNOWN_SIGNER)
            return
        if self._over_budget(sender):
            self._seen_claims.discard(key)  # not judged: a copy from another sender may be
            return
        data = claim_signing_input(self.m.mesh_id, claim.node_id, claim.order, claim.by)
        self.counters["claims_verified"] += 1
        if not self.m.policy.verify_signature(signer.cert, data, claim.signature):
            self.counters["claims_forged"] += 1
            self.m.counters.drop(DropReason.BAD_SIGNATURE)
            return
        if claim.node_id == self.m.node_id:
            self._verified_own.add(key)
            self._refute(claim)
            return
        ignored = self.detector.counters["claims_ignored"]
        event = self.detector.suspect(claim.node_id, self._claim_incarnation(claim), claim.by)
        if self.detector.counters["claims_ignored"] > ignored:
            return
        self.counters["claims_accepted"] += 1
        self._claims.setdefault(claim.node_id, claim)
        self.queue.put(("claim", claim.node_id, claim.by), claim, CLAIM_BYTES, claim.order)
        if isinstance(event, Suspected | Dead):
            self.m.tick()


__all__ = ["Outgoing", "ProbeNode", "ProbeSettings"]
