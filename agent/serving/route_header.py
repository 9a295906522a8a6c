"""``X-Viiwork-Route``: the rule that placed a request, on every hop (docs/routing.md,
"Explaining a route").

The value is a list of hops, origin first, separated by ``", "``; each hop is
``NODE:RULE[ key=value]``, e.g. ``a:prefix-hit blocks=4, b:prefix-hit blocks=4`` (node ``a``
forwarded it to ``b`` for a 4-block hit, and ``b`` gave it the local backend holding them). The
rules: ``pinned``, ``affinity``, ``prefix-hit blocks=N``, ``predicted-ttft``, ``least-loaded``,
``probe``, ``queued``, ``offer``, ``free-slot`` (a forward took the most free backend).

The origin sends its hop with a forward; the serving node appends its own and answers the
whole value, which the origin relays to the client. What a peer sends is held to
:data:`MAX_ROUTE_CHARS` printable ASCII characters, else dropped (only the serving hop is
answered).
"""

from __future__ import annotations

ROUTE_HEADER = "X-Viiwork-Route"
MAX_ROUTE_CHARS = 512


def route_entry(node: str, rule: str) -> str:
    """One hop: ``node:rule``."""
    return f"{node}:{rule}"


def route_from_origin(incoming: str | None, own: str) -> str:
    """The value a serving node answers: the origin's hops (``incoming``, when well formed:
    printable ASCII, at most :data:`MAX_ROUTE_CHARS` with ``own``), then ``own``."""
    if not incoming or len(incoming) + len(own) + 2 > MAX_ROUTE_CHARS \
            or not all(" " <= ch <= "~" for ch in incoming):
        return own
    return f"{incoming}, {own}"


__all__ = ["MAX_ROUTE_CHARS", "ROUTE_HEADER", "route_entry", "route_from_origin"]
