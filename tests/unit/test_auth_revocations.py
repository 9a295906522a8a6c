"""The signed revocation list: newest version wins, forged and older lists are refused and
counted, the highest version is persisted (temp file + rename) and a restart never un-revokes."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import jwt
import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from viiwork.agent.auth.errors import RevocationReason, RevocationRefused
from viiwork.agent.auth.issuing import Issuer, sign_revocations
from viiwork.agent.auth.keyset import KeySet, key_id
from viiwork.agent.auth.revocations import (
    MAX_LIST_BYTES,
    RevocationList,
    RevocationStateError,
    RevocationStore,
    newer,
)

ISSUER = "test-issuer"
MESH = "mesh-a"


def make_issuer() -> Issuer:
    key = Ed25519PrivateKey.generate()
    return Issuer(key=key, name=ISSUER, kid=key_id(key.public_key()), directory=Path("."))


@pytest.fixture(scope="module")
def issuer() -> Issuer:
    return make_issuer()


def signed(issuer: Issuer, ver: int, *jtis: str, aud: str = MESH) -> str:
    return sign_revocations(issuer, RevocationList(iss=ISSUER, aud=(aud,), ver=ver, revoked=frozenset(jtis), iat=1))


def store(issuer: Issuer, state_dir: Path) -> RevocationStore:
    return RevocationStore(state_dir, KeySet.of([issuer.key.public_key()]), issuer=ISSUER, audiences=[MESH])


def test_newer() -> None:
    a = RevocationList(iss=ISSUER, aud=(MESH,), ver=2, revoked=frozenset(), iat=0)
    b = RevocationList(iss=ISSUER, aud=(MESH,), ver=1, revoked=frozenset({"k1"}), iat=5)
    assert newer(a, b) and not newer(b, a) and not newer(a, a)


def test_newest_wins_and_survives_a_restart(issuer: Issuer, tmp_path: Path) -> None:
    s = store(issuer, tmp_path)
    assert s.current.ver == 0 and not s.current.revoked
    assert s.offer(signed(issuer, 1, "k1")).ver == 1
    assert s.offer(signed(issuer, 3, "k1", "k2")).revoked == {"k1", "k2"}
    restarted = store(issuer, tmp_path)
    assert (restarted.current.ver, restarted.current.revoked) == (3, {"k1", "k2"})
    assert restarted.current.token == signed_token_of(tmp_path)
    assert not list(tmp_path.glob("*.tmp"))


def signed_token_of(state_dir: Path) -> str:
    return json.loads((state_dir / "revocations.json").read_text())["token"]


def test_older_or_same_version_is_refused_and_counted(issuer: Issuer, tmp_path: Path) -> None:
    s = store(issuer, tmp_path)
    s.offer(signed(issuer, 2, "k1", "k2"))
    for ver in (1, 2):
        with pytest.raises(RevocationRefused) as caught:
            s.offer(signed(issuer, ver))  # would un-revoke k1 and k2
        assert caught.value.reason is RevocationReason.STALE
    assert s.refused[RevocationReason.STALE] == 2
    assert store(issuer, tmp_path).current.revoked == {"k1", "k2"}


def _forged_other_key(issuer: Issuer) -> str:
    return signed(make_issuer(), 9, "k1")


def _forged_same_kid(issuer: Issuer) -> str:
    other = make_issuer()
    payload = {"iss": ISSUER, "aud": MESH, "ver": 9, "revoked": [], "iat": 1}
    return jwt.encode(payload, other.key, algorithm="EdDSA", headers={"kid": issuer.kid})


def _alg_none(issuer: Issuer) -> str:
    payload = {"iss": ISSUER, "aud": MESH, "ver": 9, "revoked": [], "iat": 1}
    return jwt.encode(payload, None, algorithm="none", headers={"kid": issuer.kid})


@pytest.mark.parametrize(("make", "reason"), [
    (_forged_other_key, RevocationReason.UNKNOWN_KID),
    (_forged_same_kid, RevocationReason.BAD_SIGNATURE),
    (_alg_none, RevocationReason.BAD_ALG),
    (lambda i: signed(i, 9, aud="mesh-b"), RevocationReason.WRONG_AUDIENCE),
    (lambda i: signed(i, 9, "not a key id"), RevocationReason.BAD_CLAIMS),
    (lambda i: "x.y", RevocationReason.MALFORMED),
], ids=["other_issuer", "forged_under_our_kid", "alg_none", "wrong_audience", "bad_id", "malformed"])
def test_forged_lists_are_refused_and_counted(issuer: Issuer, tmp_path: Path, make: Callable[[Issuer], str],
                                           reason: RevocationReason) -> None:
    s = store(issuer, tmp_path)
    s.offer(signed(issuer, 1, "k1"))
    with pytest.raises(RevocationRefused) as caught:
        s.offer(make(issuer))
    assert caught.value.reason is reason and s.refused[reason] == 1
    assert s.current.ver == 1


def test_a_damaged_state_file_stops_the_node_rather_than_un_revoking(issuer: Issuer, tmp_path: Path) -> None:
    (tmp_path / "revocations.json").write_text("{not json")
    with pytest.raises(RevocationStateError, match="revocations.json"):
        store(issuer, tmp_path)


def test_state_survives_a_rotated_issuer_key(issuer: Issuer, tmp_path: Path) -> None:
    store(issuer, tmp_path).offer(signed(issuer, 4, "k1"))
    rotated = RevocationStore(tmp_path, KeySet.of([make_issuer().key.public_key()]), issuer=ISSUER, audiences=[MESH])
    assert rotated.current.revoked == {"k1"}


def test_a_list_longer_than_a_key_is_taken_up_to_its_own_cap(issuer: Issuer, tmp_path: Path) -> None:
    """A key is at most 8 KiB; a list of 20,000 revoked ids (about 640 KB signed) is taken, and one
    over MAX_LIST_BYTES is refused as malformed before it is decoded."""
    s = store(issuer, tmp_path)
    many = [f"k{i:020x}" for i in range(20_000)]
    token = signed(issuer, 1, *many)
    assert 8 * 1024 < len(token) <= MAX_LIST_BYTES
    assert len(s.offer(token).revoked) == 20_000
    with pytest.raises(RevocationRefused) as caught:
        s.offer(token + "A" * (MAX_LIST_BYTES - len(token) + 1))
    assert caught.value.reason is RevocationReason.MALFORMED
