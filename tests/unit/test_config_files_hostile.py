"""viiworkctl init, config check, config show and the agent's --config against hostile files:
FIFOs (os.mkfifo), /dev/zero, symlinks, oversized files, file names holding newlines, terminal
escapes and bytes that are not UTF-8, and a write that fails part-way (a real RLIMIT_FSIZE).

Each command runs as a subprocess of this tree (``python -m viiwork.agent.cli``) with a
timeout, so a hang fails the test instead of hanging it.
"""

from __future__ import annotations

import json
import os
import resource
import signal
import stat
import subprocess
import sys
import tomllib
from collections.abc import Callable
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from support.procs import free_port
from support.tiny_gguf import write_tiny_gguf
from viiwork.agent.cli.quoting import quote_path
from viiwork.agent.config.load import MAX_CONFIG_BYTES

HANG_S = 30  # far above any of these commands (each well under 2 s here); reached only by a hang


def ctl(*args: str | bytes, preexec: Callable[[], object] | None = None) -> subprocess.CompletedProcess[bytes]:
    """viiworkctl of this tree; bytes out, so a raw escape or newline is seen as it is."""
    env = dict(os.environ, PYTHONDONTWRITEBYTECODE="1")
    return subprocess.run([sys.executable, "-m", "viiwork.agent.cli", *args], capture_output=True,
                          timeout=HANG_S, env=env, preexec_fn=preexec)


def one_error_line(done: subprocess.CompletedProcess[bytes]) -> str:
    err = done.stderr.decode()
    assert b"Traceback" not in done.stderr, err
    assert err.count("\n") == 1, err
    return err


# --- init: the write (F3, F6) ---------------------------------------------------------

def _file_size_limit(limit: int) -> Callable[[], None]:
    def preexec() -> None:
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # write(2) then fails with EFBIG
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
    return preexec


def test_init_force_that_fails_part_way_leaves_the_old_file_whole(tmp_path: Path) -> None:
    out = tmp_path / "viiwork.toml"
    old = '# mine\n[api]\nlisten = "127.0.0.1:9999"\n'
    out.write_text(old)
    done = ctl("init", "--out", str(out), "--force", "--no-gpus", preexec=_file_size_limit(64))
    assert done.returncode == 1
    assert one_error_line(done) == f"viiworkctl init: cannot write {out}: File too large\n"
    assert out.read_text() == old
    assert sorted(p.name for p in tmp_path.iterdir()) == ["viiwork.toml"]  # no temporary file left


def test_init_force_keeps_the_mode_and_a_new_file_gets_0644(tmp_path: Path) -> None:
    out = tmp_path / "viiwork.toml"
    out.write_text("# mine\n")
    out.chmod(0o600)
    done = ctl("init", "--out", str(out), "--force", "--no-gpus")
    assert done.returncode == 0, done.stderr
    assert stat.S_IMODE(out.stat().st_mode) == 0o600
    assert "[api]" in out.read_text()
    new = tmp_path / "new.toml"
    done = ctl("init", "--out", str(new), "--no-gpus", preexec=lambda: os.umask(0o077) and None)
    assert done.returncode == 0, done.stderr
    assert stat.S_IMODE(new.stat().st_mode) == 0o644
    assert sorted(p.name for p in tmp_path.iterdir()) == ["new.toml", "viiwork.toml"]


@pytest.mark.skipif(os.geteuid() != 0, reason="chown to another user needs root")
def test_init_force_as_root_keeps_the_owner(tmp_path: Path) -> None:
    out = tmp_path / "viiwork.toml"
    out.write_text("# mine\n")
    os.chown(out, 4321, 4321)
    done = ctl("init", "--out", str(out), "--force", "--no-gpus")
    assert done.returncode == 0, done.stderr
    assert (out.stat().st_uid, out.stat().st_gid) == (4321, 4321)


def test_init_force_replaces_a_symlink_itself_not_its_target(tmp_path: Path) -> None:
    target = tmp_path / "elsewhere.toml"
    target.write_text("# the target\n")
    link = tmp_path / "viiwork.toml"
    link.symlink_to(target)
    done = ctl("init", "--out", str(link), "--no-gpus")
    assert done.returncode == 1
    assert "exists; pass --force" in one_error_line(done)
    done = ctl("init", "--out", str(link), "--force", "--no-gpus")
    assert done.returncode == 0, done.stderr
    assert not link.is_symlink() and "[api]" in link.read_text()
    assert target.read_text() == "# the target\n"
    dangling = tmp_path / "dangling.toml"
    dangling.symlink_to(tmp_path / "nowhere.toml")
    done = ctl("init", "--out", str(dangling), "--no-gpus")
    assert done.returncode == 1 and "exists; pass --force" in one_error_line(done)
    assert not (tmp_path / "nowhere.toml").exists()


# --- init: what is probed (F4) ---------------------------------------------------------

def test_init_refuses_a_fifo_at_out_with_or_without_force(tmp_path: Path) -> None:
    out = tmp_path / "viiwork.toml"
    os.mkfifo(out)
    for force in ([], ["--force"]):
        done = ctl("init", "--out", str(out), "--no-gpus", *force)
        assert done.returncode == 1
        assert one_error_line(done) == (f"viiworkctl init: {out} is a FIFO (named pipe), not a regular file: "
                                        "only a regular file is written\n")
        assert stat.S_ISFIFO(os.lstat(out).st_mode)


def test_init_skips_a_fifo_named_gguf_and_follows_a_symlinked_model(tmp_path: Path) -> None:
    models = tmp_path / "models"
    models.mkdir()
    os.mkfifo(models / "a-pipe.gguf")
    blob = tmp_path / "blob"
    write_tiny_gguf(blob, seed=1)
    (models / "linked.gguf").symlink_to(blob)  # as the Hugging Face cache lays models out
    out = tmp_path / "viiwork.toml"
    done = ctl("init", "--out", str(out), "--no-gpus", "--models-dir", str(models),
               "--listen", f"127.0.0.1:{free_port()}")
    assert done.returncode == 0, done.stderr
    said = done.stdout.decode()
    assert f"note: skipped {models / 'a-pipe.gguf'}: not a regular file but a FIFO (named pipe)\n" in said
    cfg = tomllib.loads(out.read_text())
    assert [m["path"] for m in cfg["models"]] == [str(models / "linked.gguf")]


# --- init: names as they are printed (F5) --------------------------------------------

def test_init_prints_hostile_file_names_quoted(tmp_path: Path) -> None:
    models = tmp_path / "models"
    models.mkdir()
    newline = models / "evil\nwrote x.gguf"
    escape = models / "\x1b[2Jclear.gguf"
    for path in (newline, escape):
        write_tiny_gguf(path, seed=1)
    not_utf8 = os.path.join(os.fsencode(models), b"\xff\xfe.gguf")
    with open(not_utf8, "wb") as f:
        f.write(b"GGUF")
    out = tmp_path / "viiwork.toml"
    done = ctl("init", "--out", str(out), "--no-gpus", "--models-dir", str(models),
               "--listen", f"127.0.0.1:{free_port()}")
    assert done.returncode == 0, done.stderr
    said = done.stdout.decode("utf-8")  # it is UTF-8, the \xff name included
    assert "\x1b" not in said
    assert not any(line.startswith("wrote x.gguf") for line in said.splitlines())
    assert f"{quote_path(newline)} (" in said and "$'" in said and "\\x1b[2Jclear.gguf" in said
    assert f"note: skipped {quote_path(os.fsdecode(not_utf8))}: its name is not UTF-8" in said
    assert "\\xff\\xfe.gguf" in said
    # tomli-w escapes the names in the TOML; the agent's loader reads the same paths back.
    cfg = tomllib.loads(out.read_text())
    assert sorted(m["path"] for m in cfg["models"]) == sorted([str(escape), str(newline)])
    check = ctl("config", "check", str(out))
    assert check.returncode == 0, check.stderr


def test_init_quotes_out_in_the_file_header_too(tmp_path: Path) -> None:
    out = tmp_path / 'x\n[api]\nlisten = "6.6.6.6:1"\n.toml'
    done = ctl("init", "--out", str(out), "--no-gpus", "--listen", f"127.0.0.1:{free_port()}")
    assert done.returncode == 0, done.stderr
    assert tomllib.loads(out.read_text())["api"]["listen"].startswith("127.0.0.1:")
    assert done.stdout.decode().splitlines()[-1].startswith(f"wrote {quote_path(out)}; ")


# Bytes a file name may hold (all but NUL and '/'), decoded as Python decodes file names.
NAMES = st.binary(min_size=1, max_size=24).filter(lambda b: b"\0" not in b and b"/" not in b).map(os.fsdecode)


@settings(max_examples=60, deadline=None)
@given(name=NAMES)
def test_quote_path_is_printable_and_bash_reads_back_the_same_bytes(name: str) -> None:
    quoted = quote_path(name)
    assert quoted.isprintable()
    quoted.encode("utf-8")  # prints on a UTF-8 terminal without an error
    done = subprocess.run(["bash", "-c", f"printf %s {quoted}"], capture_output=True, timeout=HANG_S,
                          env={"LC_ALL": "C", "PATH": os.environ["PATH"]})
    assert done.returncode == 0, done.stderr
    assert done.stdout == os.fsencode(name)


# --- the loader: config check, config show, the agent (F7) ----------------------------

def _agent(*args: str) -> subprocess.CompletedProcess[bytes]:
    return subprocess.run([sys.executable, "-c", "import sys; from viiwork.agent.main import main; sys.exit(main())",
                           *args], capture_output=True, timeout=HANG_S)


@pytest.fixture
def fifo(tmp_path: Path) -> Path:
    path = tmp_path / "viiwork.toml"
    os.mkfifo(path)
    return path


@pytest.mark.parametrize("kind", ["dev-zero", "fifo", "directory"])
def test_every_config_reader_refuses_what_is_not_a_regular_file(kind: str, fifo: Path) -> None:
    path, words = {"dev-zero": ("/dev/zero", "a character device"), "fifo": (str(fifo), "a FIFO (named pipe)"),
                   "directory": (str(fifo.parent), "a directory")}[kind]
    expected = f"{path}: 1 error in config\n  cannot read config: not a regular file: {words}\n"
    for done in (ctl("config", "check", path), ctl("config", "check", "--offline", path),
                 ctl("config", "show", "--config", path), _agent("--config", path)):
        assert done.returncode == 1
        assert b"Traceback" not in done.stderr
        assert done.stderr.decode() == expected
    as_json = ctl("config", "check", "--json", path)
    assert as_json.returncode == 1
    assert json.loads(as_json.stdout)["errors"] == [
        {"path": "", "line": None, "message": f"cannot read config: not a regular file: {words}"}]


def test_a_config_of_the_cap_is_read_and_one_byte_more_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "viiwork.toml"
    path.write_text("#" + "x" * (MAX_CONFIG_BYTES - 2) + "\n")  # exactly the cap: a valid empty config
    done = ctl("config", "check", "--offline", str(path))
    assert done.returncode == 2, done.stderr  # valid, no models
    path.write_text("#" + "x" * (MAX_CONFIG_BYTES - 1) + "\n")
    for done in (ctl("config", "check", str(path)), ctl("config", "show", "--config", str(path)),
                 _agent("--config", str(path))):
        assert done.returncode == 1
        assert done.stderr.decode() == (
            f"{path}: 1 error in config\n  cannot read config: {MAX_CONFIG_BYTES + 1} bytes, more than the "
            f"{MAX_CONFIG_BYTES} a config may have (MAX_CONFIG_BYTES): is this the config file?\n")


def test_a_symlink_to_a_config_is_read(tmp_path: Path) -> None:
    real = tmp_path / "real.toml"
    real.write_text('[[models]]\nname = "m"\nengine = "llamacpp"\npath = "/m.gguf"\n')
    link = tmp_path / "viiwork.toml"
    link.symlink_to(real)
    done = ctl("config", "check", "--offline", str(link))
    assert done.returncode == 0, done.stderr
    assert done.stdout.decode() == (f"{link}: ok (file only): node {os.uname().nodename!r}, 1 model, 1 backend, "
                                    "api 0.0.0.0:8086, standalone\n")


@pytest.mark.parametrize(("text", "says"), [
    ("x = " + "[" * 500 + "]" * 500, "nested too deep"),
    ("x = " + "[" * 5000 + "]" * 5000, "nested too deep"),
    ("x = " + "{a = " * 600 + "1" + "}" * 600, "nested too deep"),
    ("x = " + "1" * 5000, "not valid TOML: Exceeds the limit (4300 digits) for integer string conversion"),
], ids=["arrays-500", "arrays-5000", "inline-tables-600", "int-5000-digits"])
def test_what_tomllib_raises_besides_a_decode_error_is_one_config_error(tmp_path: Path, text: str,
                                                                         says: str) -> None:
    """tomllib's RecursionError and int()'s digit limit (a ValueError) used to escape as tracebacks."""
    path = tmp_path / "deep.toml"
    path.write_text(text + "\n")
    for done in (ctl("config", "check", str(path)), ctl("config", "check", "--offline", str(path)),
                 ctl("config", "show", "--config", str(path)), _agent("--config", str(path))):
        assert done.returncode == 1
        assert b"Traceback" not in done.stderr
        head, issue = done.stderr.decode().splitlines()
        assert head == f"{path}: 1 error in config" and says in issue, issue
        assert "set_int_max_str_digits" not in issue
    as_json = ctl("config", "check", "--json", str(path))
    assert as_json.returncode == 1 and says in json.loads(as_json.stdout)["errors"][0]["message"]


# --- config check: errors in the file's order, counts in words -------------------------

OUT_OF_ORDER = """\
[api]
lissen = "x"

[[models]]
name = "m"
engine = "llamacpp"
path = "/m\\u0000.gguf"
[models.llamacpp]
thread = 2
"""


def test_config_check_lists_errors_in_line_order(tmp_path: Path) -> None:
    path = tmp_path / "viiwork.toml"
    path.write_text(OUT_OF_ORDER)
    done = ctl("config", "check", "--offline", str(path))
    assert done.returncode == 1
    assert done.stderr.decode().splitlines() == [
        f"{path}: 3 errors in config",
        "  api.lissen: unknown key (line 2)",
        "  models[0].path: may not contain a NUL character (\\u0000) (line 7)",
        "  models[0].llamacpp.thread: unknown key (line 9)",
    ]
    as_json = ctl("config", "check", "--offline", "--json", str(path))
    assert [e["line"] for e in json.loads(as_json.stdout)["errors"]] == [2, 7, 9]


def test_the_size_cap_is_the_one_documented() -> None:
    docs = " ".join((Path(__file__).parents[2] / "docs" / "configuration.md").read_text().split())
    assert MAX_CONFIG_BYTES == 2**20
    assert "a regular file (a symlink to one is fine) of at most 1 MiB (`MAX_CONFIG_BYTES`" in docs
