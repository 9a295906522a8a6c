"""A client key's claims as a frozen value, read from a verified JWT payload with types and bounds.

Required (issue 17): ``iss``, ``aud``, ``jti``, ``exp``, ``tenant``. Optional: ``nbf``, ``iat``,
``models`` (absent = every model), ``rpm``, ``tpm``, ``concurrency`` (absent = no limit of its
own), ``priority`` (default ``normal``), ``scope`` (a space-separated string as in RFC 8693
section 4.2; default ``inference``). Claims not named here are ignored, so an issuer may add some.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from viiwork.agent.auth.errors import InvalidApiKey, Reason

# One enum for the claim and for the wire (a want's ``priority`` extension, mesh/extensions.py).
from viiwork.mesh.extensions import Priority as Priority

#: tenant and jti: 1..64 characters, a letter or digit first, then letters, digits, ``._-``.
NAME_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
#: A model name in ``models``: 1..128 printable ASCII characters without spaces.
MODEL_PATTERN = re.compile(r"[!-~]{1,128}")
MAX_MODELS = 64
#: rpm, tpm and concurrency: 1..10^9 (0 would be a key that can do nothing; say so by revoking).
MAX_LIMIT = 10**9
#: exp, nbf, iat: seconds since the epoch, 0..2^40 (beyond year 36000 is a mistake, not a date).
MAX_TIME = 2**40
MAX_AUDIENCES = 16



class Scope(str, Enum):
    INFERENCE = "inference"  # /v1/chat/completions, /v1/completions, /v1/models, ...
    READ = "read"  # /v1/status, /metrics, /v1/mesh


@dataclass(frozen=True)
class KeyClaims:
    """What a verified key allows. Times are seconds since the epoch (UTC)."""

    iss: str
    aud: tuple[str, ...]  # the audiences the key names (a mesh id, or node names)
    jti: str  # the key's id: what logs, usage and revocation name
    exp: int
    tenant: str
    nbf: int | None = None
    iat: int | None = None
    models: tuple[str, ...] | None = None  # None: every model
    rpm: int | None = None  # requests per minute; None: no limit of its own
    tpm: int | None = None  # tokens per minute; None: no limit of its own
    concurrency: int | None = None  # requests in flight; None: no limit of its own
    priority: Priority = Priority.NORMAL
    scope: frozenset[Scope] = field(default_factory=lambda: frozenset({Scope.INFERENCE}))

    def to_payload(self) -> dict[str, Any]:
        """The JWT claims set: absent optionals are left out; ``aud`` a string when it is one."""
        payload: dict[str, Any] = {"iss": self.iss, "aud": self.aud[0] if len(self.aud) == 1 else list(self.aud),
                                   "jti": self.jti, "exp": self.exp, "tenant": self.tenant}
        for name in ("nbf", "iat", "rpm", "tpm", "concurrency"):
            value = getattr(self, name)
            if value is not None:
                payload[name] = value
        if self.models is not None:
            payload["models"] = list(self.models)
        payload["priority"] = self.priority.value
        payload["scope"] = " ".join(sorted(s.value for s in self.scope))
        return payload


def _bad(detail: str) -> InvalidApiKey:
    return InvalidApiKey(Reason.BAD_CLAIMS, detail)


def _int(payload: Mapping[str, Any], name: str, low: int, high: int, required: bool = False) -> int | None:
    value = payload.get(name)
    if value is None:
        if required:
            raise _bad(f"claim {name!r} is required")
        return None
    # bool is an int in Python, never in JSON's sense of a number.
    if isinstance(value, bool) or not isinstance(value, int):
        raise _bad(f"claim {name!r} must be an integer, not {type(value).__name__}")
    if not low <= value <= high:
        raise _bad(f"claim {name!r} is {value}, outside {low}..{high}")
    return value


def _name(payload: Mapping[str, Any], name: str) -> str:
    value = payload.get(name)
    if value is None:
        raise _bad(f"claim {name!r} is required")
    if not isinstance(value, str) or not NAME_PATTERN.fullmatch(value):
        raise _bad(f"claim {name!r} must be 1..64 characters of letters, digits and ._- (a letter or digit first)")
    return value


def audiences(value: Any) -> tuple[str, ...]:
    """``aud`` as a tuple: RFC 7519 section 4.1.3 allows one string or an array of strings."""
    items = [value] if isinstance(value, str) else value
    if (not isinstance(items, list) or not 1 <= len(items) <= MAX_AUDIENCES
            or not all(isinstance(a, str) and 1 <= len(a) <= 253 for a in items)):
        raise _bad(f"claim 'aud' must be a string or 1..{MAX_AUDIENCES} strings of 1..253 characters")
    return tuple(items)


def claims_from_payload(payload: Mapping[str, Any]) -> KeyClaims:
    """KeyClaims from a JWT payload whose signature was checked; InvalidApiKey(bad_claims) otherwise."""
    iss = payload.get("iss")
    if not isinstance(iss, str) or not 1 <= len(iss) <= 253:
        raise _bad("claim 'iss' must be a string of 1..253 characters")
    if "aud" not in payload:
        raise _bad("claim 'aud' is required")
    aud = audiences(payload["aud"])
    models = payload.get("models")
    if models is not None:
        if (not isinstance(models, list) or not 1 <= len(models) <= MAX_MODELS
                or not all(isinstance(m, str) and MODEL_PATTERN.fullmatch(m) for m in models)):
            raise _bad(f"claim 'models' must be 1..{MAX_MODELS} model names (absent means every model)")
        models = tuple(models)
    priority = payload.get("priority", Priority.NORMAL.value)
    if not isinstance(priority, str) or priority not in {p.value for p in Priority}:
        raise _bad("claim 'priority' must be one of high, normal, low")
    scope_text = payload.get("scope", Scope.INFERENCE.value)
    words = scope_text.split(" ") if isinstance(scope_text, str) else None
    if not words or not set(words) <= {s.value for s in Scope}:
        raise _bad("claim 'scope' must be a space-separated string of inference, read")
    exp = _int(payload, "exp", 0, MAX_TIME, required=True)
    assert exp is not None
    return KeyClaims(
        iss=iss, aud=aud, jti=_name(payload, "jti"), exp=exp, tenant=_name(payload, "tenant"),
        nbf=_int(payload, "nbf", 0, MAX_TIME), iat=_int(payload, "iat", 0, MAX_TIME), models=models,
        rpm=_int(payload, "rpm", 1, MAX_LIMIT), tpm=_int(payload, "tpm", 1, MAX_LIMIT),
        concurrency=_int(payload, "concurrency", 1, MAX_LIMIT), priority=Priority(priority),
        scope=frozenset(Scope(w) for w in words),
    )
