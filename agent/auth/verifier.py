"""``Verifier``: a client key (a token) to its ``KeyClaims``, or one ``InvalidApiKey``.

A miss goes through ``jws.verify_signed`` (shape, EdDSA only, ``kid``, signature, ``iss``,
``aud``), then the claims' types and bounds, then times and revocation. A verified key is cached
by the SHA-256 of the token (the token itself is never a key of anything that is logged or
shown), in a bounded LRU; a hit still checks expiry and revocation, so a key revoked or expired
after it was cached is refused at once. Counters: ``refused`` by reason, ``cache_hits``,
``verified`` (full checks that passed). Not thread-safe: one owner (the agent's loop).
"""

from __future__ import annotations

import hashlib
import time
from collections import Counter, OrderedDict
from collections.abc import Callable, Iterable

from viiwork.agent.auth.claims import KeyClaims, claims_from_payload
from viiwork.agent.auth.errors import InvalidApiKey, Reason
from viiwork.agent.auth.jws import verify_signed
from viiwork.agent.auth.keyset import KeySet
from viiwork.agent.auth.revocations import RevocationList, empty_list, newer

#: Default clock leeway for exp and nbf, seconds (issue 17).
DEFAULT_LEEWAY_S = 60.0
DEFAULT_CACHE_SIZE = 4096
REQUIRED_CLAIMS = ("iss", "aud", "jti", "exp", "tenant")


def _wall_clock() -> float:
    return time.time()  # looked up per call, so freezegun's clock applies in tests


def check_times(claims: KeyClaims, now: float, leeway_s: float) -> None:
    """Raises InvalidApiKey(expired) when now > exp + leeway, (not_yet_valid) when now < nbf - leeway."""
    if now > claims.exp + leeway_s:
        raise InvalidApiKey(Reason.EXPIRED, f"key {claims.jti} expired at {claims.exp}")
    if claims.nbf is not None and now < claims.nbf - leeway_s:
        raise InvalidApiKey(Reason.NOT_YET_VALID, f"key {claims.jti} is valid from {claims.nbf}")


class Verifier:
    """Verifies client keys for one issuer and the audiences this node answers to.

    ``issuer``: the ``iss`` keys must carry. ``audiences``: the mesh id and/or the node name.
    ``leeway_s``: clock skew allowed on exp and nbf (seconds, >= 0). ``cache_size``: verified
    keys kept (>= 0; 0 disables the cache). ``clock``: seconds since the epoch.
    """

    def __init__(self, keys: KeySet, *, issuer: str, audiences: Iterable[str], leeway_s: float = DEFAULT_LEEWAY_S,
                 cache_size: int = DEFAULT_CACHE_SIZE, clock: Callable[[], float] = _wall_clock) -> None:
        if leeway_s < 0 or cache_size < 0:
            raise ValueError("leeway_s and cache_size must be >= 0")
        self.keys = keys
        self.issuer = issuer
        self.audiences = frozenset(audiences)
        self.leeway_s = leeway_s
        self.cache_size = cache_size
        self.clock = clock
        self.revocations = empty_list(issuer)
        self.refused: Counter[Reason] = Counter()
        self.cache_hits = 0
        self.verified = 0
        self._cache: OrderedDict[bytes, KeyClaims] = OrderedDict()

    def use_revocations(self, revocations: RevocationList) -> bool:
        """Check keys against ``revocations`` from now on, if it is newer; returns whether it was taken.
        The caller verified it (RevocationStore.offer)."""
        if not newer(revocations, self.revocations):
            return False
        self.revocations = revocations
        return True

    def use_keys(self, keys: KeySet) -> None:
        """Replace the issuer's keys (a rotation); cached keys are verified again."""
        self.keys = keys
        self._cache.clear()

    def verify(self, token: str) -> KeyClaims:
        """The claims of ``token``; raises InvalidApiKey (counted in ``refused``) and nothing else."""
        try:
            return self._verify(token)
        except InvalidApiKey as exc:
            self.refused[exc.reason] += 1
            raise

    def _still_valid(self, claims: KeyClaims) -> None:
        check_times(claims, self.clock(), self.leeway_s)
        if claims.jti in self.revocations.revoked:
            raise InvalidApiKey(Reason.REVOKED, f"key {claims.jti} is revoked (list version {self.revocations.ver})")

    def _verify(self, token: str) -> KeyClaims:
        digest = hashlib.sha256(token.encode("utf-8", "surrogatepass")).digest() if isinstance(token, str) else b""
        cached = self._cache.get(digest)
        if cached is not None:
            self._cache.move_to_end(digest)
            self._still_valid(cached)
            self.cache_hits += 1
            return cached
        _, payload = verify_signed(token, self.keys, issuer=self.issuer, audiences=self.audiences,
                                   required=REQUIRED_CLAIMS)
        claims = claims_from_payload(payload)
        self._still_valid(claims)
        self.verified += 1
        if self.cache_size:
            self._cache[digest] = claims
            if len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)
        return claims
