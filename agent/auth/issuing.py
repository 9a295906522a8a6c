"""The issuer's side (the operator's workstation, ``viiworkctl keys``): key pair, keys, lists, record.

An issuer directory holds ``issuer.key`` (Ed25519 PKCS#8 PEM, 0600), ``issuer.pub`` (PEM, what
nodes install), ``issuer.json`` (``{"name": iss, "kid": ...}``), ``issued.jsonl`` (one JSON
object per issued key: ``jti``, ``tenant``, ``kid``, claims; never the token) and
``revocations.jwt`` (the latest signed revocation list).
"""

from __future__ import annotations

import json
import os
import secrets
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jwt
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from viiwork.agent.auth.claims import KeyClaims
from viiwork.agent.auth.keyset import KeyId, key_id, load_private_key, private_pem, public_pem
from viiwork.agent.auth.revocations import RevocationList

KEY_FILE = "issuer.key"
PUB_FILE = "issuer.pub"
META_FILE = "issuer.json"
RECORD_FILE = "issued.jsonl"
REVOCATIONS_FILE = "revocations.jwt"
DEFAULT_ISSUER_NAME = "viiwork-issuer"


class IssuerDirError(Exception):
    """An issuer directory that cannot be created or used; the message says what to do."""


@dataclass(frozen=True)
class Issuer:
    """A loaded issuer: its private key, ``iss`` name, ``kid`` and directory."""

    key: Ed25519PrivateKey
    name: str
    kid: KeyId
    directory: Path


def new_jti() -> str:
    """A fresh key id: ``k`` and 20 lowercase hex digits (80 random bits)."""
    return "k" + secrets.token_hex(10)


def _create_exclusive(path: Path, data: bytes, mode: int) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
    try:
        os.write(fd, data)
        os.fsync(fd)
    finally:
        os.close(fd)


def init_issuer(directory: Path, name: str = DEFAULT_ISSUER_NAME) -> Issuer:
    """Create a key pair in ``directory`` (created 0700 if absent). Refuses to overwrite any file
    of an issuer (IssuerDirError)."""
    try:
        directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    except OSError as exc:
        raise IssuerDirError(f"cannot create {directory}: {exc.strerror}") from None
    existing = [f for f in (KEY_FILE, PUB_FILE, META_FILE) if (directory / f).exists()]
    if existing:
        raise IssuerDirError(f"{directory} already holds {', '.join(existing)}: refusing to overwrite an issuer")
    key = Ed25519PrivateKey.generate()
    kid = key_id(key.public_key())
    try:
        _create_exclusive(directory / KEY_FILE, private_pem(key), 0o600)
        _create_exclusive(directory / PUB_FILE, public_pem(key.public_key()), 0o644)
        _create_exclusive(directory / META_FILE, json.dumps({"name": name, "kid": kid}).encode() + b"\n", 0o644)
    except OSError as exc:
        raise IssuerDirError(f"cannot write the issuer in {directory}: {exc.strerror}") from None
    return Issuer(key=key, name=name, kid=kid, directory=directory)


def load_issuer(key_path: Path) -> Issuer:
    """The issuer whose private key is ``key_path``; its name from ``issuer.json`` beside it
    (DEFAULT_ISSUER_NAME when absent). Raises IssuerKeyError or IssuerDirError."""
    key = load_private_key(key_path)
    meta_path = key_path.parent / META_FILE
    name = DEFAULT_ISSUER_NAME
    if meta_path.exists():
        try:
            meta = json.loads(meta_path.read_text())
            name = meta["name"]
            if not isinstance(name, str) or not name:
                raise ValueError
        except (OSError, ValueError, KeyError, TypeError):
            raise IssuerDirError(f"{meta_path} is not an issuer.json with a \"name\"") from None
    return Issuer(key=key, name=name, kid=key_id(key.public_key()), directory=key_path.parent)


def sign_key(issuer: Issuer, claims: KeyClaims) -> str:
    """The token for ``claims``: a compact JWS, EdDSA, header ``kid`` = the issuer key's kid."""
    return jwt.encode(claims.to_payload(), issuer.key, algorithm="EdDSA", headers={"kid": issuer.kid})


def sign_revocations(issuer: Issuer, revocations: RevocationList) -> str:
    """The signed list (compact JWS, EdDSA, ``kid`` header), as nodes read it back."""
    return jwt.encode(revocations.to_payload(), issuer.key, algorithm="EdDSA", headers={"kid": issuer.kid})


def append_record(issuer: Issuer, claims: KeyClaims) -> None:
    """Add one line for ``claims`` to ``issued.jsonl``: a single O_APPEND write, so concurrent
    issuers never interleave lines. The token is not in it."""
    line = json.dumps({"jti": claims.jti, "tenant": claims.tenant, "kid": issuer.kid,
                       "claims": claims.to_payload()}, sort_keys=True) + "\n"
    fd = os.open(issuer.directory / RECORD_FILE, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    try:
        os.write(fd, line.encode())
        os.fsync(fd)
    finally:
        os.close(fd)


def read_records(directory: Path) -> list[dict[str, Any]]:
    """The issued keys' records, oldest first ([] when none were issued). A line that is not a
    JSON object raises IssuerDirError naming its number."""
    path = directory / RECORD_FILE
    try:
        text = path.read_text()
    except FileNotFoundError:
        return []
    except OSError as exc:
        raise IssuerDirError(f"cannot read {path}: {exc.strerror}") from None
    records = []
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except ValueError:
            record = None
        if not isinstance(record, dict) or not isinstance(record.get("claims"), dict):
            raise IssuerDirError(f"{path}:{number} is not an issued-key record")
        records.append(record)
    return records
