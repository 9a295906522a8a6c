"""A request's client key from its headers: a pure function, no I/O, no decoding.

Clients send ``Authorization: Bearer <token>`` (RFC 6750 section 2.1; the scheme is
case-insensitive, RFC 9110 section 11.1) or ``x-api-key: <token>`` (as Anthropic-style clients
do). Both present must carry the same token, and each at most once: a repeated header (two
``Authorization`` lines, or two ``x-api-key``) is refused as malformed rather than read by its
first copy, since a proxy in front may read another copy than the agent does.
"""

from __future__ import annotations

from multidict import MultiMapping

from viiwork.agent.auth.errors import InvalidApiKey, Reason
from viiwork.agent.auth.jws import MAX_TOKEN_BYTES, well_formed

#: A header value longer than this is refused before any parsing ("Bearer " + MAX_TOKEN_BYTES).
MAX_HEADER_BYTES = MAX_TOKEN_BYTES + 64


def _from_authorization(value: str) -> str:
    scheme, _, rest = value.partition(" ")
    if scheme.lower() != "bearer":
        raise InvalidApiKey(Reason.MALFORMED, "Authorization must be 'Bearer <key>'")
    return rest.strip(" \t")


def token_from_request(headers: MultiMapping[str]) -> str:
    """The token of a request's headers (aiohttp's ``request.headers``, a case-insensitive
    multi-map) by ``token_from_headers``. Raises InvalidApiKey(malformed)
    when ``Authorization`` or ``x-api-key`` appears more than once, whatever the copies hold."""
    values: dict[str, str | None] = {}
    for name in ("Authorization", "x-api-key"):
        copies = headers.getall(name, [])
        if len(copies) > 1:
            raise InvalidApiKey(Reason.MALFORMED, f"{name} is sent {len(copies)} times (send it once)")
        values[name] = copies[0] if copies else None
    return token_from_headers(values["Authorization"], values["x-api-key"])


def token_from_headers(authorization: str | None, x_api_key: str | None) -> str:
    """The token from the two headers' values (None when the header is absent).

    Returns the token (a well-formed compact JWS). Raises InvalidApiKey(missing) when neither
    header has a value, InvalidApiKey(malformed) for another scheme than Bearer, a value over
    MAX_HEADER_BYTES, a token that is not a compact JWS, or two headers that disagree.
    """
    found: list[str] = []
    for name, value in (("Authorization", authorization), ("x-api-key", x_api_key)):
        if value is None:
            continue
        if len(value) > MAX_HEADER_BYTES:
            raise InvalidApiKey(Reason.MALFORMED, f"{name} is longer than {MAX_HEADER_BYTES} characters")
        value = value.strip(" \t")
        if not value:
            continue
        token = _from_authorization(value) if name == "Authorization" else value
        if not well_formed(token):
            raise InvalidApiKey(Reason.MALFORMED, f"{name} does not hold a compact JWS")
        found.append(token)
    if not found:
        raise InvalidApiKey(Reason.MISSING, "no key: send 'Authorization: Bearer <key>' or 'x-api-key: <key>'")
    if len(found) == 2 and found[0] != found[1]:
        raise InvalidApiKey(Reason.MALFORMED, "Authorization and x-api-key carry different keys")
    return found[0]
