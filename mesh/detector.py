"""The failure detector: SWIM probing with Lifeguard's local health (sans-IO).

Each probe interval this node probes one member: round-robin over a shuffled list (a new
member goes in at a random place, a full pass reshuffles), so every member is probed once
per pass and a crashed one is probed by some node within about one interval. A probe is a
ping that must be acked within the probe timeout, tried twice; on a miss, up to
``indirect_checks`` alive members (relays) are asked to ping the target for us (each relay
tries twice) and answer ack (reached it) or nack (answered, did not reach it). No ack at
all: this node suspects the target and the caller broadcasts a signed suspicion claim.
A suspicion ends in one of two ways: the member publishes a newer incarnation (summary
``(generation, seq)``) than the one suspected, which refutes it, or its timeout passes and
it is dead *here* (a local declaration, never broadcast). Issue 16, items 1 and 6;
docs/mesh.md describes liveness.

Rules (SWIM, Das et al. 2002; Lifeguard, Dadgar et al. 2018; memberlist's documented
configuration):

- **Suspicion timeout** with ``n`` = live (alive or suspect) members + 1 when it starts:
  ``min = suspicion_mult * max(1, log10(n)) * probe_interval_ms`` (memberlist floors the
  scale at 1, so a small mesh is not quicker to declare death), ``max =
  suspicion_max_timeout_mult * min``; after ``c`` confirmations (distinct suspectors beyond
  the first) ``max(min, max - (max - min) * log(c + 1) / log(k + 1))`` with ``k =
  suspicion_confirmations``, or ``k = 0`` (timeout ``min``) when ``n - 2 < k``, as in
  memberlist.
- **Claims** about a member at an incarnation below the known one, about an unknown or dead
  member, or by the member itself are ignored (counted ``claims_ignored``). A claim about
  this node at or above its own incarnation yields :class:`Refute` (the caller publishes a
  newer one) and raises the health score.
- **Local health** (Lifeguard's awareness), ``0 .. awareness_max_multiplier - 1``: the probe
  interval, probe timeout and indirect timeout are multiplied by ``score + 1`` (not the
  relay timeout: see :meth:`Detector.relay_timeout_ms`). +1 for each relay that stayed
  silent (neither ack nor nack: our own path is the likely fault), +1 for a probe that ends
  without an ack when there was no relay to ask, +1 for each refuted claim about this node;
  -1 for a probe acked directly or through a relay. As memberlist does, a probe of a member
  that really crashed, which every relay answers with a nack, costs nothing: charging it +1
  slowed every prober while a crashed member stayed suspect (with three of ten nodes
  crashing at once, the third was first suspected 9.4 s after the crash in one seed:
  docs/benchmarks-mesh.md). A slow node thus probes less and waits longer before it
  accuses anyone. A silent relay that is itself found suspect or dead before it is next
  acked gives its +1 back (counted ``relay_refunds``): its silence is explained by its own
  crash, not by this node's path (with three of ten nodes crashing at once the crashed
  ones are often picked as relays, and the charges slowed the prober's detection of them).
  A member that announced it is leaving (:meth:`Detector.set_leaving`) is expected to go
  silent: a probe of it that misses costs nothing (counted ``leaving_misses``), and it is
  never picked as a relay. Charging those misses stretched a node's probe interval after
  every graceful stop of a peer, delaying the detection of a real crash behind it.
- A successful probe of a suspect does not clear it: only a newer incarnation does (SWIM).
- **A probe suspects the incarnation it started on**: a newer one accepted while it was in
  flight (a refutation after a partition heals, or any newer summary) is proof of life later
  than the probe's first ping, so its miss raises no suspicion (counted
  ``probes_outdated``; its health accounting stands). memberlist probes a copy of the
  member's state for the same reason. Suspecting the newer incarnation instead made a peer
  that had just refuted suspect again ~20 ms later, and a request routed to it in between
  was refused (found by CI, tests/mesh/test_partition.py).
  Dead members stay known (and are not probed) until removed; a newer incarnation of a dead
  member makes it alive again.

**False suspicions at 5% loss.** Each message is lost independently with ``p = 0.05``. A
direct attempt (ping, ack) fails with ``d = 1 - 0.95^2 = 0.0975``, both with ``d^2 =
0.0095``. One relay path (ping-req, the relay's two pings, reply) fails with ``f = 1 -
0.95^2 * (1 - d^2) = 0.1061``. A live target is falsely suspected with ``d^2 * f^k``: for
``k = 3`` 1.13e-5, so 0.082 per node-hour at 7,200 probes an hour (one per 500 ms); for
``k = 4`` **1.20e-6, so 0.0087 per node-hour**, within issue 16's 0.01, hence
``indirect_checks = 4`` (see :func:`false_suspicion_probability`). Time to suspicion: the
prober waits at most ``2 * 200 + 600`` ms after its ping; gossip spreads the claim.

One module (about 500 lines, 40% of them docstrings: each setting's source, the loss
derivation) because :class:`Detector` is one state machine: the probe order, the probe in
flight, the suspicions and the health score all read and write the same member table.

Pure: no sockets, timers or asyncio. The clock (monotonic ms) and rng are injected; the
caller (transport or simulator) sends the messages and keeps the time of each RPC with the
timeouts given here, and reports every outcome. Single-threaded.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Collection
from dataclasses import dataclass, fields
from typing import Literal

from viiwork.mesh.identity import NodeId

Incarnation = tuple[int, int]
"""A member's incarnation: its summary's ``(generation, seq)``; larger is newer."""
State = Literal["alive", "suspect", "dead"]


class DetectorSettingsError(ValueError):
    """A :class:`DetectorSettings` field out of range: the message names field, value and
    the allowed range."""


@dataclass(frozen=True, slots=True)
class DetectorSettings:
    """Timings of the detector. Raises :class:`DetectorSettingsError` on a value out of range.

    - ``probe_interval_ms`` (> 0, default 500): time between probe starts at health 0.
      memberlist's LAN ProbeInterval is 1,000; issue 16's detection goal needs 500.
    - ``probe_timeout_ms`` (> 0, default 200): wait for one ack at health 0. memberlist's
      LAN ProbeTimeout is 500; 200 covers a LAN round trip with room (issue 16).
    - ``direct_attempts`` (>= 1, default 2): pings before going indirect (issue 16).
    - ``indirect_checks`` (>= 0, default 4): relays asked on a miss. memberlist's
      IndirectChecks is 3; 4 is what keeps false suspicions under 0.01 per node-hour at 5%
      loss (module docstring).
    - ``relay_attempts`` (>= 1, default 2): pings a relay sends before it nacks (issue 16).
    - ``indirect_timeout_ms`` (> relay_attempts * probe_timeout_ms, default 600): wait for
      the relays' answers at health 0: their pings plus one round trip.
    - ``suspicion_mult`` (> 0, default 4): memberlist's SuspicionMult (LAN).
    - ``suspicion_max_timeout_mult`` (>= 1, default 6): memberlist's SuspicionMaxTimeoutMult.
    - ``suspicion_confirmations`` (>= 0, default 2): confirmations that shrink the timeout
      to its minimum (``k``); memberlist expects SuspicionMult - 2.
    - ``awareness_max_multiplier`` (>= 1, default 8): memberlist's AwarenessMaxMultiplier;
      the health score stays below it.
    """

    probe_interval_ms: float = 500.0
    probe_timeout_ms: float = 200.0
    direct_attempts: int = 2
    indirect_checks: int = 4
    relay_attempts: int = 2
    indirect_timeout_ms: float = 600.0
    suspicion_mult: float = 4.0
    suspicion_max_timeout_mult: float = 6.0
    suspicion_confirmations: int = 2
    awareness_max_multiplier: int = 8

    def __post_init__(self) -> None:
        floors: dict[str, tuple[float, bool]] = {  # field: (bound, strictly above it)
            "probe_interval_ms": (0, True), "probe_timeout_ms": (0, True),
            "direct_attempts": (1, False), "indirect_checks": (0, False),
            "relay_attempts": (1, False),
            "indirect_timeout_ms": (self.relay_attempts * self.probe_timeout_ms, True),
            "suspicion_mult": (0, True), "suspicion_max_timeout_mult": (1, False),
            "suspicion_confirmations": (0, False), "awareness_max_multiplier": (1, False)}
        for f in fields(self):
            value = getattr(self, f.name)
            bound, strict = floors[f.name]
            if not math.isfinite(value) or value < bound or (strict and value == bound):
                raise DetectorSettingsError(
                    f"detector.{f.name} = {value!r}: must be {'>' if strict else '>='} {bound}")


@dataclass(frozen=True, slots=True)
class Probe:
    """Ping ``target`` up to ``attempts`` times, each waiting ``timeout_ms``; report with
    :meth:`Detector.direct_result`."""

    probe_id: int
    target: NodeId
    timeout_ms: float
    attempts: int


@dataclass(frozen=True, slots=True)
class IndirectPlan:
    """Send a ping-req about ``target`` to each relay (possibly none: no alive member to
    ask), wait ``timeout_ms``, report with :meth:`Detector.indirect_result`."""

    probe_id: int
    target: NodeId
    relays: tuple[NodeId, ...]
    timeout_ms: float


@dataclass(frozen=True, slots=True)
class Suspected:
    """``node_id`` at ``incarnation`` became suspect here; ``by_self``: this node's own probe
    failed (the caller signs and broadcasts a claim) rather than a received claim."""

    node_id: NodeId
    incarnation: Incarnation
    by_self: bool


@dataclass(frozen=True, slots=True)
class Dead:
    """``node_id``'s suspicion at ``incarnation`` timed out: dead here (never broadcast)."""

    node_id: NodeId
    incarnation: Incarnation


@dataclass(frozen=True, slots=True)
class Alive:
    """``node_id`` is alive at ``incarnation``: ``refuted`` a suspicion (True) or came back
    from dead (False)."""

    node_id: NodeId
    incarnation: Incarnation
    refuted: bool


@dataclass(frozen=True, slots=True)
class Refute:
    """A claim suspects this node at ``incarnation``: publish a newer one."""

    incarnation: Incarnation


Event = Suspected | Dead | Alive | Refute


def suspicion_timeout_ms(n: int, confirmations: int, settings: DetectorSettings) -> float:
    """Lifeguard's suspicion timeout (ms) in a mesh of ``n`` live nodes (self included) after
    ``confirmations`` (>= 0) independent confirmations; formula in the module docstring."""
    low = settings.suspicion_mult * max(1.0, math.log10(max(1, n))) * settings.probe_interval_ms
    high = settings.suspicion_max_timeout_mult * low
    k = settings.suspicion_confirmations if n - 2 >= settings.suspicion_confirmations else 0
    if k < 1:
        return low
    return max(low, high - (high - low) * math.log(confirmations + 1) / math.log(k + 1))


def false_suspicion_probability(loss: float, settings: DetectorSettings) -> float:
    """Chance (0..1) that one probe of a live target ends in suspicion when each message is
    lost independently with probability ``loss`` and all relays are alive (derivation in the
    module docstring)."""
    delivered = (1 - loss) ** 2
    direct_miss = (1 - delivered) ** settings.direct_attempts
    relay_miss = 1 - delivered * (1 - (1 - delivered) ** settings.relay_attempts)
    return direct_miss * relay_miss ** settings.indirect_checks


@dataclass(slots=True)
class _Member:
    incarnation: Incarnation
    state: State = "alive"
    suspected_at: float | None = None
    suspectors: tuple[str, ...] = ()
    n_at_suspicion: int = 0
    leaving: bool = False


@dataclass(slots=True)
class _InFlight:
    probe: Probe
    started_at: float
    incarnation: Incarnation  # the target's when the probe started
    relays: tuple[NodeId, ...] | None = None  # None while direct


class Detector:
    """One node's SWIM detector over its members (peers, never ``self_id``).

    ``clock()`` returns monotonic milliseconds; ``rng`` shuffles the probe order and picks
    relays. One probe is in flight at a time; one not reported within twice its total
    timeouts is abandoned (counted) when the next is asked for.
    """

    def __init__(self, self_id: NodeId, settings: DetectorSettings,
                 clock: Callable[[], float], rng: random.Random) -> None:
        self.self_id = self_id
        self.settings = settings
        self._clock = clock
        self._rng = rng
        self._members: dict[NodeId, _Member] = {}
        self._suspects: set[NodeId] = set()
        self._dead: set[NodeId] = set()
        self._leaving: set[NodeId] = set()  # alive members that announced they are leaving
        self._order: list[NodeId] = []
        self._next = 0  # index in _order of the next member to probe in this pass
        self._self_incarnation: Incarnation | None = None
        self._score = 0
        self._last_probe_at: float | None = None
        self._in_flight: _InFlight | None = None
        self._probe_ids = 0
        self._charged: dict[NodeId, int] = {}  # silent relays -> health charged, until acked or suspected
        self.passes = 0
        """Completed passes over the probe order (each ends with a reshuffle)."""
        self.counters: dict[str, int] = dict.fromkeys((
            "probes", "probe_misses", "indirect_probes", "suspicions_raised", "confirmations",
            "refutations", "refutes", "claims_ignored", "deaths", "probes_abandoned",
            "results_ignored", "relay_refunds", "leaving_misses", "probes_outdated"), 0)
        """For /metrics: probes started, direct misses, indirect probes, suspicions raised by
        this node's probes, confirmations counted, suspicions refuted, Refute events, claims
        ignored, members declared dead, probes abandoned, results for no current probe,
        health charges given back for silent relays found suspect or dead, misses of leaving
        members, misses outdated by a newer incarnation heard during the probe."""

    # -- members --------------------------------------------------------------------------

    def add(self, node_id: NodeId, incarnation: Incarnation) -> Alive | None:
        """Start tracking ``node_id`` as alive, at a random place in the probe order. A known
        member is given to :meth:`set_incarnation`. Raises ValueError for ``self_id``."""
        if node_id == self.self_id:
            raise ValueError(f"detector of {self.self_id} cannot track itself as a member")
        if node_id in self._members:
            return self.set_incarnation(node_id, incarnation)
        self._members[node_id] = _Member(incarnation)
        at = self._rng.randint(0, len(self._order))
        self._order.insert(at, node_id)
        if at < self._next:
            self._next += 1  # inserted behind the cursor: first probed next pass
        return None

    def remove(self, node_id: NodeId) -> None:
        """Forget ``node_id`` (no-op when unknown); a probe of it in flight is dropped."""
        if self._members.pop(node_id, None) is None:
            return
        self._charged.pop(node_id, None)
        self._suspects.discard(node_id)
        self._dead.discard(node_id)
        self._leaving.discard(node_id)
        at = self._order.index(node_id)
        del self._order[at]
        if at < self._next:
            self._next -= 1
        if self._in_flight is not None and self._in_flight.probe.target == node_id:
            self._in_flight = None

    def set_leaving(self, node_id: NodeId, leaving: bool) -> None:
        """``node_id``'s newest summary says it is leaving (a graceful stop) or not (a restart
        takes it back): see the module docstring. No-op for an unknown member."""
        member = self._members.get(node_id)
        if member is None or member.leaving == leaving:
            return
        member.leaving = leaving
        (self._leaving.add if leaving and member.state == "alive" else self._leaving.discard)(node_id)

    def set_incarnation(self, node_id: NodeId, incarnation: Incarnation) -> Alive | None:
        """A newer summary of ``node_id`` was accepted. Refutes a suspicion at a lower
        incarnation and revives a dead member (returns :class:`Alive`); for ``self_id``
        records this node's own incarnation. Unknown or not newer: None."""
        if node_id == self.self_id:
            if self._self_incarnation is None or incarnation > self._self_incarnation:
                self._self_incarnation = incarnation
            return None
        member = self._members.get(node_id)
        if member is None or incarnation <= member.incarnation:
            return None
        member.incarnation = incarnation
        if member.state == "alive":
            return None
        refuted = member.state == "suspect"
        if refuted:
            self.counters["refutations"] += 1
        self._set_state(node_id, member, "alive")
        return Alive(node_id, incarnation, refuted)

    def state(self, node_id: NodeId) -> State | None:
        """``alive``, ``suspect`` or ``dead``; None when unknown."""
        member = self._members.get(node_id)
        return None if member is None else member.state

    def suspected_at(self, node_id: NodeId) -> float | None:
        """Clock time (ms) the current suspicion of ``node_id`` began; None when not suspect."""
        member = self._members.get(node_id)
        return None if member is None or member.state != "suspect" else member.suspected_at

    def confirmations(self, node_id: NodeId) -> int:
        """Distinct suspectors of ``node_id`` beyond the first (0 when not suspect)."""
        member = self._members.get(node_id)
        if member is None or member.state != "suspect":
            return 0
        return len(member.suspectors) - 1

    @property
    def live_count(self) -> int:
        """Members that are alive or suspect (this node not included)."""
        return len(self._members) - len(self._dead)

    @property
    def health_score(self) -> int:
        """Local health, 0 (healthy) .. ``awareness_max_multiplier - 1``."""
        return self._score

    def _set_state(self, node_id: NodeId, member: _Member, state: State) -> None:
        for held, named in ((self._suspects, "suspect"), (self._dead, "dead")):
            (held.add if state == named else held.discard)(node_id)
        member.state = state
        (self._leaving.add if state == "alive" and member.leaving else self._leaving.discard)(node_id)
        refund = self._charged.pop(node_id, 0) if state != "alive" else 0
        if refund:
            self.counters["relay_refunds"] += refund
            self._adjust_health(-refund)
        if state == "alive":
            member.suspected_at, member.suspectors = None, ()

    def _alive_relays(self, target: NodeId) -> tuple[NodeId, ...]:
        """Up to ``indirect_checks`` distinct random alive members other than ``target``:
        drawn from the probe order while most members are alive (O(k)), else by a scan."""
        k = self.settings.indirect_checks
        alive = len(self._members) - len(self._suspects) - len(self._dead) - len(self._leaving)
        # The target (still a member: remove() drops its probe) is not a relay.
        alive -= target not in self._suspects and target not in self._dead and target not in self._leaving
        if alive <= 2 * k:
            pool = [n for n in self._order if n != target and self._relay_candidate(n)]
            return tuple(self._rng.sample(pool, min(k, len(pool))))
        picked: dict[NodeId, None] = {}
        while len(picked) < k:
            node_id = self._order[self._rng.randrange(len(self._order))]
            if node_id != target and self._relay_candidate(node_id):
                picked[node_id] = None
        return tuple(picked)

    def _relay_candidate(self, node_id: NodeId) -> bool:
        member = self._members[node_id]
        return member.state == "alive" and not member.leaving

    def _adjust_health(self, delta: int) -> None:
        top = self.settings.awareness_max_multiplier - 1
        self._score = min(top, max(0, self._score + delta))

    # -- probing --------------------------------------------------------------------------

    def probe_interval_ms(self) -> float:
        """Time between probe starts at the current health (ms)."""
        return self.settings.probe_interval_ms * (self._score + 1)

    def relay_timeout_ms(self) -> float:
        """For a ping-req received: wait this long (ms) for each of up to
        ``settings.relay_attempts`` pings of the target, then answer ack or nack. Not scaled
        by this node's health (memberlist's relay waits its plain probe timeout too): the
        requester waits ``indirect_timeout_ms`` scaled by *its* health, and a nack that came
        after that counted as a silent relay there, charging the requester's health for this
        node's slowness (with three of ten nodes crashing, one node's raised score spread
        to its requesters that way)."""
        return self.settings.probe_timeout_ms

    def _probe_budget_ms(self, probe: Probe) -> float:
        scale = self._score + 1
        return 2 * (probe.attempts * probe.timeout_ms + self.settings.indirect_timeout_ms * scale)

    def due(self) -> float | None:
        """Clock time (ms) from which :meth:`next_probe` gives a probe; None while no member
        is probeable or a probe is in flight (within its budget)."""
        flight = self._in_flight
        if flight is not None and self._clock() - flight.started_at <= self._probe_budget_ms(
                flight.probe):
            return None
        if len(self._dead) == len(self._members):
            return None
        if self._last_probe_at is None:
            return self._clock()
        return self._last_probe_at + self.probe_interval_ms()

    def next_probe(self) -> Probe | None:
        """The next probe when it is due (see :meth:`due`), else None."""
        due = self.due()
        now = self._clock()
        if due is None or now < due:
            return None
        if self._in_flight is not None:
            self.counters["probes_abandoned"] += 1
            self._in_flight = None
        target = self._next_target()
        self._probe_ids += 1
        probe = Probe(self._probe_ids, target, self.settings.probe_timeout_ms * (self._score + 1),
                      self.settings.direct_attempts)
        self._in_flight = _InFlight(probe, now, self._members[target].incarnation)
        self._last_probe_at = now
        self.counters["probes"] += 1
        return probe

    def _next_target(self) -> NodeId:
        # due() saw a live member, so this finds one within two passes.
        while True:
            if self._next >= len(self._order):
                self._rng.shuffle(self._order)
                self._next = 0
                self.passes += 1
            node_id = self._order[self._next]
            self._next += 1
            if self._members[node_id].state != "dead":
                return node_id

    def _current(self, probe_id: int, direct: bool) -> _InFlight | None:
        flight = self._in_flight
        if flight is None or flight.probe.probe_id != probe_id or (
                (flight.relays is None) != direct):
            self.counters["results_ignored"] += 1
            return None
        return flight

    def direct_result(self, probe_id: int, ok: bool) -> IndirectPlan | None:
        """Report the direct pings: ``ok`` when any was acked (the probe ends, health -1).
        On a miss returns the indirect plan: up to ``indirect_checks`` random alive members
        other than the target. A result for no current direct probe is ignored (None)."""
        flight = self._current(probe_id, direct=True)
        if flight is None:
            return None
        if ok:
            self._in_flight = None
            self._adjust_health(-1)
            self._charged.pop(flight.probe.target, None)  # alive: its silence as a relay was ours
            return None
        self.counters["probe_misses"] += 1
        target = flight.probe.target
        relays = self._alive_relays(target)
        flight.relays = relays
        self.counters["indirect_probes"] += 1
        return IndirectPlan(probe_id, target, relays,
                            self.settings.indirect_timeout_ms * (self._score + 1))

    def indirect_result(self, probe_id: int, acks: int, nacks: int,
                        silent: Collection[NodeId] | None = None) -> Suspected | None:
        """Report the relays' answers within the plan's timeout: ``acks`` relays reached the
        target, ``nacks`` answered without reaching it, the rest were silent. Any ack: the
        target is alive (health -1). None: each silent relay costs health +1 (``silent``
        names them, so that the charge is given back if one is found suspect or dead first;
        +1 when there were no relays), and the target becomes suspect: :class:`Suspected`
        ``by_self`` is returned, unless this node already suspects it or a newer incarnation
        of it was accepted since the probe started (module docstring). Raises ValueError when
        the counts are negative or exceed the relays."""
        flight = self._current(probe_id, direct=False)
        if flight is None:
            return None
        assert flight.relays is not None
        if acks < 0 or nacks < 0 or acks + nacks > len(flight.relays):
            raise ValueError(f"acks={acks}, nacks={nacks} for {len(flight.relays)} relays")
        self._in_flight = None
        if acks > 0:
            self._adjust_health(-1)
            return None
        target = flight.probe.target
        member = self._members[target]
        if member.leaving:  # it said it goes: its silence says nothing of this node's path
            self.counters["leaving_misses"] += 1
        else:
            # No ack: the relays that answered nack vouch for this node's own path, so the
            # miss costs only the silent ones; with no relay to ask, the miss itself costs 1.
            self._adjust_health(len(flight.relays) - nacks if flight.relays else 1)
            for relay in silent or ():
                if relay in flight.relays and relay in self._members:
                    self._charged[relay] = self._charged.get(relay, 0) + 1
        if member.incarnation > flight.incarnation:  # heard alive since the first ping
            self.counters["probes_outdated"] += 1
            return None
        if member.state == "dead" or self.self_id in member.suspectors:
            return None
        self.counters["suspicions_raised"] += 1
        self._suspect(target, member, member.incarnation, self.self_id)
        return Suspected(target, member.incarnation, by_self=True)

    # -- suspicion ------------------------------------------------------------------------

    def _suspect(self, node_id: NodeId, member: _Member, incarnation: Incarnation,
                 by: str) -> bool:
        """Start or confirm a suspicion; True when it started."""
        member.incarnation = max(member.incarnation, incarnation)
        if member.state == "suspect":
            if by not in member.suspectors:
                member.suspectors += (by,)
                self.counters["confirmations"] += 1
            return False
        self._set_state(node_id, member, "suspect")
        member.suspected_at, member.suspectors = self._clock(), (by,)
        member.n_at_suspicion = len(self._members) - len(self._dead) + 1
        return True

    def suspect(self, node_id: NodeId, incarnation: Incarnation, by: str) -> Event | None:
        """A verified claim by ``by`` that ``node_id`` at ``incarnation`` is suspect. Returns
        :class:`Suspected` (not ``by_self``) when a suspicion starts, :class:`Refute` for a
        claim about this node, else None (a confirmation, or ignored: see module docstring)."""
        if node_id == self.self_id:
            if self._self_incarnation is not None and incarnation < self._self_incarnation:
                self.counters["claims_ignored"] += 1
                return None
            self.counters["refutes"] += 1
            self._adjust_health(1)
            return Refute(incarnation)
        member = self._members.get(node_id)
        if (member is None or member.state == "dead" or by == node_id
                or incarnation < member.incarnation):
            self.counters["claims_ignored"] += 1
            return None
        if self._suspect(node_id, member, incarnation, by):
            return Suspected(node_id, member.incarnation, by_self=by == self.self_id)
        return None

    def tick(self, now: float) -> list[Dead]:
        """Expire suspicions whose timeout (module docstring) has passed at ``now`` (ms)."""
        events: list[Dead] = []
        for node_id in sorted(self._suspects):
            member = self._members[node_id]
            timeout = suspicion_timeout_ms(member.n_at_suspicion, len(member.suspectors) - 1,
                                           self.settings)
            if member.suspected_at is not None and now >= member.suspected_at + timeout:
                self._set_state(node_id, member, "dead")
                self.counters["deaths"] += 1
                events.append(Dead(node_id, member.incarnation))
        return events
