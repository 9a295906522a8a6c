"""Bounded, versioned extension fields of a signed JSON object (docs/mesh.md, "Extensions").

A signed object (the capacity summary from protocol 4; slot-offer wants later) may carry
the key ``"ext"``: ``{name: [version, value]}``. The mechanism lets later issues add fields
without a new protocol version:

- **Bounds are the protocol's**: a name matches ``[a-z][a-z0-9_]{0,31}``; at most
  :data:`MAX_EXTENSIONS` names; ``version`` an integer 1..2**31; ``value`` JSON made of
  objects, lists, strings, integers (|n| <= 2**53), booleans and null (no floats: the
  canonical encoding takes integers only), at most :data:`MAX_EXTENSION_DEPTH` nested
  lists/objects; each value's canonical size at most its cap (see :func:`cap_of`), all of
  ``"ext"`` at most :data:`MAX_EXTENSION_BYTES`. Breaking one is
  :class:`MalformedExtensions` or :class:`OversizedExtensions` and the whole object is
  refused (a summary decoder turns them into its own typed errors).
- **Within the bounds nothing is refused**: an unknown name, a known name at an unknown
  version, or a known ``(name, version)`` whose value its decoder rejects is *ignored* and
  reported in :attr:`Extensions.ignored` with the reason ``unknown_name``,
  ``unknown_version`` or ``bad_value``.
- **Relayed unchanged**: every entry keeps its value as decoded (as its canonical bytes),
  so the canonical re-encoding reproduces the signed bytes exactly; a node that does not
  understand an extension still verifies the signature and relays the object intact.

Typed access goes through an :class:`ExtensionSpec` (a name, a version, a cap, a strict
decoder and its encoder); :data:`REGISTRY` holds the specs this node understands. A new
meaning of a field is a new version of its extension, never a new protocol. A later
extension (or version) keeps its cap at most :data:`UNKNOWN_EXTENSION_CAP` (or the cap of
its name's earlier versions), since a node that does not know it applies that cap.

One module (over 420 lines) because the registered specs are part of the protocol's bounds:
their caps enter the same size check as the mechanism's, and :data:`REGISTRY` is what the
decoder reads by default; the owner issues may move a spec's typed value next to its user.

Pure: no I/O, no clocks.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Generic, TypeVar, cast

from viiwork.mesh.bounds import MAX_INT, MAX_LABEL_CHARS, MAX_MODELS, MAX_NAME_CHARS
from viiwork.mesh.identity import NodeId, is_node_id

MAX_EXTENSIONS = 16
MAX_EXTENSION_BYTES = 8 * 1024  # half of summary.MAX_SUMMARY_BYTES (16 KiB): room is left for models
UNKNOWN_EXTENSION_CAP = 1024  # canonical bytes of one value this node does not understand
MAX_EXTENSION_DEPTH = 8  # nested lists/objects within one value
MAX_EXTENSION_VERSION = 2**31
MAX_EXTENSION_INT = MAX_INT  # JSON-safe, as in a summary
MAX_MODEL_NAME_CHARS = MAX_NAME_CHARS
_NAME = re.compile(r"[a-z][a-z0-9_]{0,31}\Z")
_DIGEST = re.compile(r"[0-9a-f]{16}\Z")

T = TypeVar("T")


class ExtensionError(ValueError):
    """``"ext"`` breaks the protocol's bounds (base of the typed errors); ``reason`` as the
    summary errors count it."""

    reason = "malformed"


class MalformedExtensions(ExtensionError):
    """Wrong shape: not an object, too many names, a bad name or version, a float, too deep;
    the message names the place."""

    reason = "malformed"


class OversizedExtensions(ExtensionError):
    """A value over its cap, or all of ``"ext"`` over :data:`MAX_EXTENSION_BYTES`."""

    reason = "oversized"


class BadExtensionValue(ValueError):
    """Raised by a spec's decoder for a value it does not accept (the entry is ignored as
    ``bad_value``, never the object refused)."""


def canonical_bytes(value: Any) -> bytes:
    """The canonical encoding (the same as :func:`viiwork.mesh.summary.canonical_json`):
    sorted keys, ``,``/``:`` separators, ASCII."""
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=False).encode("ascii")


def fits(spec: ExtensionSpec[T], value: T) -> bool:
    """Whether ``value`` encodes within ``spec``'s cap (a publisher trims to this before it
    publishes: :meth:`Extensions.of` refuses a value over its cap)."""
    return len(canonical_bytes(spec.encode(value))) <= spec.cap_bytes


@dataclass(frozen=True, slots=True)
class ExtensionSpec(Generic[T]):
    """One understood ``(name, version)``: ``cap_bytes`` bounds the canonical size of its
    value; ``decode(raw) -> T`` raises :class:`BadExtensionValue` for a value it does not
    accept; ``encode(T) -> raw`` is its inverse (JSON of integers, never floats)."""

    name: str
    version: int
    cap_bytes: int
    decode: Callable[[Any], T]
    encode: Callable[[T], Any]

    def __post_init__(self) -> None:
        if not _NAME.match(self.name) or not 1 <= self.version <= MAX_EXTENSION_VERSION:
            raise ValueError(f"extension {self.name!r} v{self.version}: bad name or version")
        if not 0 < self.cap_bytes <= MAX_EXTENSION_BYTES:
            raise ValueError(f"extension {self.name!r}: cap {self.cap_bytes} outside 1..{MAX_EXTENSION_BYTES}")


#: name -> version -> spec: what a decoder understands.
Registry = Mapping[str, Mapping[int, ExtensionSpec[Any]]]


def cap_of(name: str, version: int, registry: Registry) -> int:
    """The cap (canonical bytes) a value of ``(name, version)`` must keep: the spec's own
    when registered; for a known name at an unknown version the largest of its versions'
    caps (at least :data:`UNKNOWN_EXTENSION_CAP`); otherwise :data:`UNKNOWN_EXTENSION_CAP`."""
    versions = registry.get(name)
    if not versions:
        return UNKNOWN_EXTENSION_CAP
    spec = versions.get(version)
    if spec is not None:
        return spec.cap_bytes
    return max(UNKNOWN_EXTENSION_CAP, *(s.cap_bytes for s in versions.values()))


def _check_value(value: Any, where: str, depth: int) -> None:
    if value is None or isinstance(value, (bool, str)):
        return
    if isinstance(value, int):
        if not -MAX_EXTENSION_INT <= value <= MAX_EXTENSION_INT:
            raise MalformedExtensions(f"{where}: integer beyond +-2**53")
        return
    if isinstance(value, float):
        raise MalformedExtensions(f"{where}: a float ({value!r:.20}); extensions carry integers only")
    if isinstance(value, (list, dict)):
        if depth >= MAX_EXTENSION_DEPTH:
            raise MalformedExtensions(f"{where}: nested deeper than {MAX_EXTENSION_DEPTH} lists/objects")
        if isinstance(value, list):
            for i, item in enumerate(value):
                _check_value(item, f"{where}[{i}]", depth + 1)
        else:
            for key, item in value.items():
                if not isinstance(key, str):
                    raise MalformedExtensions(f"{where}: a key that is not a string")
                _check_value(item, f"{where}.{key:.40}", depth + 1)
        return
    raise MalformedExtensions(f"{where}: {type(value).__name__} is not JSON")


_BAD = object()  # a value that did not decode


class Extensions:
    """The extensions of one object, immutable: name -> ``(version, raw value)``.

    ``raw(name)`` gives the value as decoded (a fresh copy); ``get(spec)`` the typed value
    when the entry has the spec's name and version and its decoder accepts it, else None;
    ``ignored``: ``(name, reason)`` for each entry this node did not understand when it
    decoded them (``unknown_name``, ``unknown_version``, ``bad_value``), sorted by name.
    Equal when the entries are (``ignored`` is a local view, not content).
    """

    __slots__ = ("_entries", "_ignored", "_typed")

    def __init__(self, entries: Mapping[str, tuple[int, bytes]] | None = None,
                 ignored: tuple[tuple[str, str], ...] = ()) -> None:
        self._entries: dict[str, tuple[int, bytes]] = dict(sorted((entries or {}).items()))
        self._ignored = ignored
        self._typed: dict[ExtensionSpec[Any], Any] = {}  # decode cache: pure, so safe to share

    @classmethod
    def of(cls, values: Mapping[ExtensionSpec[Any], Any]) -> Extensions:
        """Extensions from typed values: each encoded by its spec and held to the bounds
        (MalformedExtensions / OversizedExtensions; ValueError for a name given twice or a
        value its own spec's decoder refuses)."""
        raw: dict[str, list[Any]] = {}
        for spec, value in values.items():
            if spec.name in raw:
                raise ValueError(f"extension {spec.name!r} given twice")
            raw[spec.name] = [spec.version, spec.encode(value)]
        if not raw:
            return EMPTY
        ext = decode_extensions(raw, {spec.name: {spec.version: spec} for spec in values})
        if ext.ignored:  # only a spec whose decoder refuses its own encoding gets here
            raise ValueError(f"extensions {ext.ignored!r}: the spec's decoder refuses its encoding")
        return ext

    def with_value(self, spec: ExtensionSpec[T], value: T) -> Extensions:
        """These extensions with ``spec``'s set to ``value`` (replacing one of its name), held
        to the bounds as :meth:`of` holds them (the others against :data:`REGISTRY`); the
        others keep their bytes. ValueError when ``spec``'s decoder refuses its encoding."""
        raw = self.encode()
        raw[spec.name] = [spec.version, spec.encode(value)]
        ext = decode_extensions(raw, {**REGISTRY, spec.name: {spec.version: spec}})
        if ext._decoded(spec) is _BAD:
            raise ValueError(f"extension {spec.name!r}: the spec's decoder refuses its encoding")
        return ext

    @property
    def ignored(self) -> tuple[tuple[str, str], ...]:
        return self._ignored

    def get(self, spec: ExtensionSpec[T]) -> T | None:
        """The typed value of ``spec``'s extension, or None (absent, another version, or a
        value its decoder rejects)."""
        value = self._decoded(spec)
        return None if value is _BAD else cast(T, value)

    def _decoded(self, spec: ExtensionSpec[Any]) -> object:
        """The typed value, or ``_BAD`` (absent, another version, refused by the decoder):
        a decoder may well return None for a good value."""
        entry = self._entries.get(spec.name)
        if entry is None or entry[0] != spec.version:
            return _BAD
        value: object = self._typed.get(spec, _BAD)
        if value is _BAD:
            try:
                value = spec.decode(json.loads(entry[1]))
            except BadExtensionValue:
                return _BAD
            self._typed[spec] = value
        return value

    def raw(self, name: str) -> tuple[int, Any] | None:
        """``(version, value)`` as decoded, or None when absent."""
        entry = self._entries.get(name)
        return None if entry is None else (entry[0], json.loads(entry[1]))

    def version_of(self, name: str) -> int | None:
        entry = self._entries.get(name)
        return None if entry is None else entry[0]

    def encode(self) -> dict[str, list[Any]]:
        """The wire object ``{name: [version, value]}``: its canonical bytes are those decoded."""
        return {name: [version, json.loads(data)] for name, (version, data) in self._entries.items()}

    def __len__(self) -> int:
        return len(self._entries)

    def __iter__(self) -> Iterator[str]:
        return iter(self._entries)

    def __contains__(self, name: object) -> bool:
        return name in self._entries

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Extensions) and self._entries == other._entries

    def __hash__(self) -> int:
        return hash(tuple(self._entries.items()))

    def __repr__(self) -> str:
        inner = ", ".join(f"{n}: v{v} {d[:40]!r}" for n, (v, d) in self._entries.items())
        return f"Extensions({{{inner}}}, ignored={self._ignored!r})"


EMPTY = Extensions()


def decode_extensions(obj: Any, registry: Registry | None = None, where: str = "ext") -> Extensions:
    """Decode the value of ``"ext"`` held to the bounds (module doc) against ``registry``
    (default :data:`REGISTRY`). Raises MalformedExtensions (naming the place) or
    OversizedExtensions; an entry it does not understand is kept, and listed in ``ignored``.
    An empty object is malformed: a sender leaves ``"ext"`` out instead, so that the
    canonical re-encoding of the object stays the signed one."""
    reg = REGISTRY if registry is None else registry
    if not isinstance(obj, dict):
        raise MalformedExtensions(f"{where}: expected an object, got {type(obj).__name__}")
    if not obj:
        raise MalformedExtensions(f"{where}: empty (leave the key out instead)")
    if len(obj) > MAX_EXTENSIONS:
        raise MalformedExtensions(f"{where}: {len(obj)} extensions, at most {MAX_EXTENSIONS}")
    entries: dict[str, tuple[int, bytes]] = {}
    for name, item in obj.items():
        if not isinstance(name, str) or not _NAME.match(name):
            raise MalformedExtensions(f"{where}: name {name!r:.40} does not match [a-z][a-z0-9_]{{0,31}}")
        at = f"{where}.{name}"
        if not isinstance(item, list) or len(item) != 2:
            raise MalformedExtensions(f"{at}: expected [version, value]")
        version, value = item
        if not isinstance(version, int) or isinstance(version, bool) or not 1 <= version <= MAX_EXTENSION_VERSION:
            raise MalformedExtensions(f"{at}: version: expected an integer 1..2**31, got {version!r:.40}")
        _check_value(value, at, 0)
        data = canonical_bytes(value)
        cap = cap_of(name, version, reg)
        if len(data) > cap:
            raise OversizedExtensions(f"{at}: {len(data)} bytes, cap {cap}")
        entries[name] = (version, data)
    total = len(canonical_bytes(obj))
    if total > MAX_EXTENSION_BYTES:
        raise OversizedExtensions(f"{where}: {total} bytes, limit {MAX_EXTENSION_BYTES}")
    ext = Extensions(entries)
    ignored: list[tuple[str, str]] = []
    for name, (version, _data) in ext._entries.items():
        versions = reg.get(name)
        if not versions:
            ignored.append((name, "unknown_name"))
        elif version not in versions:
            ignored.append((name, "unknown_version"))
        elif ext._decoded(versions[version]) is _BAD:
            ignored.append((name, "bad_value"))
    ext._ignored = tuple(ignored)
    return ext


# --- the registered specs (v1) ----------------------------------------------------------------
# Small on purpose: issue 18 (speeds, prefixes), 21 (gangs), 17 (revocations, the priority
# of a want) and 19 (endpoints) own their meaning and may change them under a new extension version.


def _bad(where: str, what: str) -> BadExtensionValue:
    return BadExtensionValue(f"{where}: {what}")


def _exact_keys(value: Any, keys: frozenset[str], where: str) -> dict[str, Any]:
    if not isinstance(value, dict) or set(value) != keys:
        raise _bad(where, f"expected an object with {', '.join(sorted(keys))}")
    return value


def _count(value: Any, where: str, lo: int = 0, hi: int = 1 << 32) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or not lo <= value <= hi:
        raise _bad(where, f"expected an integer {lo}..{hi}")
    return value


def _label(value: Any, where: str, max_chars: int) -> str:
    if not isinstance(value, str) or not 1 <= len(value) <= max_chars:
        raise _bad(where, f"expected a string of 1..{max_chars} characters")
    return value


def _per_model(value: Any, where: str, max_models: int) -> list[tuple[str, Any]]:
    if not isinstance(value, dict) or len(value) > max_models:
        raise _bad(where, f"expected an object of at most {max_models} models")
    return [(_label(k, where, MAX_MODEL_NAME_CHARS), v) for k, v in sorted(value.items())]


MAX_SPEED_MODELS = MAX_MODELS


@dataclass(frozen=True, slots=True)
class ModelSpeed:
    """Measured speed of one model on the publishing node, tokens per second (>= 0)."""

    model: str
    prefill_tps: int
    decode_tps: int


@dataclass(frozen=True, slots=True)
class Speeds:
    """``speeds`` v1 (issue 18): per model, sorted by name. Wire:
    ``{model: {"prefill_tps": int, "decode_tps": int}}``."""

    models: tuple[ModelSpeed, ...]

    def of(self, model: str) -> ModelSpeed | None:
        return next((s for s in self.models if s.model == model), None)


_SPEED_KEYS = frozenset({"prefill_tps", "decode_tps"})


def _decode_speeds(value: Any) -> Speeds:
    out = []
    for model, item in _per_model(value, "speeds", MAX_SPEED_MODELS):
        item = _exact_keys(item, _SPEED_KEYS, f"speeds.{model:.40}")
        out.append(ModelSpeed(model, _count(item["prefill_tps"], "speeds.prefill_tps"),
                              _count(item["decode_tps"], "speeds.decode_tps")))
    return Speeds(tuple(out))


def _encode_speeds(value: Speeds) -> Any:
    return {s.model: {"prefill_tps": s.prefill_tps, "decode_tps": s.decode_tps} for s in value.models}


MAX_PREFIX_MODELS = 64
MAX_PREFIXES_PER_MODEL = 64


@dataclass(frozen=True, slots=True)
class ModelPrefixes:
    """Prefix digests one model holds cached on the publishing node: 16 lowercase hex
    characters each (issue 18 defines what is hashed)."""

    model: str
    digests: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class Prefixes:
    """``prefixes`` v1 (issue 18): per model, sorted by name. Wire: ``{model: [hex16, ...]}``
    with at most 64 digests a model; the cap (4 KiB, about 200 digests) bounds them all.
    ``set_of(model)``: the digests as a set, built once (the router looks them up per request)."""

    models: tuple[ModelPrefixes, ...]
    _sets: dict[str, frozenset[str]] = field(default_factory=dict, init=False, compare=False, repr=False)

    def of(self, model: str) -> tuple[str, ...]:
        return next((p.digests for p in self.models if p.model == model), ())

    def set_of(self, model: str) -> frozenset[str]:
        found = self._sets.get(model)
        if found is None:
            found = self._sets[model] = frozenset(self.of(model))
        return found


def _decode_prefixes(value: Any) -> Prefixes:
    out = []
    for model, digests in _per_model(value, "prefixes", MAX_PREFIX_MODELS):
        if not isinstance(digests, list) or len(digests) > MAX_PREFIXES_PER_MODEL \
                or not all(isinstance(d, str) and _DIGEST.match(d) for d in digests):
            raise _bad(f"prefixes.{model:.40}", f"expected at most {MAX_PREFIXES_PER_MODEL} 16-hex-digit digests")
        out.append(ModelPrefixes(model, tuple(digests)))
    return Prefixes(tuple(out))


def _encode_prefixes(value: Prefixes) -> Any:
    return {p.model: list(p.digests) for p in value.models}


MAX_GANG_MEMBERS = 16
MAX_GANG_SIZE = 1 << 10


@dataclass(frozen=True, slots=True)
class GangMember:
    """The publishing node's place in a gang serving one multi-host model: ``gang`` labels
    the gang, ``rank`` is 0..size-1, ``leader`` the node id that takes its requests."""

    model: str
    gang: str
    rank: int
    size: int
    leader: NodeId


@dataclass(frozen=True, slots=True)
class Gangs:
    """``gangs`` v1 (issue 21): at most 16 memberships. Wire:
    ``[{"model", "gang", "rank", "size", "leader"}, ...]``."""

    members: tuple[GangMember, ...]


_GANG_KEYS = frozenset({"model", "gang", "rank", "size", "leader"})


def _decode_gangs(value: Any) -> Gangs:
    if not isinstance(value, list) or len(value) > MAX_GANG_MEMBERS:
        raise _bad("gangs", f"expected a list of at most {MAX_GANG_MEMBERS}")
    out = []
    for i, item in enumerate(value):
        where = f"gangs[{i}]"
        item = _exact_keys(item, _GANG_KEYS, where)
        size = _count(item["size"], f"{where}.size", 1, MAX_GANG_SIZE)
        rank = _count(item["rank"], f"{where}.rank", 0, size - 1)
        if not is_node_id(item["leader"]):
            raise _bad(f"{where}.leader", "not a node id")
        out.append(GangMember(_label(item["model"], f"{where}.model", MAX_MODEL_NAME_CHARS),
                              _label(item["gang"], f"{where}.gang", MAX_LABEL_CHARS), rank, size,
                              NodeId(item["leader"])))
    return Gangs(tuple(out))


def _encode_gangs(value: Gangs) -> Any:
    return [{"model": g.model, "gang": g.gang, "rank": g.rank, "size": g.size, "leader": g.leader}
            for g in value.members]


@dataclass(frozen=True, slots=True)
class Revocations:
    """``revocations`` v1 (issue 17): the version of the revocation list the publisher holds (>= 0).
    Wire: ``{"version": int}``."""

    version: int


def _decode_revocations(value: Any) -> Revocations:
    value = _exact_keys(value, frozenset({"version"}), "revocations")
    return Revocations(_count(value["version"], "revocations.version", 0, MAX_EXTENSION_INT))


def _encode_revocations(value: Revocations) -> Any:
    return {"version": value.version}


class Priority(str, Enum):
    """``priority`` v1 (issue 17): a want's priority in slot offers. Wire: the value as a string."""

    HIGH = "high"
    NORMAL = "normal"
    LOW = "low"


def _decode_priority(value: Any) -> Priority:
    if not isinstance(value, str):
        raise _bad("priority", "expected high|normal|low")
    try:
        return Priority(value)
    except ValueError:
        raise _bad("priority", "expected high|normal|low") from None


def _encode_priority(value: Priority) -> Any:
    return value.value


def _decode_refuted(value: Any) -> int:
    return _count(value, "refuted", 0, MAX_EXTENSION_INT)


def _encode_refuted(value: int) -> Any:
    return value


MAX_ENDPOINT_GROUPS = 8
MAX_ENDPOINT_NAMES = 32


@dataclass(frozen=True, slots=True)
class ModelEndpoints:
    """The endpoints a model's backends on the publishing node serve, by name (``chat``,
    ``messages``, ``rerank``...: engines/contract.py ``Endpoint``)."""

    model: str
    endpoints: frozenset[str]


@dataclass(frozen=True, slots=True)
class Endpoints:
    """``endpoints`` v1 (issue 19): which endpoints each model serves on the publishing node,
    sorted by model. Wire: a list of at most 8 groups ``[[name, ...], [model, ...]]``, the
    models of a group serving the same names (one group on a node whose models share an
    engine and kind), so the value stays under its 1 KiB cap. A name is
    ``[a-z][a-z0-9_]{0,31}`` (at most 32 a group); a name this node does not know is kept
    and matches no endpoint it routes. A model in no group: the publisher did not say
    (:meth:`of` is None; the reader assumes the classic endpoints)."""

    models: tuple[ModelEndpoints, ...]

    def of(self, model: str) -> frozenset[str] | None:
        return next((m.endpoints for m in self.models if m.model == model), None)


def _decode_endpoints(value: Any) -> Endpoints:
    if not isinstance(value, list) or len(value) > MAX_ENDPOINT_GROUPS:
        raise _bad("endpoints", f"expected a list of at most {MAX_ENDPOINT_GROUPS} groups")
    out: dict[str, frozenset[str]] = {}
    for i, group in enumerate(value):
        where = f"endpoints[{i}]"
        if not isinstance(group, list) or len(group) != 2:
            raise _bad(where, "expected [[endpoint, ...], [model, ...]]")
        names, models = group
        if not isinstance(names, list) or not 1 <= len(names) <= MAX_ENDPOINT_NAMES \
                or not all(isinstance(n, str) and _NAME.match(n) for n in names):
            raise _bad(where, f"expected 1..{MAX_ENDPOINT_NAMES} endpoint names matching [a-z][a-z0-9_]{{0,31}}")
        if not isinstance(models, list) or not 1 <= len(models) <= MAX_MODELS:
            raise _bad(where, f"expected 1..{MAX_MODELS} models")
        for model in models:
            name = _label(model, where, MAX_MODEL_NAME_CHARS)
            if name in out:
                raise _bad(where, f"model {name:.40} in two groups")
            out[name] = frozenset(names)
    return Endpoints(tuple(ModelEndpoints(m, out[m]) for m in sorted(out)))


def _encode_endpoints(value: Endpoints) -> Any:
    groups: dict[frozenset[str], list[str]] = {}
    for m in value.models:
        groups.setdefault(m.endpoints, []).append(m.model)
    return [[sorted(names), models] for names, models in sorted(groups.items(), key=lambda g: sorted(g[0]))]


# Caps: a model entry of speeds is ~60 bytes with a 20-character name (64 models would not fit
# next to their 64 model entries in 16 KiB anyway); one digest is 19 bytes.
SPEEDS = ExtensionSpec("speeds", 1, 2048, _decode_speeds, _encode_speeds)
PREFIXES = ExtensionSpec("prefixes", 1, 4096, _decode_prefixes, _encode_prefixes)
GANGS = ExtensionSpec("gangs", 1, 2048, _decode_gangs, _encode_gangs)
REVOCATIONS = ExtensionSpec("revocations", 1, 64, _decode_revocations, _encode_revocations)
PRIORITY = ExtensionSpec("priority", 1, 16, _decode_priority, _encode_priority)
# ``refuted`` v1 (probe mode, docs/mesh.md "Probe mode"): the publisher's own seq, within its
# summary's generation, through which claims about it are refuted. 16 digits hold MAX_INT.
REFUTED = ExtensionSpec("refuted", 1, 16, _decode_refuted, _encode_refuted)
# At most UNKNOWN_EXTENSION_CAP: a node from before this extension refuses a summary whose
# unknown value is larger. All ten endpoints take 130 bytes; the rest is model names.
ENDPOINTS = ExtensionSpec("endpoints", 1, UNKNOWN_EXTENSION_CAP, _decode_endpoints, _encode_endpoints)


def registry_of(*specs: ExtensionSpec[Any]) -> Registry:
    """A registry of ``specs`` (ValueError when a ``(name, version)`` appears twice)."""
    out: dict[str, dict[int, ExtensionSpec[Any]]] = {}
    for spec in specs:
        if spec.version in out.setdefault(spec.name, {}):
            raise ValueError(f"extension {spec.name!r} v{spec.version} registered twice")
        out[spec.name][spec.version] = spec
    return out


#: The extensions this node understands.
REGISTRY: Registry = registry_of(SPEEDS, PREFIXES, GANGS, REVOCATIONS, PRIORITY, ENDPOINTS, REFUTED)
