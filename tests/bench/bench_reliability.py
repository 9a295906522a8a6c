"""Faults between real agents (issue 13): a stopped origin, a frozen peer, a client that leaves.

Not a test. Three ``viiwork-agent`` processes on loopback (``support.agent.run_agent``), open
trust, found by seeds, mesh settings at their defaults (``gossip_interval_ms`` 500,
``suspect_after_ms`` 2000, ``dead_after_ms`` 10000), each model on a fake llama-server
(``support.engines``; a separate process, 1 backend):

- A serves ``local`` (2 slots, a token every 50 ms), B ``shared`` (4 slots, a token every
  50 ms), C ``shared`` (1 slot, a token every 5 ms). A's router picks B for ``shared`` (more
  free slots); a request re-run on C answers at once.
- ``health.drain_timeout_s`` 20, ``supervisor.stop_timeout_s`` 5, ``routing.queue_max`` 0.

Rounds (``-n`` each, min / median / max reported):

(a) SIGTERM of A with three streams past their first byte: one relayed from C (A the origin),
    one local, one relayed in (B the origin); each of ~3 s. Measured from the signal: A's
    exit, each stream's end (``[DONE]``, an SSE error event, or cut without either: the
    goal is 0), and the first liveness other than ``alive`` that B and C show for A (every
    20 ms; the goal is ``left``). A is started again (same mesh port and identity) between
    rounds.
(b) SIGSTOP of B with a stream from B past its first byte and a non-streamed request on B
    (40 tokens, 2 s there) before its first byte, both from A: seconds from the signal until
    the stream's client gets an error event and until the non-streamed client gets its
    answer (re-run on C). Goal: both <= suspect_after_ms + 5 s. Then SIGCONT, and B is free
    and alive in A's view before the next round.
(c) A client that leaves once its request runs (streamed: after the first event; not
    streamed: 0.3 s after the engine shows it busy): seconds from the close until the agent
    that owns the slot shows the model's ``busy`` at 0 in /v1/status, and until the engine's
    own count is 0 (the fake engine's ``/fake/stats``, llama-server's ``GET /slots``, read over
    the engine's Unix socket with its key: support.agent.Agent.engine_session), polled
    every 20 ms. Locally (client -> B) and across a hop (client -> A ``?host=node-b``) with the
    fake engine; locally with the real llama-server (``.venv/bin/llama-server``, the demo's
    SmolLM2-135M, ``parallel`` 1, ``max_tokens`` 2000 with ``ignore_eos``). "still busy" when
    the slot was not free within 15 s.

About 40 s with the defaults on a 2-core VM (37 s measured). Prints a Markdown section (and writes it to
``--out`` when given).

Usage: .venv/bin/python tests/bench/bench_reliability.py [-n 3] [--no-real] [--out FILE]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import signal
import statistics
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path.insert(0, str(HERE.parent))  # tests/ for support.*

from support.agent import ENGINE_URL, Agent, run_agent  # noqa: E402
from support.engines import fake_engine_binary  # noqa: E402
from support.procs import free_port  # noqa: E402

POLL_S = 0.02
GIVE_UP_S = 15.0
SUSPECT_MS = 2000  # mesh.suspect_after_ms default, stated in the output
DRAIN_S, STOP_S = 20.0, 5.0
SLOW = {"FAKE_LOAD_S": "0.1", "FAKE_TOKENS": "2000", "FAKE_TOKEN_DELAY_S": "0.05"}
FAST = {"FAKE_LOAD_S": "0.1", "FAKE_TOKENS": "2000", "FAKE_TOKEN_DELAY_S": "0.005"}
LLAMA_SERVER = ROOT / ".venv" / "bin" / "llama-server"


def chat(model: str, tokens: int, stream: bool, **extra: object) -> dict:
    return {"model": model, "stream": stream, "max_tokens": tokens,
            "messages": [{"role": "user", "content": "Write a very long story about the sea."}], **extra}


def fake_model(name: str, binary: Path, parallel: int, env: dict[str, str]) -> dict:
    return {"name": name, "engine": "llamacpp", "path": "/dev/null", "parallel": parallel, "backends": 1,
            "llamacpp": {"binary": str(binary)}, "env": env}


def mesh_extra(listen_port: int, seeds: list[str]) -> dict:
    return {"mesh": {"trust": "open", "mesh_id": "bench-reliability", "listen": f"127.0.0.1:{listen_port}",
                     "advertise": "127.0.0.1", "discovery": ["seeds"], "seeds": seeds},
            "routing": {"queue_max": 0, "stale_after_ms": 3000},
            "health": {"drain_timeout_s": DRAIN_S}, "supervisor": {"stop_timeout_s": STOP_S}}


async def until(check: Callable[[], Awaitable[bool]], timeout_s: float) -> float | None:
    """Seconds until ``await check()`` is true, polled every POLL_S; None past ``timeout_s``."""
    start = time.monotonic()
    while time.monotonic() - start < timeout_s:
        try:
            if await check():
                return time.monotonic() - start
        except (aiohttp.ClientError, OSError, ValueError, KeyError, StopIteration):
            pass
        await asyncio.sleep(POLL_S)
    return None


async def must(check: Callable[[], Awaitable[bool]], timeout_s: float, what: str) -> None:
    if await until(check, timeout_s) is None:
        raise SystemExit(f"timed out after {timeout_s} s waiting for {what}")


async def get_json(http: aiohttp.ClientSession, url: str) -> object:
    async with http.get(url) as r:
        return await r.json()


async def agent_busy(http: aiohttp.ClientSession, agent: Agent, model: str) -> int:
    doc = await get_json(http, f"{agent.url}/v1/status")
    return next(m["busy"] for m in doc["models"] if m["name"] == model)


# An engine answers only the agent: its Unix socket and key (support.agent.Agent.engine_session).
async def fake_engine_busy(engine: aiohttp.ClientSession) -> int:
    return (await get_json(engine, f"{ENGINE_URL}/fake/stats"))["busy"]


async def llama_busy(engine: aiohttp.ClientSession) -> int:
    return sum(1 for slot in await get_json(engine, f"{ENGINE_URL}/slots") if slot.get("is_processing"))


async def peer(http: aiohttp.ClientSession, viewer: Agent, name: str) -> dict | None:
    doc = await get_json(http, f"{viewer.url}/v1/mesh")
    return next((n for n in doc["nodes"] if n["name"] == name), None)


async def free_in(http: aiohttp.ClientSession, viewer: Agent, name: str, model: str) -> int:
    """Free slots of ``model`` on ``name`` in ``viewer``'s view; -1 unless it is alive there."""
    n = await peer(http, viewer, name)
    if n is None or n["liveness"] != "alive" or n.get("state", "serving") != "serving":
        return -1
    return sum(m["slots"] - m["busy"] for m in n["models"] if m["name"] == model)


def events_in(raw: bytes) -> list[str]:
    return [line[6:] for line in raw.decode(errors="replace").split("\n") if line.startswith("data: ")]


def outcome(events: list[str]) -> str:
    """``done`` ([DONE] last), ``error`` (an SSE error event) or ``cut`` (neither)."""
    if events and events[-1] == "[DONE]":
        return "done"
    for e in events:
        try:
            if isinstance(json.loads(e), dict) and "error" in json.loads(e):
                return "error"
        except ValueError:
            pass
    return "cut"


async def open_stream(http: aiohttp.ClientSession, url: str, body: dict) -> aiohttp.ClientResponse:
    resp = await http.post(url, json=body)
    if resp.status != 200 or not (await resp.content.readline()).startswith(b"data: "):
        raise SystemExit(f"{url}: stream did not start ({resp.status}): {(await resp.text())[:300]}")
    return resp


async def stream_end(resp: aiohttp.ClientResponse, since: float, timeout_s: float) -> tuple[str, float]:
    try:
        raw = await asyncio.wait_for(resp.read(), timeout_s)
    except (TimeoutError, aiohttp.ClientError):
        raw = b""
    finally:
        resp.close()
    return outcome(events_in(raw)), time.monotonic() - since


@dataclass
class Mesh:
    tmp: Path
    binary: Path
    stack: ExitStack
    a_mesh_port: int = field(default_factory=free_port)
    agents: dict[str, Agent] = field(default_factory=dict)

    def mesh_address(self, agent: Agent) -> str:
        return agent.wait_for(lambda d: bool(d["mesh"]["self"]["mesh"]), 30, "mesh address")["mesh"]["self"]["mesh"]

    def start_a(self, seeds: list[str]) -> Agent:
        self.agents["a"] = self.stack.enter_context(run_agent(
            self.tmp, [fake_model("local", self.binary, 2, SLOW)], name="node-a",
            extra=mesh_extra(self.a_mesh_port, seeds)))
        return self.agents["a"]

    def start(self) -> None:
        a = self.start_a([])
        seeds = [self.mesh_address(a)]
        for name, parallel, env in (("b", 4, SLOW), ("c", 1, FAST)):
            self.agents[name] = self.stack.enter_context(run_agent(
                self.tmp, [fake_model("shared", self.binary, parallel, env)], name=f"node-{name}",
                extra=mesh_extra(0, seeds)))

    async def settled(self, http: aiohttp.ClientSession) -> None:
        """Every backend idle, and A, B, C alive, serving and free in each other's views."""
        a, b, c = (self.agents[k] for k in "abc")

        async def ok() -> bool:
            return (await free_in(http, a, "node-b", "shared") == 4 and await free_in(http, a, "node-c", "shared") == 1
                    and await free_in(http, b, "node-a", "local") == 2 and await free_in(http, c, "node-a", "local") == 2
                    and await agent_busy(http, b, "shared") == 0 and await agent_busy(http, a, "local") == 0)
        await must(ok, 60, "the mesh to settle (all alive, serving, idle)")


async def sigterm_round(http: aiohttp.ClientSession, mesh: Mesh) -> dict:
    a, b, c = (mesh.agents[k] for k in "abc")
    streams = {
        "relayed from C": await open_stream(http, f"{a.url}/v1/chat/completions?host=node-c",
                                            chat("shared", 600, True)),
        "local": await open_stream(http, f"{a.url}/v1/chat/completions", chat("local", 60, True)),
        "relayed in (B origin)": await open_stream(http, f"{b.url}/v1/chat/completions?host=node-a",
                                                   chat("local", 60, True)),
    }
    a.proc.send_signal(signal.SIGTERM)
    sent = time.monotonic()
    ends = {k: asyncio.create_task(stream_end(r, sent, DRAIN_S + STOP_S + 10)) for k, r in streams.items()}

    async def first_change(viewer: Agent) -> tuple[str, float]:
        while time.monotonic() - sent < 30:
            n = await peer(http, viewer, "node-a")
            if n is not None and n["liveness"] != "alive":
                return n["liveness"], time.monotonic() - sent
            await asyncio.sleep(POLL_S)
        return "alive", float("nan")

    seen = await asyncio.gather(first_change(b), first_change(c))
    code = await asyncio.to_thread(a.proc.wait, DRAIN_S + STOP_S + 30)
    exited = time.monotonic() - sent
    results = {k: await t for k, t in ends.items()}
    return {"exit_s": exited, "exit_code": code, "streams": results, "seen": seen}


async def sigstop_round(http: aiohttp.ClientSession, mesh: Mesh) -> dict:
    a, b = mesh.agents["a"], mesh.agents["b"]
    url = f"{a.url}/v1/chat/completions"
    async with b.engine_session("shared") as engine:
        return await _sigstop_round(http, a, b, url, engine)


async def _sigstop_round(http: aiohttp.ClientSession, a: Agent, b: Agent, url: str,
                         engine: aiohttp.ClientSession) -> dict:
    streaming = await open_stream(http, url, chat("shared", 1000, True))
    if streaming.headers.get("X-Viiwork-Node") != "node-b":
        raise SystemExit(f"the stream ran on {streaming.headers.get('X-Viiwork-Node')}, not node-b")

    async def whole() -> tuple[int, str, float]:
        async with http.post(url, json=chat("shared", 40, False)) as r:
            await r.read()
            return r.status, r.headers.get("X-Viiwork-Node", ""), time.monotonic()

    waiting = asyncio.create_task(whole())
    await must(lambda: _at_least(fake_engine_busy(engine), 2), 10, "the non-streamed request on B's engine")
    os.kill(b.proc.pid, signal.SIGSTOP)
    stopped = time.monotonic()
    try:
        stream_result = await stream_end(streaming, stopped, 60)
        status, node, answered = await asyncio.wait_for(waiting, 60)
    finally:
        os.kill(b.proc.pid, signal.SIGCONT)
    back = await until(lambda: _equals(free_in(http, a, "node-b", "shared"), 4), 30)  # from SIGCONT
    return {"stream": stream_result, "whole": (status, node, answered - stopped), "alive_again_s": back}


async def _at_least(value: Awaitable[int], n: int) -> bool:
    return await value >= n


async def _equals(value: Awaitable[int], n: int) -> bool:
    return await value == n


async def leave_once(http: aiohttp.ClientSession, url: str, body: dict, owner: Agent, model: str,
                     engine_busy: Callable[[], Awaitable[int]], headers: dict[str, str] | None = None
                     ) -> tuple[float | None, float | None]:
    """Send ``body``, leave once it runs; seconds until the owner's busy and the engine's are 0."""
    await must(lambda: _both_idle(http, owner, model, engine_busy), 60, "an idle slot before the request")
    session = aiohttp.ClientSession()  # its own connection, closed by the cancel

    async def run() -> None:
        async with session.post(url, json=body, headers=headers or {}) as r:
            if body.get("stream"):
                await r.content.readline()
                await asyncio.sleep(3600)  # the client stays until it is cancelled
            await r.read()

    task = asyncio.create_task(run())
    try:
        await must(lambda: _at_least(engine_busy(), 1), 30, "the request to reach the engine")
        await must(lambda: _at_least(agent_busy(http, owner, model), 1), 10, "the owner to count the slot busy")
        await asyncio.sleep(0.3)
        if task.done():
            raise SystemExit(f"the request ended before the client left: {task.exception()!r}")
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
    finally:
        await session.close()
    closed = time.monotonic()
    agent_s = engine_s = None
    while time.monotonic() - closed < GIVE_UP_S and (agent_s is None or engine_s is None):
        try:
            if agent_s is None and await agent_busy(http, owner, model) == 0:
                agent_s = time.monotonic() - closed
            if engine_s is None and await engine_busy() == 0:
                engine_s = time.monotonic() - closed
        except (aiohttp.ClientError, OSError, ValueError):
            pass
        await asyncio.sleep(POLL_S)
    return agent_s, engine_s


async def _both_idle(http: aiohttp.ClientSession, owner: Agent, model: str,
                     engine_busy: Callable[[], Awaitable[int]]) -> bool:
    return await agent_busy(http, owner, model) == 0 and await engine_busy() == 0


def stats(values: list[float | None]) -> str:
    """``min / median / max`` in seconds, or how many were still busy."""
    got = [v for v in values if v is not None and v == v]
    if not got:
        return f"still busy ({len(values)}/{len(values)})"
    text = f"{min(got):.2f} / {statistics.median(got):.2f} / {max(got):.2f}"
    missing = len(values) - len(got)
    return text + (f" ({missing} still busy)" if missing else "")


async def fake_part(args: argparse.Namespace, tmp: Path) -> dict:
    binary = fake_engine_binary(tmp / "bin")
    out: dict = {"disconnect": {}, "sigstop": [], "sigterm": []}
    with ExitStack() as stack:
        mesh = Mesh(tmp, binary, stack)
        mesh.start()
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as http:
            await mesh.settled(http)
            a, b = mesh.agents["a"], mesh.agents["b"]
            engine = b.engine_session("shared")
            for stream in (False, True):
                for where, url, in (("local", f"{b.url}/v1/chat/completions"),
                                    ("across a hop", f"{a.url}/v1/chat/completions?host=node-b")):
                    runs = [await leave_once(http, url, chat("shared", 1000, stream), b, "shared",
                                             lambda: fake_engine_busy(engine)) for _ in range(args.n)]
                    out["disconnect"][("fake llama-server", where, stream)] = runs
            await engine.close()
            print("  (c) disconnects with the fake engine measured", flush=True)
            for _ in range(args.n):
                await mesh.settled(http)
                out["sigstop"].append(await sigstop_round(http, mesh))
            print("  (b) SIGSTOP rounds measured", flush=True)
            peers = [mesh.mesh_address(mesh.agents[k]) for k in "bc"]
            for i in range(args.n):
                await mesh.settled(http)
                out["sigterm"].append(await sigterm_round(http, mesh))
                if i < args.n - 1:
                    mesh.start_a(peers)
            print("  (a) SIGTERM rounds measured", flush=True)
    return out


async def real_part(args: argparse.Namespace, tmp: Path) -> dict:
    from viiwork.agent.config.demo import find_demo_model

    model = {"name": "real", "engine": "llamacpp", "path": str(find_demo_model()), "ctx_per_slot": 4096,
             "parallel": 1, "backends": 1, "startup_timeout_s": 120, "llamacpp": {"binary": str(LLAMA_SERVER)}}
    out: dict = {}
    with run_agent(tmp, [model], name="node-real") as agent:
        agent.wait_healthy("real", timeout_s=180)
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as http, \
                agent.engine_session("real") as engine:
            for stream in (False, True):
                body = chat("real", 2000, stream, ignore_eos=True, temperature=0, seed=1)
                out[("llama-server", "local", stream)] = [
                    await leave_once(http, f"{agent.url}/v1/chat/completions", body, agent, "real",
                                     lambda: llama_busy(engine)) for _ in range(args.n)]
    print("  (c) disconnects with llama-server measured", flush=True)
    return out


def render(args: argparse.Namespace, fake: dict, real: dict, real_note: str, took_s: float) -> str:
    n = args.n
    lines = ["## Reliability: faults and bad inputs (issue 13)", "",
             f"Three real agents on loopback with fake llama-servers, mesh settings at their defaults "
             f"(`gossip_interval_ms` 500, `suspect_after_ms` {SUSPECT_MS}, `dead_after_ms` 10000), "
             f"`health.drain_timeout_s` {DRAIN_S:.0f}, `supervisor.stop_timeout_s` {STOP_S:.0f}; {n} rounds each, "
             f"seconds as min / median / max ({platform.machine()}, {os.cpu_count()} CPUs; "
             f"`.venv/bin/python tests/bench/bench_reliability.py -n {n}`, {took_s:.0f} s).", "",
             "### SIGTERM of an origin with streams in flight", "",
             "A is the origin of a stream relayed from C and of a local one, and runs a stream relayed in "
             "from B; each would take ~3 s. Seconds from SIGTERM.", "",
             "| figure | result |", "|---|---|"]
    rounds = fake["sigterm"]
    lines.append(f"| A exits (status {', '.join(str(r['exit_code']) for r in rounds)}) | "
                 f"{stats([r['exit_s'] for r in rounds])} |")
    for kind in rounds[0]["streams"]:
        tally = {o: sum(1 for r in rounds if r["streams"][kind][0] == o) for o in ("done", "error", "cut")}
        lines.append(f"| stream {kind}: ends | {stats([r['streams'][kind][1] for r in rounds])}; "
                     f"{tally['done']} with [DONE], {tally['error']} with an error event, {tally['cut']} cut |")
    for i, who in enumerate(("B", "C")):
        values = sorted({r["seen"][i][0] for r in rounds})
        lines.append(f"| {who} sees A leave `alive` (first value seen: {', '.join(values)}) | "
                     f"{stats([r['seen'][i][1] for r in rounds])} |")
    total = len(rounds) * len(rounds[0]["streams"])
    cut = sum(1 for r in rounds for s in r["streams"].values() if s[0] == "cut")
    lines += ["", f"Streams without [DONE] or an error event: {cut} of {total} (goal 0).", "",
              "### SIGSTOP of a peer with forwards in flight", "",
              "B frozen while A relays a stream from it past the first byte and waits on a non-streamed "
              "forward to it (40 tokens) before the first byte. Seconds from SIGSTOP.", "",
              "| figure | result |", "|---|---|"]
    rounds = fake["sigstop"]
    ends = sorted({r["stream"][0] for r in rounds})
    lines.append(f"| stream: the client gets the end (ended by: {', '.join(ends)}) | "
                 f"{stats([r['stream'][1] for r in rounds])} |")
    ran = sorted({f"{r['whole'][0]} from {r['whole'][1]}" for r in rounds})
    lines.append(f"| non-streamed: the client gets its answer ({', '.join(ran)}) | "
                 f"{stats([r['whole'][2] for r in rounds])} |")
    lines.append(f"| after SIGCONT: B alive and free in A's view | {stats([r['alive_again_s'] for r in rounds])} |")
    worst = max([r["stream"][1] for r in rounds] + [r["whole"][2] for r in rounds])
    bound = SUSPECT_MS / 1000 + 5
    over = sum(1 for r in rounds for v in (r["stream"][1], r["whole"][2]) if v > bound)
    lines += ["", f"Waits over suspect_after_ms + 5 s = {bound:.0f} s: {over} of {2 * len(rounds)} "
              f"(worst {worst:.2f} s; goal 0).", "",
              "### Client disconnect: time until the slot is free", "",
              "Seconds from the client's close until the agent that owns the slot shows `busy` 0 in "
              "/v1/status, and until the engine's own count is 0.", "",
              "| engine | path | request | agent busy 0 | engine busy 0 |", "|---|---|---|---|---|"]
    for (engine, where, stream), runs in {**fake["disconnect"], **real}.items():
        lines.append(f"| {engine} | {where} | {'streamed' if stream else 'not streamed'} | "
                     f"{stats([r[0] for r in runs])} | {stats([r[1] for r in runs])} |")
    if real_note:
        lines += ["", real_note]
    return "\n".join(lines) + "\n"


async def amain(args: argparse.Namespace) -> str:
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="vw-bench-reliability-") as tmp:
        for sub in ("fake", "real"):
            (Path(tmp) / sub).mkdir()
        fake = await fake_part(args, Path(tmp) / "fake")
        real, note = {}, ""
        if args.no_real:
            note = "llama-server not measured (--no-real)."
        elif not LLAMA_SERVER.exists():
            note = f"llama-server not measured: {LLAMA_SERVER} is missing."
        else:
            try:
                real = await real_part(args, Path(tmp) / "real")
            except Exception as exc:  # the demo model may be missing; the fake figures still count
                note = f"llama-server not measured: {exc!r}"
    return render(args, fake, real, note, time.monotonic() - started)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("-n", type=int, default=3, help="rounds of each fault")
    p.add_argument("--no-real", action="store_true", help="skip the llama-server rows")
    p.add_argument("--out", type=Path)
    args = p.parse_args()
    text = asyncio.run(amain(args))
    print(text)
    if args.out:
        args.out.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
