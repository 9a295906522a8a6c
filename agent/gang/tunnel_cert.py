"""A gang tunnel's own credentials: what each end of a llama.cpp RPC tunnel presents (docs/mesh.md, "Gangs").

Both ends of a gang's tunnel run as processes of their own (agent/gang/tunnel_process.py),
so that they outlive a restart of their agent: the head's engine keeps its RPC devices when
the head's agent restarts, and when a worker's agent restarts. Those processes run as the
engine's user, in the engines' sandbox, and must not hold the node's mesh key (whoever holds
it speaks for the node in the mesh). So each end gets a credential of its own for each gang:
a fresh Ed25519 key and a self-signed certificate (:func:`make_credential`), written to its
tunnel directory. The two agents swap the certificates (public) over the mesh's mutual TLS,
where each knows the other's node: the head sends its own in the start request (to the
worker its config names), the worker answers with its own (to the head its config names).
Each end then trusts exactly the other's certificate and no other (:func:`entry_context`,
:func:`exit_context`, and the exact match in agent/gang/tunnel.py). Stolen, a key reaches
that gang's rpc-servers, which the head's engine reaches anyway, and nothing else; a new gang
has new keys.
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

from viiwork.agent.supervision.engine_keys import read_private, write_private
from viiwork.mesh import tls

CERT_FILE = "tunnel.crt"
KEY_FILE = "tunnel.key"
#: The longest certificate PEM a start request may carry (an Ed25519 one is about 450 bytes).
MAX_CERT_PEM_CHARS = 4096
#: Backdated like node certificates (OpenSSL checks dates with no tolerance: mesh/tls.py).
_BACKDATE = dt.timedelta(hours=1)
_LIFETIME = dt.timedelta(days=3650)


def make_credential(directory: Path, gang: str, engine_user: str | None) -> str:
    """A fresh key and self-signed certificate for this end of ``gang``'s tunnel, written to
    ``directory`` (0600 files in a 0700 dir owned by ``engine_user`` when the agent is root:
    engine_keys.write_private). Returns the certificate's PEM. Raises EngineKeyError when a
    file cannot be written."""
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
    return cert_pem.decode("ascii")


def write_peer(directory: Path, peer: str, pem: str, engine_user: str | None) -> Path:
    """The other end's certificate (checked by :func:`pinned_der` first) written to
    ``directory/peer-<peer>.crt``; returns its path. Raises EngineKeyError."""
    return write_private(directory, f"peer-{peer}.crt", pem.encode("ascii"), engine_user,
                         what="gang tunnel peer certificate")


def read_tunnel_cert(directory: Path) -> str | None:
    """This end's certificate as :func:`make_credential` wrote it, read back by a restarted
    agent (agent/gang/worker.py ``adopt``): None unless ``directory/tunnel.crt`` is a regular
    file of one link, not followed (the directory is the engine user's), at most
    :data:`MAX_CERT_PEM_CHARS`, and a self-signed Ed25519 certificate (:func:`pinned_der`):
    whatever the engine's user put there, nothing else is read or sent on to the head."""
    raw = read_private(directory / CERT_FILE, MAX_CERT_PEM_CHARS)
    try:
        pem = raw.decode("ascii") if raw is not None else None
        if pem is not None:
            pinned_der(pem)
    except (UnicodeDecodeError, ValueError):
        return None
    return pem


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


def exit_context(directory: Path, peer: Path) -> ssl.SSLContext:
    """A worker's exit: its certificate and key from ``directory``; a client certificate is
    required and must chain to ``peer`` alone (the head's certificate of this gang). Raises
    OSError/ValueError as ``ssl`` does."""
    return tls.server_context(directory / CERT_FILE, directory / KEY_FILE, peer.read_bytes())


def entry_context(directory: Path, peer: Path) -> ssl.SSLContext:
    """The head's entry: its certificate and key from ``directory``; the exit's certificate
    must chain to ``peer`` alone (the worker's certificate of this gang). Raises OSError/ValueError."""
    return tls.client_context(directory / CERT_FILE, directory / KEY_FILE, peer.read_bytes())
