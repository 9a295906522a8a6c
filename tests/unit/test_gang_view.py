"""Gangs in the summary and in viiworkctl (issue 21): the ``gangs`` extension a node publishes
(on change only), and the lines ``viiworkctl status`` and ``viiworkctl mesh`` print for them.

The same paths with two real agents on loopback: tests/mesh/test_agents_gang.py.
"""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

from rich.console import Console

from viiwork.agent.cli.mesh import gang_lines as mesh_gang_lines
from viiwork.agent.cli.mesh import render as render_mesh
from viiwork.agent.cli.status import gang_lines as status_gang_lines
from viiwork.agent.cli.status import render as render_status
from viiwork.agent.config.schema import Config
from viiwork.agent.peering.gang_ext import gangs_of
from viiwork.agent.peering.mesh_link import MeshLink
from viiwork.agent.serving.proxy import Upstream
from viiwork.agent.serving.waitqueue import Queues
from viiwork.mesh.extensions import GANGS, MAX_GANG_MEMBERS, Extensions, GangMember
from viiwork.mesh.identity import NodeId

HEAD = NodeId("a" * 16)


def member(model: str = "big", gang: str = "g1", rank: int = 0, size: int = 2) -> GangMember:
    return GangMember(model, gang, rank, size, HEAD)


def test_gangs_of_orders_caps_and_leaves_out_none() -> None:
    assert gangs_of([]) is None
    value = gangs_of([member("b", rank=1), member("a"), member("b", rank=1)])
    assert value is not None and [(m.model, m.rank) for m in value.members] == [("a", 0), ("b", 1)]
    many = gangs_of(member(f"m{i:02}") for i in range(MAX_GANG_MEMBERS + 3))
    assert many is not None and len(many.members) == MAX_GANG_MEMBERS
    # What it builds is within the extension's bounds (a summary carries it).
    assert Extensions.of({GANGS: many}).get(GANGS) == many


def link(tmp_path: Path) -> MeshLink:
    config = Config.model_validate({
        "node": {"name": "n", "state_dir": str(tmp_path)}, "api": {"listen": "127.0.0.1:0"},
        "mesh": {"trust": "open", "mesh_id": "t", "listen": "127.0.0.1:0", "discovery": ["seeds"]}, "models": []})
    return MeshLink(config, {}, queues=Queues({}, 4, 1.0), upstream=Upstream(1.0), draining=lambda: False)


def test_the_gangs_extension_is_republished_on_change_only(tmp_path: Path) -> None:
    mesh = link(tmp_path)
    members: list[GangMember] = []
    mesh.gang_members = lambda: members
    mesh._capacity()
    assert mesh.node._pending_extensions is None or mesh.node._pending_extensions.get(GANGS) is None
    members.append(member(rank=1))  # a part starts
    mesh._capacity()
    published = mesh.node._pending_extensions
    assert published is not None and published.get(GANGS) == gangs_of(members)
    mesh._capacity()
    assert mesh.node._pending_extensions is published  # nothing changed: no new summary
    members[0] = member(gang="g2", rank=1)  # a new gang id
    mesh._capacity()
    again = mesh.node._pending_extensions
    assert again is not published and again is not None and again.get(GANGS) == gangs_of(members)
    members.clear()  # the part stops: the extension is left out
    mesh._capacity()
    assert mesh.node._pending_extensions is not again
    assert mesh.node._pending_extensions is not None and mesh.node._pending_extensions.get(GANGS) is None


STATUS_GANGS = {
    "heads": {"big": {"gang": "g1", "parts": [{"rank": 1, "host": "w1", "node_id": "x"}], "tunnels": [],
                      "last_failure": "w1 (rank 1) is dead, serving", "starts": 3, "failures": 1, "parts_lost": 1},
              "idle": {"gang": None, "parts": [], "tunnels": [], "last_failure": "", "starts": 0, "failures": 0,
                       "parts_lost": 0}},
    "parts": [{"model": "other", "gang": "g9", "rank": 2, "size": 3, "head": "y", "gpus": ["0", "GPU-1f"], "running": False,
               "parts": [{"role": "rpc", "pid": 41, "unit": None}]}],
    "refused": {"not_the_head": 2},
}


def test_status_lines_show_heads_parts_and_refusals() -> None:
    assert status_gang_lines(None) == [] and status_gang_lines({"heads": "x", "parts": ["y"]}) == []
    assert status_gang_lines(STATUS_GANGS) == [
        "big: head of gang g1, parts: w1 rank 1; starts 3, failures 1, parts lost 1; "
        "last failure: w1 (rank 1) is dead, serving",
        "idle: head of gang none (not running), parts: -; starts 0, failures 0, parts lost 0",
        "other: part of gang g9, rank 2 of 3, GPUs 0, GPU-1f, not running (rpc pid 41)",
        "requests refused: not_the_head 2",
    ]


def printed(render: Any, doc: dict[str, Any]) -> str:
    out = io.StringIO()
    render(doc, Console(file=out, width=200, color_system=None))
    return out.getvalue()


def test_status_table_ends_with_the_gang_lines_and_escapes_them() -> None:
    doc = {"node": {"name": "n"}, "models": [], "gangs": {"heads": {}, "parts": [
        {"model": "m\x1b[31m", "gang": "g", "rank": 1, "running": True, "parts": []}]}}
    text = printed(render_status, doc)
    assert "gang m\\x1b[31m: part of gang g, rank 1, running" in text and "\x1b" not in text


MESH_GANGS = [
    {"model": "big", "gang": "g1", "size": 3, "leader": HEAD, "leader_name": "head",
     "parts": [{"rank": 0, "node": HEAD, "name": "head"}, {"rank": 2, "node": "z", "name": "w2"}]},
    {"model": "x", "gang": "g2", "size": 2, "leader": HEAD, "leader_name": None,
     "parts": [{"rank": 1, "node": "q", "name": "w\x07"}]},
]


def test_mesh_lines_list_each_gang_with_its_ranks_and_the_missing_ones() -> None:
    assert mesh_gang_lines(None) == [] and mesh_gang_lines(["x", {"size": "many"}])[0].startswith("?: gang ?, 0/many")
    assert mesh_gang_lines(MESH_GANGS) == [
        "big: gang g1, 2/3 parts, leader head: rank 0 head, rank 2 w2; missing rank 1",
        f"x: gang g2, 1/2 parts, leader {HEAD}: rank 1 w\\x07; missing rank 0",
    ]
    text = printed(render_mesh, {"self": None, "nodes": [], "gangs": MESH_GANGS})
    assert "gang big: gang g1, 2/3 parts" in text and "\x07" not in text
