"""Mesh trust with standard X.509 (the ``cryptography`` library): CA, enrolment, verification.

One module (over 400 lines) because it is one certificate profile: the CA, the signing
request, the issued node certificate and the verifiers must agree on the same rules below
(Ed25519, the node-id SAN, backdating, tolerance), and share the helpers that encode them.

Two trust modes (``mesh.trust``, docs/mesh.md):

``ca``
    The mesh CA is a self-signed Ed25519 certificate (:func:`init_ca`). A node makes a
    signing request for its key and name (:func:`make_signing_request`), the CA host signs
    it (:func:`sign_request`), the node installs the certificate into its state dir
    (:func:`install_certificate`). The mesh id is derived from the CA's public key
    (:func:`mesh_id_for_ca`), so renewing the CA certificate with the same key keeps it.

``open`` (labs)
    There is no CA to enrol with. Every node issues its own certificate at start under a CA
    whose key is *derived from the configured mesh id* (:func:`open_mesh_ca`, HKDF-SHA256):
    any node that knows the mesh id can join, and nodes of another mesh id fail the TLS
    handshake, so two open meshes on one LAN stay apart and the TLS code path is the same
    as in CA mode. This is how "self-signed certificates" are realised with Python's ``ssl``
    (which has no verify callback to accept an unknown self-signed peer). On top, receivers
    pin each node *name* to the first node id seen with it (:class:`~viiwork.mesh.pins.PinStore`),
    so a later node cannot take over a known name. Open mode offers no admission control:
    the mesh id is public (it is in the mDNS TXT record); the agent warns at start.

Certificate rules (both modes): Ed25519 keys only; node certificates are end-entity
(``BasicConstraints ca=False``) for both TLS client and server use; the subject CN is the
node name and a URI SAN ``urn:viiwork:node:<node id>`` names the node id (the verifier
recomputes the id from the key and refuses a SAN that disagrees). Certificates are issued
with ``not_valid_before`` one hour in the past, so a freshly signed certificate works on a
peer whose clock runs up to an hour behind; summary verification adds
``tolerance_s`` (default 300 s) on both ends of the validity window. OpenSSL's handshake
check has no tolerance beyond the backdating.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import logging
import os
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey
from cryptography.hazmat.primitives.kdf.hkdf import HKDF
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from viiwork.mesh.identity import (
    NodeId,
    NodeIdentity,
    ensure_state_dir,
    load_private_key,
    node_id_from_public_key,
    private_key_pem,
    write_private_file,
)
from viiwork.mesh.pins import NameConflict, PinStore
from viiwork.mesh.signing import CertificateView

log = logging.getLogger(__name__)

CA_KEY_FILE = "ca.key"
CA_CERT_FILE = "ca.crt"
NODE_CERT_FILE = "node.crt"
OPEN_NODE_CERT_FILE = "open-node.crt"
NODE_URI_PREFIX = "urn:viiwork:node:"
BACKDATE = dt.timedelta(hours=1)
DEFAULT_TOLERANCE_S = 300.0
DEFAULT_CA_DAYS = 3650
DEFAULT_NODE_DAYS = 365
MAX_CERT_BYTES = 4096  # an Ed25519 node certificate is ~300 bytes DER

TrustMode = Literal["ca", "open"]

__all__ = [
    "CaTrust",
    "CertInfo",
    "CertificateExpired",
    "CertificateInvalid",
    "NameConflict",
    "OpenTrust",
    "TrustError",
    "WrongCa",
    "init_ca",
    "install_certificate",
    "issue_open_certificate",
    "load_ca",
    "load_certificate",
    "make_signing_request",
    "mesh_id_for_ca",
    "open_mesh_ca",
    "sign_request",
]


class TrustError(Exception):
    """A certificate, request or CA cannot be used (the message says why)."""


class CertificateInvalid(TrustError):
    """Not a usable node certificate: undecodable, wrong key type, a CA, a SAN that disagrees."""


class WrongCa(TrustError):
    """The certificate was not issued by this mesh's CA."""


class CertificateExpired(TrustError):
    """The certificate is outside its validity window (with the tolerance) by the local clock."""


def utcnow() -> dt.datetime:
    return dt.datetime.now(dt.UTC)


def _name(cn: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])


def _cn(cert_or_csr: x509.Certificate | x509.CertificateSigningRequest) -> str:
    attrs = cert_or_csr.subject.get_attributes_for_oid(NameOID.COMMON_NAME)
    return str(attrs[0].value) if attrs else ""


def _raw_public(key: Ed25519PublicKey) -> bytes:
    return key.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)


def mesh_id_for_ca(ca_cert: x509.Certificate) -> str:
    """The mesh id of a CA: the node-id derivation applied to the CA's public key (16 chars)."""
    key = ca_cert.public_key()
    if not isinstance(key, Ed25519PublicKey):
        raise CertificateInvalid("the mesh CA must have an Ed25519 key")
    return str(node_id_from_public_key(key))


# --- CA ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class CaFiles:
    key_path: Path
    cert_path: Path
    mesh_id: str


def _ca_certificate(key: Ed25519PrivateKey, name: str, not_before: dt.datetime, not_after: dt.datetime,
                    serial: int) -> x509.Certificate:
    ski = x509.SubjectKeyIdentifier.from_public_key(key.public_key())
    return (
        x509.CertificateBuilder()
        .subject_name(_name(name))
        .issuer_name(_name(name))
        .public_key(key.public_key())
        .serial_number(serial)
        .not_valid_before(not_before)
        .not_valid_after(not_after)
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(digital_signature=False, content_commitment=False, key_encipherment=False,
                          data_encipherment=False, key_agreement=False, key_cert_sign=True, crl_sign=True,
                          encipher_only=False, decipher_only=False),
            critical=True,
        )
        .add_extension(ski, critical=False)
        .sign(key, None)
    )


def init_ca(out_dir: Path, name: str = "viiwork mesh CA", days: int = DEFAULT_CA_DAYS,
            now: dt.datetime | None = None) -> CaFiles:
    """Create a mesh CA in ``out_dir``: ``ca.key`` (PKCS#8 PEM, 0600) and ``ca.crt`` (PEM).

    ``out_dir`` is created 0700 when missing. Refuses (TrustError) to overwrite an existing
    ``ca.key``: replacing a CA silently would cut every enrolled node off the mesh.
    """
    if days < 1:
        raise TrustError("days must be >= 1")
    out_dir = ensure_state_dir(Path(out_dir))
    key_path, cert_path = out_dir / CA_KEY_FILE, out_dir / CA_CERT_FILE
    if key_path.exists():
        raise TrustError(f"{key_path} already exists; refusing to replace a CA (choose another --out)")
    now = now or utcnow()
    key = Ed25519PrivateKey.generate()
    cert = _ca_certificate(key, name, now - BACKDATE, now + dt.timedelta(days=days), x509.random_serial_number())
    write_private_file(key_path, private_key_pem(key))
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    os.chmod(cert_path, 0o644)
    return CaFiles(key_path=key_path, cert_path=cert_path, mesh_id=mesh_id_for_ca(cert))


def load_certificate(path: Path) -> x509.Certificate:
    """Load one PEM (or DER) certificate; TrustError naming the file when unreadable."""
    try:
        data = Path(path).read_bytes()
    except OSError as exc:
        raise TrustError(f"cannot read certificate {path}: {exc.strerror or exc}") from None
    try:
        if b"-----BEGIN" in data:
            return x509.load_pem_x509_certificate(data)
        return x509.load_der_x509_certificate(data)
    except ValueError as exc:
        raise TrustError(f"{path} is not an X.509 certificate: {exc}") from None


def load_ca(ca_dir: Path, need_key: bool = True) -> tuple[Ed25519PrivateKey | None, x509.Certificate]:
    """Load ``ca.key`` (permission-checked, when ``need_key``) and ``ca.crt`` from ``ca_dir``."""
    ca_dir = Path(ca_dir)
    cert = load_certificate(ca_dir / CA_CERT_FILE)
    key = None
    if need_key:
        key_path = ca_dir / CA_KEY_FILE
        if not key_path.exists():
            raise TrustError(f"{key_path} not found: --ca must name the directory made by `viiworkctl mesh ca init`")
        key = load_private_key(key_path)
        if _raw_public(key.public_key()) != _raw_public(_ed25519(cert)):
            raise TrustError(f"{key_path} does not match {ca_dir / CA_CERT_FILE}")
    return key, cert


def _ed25519(cert: x509.Certificate | x509.CertificateSigningRequest) -> Ed25519PublicKey:
    try:
        key = cert.public_key()
    except (ValueError, TypeError) as exc:  # unsupported key algorithm
        raise CertificateInvalid(f"unreadable public key: {exc}") from None
    if not isinstance(key, Ed25519PublicKey):
        raise CertificateInvalid(f"key must be Ed25519, got {type(key).__name__}")
    return key


# --- enrolment --------------------------------------------------------------------------------


def make_signing_request(identity: NodeIdentity, name: str) -> bytes:
    """A PEM PKCS#10 request for the node's key: CN = ``name``, URI SAN = its node id."""
    if not name or len(name) > 63:
        raise TrustError("node name must be 1..63 characters")
    csr = (
        x509.CertificateSigningRequestBuilder()
        .subject_name(_name(name))
        .add_extension(x509.SubjectAlternativeName([x509.UniformResourceIdentifier(NODE_URI_PREFIX + identity.node_id)]),
                       critical=False)
        .sign(identity.private_key, None)
    )
    return csr.public_bytes(serialization.Encoding.PEM)


@dataclass(frozen=True)
class RequestInfo:
    """What a signing request asks for: ``name`` (CN) and the ``node_id`` of its key."""

    name: str
    node_id: NodeId


def read_signing_request(csr_pem: bytes) -> tuple[x509.CertificateSigningRequest, RequestInfo]:
    """Parse and check a request: decodable, self-signature valid, Ed25519, SAN consistent."""
    try:
        csr = x509.load_pem_x509_csr(csr_pem)
    except ValueError as exc:
        raise TrustError(f"not a PEM certificate signing request: {exc}") from None
    key = _ed25519(csr)
    if not csr.is_signature_valid:
        raise TrustError("the signing request's signature is invalid (corrupted or tampered with)")
    node_id = node_id_from_public_key(key)
    name = _cn(csr)
    if not name:
        raise TrustError("the signing request has no common name (the node name)")
    _check_san(_san_uris(csr), node_id)
    return csr, RequestInfo(name=name, node_id=node_id)


def _san_uris(obj: x509.Certificate | x509.CertificateSigningRequest) -> list[str]:
    try:
        san = obj.extensions.get_extension_for_class(x509.SubjectAlternativeName)
    except x509.ExtensionNotFound:
        return []
    return list(san.value.get_values_for_type(x509.UniformResourceIdentifier))


def _check_san(uris: list[str], node_id: NodeId) -> None:
    for uri in uris:
        if uri.startswith(NODE_URI_PREFIX) and uri[len(NODE_URI_PREFIX):] != node_id:
            raise CertificateInvalid(f"SAN {uri} does not match the key's node id {node_id}")


def _node_certificate(subject_key: Ed25519PublicKey, name: str, node_id: NodeId, ca_key: Ed25519PrivateKey,
                      ca_cert: x509.Certificate, not_before: dt.datetime, not_after: dt.datetime) -> x509.Certificate:
    return (
        x509.CertificateBuilder()
        .subject_name(_name(name))
        .issuer_name(ca_cert.subject)
        .public_key(subject_key)
        .serial_number(x509.random_serial_number())
        .not_valid_before(not_before)
        .not_valid_after(not_after)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(
            x509.KeyUsage(digital_signature=True, content_commitment=False, key_encipherment=False,
                          data_encipherment=False, key_agreement=False, key_cert_sign=False, crl_sign=False,
                          encipher_only=False, decipher_only=False),
            critical=True,
        )
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]),
                       critical=False)
        .add_extension(x509.SubjectAlternativeName([x509.UniformResourceIdentifier(NODE_URI_PREFIX + node_id)]),
                       critical=False)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(subject_key), critical=False)
        .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False)
        .sign(ca_key, None)
    )


def sign_request(ca_key: Ed25519PrivateKey, ca_cert: x509.Certificate, csr_pem: bytes,
                 days: int = DEFAULT_NODE_DAYS, now: dt.datetime | None = None) -> bytes:
    """Sign a node's request with the CA; returns the node certificate (PEM).

    Valid from one hour ago (clock tolerance) for ``days`` days, never past the CA's own
    expiry. Raises TrustError for a bad request or ``days < 1``.
    """
    if days < 1:
        raise TrustError("days must be >= 1")
    csr, info = read_signing_request(csr_pem)
    now = now or utcnow()
    not_after = min(now + dt.timedelta(days=days), ca_cert.not_valid_after_utc)
    cert = _node_certificate(_ed25519(csr), info.name, info.node_id, ca_key, ca_cert, now - BACKDATE, not_after)
    return cert.public_bytes(serialization.Encoding.PEM)


def install_certificate(state_dir: Path, cert_pem: bytes, identity: NodeIdentity,
                        ca_cert: x509.Certificate | None = None, now: dt.datetime | None = None) -> Path:
    """Check a node certificate against this node's key (and the CA, when given) and write it
    to ``<state_dir>/node.crt`` (0644). Returns the path. Raises TrustError (WrongCa,
    CertificateExpired, CertificateInvalid) naming what does not fit."""
    try:
        cert = x509.load_pem_x509_certificate(cert_pem)
    except ValueError as exc:
        raise TrustError(f"not a PEM certificate: {exc}") from None
    key = _ed25519(cert)
    if _raw_public(key) != _raw_public(identity.public_key):
        raise CertificateInvalid(
            f"the certificate is for node {node_id_from_public_key(key)}, not this node ({identity.node_id}); "
            "was it signed from another node's request?"
        )
    if ca_cert is not None:
        CaTrust(ca_cert).verify_certificate(cert.public_bytes(serialization.Encoding.DER), now or utcnow())
    state_dir = ensure_state_dir(Path(state_dir))
    path = state_dir / NODE_CERT_FILE
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    os.chmod(tmp, 0o644)
    os.replace(tmp, path)
    return path


# --- open mode --------------------------------------------------------------------------------

_OPEN_NOT_BEFORE = dt.datetime(2000, 1, 1, tzinfo=dt.UTC)
_OPEN_NOT_AFTER = dt.datetime(9999, 12, 31, 23, 59, 59, tzinfo=dt.UTC)


def open_mesh_ca(mesh_id: str) -> tuple[Ed25519PrivateKey, x509.Certificate]:
    """The open-mode CA of ``mesh_id``: key = HKDF-SHA256(mesh id), certificate fixed
    (serial 1, valid 2000..9999, deterministic Ed25519 signature), so every node derives the
    byte-identical CA without talking to anyone."""
    if not mesh_id:
        raise TrustError("open mode needs a mesh_id")
    seed = HKDF(algorithm=hashes.SHA256(), length=32, salt=b"viiwork open mesh CA",
                info=b"ed25519 key v1").derive(mesh_id.encode("utf-8"))
    key = Ed25519PrivateKey.from_private_bytes(seed)
    label = hashlib.sha256(mesh_id.encode("utf-8")).hexdigest()[:16]
    cert = _ca_certificate(key, f"viiwork open mesh {label}", _OPEN_NOT_BEFORE, _OPEN_NOT_AFTER, 1)
    return key, cert


def issue_open_certificate(identity: NodeIdentity, name: str, mesh_id: str, days: int = DEFAULT_NODE_DAYS,
                           now: dt.datetime | None = None) -> bytes:
    """This node's open-mode certificate (PEM), issued under :func:`open_mesh_ca`."""
    ca_key, ca_cert = open_mesh_ca(mesh_id)
    now = now or utcnow()
    cert = _node_certificate(identity.public_key, name, identity.node_id, ca_key, ca_cert, now - BACKDATE,
                             now + dt.timedelta(days=days))
    return cert.public_bytes(serialization.Encoding.PEM)


# --- verification -----------------------------------------------------------------------------


@dataclass(frozen=True)
class CertInfo:
    """A verified node certificate: who it names and until when it is valid (UTC)."""

    node_id: NodeId
    name: str
    public_key: Ed25519PublicKey
    not_before: dt.datetime
    not_after: dt.datetime
    der: bytes


def parse_node_certificate(der: bytes) -> x509.Certificate:
    if not isinstance(der, (bytes, bytearray)) or not der or len(der) > MAX_CERT_BYTES:
        raise CertificateInvalid(f"certificate must be 1..{MAX_CERT_BYTES} bytes of DER")
    try:
        return x509.load_der_x509_certificate(bytes(der))
    except ValueError as exc:
        raise CertificateInvalid(f"undecodable certificate: {exc}") from None


class CaTrust:
    """Verifies node certificates against one CA certificate (``trust = "ca"``).

    ``verify_certificate(der, now)`` checks, in order: decodable DER, Ed25519 key, not a CA,
    issued and signed by the CA (:class:`WrongCa` otherwise), SAN consistent with the key,
    validity window widened by ``tolerance_s`` around ``now`` (:class:`CertificateExpired`).
    Chain results are cached by certificate bytes (bounded LRU of ``cache_size``); the
    validity window is rechecked on every call. ``chain_verifications`` counts the Ed25519
    signature checks actually performed.
    """

    mode: TrustMode = "ca"

    def __init__(self, ca_cert: x509.Certificate, tolerance_s: float = DEFAULT_TOLERANCE_S, cache_size: int = 4096):
        self.ca_cert = ca_cert
        self.ca_pem = ca_cert.public_bytes(serialization.Encoding.PEM)
        self.mesh_id = mesh_id_for_ca(ca_cert)
        self.tolerance = dt.timedelta(seconds=tolerance_s)
        self._cache: OrderedDict[bytes, CertInfo] = OrderedDict()
        self._cache_size = cache_size
        self.chain_verifications = 0
        self.signature_verifications = 0

    def verify_signature(self, cert: CertificateView, data: bytes, signature: bytes) -> bool:
        """True when ``signature`` is ``cert``'s key's Ed25519 signature of ``data``."""
        self.signature_verifications += 1
        return verify_signature(cert.public_key, data, signature)

    def verify_certificate(self, der: bytes, now: dt.datetime) -> CertInfo:
        info = self._cache.get(bytes(der))
        if info is None:
            info = self._verify_chain(bytes(der))
            self._cache[bytes(der)] = info
            if len(self._cache) > self._cache_size:
                self._cache.popitem(last=False)
        else:
            self._cache.move_to_end(bytes(der))
        if now + self.tolerance < info.not_before or now - self.tolerance > info.not_after:
            raise CertificateExpired(
                f"certificate of {info.name} ({info.node_id}) is valid {info.not_before:%Y-%m-%d %H:%M} .. "
                f"{info.not_after:%Y-%m-%d %H:%M} UTC, local clock says {now:%Y-%m-%d %H:%M} UTC"
            )
        self._after_verify(info)
        return info

    def _after_verify(self, info: CertInfo) -> None:
        """Hook for policies that add rules on top of the chain (open mode's name pins)."""

    def _verify_chain(self, der: bytes) -> CertInfo:
        cert = parse_node_certificate(der)
        key = _ed25519(cert)
        try:
            basic = cert.extensions.get_extension_for_class(x509.BasicConstraints).value
            if basic.ca:
                raise CertificateInvalid("a CA certificate cannot be a node certificate")
        except x509.ExtensionNotFound:
            pass
        except ValueError as exc:  # malformed extensions
            raise CertificateInvalid(f"undecodable extensions: {exc}") from None
        self.chain_verifications += 1
        try:
            cert.verify_directly_issued_by(self.ca_cert)
        except (ValueError, InvalidSignature, TypeError):
            raise WrongCa(f"certificate of {_cn(cert)!r} was not issued by this mesh's CA") from None
        node_id = node_id_from_public_key(key)
        _check_san(_san_uris(cert), node_id)
        return CertInfo(node_id=node_id, name=_cn(cert), public_key=key, not_before=cert.not_valid_before_utc,
                        not_after=cert.not_valid_after_utc, der=der)


class OpenTrust(CaTrust):
    """Open mode (``trust = "open"``): certificates chain to :func:`open_mesh_ca` of
    ``mesh_id``, and each node name is pinned to the first node id seen with it
    (:class:`NameConflict` for a different id later)."""

    mode: TrustMode = "open"

    def __init__(self, mesh_id: str, pins: PinStore, tolerance_s: float = DEFAULT_TOLERANCE_S, cache_size: int = 4096):
        _, ca_cert = open_mesh_ca(mesh_id)
        super().__init__(ca_cert, tolerance_s=tolerance_s, cache_size=cache_size)
        self.mesh_id = mesh_id
        self.pins = pins

    def _after_verify(self, info: CertInfo) -> None:
        self.pins.check_and_pin(info.name, info.node_id)


def certificate_der(pem_or_der: bytes) -> bytes:
    """DER bytes of a PEM or DER certificate."""
    if b"-----BEGIN" in pem_or_der:
        return x509.load_pem_x509_certificate(pem_or_der).public_bytes(serialization.Encoding.DER)
    return bytes(pem_or_der)


def verify_signature(public_key: Ed25519PublicKey, data: bytes, signature: bytes) -> bool:
    """True when ``signature`` is a valid Ed25519 signature of ``data`` by ``public_key``."""
    try:
        public_key.verify(signature, data)
        return True
    except InvalidSignature:
        return False
