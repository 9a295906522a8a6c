"""Names and labels of a gang's parts on a host (docs/engines.md, "Gangs"; issue 21).

A part runs as a transient unit ``viiwork-gang-<model>-<gang id>-r<rank>-<role>.service`` in
``viiwork-engines.slice``, like a one-host backend's ``viiwork-engine-<node>-<model>-<n>``
(agent/supervision/runners/systemd/units.py), with the model escaped the same way. The prefix
is not ``viiwork-engine-``: adoption of one-host backends lists that prefix and would take a
gang's part for a stale backend; the gang launcher adopts ``viiwork-gang-*`` itself. The gang
id, rank, role and size travel as labels (``VIIWORK_GANG``, ``VIIWORK_GANG_RANK``, ...) in the
unit's environment, so a restarted agent can read back which gang a running part belongs to.
Pure functions.
"""

from __future__ import annotations

from collections.abc import Mapping

from viiwork.agent.supervision.runners.systemd.units import escape_unit_component
from viiwork.engines.gang import GangPart, PartRole, is_gang_id

#: Unit names of gang parts start with this.
GANG_UNIT_PREFIX = "viiwork-gang-"


def gang_unit_stem(model: str, gang_id: str, part: GangPart) -> str:
    """``viiwork-gang-<model>-<gang id>-r<rank>-<role>`` (model escaped: escape_unit_component).
    Raises ValueError for a gang id ``new_gang_id`` did not make."""
    if not is_gang_id(gang_id):
        raise ValueError(f"not a gang id: {gang_id!r}")
    return f"{GANG_UNIT_PREFIX}{escape_unit_component(model)}-{gang_id}-r{part.rank}-{part.role.value}"


def gang_labels(owner: str, model: str, gang_id: str, part: GangPart, size: int, shared_hash: str,
                head: str = "") -> dict[str, str]:
    """The labels of a part's unit: owner node, model, gang id, rank, role, size, the shared
    part's hash (agent/config/gang.py), so adoption can tell a part of another entry, and on a
    worker the ``gang_head`` node id it serves (a restarted worker's agent adopts by them)."""
    labels = {"owner": owner, "model": model, "gang": gang_id, "gang_rank": str(part.rank),
              "gang_role": part.role.value, "gang_size": str(size), "gang_shared_hash": shared_hash}
    if head:
        labels["gang_head"] = head
    return labels


def part_of_labels(labels: Mapping[str, str]) -> tuple[str, GangPart] | None:
    """``(gang id, part)`` read back from a unit's labels; None when they are not a gang part's
    (missing or malformed: such a unit is not adopted as one)."""
    gang_id, rank, role = labels.get("gang", ""), labels.get("gang_rank", ""), labels.get("gang_role", "")
    if not is_gang_id(gang_id) or not (rank.isascii() and rank.isdigit()) or role not in PartRole.__members__.values():
        return None
    return gang_id, GangPart(int(rank), PartRole(role))


#: The role label of a tunnel end's process (agent/gang/tunnel_process.py): not an engine part
#: (engines/gang.py ``PartRole``), the agents' own carrier of a part's stream.
TUNNEL_ROLE = "tunnel"


def tunnel_unit_stem(model: str, gang_id: str, rank: int, end: str) -> str:
    """``viiwork-gang-<model>-<gang id>-r<rank>-tunnel-<end>``: the head's tunnel ``entry`` to
    rank ``rank``, or that worker's ``exit`` (distinct names: two agents of one machine may
    share a service manager). Raises ValueError for a gang id ``new_gang_id`` did not make or
    another end."""
    if not is_gang_id(gang_id):
        raise ValueError(f"not a gang id: {gang_id!r}")
    if end not in ("entry", "exit"):
        raise ValueError(f"not a tunnel end: {end!r}")
    return f"{GANG_UNIT_PREFIX}{escape_unit_component(model)}-{gang_id}-r{rank}-{TUNNEL_ROLE}-{end}"


def tunnel_labels(owner: str, model: str, gang_id: str, rank: int, size: int, shared_hash: str, port: int,
                  peer: str) -> dict[str, str]:
    """A tunnel end's labels: those of a part (``gang_role`` ``tunnel``, ``gang_rank`` the
    worker's) plus the ``port`` it listens on and the ``gang_peer`` node id at its other end
    (the head's entry: the worker; a worker's exit: the head)."""
    return {"owner": owner, "model": model, "gang": gang_id, "gang_rank": str(rank), "gang_role": TUNNEL_ROLE,
            "gang_size": str(size), "gang_shared_hash": shared_hash, "port": str(port), "gang_peer": peer}


def tunnel_of_labels(labels: Mapping[str, str]) -> tuple[str, int, int] | None:
    """``(gang id, rank, port)`` of a tunnel unit's labels; None when they are not a tunnel's."""
    gang_id, rank, port = labels.get("gang", ""), labels.get("gang_rank", ""), labels.get("port", "")
    if (labels.get("gang_role") != TUNNEL_ROLE or not is_gang_id(gang_id) or not (rank.isascii() and rank.isdigit())
            or not (port.isascii() and port.isdigit()) or not 0 < int(port) < 65536):
        return None
    return gang_id, int(rank), int(port)
