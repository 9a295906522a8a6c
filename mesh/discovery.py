"""Finding peers: mDNS (python-zeroconf, ``AsyncZeroconf``) and static seeds.

mDNS service ``_viiwork._tcp.local.``; instance ``<node id>._viiwork._tcp.local.`` on the
advertised IPv4 address and the mesh port, with TXT records:

- ``id``: node id; ``mesh``: mesh id (two meshes on one LAN ignore each other's records);
- ``proto``: newest protocol version spoken; ``api``: client API port; ``port``: mesh port.

Found peers become gossip candidates (:meth:`~viiwork.mesh.membership.Membership.add_candidate`);
what they are is then learned over mutual TLS, never from mDNS (anyone on the LAN can
answer mDNS). mDNS does not cross routers, VPNs or Docker bridges, so ``mesh.seeds``
(``host:port``) work alone (docs/architecture.md, rule 9).

Addresses (docs/architecture.md, rule 10): a wildcard, loopback or link-local address is never advertised
unless ``mesh.advertise`` names it (tests on one host do). mDNS runs on the configured
interfaces only (names or IPv4 addresses); tests use ``127.0.0.1`` and never all interfaces.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import socket
from collections.abc import Callable
from typing import Any

import ifaddr
from zeroconf import IPVersion, ServiceStateChange
from zeroconf.asyncio import AsyncServiceBrowser, AsyncServiceInfo, AsyncZeroconf

from viiwork.mesh.identity import NodeId, is_node_id

log = logging.getLogger(__name__)

SERVICE_TYPE = "_viiwork._tcp.local."
RESOLVE_TIMEOUT_MS = 3000


class DiscoveryError(Exception):
    """mDNS cannot start as configured (the message names the setting)."""


def is_advertisable(host: str) -> bool:
    """False for wildcard, loopback and link-local addresses (and "localhost"); other
    addresses and DNS names pass."""
    try:
        addr = ipaddress.ip_address(host.strip("[]"))
    except ValueError:
        return host.lower() not in ("", "localhost") and not host.lower().endswith(".localhost")
    return not (addr.is_unspecified or addr.is_loopback or addr.is_link_local)


def interface_addresses(interfaces: list[str]) -> list[str]:
    """IPv4 addresses for ``interfaces`` (interface names or IPv4 addresses, in order).
    Raises DiscoveryError for a name that is no interface or has no IPv4 address."""
    adapters = {a.nice_name: a for a in ifaddr.get_adapters()}
    out: list[str] = []
    for item in interfaces:
        try:
            ipaddress.IPv4Address(item)
            out.append(item)
            continue
        except ValueError:
            pass
        adapter = adapters.get(item)
        if adapter is None:
            raise DiscoveryError(f"mesh.interfaces: no interface {item!r} (have {', '.join(sorted(adapters))})")
        v4 = [ip.ip for ip in adapter.ips if isinstance(ip.ip, str)]
        if not v4:
            raise DiscoveryError(f"mesh.interfaces: interface {item!r} has no IPv4 address")
        out.extend(v4)
    return out


def pick_advertised_host(listen_host: str, advertise: str | None, interfaces: list[str]) -> str | None:
    """The host to advertise to peers: ``advertise`` as given (the operator's explicit
    choice, loopback included); else a specific listen address if advertisable (a listener
    bound to one address is reachable there only: a loopback one is advertised nowhere);
    else, for a wildcard listener, the first advertisable IPv4 address of the configured
    interfaces, or of any interface. None when nothing advertisable exists (the node then
    only dials out)."""
    if advertise:
        return advertise
    if listen_host not in ("0.0.0.0", "::", ""):
        return listen_host if is_advertisable(listen_host) else None
    candidates = interface_addresses(interfaces) if interfaces else [
        ip.ip for a in ifaddr.get_adapters() for ip in a.ips if isinstance(ip.ip, str)]
    for host in candidates:
        if is_advertisable(host):
            return host
    return None


class MdnsDiscovery:
    """Registers this node and browses for others (see the module doc).

    ``on_found(address, node_id)`` / ``on_lost(address)`` are called on the event loop and
    must not block.
    """

    def __init__(self, *, node_id: NodeId, mesh_id: str, protocol: int, advertise_host: str, mesh_port: int,
                 api_port: int, interfaces: list[str], on_found: Callable[[str, NodeId], None],
                 on_lost: Callable[[str], None]):
        self.node_id, self.mesh_id, self.protocol = node_id, mesh_id, protocol
        self.advertise_host, self.mesh_port, self.api_port = advertise_host, mesh_port, api_port
        self.interfaces = interfaces
        self.on_found, self.on_lost = on_found, on_lost
        self._zc: AsyncZeroconf | None = None
        self._browser: AsyncServiceBrowser | None = None
        self._info: AsyncServiceInfo | None = None
        self._names: dict[str, list[str]] = {}  # instance name -> addresses it announced
        self._tasks: set[asyncio.Task[None]] = set()
        self.ignored_other_mesh = 0

    async def start(self) -> None:
        try:
            ip = ipaddress.IPv4Address(self.advertise_host)
        except ValueError:
            try:
                infos = await asyncio.get_running_loop().getaddrinfo(self.advertise_host, None, family=socket.AF_INET)
            except UnicodeError:  # not a host name at all (idna refuses it); OSError goes to the caller
                infos = []
            if not infos:
                raise DiscoveryError(f"cannot resolve advertised host {self.advertise_host!r}") from None
            ip = ipaddress.IPv4Address(infos[0][4][0])
        bind: Any = interface_addresses(self.interfaces) if self.interfaces else [str(ip)]
        self._zc = AsyncZeroconf(interfaces=bind, ip_version=IPVersion.V4Only)
        self._info = AsyncServiceInfo(
            SERVICE_TYPE, f"{self.node_id}.{SERVICE_TYPE}", addresses=[ip.packed], port=self.mesh_port,
            properties={"id": self.node_id, "mesh": self.mesh_id, "proto": str(self.protocol),
                        "api": str(self.api_port), "port": str(self.mesh_port)},
            server=f"{self.node_id}.local.",
        )
        # Registration probes the name first (~1.7 s); browse meanwhile.
        self._browser = AsyncServiceBrowser(self._zc.zeroconf, SERVICE_TYPE, handlers=[self._on_change])
        registered = await self._zc.async_register_service(self._info)
        self._spawn(self._await_registration(registered))

    async def _await_registration(self, registered: Any) -> None:
        try:
            await registered
            log.info("mDNS: registered %s on %s", self.node_id, self.advertise_host)
        except Exception as exc:  # noqa: BLE001 - zeroconf raises several types; discovery degrades to seeds
            log.warning("mDNS registration failed (%s); seeds still work", exc)

    def _spawn(self, coro: Any) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _on_change(self, zeroconf: Any, service_type: str, name: str, state_change: ServiceStateChange) -> None:
        if state_change is ServiceStateChange.Removed:
            for address in self._names.pop(name, []):
                self.on_lost(address)
            return
        self._spawn(self._resolve(name))

    async def _resolve(self, name: str) -> None:
        if self._zc is None:
            return
        info = AsyncServiceInfo(SERVICE_TYPE, name)
        if not await info.async_request(self._zc.zeroconf, RESOLVE_TIMEOUT_MS):
            return
        props = {k.decode(errors="replace"): (v or b"").decode(errors="replace")
                 for k, v in (info.properties or {}).items()}
        node_id = props.get("id", "")
        if not is_node_id(node_id) or node_id == self.node_id:
            return
        if props.get("mesh") != self.mesh_id:
            self.ignored_other_mesh += 1
            log.debug("mDNS: ignoring %s of mesh %r", name, props.get("mesh"))
            return
        addresses = [f"{ip}:{info.port}" for ip in info.parsed_addresses(IPVersion.V4Only)]
        self._names[name] = addresses
        for address in addresses:
            self.on_found(address, NodeId(node_id))

    async def stop(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._browser is not None:
            await self._browser.async_cancel()
        if self._zc is not None:
            if self._info is not None:
                try:
                    await self._zc.async_unregister_service(self._info)
                except Exception as exc:  # noqa: BLE001 - best effort on the way out
                    log.debug("mDNS unregister failed: %s", exc)
            await self._zc.async_close()
        self._zc = self._browser = self._info = None
