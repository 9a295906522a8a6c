"""Probe mode's wire codec (viiwork.mesh.probe_codec): round trips, strict typed refusals,
and a probe-mode mesh over encoded bytes."""

from __future__ import annotations

import base64
import json
import random

import pytest
from hypothesis import given
from hypothesis import strategies as st

from viiwork.mesh.bounds import MAX_INT
from viiwork.mesh.membership import Liveness
from viiwork.mesh.messages import Ack, Claim, Gossip, Nack, News, Ping, PingReq, Pull, estimate_size
from viiwork.mesh.probe_codec import (
    MAX_PROBE_ITEMS,
    decode_any,
    decode_probe_message,
    encode_any,
    encode_probe_message,
    pack_news,
    unpack_news,
)
from viiwork.mesh.sim import Simulator, sim_node_id
from viiwork.mesh.summary import MalformedSummary, OversizedSummary, SummaryError, UnsupportedProtocol

A, B = sim_node_id(1), sim_node_id(2)
ITEMS = (News(A, (3, 17)), Claim(B, (1, 2), A, bytes(range(64))))
MESSAGES = [
    Ping(4, "m", 7, ITEMS), Ack(4, "m", 7, ()), Nack(4, "m", 8, ITEMS[:1]),
    PingReq(4, "m", 9, B, "10.0.0.2:8087", ITEMS), Gossip(4, "m", ITEMS), Pull(4, "m", {A: (0, 0), B: (2, 5)}),
]


@pytest.mark.parametrize("msg", MESSAGES, ids=lambda m: type(m).__name__)
def test_every_probe_message_round_trips_and_its_size_estimate_is_close(msg):
    data = encode_probe_message(msg)
    assert decode_probe_message(data, (2, 3, 4)) == msg
    assert decode_any(data, (2, 3, 4)) == msg
    assert abs(estimate_size(msg) - len(data)) <= 0.15 * len(data) + 10, (estimate_size(msg), len(data))


@pytest.mark.parametrize("obj,error", [
    ({"type": "ping", "protocol": 4, "mesh_id": "m", "id": 1}, MalformedSummary),  # no news
    ({"type": "ping", "protocol": 4, "mesh_id": "m", "id": -1, "news": []}, MalformedSummary),
    ({"type": "ping", "protocol": 4, "mesh_id": "m", "id": True, "news": []}, MalformedSummary),
    ({"type": "ping", "protocol": 9, "mesh_id": "m", "id": 1, "news": []}, UnsupportedProtocol),
    ({"type": "pong", "protocol": 4, "mesh_id": "m", "id": 1, "news": []}, MalformedSummary),
    ({"type": "gossip", "protocol": 4, "mesh_id": "m", "news": [["n", "nope", 1, 1]]}, MalformedSummary),
    ({"type": "gossip", "protocol": 4, "mesh_id": "m", "news": [["c", A, 1, 1, B, "c2ln"]]}, MalformedSummary),
    ({"type": "gossip", "protocol": 4, "mesh_id": "m", "news": [["n", A, 1, 1]] * (MAX_PROBE_ITEMS + 1)},
     OversizedSummary),
    ({"type": "pull", "protocol": 4, "mesh_id": "m", "wants": [[A, 1, 1], [A, 2, 2]]}, MalformedSummary),
    ({"type": "ping-req", "protocol": 4, "mesh_id": "m", "id": 1, "news": [], "target": A, "address": ""},
     MalformedSummary),
])
def test_malformed_messages_are_refused_with_a_typed_error(obj, error):
    with pytest.raises(error):
        decode_probe_message(json.dumps(obj).encode(), (2, 3, 4))


def test_random_bytes_and_truncations_raise_only_summary_errors():
    rng = random.Random(5)
    samples = [encode_probe_message(m) for m in MESSAGES]
    for _ in range(300):
        data = bytearray(rng.choice(samples))
        if rng.random() < 0.5:
            data = data[: rng.randrange(len(data))]
        else:
            for _ in range(3):
                data[rng.randrange(len(data))] = rng.randrange(256)
        try:
            decode_any(bytes(data), (2, 3, 4))
        except SummaryError:
            pass


def test_a_probe_mode_mesh_over_encoded_bytes_detects_a_crash():
    sim = Simulator(10, seed=21, loss=0.05, mode="probe", wire=True)
    assert sim.run_until_true(sim.converged, 20_000, 100)
    sim.kill(3)
    assert sim.run_until_true(lambda: all(sim.view_of(o.index, 3) is Liveness.DEAD for o in sim.up_nodes()),
                              20_000, 100)
    assert all(sim.knows(a, b) for a in sim.up_nodes() for b in sim.up_nodes() if a is not b)
    assert not any(n.membership.counters.drops["malformed"] for n in sim.nodes)
    assert encode_any(MESSAGES[0]) == encode_probe_message(MESSAGES[0])


_ids = st.integers(0, 2**16).map(sim_node_id)
_orders = st.tuples(st.integers(0, MAX_INT), st.integers(0, MAX_INT))


@given(st.lists(st.builds(News, _ids, _orders), max_size=40))
def test_packed_news_round_trip_any_ids_and_orders(news):
    assert unpack_news(pack_news(news), "news[0]") == news


def test_news_travel_packed_and_cost_about_19_bytes_each():
    news = tuple(News(sim_node_id(i), (1, 100_000 + i)) for i in range(50))
    data = encode_probe_message(Gossip(4, "m", news))
    obj = json.loads(data)
    assert [item[0] for item in obj["news"]] == ["p"]
    assert len(obj["news"][0][1]) == 4 * -(-50 * 14 // 3)  # 10-byte id + 1 + 3 varint bytes, base64
    assert decode_probe_message(data, (4,)) == Gossip(4, "m", news)


def test_the_single_news_item_form_of_earlier_builds_is_still_read():
    data = json.dumps({"type": "gossip", "protocol": 4, "mesh_id": "m", "news": [["n", A, 3, 17], ["p", pack_news(
        [News(B, (1, 2))])]]}).encode()
    assert decode_probe_message(data, (4,)).news == (News(A, (3, 17)), News(B, (1, 2)))


def _gossip(*items):
    return json.dumps({"type": "gossip", "protocol": 4, "mesh_id": "m", "news": list(items)}).encode()


_ID = base64.b32decode(A.upper())


@pytest.mark.parametrize("item,error", [
    (["p", "not base64!"], MalformedSummary),
    (["p", 17], MalformedSummary),
    (["p", base64.b64encode(_ID[:7]).decode()], MalformedSummary),  # ends inside a node id
    (["p", base64.b64encode(_ID + b"\x01\x81").decode()], MalformedSummary),  # ends inside the seq
    (["p", base64.b64encode(_ID + b"\x01" + b"\xff" * 9 + b"\x01").decode()], MalformedSummary),  # 10-byte varint
    (["p", base64.b64encode(_ID + b"\x01" + b"\xff" * 7 + b"\x7f").decode()], MalformedSummary),  # 2**56 - 1
    (["p", base64.b64encode((_ID + b"\x01\x01") * (MAX_PROBE_ITEMS + 1)).decode()], OversizedSummary),
    (["p", "", "extra"], MalformedSummary),
])
def test_malformed_packed_news_is_refused_with_a_typed_error(item, error):
    with pytest.raises(error):
        decode_probe_message(_gossip(item), (4,))


def test_packed_and_single_items_together_are_bounded_by_max_probe_items():
    packed = ["p", base64.b64encode((_ID + b"\x01\x01") * MAX_PROBE_ITEMS).decode()]
    assert len(decode_probe_message(_gossip(packed), (4,)).news) == MAX_PROBE_ITEMS
    with pytest.raises(OversizedSummary):
        decode_probe_message(_gossip(packed, ["n", A, 1, 1]), (4,))


def test_unpacking_stops_at_its_limit_rather_than_reading_the_whole_item():
    text = pack_news([News(sim_node_id(i), (1, i)) for i in range(4)])
    assert len(unpack_news(text, "news[0]", limit=4)) == 4
    with pytest.raises(OversizedSummary):
        unpack_news(text, "news[0]", limit=3)


def test_a_pulls_wants_travel_packed_and_the_list_form_is_still_read():
    wants = {sim_node_id(i): (1, 1000 + i) for i in range(100)}
    data = encode_probe_message(Pull(4, "m", wants))
    assert isinstance(json.loads(data)["wants"], str)
    assert len(data) < 100 * 20 + 80  # ~19 bytes a want, against ~30 as a list
    assert decode_probe_message(data, (4,)) == Pull(4, "m", wants)
    listed = json.dumps({"type": "pull", "protocol": 4, "mesh_id": "m", "wants": [[A, 1, 2]]}).encode()
    assert decode_probe_message(listed, (4,)) == Pull(4, "m", {A: (1, 2)})


@pytest.mark.parametrize("wants,error", [
    (pack_news([News(A, (1, 1)), News(A, (1, 2))]), MalformedSummary),  # a node twice
    ("not base64!", MalformedSummary),
    (base64.b64encode((_ID + b"\x01\x01") * (MAX_PROBE_ITEMS + 1)).decode(), OversizedSummary),
])
def test_malformed_packed_wants_are_refused_with_a_typed_error(wants, error):
    with pytest.raises(error):
        decode_probe_message(json.dumps({"type": "pull", "protocol": 4, "mesh_id": "m", "wants": wants}).encode(), (4,))
