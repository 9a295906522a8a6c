"""Capacity summaries and gossip messages: canonical encoding, strict decoding, bounds."""

from __future__ import annotations

import copy
import json
import random

import pytest

from viiwork.mesh.messages import (
    MAX_ENTRIES,
    Digest,
    Push,
    RelayedSummary,
    Reply,
    decode_message,
    encode_message,
    estimate_size,
)
from viiwork.mesh.summary import (
    MAX_SUMMARY_BYTES,
    MalformedSummary,
    ModelCapacity,
    OversizedSummary,
    PublishedState,
    SummaryError,
    SummaryPayload,
    UnsupportedProtocol,
    canonical_json,
    decode_payload,
    decode_summary,
    encode_payload,
    sign_payload,
    signing_input,
    summary_to_obj,
)

NODE = "abcdefghijklmnop"


def payload(protocol=2, models=None, **kw) -> SummaryPayload:
    base = dict(protocol=protocol, mesh_id="mesh1", node_id=NODE, name="gpu-01", api="10.0.0.1:8086",
                mesh="10.0.0.1:8087", version="0.1.0", generation=3, boot="00ff00ff00ff00ff", seq=17,
                state=PublishedState.SERVING,
                models=models if models is not None else (
                    ModelCapacity("llama", "llamacpp", "chat", 4, 1, None, 4096, 1, 1, "sha256:ab"),
                    ModelCapacity("emb", "vllm", "embedding", 8, 0, 2, 512, 2, 2, None)))
    base.update(kw)
    return SummaryPayload(**base)


def signed(p=None):
    return sign_payload(p or payload(), lambda data: bytes(64), b"CERT")


def test_canonical_encoding_is_sorted_compact_ascii():
    data = encode_payload(payload(name="gpu-é"[:5]))
    assert data == canonical_json(json.loads(data))
    assert b" " not in data and data.isascii()
    keys = list(json.loads(data).keys())
    assert keys == sorted(keys)


def test_roundtrip_keeps_every_field_and_unknown_waiting_stays_none():
    s = signed()
    back = decode_summary(summary_to_obj(s), (1, 2))
    assert back.payload == s.payload and back.payload_bytes == s.payload_bytes
    assert back.signature == s.signature and back.certificate == b"CERT"
    assert back.payload.models[0].waiting is None and back.payload.models[1].waiting == 2


def test_signing_input_is_domain_tagged():
    assert signing_input(b"{}") == b"viiwork-summary\x00{}"


def test_protocol_1_has_no_fingerprint_and_decodes_as_unknown():
    obj = json.loads(encode_payload(payload(protocol=1)))
    assert all("fingerprint" not in m for m in obj["models"])
    assert decode_payload(obj, (1, 2)).models[0].fingerprint is None


def _bad(mutate):
    obj = summary_to_obj(signed())
    mutate(obj)
    return obj


CASES = [
    ("extra key", lambda o: o["payload"].update(evil=1), "unknown evil"),
    ("missing key", lambda o: o["payload"].pop("seq"), "missing seq"),
    ("bool as int", lambda o: o["payload"].update(seq=True), "payload.seq"),
    ("float as int", lambda o: o["payload"].update(seq=1.0), "payload.seq"),
    ("negative", lambda o: o["payload"]["models"][0].update(busy=-1), "models[0].busy"),
    ("huge int", lambda o: o["payload"].update(seq=2**70), "payload.seq"),
    ("bad node id", lambda o: o["payload"].update(node_id="NOT-AN-ID"), "payload.node_id"),
    ("bad state", lambda o: o["payload"].update(state="sleeping"), "payload.state"),
    ("healthy > total", lambda o: o["payload"]["models"][0].update(healthy=5), "healthy"),
    ("duplicate model", lambda o: o["payload"]["models"].append(copy.deepcopy(o["payload"]["models"][0])), "twice"),
    ("model not object", lambda o: o["payload"]["models"].append(3), "models[2]"),
    ("short signature", lambda o: o.update(sig="AAAA"), "summary.sig"),
    ("bad base64", lambda o: o.update(sig="!!!"), "summary.sig"),
    ("fingerprint in v1", lambda o: (o["payload"].update(protocol=1), o["payload"].pop("gpus")),
     "unknown fingerprint"),
    ("gpus in v1", lambda o: o["payload"].update(protocol=1), "unknown gpus"),
    ("generation 0", lambda o: o["payload"].update(generation=0), "payload.generation"),
]


@pytest.mark.parametrize("mutate,fragment", [(m, f) for _, m, f in CASES], ids=[c[0] for c in CASES])
def test_malformed_summaries_name_the_field(mutate, fragment):
    with pytest.raises(MalformedSummary) as err:
        decode_summary(_bad(mutate), (1, 2))
    assert fragment in str(err.value)


@pytest.mark.parametrize("version", [0, 3, 99])
def test_unsupported_protocol_is_typed(version):
    with pytest.raises(UnsupportedProtocol):
        decode_summary(_bad(lambda o: o["payload"].update(protocol=version)), (1, 2))


def test_oversized_summary_is_refused_both_ways():
    many = tuple(ModelCapacity(f"model-{i:03d}-" + "x" * 180, "llamacpp", "chat", 1, 0, None, 1, 1, 1, "f" * 100)
                 for i in range(64))
    with pytest.raises(OversizedSummary):
        encode_payload(payload(models=many))
    obj = summary_to_obj(signed())
    obj["payload"]["models"] = [dict(obj["payload"]["models"][0], name=f"m{i}" + "x" * 190, fingerprint="f" * 120)
                                for i in range(64)]
    assert len(canonical_json(obj["payload"])) > MAX_SUMMARY_BYTES
    with pytest.raises(OversizedSummary):
        decode_summary(obj, (1, 2))


def test_messages_roundtrip_and_estimate_is_close():
    s = signed()
    msgs = [
        Digest(2, "mesh1", {NODE: (3, 17), "bcdefghijklmnopq": (0, 0)}),
        Reply(2, "mesh1", (RelayedSummary(s, 120),), {"bcdefghijklmnopq": (1, 2)}),
        Push(2, "mesh1", (RelayedSummary(s.without_certificate(), 5),)),
    ]
    for msg in msgs:
        data = encode_message(msg)
        back = decode_message(data, (1, 2))
        assert type(back) is type(msg)
        if isinstance(msg, Digest):
            assert back.entries == msg.entries
        else:
            assert [r.age_ms for r in back.summaries] == [r.age_ms for r in msg.summaries]
            assert [r.summary.payload for r in back.summaries] == [r.summary.payload for r in msg.summaries]
        assert abs(estimate_size(msg) - len(data)) <= 0.15 * len(data) + 40


def test_protocol_1_messages_carry_no_age():
    data = encode_message(Push(1, "mesh1", (RelayedSummary(signed(payload(protocol=1)), 999),)))
    assert b"age_ms" not in data
    assert decode_message(data, (1, 2)).summaries[0].age_ms == 0


def test_a_protocol_1_message_cannot_carry_a_protocol_2_summary():
    obj = json.loads(encode_message(Push(2, "mesh1", (RelayedSummary(signed(), 1),))))
    obj["protocol"] = 1
    for item in obj["summaries"]:
        item.pop("age_ms")
    msg = decode_message(json.dumps(obj).encode(), (1, 2))
    assert msg.summaries == () and msg.rejected == ("unsupported_protocol",)


def test_one_bad_summary_does_not_spoil_the_message():
    good = summary_to_obj(signed())
    good["age_ms"] = 1
    bad = dict(good, sig="short")
    data = json.dumps({"type": "push", "protocol": 2, "mesh_id": "m", "summaries": [bad, good]}).encode()
    msg = decode_message(data, (1, 2))
    assert len(msg.summaries) == 1 and msg.rejected == ("malformed",)


def test_message_bounds():
    with pytest.raises(OversizedSummary):
        decode_message(b" " * 100, (2,), max_message_bytes=50)
    entries = [[NODE, 1, 1]] * (MAX_ENTRIES + 1)
    data = json.dumps({"type": "digest", "protocol": 2, "mesh_id": "m", "entries": entries}).encode()
    with pytest.raises(OversizedSummary):
        decode_message(data, (2,))
    dup = json.dumps({"type": "digest", "protocol": 2, "mesh_id": "m", "entries": [[NODE, 1, 1]] * 2}).encode()
    with pytest.raises(MalformedSummary, match="twice"):
        decode_message(dup, (2,))
    with pytest.raises(MalformedSummary, match="message.type"):
        decode_message(json.dumps({"type": "push", "protocol": 2, "mesh_id": "m", "summaries": []}).encode(),
                       (2,), expected="digest")


def test_random_garbage_only_ever_raises_typed_errors():
    rng = random.Random(7)
    valid = encode_message(Reply(2, "mesh1", (RelayedSummary(signed(), 3),), {NODE: (1, 1)}))
    samples = [b"", b"[]", b"null", b"{}", b"[" * 100_000, b'{"type":"digest"}', "\u00ff".encode("latin-1")]
    for _ in range(300):
        samples.append(bytes(rng.getrandbits(8) for _ in range(rng.randint(1, 200))))
        mutated = bytearray(valid)
        for _ in range(rng.randint(1, 8)):
            mutated[rng.randrange(len(mutated))] = rng.getrandbits(8)
        samples.append(bytes(mutated))
    for data in samples:
        try:
            decode_message(data, (1, 2))
        except SummaryError:
            pass


HOSTILE = "ok\x1bcX\x1b[2J"


@pytest.mark.parametrize("mutate", [
    lambda o: o["payload"].update(name=HOSTILE),
    lambda o: o["payload"]["models"][0].update(name=HOSTILE),
    lambda o: o["payload"]["models"][0].update(name="a\x85b"),  # C1 (NEL)
    lambda o: o["payload"]["models"][0].update(name="a\u202eb"),  # the config's rule: printable only
    lambda o: o["payload"].update(version="1\x7f"),
    lambda o: o["payload"]["gpus"].append({"index": 0, "name": "H200\n", "memory_total_mib": None,
                                           "memory_free_mib": None}),
], ids=["node name", "model name", "C1", "format char", "DEL", "gpu name"])
def test_control_characters_are_refused_and_counted_as_malformed(mutate):
    with pytest.raises(MalformedSummary):
        decode_summary(_bad(mutate), (1, 2))
    good = summary_to_obj(signed())
    good["age_ms"] = 1
    bad = _bad(mutate)
    bad["age_ms"] = 1
    data = json.dumps({"type": "push", "protocol": 2, "mesh_id": "m", "summaries": [bad, good]}).encode()
    msg = decode_message(data, (1, 2))
    assert len(msg.summaries) == 1 and msg.rejected == ("malformed",)
