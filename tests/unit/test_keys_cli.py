"""viiworkctl keys as an operator runs it (subprocesses): issuer files and modes, issue ->
inspect --issuer-pub, revoke twice -> version 2 with both ids, list never shows a token, and
one-line errors with exit 1 (failure) or 2 (usage), never a traceback."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
from pathlib import Path

import jwt
import pytest

from viiwork.agent.auth.keyset import KeySet
from viiwork.agent.auth.revocations import read_revocations
from viiwork.agent.auth.verifier import Verifier


def ctl(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k not in ("VIIWORK_URL", "COLUMNS")} | {"COLUMNS": "200"}
    done = subprocess.run([sys.executable, "-m", "viiwork.agent.cli", "keys", *args], capture_output=True, text=True,
                          env=env, cwd=cwd, timeout=60)
    assert "Traceback" not in done.stderr, done.stderr
    return done


@pytest.fixture
def issuer_dir(tmp_path: Path) -> Path:
    done = ctl("issuer", "init", "--out", str(tmp_path / "iss"), "--name", "acme-issuer", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    return tmp_path / "iss"


def issue(issuer_dir: Path, *extra: str) -> str:
    done = ctl("issue", "--issuer-key", str(issuer_dir / "issuer.key"), "--tenant", "team-a", "--audience", "mesh-a",
               *extra, cwd=issuer_dir)
    assert done.returncode == 0, done.stderr
    assert done.stdout.count("\n") == 1  # the token alone
    return done.stdout.strip()


def test_issuer_init_modes_and_no_overwrite(issuer_dir: Path) -> None:
    assert stat.S_IMODE((issuer_dir / "issuer.key").stat().st_mode) == 0o600
    assert (issuer_dir / "issuer.pub").read_text().startswith("-----BEGIN PUBLIC KEY-----")
    before = (issuer_dir / "issuer.key").read_bytes()
    again = ctl("issuer", "init", "--out", str(issuer_dir), cwd=issuer_dir)
    assert again.returncode == 1 and "refusing to overwrite" in again.stderr
    assert len(again.stderr.strip().splitlines()) == 1
    assert (issuer_dir / "issuer.key").read_bytes() == before


def test_issue_then_inspect_verifies(issuer_dir: Path) -> None:
    token = issue(issuer_dir, "--models", "m1,m2", "--rpm", "30", "--tpm", "5000", "--concurrency", "2",
                  "--priority", "high", "--scope", "inference,read", "--expires", "2h")
    claims = Verifier(KeySet.from_path(issuer_dir / "issuer.pub"), issuer="acme-issuer",
                      audiences=["mesh-a"]).verify(token)
    assert (claims.tenant, claims.models, claims.rpm, claims.priority.value) == ("team-a", ("m1", "m2"), 30, "high")
    assert claims.iat is not None and claims.exp - claims.iat == 7200
    untrusted = ctl("inspect", token, cwd=issuer_dir)
    assert untrusted.returncode == 0 and "NOT VERIFIED" in untrusted.stderr
    assert json.loads(untrusted.stdout)["claims"]["jti"] == claims.jti
    verified = ctl("inspect", token, "--issuer-pub", str(issuer_dir / "issuer.pub"), cwd=issuer_dir)
    assert verified.returncode == 0 and "verified: key " + claims.jti in verified.stderr, verified.stderr
    header, body, sig = token.split(".")
    forged = ctl("inspect", f"{header}.{body}.{sig[:-4]}AAAA", "--issuer-pub", str(issuer_dir / "issuer.pub"),
                 cwd=issuer_dir)
    assert forged.returncode == 1 and "bad_signature" in forged.stderr


def test_revoke_twice_gives_version_2_with_both(issuer_dir: Path) -> None:
    first, second = (jwt.decode(issue(issuer_dir), options={"verify_signature": False})["jti"] for _ in range(2))
    out = issuer_dir.parent / "revocations.jwt"
    for jti in (first, second):
        done = ctl("revoke", "--issuer-key", str(issuer_dir / "issuer.key"), "--id", jti, "--out", str(out),
                   cwd=issuer_dir)
        assert done.returncode == 0, done.stderr
    revocations = read_revocations(out.read_text().strip(), KeySet.from_path(issuer_dir / "issuer.pub"),
                                   issuer="acme-issuer", audiences=["mesh-a"])
    assert (revocations.ver, revocations.revoked) == (2, {first, second})
    assert (issuer_dir / "revocations.jwt").read_text() == out.read_text()
    third = ctl("revoke", "--issuer-key", str(issuer_dir / "issuer.key"), "--id", "k-from-elsewhere", "--out",
                str(out), "--audience", "node-9", cwd=issuer_dir)
    assert third.returncode == 0 and "not in this issuer's record" in third.stderr
    later = read_revocations(out.read_text().strip(), KeySet.from_path(issuer_dir / "issuer.pub"),
                             issuer="acme-issuer", audiences=["node-9"])
    assert later.ver == 3 and later.revoked == {first, second, "k-from-elsewhere"} and "mesh-a" in later.aud
    again = ctl("revoke", "--issuer-key", str(issuer_dir / "issuer.key"), "--id", first, "--out", str(out),
                cwd=issuer_dir)
    assert again.returncode == 1 and "already revoked in version 3" in again.stderr


def test_list_never_prints_a_token(issuer_dir: Path) -> None:
    tokens = [issue(issuer_dir, "--models", "a-model-name-that-is-long"), issue(issuer_dir, "--rpm", "60")]
    record = (issuer_dir / "issued.jsonl").read_text()
    table = ctl("list", "--issuer-key", str(issuer_dir / "issuer.key"), cwd=issuer_dir)
    as_json = ctl("list", "--issuer-key", str(issuer_dir / "issuer.key"), "--json", cwd=issuer_dir)
    assert table.returncode == as_json.returncode == 0
    for token in tokens:
        jti = jwt.decode(token, options={"verify_signature": False})["jti"]
        assert jti in table.stdout and jti in record
        for text in (table.stdout, as_json.stdout, record):
            assert token not in text and token.split(".")[2] not in text
    assert max(len(line) for line in table.stdout.splitlines()) <= 100
    assert [r["tenant"] for r in json.loads(as_json.stdout)] == ["team-a", "team-a"]


@pytest.mark.parametrize(("args", "code", "needle"), [
    (["issue", "--tenant", "t", "--audience", "a"], 2, "--issuer-key"),
    (["issue", "--issuer-key", "K", "--tenant", "t", "--audience", "a", "--expires", "forever"], 2, "duration"),
    (["issue", "--issuer-key", "K", "--tenant", "t", "--audience", "a", "--rpm", "0"], 2, "1..1000000000"),
    (["issue", "--issuer-key", "/nonexistent/issuer.key", "--tenant", "t", "--audience", "a"], 1, "cannot read"),
    (["inspect", "garbage"], 1, "not a JWT"),
    (["list", "--issuer-key", "/nonexistent/issuer.key"], 1, "does not exist"),
    ([], 2, "SUBCOMMAND"),
], ids=["missing_key_option", "bad_expires", "rpm_zero", "no_key_file", "inspect_garbage", "list_no_issuer", "bare"])
def test_errors_are_one_line(tmp_path: Path, args: list[str], code: int, needle: str) -> None:
    done = ctl(*args, cwd=tmp_path)
    assert done.returncode == code, done.stderr
    assert needle in done.stderr + done.stdout
    if code == 1:
        assert len(done.stderr.strip().splitlines()) == 1, done.stderr


def test_an_open_issuer_key_is_refused(issuer_dir: Path) -> None:
    (issuer_dir / "issuer.key").chmod(0o644)
    done = ctl("issue", "--issuer-key", str(issuer_dir / "issuer.key"), "--tenant", "t", "--audience", "a",
               cwd=issuer_dir)
    assert done.returncode == 1 and "chmod 600" in done.stderr and done.stdout == ""
