"""The gang tunnel's own credential (agent/gang/tunnel_cert.py), its check on the worker's side,
the start request that carries it (agent/gang/wire.py), and the tunnel process's command line
and counters file (agent/gang/tunnel_process.py)."""

from __future__ import annotations

import datetime as dt
import json
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from cryptography.x509.oid import NameOID

from viiwork.agent.gang.tunnel import TunnelCounters
from viiwork.agent.gang.tunnel_cert import (
    CERT_FILE,
    KEY_FILE,
    make_credential,
    pinned_der,
    read_tunnel_cert,
    write_peer,
)
from viiwork.agent.gang.tunnel_process import counters_path, read_counters
from viiwork.agent.gang.wire import Malformed, StartRequest, parse_start


def certificate(key, signer, name: str = "x") -> str:  # type: ignore[no-untyped-def]
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
    now = dt.datetime.now(dt.UTC)
    builder = (x509.CertificateBuilder().subject_name(subject).issuer_name(subject).public_key(key.public_key())
               .serial_number(1).not_valid_before(now).not_valid_after(now + dt.timedelta(days=1)))
    algorithm = None if isinstance(signer, Ed25519PrivateKey) else hashes.SHA256()
    return builder.sign(signer, algorithm).public_bytes(serialization.Encoding.PEM).decode()


def test_a_credential_is_fresh_private_and_pinned_by_its_certificate(tmp_path: Path) -> None:
    directory = tmp_path / "engines" / "big-gang-tunnel"
    first = make_credential(directory, "abcdefghijkl", None)
    second = make_credential(directory, "mnopqrstuvwx", None)
    assert first != second  # a new gang, a new key
    assert (directory / CERT_FILE).read_text() == second
    assert write_peer(directory, "r1", first, None).read_text() == first
    assert stat.S_IMODE(directory.stat().st_mode) == 0o700
    for name in (KEY_FILE, CERT_FILE, "peer-r1.crt"):
        assert stat.S_IMODE((directory / name).stat().st_mode) == 0o600
    der = pinned_der(second)
    assert x509.load_der_x509_certificate(der).subject.rfc4514_string() == "CN=viiwork gang tunnel mnopqrstuvwx"


def test_pinned_der_refuses_what_is_not_a_self_signed_ed25519_certificate() -> None:
    key, other = Ed25519PrivateKey.generate(), Ed25519PrivateKey.generate()
    assert pinned_der(certificate(key, key))
    with pytest.raises(ValueError, match="not self-signed"):
        pinned_der(certificate(key, other))
    ec_key = ec.generate_private_key(ec.SECP256R1())
    with pytest.raises(ValueError, match="not an Ed25519"):
        pinned_der(certificate(ec_key, ec_key))
    for bad in ("", "x" * 5000, "-----BEGIN CERTIFICATE-----\ngarbage\n-----END CERTIFICATE-----\n", "é"):
        with pytest.raises(ValueError):
            pinned_der(bad)
    with pytest.raises(ValueError):
        pinned_der(None)  # type: ignore[arg-type]


def start_body(cert: object) -> bytes:
    request = StartRequest("big", "abcdefghijkl", 1, 2, ("10.0.0.1", "10.0.0.2"), {"name": "0" * 32})
    return json.dumps({**request.to_json(), "tunnel_cert": cert}).encode()


def test_a_start_request_carries_a_checked_tunnel_certificate() -> None:
    key = Ed25519PrivateKey.generate()
    pem = certificate(key, key)
    assert parse_start(start_body(pem)).tunnel_cert == pem
    assert parse_start(start_body(None)).tunnel_cert is None  # engines without a tunnel
    for bad in (certificate(key, Ed25519PrivateKey.generate()), 42, "x" * 5000):
        with pytest.raises(Malformed, match="tunnel_cert"):
            parse_start(start_body(bad))
    with pytest.raises(Malformed, match="nested too deeply"):  # a 500 and a traceback before (attacker pass)
        parse_start(b"[" * 16000)
    without = json.loads(start_body(None))
    del without["tunnel_cert"]
    with pytest.raises(Malformed):
        parse_start(json.dumps(without).encode())


def test_counters_file_round_trip_and_bad_files(tmp_path: Path) -> None:
    counters = TunnelCounters(connections_open=1, connections_total=3, bytes_in=10, bytes_out=20)
    counters.refused["wrong_node"] = 2
    counters_path(tmp_path, 1).write_text(json.dumps(counters.as_dict()))
    assert read_counters(tmp_path, 1) == counters
    assert read_counters(tmp_path, 2) is None  # not written yet
    counters_path(tmp_path, 3).write_text("[1, 2]")
    assert read_counters(tmp_path, 3) is None
    counters_path(tmp_path, 4).write_text(json.dumps({"bytes_in": -5, "bytes_out": "many", "refused": {"malformed": 1}}))
    odd = read_counters(tmp_path, 4)
    assert odd is not None and (odd.bytes_in, odd.bytes_out, odd.refused["malformed"]) == (0, 0, 1)
    os.symlink(counters_path(tmp_path, 1), counters_path(tmp_path, 5))
    assert read_counters(tmp_path, 5) is None  # a link left by the engine's user is not followed


def run_process(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "viiwork.agent.gang.tunnel_process", *args],
                          capture_output=True, text=True, timeout=30)


def test_tunnel_process_refuses_bad_arguments_and_a_missing_credential(tmp_path: Path) -> None:
    common = ["--gang", "abcdefghijkl", "--rank", "1", "--dir", str(tmp_path), "--peer", str(tmp_path / "peer.crt")]
    entry = ["entry", *common, "--worker", "a" * 16, "--connect", "10.0.0.2:7000", "--port", "7001"]
    exit_ = ["exit", *common, "--head", "a" * 16, "--listen", "127.0.0.1:7002", "--rpc-port", "7003"]
    for argv, i, bad in ((entry, 2, "not-a-gang"), (entry, 10, "nobody"), (entry, 12, "10.0.0.2"),
                         (entry, 14, "70000"), (exit_, 10, "x"), (exit_, 14, "0"), (["both", *common], 0, "both")):
        argv = list(argv)
        argv[i] = bad
        done = run_process(*argv)
        assert done.returncode == 2 and "error" in done.stderr, (bad, done.stderr)
    for argv in (entry, exit_):  # no credential in the directory
        done = run_process(*argv)
        assert done.returncode == 1 and "cannot read the tunnel credentials" in done.stderr, done.stderr


def test_a_restarted_agent_reads_back_only_its_own_certificate(tmp_path: Path) -> None:
    """The tunnel directory is the engine user's: whatever it plants as tunnel.crt (a link to
    the node's key, a FIFO, a huge file, a key itself), nothing but a self-signed certificate
    is read back and sent to the head (second attacker pass: a link leaked node.key)."""
    directory = tmp_path / "engines" / "big-gang-tunnel"
    pem = make_credential(directory, "abcdefghijkl", None)
    assert read_tunnel_cert(directory) == pem
    secret = tmp_path / "node.key"
    secret.write_text((directory / KEY_FILE).read_text())
    cert = directory / CERT_FILE
    for plant in ("link", "fifo", "big", "key"):
        cert.unlink()
        if plant == "link":
            os.symlink(secret, cert)
        elif plant == "fifo":
            os.mkfifo(cert)
        elif plant == "big":
            cert.write_text(pem + "x" * 5000)
        else:
            cert.write_text(secret.read_text())
        assert read_tunnel_cert(directory) is None, plant


def test_a_counters_file_of_nested_arrays_reads_as_none(tmp_path: Path) -> None:
    counters_path(tmp_path, 1).write_text("[" * 15000)
    assert read_counters(tmp_path, 1) is None  # /metrics answered 500 before
