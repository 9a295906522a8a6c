"""The signed load record: what changes often, without the summary around it (probe mode).

A node's capacity summary (:mod:`viiwork.mesh.summary`) is ~500-850 bytes, but between
structural changes only each model's ``busy`` and ``waiting`` move (quantised:
:mod:`viiwork.mesh.quantise`). At 1,000 nodes the rate limit lets ~125 load publications a
second through the mesh, and every node must receive each one once, so the size of what
carries the load sets the floor of bytes per node per second (docs/mesh.md, "Byte budget").
A :class:`LoadRecord` carries only that load, signed by the node key:

    ["<node id>", generation, seq, base_seq, [[busy, waiting], ...], "<signature, base64>"]

- ``(generation, seq)``: the record's version, drawn from the same counter as the node's
  summaries (:class:`~viiwork.mesh.publisher.LocalPublisher`'s ``seq``), so a record and a
  summary of one node are ordered against each other by ``(generation, seq)`` alone (no
  clocks: docs/architecture.md, rule 7). The newer of the two holds the node's load.
- ``base_seq``: the summary (same generation) the record amends. ``loads`` has one
  ``[busy, waiting]`` per model of that summary, in its order (sorted by name), so no model
  name travels; ``waiting`` is null (unknown), 0 or 1 (queue presence, as published).
- the signature covers :func:`load_signing_input` (domain-separated from summaries and
  claims) and is checked with the certificate held with the base summary.

Encoded (one model, a 7-character mesh id) a record is ~135 bytes against ~500 for the
summary. Strict decoding (:func:`decode_load_record`): exactly that shape, bounded integers,
at most :data:`~viiwork.mesh.bounds.MAX_MODELS` loads, a 64-byte signature;
anything else is :class:`~viiwork.mesh.summary.MalformedSummary`. Whether a record fits the
summary it amends (``busy <= slots`` for each model, as many loads as models) is
:func:`load_problem`'s question, asked by the receiver before it verifies.

Pure: no I/O, no clocks.
"""

from __future__ import annotations

import base64
import dataclasses
from dataclasses import dataclass
from typing import Any

from viiwork.mesh.bounds import MAX_INT, MAX_MODELS
from viiwork.mesh.identity import NodeId, is_node_id
from viiwork.mesh.summary import MalformedSummary, ModelCapacity, SummaryPayload, decode_signature

Order = tuple[int, int]

LOAD_RECORD_BYTES = 120  # estimate without loads: '["<16>",g,sssss,sssss,[],"<88 base64>"],'
LOAD_BYTES = 6  # estimate per model: '[b,w],'


@dataclass(frozen=True, slots=True)
class ModelLoad:
    """One model's published load: ``busy`` slots (0..slots), ``waiting`` None (unknown),
    0 or 1 (someone is queued)."""

    busy: int
    waiting: int | None


@dataclass(frozen=True, slots=True)
class LoadRecord:
    """A node's signed load at ``(generation, seq)``, amending its summary ``(generation,
    base_seq)`` (module doc). ``signature``: 64 bytes over :func:`load_signing_input`."""

    node_id: NodeId
    generation: int
    seq: int
    base_seq: int
    loads: tuple[ModelLoad, ...]
    signature: bytes

    @property
    def order(self) -> Order:
        return (self.generation, self.seq)

    @property
    def base(self) -> Order:
        """The order of the summary this record amends."""
        return (self.generation, self.base_seq)

    def wire_size(self) -> int:
        """Estimated encoded size in bytes (the simulator's fast path)."""
        return LOAD_RECORD_BYTES + LOAD_BYTES * len(self.loads)


def loads_of(models: tuple[ModelCapacity, ...]) -> tuple[ModelLoad, ...]:
    """The loads of ``models`` (a summary's, in its order)."""
    return tuple(ModelLoad(m.busy, m.waiting) for m in models)


def load_signing_input(mesh_id: str, node_id: NodeId, generation: int, seq: int, base_seq: int,
                       loads: tuple[ModelLoad, ...]) -> bytes:
    """The bytes a load record's signature covers: ``viiwork-load`` and the mesh id first, so
    a record signed for one mesh, or a summary or claim signature, never verifies as one."""
    body = ";".join(f"{ld.busy},{'-' if ld.waiting is None else ld.waiting}" for ld in loads)
    return f"viiwork-load\0{mesh_id}\0{node_id}\0{generation}\0{seq}\0{base_seq}\0{body}".encode("ascii")


def sign_load(mesh_id: str, node_id: NodeId, generation: int, seq: int, base_seq: int,
              models: tuple[ModelCapacity, ...], sign: Any) -> LoadRecord:
    """A record of ``models``' load signed with ``sign(bytes) -> 64-byte signature``.
    Raises ValueError when ``base_seq`` is not below ``seq``."""
    if not 0 < base_seq < seq:
        raise ValueError(f"base_seq must be in 1..seq-1, got {base_seq} (seq {seq})")
    loads = loads_of(models)
    return LoadRecord(node_id, generation, seq, base_seq, loads,
                      sign(load_signing_input(mesh_id, node_id, generation, seq, base_seq, loads)))


def load_problem(record: LoadRecord, base: SummaryPayload) -> str | None:
    """Why ``record`` cannot amend the summary ``base``, or None when it can: same node and
    generation, ``base_seq`` is ``base``'s seq, one load per model with ``busy <= slots``."""
    if record.node_id != base.node_id or record.base != (base.generation, base.seq):
        return "not based on the summary held"
    if len(record.loads) != len(base.models):
        return f"{len(record.loads)} loads for {len(base.models)} models"
    for ld, m in zip(record.loads, base.models, strict=True):
        if ld.busy > m.slots:
            return f"busy {ld.busy} over {m.slots} slots of {m.name}"
    return None


def apply_load(models: tuple[ModelCapacity, ...], record: LoadRecord) -> tuple[ModelCapacity, ...]:
    """``models`` (the base summary's) with the record's ``busy`` and ``waiting``; the caller
    checked :func:`load_problem` (a length mismatch returns ``models`` unchanged)."""
    if len(models) != len(record.loads):
        return models
    return tuple(dataclasses.replace(m, busy=ld.busy, waiting=ld.waiting)
                 for m, ld in zip(models, record.loads, strict=True))


# --- codec --------------------------------------------------------------------------------------


def load_record_obj(record: LoadRecord) -> list[Any]:
    """The JSON shape of a record (module doc)."""
    return [record.node_id, record.generation, record.seq, record.base_seq,
            [[ld.busy, ld.waiting] for ld in record.loads], base64.b64encode(record.signature).decode("ascii")]


def _count(value: Any, where: str) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value <= MAX_INT:
        raise MalformedSummary(f"{where}: expected an integer 0..{MAX_INT}, got {value!r:.40}")
    return value


def decode_load_record(value: Any, where: str = "record") -> LoadRecord:
    """A record from its JSON shape. Raises MalformedSummary naming the field for anything
    else (a wrong type, a count out of range, ``base_seq >= seq``, more than MAX_MODELS
    loads, ``waiting`` other than null/0/1, a signature that is not 64 bytes of base64)."""
    if not isinstance(value, list) or len(value) != 6:
        raise MalformedSummary(f"{where}: expected [node_id, generation, seq, base_seq, loads, signature]")
    node_id, generation, seq, base_seq, loads, sig = value
    if not is_node_id(node_id):
        raise MalformedSummary(f"{where}[node_id]: expected a node id, got {node_id!r:.40}")
    generation = _count(generation, f"{where}[generation]")
    seq = _count(seq, f"{where}[seq]")
    base_seq = _count(base_seq, f"{where}[base_seq]")
    if not 0 < base_seq < seq:
        raise MalformedSummary(f"{where}[base_seq]: expected 1..seq-1, got {base_seq}")
    if not isinstance(loads, list) or len(loads) > MAX_MODELS:
        raise MalformedSummary(f"{where}[loads]: expected a list of at most {MAX_MODELS}")
    parsed = []
    for i, ld in enumerate(loads):
        if not isinstance(ld, list) or len(ld) != 2:
            raise MalformedSummary(f"{where}[loads][{i}]: expected [busy, waiting]")
        waiting = ld[1]
        if waiting is not None and (not isinstance(waiting, int) or isinstance(waiting, bool) or waiting not in (0, 1)):
            raise MalformedSummary(f"{where}[loads][{i}][waiting]: expected null, 0 or 1, got {waiting!r:.20}")
        parsed.append(ModelLoad(_count(ld[0], f"{where}[loads][{i}][busy]"), waiting))
    raw = decode_signature(sig, f"{where}[signature]")
    return LoadRecord(NodeId(node_id), generation, seq, base_seq, tuple(parsed), raw)


__all__ = ["LOAD_RECORD_BYTES", "LoadRecord", "ModelLoad", "apply_load", "decode_load_record", "load_problem",
           "load_record_obj", "load_signing_input", "loads_of", "sign_load"]
