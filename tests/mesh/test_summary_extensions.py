"""Extension fields of the capacity summary (protocol 4): bounds refused, the rest ignored
and relayed with the origin's signature intact."""

from __future__ import annotations

import json
from typing import Any

import pytest
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from viiwork.mesh import extensions as ext_mod
from viiwork.mesh import summary as summary_mod
from viiwork.mesh.extensions import (
    GANGS,
    MAX_EXTENSION_BYTES,
    MAX_EXTENSIONS,
    PREFIXES,
    PRIORITY,
    REGISTRY,
    REVOCATIONS,
    SPEEDS,
    UNKNOWN_EXTENSION_CAP,
    BadExtensionValue,
    ExtensionError,
    Extensions,
    ExtensionSpec,
    GangMember,
    Gangs,
    ModelPrefixes,
    ModelSpeed,
    Prefixes,
    Priority,
    Revocations,
    Speeds,
    canonical_bytes,
    decode_extensions,
)
from viiwork.mesh.identity import NodeId
from viiwork.mesh.messages import Push, RelayedSummary, decode_message, encode_message
from viiwork.mesh.summary import (
    MalformedSummary,
    ModelCapacity,
    OversizedSummary,
    PublishedState,
    SignedSummary,
    SummaryPayload,
    canonical_json,
    decode_payload,
    decode_summary,
    payload_to_obj,
    sign_payload,
    signing_input,
    summary_to_obj,
)

NODE = NodeId("abcdefghijklmnop")
KEY = Ed25519PrivateKey.generate()

TYPED: dict[ExtensionSpec[Any], Any] = {
    SPEEDS: Speeds((ModelSpeed("emb", 90_000, 0), ModelSpeed("llama", 4_000, 95))),
    PREFIXES: Prefixes((ModelPrefixes("llama", ("0123456789abcdef", "fedcba9876543210")),)),
    GANGS: Gangs((GangMember("llama-405b", "g1", 1, 2, NodeId("bcdefghijklmnopq")),)),
    REVOCATIONS: Revocations(7),
    PRIORITY: Priority.LOW,
}


def payload(protocol: int = 4, extensions: Extensions | None = None) -> SummaryPayload:
    return SummaryPayload(
        protocol=protocol, mesh_id="mesh1", node_id=NODE, name="gpu-01", api="10.0.0.1:8086", mesh="10.0.0.1:8087",
        version="0.1.0", generation=3, boot="00ff00ff00ff00ff", seq=17, state=PublishedState.SERVING,
        models=(ModelCapacity("llama", "llamacpp", "chat", 4, 1, None, 4096, 1, 1, "sha256:ab"),),
        extensions=extensions if extensions is not None else Extensions.of(TYPED))


def sign(p: SummaryPayload) -> SignedSummary:
    return sign_payload(p, KEY.sign, b"CERT")


def verifies(s: SignedSummary) -> bool:
    try:
        KEY.public_key().verify(s.signature, signing_input(s.payload_bytes))
    except InvalidSignature:
        return False
    return True


def over_the_wire(s: SignedSummary) -> SignedSummary:
    """What a receiver holds: the wire object through JSON text, decoded strictly."""
    return decode_summary(json.loads(json.dumps(summary_to_obj(s))), (3, 4))


def raw_spec(name: str, version: int, cap: int = 4096) -> ExtensionSpec[Any]:
    """A sender's spec that this node does not know (or knows otherwise): value as given."""
    return ExtensionSpec(name, version, cap, lambda v: v, lambda v: v)


# --- round trips ------------------------------------------------------------------------------


def test_round_trip_keeps_typed_values_and_the_signature_verifies() -> None:
    s = sign(payload())
    assert verifies(s)
    back = over_the_wire(s)
    assert back.payload == s.payload and back.payload_bytes == s.payload_bytes
    assert verifies(back)
    for spec, value in TYPED.items():
        assert back.payload.extensions.get(spec) == value
    assert back.payload.extensions.ignored == ()
    assert json.loads(s.payload_bytes)["ext"]["revocations"] == [1, {"version": 7}]


def test_a_summary_without_extensions_has_the_protocol_3_shape() -> None:
    four = payload_to_obj(payload(4, Extensions()))
    three = payload_to_obj(payload(3, Extensions()))
    assert "ext" not in four and set(four) == set(three)
    assert decode_payload(four, (3, 4)).extensions == Extensions()


def test_relay_through_a_gossip_message_keeps_the_extensions() -> None:
    s = sign(payload(extensions=Extensions.of({raw_spec("future", 1): {"a": [1, "x"]}, **TYPED})))
    hop = RelayedSummary(s, 10)
    for _ in range(2):  # the origin's push, then a relay's that does not know "future"
        msg = decode_message(encode_message(Push(4, "mesh1", (hop,))), (3, 4))
        assert isinstance(msg, Push) and msg.rejected == ()
        hop = msg.summaries[0]
        assert hop.summary.payload_bytes == s.payload_bytes and verifies(hop.summary)
        assert hop.summary.payload.extensions.ignored == (("future", "unknown_name"),)


# --- ignored, never refused, and relayed unchanged ---------------------------------------------

IGNORED = [
    ("unknown name", raw_spec("tomorrow", 1), {"k": [1, 2, {"z": None, "b": True}]}, "unknown_name", None),
    ("unknown version", raw_spec("speeds", 2), {"llama": [4000, 95]}, "unknown_version", SPEEDS),
    ("bad speeds", raw_spec("speeds", 1), {"llama": {"prefill_tps": -1, "decode_tps": 9}}, "bad_value", SPEEDS),
    ("speeds extra key", raw_spec("speeds", 1), {"m": {"prefill_tps": 1, "decode_tps": 1, "x": 1}}, "bad_value",
     SPEEDS),
    ("bad digest", raw_spec("prefixes", 1), {"llama": ["0123456789ABCDEF"]}, "bad_value", PREFIXES),
    ("too many digests", raw_spec("prefixes", 1), {"m": ["0123456789abcdef"] * 65}, "bad_value", PREFIXES),
    ("rank beyond size", raw_spec("gangs", 1),
     [{"model": "m", "gang": "g", "rank": 2, "size": 2, "leader": "bcdefghijklmnopq"}], "bad_value", GANGS),
    ("leader not a node id", raw_spec("gangs", 1),
     [{"model": "m", "gang": "g", "rank": 0, "size": 2, "leader": "NOPE"}], "bad_value", GANGS),
    ("negative revocations", raw_spec("revocations", 1), {"version": -1}, "bad_value", REVOCATIONS),
    ("bool as revocations", raw_spec("revocations", 1), {"version": True}, "bad_value", REVOCATIONS),
    ("unknown priority", raw_spec("priority", 1), "urgent", "bad_value", PRIORITY),
]


@pytest.mark.parametrize("spec,value,reason,known", [c[1:] for c in IGNORED], ids=[c[0] for c in IGNORED])
def test_what_is_not_understood_is_ignored_counted_and_relayed(spec: ExtensionSpec[Any], value: Any, reason: str,
                                                               known: ExtensionSpec[Any] | None) -> None:
    others = {REVOCATIONS: Revocations(3)} if spec.name != "revocations" else {PRIORITY: Priority.HIGH}
    s = sign(payload(extensions=Extensions.of({spec: value, **others})))
    back = over_the_wire(s)
    ext = back.payload.extensions
    assert ext.ignored == ((spec.name, reason),)
    assert ext.raw(spec.name) == (spec.version, value)
    if known is not None:
        assert ext.get(known) is None
    for other, typed in others.items():
        assert ext.get(other) == typed  # the understood ones still read
    relayed = over_the_wire(back)  # the next hop gets what this one re-encodes
    assert relayed.payload_bytes == s.payload_bytes
    assert verifies(relayed)
    assert canonical_json(payload_to_obj(back.payload)) == s.payload_bytes


def test_a_known_name_at_another_version_is_not_read_as_the_known_one() -> None:
    same_shape = {"llama": {"prefill_tps": 10, "decode_tps": 20}}  # v2 could mean tokens per ms
    back = over_the_wire(sign(payload(extensions=Extensions.of({raw_spec("speeds", 2): same_shape}))))
    assert back.payload.extensions.get(SPEEDS) is None
    assert back.payload.extensions.ignored == (("speeds", "unknown_version"),)
    assert back.payload.extensions.version_of("speeds") == 2


def test_an_altered_extension_breaks_the_signature() -> None:
    obj = summary_to_obj(sign(payload()))
    obj["payload"]["ext"]["revocations"][1]["version"] = 8
    assert not verifies(decode_summary(obj, (4,)))


# --- bounds: the whole summary is refused ------------------------------------------------------


def _with_ext(ext: Any) -> dict[str, Any]:
    obj = summary_to_obj(sign(payload(extensions=Extensions())))
    obj["payload"]["ext"] = ext
    return obj


def _nested(depth: int) -> Any:
    value: Any = 1
    for _ in range(depth):
        value = [value]
    return value


BOUNDS = [
    ("not an object", [["speeds", 1]], MalformedSummary, "payload.ext: expected an object"),
    ("empty", {}, MalformedSummary, "empty"),
    ("too many", {f"x{i}": [1, 0] for i in range(MAX_EXTENSIONS + 1)}, MalformedSummary, "at most 16"),
    ("upper-case name", {"Speeds": [1, 0]}, MalformedSummary, "does not match"),
    ("name starts with a digit", {"1x": [1, 0]}, MalformedSummary, "does not match"),
    ("name with a dash", {"a-b": [1, 0]}, MalformedSummary, "does not match"),
    ("name of 33", {"a" * 33: [1, 0]}, MalformedSummary, "does not match"),
    ("not a pair", {"x": [1]}, MalformedSummary, "[version, value]"),
    ("bare value", {"x": 1}, MalformedSummary, "[version, value]"),
    ("version 0", {"x": [0, 1]}, MalformedSummary, "version"),
    ("version 2**31+1", {"x": [2**31 + 1, 1]}, MalformedSummary, "version"),
    ("version bool", {"x": [True, 1]}, MalformedSummary, "version"),
    ("float", {"x": [1, {"a": [1, 2.0]}]}, MalformedSummary, "float"),
    ("float in a known one", {"revocations": [1, {"version": 1.0}]}, MalformedSummary, "float"),
    ("huge int", {"x": [1, 2**53 + 1]}, MalformedSummary, "2**53"),
    ("depth 9", {"x": [1, _nested(9)]}, MalformedSummary, "deeper than 8"),
    ("unknown over 1024", {"x": [1, "a" * (UNKNOWN_EXTENSION_CAP - 1)]}, OversizedSummary, "cap 1024"),
    ("known over its cap", {"revocations": [1, {"version": 1, "pad": "a" * 60}]}, OversizedSummary, "cap 64"),
    ("unknown version over the name's cap", {"prefixes": [2, "a" * 4096]}, OversizedSummary, "cap 4096"),
    ("total over 8 KiB", {f"x{i}": [1, "a" * 1000] for i in range(9)}, OversizedSummary, "limit 8192"),
]


@pytest.mark.parametrize("ext,error,fragment", [c[1:] for c in BOUNDS], ids=[c[0] for c in BOUNDS])
def test_bounds_refuse_the_summary(ext: Any, error: type[Exception], fragment: str) -> None:
    with pytest.raises(error) as err:
        decode_summary(_with_ext(ext), (3, 4))
    assert fragment in str(err.value)


WITHIN = [
    ("unknown at its cap", {"x": [1, "a" * (UNKNOWN_EXTENSION_CAP - 2)]}),
    ("depth 8", {"x": [1, _nested(8)]}),
    ("16 names", {f"x{i}": [1, i] for i in range(MAX_EXTENSIONS)}),
    ("name of 32", {"a" + "_9" * 15 + "z": [1, None]}),
    ("version 2**31", {"x": [2**31, -(2**53)]}),
    ("unknown version within the name's cap", {"prefixes": [2, "a" * 3000]}),
    ("total at 8 KiB", {"xx": [1, "a" * 83], **{f"x{i}": [1, "a" * 1000] for i in range(8)}}),
]


@pytest.mark.parametrize("ext", [c[1] for c in WITHIN], ids=[c[0] for c in WITHIN])
def test_just_within_the_bounds_is_accepted(ext: Any) -> None:
    if "xx" in ext:  # the total case: exactly at the bound
        assert len(canonical_bytes(ext)) == MAX_EXTENSION_BYTES
    assert set(decode_summary(_with_ext(ext), (4,)).payload.extensions) == set(ext)


def test_protocol_3_refuses_ext_and_cannot_encode_extensions() -> None:
    obj = _with_ext({"revocations": [1, {"version": 1}]})
    obj["payload"]["protocol"] = 3
    with pytest.raises(MalformedSummary, match="unknown ext"):
        decode_summary(obj, (3, 4))
    with pytest.raises(ValueError, match="protocol 3"):
        payload_to_obj(payload(3))


def test_builder_holds_the_sender_to_the_bounds() -> None:
    with pytest.raises(ext_mod.OversizedExtensions):
        Extensions.of({PREFIXES: Prefixes(tuple(ModelPrefixes(f"m{i}", ("0123456789abcdef",) * 64)
                                                for i in range(4)))})
    with pytest.raises(ext_mod.MalformedExtensions):
        Extensions.of({raw_spec("x", 1): 0.5})
    with pytest.raises(ValueError, match="twice"):
        Extensions.of({SPEEDS: Speeds(()), raw_spec("speeds", 2): {}})


def test_the_copies_of_summary_figures_agree() -> None:
    assert canonical_bytes({"b": [1, "é"], "a": None}) == canonical_json({"b": [1, "é"], "a": None})
    assert ext_mod.MAX_MODEL_NAME_CHARS == summary_mod.MAX_NAME_CHARS
    assert ext_mod.MAX_LABEL_CHARS == summary_mod.MAX_LABEL_CHARS
    assert ext_mod.MAX_EXTENSION_INT == summary_mod.MAX_INT
    assert ext_mod.MAX_SPEED_MODELS == summary_mod.MAX_MODELS
    assert 2 * MAX_EXTENSION_BYTES == summary_mod.MAX_SUMMARY_BYTES
    assert 4 in summary_mod.IMPLEMENTED_PROTOCOLS and summary_mod.PROTOCOL_VERSION == 4


# --- properties -------------------------------------------------------------------------------

JSON = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**53), 2**53) | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12,
)


def _depth(value: Any) -> int:
    if isinstance(value, list):
        return 1 + max((_depth(v) for v in value), default=0)
    if isinstance(value, dict):
        return 1 + max((_depth(v) for v in value.values()), default=0)
    return 0


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(values=st.dictionaries(st.from_regex(r"[a-z][a-z0-9_]{0,31}", fullmatch=True).filter(lambda n: n not in REGISTRY),
                              JSON, min_size=1, max_size=4),
       version=st.integers(1, 2**31))
def test_any_value_within_bounds_round_trips_signed(values: dict[str, Any], version: int) -> None:
    assume(all(_depth(v) <= 8 and len(canonical_bytes(v)) <= 1024 for v in values.values()))
    specs = {raw_spec(name, version, 1024): value for name, value in values.items()}
    s = sign(payload(extensions=Extensions.of(specs)))
    back = over_the_wire(s)
    relayed = over_the_wire(back)
    assert relayed.payload_bytes == s.payload_bytes and verifies(relayed)
    for name, value in values.items():
        assert back.payload.extensions.raw(name) == (version, value)


@settings(max_examples=300, deadline=None)
@given(name=st.sampled_from(sorted(REGISTRY)), value=JSON)
def test_registered_decoders_only_ever_reject_with_bad_value(name: str, value: Any) -> None:
    spec = REGISTRY[name][1]
    try:
        typed = spec.decode(value)
    except BadExtensionValue:
        return
    assert spec.decode(spec.encode(typed)) == typed
    try:
        decode_extensions({name: [1, value]})
    except ExtensionError:
        pass
