"""Strings and cross-field rules of the config: refused at load, naming field and line.

Issue 14 (F7): configs that passed ``viiworkctl config check`` and then crashed the agent
at start (an oversized mesh summary, ``interfaces = ["eth0\\u0000"]``) or a backend's
supervision (a NUL in ``env``, ``args`` or ``path``: ``ValueError: embedded null byte``).
The rules are in docs/configuration.md ("Rules"). Configs are TOML text read by the real
loader; one test starts the real agent on the config that used to crash it.
"""

from __future__ import annotations

import dataclasses
import logging
import subprocess
from pathlib import Path

import pytest
from conftest import venv_bin

from support.mesh_crypto import ManualClock, TestCA, chat_model, core
from viiwork.agent.config.load import ConfigError, ConfigIssue, parse_config
from viiwork.agent.config.schema import largest_summary_bytes, parse_hostport
from viiwork.mesh.summary import MAX_SUMMARY_BYTES, GpuCapacity

NODE = '[node]\nname = "n"\nstate_dir = "/tmp/viiwork-strings"\n'
MESH = '[mesh]\ntrust = "open"\nmesh_id = "lab"\n'
MODEL = '[[models]]\nname = "m"\nengine = "llamacpp"\npath = "/m.gguf"\n'


def issues_of(text: str) -> list[ConfigIssue]:
    try:
        parse_config(text, "strings.toml")
    except ConfigError as exc:
        return exc.issues
    return []


def line_of(text: str, needle: str) -> int:
    (line,) = [i for i, t in enumerate(text.splitlines(), 1) if needle in t]
    return line


def big_models(count: int, name_chars: int) -> str:
    """``count`` [[models]] with names of ``name_chars`` characters (the attacker's config)."""
    return "".join(f'[[models]]\nname = "{"m" * (name_chars - 3)}{i:03d}"\nengine = "llamacpp"\npath = "/dev/null"\n'
                   for i in range(count))


# (id, config text, the field named, a substring of the line the error names)
REFUSED = [
    ("mesh_id-100KB", NODE + '[mesh]\ntrust = "open"\nmesh_id = "' + "x" * 100_000 + '"\n' + MODEL,
     "mesh.mesh_id", "mesh_id ="),
    ("mesh_id-65", NODE + '[mesh]\ntrust = "open"\nmesh_id = "' + "x" * 65 + '"\n' + MODEL, "mesh.mesh_id", "mesh_id ="),
    ("mesh_id-slash", NODE + '[mesh]\ntrust = "open"\nmesh_id = "lab/7"\n' + MODEL, "mesh.mesh_id", "mesh_id ="),
    ("mesh_id-space", NODE + '[mesh]\ntrust = "open"\nmesh_id = "lab 7"\n' + MODEL, "mesh.mesh_id", "mesh_id ="),
    ("interface-nul", NODE + MESH + 'interfaces = ["eth0\\u0000"]\n' + MODEL, "mesh.interfaces[0]", "interfaces ="),
    ("interface-16-bytes", NODE + MESH + 'interfaces = ["lo", "abcdefghijklmnop"]\n' + MODEL,
     "mesh.interfaces[1]", "interfaces ="),
    ("interface-slash", NODE + MESH + 'interfaces = ["../eth0"]\n' + MODEL, "mesh.interfaces[0]", "interfaces ="),
    ("interface-space", NODE + MESH + 'interfaces = ["eth 0"]\n' + MODEL, "mesh.interfaces[0]", "interfaces ="),
    ("env-value-nul", NODE + MODEL + 'env = {A = "x\\u0000y"}\n', "models[0].env.A", "env ="),
    ("env-name-nul", NODE + MODEL + 'env = {"A\\u0000" = "x"}\n', "models[0].env", "env ="),
    ("env-name-space", NODE + MODEL + 'env = {"A B" = "x"}\n', "models[0].env", "env ="),
    ("env-name-digit", NODE + MODEL + 'env = {"1A" = "x"}\n', "models[0].env", "env ="),
    ("env-name-equals", NODE + MODEL + 'env = {"A=B" = "x"}\n', "models[0].env", "env ="),
    ("args-nul", NODE + MODEL + 'args = ["--x", "y\\u0000"]\n', "models[0].args[1]", "args ="),
    ("path-nul", NODE + MODEL.replace("/m.gguf", "/m.gguf\\u0000x"), "models[0].path", "path ="),
    ("binary-nul", NODE + MODEL + '[models.llamacpp]\nbinary = "/usr/bin/llama-server\\u0000"\n',
     "models[0].llamacpp.binary", "binary ="),
    ("vllm-python-nul", NODE + '[[models]]\nname = "v"\nengine = "vllm"\npath = "/m"\n[models.vllm]\npython = "py\\u0000"\n',
     "models[0].vllm.python", "python ="),
    ("port-underscores", NODE + '[api]\nlisten = "127.0.0.1:8_0_8_6"\n' + MODEL, "api.listen", "listen ="),
    ("port-arabic-digits", NODE + '[api]\nlisten = "127.0.0.1:\u0668\u0660\u0668\u0666"\n' + MODEL, "api.listen", "listen ="),
    ("port-space", NODE + '[api]\nlisten = "127.0.0.1: 8086"\n' + MODEL, "api.listen", "listen ="),
    ("port-plus", NODE + MESH + 'listen = "127.0.0.1:+8087"\n' + MODEL, "mesh.listen", "listen ="),
    ("seed-port-underscores", NODE + MESH + 'seeds = ["10.0.0.1:80_87"]\n' + MODEL, "mesh.seeds", "seeds ="),
    ("advertise-garbage", NODE + MESH + 'advertise = "a:b:c/../\\r\\nX: y"\n' + MODEL, "mesh.advertise", "advertise ="),
    ("advertise-empty-label", NODE + MESH + 'advertise = "gpu..lab"\n' + MODEL, "mesh.advertise", "advertise ="),
    ("advertise-port-0", NODE + MESH + 'advertise = "10.0.0.1:0"\n' + MODEL, "mesh.advertise", "advertise ="),
    ("state_dir-empty", '[node]\nname = "n"\nstate_dir = ""\n' + MODEL, "node.state_dir", "state_dir ="),
    ("state_dir-relative", '[node]\nname = "n"\nstate_dir = "st"\n' + MODEL, "node.state_dir", "state_dir ="),
    ("admin_socket-relative", NODE + '[api]\nadmin_socket = "admin.sock"\n' + MODEL, "api.admin_socket", "admin_socket ="),
    ("log_dir-empty", NODE + '[supervisor]\nlog_dir = ""\n' + MODEL, "supervisor.log_dir", "log_dir ="),
    ("suspect-below-2-rounds", NODE + MESH + "gossip_interval_ms = 1000\nsuspect_after_ms = 1999\n" + MODEL,
     "mesh.suspect_after_ms", "suspect_after_ms ="),
    ("dead-below-3-rounds", NODE + MESH + "gossip_interval_ms = 1000\nsuspect_after_ms = 2000\ndead_after_ms = 2999\n"
     + MODEL, "mesh.dead_after_ms", "dead_after_ms ="),
    ("gossip-a-day", NODE + MESH + "gossip_interval_ms = 86400000\nsuspect_after_ms = 86399999\ndead_after_ms = 86400000\n"
     + MODEL, "mesh.gossip_interval_ms", "gossip_interval_ms ="),
    ("65-models", NODE + MESH + big_models(65, 8), "models[64]", 3 + 3 + 64 * 4 + 1),  # its [[models]] line
    ("summary-64x193", NODE + MESH + big_models(64, 193), "models[0].name", 'name = "mmm'),
]


@pytest.mark.parametrize(("text", "field", "line_text"), [pytest.param(*c[1:], id=c[0]) for c in REFUSED])
def test_refused_naming_field_and_line(text: str, field: str, line_text: str | int) -> None:
    issues = issues_of(text)
    assert issues, f"accepted: {field}"
    if isinstance(line_text, int):
        line = line_text
    else:
        line = [i for i, t in enumerate(text.splitlines(), 1) if line_text in t][0]
    for issue in issues:
        assert issue.dotted == field, str(issue)
        assert issue.line == line, str(issue)


def test_nul_anywhere_is_refused_at_its_path() -> None:
    # One check for every string: a field nobody thought of (the node name) included.
    issues = issues_of('[node]\nname = "a\\u0000"\nstate_dir = "/v"\n')
    assert [i.dotted for i in issues] == ["node.name"] * len(issues) and "NUL" in str(issues[0])


@pytest.mark.parametrize("text", [
    NODE + '[mesh]\ntrust = "open"\nmesh_id = "' + "x" * 64 + '"\n' + MODEL,
    NODE + '[mesh]\ntrust = "open"\nmesh_id = "lab-7.a_b"\ninterfaces = ["enp0s31f6", "br-0123456789ab", "10.0.0.1"]\n'
    + MODEL,
    NODE + MESH + "gossip_interval_ms = 1000\nsuspect_after_ms = 2000\ndead_after_ms = 3000\n" + MODEL,
    NODE + MESH + 'advertise = "gpu-01.lab.example:8087"\n' + MODEL,
    NODE + MODEL + 'env = {_A1 = "x", CUDA_VISIBLE_DEVICES = "0"}\n',
    NODE + big_models(64, 193),  # standalone: no summary to fit
    NODE + MESH + big_models(64, 40),  # docs/configuration.md: "about 64 names of 40 characters fit"
], ids=["mesh_id-64", "interfaces", "timing-at-the-floor", "advertise-name-port", "env", "big-standalone", "64x40-mesh"])
def test_accepted(text: str) -> None:
    assert issues_of(text) == []


def test_the_summary_bound_is_the_encoder_s() -> None:
    """The load-time bound is what the real encoder makes; the largest accepted config fits it."""
    fits = parse_config(NODE + MESH + big_models(64, 40))
    assert 15_000 < largest_summary_bytes(fits) <= MAX_SUMMARY_BYTES
    one = parse_config(NODE + MESH + MODEL)
    assert largest_summary_bytes(one) < 1500


@pytest.mark.parametrize("port", ["8_0_8_6", "\u0668\u0660\u0668\u0666", " 8086", "8086 ", "+8086", "-1", ""])
def test_parse_hostport_takes_ascii_digits_only(port: str) -> None:
    with pytest.raises(ValueError, match="port must be a number"):
        parse_hostport(f"127.0.0.1:{port}")


def test_publisher_drops_gpus_from_an_oversized_summary_then_counts(caplog: pytest.LogCaptureFixture) -> None:
    """The host's GPUs are not in the load-time bound: a summary too large with them is
    published without them, counted, one WARNING; one that cannot fit keeps the last."""
    ca, clock = TestCA(), ManualClock()
    m, pub = core(ca.node("big"), ca, clock)
    seq = pub.seq
    gpus = [GpuCapacity(index=i, name="G" * 128, memory_total_mib=1 << 20, memory_free_mib=1 << 19) for i in range(64)]
    models = [dataclasses.replace(chat_model(f"{i:03d}" + "m" * 40)) for i in range(40)]
    with caplog.at_level(logging.DEBUG, logger="viiwork.mesh.publisher"):
        pub.set_local(models, gpus=gpus)
        summary = pub.maybe_publish(force=True)
        assert summary is not None and summary.payload.gpus == () and len(summary.payload.models) == 40
        assert summary.payload.seq == seq + 1
        pub.set_local([chat_model("m" * 200 + str(i)) for i in range(64)], gpus=gpus)  # past any config's bound
        assert pub.maybe_publish(force=True) is None
        assert pub.last is summary and pub.seq == seq + 1
    assert m.counters.transport["summary_oversized"] == 3  # with GPUs; with, then without
    assert [r.levelname for r in caplog.records if "summary" in r.getMessage()] == ["WARNING", "DEBUG", "DEBUG"]


def test_agent_refuses_the_config_that_crashed_it(tmp_path: Path) -> None:
    """The attacker's big.toml (64 models of 193-character names) raised OversizedSummary
    from the publisher at start, a traceback; now the agent refuses it before starting
    anything: exit 1, the error naming field and line, no traceback."""
    state = tmp_path / "state"
    config = tmp_path / "big.toml"
    config.write_text(f'[node]\nname = "n"\nstate_dir = "{state}"\n[api]\nlisten = "127.0.0.1:0"\n'
                      f'admin_socket = "{tmp_path / "a.sock"}"\n[mesh]\ntrust = "open"\nmesh_id = "x"\n'
                      'listen = "127.0.0.1:0"\ndiscovery = ["seeds"]\n' + big_models(64, 193))
    agent = venv_bin("viiwork-agent")
    result = subprocess.run([str(agent), "--config", str(config)], capture_output=True, text=True, timeout=60)
    out = result.stdout + result.stderr
    assert result.returncode == 1, out
    assert "Traceback" not in out
    errors = [ln.strip() for ln in out.splitlines() if ln.strip().startswith("models[")]
    assert errors == [f"models[0].name: {errors[0].split(': ', 1)[1]}"], out
    assert f"(line {line_of(config.read_text(), 'm' * 190 + '000')})" in errors[0] and "16384" in errors[0], out
    assert not state.exists()  # refused before the state dir was made
