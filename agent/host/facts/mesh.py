"""The ``[mesh]`` section's facts: CA and node certificates, the node key, discovery interfaces."""

from __future__ import annotations

import datetime as dt
import ipaddress
import os
import socket
import stat
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from viiwork.agent.config.schema import Config


@dataclass(frozen=True, slots=True)
class CertFact:
    """A certificate file: ``error`` when it cannot be read or does not verify; ``not_after`` UTC."""

    role: str
    path: str
    exists: bool
    error: str | None = None
    subject: str | None = None
    not_after: dt.datetime | None = None


@dataclass(frozen=True, slots=True)
class KeyFact:
    """The node key file: ``mode`` (permission bits) and whether it matches the certificate."""

    path: str
    exists: bool
    mode: int | None = None
    matches_certificate: bool | None = None
    error: str | None = None


@dataclass(frozen=True, slots=True)
class InterfaceFact:
    """A network interface as configured (``entry``: a name or an address) and as found.

    up/multicast/loopback: from the kernel's interface flags; None when not known (an
    address that is local but whose interface could not be named).
    """

    entry: str
    name: str | None
    exists: bool
    up: bool | None = None
    multicast: bool | None = None
    loopback: bool | None = None


@dataclass(frozen=True, slots=True)
class MeshFacts:
    """The ``[mesh]`` section's trust files and discovery interfaces.

    interfaces: the configured ``mesh.interfaces`` (empty: all). all_interfaces: every
    interface of the host (what "all" means).
    """

    trust: str
    discovery: tuple[str, ...]
    seeds: tuple[str, ...]
    interfaces: tuple[InterfaceFact, ...]
    all_interfaces: tuple[InterfaceFact, ...]
    ca: CertFact | None = None
    node_certificate: CertFact | None = None
    node_key: KeyFact | None = None


IFF_UP, IFF_LOOPBACK, IFF_MULTICAST = 0x1, 0x8, 0x1000


def read_interface(name: str, net_root: Path) -> InterfaceFact:
    """Interface ``name`` from ``net_root/NAME/flags`` and ``operstate``; missing: ``exists=False``."""
    base = net_root / name
    try:
        flags = int((base / "flags").read_text().strip(), 16)
    except (OSError, ValueError):
        return InterfaceFact(name, name, False)
    try:
        operstate = (base / "operstate").read_text().strip()
    except OSError:
        operstate = "unknown"
    up = bool(flags & IFF_UP) and operstate in ("up", "unknown")
    return InterfaceFact(name, name, True, up, bool(flags & IFF_MULTICAST), bool(flags & IFF_LOOPBACK))


def _interface_of_address(address: str, net_root: Path) -> InterfaceFact:
    """An address entry: the interface holding it (IPv6 from /proc/net/if_inet6; IPv4 by a
    bind test, which proves it is local but not which interface holds it)."""
    ip = ipaddress.ip_address(address)
    if ip.version == 6:
        try:
            for line in Path("/proc/net/if_inet6").read_text().splitlines():
                parts = line.split()
                if len(parts) >= 6 and ipaddress.ip_address(int(parts[0], 16)) == ip:
                    fact = read_interface(parts[5], net_root)
                    return InterfaceFact(address, fact.name, fact.exists, fact.up, fact.multicast, fact.loopback)
        except OSError:
            pass
    family = socket.AF_INET6 if ip.version == 6 else socket.AF_INET
    with socket.socket(family, socket.SOCK_DGRAM) as sock:
        try:
            sock.bind((address, 0))
        except OSError:
            return InterfaceFact(address, None, False)
    return InterfaceFact(address, None, True, True, None, ip.is_loopback)


def read_interfaces(entries: Sequence[str], net_root: str | Path = "/sys/class/net") -> tuple[
        tuple[InterfaceFact, ...], tuple[InterfaceFact, ...]]:
    """(the configured entries, every interface of the host)."""
    root = Path(net_root)
    try:
        names = sorted(os.listdir(root))
    except OSError:
        names = []
    all_ifaces = tuple(read_interface(n, root) for n in names)
    chosen = []
    for entry in entries:
        try:
            ipaddress.ip_address(entry)
        except ValueError:
            chosen.append(read_interface(entry, root))
        else:
            chosen.append(_interface_of_address(entry, root))
    return tuple(chosen), all_ifaces


def read_node_id(config: Config) -> str | None:
    """This node's id from its key file (``mesh.node_key``, else ``<state_dir>/node.key``), or
    None when there is no mesh or the key cannot be read (not created yet, or not readable by
    the user running the doctor)."""
    if config.mesh is None:
        return None
    from viiwork.mesh import identity

    path = Path(config.mesh.node_key) if config.mesh.node_key else Path(config.node.state_dir) / identity.KEY_FILE
    try:
        return identity.node_id_from_public_key(identity.load_private_key(path).public_key())
    except (OSError, identity.IdentityError):
        return None


def read_mesh_facts(config: Config, net_root: str | Path = "/sys/class/net",
                    now: dt.datetime | None = None) -> MeshFacts | None:
    """Trust files and interfaces of the ``[mesh]`` section; None for a standalone node."""
    mesh = config.mesh
    if mesh is None:
        return None
    from viiwork.mesh import identity, trust  # the mesh package owns the file names and rules

    now = now or dt.datetime.now(dt.UTC)
    chosen, all_ifaces = read_interfaces(mesh.interfaces, net_root)
    state_dir = Path(config.node.state_dir)
    ca_fact = node_fact = None
    key_path = Path(mesh.node_key) if mesh.node_key else state_dir / identity.KEY_FILE
    node_cert_obj = None
    if mesh.trust == "ca":
        ca_path = Path(mesh.ca_certificate) if mesh.ca_certificate else state_dir / trust.CA_CERT_FILE
        try:
            loaded_ca = trust.load_certificate(ca_path)
            trust.mesh_id_for_ca(loaded_ca)  # refuses a CA whose key is not Ed25519
        except trust.TrustError as exc:
            ca_obj = None
            ca_fact = CertFact("CA certificate", str(ca_path), ca_path.exists(), str(exc))
        else:
            ca_obj = loaded_ca
            ca_fact = CertFact("CA certificate", str(ca_path), True, None, loaded_ca.subject.rfc4514_string(),
                               loaded_ca.not_valid_after_utc)
        node_path = Path(mesh.node_certificate) if mesh.node_certificate else state_dir / trust.NODE_CERT_FILE
        if not node_path.exists():
            node_fact = CertFact("node certificate", str(node_path), False, f"{node_path} does not exist")
        else:
            try:
                node_cert_obj = trust.load_certificate(node_path)
                error = None
                if ca_obj is not None:
                    try:
                        trust.CaTrust(ca_obj).verify_certificate(trust.certificate_der(node_path.read_bytes()), now)
                    except trust.TrustError as exc:
                        error = f"{type(exc).__name__}: {exc}"
                node_fact = CertFact("node certificate", str(node_path), True, error,
                                     node_cert_obj.subject.rfc4514_string(), node_cert_obj.not_valid_after_utc)
            except (trust.TrustError, OSError) as exc:
                node_fact = CertFact("node certificate", str(node_path), True, str(exc))
    key_fact = _key_fact(key_path, node_cert_obj)
    return MeshFacts(mesh.trust, tuple(mesh.discovery), tuple(mesh.seeds), chosen, all_ifaces,
                     ca_fact, node_fact, key_fact)


def _key_fact(path: Path, cert: Any) -> KeyFact:
    from cryptography.hazmat.primitives import serialization

    try:
        mode = stat.S_IMODE(path.stat().st_mode)
    except FileNotFoundError:
        return KeyFact(str(path), False)
    except OSError as exc:
        return KeyFact(str(path), True, None, None, f"cannot stat: {exc.strerror or exc}")
    matches = None
    error = None
    if cert is not None:
        try:
            key = serialization.load_pem_private_key(path.read_bytes(), password=None)
            raw = serialization.Encoding.Raw, serialization.PublicFormat.Raw
            matches = key.public_key().public_bytes(*raw) == cert.public_key().public_bytes(*raw)
        except (OSError, ValueError, TypeError) as exc:
            error = f"cannot read the key: {exc}"
    return KeyFact(str(path), True, mode, matches, error)
