"""Probe mode's wire codec (viiwork.mesh.probe_codec): round trips, strict typed refusals,
and a probe-mode mesh over encoded bytes."""

from __future__ import annotations

import json
import random

import pytest

from viiwork.mesh.membership import Liveness
from viiwork.mesh.messages import Ack, Claim, Gossip, Nack, News, Ping, PingReq, Pull, estimate_size
from viiwork.mesh.probe_codec import (
    MAX_PROBE_ITEMS,
    decode_any,
    decode_probe_message,
    encode_any,
    encode_probe_message,
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
