"""``viiwork-agent``: the daemon. ``--config FILE`` runs a config; ``--demo`` the embedded one.

Lifecycle: load config -> lock and check ``node.state_dir`` (agent/host/statedir.py) -> bind the
mesh listener, the admin socket and the client API -> start the supervisor (backends begin
loading, or are adopted) -> serve until SIGTERM/SIGINT -> stop admitting, tell peers, let requests in
flight end (at most ``health.drain_timeout_s``), close the mesh listener, stop (or hand
over) the engines: docs/architecture.md, "Stopping".

One module (over 400 lines) because it is the one place where the subsystems are wired, in
the order the lifecycle needs (bind before starting engines, stop in reverse); each subsystem
lives in its own module, and what is here is the order and the hand-offs between them.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path

import aiohttp
from aiohttp import web

from viiwork import __version__
from viiwork.agent.admin import ActionError, build_admin_app, node_actions, start_admin_site
from viiwork.agent.auth.gate import AuthGate, AuthStartError
from viiwork.agent.banner import ready_lines
from viiwork.agent.config.demo import DEMO_CONFIG_FILE
from viiwork.agent.config.load import DEFAULT_CONFIG_PATH, ConfigError, parse_config, read_config_text
from viiwork.agent.config.schema import Config, parse_hostport
from viiwork.agent.gang.head import GangHead
from viiwork.agent.gang.tunnel import metric_families as tunnel_metric_families
from viiwork.agent.gang.worker import GangWorker
from viiwork.agent.host.facts.mesh import read_node_id
from viiwork.agent.host.gpus import GpuInventory, GpuMonitor, GpuRefError, check_config_gpus
from viiwork.agent.host.statedir import StateDirLocked, take_state_dir
from viiwork.agent.notify import (
    Notifier,
    StopDecision,
    StopIntent,
    finish_supervision,
    run_status,
    runner_stop_intent,
    status_line,
)
from viiwork.agent.peering.mesh_link import MeshLink
from viiwork.agent.peering.mesh_usage import MeshUsage
from viiwork.agent.peering.revocation_sync import RevocationSync, operator_push
from viiwork.agent.peering.usage_share import UsageShare
from viiwork.agent.serving import protocol_log
from viiwork.agent.serving.api import PARSER_MAX_FIELD_BYTES, ClientApi
from viiwork.agent.serving.api_listener import ApiSite, ConnectionLimits, raise_open_file_limit
from viiwork.agent.serving.browser_guard import BrowserGuard, BrowserPolicy
from viiwork.agent.serving.ejections import Ejections
from viiwork.agent.serving.prefix_routing import PrefixRouting, PrefixSettings
from viiwork.agent.serving.proxy import Upstream
from viiwork.agent.serving.tracing import Tracing, TracingUnavailable
from viiwork.agent.serving.waitqueue import Queues
from viiwork.agent.supervision.runners.base import Runner, RunnerError
from viiwork.agent.supervision.supervisor import Supervisor
from viiwork.agent.usage.ledger import Ledger
from viiwork.agent.usage.store import SchemaNewer
from viiwork.mesh.node import MeshStartError
from viiwork.mesh.persist import PendingWrites, StateDirFault

log = logging.getLogger("viiwork.agent")

# Another agent runs this node's id and this one left (docs/mesh.md, "One node per identity"):
# EX_CONFIG, which systemd/viiwork.service does not restart (RestartPreventExitStatus=).
EXIT_IDENTITY_CONFLICT = 78


def setup_logging(level: str) -> None:
    # journald adds its own timestamps; JOURNAL_STREAM is set when stderr goes to it.
    fmt = "%(levelname)s %(name)s: %(message)s" if os.environ.get("JOURNAL_STREAM") else \
        "%(asctime)s %(levelname)s %(name)s: %(message)s"
    logging.basicConfig(level=getattr(logging, level.upper(), logging.INFO), format=fmt, stream=sys.stderr)
    logging.getLogger("aiohttp.access").setLevel(logging.WARNING)
    protocol_log.install()  # parser-refused requests: one WARNING line, then DEBUG


async def make_runner(config: Config) -> Runner:
    """The runner the config asks for: ``process``, ``systemd``, or ``auto`` (systemd when the
    chosen bus answers as org.freedesktop.systemd1)."""
    choice = config.supervisor.runner
    if choice in ("systemd", "auto"):
        try:
            from viiwork.agent.supervision.runners.systemd.runner import create_runner
        except ImportError:  # this build has no systemd runner (or it lacks create_runner)
            if choice == "systemd":
                raise RunnerError('supervisor.runner = "systemd", but this build has no systemd runner') from None
        else:
            runner = await create_runner(config, required=(choice == "systemd"))
            if runner is not None:
                return runner
    from viiwork.agent.supervision.runners.process import ProcessRunner

    return ProcessRunner()


async def _cancel(task: asyncio.Task) -> None:
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task


DEMO_SOURCE = "<embedded demo config>"


async def run_agent(config: Config, *, source: str = "config", text: str | None = None,
                    config_path: Path | None = None, ready_banner: bool = True) -> int:
    """Run until SIGTERM/SIGINT; returns the process exit code.

    ``source``/``text``: the config's file name and text, for line numbers in errors found
    against this host (GPUs that do not exist). ``config_path``: the file that
    ``viiworkctl reload`` and SIGHUP re-read (None: the embedded demo config).
    """
    # Reads (and removes from our environment) NOTIFY_SOCKET and the watchdog variables.
    notifier = Notifier()
    stop = asyncio.Event()
    refused: list[str] = []  # the line to exit with: another agent runs this node id (mesh/clones.py)
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    host, port = parse_hostport(config.api.listen, "api.listen")
    # Before anything else (sockets, runner, engines): one agent per state dir, and a state
    # dir it can write, or one line and exit (agent/host/statedir.py; docs/reliability.md).
    try:
        state_lock = await asyncio.to_thread(take_state_dir, config.node.state_dir)
    except (StateDirLocked, StateDirFault) as exc:
        line = str(exc)
        if isinstance(exc, StateDirLocked) and source == DEMO_SOURCE:
            # The demo has no config to give another state dir: one demo per user.
            line = (f"another demo agent of this user runs (pid {exc.holder_pid}, state dir {exc.state_dir}): "
                    "one demo per user; stop it first")
        log.error("%s", line)
        notifier.status(line)
        return 1

    async with contextlib.AsyncExitStack() as stack:
        stack.callback(state_lock.release)  # last out: held while anything else runs
        if source == DEMO_SOURCE and text is not None:
            # The demo's config as a file, for viiworkctl (agent/cli/target.py) and the operator.
            demo_file = config.node.state_dir / DEMO_CONFIG_FILE
            await asyncio.to_thread(demo_file.write_text, text, encoding="utf-8")
            stack.callback(lambda: demo_file.unlink(missing_ok=True))
        # The usage ledger (agent/usage; docs/usage.md), closed after the drain so the rows of
        # the requests that end while draining are committed too. The request path records a
        # row per finished request through it (its UsageRow) before it reports the end.
        ledger = Ledger(config.usage.file(config.node.state_dir), retention_days=config.usage.retention_days)
        try:
            await asyncio.to_thread(ledger.start)
        except SchemaNewer as exc:
            log.error("%s (usage.path)", exc)
            notifier.status(str(exc))
            return 1
        stack.push_async_callback(ledger.close)
        probe_http = await stack.enter_async_context(aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0, force_close=True)))
        upstream = await stack.enter_async_context(Upstream(
            config.api.stream_idle_timeout_s, client_stall_timeout_s=config.api.client_stall_timeout_s))
        supervisor: Supervisor | None = None
        gpus = GpuMonitor(backends=lambda: [b for rt in supervisor.models.values() for b in rt.backends]
                          if supervisor else [])
        inventory = await gpus.async_refresh()
        try:
            check_config_gpus(config, inventory, source=source, text=text)
        except ConfigError as exc:
            log.error("%s", exc)
            return 1
        runner = await make_runner(config)
        stack.push_async_callback(runner.close)
        supervisor = Supervisor(config, runner, probe_http, config.node.name, vendor_of=_vendor_lookup(inventory),
                                node_id=read_node_id(config))
        # The origin queues, shared by the request pipeline and the mesh link (slot offers).
        queues = Queues(supervisor.models, config.routing.queue_max, config.routing.queue_timeout_s)
        # Outlier ejection (agent/serving/ejections.py), shared by the pipeline and the mesh link:
        # a local backend ejected again and again is reported to the supervisor, which respawns it.
        ejections = Ejections.from_config(supervisor.models, config.routing.outliers,
                                          report=supervisor.report_outlier)
        try:
            auth = AuthGate.at_start(config, host)
        except AuthStartError as exc:
            log.error("client keys: %s", exc)
            notifier.status(f"client keys: {exc}")
            return 1
        # Trace context and, with [tracing], the OpenTelemetry SDK's exporter (agent/serving/tracing.py):
        # stopped after the API (last in, first out), so the last requests' spans go out.
        tracing = Tracing(config.tracing, node_name=config.node.name)
        try:
            tracing.start()
        except TracingUnavailable as exc:
            log.error("%s", exc)
            notifier.status(str(exc))
            return 1
        stack.push_async_callback(tracing.stop)
        # Prefix-aware routing (agent/serving/prefix_routing.py), shared by the pipeline and the mesh link.
        prefixes = PrefixRouting(PrefixSettings.from_config(config.routing), supervisor.models)
        mesh = None
        sync: RevocationSync | None = None
        stopping: dict[str, StopDecision] = {}  # the stop intent, once asked (_stop_serving)
        mesh_usage: MeshUsage | None = None
        if config.mesh is not None:
            mesh = MeshLink(config, supervisor.models, queues=queues, upstream=upstream,
                            draining=lambda: api.draining, gpus=lambda: gpus.inventory, ejections=ejections,
                            prefixes=prefixes)
            # Gangs (agent/gang/): this host's parts when a head asks; its routes before the listener starts.
            gang_worker = GangWorker(supervisor.node, mesh.node)
            gang_worker.add_routes(mesh.node.app)
            # This host's gang parts stop with it, or keep running for a restart (systemd's).
            stack.push_async_callback(lambda: gang_worker.stop(
                restart=stopping.get("decision") is not None and stopping["decision"].intent is StopIntent.RESTART))
            # viiworkctl usage --mesh: this node's ledger for peers that ask (agent/peering/mesh_usage.py).
            mesh_usage = MeshUsage(mesh, config.usage.file(config.node.state_dir))
            if auth is not None and auth.revocations is not None:
                # The revocation list across the mesh: its routes go on the mesh listener before it starts.
                sync = RevocationSync(auth, mesh)
        # Mesh-wide key limits (agent/peering/usage_share.py): each node reports what it admitted.
        usage_share = None
        if mesh is not None and auth is not None:
            link = mesh
            usage_share = UsageShare(auth.limiter, lambda: link.node.node_id, link.node.peers, lambda: link.session)
            usage_share.add_routes(link.node.app)
            auth.pacer = usage_share.pace
        # This machine's names for the Host check (getfqdn may wait for DNS: off the loop).
        browser_policy = await asyncio.to_thread(BrowserPolicy.of_this_host, config.api.allowed_hosts,
                                                 config.api.allowed_origins)
        api = ClientApi(
            node_name=config.node.name,
            runtimes=supervisor.models,
            upstream=upstream,
            max_body_bytes=config.api.max_body_bytes,
            queue_max=config.routing.queue_max,
            queue_timeout_s=config.routing.queue_timeout_s,
            status_source=supervisor.status,
            extra_status={"gpus": gpus.status_section},
            forward_retry=config.routing.forward_retry,
            body_read_timeout_s=config.api.body_read_timeout_s,
            body_timeout_s=config.api.body_timeout_s,
            queues=queues,
            mesh=mesh,
            ejections=ejections,
            browser=BrowserGuard(browser_policy),
            auth=auth,
            ledger=ledger,
            tracing=tracing,
            prefixes=prefixes,
        )
        if mesh is not None and config.mesh is not None:
            api.extra_status["mesh"] = mesh.status
            if config.mesh.trust == "open":
                log.warning("mesh trust is \"open\": node certificates are self-signed and pinned on first use; "
                            "any host that reaches the mesh port first can join mesh %r. Use trust = \"ca\" "
                            "outside labs.", config.mesh.mesh_id)

            def on_refuse(line: str) -> None:
                refused.append(line)
                stop.set()

            mesh.node.on_refuse.append(on_refuse)
            try:
                await mesh.start()
            except MeshStartError as exc:
                log.error("mesh: %s", exc)
                notifier.status(f"mesh: {exc}")
                return 1
            supervisor.set_node_id(mesh.node.node_id)
            link_for_gangs = mesh
            supervisor.attach_gangs(lambda runtime: GangHead(supervisor.node, lambda: runtime.config, link_for_gangs))
            if any(m.hosts for m in config.models):  # parts left by an earlier agent, before the supervisor's adoption
                supervisor.gang_parts_claimed = await gang_worker.adopt()
            if any(m.hosts for m in config.models):
                # The summary's ``gangs`` extension (agent/peering/gang_ext.py): heads and parts.
                mesh.gang_members = lambda: [
                    *(m for rt in supervisor.models.values() if rt.gang is not None
                      for m in [rt.gang.membership()] if m is not None),
                    *gang_worker.memberships()]
                api.extra_status["gangs"] = lambda: {
                    "heads": {name: rt.gang.status() for name, rt in supervisor.models.items() if rt.gang is not None},
                    **gang_worker.status()}
                # The tunnels' counters (agent/gang/tunnel.py): the heads' processes', the workers' exits.
                api.metric_sources.append(lambda: tunnel_metric_families([
                    *(v for rt in supervisor.models.values() if isinstance(rt.gang, GangHead)
                      for v in rt.gang.tunnel_views()),
                    *gang_worker.exits()]))
            stack.push_async_callback(mesh.stop)
            if any(m.hosts for m in config.models):  # this host's parts follow their heads (agent/gang/worker.py)
                stack.push_async_callback(_cancel, asyncio.create_task(gang_worker.run(), name="gang-heads"))
            if sync is not None:
                await sync.start()
                stack.push_async_callback(sync.stop)  # before mesh.stop (last in, first out)
                api.metric_sources.append(sync.metric_families)
                api.extra_status["revocations"] = sync.status
            if usage_share is not None:  # stopped before the mesh's session closes
                api.extra_status["usage_reports"] = usage_share.status
                api.metric_sources.append(usage_share.metric_families)
                stack.push_async_callback(usage_share.stop)
                stack.push_async_callback(_cancel, asyncio.create_task(usage_share.run(), name="usage-share"))
        writes = api.mesh.node.writes if api.mesh is not None else PendingWrites()
        key_writes = supervisor.writes  # engine key files a launch could not write (agent/supervision/supervisor.py)
        api.extra_status["usage"] = lambda: ledger.stats().as_dict()
        api.extra_status["state_dir"] = lambda: {"path": str(config.node.state_dir),
                                                 "pending_writes": writes.status() + key_writes.status()}
        app_runner = web.AppRunner(api.build_app(), handler_cancellation=True, access_log=None,
                                   keepalive_timeout=config.api.keepalive_timeout_s,
                                   max_field_size=PARSER_MAX_FIELD_BYTES, max_line_size=PARSER_MAX_FIELD_BYTES)
        await app_runner.setup()
        stack.push_async_callback(app_runner.cleanup)
        actions = node_actions(supervisor=supervisor, api=api, config_path=config_path,
                               push_revocations=operator_push(auth, sync),
                               usage=mesh_usage.gather if mesh_usage is not None else None)
        admin_runner = web.AppRunner(build_admin_app(actions), access_log=None)
        await admin_runner.setup()
        stack.push_async_callback(admin_runner.cleanup)
        try:
            await start_admin_site(admin_runner, config.api.admin_socket)
        except OSError as exc:
            log.error("cannot create the admin socket %s (api.admin_socket): %s", config.api.admin_socket,
                      exc.strerror or exc)
            return 1

        def on_sighup() -> None:
            async def reload() -> None:
                try:
                    result = await actions.reload()
                    log.info("SIGHUP reload: %s", {k: v for k, v in result.items() if v})
                except ActionError as exc:
                    log.error("SIGHUP reload failed: %s", exc)
            task = asyncio.create_task(reload(), name="reload")
            reloads.add(task)
            task.add_done_callback(reloads.discard)

        reloads: set[asyncio.Task] = set()
        loop.add_signal_handler(signal.SIGHUP, on_sighup)
        # Connection caps and the request-head deadline: agent/serving/api_listener.py.
        site = ApiSite(app_runner, host, port, ConnectionLimits(
            head_timeout_s=config.api.head_timeout_s, max_connections=config.api.max_connections,
            max_connections_per_address=config.api.max_connections_per_address), node_name=config.node.name)
        try:
            await site.start()
        except OSError as exc:
            log.error("cannot listen on %s (api.listen): %s%s", config.api.listen, exc.strerror or exc,
                      "; run the demo on another port with --listen 127.0.0.1:PORT" if source == DEMO_SOURCE else "")
            return 1
        log.info("API listening on %s:%d", host, port)
        assert site.guard is not None
        api.metric_sources += [site.guard.metric_families, protocol_log.install().metric_families]
        api.extra_status["api"] = site.guard.status
        # Only now, with every listener (mesh, admin socket, API) known to be ours, do the
        # engines start or get adopted: an agent that fails to bind never touches, nor on its
        # way out stops, engines of another agent of this node (docs/reliability.md).
        await supervisor.start()
        # On the way out: drain and stop the engines, or leave them running when systemd is
        # restarting the agent (the next one adopts them): viiwork.agent.notify.
        stack.push_async_callback(lambda: finish_supervision(supervisor, runner, notifier, stopping.get("decision")))
        stack.push_async_callback(_cancel, asyncio.create_task(gpus.async_run(interval_s=10.0), name="gpus"))
        if ready_banner:
            print(ready_lines(host, port, config, demo=source == DEMO_SOURCE), flush=True)
        notifier.ready(status_line(supervisor.models))
        stack.push_async_callback(_cancel, asyncio.create_task(notifier.run_watchdog(), name="watchdog"))
        stack.push_async_callback(_cancel, asyncio.create_task(
            run_status(notifier, lambda: status_line(supervisor.models)), name="status"))
        await stop.wait()
        if refused:
            notifier.status(refused[0])
        await _stop_serving(api, runner, notifier, config, stopping)
    if refused:
        log.error("%s", refused[0])
        return EXIT_IDENTITY_CONFLICT
    return 0


async def _stop_serving(api: ClientApi, runner: Runner, notifier: Notifier, config: Config,
                        stopping: dict[str, StopDecision]) -> None:
    """The first half of the way out (docs/architecture.md, "Stopping"); the exit stack then
    stops (or hands over) the engines and closes the listeners.

    At once: new requests get 503 + Retry-After and ``/health`` 503. Peers learn
    ``leaving`` (a stop) or ``restarting`` (systemd starts the agent again) from the next
    gossip round and send no new forward here. Every request in flight, local or relayed in
    either direction, runs to its end within ``health.drain_timeout_s`` (the intent question
    to systemd included); what still runs then ends with an SSE error event or a 503
    (viiwork.agent.serving.drain). Only then does the mesh listener close (and push the final
    summary to a few peers), so no hop through it is cut.
    """
    began = time.monotonic()
    api.draining = True
    api.stopping = True
    log.info("stopping: %d request(s) in flight", len(api.in_flight))
    decision = stopping["decision"] = await runner_stop_intent(runner)
    restart = decision.intent is StopIntent.RESTART
    what = "restarting" if restart else "stopping"
    notifier.stopping(f"{what}: draining {len(api.in_flight)} request(s) in flight")
    if api.mesh is not None:
        api.mesh.begin_stop(restart=restart)
    budget = config.health.drain_timeout_s
    outcome = await api.in_flight.drain(
        budget - (time.monotonic() - began),
        f"node {config.node.name!r} is {what} and ended this request: it ran past "
        f"health.drain_timeout_s ({budget:g} s)")
    log.info("drained in %.1f s: %d request(s) were in flight, %d stream(s) ended with an error event, "
             "%d request(s) answered 503", outcome.seconds, outcome.waited_for, outcome.cut_streams,
             outcome.cut_unstarted)
    if api.mesh is not None:
        await api.mesh.stop()


def _vendor_lookup(inventory: GpuInventory) -> Callable[[str], str]:
    """Map a configured GPU reference (index or UUID, as text) to its vendor name."""
    def vendor_of(ref: str) -> str:
        try:
            return inventory.resolve(int(ref) if ref.isdigit() else ref).vendor.value
        except (GpuRefError, ValueError, KeyError):
            return "unknown"
    return vendor_of


def build_parser() -> argparse.ArgumentParser:
    """viiwork-agent's command line (also the source of its man page: agent/cli/manpage.py)."""
    parser = argparse.ArgumentParser(
        prog="viiwork-agent",
        description="The viiwork host agent: runs the models of its config as engine backends, serves an "
                    "OpenAI-compatible API and joins its mesh. Stops on SIGTERM or SIGINT; SIGHUP or "
                    "`viiworkctl reload` re-reads the config.")
    group = parser.add_mutually_exclusive_group()
    group.add_argument("--config", type=Path, help=f"config file (default {DEFAULT_CONFIG_PATH})")
    group.add_argument("--demo", action="store_true",
                       help="run the embedded demo config: SmolLM2-135M on the CPU as model 'smollm2' on 127.0.0.1:8086")
    parser.add_argument("--listen", metavar="HOST:PORT",
                        help="with --demo: the demo's API address instead of 127.0.0.1:8086")
    parser.add_argument("--log-level", default=os.environ.get("VIIWORK_LOG_LEVEL", "info"),
                        choices=["debug", "info", "warning", "error"],
                        help="the agent's log level (default: $VIIWORK_LOG_LEVEL, else info)")
    parser.add_argument("--version", action="version", version=f"viiwork-agent {__version__}")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.listen is not None and not args.demo:
        parser.error("--listen is for --demo (a config file sets api.listen)")
    setup_logging(args.log_level)
    raise_open_file_limit()  # each client connection holds a descriptor: agent/serving/api_listener.py
    try:
        if args.demo:
            from viiwork.agent.config.demo import DemoUnavailable, demo_config_text

            try:
                text = demo_config_text(args.listen)
            except DemoUnavailable as exc:
                print(f"viiwork-agent --demo: {exc}", file=sys.stderr)
                return 1
            config = parse_config(text, DEMO_SOURCE)
            source = DEMO_SOURCE
        else:
            path = args.config or DEFAULT_CONFIG_PATH
            source, text = str(path), read_config_text(path)  # a regular file, at most 1 MiB
            config = parse_config(text, source)
    except ConfigError as exc:
        print(str(exc), file=sys.stderr)
        return 1
    try:
        return asyncio.run(run_agent(config, source=source, text=text,
                                     config_path=None if args.demo else (args.config or DEFAULT_CONFIG_PATH)))
    except RunnerError as exc:
        print(f"viiwork-agent: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
