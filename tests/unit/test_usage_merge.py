"""The usage of several nodes added up (agent/usage/query.py: ``summarise_parts``, ``merge``): the
sums are those of one file holding every row, and the median is within the bucket step of the exact
one; a part a peer sends is checked before it is added."""

from __future__ import annotations

import random
import sqlite3
from pathlib import Path

import pytest

from viiwork.agent.peering.mesh_usage import decode_parts
from viiwork.agent.usage.query import (
    DURATION_BUCKET_RATIO,
    MAX_BUCKET,
    Grouping,
    GroupKeyRefused,
    GroupPart,
    merge,
    summarise,
    summarise_parts,
)
from viiwork.agent.usage.store import UsageRow, insert_rows, open_for_writing


def rows(rng: random.Random, n: int, node: str) -> list[UsageRow]:
    return [UsageRow(finished_at_ms=1_000_000 + i, request_id=f"{node}-{i}", tenant=rng.choice(["acme", "globex", ""]),
                     jti="k", model=rng.choice(["llama", "qwen"]), origin_node="", serving_node=node,
                     prompt_tokens=rng.choice([None, rng.randrange(1, 500)]), completion_tokens=rng.randrange(0, 99),
                     cached_tokens=None, status=rng.choice([200, 200, 200, 429, 500]), queued_ms=0.0, ttft_ms=None,
                     duration_ms=rng.choice([0.4, rng.uniform(1, 90_000)]))
            for i in range(n)]


def write(path: Path, batch: list[UsageRow]) -> sqlite3.Connection:
    conn = open_for_writing(path)
    insert_rows(conn, batch)
    return conn


@pytest.mark.parametrize("by", list(Grouping), ids=lambda g: g.value)
def test_three_nodes_merged_equal_one_file_with_every_row(tmp_path: Path, by: Grouping) -> None:
    rng = random.Random(7)
    batches = {node: rows(rng, n, node) for node, n in (("a", 400), ("b", 251), ("c", 1))}
    everything = write(tmp_path / "all.sqlite3", [r for b in batches.values() for r in b])
    parts = []
    for node, batch in batches.items():
        conn = write(tmp_path / f"{node}.sqlite3", batch)
        got, left_out = summarise_parts(conn, 1_000_100, by)
        assert left_out == 0
        parts += got
        conn.close()
    merged = {r.key: r for r in merge(parts)}
    exact = {r.key: r for r in summarise(everything, 1_000_100, by)}
    assert merged.keys() == exact.keys()
    for key, want in exact.items():
        got = merged[key]
        assert (got.requests, got.errors, got.prompt_tokens, got.completion_tokens, got.cached_tokens) == \
            (want.requests, want.errors, want.prompt_tokens, want.completion_tokens, want.cached_tokens)
        if want.p50_duration_ms < 1:
            assert got.p50_duration_ms < 1
        else:
            assert abs(got.p50_duration_ms / want.p50_duration_ms - 1) <= DURATION_BUCKET_RATIO - 1, (key, got, want)
    assert [r.key for r in merge(parts)] == [r.key for r in summarise(everything, 1_000_100, by)]


def test_a_part_round_trips_and_a_bad_one_is_refused() -> None:
    part = GroupPart("acme", 3, 1, None, 12, 0, {0: 1, 80: 2})
    assert GroupPart.from_dict(part.as_dict()) == part
    good = part.as_dict()
    for bad in ({**good, "requests": 4},  # buckets do not add up
                {**good, "errors": 9},
                {**good, "durations": [[MAX_BUCKET + 1, 3]]},
                {**good, "durations": [[1, -3], [2, 6]]},
                {**good, "prompt_tokens": True},
                {**good, "key": 5},
                [good]):
        with pytest.raises(ValueError):
            GroupPart.from_dict(bad)


def test_a_peer_group_key_with_a_control_character_is_dropped_and_counted() -> None:
    good = GroupPart("acme", 1, 0, 1, 1, 0, {3: 1}).as_dict()
    bad_keys = ["\x1b[2J", "a\nb", "rtl\u202e", "k" * 257]
    for key in bad_keys:
        with pytest.raises(GroupKeyRefused):
            GroupPart.from_dict({**good, "key": key})
    assert GroupPart.from_dict({**good, "key": "k" * 256}).key == "k" * 256
    parts, refused = decode_parts([good, *({**good, "key": k} for k in bad_keys), {**good, "key": "[/red]"}])
    assert [p.key for p in parts] == ["acme", "[/red]"] and refused == len(bad_keys)
    with pytest.raises(ValueError):  # any other fault still refuses the whole answer
        decode_parts([good, {**good, "requests": 7}])
