"""Probe mode's messages on the wire: compact JSON, strictly decoded (bounded, typed errors).

The messages are :mod:`viiwork.mesh.messages`' ``Ping``, ``Ack``, ``PingReq``, ``Nack``,
``Gossip`` and ``Pull`` (docs/mesh.md, "Probe mode"); the digest exchange's messages keep
their own codec there. Shapes (JSON objects; ``mesh_id`` must be the receiver's):

    {"type": "ping", "protocol": 4, "mesh_id": "...", "id": 17, "news": [I, ...]}
    {"type": "ack" | "nack", ... same keys as ping}
    {"type": "ping-req", ... same keys as ping, "target": "<node id>", "address": "host:port"}
    {"type": "gossip", "protocol": 4, "mesh_id": "...", "news": [I, ...]}
    {"type": "pull", "protocol": 4, "mesh_id": "...", "wants": "<base64>" | [["<node id>", g, s], ...]}
    {"type": "loads", "protocol": 4, "mesh_id": "...", "records": [R, ...]}

where an item ``I`` is ``["p", "<base64>"]`` (news, packed: see below), ``["n", "<node id>",
g, s]`` (one news item, the form of earlier builds, still read) or ``["c", "<node id>", g, s,
"<by node id>", "<signature, base64>"]`` (a suspicion claim), and ``R`` a load record
(:func:`~viiwork.mesh.load_record.decode_load_record`; one that does not decode is left out
and its reason listed in ``Loads.rejected``, the rest of the message is used). At most
:data:`MAX_PROBE_ITEMS` items or wants and :data:`MAX_PROBE_MESSAGE_BYTES` bytes:
:class:`~viiwork.mesh.summary.OversizedSummary`; anything mis-shaped is
:class:`~viiwork.mesh.summary.MalformedSummary` naming the field; a protocol this node does
not accept is :class:`~viiwork.mesh.summary.UnsupportedProtocol`. Nothing else is raised for
any input bytes.

**Packed news** (docs/mesh.md, "Probe mode"): a message's news items travel as one ``["p",
...]`` item, the standard base64 of the concatenation, per item, of the node id's 10 raw bytes
(its base32 decoded) and the generation and seq as unsigned LEB128 varints (at most 8 bytes
each, values 0..2**53): 14 bytes (~19 characters) for a small generation and a seq below
2**21, against ~30 for ``["n", ...]``. A pull's ``wants`` travel the same way, as one base64
string (a version pull names every member: ~19 kB at 1,000 nodes instead of ~30); the list
form of earlier builds is still read. At 1,000 nodes each node sends ~125 publications a
second 8 times each, so news are most of the gossip bytes: measured in
docs/benchmarks-mesh.md. Probe-mode builds before packing refuse a message holding a ``"p"``
item (malformed): mixed meshes of those development builds are not supported.
"""

from __future__ import annotations

import base64
import binascii
import json
from collections.abc import Sequence
from typing import Any

from viiwork.mesh.bounds import MAX_INT
from viiwork.mesh.identity import NODE_ID_BYTES, NodeId, is_node_id
from viiwork.mesh.load_record import decode_load_record, load_record_obj
from viiwork.mesh.messages import (
    MAX_MESSAGE_BYTES,
    Ack,
    Claim,
    Digest,
    Entries,
    Gossip,
    Loads,
    Message,
    Nack,
    News,
    Order,
    Ping,
    PingReq,
    ProbeMessage,
    Pull,
    Push,
    Reply,
    decode_message,
    encode_message,
)
from viiwork.mesh.summary import MalformedSummary, OversizedSummary, check_protocol, decode_signature

MAX_PROBE_MESSAGE_BYTES = 64 * 1024
MAX_PROBE_ITEMS = 1024

_TYPES: dict[type, str] = {Ping: "ping", Ack: "ack", Nack: "nack", PingReq: "ping-req", Gossip: "gossip", Pull: "pull",
                           Loads: "loads"}
_KEYS = {"ping": {"id", "news"}, "ack": {"id", "news"}, "nack": {"id", "news"},
         "ping-req": {"id", "news", "target", "address"}, "gossip": {"news"}, "pull": {"wants"}, "loads": {"records"}}


_MAX_VARINT_BYTES = 8  # 7 bits each: 56 bits hold MAX_INT (2**53)


def _varint(value: int) -> bytes:
    out = bytearray()
    while True:
        byte = value & 0x7F
        value >>= 7
        if value:
            out.append(byte | 0x80)
        else:
            out.append(byte)
            return bytes(out)


def pack_news(news: Sequence[News]) -> str:
    """The base64 text of a ``["p", ...]`` item (module doc: packed news)."""
    raw = bytearray()
    for item in news:
        raw += base64.b32decode(item.node_id.upper())
        raw += _varint(item.order[0]) + _varint(item.order[1])
    return base64.b64encode(bytes(raw)).decode("ascii")


def _read_varint(raw: bytes, at: int, where: str) -> tuple[int, int]:
    value = 0
    for i in range(_MAX_VARINT_BYTES):
        if at + i >= len(raw):
            raise MalformedSummary(f"{where}: packed news end inside a number")
        byte = raw[at + i]
        value |= (byte & 0x7F) << (7 * i)
        if not byte & 0x80:
            if value > MAX_INT:
                raise MalformedSummary(f"{where}: packed number above {MAX_INT}")
            return value, at + i + 1
    raise MalformedSummary(f"{where}: packed number longer than {_MAX_VARINT_BYTES} bytes")


def unpack_news(text: Any, where: str, limit: int = MAX_PROBE_ITEMS) -> list[News]:
    """The news of a ``["p", text]`` item. Raises MalformedSummary (not base64, a truncated
    item, a number out of range) or OversizedSummary (more than ``limit`` items)."""
    try:
        raw = base64.b64decode(text, validate=True) if isinstance(text, str) else None
    except (binascii.Error, ValueError):
        raw = None
    if raw is None:
        raise MalformedSummary(f"{where}: expected base64 text")
    out: list[News] = []
    at = 0
    while at < len(raw):
        if len(out) >= limit:
            raise OversizedSummary(f"{where}: more than {limit} packed news items")
        if at + NODE_ID_BYTES > len(raw):
            raise MalformedSummary(f"{where}: packed news end inside a node id")
        nid = NodeId(base64.b32encode(raw[at:at + NODE_ID_BYTES]).decode("ascii").lower())
        generation, at = _read_varint(raw, at + NODE_ID_BYTES, where)
        seq, at = _read_varint(raw, at, where)
        out.append(News(nid, (generation, seq)))
    return out


def _items_obj(items: Sequence[News | Claim]) -> list[Any]:
    news = [i for i in items if isinstance(i, News)]
    out: list[Any] = [["p", pack_news(news)]] if news else []
    for item in items:
        if isinstance(item, Claim):
            out.append(["c", item.node_id, item.order[0], item.order[1], item.by,
                        base64.b64encode(item.signature).decode("ascii")])
    return out


def encode_probe_message(msg: ProbeMessage) -> bytes:
    """Compact JSON bytes of a probe-mode message."""
    obj: dict[str, Any] = {"type": _TYPES[type(msg)], "protocol": msg.protocol, "mesh_id": msg.mesh_id}
    if isinstance(msg, Pull):
        obj["wants"] = pack_news([News(nid, order) for nid, order in msg.wants.items()])
    elif isinstance(msg, Loads):
        obj["records"] = [load_record_obj(r) for r in msg.records]
    else:
        if not isinstance(msg, Gossip):
            obj["id"] = msg.ping_id
        if isinstance(msg, PingReq):
            obj["target"], obj["address"] = msg.target, msg.address
        obj["news"] = _items_obj(msg.news)
    return json.dumps(obj, separators=(",", ":"), ensure_ascii=True).encode("ascii")


def _count(value: Any, where: str) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value <= MAX_INT:
        raise MalformedSummary(f"{where}: expected an integer 0..{MAX_INT}, got {value!r:.40}")
    return value


def _node(value: Any, where: str) -> NodeId:
    if not is_node_id(value):
        raise MalformedSummary(f"{where}: expected a node id, got {value!r:.40}")
    return NodeId(value)


def _order(g: Any, s: Any, where: str) -> Order:
    return (_count(g, where + "[generation]"), _count(s, where + "[seq]"))


def _list(value: Any, where: str) -> list[Any]:
    if not isinstance(value, list):
        raise MalformedSummary(f"{where}: expected a list")
    if len(value) > MAX_PROBE_ITEMS:
        raise OversizedSummary(f"{where}: {len(value)} entries, limit {MAX_PROBE_ITEMS}")
    return value


def _item(value: Any, where: str) -> News | Claim:
    if isinstance(value, list) and len(value) == 4 and value[0] == "n":
        return News(_node(value[1], where), _order(value[2], value[3], where))
    if isinstance(value, list) and len(value) == 6 and value[0] == "c":
        raw = decode_signature(value[5], f"{where}[signature]")
        return Claim(_node(value[1], where), _order(value[2], value[3], where), _node(value[4], where + "[by]"), raw)
    raise MalformedSummary(f"{where}: expected [\"p\", packed], [\"n\", id, g, s] or [\"c\", id, g, s, by, sig], "
                           f"got {value!r:.60}")


def _news(value: Any) -> tuple[News | Claim, ...]:
    out: list[News | Claim] = []
    for i, v in enumerate(_list(value, "news")):
        if isinstance(v, list) and len(v) == 2 and v[0] == "p":
            out += unpack_news(v[1], f"news[{i}]", MAX_PROBE_ITEMS - len(out))
        else:
            out.append(_item(v, f"news[{i}]"))
        if len(out) > MAX_PROBE_ITEMS:
            raise OversizedSummary(f"news: more than {MAX_PROBE_ITEMS} items")
    return tuple(out)


def _parse(data: bytes, limit: int) -> dict[str, Any]:
    if len(data) > limit:
        raise OversizedSummary(f"message is {len(data)} bytes, limit {limit}")
    try:
        obj = json.loads(data)
    except (ValueError, RecursionError) as exc:
        raise MalformedSummary(f"message: not JSON ({type(exc).__name__})") from None
    if not isinstance(obj, dict):
        raise MalformedSummary("message: expected a JSON object")
    return obj


def decode_probe_message(data: bytes, accepted: tuple[int, ...]) -> ProbeMessage:
    """Decode one probe-mode message (``accepted``: the protocol versions this node speaks).
    Raises OversizedSummary, MalformedSummary or UnsupportedProtocol (module doc)."""
    return _from_obj(_parse(data, MAX_PROBE_MESSAGE_BYTES), accepted)


def decode_any(data: bytes, accepted: tuple[int, ...], max_message_bytes: int = MAX_MESSAGE_BYTES) -> Message | ProbeMessage:
    """Decode a probe-mode message or one of the digest exchange's (``digest``, ``reply``,
    ``push``: :func:`~viiwork.mesh.messages.decode_message`, up to ``max_message_bytes``),
    by its ``type``; the same errors."""
    obj = _parse(data, max(max_message_bytes, MAX_PROBE_MESSAGE_BYTES))
    kind = obj.get("type")
    if kind in ("digest", "reply", "push"):
        return decode_message(data, accepted, kind, max_message_bytes)
    if len(data) > MAX_PROBE_MESSAGE_BYTES:
        raise OversizedSummary(f"message is {len(data)} bytes, limit {MAX_PROBE_MESSAGE_BYTES}")
    return _from_obj(obj, accepted)


def encode_any(msg: Message | ProbeMessage) -> bytes:
    """The bytes of any message probe mode sends."""
    if isinstance(msg, Digest | Reply | Push):
        return encode_message(msg)
    return encode_probe_message(msg)


def _from_obj(obj: dict[str, Any], accepted: tuple[int, ...]) -> ProbeMessage:
    kind = obj.get("type")
    if kind not in _KEYS:
        raise MalformedSummary(f"message.type: expected one of {', '.join(sorted(_KEYS))}, got {kind!r:.40}")
    protocol = check_protocol(obj.get("protocol"), accepted, "message.protocol")
    if set(obj) != _KEYS[kind] | {"type", "protocol", "mesh_id"}:
        raise MalformedSummary(f"message: keys must be {', '.join(sorted(_KEYS[kind] | {'type', 'protocol', 'mesh_id'}))}")
    mesh_id = obj["mesh_id"]
    if not isinstance(mesh_id, str) or not 0 < len(mesh_id) <= 128:
        raise MalformedSummary("message.mesh_id: expected a string of 1..128 characters")
    if kind == "pull":
        wants: Entries = {}
        if isinstance(obj["wants"], str):
            for item in unpack_news(obj["wants"], "wants"):
                if item.node_id in wants:
                    raise MalformedSummary(f"wants: node {item.node_id} listed twice")
                wants[item.node_id] = item.order
            return Pull(protocol, mesh_id, wants)
        for i, w in enumerate(_list(obj["wants"], "wants")):
            if not isinstance(w, list) or len(w) != 3:
                raise MalformedSummary(f"wants[{i}]: expected [node_id, generation, seq]")
            nid = _node(w[0], f"wants[{i}]")
            if nid in wants:
                raise MalformedSummary(f"wants[{i}]: node {nid} listed twice")
            wants[nid] = _order(w[1], w[2], f"wants[{i}]")
        return Pull(protocol, mesh_id, wants)
    if kind == "loads":
        records, rejected = [], []
        for i, v in enumerate(_list(obj["records"], "records")):
            try:
                records.append(decode_load_record(v, f"records[{i}]"))
            except MalformedSummary as exc:
                rejected.append(exc.reason)
        return Loads(protocol, mesh_id, tuple(records), tuple(rejected))
    news = _news(obj["news"])
    if kind == "gossip":
        return Gossip(protocol, mesh_id, news)
    ping_id = _count(obj["id"], "id")
    if kind == "ping-req":
        address = obj["address"]
        if not isinstance(address, str) or not 0 < len(address) <= 300:
            raise MalformedSummary("address: expected host:port, 1..300 characters")
        return PingReq(protocol, mesh_id, ping_id, _node(obj["target"], "target"), address, news)
    if kind == "ping":
        return Ping(protocol, mesh_id, ping_id, news)
    if kind == "ack":
        return Ack(protocol, mesh_id, ping_id, news)
    return Nack(protocol, mesh_id, ping_id, news)


__all__ = ["MAX_PROBE_ITEMS", "MAX_PROBE_MESSAGE_BYTES", "decode_any", "decode_probe_message", "encode_any",
           "encode_probe_message", "pack_news", "unpack_news"]
