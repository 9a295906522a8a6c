"""Run one MeshNode in its own process, with a loopback HTTP API that serves ``GET /v1/mesh``
(as the agent will), for the real-process mesh tests and the real-process benchmark.

    python tests/support/mesh_runner.py --state DIR --name n1 --trust open --mesh-id lab \
        --discovery mdns,seeds [--seeds 127.0.0.1:P] [--ca CA.crt] [--model m] [--interval-ms 200] \
        [--connect-timeout-s 0.5] [--exchange-timeout-s 1.0] [--detector probe]

Everything binds 127.0.0.1 only (mDNS too), or ``--host`` (a namespace's address). When ready it prints one JSON line
``{"node_id", "mesh_port", "api_port"}``. SIGTERM stops gracefully (publishes ``leaving``);
SIGKILL is a crash. ``GET /v1/counters`` adds the process's CPU time and ``POST /v1/busy``
``{"busy": n}`` changes the published load (both for the benchmark) and answers once it is
published, with ``published_at`` (``time.monotonic()``, shared by every process of the host). ``--churn-per-s R``
moves the load one slot up or down R times a second on average (exponential gaps: requests
starting and ending, issue 16's realistic load) until a ``POST /v1/busy`` (that goes on
churning from its load with ``"churn": true``); ``GET /v1/brief``
is ``{node_id: [liveness, busy of its first model]}`` for every peer (cheap to poll at 50
nodes, unlike ``/v1/mesh``; ``?id=NODE_ID``: that peer only). ``POST /v1/watch`` ``{"id", "busy"}`` notes (every 5 ms,
in this process) when that peer first shows that load; ``GET /v1/watch`` is ``{"seen_at"}``
(``time.monotonic()``, or null). ``VIIWORK_RUNNER_PROFILE=DIR``
writes the process's CPU profile (cProfile) to ``DIR/NAME.prof`` when it stops.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import logging
import os
import random
import signal
import sys
import time
from pathlib import Path

from aiohttp import web

from viiwork.mesh.identity import NodeId
from viiwork.mesh.membership import GossipSettings
from viiwork.mesh.node import MeshNode, MeshSettings
from viiwork.mesh.summary import ModelCapacity, PublishedState


async def main(args: argparse.Namespace) -> int:
    gossip = GossipSettings(gossip_interval_ms=args.interval_ms, suspect_after_ms=args.suspect_ms,
                            dead_after_ms=args.dead_ms, scale_with_size=False)
    node_ref: dict[str, MeshNode] = {}
    state: dict[str, ModelCapacity] = {}

    async def mesh_view(request: web.Request) -> web.Response:
        return web.json_response(node_ref["node"].view())

    async def counters(request: web.Request) -> web.Response:
        times = os.times()
        return web.json_response({**node_ref["node"].counters(), "cpu_s": times.user + times.system})

    churn = {"on": args.churn_per_s > 0}

    async def churn_loop() -> None:
        rng = random.Random()
        while churn["on"]:
            await asyncio.sleep(rng.expovariate(args.churn_per_s))
            if not churn["on"]:
                return
            busy = state["model"].busy
            step = rng.choice((-1, 1)) if 0 < busy < args.slots else (1 if busy == 0 else -1)
            state["model"] = dataclasses.replace(state["model"], busy=busy + step)  # read by the provider

    async def brief(request: web.Request) -> web.Response:
        m = node_ref["node"].membership
        wanted = request.query.get("id")  # one peer: what the benchmark polls while it times a change
        if m is None:
            peers = []
        elif wanted is None:
            peers = m.peers()
        else:
            peers = [p for p in [m.peer(NodeId(wanted))] if p is not None]
        return web.json_response({p.node_id: [p.liveness.value, p.models[0].busy if p.models else None]
                                  for p in peers})

    async def set_busy(request: web.Request) -> web.Response:
        body = await request.json()
        busy = int(body["busy"])
        churn["on"] = False
        if body.get("churn") and args.churn_per_s > 0:  # from this load on, churn again
            churn["on"] = True
            asyncio.get_running_loop().create_task(churn_loop())
        state["model"] = ModelCapacity(args.model, "llamacpp", "chat", args.slots, busy, None, 4096, 1, 1,
                                       f"fp-{args.model}")
        node = node_ref["node"]
        assert node.publisher is not None
        seq = node.publisher.seq
        node.set_local_summary([state["model"]], PublishedState.SERVING)
        # The moment the change goes out (the publication limit may hold a load change back:
        # up to n_live / 40 s, docs/mesh.md "Publication rate"), on the host's monotonic clock,
        # which the benchmark shares; None when nothing was published within 5 s.
        published_at = None
        for _ in range(1000):
            if node.publisher.seq != seq:
                published_at = time.monotonic()
                break
            await asyncio.sleep(0.005)
        return web.json_response({"busy": busy, "seq": node.publisher.seq, "published_at": published_at})

    watch: dict[str, object] = {}

    async def start_watch(request: web.Request) -> web.Response:
        """Note, on this process's own loop (every 5 ms), when peer ``id`` first shows ``busy``:
        the benchmark times a change without the delay of polling 50 processes over HTTP."""
        body = await request.json()
        watch.clear()
        watch.update(id=NodeId(str(body["id"])), busy=int(body["busy"]), seen_at=None)

        async def look() -> None:
            m = node_ref["node"].membership
            for _ in range(6000):  # 30 s
                p = None if m is None else m.peer(watch["id"])  # type: ignore[arg-type]
                if p is not None and p.models and p.models[0].busy == watch["busy"]:
                    watch["seen_at"] = time.monotonic()
                    return
                await asyncio.sleep(0.005)

        asyncio.get_running_loop().create_task(look())
        return web.json_response({"watching": str(body["id"])})

    async def watched(request: web.Request) -> web.Response:
        return web.json_response({"seen_at": watch.get("seen_at")})

    api = web.Application()
    api.router.add_post("/v1/watch", start_watch)
    api.router.add_get("/v1/watch", watched)
    api.router.add_get("/v1/mesh", mesh_view)
    api.router.add_get("/v1/counters", counters)
    api.router.add_post("/v1/busy", set_busy)
    api.router.add_get("/v1/brief", brief)
    runner = web.AppRunner(api, access_log=None, handle_signals=False)
    await runner.setup()
    site = web.TCPSite(runner, args.host, 0)
    await site.start()
    api_port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]

    settings = MeshSettings(
        state_dir=Path(args.state), name=args.name, trust=args.trust, listen=f"{args.host}:{args.mesh_port}",
        advertise=args.host, api_listen=f"{args.host}:{api_port}", interfaces=(args.host,),
        discovery=tuple(args.discovery.split(",")), seeds=tuple(s for s in args.seeds.split(",") if s),
        mesh_id=args.mesh_id, ca_certificate=Path(args.ca) if args.ca else None, gossip=gossip, version="runner",
        connect_timeout_s=args.connect_timeout_s, exchange_timeout_s=args.exchange_timeout_s, detector=args.detector)
    state["model"] = ModelCapacity(args.model, "llamacpp", "chat", args.slots, 0, None, 4096, 1, 1, f"fp-{args.model}")
    node = MeshNode(settings, provider=lambda: ([state["model"]], PublishedState.SERVING))
    node_ref["node"] = node
    await node.start()
    print(json.dumps({"node_id": node.node_id, "mesh_port": node.listen_port, "api_port": api_port}), flush=True)
    churning = asyncio.get_running_loop().create_task(churn_loop()) if churn["on"] else None

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGTERM, stop.set)
    loop.add_signal_handler(signal.SIGINT, stop.set)
    while not stop.is_set():
        if args.view_file:
            tmp = Path(args.view_file + ".tmp")
            tmp.write_text(json.dumps(node.view()))
            tmp.replace(args.view_file)
        try:
            await asyncio.wait_for(stop.wait(), 0.2)
        except TimeoutError:
            pass
    churn["on"] = False
    if churning is not None:
        churning.cancel()
    await node.stop(leave=True)
    await runner.cleanup()
    return 0


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser()
    ap.add_argument("--state", required=True)
    ap.add_argument("--name", required=True)
    ap.add_argument("--trust", choices=["ca", "open"], required=True)
    ap.add_argument("--mesh-id")
    ap.add_argument("--ca")
    ap.add_argument("--discovery", default="mdns,seeds")
    ap.add_argument("--seeds", default="")
    ap.add_argument("--mesh-port", type=int, default=0)
    ap.add_argument("--model", default="m")
    ap.add_argument("--interval-ms", type=int, default=200)
    ap.add_argument("--suspect-ms", type=int, default=1000)
    ap.add_argument("--dead-ms", type=int, default=3000)
    ap.add_argument("--connect-timeout-s", type=float, default=0.5)
    ap.add_argument("--exchange-timeout-s", type=float, default=1.0)
    ap.add_argument("--host", default="127.0.0.1", help="listen, advertise and run mDNS on this address")
    ap.add_argument("--detector", choices=["heartbeat", "probe"], default="probe")
    ap.add_argument("--slots", type=int, default=4)
    ap.add_argument("--churn-per-s", type=float, default=0.0)
    ap.add_argument("--view-file", help="write the /v1/mesh document here every 200 ms")
    ap.add_argument("--log-level", default="WARNING")
    return ap.parse_args(argv)


if __name__ == "__main__":
    ns = parse()
    logging.basicConfig(level=ns.log_level, format="%(name)s %(levelname)s %(message)s")
    profile_dir = os.environ.get("VIIWORK_RUNNER_PROFILE")  # a directory: cProfile each node into it
    if not profile_dir:
        sys.exit(asyncio.run(main(ns)))
    import cProfile

    profiler = cProfile.Profile(time.process_time)  # CPU time, not time asleep in epoll
    rc = profiler.runcall(asyncio.run, main(ns))
    profiler.dump_stats(str(Path(profile_dir) / f"{ns.name}.prof"))
    sys.exit(rc)
