"""Checks of the running agent: what its ``GET /v1/status`` reports (``agent=True`` checks)."""

from __future__ import annotations

import urllib.parse
from collections.abc import Mapping

from viiwork.agent.cli.agent_http import KEY_HINT
from viiwork.agent.config.schema import is_loopback
from viiwork.agent.host.doctor.registry import (
    CheckResult,
    Skip,
    Verdict,
    agent_status_or_skip,
    check,
    config_or_skip,
    plural,
    result_for,
)
from viiwork.agent.host.facts import HostFacts
from viiwork.mesh.identity import is_node_id


@check("agent.reachable", "The running agent", agent=True)
def check_agent_reachable(facts: HostFacts) -> CheckResult:
    """The agent answers `GET /v1/status` at the target URL (`--url`, `$VIIWORK_URL`, or the
    config's `api.listen`).

    - **degraded**: nothing answers: this box serves nothing and its capacity is missing
      from the mesh. Or the agent refuses the doctor's request for its client key (401/403:
      client keys on, and no key with the `read` scope given with `--api-key` or
      `$VIIWORK_API_KEY`): the other `agent.*` checks are skipped.
    - **fail**: something answers, but not with a readable status.
    """
    r = result_for("agent.reachable")
    agent = facts.agent
    if agent is None:
        raise Skip("the running agent was not asked")
    if not agent.reachable:
        return r(Verdict.DEGRADED, f"no agent at {agent.url}: {agent.error}",
                 "this box serves nothing and peers route around it",
                 "start it: `systemctl enable --now viiwork`; see why it stopped: `journalctl -u viiwork -e`")
    if agent.status is None and agent.http_status in (401, 403):
        return r(Verdict.DEGRADED, f"{agent.url}: {agent.error}",
                 "the doctor cannot read the running agent: its agent.* checks are skipped",
                 f"{KEY_HINT}; a key is made with `viiworkctl keys issue ... --scope read`")
    if agent.status is None:
        return r(Verdict.FAIL, f"{agent.url}: {agent.error}", "the agent's state cannot be read",
                 "check the URL points at a viiwork agent; see `journalctl -u viiwork -e`")
    node = agent.status.get("node") or {}
    return r(Verdict.OK, f"{node.get('name', '?')} (viiwork {node.get('version', '?')}) at {agent.url}, "
                         f"up {node.get('uptime_s', '?')} s")


@check("agent.backends", "Models and backends the agent runs", agent=True)
def check_agent_backends(facts: HostFacts) -> list[CheckResult]:
    """What the running agent reports for each model.

    - **fail**: every backend of a model is dead: this node cannot serve it until
      `viiworkctl up MODEL`.
    - **degraded**: some backends dead or unhealthy (capacity reduced; unhealthy ones are
      respawned, dead ones are not).
    - **ok**: healthy, starting (phase and progress shown), or down on purpose.
    """
    r = result_for("agent.backends")
    status = agent_status_or_skip(facts)
    models = status.get("models")
    if not isinstance(models, list):
        raise ValueError("/v1/status has no models list")
    if not models:
        return [r(Verdict.OK, "the agent serves no model")]
    results = []
    for model in models:
        name = str(model.get("name", "?"))
        backends = [b for b in model.get("backends") or [] if isinstance(b, dict)]
        states = [str(b.get("state")) for b in backends]
        logs = f"see why: `viiworkctl logs {name}`"
        if model.get("state") == "down":
            results.append(r(Verdict.OK, "down (parked by the operator; `viiworkctl up` brings it back)", subject=name))
        elif model.get("state") == "dead" or (backends and all(s == "dead" for s in states)):
            reasons = "; ".join(sorted({str(b.get("reason")) for b in backends if b.get("reason")}))[:300]
            results.append(r(Verdict.FAIL, f"every backend dead{': ' + reasons if reasons else ''}",
                             f"this node cannot serve {name} (peers may still)",
                             f"{logs}; fix it, then `viiworkctl up {name}`", subject=name))
        elif any(s in ("dead", "unhealthy") for s in states):
            bad = [b for b in backends if b.get("state") in ("dead", "unhealthy")]
            detail = "; ".join(f"{b.get('id')}: {b.get('state')} {b.get('reason') or ''}".strip() for b in bad)[:300]
            results.append(r(Verdict.DEGRADED, f"{len(bad)} of {plural(len(backends), 'backend')} not serving: {detail}",
                             "reduced capacity: unhealthy backends are respawned, dead ones are not", logs, subject=name))
        else:
            starting = [b for b in backends if b.get("state") == "starting"]
            healthy = sum(1 for s in states if s == "healthy")
            summary = f"{healthy}/{len(backends)} healthy, {model.get('busy', '?')}/{model.get('slots', '?')} slots busy"
            if starting:
                b = starting[0]
                progress = b.get("progress")
                pct = f" {progress * 100:.0f}%" if isinstance(progress, (int, float)) and progress >= 0 else ""
                summary += f"; starting: {b.get('phase') or 'loading'}{pct}"
            results.append(r(Verdict.OK, summary, subject=name))
    return results


@check("agent.config", "The agent runs the config on disk", agent=True)
def check_agent_config(facts: HostFacts) -> CheckResult:
    """The models the local agent serves are the models the config on disk names.

    - **degraded**: they differ: the config was edited and not reloaded.
    - **skipped**: the agent asked is not on this host (`--url` elsewhere), or no valid config.
    """
    r = result_for("agent.config")
    config = config_or_skip(facts)
    status = agent_status_or_skip(facts)
    assert facts.agent is not None  # agent_status_or_skip skips otherwise
    host = urllib.parse.urlsplit(facts.agent.url).hostname or ""
    if not is_loopback(host):
        raise Skip(f"the agent at {facts.agent.url} is not this host")
    serving = {str(m.get("name")) for m in status.get("models") or [] if isinstance(m, dict)}
    # A gang's entry is served by its head only: a worker (or a host it does not name) runs
    # parts, not a model. A head named by node id is not told apart here (the doctor may not
    # know this node's id): such an entry is expected neither way.
    configured = {m.name for m in config.models
                  if not m.hosts or m.hosts[0] == config.node.name or (is_node_id(m.hosts[0]) and m.name in serving)}
    if serving == configured:
        return r(Verdict.OK, f"serves the {plural(len(configured), 'model')} of {facts.config.path}")
    parts = []
    if configured - serving:
        parts.append(f"configured but not served: {', '.join(sorted(configured - serving))}")
    if serving - {m.name for m in config.models}:
        parts.append(f"served but not configured: {', '.join(sorted(serving - {m.name for m in config.models}))}")
    return r(Verdict.DEGRADED, "; ".join(parts), "the agent runs an older config than the file on disk",
             "`viiworkctl reload` (or `systemctl reload viiwork`) after `viiworkctl config check`")


@check("agent.state_dir", "Writes into the state dir the agent could not make", agent=True)
def check_agent_state_dir(facts: HostFacts) -> CheckResult:
    """What the running agent could not persist into `node.state_dir` (a disk that filled or
    turned read-only while it ran): the boot generation, open-mode name pins, and engine key
    files a backend's launch could not write (that backend waits, spending no respawn). The
    agent keeps them in memory and retries every 5 s; it never stops over them.

    - **degraded**: writes are pending: they are lost if the agent stops before the disk
      is fixed (a lower boot generation is corrected by the mesh; lost pins are pinned afresh).
    - **skipped**: an agent too old to report it.
    """
    r = result_for("agent.state_dir")
    section = agent_status_or_skip(facts).get("state_dir")
    if not isinstance(section, Mapping):
        raise Skip("the agent does not report its state dir (older version)")
    pending = [p for p in section.get("pending_writes") or [] if isinstance(p, Mapping)]
    path = section.get("path", "?")
    if not pending:
        return r(Verdict.OK, f"every write into {path} succeeded")
    detail = "; ".join(f"{p.get('what')}: {p.get('error')} ({p.get('errno')}, {_attempts(p.get('attempts'))})"
                       for p in pending)[:300]
    return r(Verdict.DEGRADED, f"{plural(len(pending), 'write')} into {path} pending: {detail}",
             "kept in memory and retried every 5 s; lost if the agent stops first",
             f"free space on (or remount read-write) the file system holding {path}: `df -h {path}`")


@check("agent.usage", "The usage ledger", agent=True)
def check_agent_usage(facts: HostFacts) -> CheckResult:
    """The running agent's usage ledger (`usage.path`; docs/usage.md): a row per finished
    request, committed before the request's end is reported. When the file refuses writes (a
    full disk), rows wait in memory, at most `backlog_max`, and are retried every 5 s.

    - **fail**: rows were dropped (the backlog was full): those requests are not in the
      ledger and never will be.
    - **degraded**: rows wait in memory: lost if the agent stops before the disk is fixed.
    - **skipped**: an agent too old to report it.
    """
    r = result_for("agent.usage")
    section = agent_status_or_skip(facts).get("usage")
    if not isinstance(section, Mapping):
        raise Skip("the agent does not report a usage ledger (older version)")
    path = section.get("path", "?")
    backlog, dropped = section.get("backlog") or 0, section.get("dropped") or 0
    remedy = f"free space on (or remount read-write) the file system holding {path}: `df -h {path}`"
    error = str(section.get("last_error") or "")[:200]
    if dropped:
        return r(Verdict.FAIL, f"{plural(int(dropped), 'row')} dropped since start; {plural(int(backlog), 'row')} "
                 f"waiting in memory{': ' + error if error else ''}",
                 "those requests are missing from the usage ledger for good", remedy)
    if backlog:
        return r(Verdict.DEGRADED, f"{plural(int(backlog), 'row')} waiting in memory for {path}: {error}",
                 "kept in memory and retried every 5 s; lost if the agent stops first", remedy)
    return r(Verdict.OK, f"{plural(int(section.get('rows_written') or 0), 'row')} written to {path} since start")


@check("agent.gpus", "GPU problems the agent has seen", agent=True)
def check_agent_gpus(facts: HostFacts) -> list[CheckResult]:
    """The running agent's GPU section: backends on a GPU that vanished, and backends whose
    processes are not on exactly their GPUs (on-GPU verification).

    - **fail**: a backend's GPU vanished (hot-removed or fallen off the bus).
    - **degraded**: a backend runs on a GPU it was not given, or not on one it was given.
    - **skipped**: the agent reports no GPU section.
    """
    r = result_for("agent.gpus")
    section = agent_status_or_skip(facts).get("gpus")
    if not isinstance(section, dict):
        raise Skip("the agent reports no GPU section")
    results = []
    for lost in section.get("lost_backends") or []:
        results.append(r(Verdict.FAIL, f"its GPU {lost.get('gpu')} vanished {lost.get('age_s', '?')} s ago",
                         "the backend cannot work; the model has less capacity",
                         "check `dmesg` (Xid 79 = fallen off the bus); reset the GPU or reboot",
                         subject=str(lost.get("backend"))))
    for p in section.get("placements") or []:
        if p.get("verdict") == "mismatch":
            results.append(r(Verdict.DEGRADED, str(p.get("reason")),
                             "it competes with another model for GPU memory, or its own GPU sits idle",
                             "check the backend's device variables (`systemctl show UNIT -p Environment`) and the "
                             "engine's device flags", subject=str(p.get("backend"))))
    if not results:
        gpus = section.get("gpus") or []
        verified = sum(1 for p in section.get("placements") or [] if p.get("verdict") == "ok")
        results.append(r(Verdict.OK, f"{plural(len(gpus), 'GPU')}, {plural(verified, 'backend placement')} verified"))
    return results


@check("agent.mesh_identity", "One agent per node identity in the mesh", agent=True)
def check_agent_mesh_identity(facts: HostFacts) -> CheckResult:
    """Whether another running agent publishes this node's id (its state dir was copied to a
    second machine, so both hold one key): docs/mesh.md, "One node per identity".

    - **fail**: two agents run this node id; peers route to neither while it lasts, and the
      one with the higher boot stops (exit 78).
    - **skipped**: no mesh, or an agent too old to report it.
    """
    r = result_for("agent.mesh_identity")
    mesh = agent_status_or_skip(facts).get("mesh")
    if not isinstance(mesh, Mapping) or not isinstance(mesh.get("self"), Mapping):
        raise Skip("the agent runs no mesh")
    me = mesh["self"]
    if "identity_conflict" not in me:
        raise Skip("the agent does not report identity conflicts (older version)")
    conflict = me.get("identity_conflict")
    if not isinstance(conflict, Mapping):
        return r(Verdict.OK, f"no other agent publishes node id {me.get('id', '?')}")
    fate = "this agent stops" if conflict.get("this_boot_leaves") else "the other agent stops"
    return r(Verdict.FAIL, f"node id {me.get('id', '?')} is also run by the agent at "
                           f"{conflict.get('other_address') or '?'} (boot {conflict.get('other_boot', '?')}; this "
                           f"boot {conflict.get('this_boot', '?')}): {fate}",
             "peers route to neither while both run; the two raise their boot generations against each other",
             "give each machine its own node.state_dir: start the copy from an empty state dir (a new key, so a new "
             "node id) and, with trust = \"ca\", enrol it (`viiworkctl mesh request`, `mesh sign`, `mesh install`)")


SEEDS_NAMED = 5  # never-answered seeds named in the summary; the rest are counted


@check("agent.mesh_seeds", "Seeds that never answered", agent=True)
def check_agent_mesh_seeds(facts: HostFacts) -> CheckResult:
    """The running agent's dial history of each `mesh.seeds` address (docs/mesh.md, "Seeds"):
    a seed that was dialed and never answered is a typo, a host that is gone, or a firewall.

    - **fail**: no seed ever answered and no peer is alive: this node found nobody through
      its seeds.
    - **degraded**: some seeds never answered while others did (or peers are alive): the
      dead ones add nothing and are retried with backoff.
    - **skipped**: no mesh, no seeds dialed (`mesh.seeds` empty or `"seeds"` not in
      `mesh.discovery`), or an agent too old to report them.
    """
    r = result_for("agent.mesh_seeds")
    mesh = agent_status_or_skip(facts).get("mesh")
    if not isinstance(mesh, Mapping) or not isinstance(mesh.get("self"), Mapping):
        raise Skip("the agent runs no mesh")
    if "seeds" not in mesh:
        raise Skip("the agent does not report its seeds (older version)")
    seeds = [s for s in mesh.get("seeds") or [] if isinstance(s, Mapping)]
    if not seeds:
        raise Skip("the agent dials no seeds")
    dead = [s for s in seeds if not s.get("answered") and (s.get("attempts") or 0) > 0]
    answered = sum(1 for s in seeds if s.get("answered"))
    if not dead:
        waiting = len(seeds) - answered
        return r(Verdict.OK, f"{answered} of {plural(len(seeds), 'seed')} answered"
                             + (f" ({waiting} not dialed yet)" if waiting else ""))
    peers = mesh.get("peers")
    alive = peers.get("alive", 0) if isinstance(peers, Mapping) else 0
    named = ", ".join(f"{s.get('address', '?')} ({s.get('last_error') or 'dialing'})" for s in dead[:SEEDS_NAMED])
    more = f" and {len(dead) - SEEDS_NAMED} more" if len(dead) > SEEDS_NAMED else ""
    summary = f"{len(dead)} of {plural(len(seeds), 'seed')} never answered: {named}{more}"
    remedy = ("check each address is the host:port of a peer's mesh listener (`mesh.listen`, port 8087 by default) "
              "and reachable from here (firewall); remove dead seeds from mesh.seeds, then `systemctl restart viiwork`")
    if answered or alive:
        return r(Verdict.DEGRADED, summary,
                 "they add nothing: peers are found through the others, and the dead ones are retried with backoff",
                 remedy)
    return r(Verdict.FAIL, summary + "; no peer is alive",
             "this node finds no peers through its seeds: it serves alone and nobody forwards to it", remedy)


def _attempts(count: object) -> str:
    """``3 attempts``, ``1 attempt``; a count the agent did not give as an integer as it came."""
    return plural(count, "attempt") if isinstance(count, int) else f"{count} attempts"
