"""The ``gangs`` extension this node publishes (docs/mesh.md, "Gangs"; issue 21).

One :class:`~viiwork.mesh.extensions.GangMember` per gang this node takes part in: rank 0 for
each gang model it heads while that gang is current (agent/gang/head.py), its rank for each
gang whose parts run here at a head's request (agent/gang/worker.py). The mesh link asks for
them once per gossip round and publishes a new summary only when the list changed (a gang
started or stopped, a new gang id), like the other extensions.
"""

from __future__ import annotations

from collections.abc import Iterable

from viiwork.mesh.extensions import MAX_GANG_MEMBERS, GangMember, Gangs


def gangs_of(members: Iterable[GangMember]) -> Gangs | None:
    """The extension's value: ``members`` in a stable order (model, rank), at most
    :data:`~viiwork.mesh.extensions.MAX_GANG_MEMBERS` (the schema caps gang entries far below
    it); None when there are none (the extension is left out)."""
    ordered = sorted(set(members), key=lambda m: (m.model, m.rank, m.gang, m.leader))
    return Gangs(tuple(ordered[:MAX_GANG_MEMBERS])) if ordered else None
