"""Checks of the mesh: trust material (CA, node certificate, node key) and peer discovery."""

from __future__ import annotations

import datetime as dt

from viiwork.agent.host.doctor.registry import CheckResult, Skip, Verdict, check, config_or_skip, plural, result_for
from viiwork.agent.host.facts import HostFacts

CERT_WARN_DAYS = 14


@check("mesh.trust", "Mesh trust and certificates")
def check_mesh_trust(facts: HostFacts) -> list[CheckResult]:
    """The mesh's trust material. A `[mesh]` without `trust` is refused by the config check.

    - **fail** (`trust = "ca"`): the CA certificate cannot be read or is not an Ed25519 CA;
      this node has no certificate (not enrolled), or it was not issued by this CA, or it
      expired; the node key is missing, readable by group or others, or does not match the
      certificate. The node cannot join the mesh.
    - **degraded**: `trust = "open"` (any host that knows the mesh id can join and receive
      forwarded prompts); a certificate expires within 14 days.
    - **skipped**: a standalone node (no `[mesh]`).
    """
    r = result_for("mesh.trust")
    config = config_or_skip(facts)
    if config.mesh is None:
        raise Skip("standalone node (no [mesh])")
    mesh = facts.need("mesh")
    results: list[CheckResult] = []
    cannot_join = "this node cannot join the mesh: no gossip, no forwarding to or from it"
    enrol = ("enrol: `viiworkctl mesh request` here, `viiworkctl mesh sign` on the CA host, "
             "`viiworkctl mesh install` here")
    if mesh.trust == "open":
        results.append(r(Verdict.DEGRADED, f"trust = \"open\" (mesh id {config.mesh.mesh_id!r})",
                         "any host that knows the mesh id (it is in the mDNS record) can join and receive prompts",
                         "create a mesh CA (`viiworkctl mesh ca init`) and enrol each node; then set trust = \"ca\""))
    for cert in (mesh.ca, mesh.node_certificate):
        if cert is None:
            continue
        if cert.error:
            remedy = enrol if cert.role == "node certificate" else \
                "point mesh.ca_certificate at the mesh CA's ca.crt (made by `viiworkctl mesh ca init`)"
            results.append(r(Verdict.FAIL, f"{cert.path}: {cert.error}", cannot_join, remedy, subject=cert.role))
            continue
        if cert.not_after is not None:
            left = cert.not_after - facts.observed_at
            if left <= dt.timedelta(0):
                results.append(r(Verdict.FAIL, f"{cert.path} expired {cert.not_after:%Y-%m-%d}", cannot_join,
                                 enrol if cert.role == "node certificate" else "renew the CA certificate",
                                 subject=cert.role))
                continue
            if left < dt.timedelta(days=CERT_WARN_DAYS):
                results.append(r(Verdict.DEGRADED, f"{cert.path} expires {cert.not_after:%Y-%m-%d} ({left.days} days)",
                                 "the node drops out of the mesh when it expires",
                                 f"renew it now ({enrol})" if cert.role == "node certificate" else "renew the CA certificate",
                                 subject=cert.role))
                continue
        until = f", valid until {cert.not_after:%Y-%m-%d}" if cert.not_after else ""
        results.append(r(Verdict.OK, f"{cert.path}: {cert.subject}{until}", subject=cert.role))
    key = mesh.node_key
    if key is not None:
        if not key.exists:
            if mesh.trust == "ca":
                results.append(r(Verdict.FAIL, f"{key.path} does not exist", cannot_join,
                                 f"start the agent once (it creates the key), then {enrol}", subject="node key"))
        elif key.mode is not None and key.mode & 0o077:
            results.append(r(Verdict.FAIL, f"{key.path} has mode {key.mode:04o}",
                             "the agent refuses a key others can read: whoever reads it can impersonate this node",
                             f"`chmod 600 {key.path}` (and re-enrol with a new key if others may have read it)",
                             subject="node key"))
        elif key.matches_certificate is False:
            results.append(r(Verdict.FAIL, f"{key.path} does not match the node certificate", cannot_join,
                             f"install the certificate signed for this node's key ({enrol})", subject="node key"))
        elif key.error:
            results.append(r(Verdict.DEGRADED, f"{key.path}: {key.error}", "the key could not be checked",
                             "run the doctor as root (the state dir is private)", subject="node key"))
        else:
            results.append(r(Verdict.OK, f"{key.path} (mode {key.mode:04o})", subject="node key"))
    return results


@check("mesh.discovery", "Peer discovery (mDNS and seeds)")
def check_mesh_discovery(facts: HostFacts) -> list[CheckResult]:
    """Peers can be found: mDNS is possible on the chosen interfaces (`mesh.interfaces`:
    names or addresses; empty means every non-loopback interface), or static `mesh.seeds`
    are listed.

    - **fail**: no way to find peers: mDNS impossible everywhere and no seeds (or seeds-only
      discovery with an empty seed list).
    - **degraded**: mDNS impossible on a chosen interface (missing, down, no MULTICAST flag),
      or only on loopback (which reaches agents on this host only).
    - **skipped**: a standalone node.
    """
    r = result_for("mesh.discovery")
    config = config_or_skip(facts)
    if config.mesh is None:
        raise Skip("standalone node (no [mesh])")
    mesh = facts.need("mesh")
    seeds = bool(mesh.seeds) and "seeds" in mesh.discovery
    alone = "this node finds no peers: it serves alone and nobody forwards to it"
    results: list[CheckResult] = []
    if "mdns" not in mesh.discovery:
        if seeds:
            return [r(Verdict.OK, f"seeds only: {plural(len(mesh.seeds), 'seed')}")]
        return [r(Verdict.FAIL, "mDNS is off and mesh.seeds is empty", alone,
                  "list peers in mesh.seeds (host:port of their mesh listeners), or add \"mdns\" to mesh.discovery")]
    if mesh.interfaces:
        targets = list(mesh.interfaces)
        for i in targets:
            problem = None
            if not i.exists:
                problem = "does not exist on this host" if i.name else "is not an address of this host"
            elif i.up is False:
                problem = "is down"
            elif i.multicast is False:
                problem = "has no MULTICAST flag"
            elif i.loopback:
                problem = "is loopback: mDNS there reaches agents on this host only"
            if problem:
                results.append(r(Verdict.DEGRADED, f"{i.entry} {problem}", "mDNS finds no peers through it",
                                 "choose interfaces that are up and multicast-capable in mesh.interfaces "
                                 "(`ip link` shows MULTICAST and UP)", subject=i.entry))
    else:
        targets = [i for i in mesh.all_interfaces if not i.loopback]
    usable = [i for i in targets if i.exists and i.up is not False and i.multicast is not False and not i.loopback]
    if not usable:
        where = ", ".join(i.entry for i in targets) or "no non-loopback interface"
        if seeds:
            results.append(r(Verdict.DEGRADED, f"mDNS impossible on {where}; relying on {plural(len(mesh.seeds), 'seed')}",
                             "new peers are found only through the seeds",
                             "add an interface that is up and multicast-capable to mesh.interfaces"))
        else:
            results.append(r(Verdict.FAIL, f"mDNS impossible on {where} and no seeds", alone,
                             "choose an interface that is up and multicast-capable (mesh.interfaces), "
                             "or list peers in mesh.seeds"))
    elif not results:
        extra = f" and {plural(len(mesh.seeds), 'seed')}" if seeds else ""
        results.append(r(Verdict.OK, f"mDNS on {', '.join(i.entry for i in usable)}{extra}"))
    return results
