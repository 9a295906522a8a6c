"""The signed, versioned revocation list, and the state file that keeps the highest version seen.

A list is a JWT signed by the issuer key, through the same check as a client key (``jws``:
EdDSA only, known ``kid``, ``iss``, ``aud``), with claims ``iss``, ``aud``, ``ver`` (1, 2, ...),
``revoked`` (every revoked ``jti`` so far, not only the new one) and ``iat``. It has no ``exp``:
a revocation never lapses. Newest version wins (``newer``); a node refuses a forged list or one
not newer than what it holds, counts the refusal by reason, and persists what it accepts, so a
restart never un-revokes.
"""

from __future__ import annotations

import json
import os
from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from viiwork.agent.auth.claims import NAME_PATTERN, audiences
from viiwork.agent.auth.errors import InvalidApiKey, RevocationReason, RevocationRefused
from viiwork.agent.auth.jws import verify_signed
from viiwork.agent.auth.keyset import KeySet

#: The most revoked ids one list holds (a key id is 21 characters: about 3.2 MB signed at the cap).
MAX_REVOKED = 100_000
#: The longest signed list taken, bytes: MAX_REVOKED ids of 21 characters fit (24 bytes each in
#: JSON, 4/3 of that in base64url); it also bounds what a peer may send or answer (docs/security.md).
MAX_LIST_BYTES = 4 * 1024 * 1024
MAX_VERSION = 2**53  # JSON numbers are exact integers up to here
STATE_FILE = "revocations.json"


@dataclass(frozen=True)
class RevocationList:
    """One version of the list. ``ver`` 0 with no ids is the state before any list."""

    iss: str
    aud: tuple[str, ...]
    ver: int
    revoked: frozenset[str]
    iat: int  # seconds since the epoch when the issuer signed it
    token: str | None = None  # the signed list as received (None for the empty version 0)

    def to_payload(self) -> dict[str, Any]:
        return {"iss": self.iss, "aud": list(self.aud), "ver": self.ver, "revoked": sorted(self.revoked),
                "iat": self.iat}


def empty_list(issuer: str) -> RevocationList:
    """Version 0: nothing revoked."""
    return RevocationList(iss=issuer, aud=(), ver=0, revoked=frozenset(), iat=0)


def newer(a: RevocationList, b: RevocationList) -> bool:
    """Whether ``a`` replaces ``b``: a strictly higher version (equal versions are the same list)."""
    return a.ver > b.ver


def _list_from_payload(payload: Mapping[str, Any], token: str | None) -> RevocationList:
    def bad(detail: str) -> RevocationRefused:
        return RevocationRefused(RevocationReason.BAD_CLAIMS, detail)

    ver, iat, revoked = payload.get("ver"), payload.get("iat"), payload.get("revoked")
    if isinstance(ver, bool) or not isinstance(ver, int) or not 1 <= ver <= MAX_VERSION:
        raise bad(f"claim 'ver' must be an integer 1..{MAX_VERSION}")
    if isinstance(iat, bool) or not isinstance(iat, int) or iat < 0:
        raise bad("claim 'iat' must be a non-negative integer")
    if (not isinstance(revoked, list) or len(revoked) > MAX_REVOKED
            or not all(isinstance(j, str) and NAME_PATTERN.fullmatch(j) for j in revoked)):
        raise bad(f"claim 'revoked' must be at most {MAX_REVOKED} key ids")
    iss = payload.get("iss")
    if not isinstance(iss, str):
        raise bad("claim 'iss' must be a string")
    try:
        aud = audiences(payload.get("aud"))
    except InvalidApiKey as exc:
        raise bad(exc.detail) from None
    return RevocationList(iss=iss, aud=aud, ver=ver, revoked=frozenset(revoked), iat=iat, token=token)


def read_revocations(token: str, keys: KeySet, *, issuer: str, audiences: Iterable[str]) -> RevocationList:
    """Verify a signed list (as a client key is verified, times aside) and read it.

    Raises RevocationRefused with the reason of the failed check (a forged list: bad_signature,
    unknown_kid or bad_alg); never ``stale``, which needs a list to compare with.
    """
    try:
        _, payload = verify_signed(token, keys, issuer=issuer, audiences=audiences,
                                   required=("ver", "revoked", "iat"), max_bytes=MAX_LIST_BYTES)
    except InvalidApiKey as exc:
        raise RevocationRefused(RevocationReason(exc.reason.value), exc.detail) from None
    return _list_from_payload(payload, token)


class RevocationStateError(Exception):
    """The state file exists but cannot be read back: the node must not start as if nothing were
    revoked. The message names the file and the fix."""


def _write_atomically(path: Path, data: bytes) -> None:
    tmp = path.with_name(path.name + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.write(fd, data)
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)  # the rename itself survives a power cut
    finally:
        os.close(dir_fd)


class RevocationStore:
    """The highest version of the list this node has seen, in ``<state_dir>/revocations.json``.

    ``offer`` verifies a list, refuses one not newer than ``current`` (``stale``), writes an
    accepted one by temp file + rename before returning it (so a restart never un-revokes), and
    counts refusals by reason in ``refused``. Not thread-safe: one owner (the agent's loop).
    """

    def __init__(self, state_dir: Path, keys: KeySet, *, issuer: str, audiences: Iterable[str]) -> None:
        self.path = state_dir / STATE_FILE
        self.keys = keys
        self.issuer = issuer
        self.audiences = frozenset(audiences)
        self.refused: Counter[RevocationReason] = Counter()
        self.current = self._load()

    def _load(self) -> RevocationList:
        # The file was verified when written; it is trusted again without the issuer's key, so a
        # rotated-away issuer key does not un-revoke on restart.
        try:
            raw = self.path.read_bytes()
        except FileNotFoundError:
            return empty_list(self.issuer)
        except OSError as exc:
            raise RevocationStateError(f"cannot read {self.path}: {exc.strerror}") from None
        try:
            doc = json.loads(raw)
            if not isinstance(doc, dict) or not isinstance(doc.get("token"), str):
                raise ValueError
            token = doc.pop("token")
            return _list_from_payload(doc, token)
        except (ValueError, RevocationRefused):
            raise RevocationStateError(
                f"{self.path} is not a revocation state file; restore it, or offer the latest signed list "
                "again after moving it away") from None

    def offer(self, token: str) -> RevocationList:
        """Accept ``token`` if it verifies and is newer than ``current``; returns the new current.

        Raises RevocationRefused (counted in ``refused``). OSError from writing the state file
        propagates (the list is then not accepted).
        """
        try:
            received = read_revocations(token, self.keys, issuer=self.issuer, audiences=self.audiences)
            if not newer(received, self.current):
                raise RevocationRefused(RevocationReason.STALE,
                                        f"version {received.ver} is not newer than {self.current.ver}")
        except RevocationRefused as exc:
            self.refused[exc.reason] += 1
            raise
        doc = received.to_payload() | {"token": token}
        _write_atomically(self.path, json.dumps(doc, sort_keys=True).encode())
        self.current = received
        return received
