"""Pure parts of the systemd runner: unit names, object paths, labels, exit statuses.

That systemd accepts these names and paths is checked against a real manager in
test_systemd_runner.py (odd model names); these pin the exact shapes.
"""

from __future__ import annotations

import pytest

from viiwork.agent.supervision.runners.base import ExitInfo
from viiwork.agent.supervision.runners.systemd.units import (
    engine_unit_stem,
    escape_unit_component,
    exit_info,
    labels_environment,
    labels_from_environment,
    unit_name,
    unit_object_path,
)


@pytest.mark.parametrize(("text", "escaped"), [
    ("Qwen/Qwen3-8B:Q4", "Qwen\\x2fQwen3\\x2d8B:Q4"),
    ("llama 3", "llama\\x203"),
    (".hidden", "\\x2ehidden"),
    ("a.b_c", "a.b_c"),
    ("ü", "\\xc3\\xbc"),
    ("back\\slash", "back\\x5cslash"),
    ("", "\\x00"),
], ids=["hub-id", "space", "leading-dot", "plain", "utf8", "backslash", "empty"])
def test_escape_unit_component(text: str, escaped: str) -> None:
    assert escape_unit_component(text) == escaped


def test_engine_unit_stem_and_name() -> None:
    stem = engine_unit_stem("gpu-01", "Qwen/Qwen3-8B:Q4", 2)
    assert stem == "viiwork-engine-gpu\\x2d01-Qwen\\x2fQwen3\\x2d8B:Q4-2"
    assert unit_name(stem) == stem + ".service"  # already valid: unchanged


def test_unit_name_escapes_what_systemd_rejects_and_keeps_dashes() -> None:
    assert unit_name("viiwork-engine-n1-a b/c-0") == "viiwork-engine-n1-a\\x20b\\x2fc-0.service"


def test_long_names_are_cut_with_a_digest() -> None:
    a = unit_name("viiwork-engine-n-" + "x" * 400 + "-0")
    b = unit_name("viiwork-engine-n-" + "x" * 400 + "-1")
    assert len(a) == len(b) == 255 and a != b
    assert a.endswith(".service")


def test_empty_stem_is_refused() -> None:
    with pytest.raises(ValueError, match="empty"):
        unit_name("")


@pytest.mark.parametrize(("name", "path"), [
    ("vw-x.service", "/org/freedesktop/systemd1/unit/vw_2dx_2eservice"),
    ("9lives.service", "/org/freedesktop/systemd1/unit/_39lives_2eservice"),
    ("a\\x2fb.service", "/org/freedesktop/systemd1/unit/a_5cx2fb_2eservice"),
])
def test_unit_object_path(name: str, path: str) -> None:
    assert unit_object_path(name) == path


def test_labels_round_trip_through_the_environment() -> None:
    labels = {"owner": "node-a", "model": "Qwen/Qwen3-8B:Q4", "index": "0", "config_hash": "ab=cd"}
    env = ["PATH=/usr/bin", "VIIWORK_STRAY=x", *labels_environment(labels)]
    assert "VIIWORK_OWNER=node-a" in env and "VIIWORK_LABELS=owner,model,index,config_hash" in env
    assert labels_from_environment(env) == labels
    assert labels_from_environment(["PATH=/usr/bin", "VIIWORK_OWNER=x"]) is None  # not ours


@pytest.mark.parametrize("key", ["Owner", "1st", "a-b", ""])
def test_bad_label_keys_are_refused(key: str) -> None:
    with pytest.raises(ValueError, match="label key"):
        labels_environment({key: "v"})


@pytest.mark.parametrize(("args", "want"), [
    (("success", 1, 0), ExitInfo("success", 0, None, "unit u")),
    (("exit-code", 1, 3), ExitInfo("exit-code", 3, None, "unit u")),
    (("signal", 2, 9), ExitInfo("signal", None, 9, "unit u")),
    (("core-dump", 3, 11), ExitInfo("core-dump", None, 11, "unit u")),
    (("", 0, 0), ExitInfo("unknown", None, None, "unit u")),
], ids=["success", "exit-code", "signal", "core-dump", "never-ran"])
def test_exit_info(args: tuple[str, int, int], want: ExitInfo) -> None:
    assert exit_info(*args, unit="u") == want


def test_systemd_own_exit_statuses_are_explained() -> None:
    info = exit_info("exit-code", 1, 226, "u")
    assert info.returncode == 226
    assert "NAMESPACE" in info.detail and 'sandbox = "none"' in info.detail
    assert "EXEC" in exit_info("exit-code", 1, 203).detail
