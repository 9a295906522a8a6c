"""The signed capacity summary: what a node publishes about itself (docs/mesh.md).

One module (over 400 lines) because it is one wire format: the payload types, their
canonical encoding and their strict decoding change together with each protocol version
(a field added to a dataclass needs its encoder and decoder in the same change).

A :class:`SummaryPayload` is encoded canonically (:func:`canonical_json`: sorted keys, no
spaces, ASCII, integers only), and signed by the origin's node key over
``b"viiwork-summary\\0" + canonical bytes`` (:func:`signing_input`). On the wire a summary
travels as ``{"payload": {...}, "sig": base64, "cert": base64 DER or null}``; the receiver
decodes the payload strictly (:func:`decode_payload`), re-encodes it canonically and checks
the signature over those bytes, so any relay can carry it unchanged and none can alter it.

Strict decoding: exactly the keys of the payload's protocol version, the right JSON types
(``true`` is not an integer, ``1.0`` is not an integer), bounded strings, lists and
integers. Errors are typed: :class:`MalformedSummary` (names the field),
:class:`OversizedSummary`, :class:`UnsupportedProtocol`.

Protocol versions (a node accepts the current one and the two before it, docs/mesh.md "Versions"):

- **4** (current): as 3, plus extensions (:mod:`viiwork.mesh.extensions`):
  the optional key ``ext``, ``{name: [version, value]}``, left out when empty (so a payload
  without extensions has the shape of 3). Its bounds are the protocol's (broken:
  ``malformed`` / ``oversized``); within them an extension the node does not understand is
  kept, relayed unchanged and listed in ``SummaryPayload.extensions.ignored``, never refused. A payload of an earlier
  version cannot carry extensions (ValueError when encoding; ``ext`` is an unknown key
  to its decoder).
- **3**: as 2, plus the ``state`` value ``restarting`` (the node stops and its
  agent comes back soon: docs/mesh.md, "Failure detection and timings"). A node that
  publishes in 2 (a peer still speaks only 2) says ``leaving`` instead, what a stopping
  node of protocol 2 said on a restart too; a protocol-2 decoder refuses an unknown state
  value (``malformed``), so the value cannot travel in 2.
- **2** (the oldest a node of 4 accepts: 99079c7, the last protocol-2 release): as
  described here, with the states ``serving``, ``draining``, ``leaving``.
- **1** (the pre-release format, still implemented so that a node told to speak 2 reads it):
  models carry no ``fingerprint`` (decoded as None, "unknown") and relayed summaries carry
  no ``age_ms`` (decoded as 0). See :mod:`viiwork.mesh.messages`.

Every version's payload says which version it is in (``protocol``) and the newest version
its node speaks (``speaks``), so a node that publishes in the previous version during an
upgrade is still known to speak the current one. A future version must keep both fields.

Ordering between two summaries of one node is by ``(generation, seq)`` only (see
:mod:`viiwork.mesh.boot`); no timestamps are published.
"""

from __future__ import annotations

import base64
import binascii
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from viiwork.mesh.bounds import (
    MAX_INT,
    MAX_LABEL_CHARS,
    MAX_MODELS,
    MAX_NAME_CHARS,
    control_char,
    model_name_problem,
)
from viiwork.mesh.extensions import (
    EMPTY,
    ExtensionError,
    Extensions,
    OversizedExtensions,
    canonical_bytes,
    decode_extensions,
)
from viiwork.mesh.identity import NodeId, is_node_id

PROTOCOL_VERSION = 4
OLDEST_ACCEPTED_PROTOCOL = 2  # PROTOCOL_VERSION - 2: a node accepts its version and the two before it
IMPLEMENTED_PROTOCOLS = (1, 2, 3, 4)
EXTENSIONS_PROTOCOL = 4  # the first version whose payload may carry ``ext``

MAX_SUMMARY_BYTES = 16 * 1024  # canonical payload; a node with 10 models is ~2.5 KB
MAX_GPUS = 64
MAX_ADDRESS_CHARS = 270  # [ipv6]:port or a 253-char DNS name with a port
SIGNATURE_BYTES = 64
SIGNING_DOMAIN = b"viiwork-summary\x00"


class SummaryError(Exception):
    """A summary or message that cannot be accepted as sent (base of the typed errors)."""

    reason = "malformed"


class MalformedSummary(SummaryError):
    """Undecodable or wrongly shaped; the message names the field."""

    reason = "malformed"


class OversizedSummary(SummaryError):
    """Larger than the bound (:data:`MAX_SUMMARY_BYTES` for a summary)."""

    reason = "oversized"


class UnsupportedProtocol(SummaryError):
    """A protocol version this node does not speak (neither current nor previous)."""

    reason = "unsupported_protocol"


class PublishedState(str, Enum):
    """What a node says about itself (its *liveness* is what others observe)."""

    SERVING = "serving"
    DRAINING = "draining"
    LEAVING = "leaving"
    RESTARTING = "restarting"  # protocol 3: stopping, back soon (peers keep it for a grace period)


#: The ``state`` values each protocol version may carry (a decoder refuses any other).
STATES_OF_PROTOCOL: dict[int, frozenset[PublishedState]] = {
    1: frozenset({PublishedState.SERVING, PublishedState.DRAINING, PublishedState.LEAVING}),
    2: frozenset({PublishedState.SERVING, PublishedState.DRAINING, PublishedState.LEAVING}),
    3: frozenset(PublishedState),
    4: frozenset(PublishedState),
}


def state_for_protocol(state: PublishedState, protocol: int) -> PublishedState:
    """``state`` as a payload of ``protocol`` can say it: ``restarting`` is ``leaving``
    before protocol 3 (the state a node of protocol 2 published on any stop)."""
    if state in STATES_OF_PROTOCOL[protocol]:
        return state
    return PublishedState.LEAVING


@dataclass(frozen=True, slots=True)
class ModelCapacity:
    """One model on the publishing node.

    ``slots``: sequences its healthy backends admit; ``busy``: in use; ``waiting``: queued
    at the engines, None when no engine publishes a queue (unknown is never 0);
    ``ctx_per_slot``: tokens per sequence (the smallest among its backends); ``healthy`` /
    ``total``: backends; ``fingerprint``: identifies the weights (e.g. a file hash prefix),
    None when unknown or the publisher speaks protocol 1.
    """

    name: str
    engine: str
    kind: str
    slots: int
    busy: int
    waiting: int | None
    ctx_per_slot: int
    healthy: int
    total: int
    fingerprint: str | None = None

    @property
    def free(self) -> int:
        """Free slots (never negative)."""
        return max(0, self.slots - self.busy)


@dataclass(frozen=True, slots=True)
class GpuCapacity:
    """One GPU of the publishing node (protocol 2): ``index`` as its inventory numbers it,
    ``name`` (e.g. "NVIDIA H200"), memory in MiB; None when it could not be read (unknown
    is never 0)."""

    index: int
    name: str
    memory_total_mib: int | None = None
    memory_free_mib: int | None = None


@dataclass(frozen=True, slots=True)
class SummaryPayload:
    """The signed content. ``protocol``: the version this payload is encoded in;
    ``speaks``: the newest version the node speaks (it may publish in the previous one
    during a rolling upgrade, see :mod:`viiwork.mesh.membership`); ``generation``/``seq``
    order a node's publications; ``boot`` is the boot nonce (display only); ``api``/``mesh``
    are advertised ``host:port`` addresses (``api`` may be "" when the node advertises none);
    ``extensions`` (protocol 4): the ``ext`` fields, empty when none."""

    protocol: int
    mesh_id: str
    node_id: NodeId
    name: str
    api: str
    mesh: str
    version: str
    generation: int
    boot: str
    seq: int
    state: PublishedState
    models: tuple[ModelCapacity, ...] = ()
    speaks: int = 0  # 0: same as ``protocol``
    gpus: tuple[GpuCapacity, ...] = ()  # protocol 2 only
    extensions: Extensions = EMPTY  # protocol 4 on

    def __post_init__(self) -> None:
        if self.speaks == 0:
            object.__setattr__(self, "speaks", self.protocol)

    @property
    def order(self) -> tuple[int, int]:
        return (self.generation, self.seq)


@dataclass(frozen=True, slots=True)
class SignedSummary:
    """A payload with its canonical bytes, the origin's signature over
    :func:`signing_input`, and the origin's certificate (DER; None when the sender knew the
    receiver already holds it)."""

    payload: SummaryPayload
    payload_bytes: bytes
    signature: bytes
    certificate: bytes | None = field(default=None, repr=False)

    def without_certificate(self) -> SignedSummary:
        if self.certificate is None:
            return self
        return SignedSummary(self.payload, self.payload_bytes, self.signature, None)

    def wire_size(self) -> int:
        """Approximate encoded size in bytes (payload + base64 signature/certificate + keys)."""
        cert = 0 if self.certificate is None else 4 * ((len(self.certificate) + 2) // 3)
        return len(self.payload_bytes) + 88 + cert + 40


def canonical_json(obj: Any) -> bytes:
    """The canonical encoding: sorted keys, ``,``/``:`` separators, ASCII, no NaN (one
    encoder for summaries and their extensions: :func:`viiwork.mesh.extensions.canonical_bytes`)."""
    return canonical_bytes(obj)


def signing_input(payload_bytes: bytes) -> bytes:
    """What the origin signs: a domain tag, then the canonical payload."""
    return SIGNING_DOMAIN + payload_bytes


# --- encoding ---------------------------------------------------------------------------------

_MODEL_KEYS = {
    1: frozenset({"name", "engine", "kind", "slots", "busy", "waiting", "ctx_per_slot", "healthy", "total"}),
    2: frozenset({"name", "engine", "kind", "slots", "busy", "waiting", "ctx_per_slot", "healthy", "total",
                  "fingerprint"}),
}
_MODEL_KEYS[3] = _MODEL_KEYS[4] = _MODEL_KEYS[2]
_BASE_PAYLOAD_KEYS = frozenset({"protocol", "speaks", "mesh_id", "node_id", "name", "api", "mesh", "version",
                                "generation", "boot", "seq", "state", "models"})
_PAYLOAD_KEYS = {1: _BASE_PAYLOAD_KEYS, 2: _BASE_PAYLOAD_KEYS | {"gpus"}, 3: _BASE_PAYLOAD_KEYS | {"gpus"},
                 4: _BASE_PAYLOAD_KEYS | {"gpus"}}  # and, optional from 4, "ext"
_GPU_KEYS = frozenset({"index", "name", "memory_total_mib", "memory_free_mib"})


def payload_to_obj(payload: SummaryPayload) -> dict[str, Any]:
    """The JSON object of ``payload`` in its own protocol version (ValueError when its
    ``state`` does not exist in that version: see :func:`state_for_protocol`; or when it
    carries extensions before protocol 4)."""
    if payload.state not in STATES_OF_PROTOCOL[payload.protocol]:
        raise ValueError(f"state {payload.state.value!r} does not exist in protocol {payload.protocol}")
    if payload.extensions and payload.protocol < EXTENSIONS_PROTOCOL:
        raise ValueError(f"protocol {payload.protocol} carries no extensions (from {EXTENSIONS_PROTOCOL} on)")
    models = []
    for m in payload.models:
        entry: dict[str, Any] = {
            "name": m.name, "engine": m.engine, "kind": m.kind, "slots": m.slots, "busy": m.busy,
            "waiting": m.waiting, "ctx_per_slot": m.ctx_per_slot, "healthy": m.healthy, "total": m.total,
        }
        if payload.protocol >= 2:
            entry["fingerprint"] = m.fingerprint
        models.append(entry)
    obj = {
        "protocol": payload.protocol, "speaks": payload.speaks, "mesh_id": payload.mesh_id, "node_id": payload.node_id,
        "name": payload.name,
        "api": payload.api, "mesh": payload.mesh, "version": payload.version, "generation": payload.generation,
        "boot": payload.boot, "seq": payload.seq, "state": payload.state.value, "models": models,
    }
    if payload.protocol >= 2:
        obj["gpus"] = [{"index": g.index, "name": g.name, "memory_total_mib": g.memory_total_mib,
                        "memory_free_mib": g.memory_free_mib} for g in payload.gpus]
    if payload.extensions:
        obj["ext"] = payload.extensions.encode()
    return obj


def encode_payload(payload: SummaryPayload) -> bytes:
    """Canonical bytes of ``payload``; OversizedSummary past :data:`MAX_SUMMARY_BYTES`."""
    data = canonical_json(payload_to_obj(payload))
    if len(data) > MAX_SUMMARY_BYTES:
        raise OversizedSummary(f"summary is {len(data)} bytes, limit {MAX_SUMMARY_BYTES}")
    return data


def sign_payload(payload: SummaryPayload, sign: Any, certificate: bytes | None) -> SignedSummary:
    """Encode and sign: ``sign(bytes) -> 64-byte signature`` (the node key's)."""
    data = encode_payload(payload)
    return SignedSummary(payload=payload, payload_bytes=data, signature=sign(signing_input(data)),
                         certificate=certificate)


def summary_to_obj(summary: SignedSummary) -> dict[str, Any]:
    """The wire object ``{"payload", "sig", "cert"}``."""
    return {
        "payload": payload_to_obj(summary.payload),
        "sig": base64.b64encode(summary.signature).decode("ascii"),
        "cert": None if summary.certificate is None else base64.b64encode(summary.certificate).decode("ascii"),
    }


# --- strict decoding --------------------------------------------------------------------------


def _int(obj: dict[str, Any], key: str, where: str, lo: int = 0, hi: int = MAX_INT) -> int:
    value = obj[key]
    if not isinstance(value, int) or isinstance(value, bool) or not lo <= value <= hi:
        raise MalformedSummary(f"{where}{key}: expected an integer {lo}..{hi}, got {value!r:.40}")
    return value


def _str(obj: dict[str, Any], key: str, where: str, max_chars: int, min_chars: int = 1) -> str:
    value = obj[key]
    if not isinstance(value, str) or not min_chars <= len(value) <= max_chars:
        raise MalformedSummary(f"{where}{key}: expected a string of {min_chars}..{max_chars} characters, got {value!r:.40}")
    bad = control_char(value)
    if bad is not None:  # a peer's strings reach terminals and logs (mesh/bounds.py)
        raise MalformedSummary(f"{where}{key}: control character {bad!r} in {value!r:.40}")
    return value


def _keys(obj: Any, expected: frozenset[str], where: str) -> dict[str, Any]:
    if not isinstance(obj, dict):
        raise MalformedSummary(f"{where or 'summary'}: expected an object, got {type(obj).__name__}")
    keys = set(obj)
    if keys != expected:
        missing, extra = sorted(expected - keys), sorted(keys - expected)
        parts = ([f"missing {', '.join(missing)}"] if missing else []) + ([f"unknown {', '.join(extra)}"] if extra else [])
        raise MalformedSummary(f"{where or 'summary'}: {'; '.join(parts)}")
    return obj


def check_protocol(value: Any, accepted: tuple[int, ...], where: str = "protocol") -> int:
    """Return the protocol version when accepted; UnsupportedProtocol (or Malformed) otherwise."""
    if not isinstance(value, int) or isinstance(value, bool):
        raise MalformedSummary(f"{where}: expected an integer, got {value!r:.40}")
    if value not in accepted:
        raise UnsupportedProtocol(f"{where} {value} not accepted (this node accepts {', '.join(map(str, accepted))})")
    return value


def decode_model(obj: Any, protocol: int, where: str) -> ModelCapacity:
    obj = _keys(obj, _MODEL_KEYS[protocol], where)
    waiting = obj["waiting"]
    if waiting is not None:
        waiting = _int(obj, "waiting", where + ".")
    fingerprint = None
    if protocol >= 2 and obj["fingerprint"] is not None:
        fingerprint = _str(obj, "fingerprint", where + ".", MAX_LABEL_CHARS * 2)
    kind = _str(obj, "kind", where + ".", MAX_LABEL_CHARS)
    name = _str(obj, "name", where + ".", MAX_NAME_CHARS)
    problem = model_name_problem(name)
    if problem is not None:
        raise MalformedSummary(f"{where}.name: {problem}, got {name!r:.40}")
    model = ModelCapacity(
        name=name,
        engine=_str(obj, "engine", where + ".", MAX_LABEL_CHARS),
        kind=kind,
        slots=_int(obj, "slots", where + ".", 0, 1 << 20),
        busy=_int(obj, "busy", where + ".", 0, 1 << 20),
        waiting=waiting,
        ctx_per_slot=_int(obj, "ctx_per_slot", where + ".", 0, 1 << 30),
        healthy=_int(obj, "healthy", where + ".", 0, 1 << 16),
        total=_int(obj, "total", where + ".", 0, 1 << 16),
        fingerprint=fingerprint,
    )
    if model.healthy > model.total:
        raise MalformedSummary(f"{where}.healthy: {model.healthy} exceeds total {model.total}")
    return model


def _opt_int(obj: dict[str, Any], key: str, where: str, hi: int) -> int | None:
    return None if obj[key] is None else _int(obj, key, where, 0, hi)


def decode_gpu(obj: Any, where: str) -> GpuCapacity:
    obj = _keys(obj, _GPU_KEYS, where)
    gpu = GpuCapacity(
        index=_int(obj, "index", where + ".", 0, 1 << 16),
        name=_str(obj, "name", where + ".", MAX_LABEL_CHARS * 2),
        memory_total_mib=_opt_int(obj, "memory_total_mib", where + ".", 1 << 30),
        memory_free_mib=_opt_int(obj, "memory_free_mib", where + ".", 1 << 30),
    )
    if gpu.memory_total_mib is not None and gpu.memory_free_mib is not None \
            and gpu.memory_free_mib > gpu.memory_total_mib:
        raise MalformedSummary(f"{where}.memory_free_mib: {gpu.memory_free_mib} exceeds total {gpu.memory_total_mib}")
    return gpu


def decode_payload(obj: Any, accepted: tuple[int, ...]) -> SummaryPayload:
    """Strictly decode a payload object (see module doc). Raises MalformedSummary naming the
    field, or UnsupportedProtocol."""
    if not isinstance(obj, dict):
        raise MalformedSummary(f"payload: expected an object, got {type(obj).__name__}")
    protocol = check_protocol(obj.get("protocol"), accepted, "payload.protocol")
    has_ext = protocol >= EXTENSIONS_PROTOCOL and "ext" in obj
    obj = _keys(obj, _PAYLOAD_KEYS[protocol] | ({"ext"} if has_ext else set()), "payload")
    node_id = obj["node_id"]
    if not is_node_id(node_id):
        raise MalformedSummary(f"payload.node_id: not a node id: {node_id!r:.40}")
    states = STATES_OF_PROTOCOL[protocol]
    try:
        state = PublishedState(obj["state"])
    except (ValueError, TypeError):
        state = None
    if state not in states:
        names = "|".join(sorted(x.value for x in states))
        raise MalformedSummary(f"payload.state: expected {names} in protocol {protocol}, got {obj['state']!r:.40}")
    models_obj = obj["models"]
    if not isinstance(models_obj, list) or len(models_obj) > MAX_MODELS:
        raise MalformedSummary(f"payload.models: expected a list of at most {MAX_MODELS} models")
    models = tuple(decode_model(m, protocol, f"payload.models[{i}]") for i, m in enumerate(models_obj))
    if len({m.name for m in models}) != len(models):
        raise MalformedSummary("payload.models: a model name appears twice")
    speaks = _int(obj, "speaks", "payload.", protocol, 1 << 16)
    gpus: tuple[GpuCapacity, ...] = ()
    if protocol >= 2:
        gpus_obj = obj["gpus"]
        if not isinstance(gpus_obj, list) or len(gpus_obj) > MAX_GPUS:
            raise MalformedSummary(f"payload.gpus: expected a list of at most {MAX_GPUS} GPUs")
        gpus = tuple(decode_gpu(g, f"payload.gpus[{i}]") for i, g in enumerate(gpus_obj))
    extensions = EMPTY
    if has_ext:
        try:
            extensions = decode_extensions(obj["ext"], where="payload.ext")
        except OversizedExtensions as exc:
            raise OversizedSummary(str(exc)) from None
        except ExtensionError as exc:
            raise MalformedSummary(str(exc)) from None
    return SummaryPayload(
        extensions=extensions,
        gpus=gpus,
        protocol=protocol,
        speaks=speaks,
        mesh_id=_str(obj, "mesh_id", "payload.", MAX_LABEL_CHARS * 2),
        node_id=NodeId(node_id),
        name=_str(obj, "name", "payload.", 63),
        api=_str(obj, "api", "payload.", MAX_ADDRESS_CHARS, 0),
        mesh=_str(obj, "mesh", "payload.", MAX_ADDRESS_CHARS),
        version=_str(obj, "version", "payload.", MAX_LABEL_CHARS),
        generation=_int(obj, "generation", "payload.", 1),
        boot=_str(obj, "boot", "payload.", MAX_LABEL_CHARS),
        seq=_int(obj, "seq", "payload.", 1),
        state=state,
        models=models,
    )


def _b64(value: Any, where: str, max_bytes: int) -> bytes:
    if not isinstance(value, str) or len(value) > 4 * ((max_bytes + 2) // 3):
        raise MalformedSummary(f"{where}: expected base64 of at most {max_bytes} bytes")
    try:
        return base64.b64decode(value, validate=True)
    except (binascii.Error, ValueError):
        raise MalformedSummary(f"{where}: invalid base64") from None


def decode_signature(value: Any, where: str) -> bytes:
    """An Ed25519 signature as base64 (summaries, load records, claims): exactly
    SIGNATURE_BYTES bytes. Raises MalformedSummary naming ``where``."""
    signature = _b64(value, where, SIGNATURE_BYTES)
    if len(signature) != SIGNATURE_BYTES:
        raise MalformedSummary(f"{where}: expected {SIGNATURE_BYTES} bytes, got {len(signature)}")
    return signature


_SUMMARY_KEYS = frozenset({"payload", "sig", "cert"})


def decode_summary(obj: Any, accepted: tuple[int, ...], max_cert_bytes: int = 4096) -> SignedSummary:
    """Strictly decode a wire summary ``{"payload", "sig", "cert"}`` (signature not checked
    here: the membership core checks it after the cheap ordering checks)."""
    obj = _keys(obj, _SUMMARY_KEYS, "summary")
    payload = decode_payload(obj["payload"], accepted)
    data = canonical_json(obj["payload"])
    if len(data) > MAX_SUMMARY_BYTES:
        raise OversizedSummary(f"summary of {payload.node_id} is {len(data)} bytes, limit {MAX_SUMMARY_BYTES}")
    signature = decode_signature(obj["sig"], "summary.sig")
    cert = None if obj["cert"] is None else _b64(obj["cert"], "summary.cert", max_cert_bytes)
    return SignedSummary(payload=payload, payload_bytes=data, signature=signature, certificate=cert)
