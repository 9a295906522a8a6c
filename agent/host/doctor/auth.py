"""Checks of client keys (docs/security.md, "Client keys"): keys on where the API is reachable,
and the issuer key a node in keys mode verifies them with."""

from __future__ import annotations

from viiwork.agent.auth.keyset import INSTALL_HINT
from viiwork.agent.config.schema import auth_audience, is_loopback, parse_hostport
from viiwork.agent.host.doctor.registry import CheckResult, Verdict, check, config_or_skip, plural, result_for
from viiwork.agent.host.facts import HostFacts

TURN_KEYS_ON = ("turn client keys on: `[auth] mode = \"keys\"` and an issuer key (docs/install.md, \"Client keys\"); "
                "or listen on loopback only (api.listen = \"127.0.0.1:8086\")")


@check("auth", "Client keys")
def check_auth(facts: HostFacts) -> list[CheckResult]:
    """Who may use the client API (`[auth]`, docs/configuration.md).

    - **fail**: `mode = "keys"` and `auth.issuer_keys` is missing or not an Ed25519 public
      key: the agent starts, but answers every inference (and every read without
      `open_loopback_reads`) with 401 until the issuer's `issuer.pub` is installed there.
    - **degraded**: client keys are off (no `[auth]`, or `mode = "none"`) while `api.listen`
      is beyond loopback: anyone who reaches the port uses every model. Keys on in an open
      mesh (`auth.allow_open_mesh`): any host that knows the mesh id joins and receives the
      keys of forwarded requests. The issuer key cannot be read as this user (run as root).
    - **ok**: keys on, with the audience keys must carry (`viiworkctl keys issue --audience`);
      or keys off with the API on loopback only.
    """
    r = result_for("auth")
    config = config_or_skip(facts)
    auth = config.auth
    host, _port = parse_hostport(config.api.listen)
    if auth.mode == "none":
        if is_loopback(host):
            return [r(Verdict.OK, f"client keys off; the API listens on loopback only ({config.api.listen})")]
        return [r(Verdict.DEGRADED, f"client keys are off and the API listens on {config.api.listen}",
                  "anyone who reaches that address can use every model and read this node's status", TURN_KEYS_ON)]
    results: list[CheckResult] = []
    if config.mesh is not None and config.mesh.trust == "open":  # the config check allows it only with allow_open_mesh
        results.append(r(Verdict.DEGRADED, f"client keys on in an open mesh (auth.allow_open_mesh, mesh id "
                                           f"{config.mesh.mesh_id!r})",
                         "any host that knows the mesh id can join and receive the keys of forwarded requests",
                         "create a mesh CA (`viiworkctl mesh ca init`), enrol each node, set trust = \"ca\" and "
                         "remove auth.allow_open_mesh", subject="mesh"))
    keys = facts.need("issuer_keys")
    if keys.permission:
        results.append(r(Verdict.DEGRADED, f"{keys.path} cannot be read as this user: {keys.error}",
                         "whether the agent has a usable issuer key is unknown", "run the doctor as root",
                         subject="issuer key"))
    elif keys.error is not None:
        results.append(r(Verdict.FAIL, f"no usable issuer key: {keys.error}",
                         "the agent refuses every request that needs a client key (401 invalid_api_key)",
                         INSTALL_HINT.format(path=keys.path), subject="issuer key"))
    else:
        reads = "; reads open on loopback" if auth.open_loopback_reads else ""
        results.append(r(Verdict.OK, f"keys on: {plural(len(keys.kids), 'issuer key')} from {keys.path} "
                                     f"(kid {', '.join(keys.kids)}); keys must carry iss {auth.issuer!r}, "
                                     f"aud {auth_audience(config)!r}{reads}", subject="issuer key"))
    return results
