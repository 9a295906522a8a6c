"""GPU figures in the capacity summary (protocol 2): encoded, decoded strictly, shown."""

from __future__ import annotations

import copy

import pytest

from viiwork.agent.cli.mesh import gpus_cell
from viiwork.agent.host.gpus import Gpu, GpuInventory, Vendor
from viiwork.agent.peering.mesh_link import gpu_capacities
from viiwork.mesh.summary import (
    GpuCapacity,
    MalformedSummary,
    PublishedState,
    SummaryPayload,
    decode_payload,
    payload_to_obj,
)

NODE = "a" * 16


def payload(protocol: int, gpus: tuple[GpuCapacity, ...]) -> SummaryPayload:
    return SummaryPayload(protocol=protocol, mesh_id="m", node_id=NODE, name="n", api="", mesh="10.0.0.1:8087",
                          version="0.1.0", generation=1, boot="b", seq=1, state=PublishedState.SERVING, gpus=gpus)


GPUS = (GpuCapacity(0, "NVIDIA H200", 143_360, 100_032), GpuCapacity(1, "NVIDIA H200", None, None))


def test_round_trip_protocol_2() -> None:
    obj = payload_to_obj(payload(2, GPUS))
    assert obj["gpus"][1] == {"index": 1, "name": "NVIDIA H200", "memory_total_mib": None, "memory_free_mib": None}
    assert decode_payload(obj, (1, 2)).gpus == GPUS


def test_protocol_1_has_no_gpus() -> None:
    obj = payload_to_obj(payload(1, GPUS))
    assert "gpus" not in obj
    assert decode_payload(obj, (1, 2)).gpus == ()


@pytest.mark.parametrize(
    ("change", "needle"),
    [
        (lambda o: o["gpus"].append({"index": 2}), "payload.gpus[2]: missing"),
        (lambda o: o["gpus"][0].update(memory_free_mib=200_000), "exceeds total"),
        (lambda o: o["gpus"][0].update(memory_total_mib=-1), "memory_total_mib"),
        (lambda o: o.update(gpus=[o["gpus"][0]] * 65), "at most 64 GPUs"),
        (lambda o: o.update(gpus="all"), "payload.gpus"),
        (lambda o: o.pop("gpus"), "missing gpus"),
    ],
    ids=["missing-keys", "free-above-total", "negative", "too-many", "not-a-list", "absent"],
)
def test_malformed_gpus_are_refused(change, needle: str) -> None:
    obj = copy.deepcopy(payload_to_obj(payload(2, GPUS)))
    change(obj)
    with pytest.raises(MalformedSummary, match=needle.replace("[", r"\[").replace("]", r"\]")):
        decode_payload(obj, (1, 2))


def test_inventory_to_published_gpus_keeps_unknown_as_none() -> None:
    inventory = GpuInventory(gpus=(
        Gpu(vendor=Vendor.NVIDIA, index=0, name="NVIDIA H200", memory_total_bytes=150_000 * 2**20,
            memory_free_bytes=99_999 * 2**20),
        Gpu(vendor=Vendor.AMD, index=1, name=None),
        Gpu(vendor=Vendor.NVIDIA, index=2, name="gone", lost=True),
    ))
    out = gpu_capacities(inventory)
    assert [g.index for g in out] == [0, 1]
    assert out[0].memory_total_mib == 149_952 and out[0].memory_free_mib == 99_968  # 64 MiB steps
    assert out[1].memory_total_mib is None and out[1].name.endswith("GPU")


def test_cell() -> None:
    cell = gpus_cell([{"index": 0, "name": "NVIDIA H200", "memory_total_mib": 143_360, "memory_free_mib": 100_032},
                      {"index": 1, "name": "X", "memory_total_mib": None, "memory_free_mib": None}])
    assert cell.splitlines() == ["0 NVIDIA H200 98/140 GiB free", "1 X ?/? GiB free"]
    assert gpus_cell([]) == "-"
