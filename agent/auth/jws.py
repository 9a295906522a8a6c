"""The one signature check for client keys and revocation lists: a compact JWS, EdDSA only.

PyJWT checks the signature with the public key the header's ``kid`` names; the algorithm rule
is applied twice on purpose: the header's ``alg`` must be in ``ALGORITHMS`` before any key is
looked up, and PyJWT is told the same list, so a token cannot pick its own algorithm (the
``alg: none`` and RS256/HS256 key-confusion attacks, RFC 8725 section 2.1).
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Any

import jwt

from viiwork.agent.auth.claims import audiences as read_audiences
from viiwork.agent.auth.errors import InvalidApiKey, Reason
from viiwork.agent.auth.keyset import KeyId, KeySet

#: The only algorithm accepted: Ed25519 (RFC 8037).
ALGORITHMS: tuple[str, ...] = ("EdDSA",)
#: A key is about 400 bytes; 8 KiB leaves room for long model lists and refuses junk early.
MAX_TOKEN_BYTES = 8 * 1024
#: A compact JWS (RFC 7515 section 7.1): three base64url parts; the signature may be empty
#: (``alg: none``), which is then refused as bad_alg rather than malformed.
COMPACT_JWS = re.compile(r"[A-Za-z0-9_-]+\.[A-Za-z0-9_-]+\.[A-Za-z0-9_-]*")


def well_formed(token: str, max_bytes: int = MAX_TOKEN_BYTES) -> bool:
    """Whether ``token`` has the shape of a compact JWS within ``max_bytes`` (no decoding)."""
    return len(token) <= max_bytes and COMPACT_JWS.fullmatch(token) is not None


def verify_signed(token: str, keys: KeySet, *, issuer: str, audiences: Iterable[str],
                  required: Iterable[str], max_bytes: int = MAX_TOKEN_BYTES) -> tuple[KeyId, dict[str, Any]]:
    """Check ``token``'s shape, algorithm, ``kid``, signature, ``iss``, ``aud`` and required claims.

    ``audiences``: the names this node answers to (any one matching ``aud`` suffices).
    ``max_bytes``: the longest token taken (a key's MAX_TOKEN_BYTES; a revocation list's is its own).
    Returns (kid, payload). Times (``exp``, ``nbf``) are the caller's to check, against its own
    clock. Raises InvalidApiKey with malformed, bad_alg, unknown_kid, bad_signature,
    wrong_issuer, wrong_audience or bad_claims; nothing else.
    """
    if not isinstance(token, str) or not well_formed(token, max_bytes):
        raise InvalidApiKey(Reason.MALFORMED, f"not a compact JWS of at most {max_bytes} bytes")
    try:
        header = jwt.get_unverified_header(token)
    except (jwt.PyJWTError, ValueError, TypeError):
        raise InvalidApiKey(Reason.MALFORMED, "the JWS header does not decode") from None
    alg = header.get("alg")
    if alg not in ALGORITHMS:
        raise InvalidApiKey(Reason.BAD_ALG, f"alg {str(alg)[:16]!r} is not EdDSA")
    kid = header.get("kid")
    key = keys.get(kid) if isinstance(kid, str) else None
    if key is None or not isinstance(kid, str):
        raise InvalidApiKey(Reason.UNKNOWN_KID, f"kid {str(kid)[:20]!r} is none of the issuer's keys")
    try:
        payload = jwt.decode(token, key, algorithms=list(ALGORITHMS),
                             options={"verify_exp": False, "verify_nbf": False, "verify_iat": False,
                                      "verify_aud": False, "verify_iss": False, "verify_jti": False,
                                      "verify_sub": False})
    except jwt.InvalidSignatureError:
        raise InvalidApiKey(Reason.BAD_SIGNATURE, f"the signature does not verify with key {kid}") from None
    except jwt.InvalidAlgorithmError:
        raise InvalidApiKey(Reason.BAD_ALG, "alg is not EdDSA") from None
    except (jwt.PyJWTError, ValueError, TypeError):
        raise InvalidApiKey(Reason.MALFORMED, "the claims do not decode to a JSON object") from None
    if "iss" not in payload:
        raise InvalidApiKey(Reason.BAD_CLAIMS, "claim 'iss' is required")
    if payload["iss"] != issuer:
        raise InvalidApiKey(Reason.WRONG_ISSUER, f"iss {str(payload['iss'])[:64]!r} is not {issuer!r}")
    if "aud" not in payload:
        raise InvalidApiKey(Reason.BAD_CLAIMS, "claim 'aud' is required")
    if not set(read_audiences(payload["aud"])) & set(audiences):
        raise InvalidApiKey(Reason.WRONG_AUDIENCE, "aud names neither this mesh nor this node")
    for name in required:
        if name not in payload:
            raise InvalidApiKey(Reason.BAD_CLAIMS, f"claim {name!r} is required")
    return KeyId(kid), payload
