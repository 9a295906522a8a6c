"""The nftables rules of one gang part: only the gang's hosts reach the ports its engine binds.

Ray and torch distributed listen on ports of their own, without authentication
(docs/security.md, "Ray and torch distributed"). The adapter says which ports a part binds on
its host (``GangEngine.gang_ports``, a block from ``gang_port`` up); this module renders, for
one part, a table of its own::

    table inet viiwork_gang_<gang id>_r<rank>_<role> {
        chain input {
            type filter hook input priority filter - 10; policy accept;
            iif "lo" accept
            ct state established,related accept
            ip saddr { <the gang's IPv4 addresses> } accept
            ip6 saddr { <the gang's IPv6 addresses> } accept
            tcp dport { <ports> } drop
            udp dport { <ports> } drop
        }
    }

It hooks ``input`` before the host's own filter (priority ``filter - 10``, Debian's
``/etc/nftables.conf`` hooks at ``filter``) and drops packets to the part's ports from any
other address; everything else passes this table untouched. An ``accept`` here only ends
this chain: the host's own chains still see the packet (nft(8), "Verdict statement"), so the
table never opens what the host's firewall closes. ``established,related``: replies to the
host's own outgoing connections, whose local port may fall in the block, pass.

The unit owns the table (``LaunchRequest.firewall``): the runner creates it before the part
starts and deletes it when the part stops (agent/supervision/runners/). Pure: no nft here.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Sequence

from viiwork.agent.supervision.runners.base import NftTable
from viiwork.engines.gang import GangAddresses, GangEngine, GangPart, PortRange, is_gang_id, roles_at

#: The table's family: one table for IPv4 and IPv6.
FAMILY = "inet"
#: The input chain's priority: before the host's filter (``filter``, 0).
PRIORITY = "filter - 10"


class FirewallError(ValueError):
    """The rules cannot be rendered: the message names the value and what is allowed."""


def table_name(gang_id: str, part: GangPart) -> str:
    """``viiwork_gang_<gang id>_r<rank>_<role>``: one table per part, so that two parts of one
    host (a vLLM head's runtime and server) never delete each other's. Raises FirewallError
    for a gang id that is not one (``new_gang_id``)."""
    if not is_gang_id(gang_id):
        raise FirewallError(f"gang id {gang_id!r} is not 12 characters of a-z, 2-7")
    return f"viiwork_gang_{gang_id}_r{part.rank}_{part.role.value}"


def render_ruleset(table: str, members: Sequence[str], ports: Sequence[PortRange]) -> str:
    """nft's input that (re)creates ``table`` (an ``inet`` table): the chain of the module
    docstring, admitting ``members`` (IP addresses; IPv6 without brackets) and loopback to
    ``ports`` and dropping the rest there. The first two lines make it replace a table of that
    name atomically (nft runs one script as one transaction). Raises FirewallError for a
    member that is not an IP address (a DNS name: the rules take addresses; advertise the
    mesh on an IP), for no members or no ports."""
    if not ports:
        raise FirewallError("no ports to confine")
    if not members:
        raise FirewallError("no gang members to admit")
    v4: list[str] = []
    v6: list[str] = []
    for member in members:
        try:
            address = ipaddress.ip_address(member)
        except ValueError:
            raise FirewallError(f"gang member {member!r} is not an IP address: the rules admit addresses "
                                "(advertise the mesh on an IP: [mesh] advertise)") from None
        (v4 if address.version == 4 else v6).append(str(address))
    port_set = ", ".join(str(r) for r in sorted(set(ports)))
    lines = [
        f"table {FAMILY} {table} {{}}",
        f"delete table {FAMILY} {table}",
        f"table {FAMILY} {table} {{",
        "\tchain input {",
        f"\t\ttype filter hook input priority {PRIORITY}; policy accept;",
        '\t\tiif "lo" accept',
        "\t\tct state established,related accept",
    ]
    if v4:
        lines.append(f"\t\tip saddr {{ {', '.join(dict.fromkeys(v4))} }} accept")
    if v6:
        lines.append(f"\t\tip6 saddr {{ {', '.join(dict.fromkeys(v6))} }} accept")
    lines += [
        f"\t\ttcp dport {{ {port_set} }} drop",
        f"\t\tudp dport {{ {port_set} }} drop",
        "\t}",
        "}",
    ]
    return "\n".join(lines) + "\n"


def part_firewall(part: GangPart, gang: GangAddresses, ports: Sequence[PortRange]) -> NftTable | None:
    """The table of ``part`` (of rank ``gang.rank``) confining ``ports`` (the adapter's
    ``gang_ports``) to the gang's hosts (``gang.node_addresses``); None when the part binds
    no port on the gang's address. Raises FirewallError (``render_ruleset``)."""
    if not ports:
        return None
    name = table_name(gang.gang_id, part)
    return NftTable(FAMILY, name, render_ruleset(name, gang.node_addresses, ports))


def confines_ports(engine: GangEngine, size: int, port: int) -> bool:
    """Whether any part of a gang of ``size`` hosts of ``engine`` at ``port`` binds ports on
    its host's gang address (so that its host needs nft): the adapter's ``gang_ports`` of
    every role at every rank, for placeholder addresses."""
    for rank in range(size):
        gang = GangAddresses(gang_id="aaaaaaaaaaaa", rank=rank, size=size,
                             node_addresses=tuple(f"192.0.2.{i + 1}" for i in range(size)), port=port)
        if any(engine.gang_ports(role, gang) for role in roles_at(engine.launch_shape, rank)):
            return True
    return False
