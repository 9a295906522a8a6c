"""Strings from an agent or a peer print as they are: no rich markup read, no terminal escape sent."""

from __future__ import annotations

import io
import os
import re
import sys
from pathlib import Path

from rich.console import Console

from viiwork.agent.cli import command_path, mesh, status

EVIL = "x[/b][link=http://evil.example/]plain[/link][reverse]spoof\x1b[2J\x1bcX\u009b"


def _console() -> tuple[Console, io.StringIO]:
    out = io.StringIO()
    return Console(file=out, width=400, force_terminal=True, color_system="standard"), out


def _check(raw: str) -> None:
    # The console's own styles are SGR sequences (ESC [ ... m); no other ESC may appear,
    # and none of the hostile string's: its ESC shows as the four characters \x1b.

    stripped = re.sub(r"\x1b\[[0-9;]*m", "", raw)
    assert "\x1b" not in stripped and "\u009b" not in stripped
    assert "[/b][link=http://evil.example/]plain[/link][reverse]spoof\\x1b[2J\\x1bcX\\xc2\\x9b" in stripped
    assert "\x1b]8;" not in raw  # no OSC 8 hyperlink


def test_mesh_render_prints_every_peer_string_literally() -> None:
    model = {"name": EVIL, "busy": EVIL, "slots": EVIL, "waiting": EVIL, "conflict": True,
             "ejected_backends": [EVIL], "speed": {"prefill_tps": 3, "decode_tps": 4}}
    node = {"name": EVIL, "id": EVIL, "api": EVIL, "liveness": EVIL, "state": EVIL, "age_ms": 5,
            "models": [model], "gpus": [{"index": EVIL, "name": EVIL}], "trust": EVIL}
    doc = {"self": dict(node, mesh_id=EVIL, identity_conflict={"other_address": EVIL}),
           "nodes": [node], "conflicts": [{"model": EVIL, "nodes": {EVIL: EVIL}}]}
    console, out = _console()
    mesh.render(doc, console, wide=True)  # a MarkupError here was the bug
    _check(out.getvalue())


def test_status_render_prints_every_agent_string_literally() -> None:
    doc = {"node": {"name": EVIL, "version": EVIL, "uptime_s": EVIL},
           "models": [{"name": EVIL, "engine": EVIL, "state": EVIL, "waiting": EVIL,
                       "backends": [{"id": EVIL, "state": "starting", "phase": EVIL, "reason": EVIL,
                                     "ejected": True}]}],
           "outliers": {"targets": [{"kind": "peer", "node": EVIL, "model": EVIL, "state": EVIL,
                                     "reason": EVIL}]}}
    console, out = _console()
    status.render(doc, console, wide=True)
    _check(out.getvalue())


def test_command_is_bare_only_when_path_finds_the_same_script(tmp_path: Path, monkeypatch) -> None:
    bin_dir = tmp_path / "venv" / "bin"
    bin_dir.mkdir(parents=True)
    script = bin_dir / "viiworkctl"
    script.write_text("#!/bin/sh\n")
    script.chmod(0o755)
    monkeypatch.setattr(sys, "executable", str(bin_dir / "python"))
    monkeypatch.setenv("PATH", "/nonexistent")
    assert command_path.command("viiworkctl") == str(script)  # a clone: .venv/bin not on PATH
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}/usr/bin")
    assert command_path.command("viiworkctl") == "viiworkctl"
    other = tmp_path / "other"
    other.mkdir()
    (other / "viiworkctl").write_text("#!/bin/sh\n")
    (other / "viiworkctl").chmod(0o755)
    monkeypatch.setenv("PATH", str(other))  # another install first on PATH: not ours
    assert command_path.command("viiworkctl") == str(script)
