"""One node per identity: two running boots of one node id (docs/mesh.md, "One node per identity").

A node's identity is its key. When a state dir is copied to a second machine, two agents
publish under one node id, each with its own boot (the random ``boot`` nonce of its summaries)
and usually its own address. Each sees the other's summaries outrank its own and raises its
generation past them (:mod:`viiwork.mesh.boot`), so they race each other without end and
peers' view of the node flips between the two.

The rule, pure and shared by the node itself and its peers: record, per boot of a node id,
the span of publication times seen (``first_ms`` .. ``last_ms``, local monotonic ms).
``first_ms`` is when this node first *received* a summary of that boot and never moves
earlier; ``last_ms`` the newest estimate (receive time minus the relayed ``age_ms``, never
before ``first_ms``). The ``age_ms`` a relay adds is not signed: trusted to start a span,
any member could stretch a restarted node's new boot back over its old one. Two boots are **in conflict** when both were
heard within ``dead_ms`` of now and their spans overlap by at least ``dead_ms``: both kept
publishing, at once, for longer than a peer is allowed to be silent before it is dead. Peers
mark the id ``conflict`` sooner, once the overlap reaches ``suspect_ms``, and so does the boot
that stays: they stop routing to it, and it reports the clone, before the other one leaves at
``dead_ms``. An honest restart overlaps by nothing, so the shorter bound costs no false alarm.

- A restart (old boot stopped, new boot started; same or new address) never overlaps: every
  publication of the old boot precedes the first one of the new boot. The same holds when
  the boot file was lost and the new boot outranks the old one's last summaries.
- A clone overlaps by as long as both run: detected ``dead_ms`` after the later one started.
- Nothing a member can send makes a stored summary count: the node itself only counts
  another boot's summaries that outrank its own current one (a stash of its previous run's
  summaries cannot, once it moved past them, one publication later), and peers only accept
  newer summaries. With spans starting at receive time, every summary of an old boot a peer
  accepts is received before the first one of the boot that outranks it, so no age, delay or
  replay a member chooses makes a restart overlap (docs/security.md, "Mesh members").

Between the two boots, the higher ``boot`` (compared as text: 16 hex digits) is the one that
leaves; both sides compute the same answer without talking.
"""

from __future__ import annotations

from dataclasses import dataclass

from viiwork.mesh.identity import NodeId

MAX_BOOTS = 4  # boots remembered per node id (a clone pair needs 2; the oldest is forgotten)


@dataclass(slots=True)
class BootSighting:
    """One boot of a node id as seen here: its advertised mesh ``address``, the newest
    ``order`` (generation, seq) seen of it, and the estimated publication times (local
    monotonic ms) of the first and newest summaries seen of it."""

    boot: str
    address: str
    order: tuple[int, int]
    first_ms: float
    last_ms: float


@dataclass(frozen=True, slots=True)
class IdentityConflict:
    """Two boots of ``node_id`` publishing at once. ``boot``/``address``: the other boot
    (for the node itself) or the boot not held now (for a peer); ``other_boot``/
    ``other_address``: the remaining one (this node's own, for the node itself);
    ``overlap_ms``: how long both were seen publishing at once; ``leaves``: the boot that
    must stop (the higher of the two)."""

    node_id: NodeId
    boot: str
    address: str
    other_boot: str
    other_address: str
    overlap_ms: float

    @property
    def leaves(self) -> str:
        return max(self.boot, self.other_boot)

    def doc(self) -> dict[str, object]:
        return {"node_id": self.node_id, "boots": {self.boot: self.address, self.other_boot: self.other_address},
                "overlap_ms": round(self.overlap_ms), "leaves": self.leaves}


def overlap_ms(a: BootSighting, b: BootSighting) -> float:
    """How long ``a`` and ``b`` were both seen publishing (negative: one ended before the
    other began, as in a restart)."""
    return min(a.last_ms, b.last_ms) - max(a.first_ms, b.first_ms)


class BootTracker:
    """The boots of one node id seen publishing (at most :data:`MAX_BOOTS`)."""

    __slots__ = ("boots",)

    def __init__(self) -> None:
        self.boots: dict[str, BootSighting] = {}

    def is_news(self, boot: str, order: tuple[int, int]) -> bool:
        """True when ``order`` is newer than anything seen of ``boot`` (worth verifying)."""
        seen = self.boots.get(boot)
        return seen is None or order > seen.order

    def see(self, boot: str, address: str, order: tuple[int, int], published_ms: float,
            received_ms: float | None = None) -> None:
        """A verified summary of ``boot`` published at ``published_ms`` (local estimate from a
        relayed age) and received at ``received_ms`` (default ``published_ms``: a summary of
        this node's own). A boot's span starts when it was first received, whatever the age."""
        seen = self.boots.get(boot)
        if seen is None:
            if len(self.boots) >= MAX_BOOTS:
                del self.boots[min(self.boots.values(), key=lambda s: s.last_ms).boot]
            first = published_ms if received_ms is None else received_ms
            self.boots[boot] = BootSighting(boot, address, order, first, first)
            return
        seen.address = address
        seen.order = max(seen.order, order)
        seen.last_ms = max(seen.last_ms, published_ms)

    def conflict(self, node_id: NodeId, now: float, dead_ms: float, of: str | None = None,
                 min_overlap_ms: float | None = None) -> IdentityConflict | None:
        """Two boots heard within ``dead_ms`` of ``now`` whose publications overlap by at
        least ``min_overlap_ms`` (default ``dead_ms``; peers pass ``suspect_ms``: the module
        doc), or None. With ``of``, only conflicts of that boot (the node itself: its own
        boot) are considered; of several, the longest."""
        need = dead_ms if min_overlap_ms is None else min_overlap_ms
        live = [s for s in self.boots.values() if now - s.last_ms < dead_ms]
        best: IdentityConflict | None = None
        for i, a in enumerate(live):
            for b in live[i + 1:]:
                if of is not None and of not in (a.boot, b.boot):
                    continue
                span = overlap_ms(a, b)
                if span < need or (best is not None and span <= best.overlap_ms):
                    continue
                other, mine = (a, b) if b.boot == of else (b, a)
                best = IdentityConflict(node_id, other.boot, other.address, mine.boot, mine.address, span)
        return best


__all__ = ["BootSighting", "BootTracker", "IdentityConflict", "MAX_BOOTS", "overlap_ms"]
