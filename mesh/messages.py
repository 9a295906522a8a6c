"""Gossip messages and their JSON codec (bounded, strict, typed errors).

One exchange between an initiator A and a responder B (both over the mesh listener):

1. A -> B ``digest``: ``[[node_id, generation, seq], ...]`` for every node A holds (itself
   included, tombstones included). ``[id, 0, 0]`` means "I lack it, or lack its certificate".
2. B -> A ``reply``: the summaries B holds that A lacks or holds older (with B's certificate
   copy only where A's entry was ``[id, 0, 0]``: whoever holds any version of a node holds its
   certificate), and ``want``: the entries of A's digest that are newer than B's, in the
   same ``[id, generation, seq]`` shape (B's own version, or 0, 0 when B lacks the node).
3. A -> B ``push``: the wanted summaries.

So a newcomer catches up in one exchange, and summaries a peer already holds never travel.

Every relayed summary carries ``age_ms``: how long ago, by the relay's own monotonic clock,
the relay believes the origin published it (its own receive time minus the age it was
given, plus the time it held it). Ages are durations, not timestamps, so no clocks need to
agree; they let a receiver see that a "newer" summary held by a stale relay is in fact old
(docs/architecture.md, rule 7). Protocol 1 messages carry no ``age_ms`` (read as 0).

Wire shapes (JSON objects; ``protocol`` is 1, 2 or 3 (3: as 2); ``mesh_id`` must be the receiver's):

    {"type": "digest", "protocol": 2, "mesh_id": "...", "entries": [["id", 3, 17], ...]}
    {"type": "reply", "protocol": 2, "mesh_id": "...", "summaries": [S, ...], "want": [["id", 3, 16], ...]}
    {"type": "push", "protocol": 2, "mesh_id": "...", "summaries": [S, ...]}

where ``S`` is ``{"payload": {...}, "sig": "...", "cert": "..." | null, "age_ms": 120}``
(:mod:`viiwork.mesh.summary`). A message larger than ``max_message_bytes`` or with more than
:data:`MAX_ENTRIES` entries is :class:`~viiwork.mesh.summary.OversizedSummary`; anything
mis-shaped is :class:`~viiwork.mesh.summary.MalformedSummary`. One bad summary inside a
good message is rejected on its own (listed in ``rejected`` with its reason); the rest of
the message is used.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, NamedTuple

from viiwork.mesh.bounds import MAX_INT
from viiwork.mesh.identity import NodeId, is_node_id
from viiwork.mesh.load_record import LoadRecord
from viiwork.mesh.summary import (
    MalformedSummary,
    OversizedSummary,
    SignedSummary,
    SummaryError,
    check_protocol,
    decode_summary,
    summary_to_obj,
)

MAX_MESSAGE_BYTES = 4 * 1024 * 1024
MAX_ENTRIES = 4096
MAX_AGE_MS = 7 * 24 * 3600 * 1000


Order = tuple[int, int]  # (generation, seq); (0, 0) in a digest = "lacks it"
Entries = dict[NodeId, Order]


class RelayedSummary(NamedTuple):
    """A summary as relayed: ``age_ms`` is the relay's estimate of time since publication."""

    summary: SignedSummary
    age_ms: int = 0


@dataclass(frozen=True, slots=True)
class Digest:
    """``entries``: node id -> the newest (generation, seq) the sender holds."""

    protocol: int
    mesh_id: str
    entries: Entries


@dataclass(frozen=True, slots=True)
class Reply:
    protocol: int
    mesh_id: str
    summaries: tuple[RelayedSummary, ...]
    wants: Entries  # node id -> the (generation, seq) the replier holds, (0, 0) when it lacks it
    rejected: tuple[str, ...] = ()  # reasons of summaries dropped while decoding


@dataclass(frozen=True, slots=True)
class Push:
    protocol: int
    mesh_id: str
    summaries: tuple[RelayedSummary, ...]
    rejected: tuple[str, ...] = ()


Message = Digest | Reply | Push


# --- probe mode (mesh/probing.py): SWIM probes with piggybacked news ----------------------------


@dataclass(frozen=True, slots=True)
class News:
    """A broadcast item: the sender holds ``node_id`` at ``order`` (a receiver that holds it
    older asks the sender for it with a :class:`Pull`)."""

    node_id: NodeId
    order: Order


@dataclass(frozen=True, slots=True)
class Claim:
    """A broadcast item: ``by`` suspects ``node_id`` at incarnation ``order``, signed by
    ``by``'s node key over :func:`claim_signing_input` (``signature``, 64 bytes)."""

    node_id: NodeId
    order: Order
    by: NodeId
    signature: bytes


Piggyback = tuple[News | Claim, ...]


@dataclass(frozen=True, slots=True)
class Ping:
    """Probe ``ping_id``: answer :class:`Ack` with the same id to the sender."""

    protocol: int
    mesh_id: str
    ping_id: int
    news: Piggyback = ()


@dataclass(frozen=True, slots=True)
class Ack:
    protocol: int
    mesh_id: str
    ping_id: int
    news: Piggyback = ()


@dataclass(frozen=True, slots=True)
class PingReq:
    """Ask the receiver to ping ``target`` (at ``address``) for the sender and answer
    :class:`Ack` (reached it) or :class:`Nack` (did not) with ``ping_id``."""

    protocol: int
    mesh_id: str
    ping_id: int
    target: NodeId
    address: str
    news: Piggyback = ()


@dataclass(frozen=True, slots=True)
class Nack:
    protocol: int
    mesh_id: str
    ping_id: int
    news: Piggyback = ()


@dataclass(frozen=True, slots=True)
class Gossip:
    """Broadcast items alone, sent to a few random live peers while any are queued."""

    protocol: int
    mesh_id: str
    news: Piggyback = ()


@dataclass(frozen=True, slots=True)
class Pull:
    """The summaries the sender wants (node id -> the version it holds, (0, 0) when it lacks
    the node): answered with a :class:`Push`."""

    protocol: int
    mesh_id: str
    wants: Entries


@dataclass(frozen=True, slots=True)
class Loads:
    """Load records (:mod:`viiwork.mesh.load_record`) answering a :class:`Pull`: the newest
    record the sender holds of each wanted node, where it is newer than that node's summary.
    ``rejected``: reasons of records dropped while decoding (the rest are used)."""

    protocol: int
    mesh_id: str
    records: tuple[LoadRecord, ...]
    rejected: tuple[str, ...] = ()


ProbeMessage = Ping | Ack | PingReq | Nack | Gossip | Pull | Loads

CLAIM_BYTES = 140  # '["c","<16>",g,sssss,"<16>","<88 base64>"],'
NEWS_BYTES = 19  # packed (probe_codec): 10-byte id + 1-byte generation + 3-byte seq, in base64
NEWS_PACK_BYTES = 9  # '["p",""],' around a message's packed news


def claim_signing_input(mesh_id: str, node_id: NodeId, order: Order, by: NodeId) -> bytes:
    """The bytes a suspicion claim's signature covers (domain-separated from summaries)."""
    return f"viiwork-suspect\0{mesh_id}\0{node_id}\0{order[0]}\0{order[1]}\0{by}".encode("ascii")


def item_size(item: News | Claim) -> int:
    """Estimated encoded size of one broadcast item (bytes)."""
    return NEWS_BYTES if isinstance(item, News) else CLAIM_BYTES


# --- encoding ---------------------------------------------------------------------------------


def _relayed_obj(item: RelayedSummary, protocol: int) -> dict[str, Any]:
    obj = summary_to_obj(item.summary)
    if protocol >= 2:
        obj["age_ms"] = int(min(max(item.age_ms, 0), MAX_AGE_MS))
    return obj


def _entries_obj(entries: Entries) -> list[list[Any]]:
    return [[nid, g, s] for nid, (g, s) in entries.items()]


def message_to_obj(msg: Message) -> dict[str, Any]:
    head: dict[str, Any] = {"protocol": msg.protocol, "mesh_id": msg.mesh_id}
    if isinstance(msg, Digest):
        return {"type": "digest", **head, "entries": _entries_obj(msg.entries)}
    if isinstance(msg, Reply):
        return {"type": "reply", **head, "summaries": [_relayed_obj(s, msg.protocol) for s in msg.summaries],
                "want": _entries_obj(msg.wants)}
    return {"type": "push", **head, "summaries": [_relayed_obj(s, msg.protocol) for s in msg.summaries]}


def encode_message(msg: Message) -> bytes:
    """Compact JSON bytes of a message."""
    return json.dumps(message_to_obj(msg), separators=(",", ":"), ensure_ascii=True).encode("ascii")


def estimate_size(msg: Message | ProbeMessage) -> int:
    """Approximate encoded size without encoding (the simulator's fast path): within a few
    percent of ``len(encode_message(msg))`` for typical messages."""
    if isinstance(msg, Pull):  # '{"type":"pull","protocol":4,"mesh_id":"","wants":[]}', then entries
        return 50 + len(msg.mesh_id) + NEWS_BYTES * len(msg.wants)  # packed like news (probe_codec)
    if isinstance(msg, Loads):  # '{"type":"loads","protocol":4,"mesh_id":"","records":[]}', then records
        return 54 + len(msg.mesh_id) + sum(r.wire_size() for r in msg.records)
    if isinstance(msg, Ping | Ack | PingReq | Nack | Gossip):
        extra = 0 if isinstance(msg, Gossip) else 8  # ',"id":N'
        if isinstance(msg, PingReq):
            extra += 40 + len(msg.address)  # ',"target":"<id>","address":"..."'
        news = sum(item_size(i) for i in msg.news)
        packed = NEWS_PACK_BYTES if news and any(isinstance(i, News) for i in msg.news) else 0
        return 52 + len(msg.mesh_id) + extra + news + packed
    head = 60 + len(msg.mesh_id)
    if isinstance(msg, Digest):
        return head + ENTRY_BYTES * len(msg.entries)
    size = head + sum(s.summary.wire_size() + 14 for s in msg.summaries)
    if isinstance(msg, Reply):
        size += ENTRY_BYTES * len(msg.wants)
    return size


ENTRY_BYTES = 30  # '["<16 chars>",g,sssss],' with a one-digit generation and a five-digit seq


# --- strict decoding --------------------------------------------------------------------------

_HEAD = {"digest": frozenset({"type", "protocol", "mesh_id", "entries"}),
         "reply": frozenset({"type", "protocol", "mesh_id", "summaries", "want"}),
         "push": frozenset({"type", "protocol", "mesh_id", "summaries"})}


def _decode_entries(value: Any, where: str) -> Entries:
    if not isinstance(value, list):
        raise MalformedSummary(f"{where}: expected a list")
    if len(value) > MAX_ENTRIES:
        raise OversizedSummary(f"{where}: {len(value)} entries, limit {MAX_ENTRIES}")
    out: Entries = {}
    for i, item in enumerate(value):
        if (not isinstance(item, list) or len(item) != 3 or not is_node_id(item[0])
                or any(not isinstance(x, int) or isinstance(x, bool) or not 0 <= x <= MAX_INT for x in item[1:])):
            raise MalformedSummary(f"{where}[{i}]: expected [node_id, generation, seq], got {item!r:.60}")
        if item[0] in out:
            raise MalformedSummary(f"{where}[{i}]: node {item[0]} listed twice")
        out[NodeId(item[0])] = (item[1], item[2])
    return out


def _decode_summaries(value: Any, protocol: int, accepted: tuple[int, ...]) -> tuple[tuple[RelayedSummary, ...], tuple[str, ...]]:
    if not isinstance(value, list):
        raise MalformedSummary("summaries: expected a list")
    if len(value) > MAX_ENTRIES:
        raise OversizedSummary(f"summaries: {len(value)} entries, limit {MAX_ENTRIES}")
    good: list[RelayedSummary] = []
    rejected: list[str] = []
    for item in value:
        try:
            if not isinstance(item, dict):
                raise MalformedSummary("summary: expected an object")
            age = 0
            if protocol >= 2:
                item = dict(item)
                age = item.pop("age_ms", None)
                if not isinstance(age, int) or isinstance(age, bool) or not 0 <= age <= MAX_AGE_MS:
                    raise MalformedSummary(f"summary.age_ms: expected an integer 0..{MAX_AGE_MS}, got {age!r:.40}")
            good.append(RelayedSummary(decode_summary(item, accepted), age))
        except SummaryError as exc:
            rejected.append(exc.reason)
    return tuple(good), tuple(rejected)


def decode_message(data: bytes, accepted: tuple[int, ...], expected: str | None = None,
                   max_message_bytes: int = MAX_MESSAGE_BYTES) -> Message:
    """Decode one message. ``accepted``: protocol versions this node speaks; ``expected``:
    the message type the endpoint takes (``digest``, ``reply``, ``push``) or None for any.
    Raises OversizedSummary, MalformedSummary (naming the field) or UnsupportedProtocol;
    never anything else for any input bytes."""
    if len(data) > max_message_bytes:
        raise OversizedSummary(f"message is {len(data)} bytes, limit {max_message_bytes}")
    try:
        obj = json.loads(data)
    except (ValueError, RecursionError) as exc:  # UnicodeDecodeError is a ValueError
        raise MalformedSummary(f"message: not JSON ({type(exc).__name__})") from None
    if not isinstance(obj, dict):
        raise MalformedSummary("message: expected a JSON object")
    kind = obj.get("type")
    if kind not in _HEAD or (expected is not None and kind != expected):
        raise MalformedSummary(f"message.type: expected {expected or 'digest|reply|push'}, got {kind!r:.40}")
    protocol = check_protocol(obj.get("protocol"), accepted, "message.protocol")
    if set(obj) != _HEAD[kind]:
        raise MalformedSummary(f"message: keys must be {', '.join(sorted(_HEAD[kind]))}")
    mesh_id = obj["mesh_id"]
    if not isinstance(mesh_id, str) or not 0 < len(mesh_id) <= 128:
        raise MalformedSummary("message.mesh_id: expected a string of 1..128 characters")
    if kind == "digest":
        return Digest(protocol, mesh_id, _decode_entries(obj["entries"], "entries"))
    # A summary is decoded in the version its payload says, which the message's version
    # bounds: a protocol-1 message cannot carry a protocol-2 summary.
    inner = tuple(v for v in accepted if v <= protocol)
    summaries, rejected = _decode_summaries(obj["summaries"], protocol, inner)
    if kind == "reply":
        return Reply(protocol, mesh_id, summaries, _decode_entries(obj["want"], "want"), rejected)
    return Push(protocol, mesh_id, summaries, rejected)
