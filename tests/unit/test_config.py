"""The config loader (viiwork.agent.config.load, models in viiwork.agent.config.schema) and `viiworkctl config check`.

Every error names its field path (indexes from 0) and, where the key is in the file, its
line: ``models[1].llamacpp.thread: unknown key (line 23)`` (docs/configuration.md).
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from viiwork.agent.config.load import ConfigError, ConfigIssue, load_config, parse_config
from viiwork.agent.config.schema import Config
from viiwork.engines.contract import Kind
from viiwork.engines.registry import engine_names

VALID = """\
[node]
name = "gpu-01"
state_dir = "/tmp/viiwork-test-state"

[api]
listen = "127.0.0.1:9086"
max_body_bytes = 1048576

[supervisor]
runner = "process"

[health]
interval_s = 2

[[models]]
name = "llama-8b"
engine = "llamacpp"
path = "/models/llama-8b.gguf"
gpus = [0, 1, 2, 3]
gpus_per_backend = 2
ctx_per_slot = 8192
parallel = 2
args = ["--flash-attn", "on"]
env = { GGML_CUDA_NO_PINNED = "1" }

[models.llamacpp]
threads = 4

[[models]]
name = "embed"
engine = "llamacpp"
kind = "embedding"
path = "/models/embed.gguf"
backends = 2

[[models]]
name = "big"
engine = "llamacpp"
path = "/models/big.gguf"
gpus = ["GPU-8f0c1e2a-0000-0000-0000-000000000001"]
startup_timeout_s = 900
"""


def errors_of(text: str) -> list[ConfigIssue]:
    with pytest.raises(ConfigError) as info:
        parse_config(textwrap.dedent(text), "test.toml")
    return info.value.issues


def only_error(text: str) -> ConfigIssue:
    issues = errors_of(text)
    assert len(issues) == 1, [str(i) for i in issues]
    return issues[0]


def test_valid_file_loads_with_values_and_defaults() -> None:
    cfg = parse_config(VALID, "valid.toml")
    assert isinstance(cfg, Config)
    assert cfg.node.name == "gpu-01"
    assert cfg.node.state_dir == Path("/tmp/viiwork-test-state")
    assert cfg.api.listen == "127.0.0.1:9086"
    assert cfg.api.max_body_bytes == 1048576
    assert cfg.api.stream_idle_timeout_s == 120          # default (docs/configuration.md)
    assert cfg.supervisor.runner == "process"
    assert cfg.health.interval_s == 2.0
    assert cfg.health.max_failures == 3                   # default
    assert cfg.routing.queue_max == 64                    # default
    assert cfg.mesh is None                               # standalone node

    llama, embed, big = cfg.models
    assert llama.kind is Kind.CHAT
    assert llama.backend_count == 2
    assert llama.backend_gpus(0) == ("0", "1")
    assert llama.backend_gpus(1) == ("2", "3")
    assert llama.args == ["--flash-attn", "on"]
    assert llama.env == {"GGML_CUDA_NO_PINNED": "1"}
    assert llama.options.threads == 4
    assert llama.options.binary == "llama-server"         # the engine's default
    assert llama.effective_startup_timeout_s == 600       # llamacpp's default

    assert embed.kind is Kind.EMBEDDING
    assert embed.backend_count == 2
    assert embed.backend_gpus(0) == ()                    # CPU
    assert embed.options is not None                      # engine defaults without a block

    assert big.backend_gpus(0) == ("GPU-8f0c1e2a-0000-0000-0000-000000000001",)
    assert big.effective_startup_timeout_s == 900


def test_empty_file_is_a_standalone_node_with_defaults() -> None:
    cfg = parse_config("", "empty.toml")
    assert cfg.models == []
    assert cfg.mesh is None
    assert cfg.api.listen == "0.0.0.0:8086"
    assert cfg.api.max_body_bytes == 32 * 1024 * 1024


def test_mesh_with_ca_trust_is_accepted() -> None:
    cfg = parse_config(
        '[mesh]\ntrust = "ca"\nca_certificate = "/etc/viiwork/ca.crt"\nseeds = ["10.0.0.2:8087"]\n'
    )
    assert cfg.mesh is not None
    assert cfg.mesh.trust == "ca"
    assert cfg.mesh.ca_certificate == Path("/etc/viiwork/ca.crt")
    assert cfg.mesh.listen == "0.0.0.0:8087"
    assert cfg.mesh.dead_after_ms == 10000


def test_mesh_detector_defaults_to_probe_and_takes_heartbeat() -> None:
    base = '[mesh]\ntrust = "open"\nmesh_id = "lab"\n'
    cfg = parse_config(base)
    assert cfg.mesh is not None and cfg.mesh.detector == "probe"
    assert (cfg.mesh.probe_interval_ms, cfg.mesh.probe_timeout_ms, cfg.mesh.indirect_checks,
            cfg.mesh.suspicion_mult) == (500, 200, 4, 4)
    cfg = parse_config(base + 'detector = "heartbeat"\n')
    assert cfg.mesh is not None and cfg.mesh.detector == "heartbeat"
    issue = only_error(base + 'detector = "swim"\n')
    assert issue.path == ("mesh", "detector")
    assert "heartbeat" in issue.message and "probe" in issue.message
    assert issue.line == 4


def test_probe_timeout_must_end_before_the_next_probe() -> None:
    base = '[mesh]\ntrust = "open"\nmesh_id = "lab"\n'
    issue = only_error(base + 'probe_interval_ms = 300\nprobe_timeout_ms = 300\n')
    assert issue.path == ("mesh", "probe_timeout_ms")
    assert "less than probe_interval_ms (300)" in issue.message
    assert only_error(base + 'indirect_checks = 17\n').path == ("mesh", "indirect_checks")
    cfg = parse_config(base + 'probe_interval_ms = 1000\nprobe_timeout_ms = 400\nsuspicion_mult = 6\n')
    assert cfg.mesh is not None and cfg.mesh.probe_timeout_ms == 400 and cfg.mesh.suspicion_mult == 6


def test_heartbeat_keys_set_in_probe_mode_are_deprecated_once() -> None:
    base = '[mesh]\ntrust = "open"\nmesh_id = "lab"\n'
    for quiet in (base, base + 'detector = "heartbeat"\nsuspect_after_ms = 3000\nfanout = 4\n',
                  base + 'probe_interval_ms = 400\n'):
        cfg = parse_config(quiet)
        assert cfg.mesh is not None and cfg.mesh.deprecations() == [], quiet
    cfg = parse_config(base + 'suspect_after_ms = 3000\ndead_after_ms = 12000\n')
    assert cfg.mesh is not None
    (line,) = cfg.mesh.deprecations()
    assert "failure detection is no longer timed by suspect_after_ms and dead_after_ms but by probes" in line
    for replacement in ("probe_interval_ms", "probe_timeout_ms", "indirect_checks", "suspicion_mult"):
        assert replacement in line
    assert "heartbeat-mode peers" in line and "fanout" not in line
    cfg = parse_config(base + 'gossip_interval_ms = 250\nfanout = 2\ndead_after_ms = 12000\n')
    assert cfg.mesh is not None
    (line,) = cfg.mesh.deprecations()
    assert "no longer timed by dead_after_ms but by probes" in line and "still judged by it" in line
    assert "gossip is no longer paced by gossip_interval_ms and fanout" in line
    assert "suspect_after_ms" not in line


def test_error_format_matches_the_documented_example() -> None:
    """The exact shape quoted in docs/configuration.md and docs/configuration.md."""
    text = VALID + textwrap.dedent("""\

        [[models]]
        name = "second-small"
        engine = "llamacpp"
        path = "/models/small.gguf"

        [models.llamacpp]
        thread = 2
        """)
    (issue,) = errors_of(text)
    line = text.splitlines().index("thread = 2") + 1
    assert str(issue) == f"models[3].llamacpp.thread: unknown key (line {line})"


# (id, TOML text, path, fragment of the message, line)
ERROR_CASES = [
    ("unknown-key-top-level", """\
        bogus = 1
        """, "bogus", "unknown key", 1),
    ("unknown-key-in-section", """\
        [api]
        listen = "127.0.0.1:8086"
        lissen = "127.0.0.1:8087"
        """, "api.lissen", "unknown key", 3),
    ("unknown-key-in-model", """\
        [[models]]
        name = "a"
        engine = "llamacpp"
        path = "/m.gguf"
        gpu = [0]
        """, "models[0].gpu", "unknown key", 5),
    ("unknown-key-in-engine-block", """\
        [[models]]
        name = "a"
        engine = "llamacpp"
        path = "/m.gguf"

        [[models]]
        name = "b"
        engine = "llamacpp"
        path = "/m.gguf"

        [models.llamacpp]
        thread = 2
        """, "models[1].llamacpp.thread", "unknown key", 12),
    ("unknown-key-in-inline-engine-block", """\
        [[models]]
        name = "a"
        engine = "llamacpp"
        path = "/m.gguf"
        llamacpp = { thread = 2 }
        """, "models[0].llamacpp.thread", "unknown key", 5),
    ("wrong-type-string-for-number", """\
        [health]
        interval_s = "five"
        """, "health.interval_s", "valid number, got 'five'", 2),
    ("wrong-type-quoted-integer", """\
        [[models]]
        name = "a"
        engine = "llamacpp"
        path = "/m.gguf"
        parallel = "4"
        """, "models[0].parallel", "valid integer, got '4'", 5),
    ("wrong-type-in-engine-block", """\
        [[models]]
        name = "a"
        engine = "llamacpp"
        path = "/m.gguf"
        [models.llamacpp]
        threads = "many"
        """, "models[0].llamacpp.threads", "valid integer", 6),
    ("wrong-type-section-not-a-table", """\
        api = "127.0.0.1:8086"
        """, "api", "must be a table", 1),
    ("wrong-type-models-not-an-array", """\
        models = "llama"
        """, "models", "must be an array", 1),
    ("out-of-range-negative", """\
        [routing]
        queue_max = -1
        """, "routing.queue_max", "greater than or equal to 0, got -1", 2),
    ("out-of-range-zero-parallel", """\
        [[models]]
        name = "a"
        engine = "llamacpp"
        path = "/m.gguf"
        parallel = 0
        """, "models[0].parallel", "greater than or equal to 1", 5),
    ("not-an-allowed-value", """\
        [supervisor]
        runner = "docker"
        """, "supervisor.runner", "must be one of 'auto', 'systemd' or 'process', got 'docker'", 2),
    ("not-an-allowed-kind", """\
        [[models]]
        name = "a"
        engine = "llamacpp"
        kind = "generate"
        path = "/m.gguf"
        """, "models[0].kind", "'chat', 'embedding' or 'rerank'", 4),
    ("missing-required-key", """\
        [[models]]
        name = "a"
        engine = "llamacpp"
        """, "models[0].path", "required key is missing", 1),
    ("unknown-engine-names-the-known-ones", """\
        [[models]]
        name = "a"
        engine = "tgi"
        path = "/m.gguf"
        """, "models[0].engine", f"unknown engine 'tgi'; known engines: {', '.join(engine_names())}", 3),
    ("options-key-is-not-the-engine-block", """\
        [[models]]
        name = "a"
        engine = "llamacpp"
        path = "/m.gguf"
        options = { threads = 2 }
        """, "models[0].options", "block named for the engine", 5),
    ("engine-block-not-a-table", """\
        [[models]]
        name = "a"
        engine = "llamacpp"
        path = "/m.gguf"
        llamacpp = "fast"
        """, "models[0].llamacpp", "must be a table", 5),
    ("duplicate-model-name", """\
        [[models]]
        name = "a"
        engine = "llamacpp"
        path = "/m.gguf"

        [[models]]
        name = "a"
        engine = "llamacpp"
        path = "/n.gguf"
        """, "models[1].name", "model 'a' is already defined by models[0]", 7),
    ("gpu-used-by-two-models", """\
        [[models]]
        name = "a"
        engine = "llamacpp"
        path = "/m.gguf"
        gpus = [0, 1]

        [[models]]
        name = "b"
        engine = "llamacpp"
        path = "/n.gguf"
        gpus = [1]
        """, "models[1].gpus", "GPU 1 already belongs to model 'a'", 11),
    ("gpu-uuid-used-by-two-models", """\
        [[models]]
        name = "a"
        engine = "llamacpp"
        path = "/m.gguf"
        gpus = ["GPU-aaaa"]
        [[models]]
        name = "b"
        engine = "llamacpp"
        path = "/n.gguf"
        gpus = ["GPU-aaaa"]
        """, "models[1].gpus", "GPU GPU-aaaa already belongs to model 'a'", 10),
    ("gpu-listed-twice", """\
        [[models]]
        name = "a"
        engine = "llamacpp"
        path = "/m.gguf"
        gpus = [2, 2]
        """, "models[0].gpus", "twice", 5),
    ("negative-gpu-index", """\
        [[models]]
        name = "a"
        engine = "llamacpp"
        path = "/m.gguf"
        gpus = [-1]
        """, "models[0].gpus", ">= 0", 5),
    ("gpus-per-backend-does-not-divide", """\
        [[models]]
        name = "a"
        engine = "llamacpp"
        path = "/m.gguf"
        gpus = [0, 1, 2]
        gpus_per_backend = 2
        """, "models[0].gpus_per_backend", "gpus_per_backend = 2 does not divide the 3 GPUs", 6),
    ("backends-with-gpus-disagrees", """\
        [[models]]
        name = "a"
        engine = "llamacpp"
        path = "/m.gguf"
        gpus = [0, 1]
        backends = 3
        """, "models[0].backends", "backends is for CPU models", 6),
    ("invalid-env-name", """\
        [[models]]
        name = "a"
        engine = "llamacpp"
        path = "/m.gguf"
        env = { "A=B" = "1" }
        """, "models[0].env", "invalid environment variable name 'A=B'", 5),
    ("model-name-with-space", """\
        [[models]]
        name = "my model"
        engine = "llamacpp"
        path = "/m.gguf"
        """, "models[0].name", "may not contain spaces", 2),
    ("mesh-without-trust-says-how-to-fix", """\
        [mesh]
        seeds = ["10.0.0.2:8087"]
        """, "mesh.trust", 'set trust = "ca" with ca_certificate', 1),
    ("trust-open-without-mesh-id", """\
        [mesh]
        trust = "open"
        """, "mesh.mesh_id", 'trust = "open" requires mesh_id', 1),
    ("trust-ca-without-ca-certificate", """\
        [mesh]
        trust = "ca"
        """, "mesh.ca_certificate", 'trust = "ca" requires ca_certificate', 1),
    ("trust-not-an-allowed-value", """\
        [mesh]
        trust = "none"
        """, "mesh.trust", "must be one of 'ca' or 'open', got 'none'", 2),
    ("dead-after-not-above-suspect-after", """\
        [mesh]
        trust = "open"
        mesh_id = "lab"
        suspect_after_ms = 5000
        dead_after_ms = 5000
        """, "mesh.dead_after_ms", "greater than suspect_after_ms", 5),
    ("bad-seed", """\
        [mesh]
        trust = "open"
        mesh_id = "lab"
        seeds = ["10.0.0.2"]
        """, "mesh.seeds", "seed must be host:port, got '10.0.0.2'", 4),
    ("listen-without-port", """\
        [api]
        listen = "8086"
        """, "api.listen", "must be host:port, got '8086'", 2),
    ("listen-port-out-of-range", """\
        [api]
        listen = "0.0.0.0:70000"
        """, "api.listen", "port must be 0..65535, got 70000", 2),
    ("listen-port-not-a-number", """\
        [mesh]
        trust = "open"
        mesh_id = "lab"
        listen = "0.0.0.0:http"
        """, "mesh.listen", "port must be a number, got 'http'", 4),
    ("node-name-with-slash", """\
        [node]
        name = "a/b"
        """, "node.name", "letters, digits", 2),
]


@pytest.mark.parametrize(
    ("text", "path", "fragment", "line"),
    [pytest.param(*case[1:], id=case[0]) for case in ERROR_CASES],
)
def test_error_names_field_and_line(text: str, path: str, fragment: str, line: int) -> None:
    issue = only_error(text)
    assert issue.dotted == path, str(issue)
    assert fragment in issue.message, str(issue)
    assert issue.line == line, str(issue)
    assert str(issue) == f"{path}: {issue.message} (line {line})"


def test_mesh_without_trust_names_both_fixes() -> None:
    issue = only_error('[mesh]\nlisten = "0.0.0.0:8087"\n')
    for needed in ('trust = "ca"', "ca_certificate", 'trust = "open"', "mesh_id", "remove [mesh]"):
        assert needed in issue.message
    assert "required key is missing" not in issue.message


def test_invalid_toml_names_the_line() -> None:
    issue = only_error('[api]\nlisten = "127.0.0.1:8086"\nmax_body_bytes = \n')
    assert issue.path == ()
    assert issue.line == 3
    assert issue.message.startswith("not valid TOML: ")
    assert str(issue).endswith("(line 3)")


def test_duplicate_toml_key_is_invalid_toml() -> None:
    issue = only_error("[api]\nlisten = \"a:1\"\nlisten = \"b:2\"\n")
    assert issue.message.startswith("not valid TOML")
    assert issue.line == 3


def test_every_problem_is_reported_at_once() -> None:
    issues = errors_of("""\
        [api]
        lissen = "127.0.0.1:1"

        [health]
        interval_s = -1

        [[models]]
        name = "a"
        engine = "llamacpp"
        parallel = 0

        [models.llamacpp]
        thread = 2
        """)
    assert [(i.dotted, i.line) for i in issues] == [
        ("api.lissen", 2),
        ("health.interval_s", 5),
        ("models[0].path", 7),
        ("models[0].parallel", 10),
        ("models[0].llamacpp.thread", 13),
    ]


def test_unknown_engine_block_is_not_reported_twice() -> None:
    issue = only_error("""\
        [[models]]
        name = "a"
        engine = "tgi"
        path = "/m.gguf"
        [models.tgi]
        port = 1
        """)
    assert issue.dotted == "models[0].engine"


def test_config_error_text_names_the_source() -> None:
    with pytest.raises(ConfigError) as info:
        parse_config("bogus = 1\n", "/etc/viiwork/viiwork.toml")
    assert str(info.value).splitlines() == [
        "/etc/viiwork/viiwork.toml: 1 error in config",
        "  bogus: unknown key (line 1)",
    ]


def test_load_config_reads_a_file(tmp_path: Path) -> None:
    path = tmp_path / "viiwork.toml"
    path.write_text(VALID)
    assert [m.name for m in load_config(path).models] == ["llama-8b", "embed", "big"]


@pytest.mark.parametrize("kind", ["missing", "directory", "not-utf8"])
def test_unreadable_file_is_a_config_error(tmp_path: Path, kind: str) -> None:
    path = tmp_path / "viiwork.toml"
    if kind == "directory":
        path.mkdir()
    elif kind == "not-utf8":
        path.write_bytes(b"name = \"\xff\xfe\"\n")
    with pytest.raises(ConfigError) as info:
        load_config(path)
    (issue,) = info.value.issues
    assert info.value.source == str(path)
    expected = {"missing": "No such file", "directory": "not a regular file: a directory", "not-utf8": "not UTF-8"}[kind]
    assert expected in issue.message


# --- viiworkctl config check: the same loader, as a command -------------------------------

def viiworkctl(*args: str) -> subprocess.CompletedProcess[str]:
    # -m: the tree under test (the console script imports the venv's editable install).
    return subprocess.run([sys.executable, "-m", "viiwork.agent.cli", *args], capture_output=True, text=True,
                          timeout=30)


def test_config_check_ok_prints_one_line_summary(tmp_path: Path) -> None:
    path = tmp_path / "viiwork.toml"
    path.write_text(VALID)  # a config for another machine: its GPUs and files are not here
    result = viiworkctl("config", "check", "--offline", str(path))
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert len(lines) == 1
    assert lines[0].startswith(f"{path}: ok")
    assert "3 models" in lines[0] and "5 backends" in lines[0]
    assert result.stderr == ""


def test_config_check_errors_go_to_stderr_with_exit_1(tmp_path: Path) -> None:
    path = tmp_path / "viiwork.toml"
    path.write_text('[api]\nlissen = "x"\n\n[[models]]\nname = "a"\nengine = "tgi"\npath = "/m"\n')
    result = viiworkctl("config", "check", str(path))
    assert result.returncode == 1
    assert result.stdout == ""
    assert "api.lissen: unknown key (line 2)" in result.stderr
    assert "models[0].engine: unknown engine 'tgi'; known engines: llamacpp" in result.stderr
    assert "(line 6)" in result.stderr


def test_config_check_json(tmp_path: Path) -> None:
    good = tmp_path / "good.toml"
    good.write_text(VALID)
    ok = viiworkctl("config", "check", "--offline", "--json", str(good))
    assert ok.returncode == 0
    body = json.loads(ok.stdout)
    assert body["ok"] is True
    assert body["models"] == ["llama-8b", "embed", "big"]
    assert body["backends"] == 5

    bad = tmp_path / "bad.toml"
    bad.write_text("[routing]\nqueue_max = -1\n")
    failed = viiworkctl("config", "check", "--json", str(bad))
    assert failed.returncode == 1
    body = json.loads(failed.stdout)
    assert body["ok"] is False
    (error,) = body["errors"]
    assert error["path"] == "routing.queue_max"
    assert error["line"] == 2
    assert "greater than or equal to 0" in error["message"]


def test_config_check_unreadable_file(tmp_path: Path) -> None:
    result = viiworkctl("config", "check", str(tmp_path / "absent.toml"))
    assert result.returncode == 1
    assert "cannot read config" in result.stderr
