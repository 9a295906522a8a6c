"""Usage across the mesh: ``viiworkctl usage --mesh`` (docs/usage.md, "Across the mesh").

Each node answers ``GET /mesh/v1/usage?since_ms=MS&by=tenant|model|node`` on its mesh listener
(mutual TLS, members only) with the parts of its own ledger (``agent/usage/query.py``,
``summarise_parts``): read-only, off the event loop, at most MAX_PART_GROUPS groups. The node
the operator asks (through its admin socket: :meth:`MeshUsage.gather`) reads its own file, asks
every peer it does not hold dead or gone at once, and merges. A row is written only by the node
that served the request, into its own file, and each node is asked once (peers are keyed by
node id), so each row is counted once; a node that does not answer is named in the answer, its
rows missing. A peer's group whose key is not printable text (``GroupKeyRefused``: a control
character, an escape sequence) is dropped and counted (``refused_groups`` in the answer, and
``MeshUsage.refused_groups``); the CLI prints every key as text, never as markup.
"""

from __future__ import annotations

import asyncio
import json
import logging
import sqlite3
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import aiohttp
from aiohttp import web

from viiwork.agent.peering.mesh_link import MeshLink, PeerTarget, read_bounded
from viiwork.agent.serving.errors import ErrorCode, error_response
from viiwork.agent.usage.query import MAX_KEY_CHARS, Grouping, GroupKeyRefused, GroupPart, merge, summarise_parts
from viiwork.agent.usage.store import SchemaNewer, open_read_only
from viiwork.mesh.dialing import expect_node
from viiwork.mesh.membership import Liveness
from viiwork.mesh.transport import peer_of

log = logging.getLogger(__name__)

USAGE_PATH = "/mesh/v1/usage"
#: A node's answer is read up to this (MAX_PART_GROUPS groups of ~60 buckets fit with room).
MAX_ANSWER_BYTES = 8 * 1024 * 1024
#: How long a peer may take to read its file and answer.
PEER_TIMEOUT_S = 10.0
ASKED = frozenset({Liveness.ALIVE, Liveness.SUSPECT})


class UsageQueryError(ValueError):
    """A query that is not one (a bad ``since_ms`` or ``by``); the message says which."""


def parse_query(query: Mapping[str, str]) -> tuple[int, Grouping]:
    """``since_ms`` (Unix ms, >= 0; default 0: all) and ``by`` (default tenant) of a query."""
    raw = query.get("since_ms", "0")
    if not raw.isdigit() or len(raw) > 16:
        raise UsageQueryError(f"since_ms must be Unix milliseconds (an integer >= 0), got {raw[:20]!r}")
    try:
        by = Grouping(query.get("by", "tenant"))
    except ValueError:
        raise UsageQueryError(f"by must be one of {', '.join(g.value for g in Grouping)}") from None
    return int(raw), by


def read_parts(path: Path, since_ms: int, by: Grouping) -> tuple[list[GroupPart], int]:
    """This node's parts from its usage file (read-only). Raises sqlite3.Error, SchemaNewer."""
    conn = open_read_only(path)
    try:
        return summarise_parts(conn, since_ms, by)
    finally:
        conn.close()


def decode_parts(groups: list[Any]) -> tuple[list[GroupPart], int]:
    """A peer's ``groups`` as parts, and how many were dropped for their key
    (GroupKeyRefused). Raises ValueError for any other group that is not a part."""
    parts: list[GroupPart] = []
    refused = 0
    for doc in groups:
        try:
            parts.append(GroupPart.from_dict(doc))
        except GroupKeyRefused:
            refused += 1
    return parts, refused


class MeshUsage:
    """The usage route of this node's mesh listener, and the gathering over peers (module doc).
    ``ledger_path``: this node's usage file. Construct before ``mesh.start()``."""

    def __init__(self, mesh: MeshLink, ledger_path: Path) -> None:
        self.mesh = mesh
        self.ledger_path = ledger_path
        self.answered = 0
        # Peers' groups dropped for their key (GroupKeyRefused), since the start.
        self.refused_groups = 0
        mesh.node.app.router.add_get(USAGE_PATH, self.handle_usage)

    async def _own(self, since_ms: int, by: Grouping) -> tuple[list[GroupPart], int, int]:
        parts, left_out = await asyncio.to_thread(read_parts, self.ledger_path, since_ms, by)
        return parts, left_out, 0

    async def handle_usage(self, request: web.Request) -> web.Response:
        """GET /mesh/v1/usage from a peer: ``{"node", "groups": [part], "left_out"}``."""
        if peer_of(request) is None:
            return error_response(400, "no verified peer certificate", code=ErrorCode.INVALID_MESSAGE)
        try:
            since_ms, by = parse_query(request.query)
        except UsageQueryError as exc:
            return error_response(400, str(exc), code=ErrorCode.INVALID_MESSAGE)
        try:
            parts, left_out, _ = await self._own(since_ms, by)
        except (sqlite3.Error, SchemaNewer) as exc:
            return error_response(503, f"cannot read the usage file: {exc}")
        self.answered += 1
        return web.json_response({"node": self.mesh.config.node.name, "groups": [p.as_dict() for p in parts],
                                  "left_out": left_out})

    async def gather(self, query: Mapping[str, str]) -> dict[str, Any]:
        """The admin socket's ``usage``: every node's parts merged. Returns ``{"since_ms", "by",
        "nodes": {name: "ok" | why not}, "groups": [SummaryRow.as_dict()], "left_out"}``.
        Raises UsageQueryError."""
        since_ms, by = parse_query(query)
        targets = [PeerTarget.of(v) for v in self.mesh.node.peers() if v.liveness in ASKED and v.mesh]
        answers = await asyncio.gather(self._own(since_ms, by), *(self._ask(t, since_ms, by) for t in targets),
                                       return_exceptions=True)
        nodes: dict[str, str] = {}
        parts: list[GroupPart] = []
        left_out = refused = 0
        for name, answer in zip([self.mesh.config.node.name] + [t.id for t in targets], answers, strict=True):
            if isinstance(answer, BaseException):
                if not isinstance(answer, Exception):
                    raise answer
                nodes[name] = f"failed: {answer}"
                continue
            parts.extend(answer[0])
            left_out += answer[1]
            refused += answer[2]
            nodes[name] = "ok"
        return {"since_ms": since_ms, "by": by.value, "nodes": nodes,
                "groups": [r.as_dict() for r in merge(parts)], "left_out": left_out, "refused_groups": refused}

    async def _ask(self, target: PeerTarget, since_ms: int, by: Grouping) -> tuple[list[GroupPart], int, int]:
        session = self.mesh.session
        if session is None:
            raise RuntimeError("the mesh is not started")
        try:
            async with session.get(target.base_url + USAGE_PATH, params={"since_ms": str(since_ms), "by": by.value},
                                   headers=expect_node(target.node_id),
                                   timeout=aiohttp.ClientTimeout(total=PEER_TIMEOUT_S)) as resp:
                raw = await read_bounded(resp.content, MAX_ANSWER_BYTES)
                if resp.status != 200:
                    raise RuntimeError(f"answered {resp.status}: {raw[:200].decode(errors='replace')}")
                if len(raw) > MAX_ANSWER_BYTES:
                    raise RuntimeError(f"answer over {MAX_ANSWER_BYTES} bytes")
        except (aiohttp.ClientError, OSError, TimeoutError, RuntimeError) as exc:  # RuntimeError: session closed
            raise RuntimeError(str(exc) or type(exc).__name__) from None
        try:
            doc = json.loads(raw)
            groups = doc["groups"]
            left_out = doc["left_out"]
            if not isinstance(groups, list) or not isinstance(left_out, int):
                raise ValueError("groups must be a list, left_out an integer")
            parts, refused = decode_parts(groups)
        except (ValueError, KeyError, TypeError, RecursionError) as exc:
            raise RuntimeError(f"not a usage answer: {exc}") from None
        if refused:
            self.refused_groups += refused
            log.warning("usage from %s: %d group(s) dropped for a key with a control character or over %d "
                        "characters", target.id, refused, MAX_KEY_CHARS)
        return parts, left_out, refused
