"""Why a client key or a revocation list is refused: closed sets of reasons, one error type each.

The request path answers every ``InvalidApiKey`` with HTTP 401 ``invalid_api_key`` (OpenAI's
code) and counts ``reason``; ``detail`` is for the operator's log and never holds the token.
"""

from __future__ import annotations

from enum import Enum


class Reason(str, Enum):
    """Why a key is refused (issue 17's list)."""

    MISSING = "missing"  # no Authorization / x-api-key header, or an empty one
    MALFORMED = "malformed"  # not a compact JWS, too long, undecodable header or claims
    BAD_SIGNATURE = "bad_signature"  # the signature does not verify with the kid's key
    UNKNOWN_KID = "unknown_kid"  # no kid in the header, or none of the issuer's keys has it
    WRONG_ISSUER = "wrong_issuer"
    WRONG_AUDIENCE = "wrong_audience"
    BAD_ALG = "bad_alg"  # alg other than EdDSA (none, HS256, RS256, ...)
    EXPIRED = "expired"  # now > exp + leeway
    NOT_YET_VALID = "not_yet_valid"  # now < nbf - leeway
    REVOKED = "revoked"  # jti in the revocation list
    BAD_CLAIMS = "bad_claims"  # a required claim missing, a wrong type, out of bounds


class InvalidApiKey(Exception):
    """A client key refused; ``reason`` is one ``Reason``, ``detail`` a short sentence for logs."""

    def __init__(self, reason: Reason, detail: str) -> None:
        super().__init__(f"{reason.value}: {detail}")
        self.reason = reason
        self.detail = detail


class RevocationReason(str, Enum):
    """Why a revocation list is refused. A forged list shows as bad_signature, unknown_kid or
    bad_alg; ``stale`` is a version not above the highest one seen."""

    MALFORMED = "malformed"
    BAD_SIGNATURE = "bad_signature"
    UNKNOWN_KID = "unknown_kid"
    BAD_ALG = "bad_alg"
    WRONG_ISSUER = "wrong_issuer"
    WRONG_AUDIENCE = "wrong_audience"
    BAD_CLAIMS = "bad_claims"
    STALE = "stale"


class RevocationRefused(Exception):
    """A revocation list refused; ``reason`` is one ``RevocationReason``."""

    def __init__(self, reason: RevocationReason, detail: str) -> None:
        super().__init__(f"{reason.value}: {detail}")
        self.reason = reason
        self.detail = detail
