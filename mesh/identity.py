"""A node's identity: an Ed25519 key pair kept in the state dir, and the node id derived from it.

Files (docs/mesh.md):

- ``<state_dir>/node.key``: the private key, PKCS#8 PEM, mode 0600. Created at first start
  (atomically: written to a temporary file, fsynced, renamed). The state dir is created
  with mode 0700 when missing.

A key file that the group or others may read is refused with :class:`KeyPermissionError`
(the fix is in the message): an agent that keeps running on a leaked key would let anyone
on the box impersonate the node.

The **node id** is ``base32(sha256(raw public key)[:10])``, lowercase without padding: 16
characters from ``a-z2-7`` (80 bits). It names the key, not the host, so a node keeps its id
across renames and a wiped state dir makes a new node. 80 bits keep the id short enough for
tables while a second preimage (a forged key with someone else's id) stays out of reach
(2^80 work); receivers never trust an id alone anyway: every id is recomputed from the
public key in a certificate.
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import logging
import os
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import NewType

from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

log = logging.getLogger(__name__)

NodeId = NewType("NodeId", str)

KEY_FILE = "node.key"
NODE_ID_BYTES = 10
NODE_ID_CHARS = 16
_NODE_ID_ALPHABET = frozenset("abcdefghijklmnopqrstuvwxyz234567")


class IdentityError(Exception):
    """The node's identity cannot be loaded or created (the message says why and the fix)."""


class KeyPermissionError(IdentityError):
    """The key file (or the state dir) is readable by the group or others."""


def node_id_from_public_key(public_key: Ed25519PublicKey) -> NodeId:
    """The node id of an Ed25519 public key: 16 lowercase base32 characters (see module doc)."""
    raw = public_key.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    digest = hashlib.sha256(raw).digest()[:NODE_ID_BYTES]
    return NodeId(base64.b32encode(digest).decode("ascii").lower().rstrip("="))


def is_node_id(value: object) -> bool:
    """True when ``value`` has the shape of a node id (16 characters of a-z, 2-7)."""
    return isinstance(value, str) and len(value) == NODE_ID_CHARS and set(value) <= _NODE_ID_ALPHABET


@dataclass(frozen=True)
class NodeIdentity:
    """This node's key pair and id. ``key_path`` is where the private key lives."""

    private_key: Ed25519PrivateKey
    node_id: NodeId
    key_path: Path

    @property
    def public_key(self) -> Ed25519PublicKey:
        return self.private_key.public_key()

    def sign(self, data: bytes) -> bytes:
        """Ed25519 signature (64 bytes) of ``data``."""
        return self.private_key.sign(data)


def ensure_state_dir(state_dir: Path) -> Path:
    """Create ``state_dir`` with mode 0700 if missing; return it. Existing dirs are not chmodded
    (the operator's choice stands), but a group/world-writable one is refused."""
    state_dir = Path(state_dir)
    if not state_dir.exists():
        state_dir.mkdir(mode=0o700, parents=True)
        os.chmod(state_dir, 0o700)  # mkdir's mode is filtered by the umask
    st = state_dir.stat()
    if not stat.S_ISDIR(st.st_mode):
        raise IdentityError(f"state dir {state_dir} is not a directory")
    if st.st_mode & 0o022:
        raise KeyPermissionError(
            f"state dir {state_dir} is writable by group or others (mode {stat.S_IMODE(st.st_mode):04o}); "
            f"fix with: chmod 700 {state_dir}"
        )
    return state_dir


def write_private_file(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` atomically with mode 0600 (temp file, fsync, rename)."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with contextlib.suppress(FileNotFoundError):
        tmp.unlink()  # left by an earlier failed write of this process (O_EXCL below)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        try:
            os.fchmod(fd, 0o600)
            view = memoryview(data)
            while view:  # os.write may write less than asked
                view = view[os.write(fd, view):]
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except BaseException:
        # A full disk fails the write: leave no partial temp file behind (the old file stays).
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise


def check_private_file(path: Path) -> None:
    """Raise :class:`KeyPermissionError` when ``path`` is readable/writable by group or others."""
    mode = stat.S_IMODE(path.stat().st_mode)
    if mode & 0o077:
        raise KeyPermissionError(
            f"{path} is readable by group or others (mode {mode:04o}); a leaked node key lets anyone "
            f"impersonate this node. Fix with: chmod 600 {path} (and rotate the key if others may have read it)"
        )


def load_private_key(path: Path) -> Ed25519PrivateKey:
    """Load an unencrypted PKCS#8 PEM Ed25519 private key after the permission check."""
    check_private_file(path)
    try:
        key = serialization.load_pem_private_key(path.read_bytes(), password=None)
    except (ValueError, TypeError) as exc:
        raise IdentityError(f"{path} is not an unencrypted PEM private key: {exc}") from None
    if not isinstance(key, Ed25519PrivateKey):
        raise IdentityError(f"{path} holds a {type(key).__name__}, not an Ed25519 key")
    return key


def private_key_pem(key: Ed25519PrivateKey) -> bytes:
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())


def load_or_create_identity(state_dir: Path, key_path: Path | None = None) -> NodeIdentity:
    """Load the node key from ``key_path`` (default ``<state_dir>/node.key``), creating the
    state dir (0700) and a new key (0600) at first start.

    Raises :class:`KeyPermissionError` for a group/world-readable key or a group/world-writable
    state dir, :class:`IdentityError` for an unreadable or non-Ed25519 key.
    """
    state_dir = ensure_state_dir(Path(state_dir))
    path = Path(key_path) if key_path is not None else state_dir / KEY_FILE
    if path.exists():
        key = load_private_key(path)
    else:
        key = Ed25519PrivateKey.generate()
        write_private_file(path, private_key_pem(key))
        log.info("created node key %s", path)
    node_id = node_id_from_public_key(key.public_key())
    return NodeIdentity(private_key=key, node_id=node_id, key_path=path)
