"""Client keys refused for every reason issue 17 lists, each counted; the cache re-checks expiry
and revocation on a hit; header parsing and arbitrary token strings fuzzed (only InvalidApiKey).

Bad tokens are made with PyJWT and cryptography the way an attacker would: ``alg: none``, an
RS256 token under the same kid, an HS256 token keyed with the issuer's public key bytes (the
key-confusion attack), another issuer's key, a payload swapped under a valid signature.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import jwt
import pytest
from cryptography.hazmat.primitives.asymmetric import rsa
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from freezegun import freeze_time
from hypothesis import given, settings
from hypothesis import strategies as st

from viiwork.agent.auth.claims import KeyClaims, Priority, Scope
from viiwork.agent.auth.errors import InvalidApiKey, Reason
from viiwork.agent.auth.headers import MAX_HEADER_BYTES, token_from_headers
from viiwork.agent.auth.issuing import Issuer, sign_key, sign_revocations
from viiwork.agent.auth.jws import MAX_TOKEN_BYTES
from viiwork.agent.auth.keyset import KeySet, key_id, public_pem
from viiwork.agent.auth.revocations import RevocationList
from viiwork.agent.auth.verifier import Verifier

ISSUER = "test-issuer"
MESH = "mesh-a"
NOW = 1_800_000_000


def at(epoch_s: int) -> datetime:
    return datetime.fromtimestamp(epoch_s, UTC)


def make_issuer(name: str = ISSUER) -> Issuer:
    key = Ed25519PrivateKey.generate()
    return Issuer(key=key, name=name, kid=key_id(key.public_key()), directory=Path("."))


@pytest.fixture(scope="module")
def issuer() -> Issuer:
    return make_issuer()


def claims(**changes: Any) -> KeyClaims:
    base: dict[str, Any] = dict(iss=ISSUER, aud=(MESH,), jti="k1", exp=NOW + 3600, tenant="acme", iat=NOW)
    base.update(changes)
    return KeyClaims(**base)


def verifier(issuer: Issuer, **kwargs: Any) -> Verifier:
    return Verifier(KeySet.of([issuer.key.public_key()]), issuer=ISSUER, audiences=[MESH, "node-1"], **kwargs)


def b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def refused(v: Verifier, token: str) -> Reason:
    before = v.refused.copy()
    with pytest.raises(InvalidApiKey) as caught:
        v.verify(token)
    assert v.refused[caught.value.reason] == before[caught.value.reason] + 1  # counted
    assert token not in str(caught.value)  # the error never carries the token
    return caught.value.reason


@freeze_time(at(NOW))
def test_a_good_key_gives_its_claims(issuer: Issuer) -> None:
    v = verifier(issuer)
    token = sign_key(issuer, claims(models=("m1", "m2"), rpm=30, tpm=1000, concurrency=2, priority=Priority.HIGH,
                                    scope=frozenset({Scope.INFERENCE, Scope.READ})))
    got = v.verify(token)
    assert (got.tenant, got.jti, got.models, got.rpm, got.tpm, got.concurrency) == ("acme", "k1", ("m1", "m2"), 30,
                                                                                    1000, 2)
    assert got.priority is Priority.HIGH and got.scope == {Scope.INFERENCE, Scope.READ}
    assert v.verify(sign_key(issuer, claims(aud=("node-1",)))).scope == {Scope.INFERENCE}  # a node name as aud
    assert v.verified == 2 and not v.refused


def _rs256(issuer: Issuer) -> str:
    rsa_key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    return jwt.encode(claims().to_payload(), rsa_key, algorithm="RS256", headers={"kid": issuer.kid})


def _hs256_with_public_key(issuer: Issuer) -> str:
    # PyJWT itself refuses a PEM as an HMAC secret, so the MAC is made by hand, as an attacker would.
    header = b64(json.dumps({"alg": "HS256", "typ": "JWT", "kid": issuer.kid}).encode())
    body = b64(json.dumps(claims().to_payload()).encode())
    mac = hmac.new(public_pem(issuer.key.public_key()), f"{header}.{body}".encode(), hashlib.sha256).digest()
    return f"{header}.{body}.{b64(mac)}"


def _alg_none(issuer: Issuer) -> str:
    return jwt.encode(claims().to_payload(), None, algorithm="none", headers={"kid": issuer.kid})


def _other_issuer_same_kid(issuer: Issuer) -> str:
    other = make_issuer()
    return jwt.encode(claims().to_payload(), other.key, algorithm="EdDSA", headers={"kid": issuer.kid})


def _tampered(issuer: Issuer) -> str:
    header, _, signature = sign_key(issuer, claims()).split(".")
    body = b64(json.dumps(claims(tenant="someone-else", rpm=10**9).to_payload()).encode())
    return f"{header}.{body}.{signature}"


def _payload_not_json(issuer: Issuer) -> str:
    header = b64(json.dumps({"alg": "EdDSA", "kid": issuer.kid}).encode())
    body = b64(b"[1, 2")
    sig = issuer.key.sign(f"{header}.{body}".encode())
    return f"{header}.{body}.{b64(sig)}"


BAD: list[tuple[str, Callable[[Issuer], str], Reason]] = [
    ("alg_none", _alg_none, Reason.BAD_ALG),
    ("rs256", _rs256, Reason.BAD_ALG),
    ("hs256_public_key_as_secret", _hs256_with_public_key, Reason.BAD_ALG),
    ("another_issuers_key", lambda i: sign_key(make_issuer(), claims()), Reason.UNKNOWN_KID),
    ("another_key_under_our_kid", _other_issuer_same_kid, Reason.BAD_SIGNATURE),
    ("tampered_claims", _tampered, Reason.BAD_SIGNATURE),
    ("no_kid", lambda i: jwt.encode(claims().to_payload(), i.key, algorithm="EdDSA"), Reason.UNKNOWN_KID),
    ("wrong_iss", lambda i: sign_key(i, claims(iss="someone")), Reason.WRONG_ISSUER),
    ("wrong_aud", lambda i: sign_key(i, claims(aud=("mesh-b",))), Reason.WRONG_AUDIENCE),
    ("not_a_jws", lambda i: "not-a-token", Reason.MALFORMED),
    ("payload_not_json", _payload_not_json, Reason.MALFORMED),
    ("tenant_with_space", lambda i: sign_key(i, claims(tenant="a b")), Reason.BAD_CLAIMS),
    ("rpm_zero", lambda i: sign_key(i, claims(rpm=0)), Reason.BAD_CLAIMS),
    ("rpm_too_big", lambda i: sign_key(i, claims(rpm=10**9 + 1)), Reason.BAD_CLAIMS),
    ("too_many_models", lambda i: sign_key(i, claims(models=tuple(f"m{n}" for n in range(65)))), Reason.BAD_CLAIMS),
    ("no_tenant", lambda i: jwt.encode({k: v for k, v in claims().to_payload().items() if k != "tenant"}, i.key,
                                       algorithm="EdDSA", headers={"kid": i.kid}), Reason.BAD_CLAIMS),
    ("no_exp", lambda i: jwt.encode({k: v for k, v in claims().to_payload().items() if k != "exp"}, i.key,
                                    algorithm="EdDSA", headers={"kid": i.kid}), Reason.BAD_CLAIMS),
    ("exp_a_string", lambda i: jwt.encode(claims().to_payload() | {"exp": "soon"}, i.key, algorithm="EdDSA",
                                          headers={"kid": i.kid}), Reason.BAD_CLAIMS),
    ("bad_priority", lambda i: jwt.encode(claims().to_payload() | {"priority": "urgent"}, i.key, algorithm="EdDSA",
                                          headers={"kid": i.kid}), Reason.BAD_CLAIMS),
    ("bad_scope", lambda i: jwt.encode(claims().to_payload() | {"scope": "admin"}, i.key, algorithm="EdDSA",
                                       headers={"kid": i.kid}), Reason.BAD_CLAIMS),
]


@pytest.mark.parametrize(("make", "reason"), [(m, r) for _, m, r in BAD], ids=[n for n, _, _ in BAD])
@freeze_time(at(NOW))
def test_bad_keys_are_refused_with_their_reason(issuer: Issuer, make: Callable[[Issuer], str], reason: Reason) -> None:
    assert refused(verifier(issuer), make(issuer)) is reason


@pytest.mark.parametrize(("offset_s", "leeway_s", "reason"), [
    (3600 + 30, 60, None),  # expired 30 s ago: within the default leeway
    (3600 + 61, 60, Reason.EXPIRED),
    (3600 + 1, 0, Reason.EXPIRED),
    (3600, 0, None),
], ids=["within_leeway", "beyond_leeway", "no_leeway", "at_exp"])
def test_expiry_with_and_without_leeway(issuer: Issuer, offset_s: int, leeway_s: int, reason: Reason | None) -> None:
    token = sign_key(issuer, claims())
    v = verifier(issuer, leeway_s=leeway_s)
    with freeze_time(at(NOW + offset_s)):
        if reason is None:
            assert v.verify(token).jti == "k1"
        else:
            assert refused(v, token) is reason


@pytest.mark.parametrize(("offset_s", "reason"), [(-61, Reason.NOT_YET_VALID), (-59, None), (0, None)],
                         ids=["before_leeway", "within_leeway", "at_nbf"])
def test_not_before(issuer: Issuer, offset_s: int, reason: Reason | None) -> None:
    token = sign_key(issuer, claims(nbf=NOW))
    v = verifier(issuer)
    with freeze_time(at(NOW + offset_s)):
        if reason is None:
            assert v.verify(token).nbf == NOW
        else:
            assert refused(v, token) is reason


def _revocations(issuer: Issuer, ver: int, *jtis: str) -> RevocationList:
    return RevocationList(iss=ISSUER, aud=(MESH,), ver=ver, revoked=frozenset(jtis), iat=NOW)


def test_revoked_key_is_refused(issuer: Issuer) -> None:
    v = verifier(issuer, clock=lambda: NOW)
    assert v.use_revocations(_revocations(issuer, 1, "k1"))
    assert refused(v, sign_key(issuer, claims())) is Reason.REVOKED
    assert v.verify(sign_key(issuer, claims(jti="k2"))).jti == "k2"


def test_cache_hit_after_revocation_is_refused(issuer: Issuer) -> None:
    v = verifier(issuer, clock=lambda: NOW)
    token = sign_key(issuer, claims())
    v.verify(token)
    v.verify(token)
    assert (v.verified, v.cache_hits) == (1, 1)
    v.use_revocations(_revocations(issuer, 1, "k1"))
    assert refused(v, token) is Reason.REVOKED


def test_cache_hit_after_expiry_is_refused(issuer: Issuer) -> None:
    now = [float(NOW)]
    v = verifier(issuer, clock=lambda: now[0])
    token = sign_key(issuer, claims())
    v.verify(token)
    now[0] = NOW + 3600 + 61
    assert refused(v, token) is Reason.EXPIRED


def test_older_revocation_list_does_not_replace_a_newer_one(issuer: Issuer) -> None:
    v = verifier(issuer, clock=lambda: NOW)
    assert v.use_revocations(_revocations(issuer, 2, "k1"))
    assert not v.use_revocations(_revocations(issuer, 1))
    assert refused(v, sign_key(issuer, claims())) is Reason.REVOKED


def test_cache_is_bounded_and_keyed_by_digest(issuer: Issuer) -> None:
    v = verifier(issuer, clock=lambda: NOW, cache_size=2)
    tokens = [sign_key(issuer, claims(jti=f"k{n}")) for n in range(3)]
    for token in tokens:
        v.verify(token)
    assert len(v._cache) == 2 and not any(t.encode() in v._cache for t in tokens)
    v.verify(tokens[0])  # evicted: a full check again
    assert (v.verified, v.cache_hits) == (4, 0)


def test_key_rotation_two_issuer_keys(issuer: Issuer) -> None:
    new = make_issuer()
    v = Verifier(KeySet.of([issuer.key.public_key(), new.key.public_key()]), issuer=ISSUER, audiences=[MESH],
                 clock=lambda: NOW)
    assert v.verify(sign_key(issuer, claims())).jti == v.verify(sign_key(new, claims())).jti == "k1"


def test_a_revocation_list_is_not_a_key(issuer: Issuer) -> None:
    # Same signer and audience, but no tenant/jti/exp: it must not pass as a client key.
    token = sign_revocations(issuer, _revocations(issuer, 1, "k1"))
    assert refused(verifier(issuer, clock=lambda: NOW), token) is Reason.BAD_CLAIMS


# Header parsing ---------------------------------------------------------------------------------

GOOD = "aaa.bbb.ccc"


@pytest.mark.parametrize(("authorization", "x_api_key", "expected"), [
    ("Bearer aaa.bbb.ccc", None, GOOD),
    ("bearer   aaa.bbb.ccc ", None, GOOD),
    (None, "aaa.bbb.ccc", GOOD),
    ("Bearer aaa.bbb.ccc", "aaa.bbb.ccc", GOOD),
    (None, None, Reason.MISSING),
    ("", "  ", Reason.MISSING),
    ("Basic dXNlcjpwYXNz", None, Reason.MALFORMED),
    ("Bearer", None, Reason.MALFORMED),
    ("Bearer aaa.bbb", None, Reason.MALFORMED),
    ("Bearer aaa.bbb.ccc", "aaa.bbb.ddd", Reason.MALFORMED),
    (None, "sk-1234", Reason.MALFORMED),
    ("Bearer " + "a" * MAX_HEADER_BYTES + ".b.c", None, Reason.MALFORMED),
], ids=["bearer", "bearer_case_and_spaces", "x_api_key", "both_same", "none", "empty", "basic", "bearer_alone",
        "two_parts", "both_differ", "openai_style_key", "too_long"])
def test_header_parsing(authorization: str | None, x_api_key: str | None, expected: str | Reason) -> None:
    if isinstance(expected, Reason):
        with pytest.raises(InvalidApiKey) as caught:
            token_from_headers(authorization, x_api_key)
        assert caught.value.reason is expected
    else:
        assert token_from_headers(authorization, x_api_key) == expected


header_values = st.one_of(st.none(), st.text(max_size=200),
                          st.builds(lambda s: "Bearer " + s, st.text(alphabet="abcAZ09-_. \t", max_size=60)))


@settings(max_examples=400, deadline=None)
@given(header_values, header_values)
def test_header_parsing_fuzz(authorization: str | None, x_api_key: str | None) -> None:
    try:
        token = token_from_headers(authorization, x_api_key)
    except InvalidApiKey as exc:
        assert exc.reason in (Reason.MISSING, Reason.MALFORMED)
    else:
        assert token.count(".") == 2 and token in (authorization or "") + (x_api_key or "")


def _jws_like() -> st.SearchStrategy[str]:
    part = st.text(alphabet="ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_", max_size=80)
    json_part = st.builds(lambda d: b64(json.dumps(d).encode()),
                          st.dictionaries(st.sampled_from(["alg", "kid", "typ", "crit", "iss", "aud", "exp"]),
                                          st.one_of(st.none(), st.integers(), st.text(max_size=8),
                                                    st.sampled_from(["EdDSA", "none", "HS256"]),
                                                    st.lists(st.text(max_size=4), max_size=3)), max_size=5))
    return st.one_of(st.text(max_size=300), st.builds(lambda a, b, c: f"{a}.{b}.{c}", part, part, part),
                     st.builds(lambda a, b, c: f"{a}.{b}.{c}", json_part, json_part, part))


@settings(max_examples=400, deadline=None)
@given(_jws_like())
def test_arbitrary_token_strings_raise_only_invalid_api_key(token: str) -> None:
    v = Verifier(KeySet.of([_FUZZ_ISSUER.key.public_key()]), issuer=ISSUER, audiences=[MESH], clock=lambda: NOW)
    with pytest.raises(InvalidApiKey):
        v.verify(token)


json_values = st.recursive(st.one_of(st.none(), st.booleans(), st.integers(min_value=-2**70, max_value=2**70),
                                      st.floats(allow_nan=False), st.text(max_size=70)),
                           lambda inner: st.one_of(st.lists(inner, max_size=70), st.dictionaries(st.text(max_size=4),
                                                                                                 inner, max_size=3)),
                           max_leaves=80)
CLAIM_NAMES = ["iss", "aud", "jti", "exp", "tenant", "nbf", "iat", "models", "rpm", "tpm", "concurrency", "priority",
               "scope"]


@settings(max_examples=300, deadline=None)
@given(st.dictionaries(st.sampled_from(CLAIM_NAMES), json_values, max_size=13))
def test_signed_arbitrary_claims_give_claims_or_bad_claims(changes: dict[str, Any]) -> None:
    # A valid signature over junk claims: the claim checks, not the signature, must stop it.
    payload = claims().to_payload() | changes
    # PyJWS, not PyJWT's encode, which itself refuses some of these claims.
    token = jwt.PyJWS().encode(json.dumps(payload).encode(), _FUZZ_ISSUER.key, algorithm="EdDSA",
                               headers={"kid": _FUZZ_ISSUER.kid})
    v = Verifier(KeySet.of([_FUZZ_ISSUER.key.public_key()]), issuer=ISSUER, audiences=[MESH], clock=lambda: NOW)
    try:
        got = v.verify(token)
    except InvalidApiKey as exc:
        if len(token) > MAX_TOKEN_BYTES:  # junk claims can make the token too long: refused unread
            assert exc.reason is Reason.MALFORMED
        else:
            assert exc.reason in (Reason.BAD_CLAIMS, Reason.WRONG_ISSUER, Reason.WRONG_AUDIENCE, Reason.EXPIRED,
                                  Reason.NOT_YET_VALID)
    else:
        assert got.iss == ISSUER and MESH in got.aud and got.exp >= NOW - 60


_FUZZ_ISSUER = make_issuer()
