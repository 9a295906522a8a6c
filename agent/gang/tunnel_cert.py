"""The gang tunnel's own certificate: what the head's tunnel process presents to a worker's exit.

The head's end of a llama.cpp RPC tunnel runs as a process of its own (agent/gang/tunnel_process.py),
so that it outlives a restart of the head's agent and the head's llama-server keeps its RPC
devices (docs/mesh.md, "Gangs"). That process runs as the engine's user, in the engines'
sandbox, and must not hold the node's mesh key (whoever holds it can speak for the node in the
mesh). So each gang gets a credential of its own: a fresh Ed25519 key and a self-signed
certificate for it (:func:`make_credential`), written to the tunnel's private directory. The
head sends the certificate (PEM, public) to each worker in its start request, over the mesh's
mutual TLS; the worker's exit admits a client presenting exactly that certificate and no
other (:func:`exit_context`, and the exact match in :class:`~viiwork.agent.gang.tunnel.TunnelExit`).
Stolen, the key reaches that gang's rpc-servers, which the head's engine reaches anyway, and
nothing else; a new gang has a new key.
"""

from __future__ import annotations

import datetime as dt
import ssl
from pathlib import Path

from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey
from cryptography.x509.oid import NameOID

from viiwork.agent.supervision.engine_keys import write_private
from viiwork.mesh import tls

CERT_FILE = "tunnel.crt"
KEY_FILE = "tunnel.key"
CA_FILE = "mesh-ca.pem"
#: The longest certificate PEM a start request may carry (an Ed25519 one is about 450 bytes).
MAX_CERT_PEM_CHARS = 4096
#: Backdated like node certificates (OpenSSL checks dates with no tolerance: mesh/tls.py).
_BACKDATE = dt.timedelta(hours=1)
_LIFETIME = dt.timedelta(days=3650)


def make_credential(directory: Path, gang: str, engine_user: str | None, ca_pem: bytes) -> str:
    """A fresh key and self-signed certificate for ``gang``'s tunnel, and the mesh CA (to check
    the workers' node certificates), written to ``directory`` (0600 files in a 0700 dir owned by
    ``engine_user`` when the agent is root: engine_keys.write_private). Returns the certificate's
    PEM. Raises EngineKeyError when a file cannot be written."""
    key = Ed25519PrivateKey.generate()
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, f"viiwork gang tunnel {gang}")])
    now = dt.datetime.now(dt.UTC)
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
            .serial_number(x509.random_serial_number()).not_valid_before(now - _BACKDATE)
            .not_valid_after(now + _LIFETIME)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .sign(key, None))
    key_pem = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                serialization.NoEncryption())
    cert_pem = cert.public_bytes(serialization.Encoding.PEM)
    write_private(directory, KEY_FILE, key_pem, engine_user, what="gang tunnel key")
    write_private(directory, CERT_FILE, cert_pem, engine_user, what="gang tunnel certificate")
    write_private(directory, CA_FILE, ca_pem, engine_user, what="mesh CA copy")
    return cert_pem.decode("ascii")


def pinned_der(pem: str) -> bytes:
    """The DER of a tunnel certificate sent by a head: one PEM certificate of at most
    :data:`MAX_CERT_PEM_CHARS`, an Ed25519 key, self-signed (its signature checks against its
    own key). Raises ValueError saying which of these fails."""
    if not isinstance(pem, str) or not 0 < len(pem) <= MAX_CERT_PEM_CHARS:
        raise ValueError(f"expected a PEM certificate of at most {MAX_CERT_PEM_CHARS} characters")
    try:
        cert = x509.load_pem_x509_certificate(pem.encode("ascii"))
    except (ValueError, UnicodeEncodeError) as exc:
        raise ValueError(f"not a PEM certificate: {exc}") from None
    key = cert.public_key()
    if not isinstance(key, Ed25519PublicKey):
        raise ValueError("not an Ed25519 certificate")
    try:
        key.verify(cert.signature, cert.tbs_certificate_bytes)
    except InvalidSignature:
        raise ValueError("not self-signed by its own key") from None
    return cert.public_bytes(serialization.Encoding.DER)


def exit_context(cert_path: Path, key_path: Path, ca_pem: bytes, pinned_pem: str) -> ssl.SSLContext:
    """A worker's exit context: this node's certificate; a client certificate is required and
    may chain to the mesh CA (a member: refused by the exit as ``wrong_node``) or be the gang's
    pinned one (admitted by the exact match). Raises ValueError/OSError as ``ssl`` does."""
    return tls.server_context(cert_path, key_path, ca_pem + b"\n" + pinned_pem.encode("ascii"))


def entry_context(directory: Path) -> ssl.SSLContext:
    """The tunnel process's client context: the gang's certificate and key from ``directory``,
    the worker's certificate checked against the mesh CA copy there (its node id is then
    compared by the entry). Raises OSError/ValueError."""
    return tls.client_context(directory / CERT_FILE, directory / KEY_FILE, (directory / CA_FILE).read_bytes())
