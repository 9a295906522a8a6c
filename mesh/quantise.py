"""Published load that changes less often: quantised free slots, queue presence, a rate limit.

Every signed summary a node publishes costs one signature verification at every other node
(docs/mesh.md, "Gossip: signed capacity summaries"), while a node's true free-slot count
changes about twice a second (requests start and end). This module decides *what* load a
node publishes (:class:`LoadQuantiser`) and *when* a load-only change may go out
(:class:`PublishLimiter`); docs/mesh.md, "Publication rate (protocol 4)", has the same rules
for operators. Pure: no clock of its own, times are passed in ms (monotonic).

**Free slots in buckets.** ``free = slots - busy`` is published as the lower bound of its
bucket: 0 and 1 exactly (0, full, is what routing most needs), then powers of two
``[2,3] [4,7] [8,15] ...``. The published ``busy`` is ``slots - published_free``, so a
router never sees more free slots than the node had when it published.

**Hysteresis (a Schmitt trigger) on the way up only.** Between buckets from ``[2,3]`` up,
the published bucket rises to a bucket with lower bound ``lo`` only once the true free count
reaches ``lo + margin(lo)``, ``margin(lo) = max(1, lo // 4)`` (``[4,7]`` at 5, ``[8,15]`` at
10, ``[32,63]`` at 40); it falls as soon as the true count drops below the published lower
bound. So the two thresholds of a boundary are ``lo + margin`` (up) and ``lo - 1`` (down): a
count that wanders by up to ``margin`` values around a boundary makes at most one change, and
the margin never hides a slot that is taken. Putting the band on the upper side, not around
the boundary, keeps the conservative rule without exception: the published free count is
never above the true one at the moment of publication (a free slot that is not there costs a
refused forward; one that is there and unpublished costs a little spread, which slot offers,
``viiwork.agent.peering.offers``, recover). Reaching 0 or 1 free, and leaving 0 or 1, is
always immediate and exact; so is reaching every slot free (``free == slots``: an idle model,
the best target a router can have, whose bucket's margin may lie above ``slots``: with 4
slots, ``[4,7]`` would need 5 free and could never be published).

**Queue presence.** ``waiting`` None stays None (unknown is never 0), 0 stays 0, more than 0
is published as 1: a router needs "someone is queued there", not how many.

Everything else of a model (name, engine, kind, slots, ctx_per_slot, healthy, total,
fingerprint) passes through exactly; a change there is *structural* (:func:`compare_models`)
and is published at once. GPU ``memory_free_mib`` is already in 64 MiB steps
(``viiwork.agent.peering.mesh_link``), so GPUs are not quantised here.

**Rate limit.** A load-only change is published at most once per
``interval_ms(n_live) = max(min_interval_ms, n_live * 1000 / mesh_publications_per_s(n_live))``
after the node's previous publication, with a mesh-wide budget
``mesh_publications_per_s(n) = max(40, n / 10)`` load publications per second (each node takes
its ``1/n`` share). Every node verifies every publication once, so the budget is also the
verifications per node per second that load publications cost (a republication for liveness
alone, today's heartbeat, is outside it: change-only dissemination, issue 16 item 2, drops
it). Against the goals of issue 16
(<= 50 verifications/s per node at 10 and 100 nodes, <= 200 at 1,000):

- 10 nodes: budget 40/s (interval 250 ms, the floor), goal 50: 10/s left;
- 100 nodes: budget 40/s (interval 2.5 s), goal 50: 10/s left;
- 1,000 nodes: budget 100/s (interval 10 s), goal 200: 100/s left.

The headroom is for structural publications (a backend starting, a drain), which are not
limited. A flat budget of 40/s would mean a 25 s interval at 1,000 nodes; growing it with
``n / 10`` from 400 nodes on holds every node's load at most 10 s old between publications
(slot offers hand a freed slot over in the meantime) while staying at half the 1,000-node
goal. At 1,000 nodes bytes bind before verifications: each publication costs every node
~400 bytes (its news sent 8 times, a pull, a record), so ``n / 8`` (125/s) came to ~57 kB/s
per node at the cap, over issue 16's 50 kB/s, and ``n / 10`` to ~45 kB/s
(docs/benchmarks-mesh.md, "The news queue at 1,000 nodes"); the routing simulation's goal
still holds at a 10 s interval (docs/benchmarks-routing.md). The floor of 250 ms is half a
gossip round (``gossip_interval_ms`` 500): a change is never held for more than one round at
10 nodes. These are upper bounds; with quantisation a
node changes bucket much less often than twice a second, so the measured rate is lower
(``tests/mesh/test_quantise.py`` prints it).

No jitter: each node's interval starts at its own last publication, which its own load
changes trigger, so the nodes' publication times do not line up (nothing mesh-wide starts
all the intervals at once, except a whole-fleet restart, where the first publications are
structural anyway).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from viiwork.mesh.summary import ModelCapacity

DEFAULT_MIN_INTERVAL_MS = 250.0  # half a gossip round (gossip_interval_ms 500)
DEFAULT_BUDGET_FLOOR_PER_S = 40.0  # mesh-wide load publications per second, any mesh size
DEFAULT_BUDGET_PER_NODE_PER_S = 1.0 / 10.0  # ... growing with n from 400 nodes: one per node per 10 s


def free_bucket(free: int) -> tuple[int, int]:
    """The bucket ``(lower, upper)`` (inclusive) of a free-slot count: ``(0, 0)``, ``(1, 1)``,
    then ``(2, 3)``, ``(4, 7)``, ``(8, 15)``, ... ValueError for a negative count."""
    if free < 0:
        raise ValueError(f"free slots must be >= 0, got {free}")
    if free <= 1:
        return (free, free)
    lower = 1 << (free.bit_length() - 1)
    return (lower, 2 * lower - 1)


def hysteresis_margin(lower: int) -> int:
    """Free slots above ``lower`` (a bucket's lower bound, >= 2) that the true count must
    reach before that bucket is published, coming from a lower one: ``max(1, lower // 4)``."""
    return max(1, lower // 4)


def _quantised_free(free: int, previous: int | None, slots: int) -> int:
    """The published free count for a true ``free`` of ``slots``, given the one published
    before (``previous``, None for a model not seen yet); see the module doc."""
    if free >= slots:
        return free  # every slot free: exact and immediate
    lower, _ = free_bucket(free)
    if free <= 1 or previous is None or previous <= 1 or free < previous:
        return lower  # exact at 0 and 1; immediate from 0/1 and on the way down
    # free >= previous: rise only to a bucket whose margin the true count has passed.
    if free < lower + hysteresis_margin(lower):
        lower //= 2
    return max(free_bucket(previous)[0], lower)  # previous may be an exact "every slot free"


class LoadQuantiser:
    """Maps this node's true :class:`ModelCapacity` tuples to the ones it publishes.

    Keeps, per model name, the free count it last returned (the hysteresis state); a model
    missing from a call is forgotten (if it comes back, it starts afresh, without hysteresis).
    Not thread-safe; one instance per publishing node.
    """

    def __init__(self) -> None:
        self._free: dict[str, int] = {}

    def quantise(self, models: Iterable[ModelCapacity]) -> tuple[ModelCapacity, ...]:
        """The published form of ``models``, in the same order: ``busy = slots -
        quantised free``, ``waiting`` as presence (None, 0 or 1), all other fields as given.
        Raises ValueError when a model name appears twice (a summary holds each once)."""
        out: list[ModelCapacity] = []
        seen: dict[str, int] = {}
        for model in models:
            if model.name in seen:
                raise ValueError(f"model {model.name!r} appears twice")
            free = _quantised_free(model.free, self._free.get(model.name), model.slots)
            seen[model.name] = free
            waiting = None if model.waiting is None else min(model.waiting, 1)
            out.append(dataclasses.replace(model, busy=model.slots - free, waiting=waiting))
        self._free = seen
        return tuple(out)

    def published_free(self, name: str) -> int | None:
        """The free count last returned for model ``name``; None when not held."""
        return self._free.get(name)


@dataclass(frozen=True, slots=True)
class ModelsChange:
    """How a quantised model tuple differs from the last published one: ``structural``
    (a model added, removed or reordered, or a field other than ``busy``/``waiting``
    changed) and ``load`` (``busy`` or ``waiting`` of a model present in both changed)."""

    structural: bool
    load: bool


_LOAD_FIELDS = ("busy", "waiting")


def compare_models(published: Sequence[ModelCapacity], quantised: Sequence[ModelCapacity]) -> ModelsChange:
    """Compare the models last published with the newly quantised ones (both as a summary
    holds them: sorted by name). The node's ``state`` and GPUs are the caller's to compare."""
    structural = [m.name for m in published] != [m.name for m in quantised]
    load = False
    before = {m.name: m for m in published}
    for new in quantised:
        old = before.get(new.name)
        if old is None or old == new:
            continue
        if (old.busy, old.waiting) != (new.busy, new.waiting):
            load = True
        if dataclasses.replace(old, busy=new.busy, waiting=new.waiting) != new:
            structural = True
    return ModelsChange(structural=structural, load=load)


class PublishLimiter:
    """Decides when a node may publish a load-only change (module doc, "Rate limit").

    ``min_interval_ms``: the shortest interval between a node's publications of load
    (default 250 ms); ``budget_floor_per_s`` and ``budget_per_node_per_s``: the mesh-wide
    budget of load publications per second, ``max(floor, n_live * per_node)`` (defaults 40
    and 1/8). Raises ValueError for a value that is not > 0. Times are monotonic ms.
    """

    def __init__(self, min_interval_ms: float = DEFAULT_MIN_INTERVAL_MS,
                 budget_floor_per_s: float = DEFAULT_BUDGET_FLOOR_PER_S,
                 budget_per_node_per_s: float = DEFAULT_BUDGET_PER_NODE_PER_S) -> None:
        for name, value in (("min_interval_ms", min_interval_ms), ("budget_floor_per_s", budget_floor_per_s),
                            ("budget_per_node_per_s", budget_per_node_per_s)):
            if not value > 0:
                raise ValueError(f"{name} must be > 0, got {value!r}")
        self.min_interval_ms = min_interval_ms
        self.budget_floor_per_s = budget_floor_per_s
        self.budget_per_node_per_s = budget_per_node_per_s
        self.last_published_ms: float | None = None
        self._held_back = False

    def mesh_publications_per_s(self, n_live: int) -> float:
        """The mesh-wide budget of load publications per second for ``n_live`` live nodes
        (this one included; below 1 counts as 1)."""
        return max(self.budget_floor_per_s, max(1, n_live) * self.budget_per_node_per_s)

    def interval_ms(self, n_live: int) -> float:
        """The shortest time between this node's publications of a load-only change, in ms:
        ``max(min_interval_ms, n_live * 1000 / mesh_publications_per_s(n_live))``."""
        n = max(1, n_live)
        return max(self.min_interval_ms, n * 1000.0 / self.mesh_publications_per_s(n))

    @property
    def held_back(self) -> bool:
        """A load change was reported and has not been published yet."""
        return self._held_back

    def due(self, now_ms: float, n_live: int, structural: bool, load_changed: bool) -> bool:
        """Should the node publish now? True at once for a ``structural`` change; for a load
        change (``load_changed`` now, or one reported earlier and held back) once
        ``interval_ms(n_live)`` has passed since the last :meth:`published` (at once before
        the first). A held-back change stays due on later calls with ``load_changed`` False,
        so a caller that polls every round publishes it when its interval ends. False when
        nothing changed. Records the held-back change; the caller calls :meth:`published`
        when it publishes."""
        if structural:
            return True
        if load_changed:
            self._held_back = True
        if not self._held_back:
            return False
        return self.last_published_ms is None or now_ms - self.last_published_ms >= self.interval_ms(n_live)

    def published(self, now_ms: float) -> None:
        """Record a publication at ``now_ms`` (any: structural, load or heartbeat; each one
        carries the latest quantised load, so nothing is held back after it)."""
        self.last_published_ms = now_ms
        self._held_back = False
