"""``ssl.SSLContext`` builders for mutual TLS between nodes, and the peer's identity.

Both sides present their node certificate and accept only certificates that chain to the
mesh CA (the only trust root: the system store is never loaded). TLS 1.3 only. Host names
are not checked: peers are dialled by address, and who answered is read from the
certificate (:func:`peer_node_id`), which is what the mesh trusts. Python's ``ssl`` with
OpenSSL 3.0 handles Ed25519 certificates and keys for this (checked by the mesh tests).
OpenSSL checks validity dates at the handshake with no tolerance; node certificates are
backdated an hour at issue (see :mod:`viiwork.mesh.trust`).
"""

from __future__ import annotations

import ssl
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

from viiwork.mesh.identity import NodeId, check_private_file, node_id_from_public_key


def _base(purpose: int, cert_path: Path, key_path: Path, ca_pem: bytes) -> ssl.SSLContext:
    ctx = ssl.SSLContext(purpose)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_3
    check_private_file(Path(key_path))
    ctx.load_cert_chain(str(cert_path), str(key_path))
    ctx.load_verify_locations(cadata=ca_pem.decode("ascii"))
    ctx.verify_mode = ssl.CERT_REQUIRED
    return ctx


def server_context(cert_path: Path, key_path: Path, ca_pem: bytes) -> ssl.SSLContext:
    """The mesh listener's context: requires a client certificate from the mesh CA."""
    return _base(ssl.PROTOCOL_TLS_SERVER, cert_path, key_path, ca_pem)


def client_context(cert_path: Path, key_path: Path, ca_pem: bytes) -> ssl.SSLContext:
    """The context for dialling peers: presents this node's certificate, requires the
    peer's to chain to the mesh CA; no host name check (identity comes from the certificate)."""
    ctx = _base(ssl.PROTOCOL_TLS_CLIENT, cert_path, key_path, ca_pem)
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_REQUIRED
    return ctx


def peer_node_id(ssl_object: ssl.SSLObject | ssl.SSLSocket | None) -> NodeId | None:
    """The node id of the verified peer certificate on a TLS connection, None without one."""
    if ssl_object is None:
        return None
    der = ssl_object.getpeercert(binary_form=True)
    if not der:
        return None
    key = x509.load_der_x509_certificate(der).public_key()
    if not isinstance(key, Ed25519PublicKey):
        return None
    return node_id_from_public_key(key)
