"""Unit names and labels of a gang's parts (agent/supervision/gang_units.py)."""

from __future__ import annotations

import pytest

from viiwork.agent.supervision.gang_units import gang_labels, gang_unit_stem, part_of_labels
from viiwork.agent.supervision.runners.systemd.units import UNIT_PREFIX, labels_environment, unit_name
from viiwork.engines.gang import GangPart, PartRole


def test_a_parts_unit_name_carries_model_gang_rank_and_role() -> None:
    stem = gang_unit_stem("Qwen/Qwen3-235B", "abcdefgh2345", GangPart(1, PartRole.WORKER))
    assert stem == "viiwork-gang-Qwen\\x2fQwen3\\x2d235B-abcdefgh2345-r1-worker"
    assert unit_name(stem).endswith("-r1-worker.service")
    assert not stem.startswith(UNIT_PREFIX)  # one-host adoption never lists a gang's parts
    head = {gang_unit_stem("m", "abcdefgh2345", GangPart(0, role)) for role in (PartRole.RUNTIME, PartRole.SERVER)}
    assert len(head) == 2  # two parts on the head of a cluster-runtime gang


def test_a_gang_id_is_checked() -> None:
    with pytest.raises(ValueError, match="not a gang id"):
        gang_unit_stem("m", "../etc", GangPart(0, PartRole.SERVER))


def test_labels_go_into_the_environment_and_back() -> None:
    labels = gang_labels("gpu-a", "m", "abcdefgh2345", GangPart(2, PartRole.RANK), 3, "f" * 64)
    env = labels_environment(labels)
    assert "VIIWORK_GANG=abcdefgh2345" in env and "VIIWORK_GANG_RANK=2" in env
    assert part_of_labels(labels) == ("abcdefgh2345", GangPart(2, PartRole.RANK))


@pytest.mark.parametrize("change", [{"gang": "nope"}, {"gang_rank": "-1"}, {"gang_role": "boss"}, {"gang_rank": ""}])
def test_malformed_labels_are_not_a_part(change: dict[str, str]) -> None:
    labels = gang_labels("gpu-a", "m", "abcdefgh2345", GangPart(1, PartRole.WORKER), 2, "f" * 64) | change
    assert part_of_labels(labels) is None
