"""X.509 trust: CA init, request, sign, install, chain verification, open mode, pins."""

from __future__ import annotations

import datetime as dt
import stat

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import serialization
from freezegun import freeze_time

from viiwork.mesh.identity import load_or_create_identity
from viiwork.mesh.pins import NameConflict, PinStore
from viiwork.mesh.trust import (
    CaTrust,
    CertificateExpired,
    CertificateInvalid,
    OpenTrust,
    TrustError,
    WrongCa,
    certificate_der,
    init_ca,
    install_certificate,
    issue_open_certificate,
    load_ca,
    make_signing_request,
    mesh_id_for_ca,
    open_mesh_ca,
    read_signing_request,
    sign_request,
    utcnow,
)


@pytest.fixture
def ca_dir(tmp_path):
    init_ca(tmp_path / "ca")
    return tmp_path / "ca"


def enrol(tmp_path, ca_dir, name="gpu-01", days=365, now=None):
    ident = load_or_create_identity(tmp_path / f"state-{name}")
    key, cert = load_ca(ca_dir)
    pem = sign_request(key, cert, make_signing_request(ident, name), days=days, now=now)
    return ident, pem, cert


def test_ca_init_writes_key_0600_and_self_signed_ed25519_ca(ca_dir):
    assert stat.S_IMODE((ca_dir / "ca.key").stat().st_mode) == 0o600
    key, cert = load_ca(ca_dir)
    assert cert.issuer == cert.subject
    assert cert.extensions.get_extension_for_class(x509.BasicConstraints).value.ca
    cert.verify_directly_issued_by(cert)


def test_ca_init_refuses_to_replace_an_existing_ca(ca_dir):
    with pytest.raises(TrustError, match="refusing to replace"):
        init_ca(ca_dir)


def test_mesh_id_is_stable_for_the_ca_key(ca_dir):
    _, cert = load_ca(ca_dir)
    assert mesh_id_for_ca(cert) == mesh_id_for_ca(load_ca(ca_dir)[1])
    assert len(mesh_id_for_ca(cert)) == 16


def test_request_sign_install_and_verify(tmp_path, ca_dir):
    ident, pem, ca_cert = enrol(tmp_path, ca_dir)
    path = install_certificate(tmp_path / "state-gpu-01", pem, ident, ca_cert)
    assert path.name == "node.crt"
    info = CaTrust(ca_cert).verify_certificate(certificate_der(pem), utcnow())
    assert info.node_id == ident.node_id and info.name == "gpu-01"


def test_request_names_node_id_and_sign_rejects_tampering(tmp_path, ca_dir):
    ident = load_or_create_identity(tmp_path / "s")
    csr = make_signing_request(ident, "box")
    _, info = read_signing_request(csr)
    assert (info.name, info.node_id) == ("box", ident.node_id)
    with pytest.raises(TrustError, match="not a PEM certificate signing request"):
        read_signing_request(b"-----BEGIN CERTIFICATE REQUEST-----\nAAAA\n-----END CERTIFICATE REQUEST-----\n")


def test_install_refuses_a_certificate_for_another_key(tmp_path, ca_dir):
    _, pem, ca_cert = enrol(tmp_path, ca_dir, "a")
    other = load_or_create_identity(tmp_path / "other")
    with pytest.raises(CertificateInvalid, match="not this node"):
        install_certificate(tmp_path / "other", pem, other, ca_cert)


def test_install_refuses_a_certificate_of_another_ca(tmp_path, ca_dir):
    ident, pem, _ = enrol(tmp_path, ca_dir)
    init_ca(tmp_path / "ca2")
    _, other_ca = load_ca(tmp_path / "ca2")
    with pytest.raises(WrongCa):
        install_certificate(tmp_path / "state-gpu-01", pem, ident, other_ca)


def test_wrong_ca_is_refused_by_verification(tmp_path, ca_dir):
    _, pem, _ = enrol(tmp_path, ca_dir)
    init_ca(tmp_path / "ca2")
    with pytest.raises(WrongCa):
        CaTrust(load_ca(tmp_path / "ca2")[1]).verify_certificate(certificate_der(pem), utcnow())


def test_expiry_is_checked_against_the_local_clock_with_tolerance(tmp_path, ca_dir):
    issued = dt.datetime(2026, 3, 1, 12, 0, tzinfo=dt.UTC)
    _, pem, ca_cert = enrol(tmp_path, ca_dir, days=10, now=issued)
    trust = CaTrust(ca_cert, tolerance_s=300)
    der = certificate_der(pem)
    with freeze_time("2026-03-11 12:04:00"):  # 4 min past expiry: inside the tolerance
        trust.verify_certificate(der, utcnow())
    with freeze_time("2026-03-11 12:06:00"):
        with pytest.raises(CertificateExpired, match="local clock"):
            trust.verify_certificate(der, utcnow())
    with freeze_time("2026-03-01 10:56:00"):  # 64 min before issue: backdated 1 h + 5 min
        trust.verify_certificate(der, utcnow())
    with freeze_time("2026-03-01 10:50:00"):
        with pytest.raises(CertificateExpired):
            trust.verify_certificate(der, utcnow())


def test_node_certificate_never_outlives_its_ca(tmp_path):
    now = dt.datetime(2026, 1, 1, tzinfo=dt.UTC)
    init_ca(tmp_path / "ca", days=30, now=now)
    _, pem, ca_cert = enrol(tmp_path, tmp_path / "ca", days=365, now=now)
    cert = x509.load_pem_x509_certificate(pem)
    assert cert.not_valid_after_utc == ca_cert.not_valid_after_utc


def test_a_ca_certificate_is_not_a_node_certificate(ca_dir):
    _, ca_cert = load_ca(ca_dir)
    with pytest.raises(CertificateInvalid, match="CA certificate"):
        CaTrust(ca_cert).verify_certificate(ca_cert.public_bytes(serialization.Encoding.DER), utcnow())


@pytest.mark.parametrize("der", [b"", b"\x30\x03\x02\x01\x01", b"x" * 5000], ids=["empty", "truncated", "huge"])
def test_garbage_certificates_are_invalid(ca_dir, der):
    with pytest.raises(CertificateInvalid):
        CaTrust(load_ca(ca_dir)[1]).verify_certificate(der, utcnow())


def test_open_mesh_ca_is_deterministic_per_mesh_id():
    a1, c1 = open_mesh_ca("lab")
    _, c2 = open_mesh_ca("lab")
    _, c3 = open_mesh_ca("other-lab")
    der = serialization.Encoding.DER
    assert c1.public_bytes(der) == c2.public_bytes(der)
    assert c1.public_bytes(der) != c3.public_bytes(der)


def test_open_mode_admits_same_mesh_id_refuses_other(tmp_path):
    ident = load_or_create_identity(tmp_path / "s")
    der = certificate_der(issue_open_certificate(ident, "lab-1", "lab"))
    assert OpenTrust("lab", PinStore()).verify_certificate(der, utcnow()).node_id == ident.node_id
    with pytest.raises(WrongCa):
        OpenTrust("other-lab", PinStore()).verify_certificate(der, utcnow())


def test_open_mode_pins_names_on_first_use(tmp_path):
    pins = PinStore(tmp_path / "known_nodes.json")
    trust = OpenTrust("lab", pins)
    first = load_or_create_identity(tmp_path / "a")
    impostor = load_or_create_identity(tmp_path / "b")
    trust.verify_certificate(certificate_der(issue_open_certificate(first, "gpu-01", "lab")), utcnow())
    with pytest.raises(NameConflict, match="pinned to node"):
        trust.verify_certificate(certificate_der(issue_open_certificate(impostor, "gpu-01", "lab")), utcnow())
    pins.save()
    assert stat.S_IMODE((tmp_path / "known_nodes.json").stat().st_mode) == 0o600
    reloaded = PinStore(tmp_path / "known_nodes.json")
    assert reloaded.pins == {"gpu-01": first.node_id}
    assert reloaded.forget("gpu-01") and not reloaded.forget("gpu-01")


def test_corrupt_pin_store_starts_empty(tmp_path):
    (tmp_path / "known_nodes.json").write_text("{nope")
    assert PinStore(tmp_path / "known_nodes.json").pins == {}


def test_chain_checks_are_cached_but_validity_is_rechecked(tmp_path, ca_dir):
    _, pem, ca_cert = enrol(tmp_path, ca_dir, days=1)
    trust = CaTrust(ca_cert)
    der = certificate_der(pem)
    for _ in range(5):
        trust.verify_certificate(der, utcnow())
    assert trust.chain_verifications == 1
    with pytest.raises(CertificateExpired):
        trust.verify_certificate(der, utcnow() + dt.timedelta(days=3))
