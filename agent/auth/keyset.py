"""The issuer's keys: public keys by ``kid`` for nodes, the private key file for the workstation.

``kid`` is the first 16 hex digits of SHA-256 over the public key's 32 raw bytes (RFC 8032
encoding): stable for a key wherever its PEM file lives, and different for a rotated key, so a
node can hold the old and the new issuer key at once during a rotation.
"""

from __future__ import annotations

import hashlib
import os
import stat
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import NewType

from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

KeyId = NewType("KeyId", str)

#: How to give a node its issuer key (``path``: its ``auth.issuer_keys``): in the 401 of a node
#: without one, and in the doctor's remedy.
INSTALL_HINT = ("install the issuer's public key: make an issuer on your workstation (`viiworkctl keys issuer init "
                "--out DIR`), copy DIR/issuer.pub to {path} (auth.issuer_keys) and restart the agent; "
                "docs/install.md, \"Client keys\"")

#: A PEM public key is about 113 bytes; anything much larger is not one.
MAX_KEY_FILE_BYTES = 16 * 1024


class IssuerKeyError(Exception):
    """An issuer key file that cannot be used: unreadable, not Ed25519 PEM, too open (0600)."""


def key_id(public_key: Ed25519PublicKey) -> KeyId:
    """The ``kid`` of ``public_key``: 16 lowercase hex digits (first 8 bytes of SHA-256 of its raw bytes)."""
    raw = public_key.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    return KeyId(hashlib.sha256(raw).hexdigest()[:16])


def _read_small(path: Path) -> bytes:
    try:
        with open(path, "rb") as handle:
            data = handle.read(MAX_KEY_FILE_BYTES + 1)
    except OSError as exc:
        raise IssuerKeyError(f"cannot read {path}: {exc.strerror}") from None
    if len(data) > MAX_KEY_FILE_BYTES:
        raise IssuerKeyError(f"{path} is larger than {MAX_KEY_FILE_BYTES} bytes: not a PEM key")
    return data


def load_public_key(path: Path) -> Ed25519PublicKey:
    """An Ed25519 public key from a PEM (SubjectPublicKeyInfo) file; IssuerKeyError otherwise."""
    data = _read_small(path)
    try:
        key = serialization.load_pem_public_key(data)
    except ValueError:
        raise IssuerKeyError(f"{path} is not a PEM public key") from None
    if not isinstance(key, Ed25519PublicKey):
        raise IssuerKeyError(f"{path} holds a {type(key).__name__}, not an Ed25519 public key")
    return key


def load_private_key(path: Path) -> Ed25519PrivateKey:
    """The issuer's Ed25519 private key from an unencrypted PKCS#8 PEM file.

    Raises IssuerKeyError when the file is unreadable, not such a key, or readable by group or
    others (the key signs every client key: it must be 0600, like ssh's private keys).
    """
    try:
        mode = os.stat(path).st_mode
    except OSError as exc:
        raise IssuerKeyError(f"cannot read {path}: {exc.strerror}") from None
    if stat.S_IMODE(mode) & 0o077:
        raise IssuerKeyError(f"{path} is readable by others (mode {stat.S_IMODE(mode):04o}): chmod 600 {path}")
    data = _read_small(path)
    try:
        key = serialization.load_pem_private_key(data, password=None)
    except (ValueError, TypeError):
        raise IssuerKeyError(f"{path} is not an unencrypted PEM private key") from None
    if not isinstance(key, Ed25519PrivateKey):
        raise IssuerKeyError(f"{path} holds a {type(key).__name__}, not an Ed25519 private key")
    return key


def public_pem(public_key: Ed25519PublicKey) -> bytes:
    """``public_key`` as PEM SubjectPublicKeyInfo (the ``issuer.pub`` format)."""
    return public_key.public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)


def private_pem(private_key: Ed25519PrivateKey) -> bytes:
    """``private_key`` as unencrypted PKCS#8 PEM (the ``issuer.key`` format)."""
    return private_key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                     serialization.NoEncryption())


@dataclass(frozen=True)
class KeySet:
    """The issuer public keys a node accepts, by ``kid`` (several during a rotation)."""

    keys: Mapping[KeyId, Ed25519PublicKey]

    @classmethod
    def of(cls, public_keys: Iterable[Ed25519PublicKey]) -> KeySet:
        return cls({key_id(k): k for k in public_keys})

    @classmethod
    def from_path(cls, path: Path) -> KeySet:
        """Keys from one PEM file (``issuer.pub``) or every ``*.pub`` file of a directory.

        Raises IssuerKeyError for an unusable file, or a directory without any ``*.pub``.
        """
        if path.is_dir():
            files = sorted(path.glob("*.pub"))
            if not files:
                raise IssuerKeyError(f"{path} holds no *.pub issuer key")
        else:
            files = [path]
        return cls.of(load_public_key(f) for f in files)

    def get(self, kid: str) -> Ed25519PublicKey | None:
        return self.keys.get(KeyId(kid))

    def __len__(self) -> int:
        return len(self.keys)
