"""The generated man pages list every sub-command and option of both programs, and man(1)
formats them without a warning."""

from __future__ import annotations

import argparse
import shutil
import subprocess
from pathlib import Path

import pytest

from viiwork.agent.cli import build_parser as ctl_parser
from viiwork.agent.cli.manpage import commands, roff_text, write_pages
from viiwork.agent.main import build_parser as agent_parser


def _options(parser: argparse.ArgumentParser) -> list[str]:
    return [o for a in parser._actions for o in a.option_strings]


@pytest.fixture(scope="module")
def pages(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    out = tmp_path_factory.mktemp("man")
    return {p.stem: p.read_text() for p in write_pages(out)}


def test_viiworkctl_page_lists_every_command_and_option(pages: dict[str, str]) -> None:
    page = pages["viiworkctl"]
    subs = list(commands(ctl_parser()))
    names = {name for name, _, _ in subs}
    assert {"status", "doctor", "mesh", "mesh ca init", "models", "logs"} <= names
    for name, _, sub in subs:
        assert f".SS {roff_text(name)}\n" in page, name
        section = page.split(f".SS {roff_text(name)}\n", 1)[1].split("\n.SS ", 1)[0]
        for option in _options(sub):
            assert f"\\fB{roff_text(option)}\\fR" in section, (name, option)


def test_agent_page_lists_every_option(pages: dict[str, str]) -> None:
    page = pages["viiwork-agent"]
    options = _options(agent_parser())
    assert {"--config", "--demo", "--log-level"} <= set(options)
    for option in options:
        assert f"\\fB{roff_text(option)}\\fR" in page, option


def test_man_formats_the_pages_without_warnings(pages: dict[str, str], tmp_path: Path) -> None:
    # man(1) is man-db, which lintian (a CI package: .ci/run) depends on.
    assert shutil.which("man"), "man(1) is not installed: apt-get install man-db"
    for name, text in pages.items():
        path = tmp_path / f"{name}.1"
        path.write_text(text)
        done = subprocess.run(["man", "--warnings", "-l", str(path)], capture_output=True, text=True,
                              env={"MANWIDTH": "80", "PATH": "/usr/bin:/bin", "MANPAGER": "cat"}, timeout=60)
        assert done.returncode == 0 and done.stderr == "", (name, done.stderr)
        assert name in done.stdout


def test_synopsis_continuation_lines_align_under_the_options(pages: dict[str, str]) -> None:
    page = pages["viiworkctl"]
    block = page[page.index(".SS status\n.nf\n") + len(".SS status\n.nf\n"):]
    first, second = block.splitlines()[:2]
    assert first.startswith("viiworkctl status [")
    # argparse indents by len("usage: viiworkctl status "); without the "usage: " prefix, by 7 less
    assert len(second) - len(second.lstrip(" ")) == len("viiworkctl status ")


def test_every_agent_option_has_help(pages: dict[str, str]) -> None:
    for action in agent_parser()._actions:
        assert action.help, f"{action.option_strings} has no help text"
    assert "log level" in pages["viiwork-agent"]
