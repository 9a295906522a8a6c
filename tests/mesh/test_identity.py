"""Node identity: key file creation and permissions, node id derivation, boot generations."""

from __future__ import annotations

import base64
import hashlib
import os
import stat

import pytest
from cryptography.hazmat.primitives import serialization

from viiwork.mesh.boot import next_boot, read_generation, store_generation
from viiwork.mesh.identity import (
    IdentityError,
    KeyPermissionError,
    is_node_id,
    load_or_create_identity,
    node_id_from_public_key,
)


def test_first_start_creates_key_0600_in_dir_0700(tmp_path):
    state = tmp_path / "state"
    ident = load_or_create_identity(state)
    assert stat.S_IMODE(state.stat().st_mode) == 0o700
    assert stat.S_IMODE((state / "node.key").stat().st_mode) == 0o600
    assert ident.key_path == state / "node.key"
    assert is_node_id(ident.node_id)


def test_second_start_loads_the_same_identity(tmp_path):
    first = load_or_create_identity(tmp_path / "s")
    second = load_or_create_identity(tmp_path / "s")
    assert first.node_id == second.node_id


def test_node_id_is_base32_of_sha256_prefix_of_raw_public_key(tmp_path):
    ident = load_or_create_identity(tmp_path / "s")
    raw = ident.public_key.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    expected = base64.b32encode(hashlib.sha256(raw).digest()[:10]).decode().lower()
    assert ident.node_id == expected == node_id_from_public_key(ident.public_key)
    assert len(ident.node_id) == 16


@pytest.mark.parametrize("mode", [0o640, 0o604, 0o644, 0o660])
def test_group_or_world_readable_key_is_refused_with_the_fix(tmp_path, mode):
    state = tmp_path / "s"
    load_or_create_identity(state)
    os.chmod(state / "node.key", mode)
    with pytest.raises(KeyPermissionError) as err:
        load_or_create_identity(state)
    assert f"chmod 600 {state / 'node.key'}" in str(err.value)


def test_group_writable_state_dir_is_refused(tmp_path):
    state = tmp_path / "s"
    state.mkdir()
    os.chmod(state, 0o775)
    with pytest.raises(KeyPermissionError, match="chmod 700"):
        load_or_create_identity(state)


def test_garbage_key_file_is_a_clear_error(tmp_path):
    state = tmp_path / "s"
    state.mkdir(mode=0o700)
    (state / "node.key").write_bytes(b"not a key")
    os.chmod(state / "node.key", 0o600)
    with pytest.raises(IdentityError, match="not an unencrypted PEM private key"):
        load_or_create_identity(state)


def test_non_ed25519_key_is_refused(tmp_path):
    from cryptography.hazmat.primitives.asymmetric import ec

    state = tmp_path / "s"
    state.mkdir(mode=0o700)
    key = ec.generate_private_key(ec.SECP256R1())
    pem = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    (state / "node.key").write_bytes(pem)
    os.chmod(state / "node.key", 0o600)
    with pytest.raises(IdentityError, match="not an Ed25519 key"):
        load_or_create_identity(state)


def test_signatures_verify_with_the_public_key(tmp_path):
    ident = load_or_create_identity(tmp_path / "s")
    sig = ident.sign(b"hello")
    ident.public_key.verify(sig, b"hello")  # raises if invalid


def test_boot_generation_increases_every_start_and_is_stored_0600(tmp_path):
    state = tmp_path / "s"
    assert [next_boot(state).generation for _ in range(3)] == [1, 2, 3]
    assert read_generation(state) == 3
    assert stat.S_IMODE((state / "boot.json").stat().st_mode) == 0o600
    a, b = next_boot(state), next_boot(state)
    assert a.nonce != b.nonce and len(a.nonce) == 16


def test_unreadable_boot_file_restarts_at_one(tmp_path):
    state = tmp_path / "s"
    next_boot(state)
    (state / "boot.json").write_text("{broken")
    assert next_boot(state).generation == 1
    store_generation(state, 41)
    assert next_boot(state).generation == 42
