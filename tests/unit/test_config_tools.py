"""viiworkctl init, config show and config check on this host: real files, real GGUFs
(tests/support/tiny_gguf.py), real sockets and a real agent; the commands run in-process
through viiworkctl's own main()."""

from __future__ import annotations

import argparse
import json
import socket
import tomllib
from pathlib import Path

import pytest

from support.agent import run_agent
from support.procs import free_port
from support.tiny_gguf import write_tiny_gguf
from viiwork.agent.cli import init as init_cmd
from viiwork.agent.cli import main
from viiwork.agent.config.load import load_config, parse_config
from viiwork.agent.host.gpus.inventory import Gpu, GpuInventory, Vendor


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


@pytest.fixture
def models_dir(tmp_path: Path) -> Path:
    d = tmp_path / "models"
    (d / "sub").mkdir(parents=True)
    write_tiny_gguf(d / "Tiny Chat.gguf", seed=1)
    write_tiny_gguf(d / "sub" / "nomic-embed-text.gguf", seed=2)
    (d / "notes.gguf").write_text("not a model")
    return d


def test_init_output_passes_config_check(tmp_path: Path, models_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "viiwork.toml"
    port = free_port()
    code, said, err = run(capsys, "init", "--out", str(out), "--models-dir", str(models_dir),
                          "--listen", f"127.0.0.1:{port}")
    assert code == 0, err
    assert "model 'Tiny-Chat'" in said and "kind embedding" in said
    assert "not a GGUF file" in said  # notes.gguf, skipped with the reason
    assert "standalone" in said
    cfg = load_config(out)
    assert {m.name: m.kind.value for m in cfg.models} == {"Tiny-Chat": "chat", "nomic-embed-text": "embedding"}
    assert cfg.mesh is None
    code, said, err = run(capsys, "config", "check", str(out))
    assert code == 0, err
    assert "ok: node" in said and "(file only)" not in said


def test_init_refuses_to_overwrite_without_force(tmp_path: Path, models_dir: Path,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "viiwork.toml"
    out.write_text("# mine\n")
    code, said, err = run(capsys, "init", "--out", str(out), "--models-dir", str(models_dir))
    assert code == 1
    assert err.strip() == f"viiworkctl init: {out} exists; pass --force to overwrite it"
    assert out.read_text() == "# mine\n"
    code, said, err = run(capsys, "init", "--out", str(out), "--models-dir", str(models_dir), "--force")
    assert code == 0, err
    assert len(load_config(out).models) == 2
    # The default listens on every address, with client keys on: no note about an open API.
    assert "every machine that can reach this host" not in said and "client keys on" in said
    # With keys off, init says who can use the API and how to narrow it.
    code, said, err = run(capsys, "init", "--out", str(out), "--models-dir", str(models_dir), "--force",
                          "--auth", "none")
    assert code == 0, err
    [note] = [line for line in said.splitlines() if "0.0.0.0:8086" in line and line.startswith("note:")]
    assert "every machine that can reach this host" in note and "--listen 127.0.0.1:8086" in note
    assert load_config(out).auth.mode == "none"


def test_init_turns_client_keys_on_as_the_shipped_config_does(tmp_path: Path,
                                                                capsys: pytest.CaptureFixture[str]) -> None:
    """Issue 17 item 9: a new config has keys on, like /etc/viiwork/viiwork.toml as shipped, so
    `init --force` over the shipped file keeps them on; the issuer key's state is said."""
    out = tmp_path / "viiwork.toml"
    pub = tmp_path / "issuer.pub"
    code, said, err = run(capsys, "init", "--out", str(out), "--no-gpus", "--issuer-keys", str(pub))
    assert code == 0, err
    auth = load_config(out).auth
    assert (auth.mode, auth.issuer_keys, auth.open_loopback_reads) == ("keys", pub, True)
    assert f"client keys on: issuer key {pub} (not installed yet: docs/install.md" in said
    pub.write_text("x")
    code, said, err = run(capsys, "init", "--out", str(out), "--no-gpus", "--issuer-keys", str(pub), "--force")
    assert code == 0 and f"issuer key {pub} (installed)" in said, err
    code, said, err = run(capsys, "init", "--out", str(out), "--no-gpus", "--mesh", "open", "--mesh-id", "lab",
                          "--force")
    assert code == 0 and load_config(out).auth.mode == "none", err  # a lab's open mesh: keys off by default
    assert "client keys off (--auth none, the default with --mesh open)" in said


def test_init_on_loopback_does_not_warn(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    for i, listen in enumerate(("127.0.0.1:8086", "[::1]:8086", "localhost:8086")):
        out = tmp_path / f"{i}.toml"
        code, said, err = run(capsys, "init", "--out", str(out), "--listen", listen, "--no-gpus")
        assert code == 0, err
        assert "every machine" not in said, listen
        assert load_config(out).api.listen == listen


def test_init_writes_the_mesh_asked_for(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "open.toml"
    code, said, err = run(capsys, "init", "--out", str(out), "--mesh", "open", "--mesh-id", "lab-1")
    assert code == 0, err
    cfg = load_config(out)
    assert cfg.mesh is not None and (cfg.mesh.trust, cfg.mesh.mesh_id) == ("open", "lab-1")
    ca = tmp_path / "ca.crt"
    ca.write_text("-----BEGIN CERTIFICATE-----\n")
    out = tmp_path / "ca.toml"
    code, said, err = run(capsys, "init", "--out", str(out), "--mesh", "ca", "--ca-certificate", str(ca),
                          "--mesh-id", "site-a")
    assert code == 0, err
    cfg = load_config(out)
    assert cfg.mesh is not None and cfg.mesh.trust == "ca" and cfg.mesh.ca_certificate == ca
    assert cfg.mesh.mesh_id == "site-a" and cfg.auth.mode == "keys"  # the mesh id: its keys' audience


BAD_INIT = [
    ("missing dir", ["--models-dir", "{tmp}/nope"], "--models-dir {tmp}/nope: does not exist"),
    ("file as dir", ["--models-dir", "{tmp}/afile"], "--models-dir {tmp}/afile: not a directory"),
    ("bad listen", ["--listen", "nohost"], "--listen must be host:port, got 'nohost'"),
    ("bad port", ["--listen", "127.0.0.1:99999"], "--listen port must be 0..65535, got 99999"),
    ("open without id", ["--mesh", "open"], "--mesh open needs --mesh-id NAME"),
    ("bad mesh id", ["--mesh", "open", "--mesh-id=-x"], "the config would be invalid: mesh.mesh_id"),
    ("ca without cert", ["--mesh", "ca"], "--mesh ca needs --ca-certificate FILE"),
    ("ca cert missing", ["--mesh", "ca", "--ca-certificate", "{tmp}/none.crt"], "--ca-certificate {tmp}/none.crt: not a file"),
    ("id without mesh", ["--mesh-id", "lab"], "--mesh-id is for --mesh open or ca"),
    ("ca keys without id", ["--mesh", "ca", "--ca-certificate", "{tmp}/afile"], "--mesh ca with client keys needs "
     "--mesh-id NAME"),
    ("open with keys", ["--mesh", "open", "--mesh-id", "lab", "--auth", "keys"], "--auth keys needs --mesh ca"),
]


@pytest.mark.parametrize(("flags", "message"), [c[1:] for c in BAD_INIT], ids=[c[0] for c in BAD_INIT])
def test_init_bad_input_is_one_line_and_writes_nothing(tmp_path: Path, flags: list[str], message: str,
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "afile").write_text("x")
    out = tmp_path / "out.toml"
    code, said, err = run(capsys, "init", "--out", str(out), *[f.format(tmp=tmp_path) for f in flags])
    assert code == 1
    assert err.count("\n") == 1 and err.startswith("viiworkctl init: ")
    assert message.format(tmp=tmp_path) in err
    assert not out.exists()


def test_init_out_in_a_missing_directory_or_a_directory(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = run(capsys, "init", "--out", str(tmp_path / "no" / "x.toml"))
    assert code == 1 and err.strip() == f"viiworkctl init: {tmp_path / 'no'} (the directory of --out) does not exist"
    code, _, err = run(capsys, "init", "--out", str(tmp_path), "--force")
    assert code == 1 and err.strip() == f"viiworkctl init: {tmp_path} is a directory"


def test_init_takes_first_split_part_and_skips_projectors(tmp_path: Path) -> None:
    d = tmp_path / "m"
    d.mkdir()
    for name in ("big-00001-of-00002.gguf", "big-00002-of-00002.gguf", "mmproj-x.gguf"):
        write_tiny_gguf(d / name, seed=3)
    notes: list[str] = []
    found = init_cmd.find_ggufs(d, notes)
    assert [f.path.name for f in found] == ["big-00001-of-00002.gguf"]
    assert init_cmd.model_name(found[0].path, set()) == "big"
    assert any("multimodal projector" in n for n in notes)


def test_init_gives_the_gpus_to_the_largest_chat_model(tmp_path: Path) -> None:
    small, large, embed = (init_cmd.GgufFile(tmp_path / n, s) for n, s in
                           (("small.gguf", 10), ("large.gguf", 99), ("embed-big.gguf", 999)))
    inventory = GpuInventory(gpus=(Gpu(Vendor.NVIDIA, 0), Gpu(Vendor.NVIDIA, 1), Gpu(Vendor.NVIDIA, 2, lost=True)))
    args = argparse.Namespace(listen="127.0.0.1:0", mesh="standalone", mesh_id=None, ca_certificate=None)
    say: list[str] = []
    doc = init_cmd.plan([small, large, embed], init_cmd.gpu_refs(inventory), None, args, say)
    gpus = {m["name"]: m.get("gpus") for m in doc["models"]}
    assert gpus == {"small": None, "large": [0, 1], "embed-big": None}
    assert any("GPUs 0, 1, one backend each" in line for line in say)


SHOWN = """\
[api]
listen = "127.0.0.1:0"

[[models]]
name = "m"
engine = "llamacpp"
path = "/srv/m.gguf"
env = { A = "1" }

[models.llamacpp]
threads = 2
"""


def test_config_show_fills_every_default_and_marks_the_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "c.toml"
    path.write_text(SHOWN)
    code, out, err = run(capsys, "config", "show", "--config", str(path))
    assert code == 0, err
    lines = out.splitlines()
    assert 'listen = "127.0.0.1:0"  # from file' in lines
    assert "head_timeout_s = 10.0  # default" in lines
    assert "threads = 2  # from file" in lines
    assert 'gpu_layers = "all"  # default' in lines
    assert 'A = "1"  # from file' in lines
    assert "# backends: unset  # default" in lines
    assert "# mesh: unset  # default" in lines
    # The TOML is the same config, defaults written out.
    assert parse_config(out) == load_config(path)
    assert "max_ejection_s = 120.0  # default" in lines  # a nested default table ([routing.outliers])


def test_config_show_json_has_a_parallel_sources_map(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "c.toml"
    path.write_text(SHOWN)
    code, out, err = run(capsys, "config", "show", "--config", str(path), "--json")
    assert code == 0, err
    doc = json.loads(out)
    assert doc["config"]["api"]["listen"] == "127.0.0.1:0"
    assert doc["config"]["models"][0]["llamacpp"]["threads"] == 2
    assert doc["config"]["models"][0]["backends"] is None
    assert doc["sources"]["api.listen"] == "file"
    assert doc["sources"]["api.max_connections"] == "default"
    assert doc["sources"]["models[0].llamacpp.threads"] == "file"
    assert doc["sources"]["models[0].llamacpp.binary"] == "default"
    assert doc["sources"]["routing.outliers.jitter"] == "default"


def test_config_show_of_a_bad_file_lists_its_errors(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "c.toml"
    path.write_text("[api]\nlisten = 5\n")
    code, out, err = run(capsys, "config", "show", "--config", str(path))
    assert code == 1 and out == ""
    assert "api.listen" in err and "(line 2)" in err
    code, out, err = run(capsys, "config", "show", "--config", str(tmp_path / "none.toml"))
    assert code == 1 and "cannot read config" in err


HOSTLESS = """\
[api]
listen = "127.0.0.1:0"

[[models]]
name = "m"
engine = "llamacpp"
path = "{tmp}/missing.gguf"
gpus = [1000]

[models.llamacpp]
binary = "{tmp}/no-llama-server"
"""


def test_config_check_checks_the_host_by_default(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "c.toml"
    path.write_text(HOSTLESS.format(tmp=tmp_path))
    code, out, err = run(capsys, "config", "check", str(path), "--json")
    assert code == 1
    errors = {e["path"]: e for e in json.loads(out)["errors"]}
    assert set(errors) == {"models[0].gpus", "models[0].path", "models[0].llamacpp.binary"}
    assert "GPU 1000 does not exist on this host" in errors["models[0].gpus"]["message"]
    assert errors["models[0].gpus"]["line"] == 8
    assert "missing.gguf does not exist" in errors["models[0].path"]["message"]
    assert errors["models[0].llamacpp.binary"]["line"] == 11
    code, out, err = run(capsys, "config", "check", str(path), "--offline")
    assert code == 0, err
    assert "ok (file only)" in out


def test_config_check_reports_an_unreadable_model_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    model = tmp_path / "m.gguf"
    write_tiny_gguf(model, seed=1)
    path = tmp_path / "c.toml"
    path.write_text(HOSTLESS.format(tmp=tmp_path).replace("gpus = [1000]\n", "")
                    .replace(f"{tmp_path}/missing.gguf", str(model)))
    code, out, err = run(capsys, "config", "check", str(path))
    assert code == 1
    assert "models[0].path" not in err and "models[0].llamacpp.binary" in err


def test_config_check_refuses_a_port_another_process_holds(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        path = tmp_path / "c.toml"
        path.write_text(f'[api]\nlisten = "127.0.0.1:{port}"\nadmin_socket = "{tmp_path}/admin.sock"\n')
        code, out, err = run(capsys, "config", "check", str(path))
        assert code == 1
        assert f"api.listen: port {port} is in use on this host" in err and "(line 2)" in err
    code, out, err = run(capsys, "config", "check", str(path))
    assert code == 2, err  # free again: only the no-models warning


def test_config_check_accepts_the_ports_of_its_own_running_agent(tmp_path: Path,
                                                                 capsys: pytest.CaptureFixture[str]) -> None:
    with run_agent(tmp_path, []) as agent:
        config = tmp_path / "node-a.toml"
        code, out, err = run(capsys, "config", "check", str(config))
        assert code == 2, err  # no models: the warning, and no port error
        assert "in use" not in err
        # The same port in a config whose admin socket no agent serves: not this config's agent.
        other = tmp_path / "other.toml"
        text = config.read_text().replace(str(tmp_path / "node-a" / "admin.sock"), str(tmp_path / "other.sock"))
        assert text != config.read_text()
        other.write_text(text)
        code, out, err = run(capsys, "config", "check", str(other))
        assert code == 1
        port = agent.url.rpartition(":")[2]
        assert f"port {port} is in use" in err


def test_a_mismatched_engine_block_hides_no_other_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "c.toml"
    path.write_text('[api]\nlisten = "nope"\n\n[[models]]\nname = "a b"\nengine = "llamacpp"\npath = "/x"\n'
                    'parallel = 0\n\n[models.llamacpp]\nthread = 1\n\n[models.vllm]\nbinary = "v"\n')
    code, out, err = run(capsys, "config", "check", str(path), "--offline", "--json")
    assert code == 1
    paths = [e["path"] for e in json.loads(out)["errors"]]
    assert sorted(paths) == sorted(["api.listen", "models[0].name", "models[0].parallel",
                                    "models[0].vllm", "models[0].llamacpp.thread"])
    assert tomllib.loads(path.read_text())  # the file itself is valid TOML


def test_ports_of_an_agent_whose_files_cannot_be_read_count_as_its_own(tmp_path: Path) -> None:
    from viiwork.agent.host.config_host import port_issues

    with run_agent(tmp_path, []) as agent:
        cfg = load_config(tmp_path / "node-a.toml")
        assert port_issues(cfg) == []  # read from /proc: its own
        # A /proc without the agent's fd folder stands for another user's agent.
        (tmp_path / "proc" / "net").mkdir(parents=True)
        assert port_issues(cfg, proc=tmp_path / "proc") == []
        # Without the agent (no admin socket answering), the same port is another process's.
        other = cfg.model_copy(update={"api": cfg.api.model_copy(update={"admin_socket": tmp_path / "none.sock"})})
        (issue,) = port_issues(other)
        assert issue.dotted == "api.listen" and f"port {agent.url.rpartition(':')[2]} is in use" in issue.message


def _docs_example() -> str:
    text = (Path(__file__).resolve().parents[2] / "docs" / "configuration.md").read_text(encoding="utf-8")
    block = text.split("## A complete example", 1)[1].split("```toml\n", 1)[1]
    return block.split("```", 1)[0]


ROUND_TRIPS = {
    "docs example": _docs_example(),
    "mesh open": '[mesh]\ntrust = "open"\nmesh_id = "lab"\nseeds = ["10.0.0.2:8087"]\n'
                 '[[models]]\nname = "v"\nengine = "vllm"\npath = "org/m"\ngpus = ["GPU-1", "GPU-2"]\n'
                 'gpus_per_backend = 2\n[models.vllm]\ngpu_memory_utilization = 0.5\n'
                 '[[models]]\nname = "s"\nengine = "sglang"\npath = "org/s"\n',
    "empty": "",
}


@pytest.mark.parametrize("text", list(ROUND_TRIPS.values()), ids=list(ROUND_TRIPS))
def test_config_show_reads_back_as_the_same_config(tmp_path: Path, text: str,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "c.toml"
    path.write_text(text)
    code, out, err = run(capsys, "config", "show", "--config", str(path))
    assert code == 0, err
    assert parse_config(out) == load_config(path)
    marked = [line for line in out.splitlines() if "  # " in line]
    assert sum(line.endswith("# from file") for line in marked) == len(
        [v for v in json.loads(run(capsys, "config", "show", "--config", str(path), "--json")[1])["sources"].values()
         if v == "file"])


def test_init_moves_off_a_held_default_port_and_still_passes_config_check(
        tmp_path: Path, models_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """With the default port held (the demo's, here a socket of the test's), init writes the next
    free port and says why, so its output passes config check on this machine (issue 20)."""
    holder = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        try:
            holder.bind(("0.0.0.0", 8086))
            holder.listen(1)
        except OSError:
            pass  # held already by something else: the case under test all the same
        out = tmp_path / "viiwork.toml"
        code, said, err = run(capsys, "init", "--out", str(out), "--models-dir", str(models_dir))
        assert code == 0, err
        listen = load_config(out).api.listen
        assert listen != "0.0.0.0:8086" and listen.startswith("0.0.0.0:80"), listen
        assert "port 8086, the default, is in use now" in said
        code, said, err = run(capsys, "config", "check", str(out))
        assert code == 0, err
    finally:
        holder.close()


def test_a_missing_binary_is_reported_at_the_model_that_names_it(tmp_path: Path,
                                                                 capsys: pytest.CaptureFixture[str]) -> None:
    """Two llama.cpp models, only the second relying on the default binary (not on PATH here):
    the error is that model's, not the first's (issue 20, a newcomer's finding)."""
    model = tmp_path / "m.gguf"
    write_tiny_gguf(model, seed=1)
    binary = tmp_path / "llama-server-here"
    binary.write_text("#!/bin/sh\nexit 0\n")
    binary.chmod(0o755)
    path = tmp_path / "c.toml"
    path.write_text(f'[api]\nlisten = "127.0.0.1:{free_port()}"\n'
                    f'[[models]]\nname = "m1"\nengine = "llamacpp"\npath = "{model}"\n'
                    f'[models.llamacpp]\nbinary = "{binary}"\n\n'
                    f'[[models]]\nname = "m2"\nengine = "llamacpp"\npath = "{model}"\n'
                    '[models.llamacpp]\nbinary = "no-such-llama-server-binary"\n')
    code, out, err = run(capsys, "config", "check", str(path), "--json")
    assert code == 1, out
    errors = {e["path"]: e for e in json.loads(out)["errors"]}
    assert set(errors) == {"models[1].llamacpp.binary"}, errors
    assert errors["models[1].llamacpp.binary"]["line"] == 15


def test_config_check_names_heartbeat_keys_that_probe_mode_replaced(tmp_path: Path,
                                                                    capsys: pytest.CaptureFixture[str]) -> None:
    """Issue 16 item 5: the file stays valid (exit 0 with a model), one warning names the keys
    and what replaced them; heartbeat mode keeps them without a word."""
    path = tmp_path / "c.toml"
    model = ('[[models]]\nname = "m"\nengine = "llamacpp"\npath = "/dev/null"\n'
             '[models.llamacpp]\nbinary = "/bin/true"\n')
    path.write_text('[mesh]\ntrust = "open"\nmesh_id = "lab"\ndead_after_ms = 12000\nfanout = 5\n' + model)
    code, out, err = run(capsys, "config", "check", str(path), "--offline")
    assert code == 0, err
    (line,) = [ln for ln in err.splitlines() if "warning:" in ln]
    assert 'deprecated with detector = "probe"' in line and "no longer timed by dead_after_ms" in line
    assert "probe_interval_ms" in line and "gossip is no longer paced by fanout" in line
    code, out, err = run(capsys, "config", "check", str(path), "--offline", "--json")
    assert code == 0 and json.loads(out)["deprecations"] == [line.split("warning: ", 1)[1]]
    path.write_text('[mesh]\ntrust = "open"\nmesh_id = "lab"\ndetector = "heartbeat"\ndead_after_ms = 12000\n'
                    'fanout = 5\n' + model)
    code, out, err = run(capsys, "config", "check", str(path), "--offline")
    assert code == 0 and "warning" not in err, err
