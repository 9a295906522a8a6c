"""Added latency of the agent in front of (a) an instant fake OpenAI upstream and (b) one
llama-server with the tiny random model: TTFB and total p50/p99, direct vs through the agent,
and streamed chunk throughput, all in the same run.

usage: .venv/bin/python tests/bench/bench_proxy.py [-n 500] [--out FILE]

Starts its own agents (``viiwork-agent --config``) on loopback with the process runner; the
direct figures go to the same backend the agent routes to (its Unix socket from /v1/status,
with its key: an engine answers only the agent, docs/security.md).
Prints a Markdown section (and writes it to --out when given).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))  # tests/ for support.*

from bench.loadgen import Series, chat_body, ms, run_series  # noqa: E402
from support.agent import ENGINE_URL, Agent  # noqa: E402
from support.engines import fake_engine_binary  # noqa: E402
from support.procs import free_port, stop_process  # noqa: E402


def find_llama_server() -> str | None:
    bindir = Path(sys.executable).parent
    for name in ("llama-server", "llama-server-vulkan"):
        if (bindir / name).exists():
            return str(bindir / name)
    return None


def agent_config(workdir: Path, name: str, binary: str, model_path: str, port: int, env: dict[str, str],
                 mesh: tuple[int, int] | None = None, models: bool = True) -> Path:
    env_lines = "\n".join(f"{k} = {json.dumps(v)}" for k, v in env.items())
    text = f"""
[node]
name = "{name}"
state_dir = {json.dumps(str(workdir / name))}

[api]
listen = "127.0.0.1:{port}"
admin_socket = {json.dumps(str(workdir / name / "admin.sock"))}

[supervisor]
runner = "process"
{mesh_section(workdir, mesh) if mesh else ""}
{"" if models else "# no models: every request is forwarded"}
[[models]]
name = "m"
engine = "llamacpp"
path = {json.dumps(model_path)}
parallel = 4
ctx_per_slot = 512
backends = 1
startup_timeout_s = 60

[models.env]
{env_lines}

[models.llamacpp]
binary = {json.dumps(binary)}
threads = 1
"""
    if not models:
        text = text[:text.index("[[models]]")]
    path = workdir / f"{name}.toml"
    path.write_text(text)
    return path


def mesh_section(workdir: Path, mesh: tuple[int, int]) -> str:
    """Open trust on loopback: own mesh port, and the other agent's as the only seed."""
    own, seed = mesh
    return f"""
[mesh]
trust = "open"
mesh_id = "bench-hop-{os.getpid()}"
listen = "127.0.0.1:{own}"
advertise = "127.0.0.1:{own}"
discovery = ["seeds"]
seeds = ["127.0.0.1:{seed}"]
"""


def measure_hop(work: Path, llama: str, gguf: Path, n: int) -> list[str]:
    """One forwarding hop on the tiny model: origin A (no models) -> peer B -> engine, against
    B's own API (peer -> engine), TTFB and total, same run, interleaved."""
    pa, pb, ma, mb = free_port(), free_port(), free_port(), free_port()
    cfg_b = agent_config(work, "hop-b", llama, str(gguf), pb, {}, mesh=(mb, ma))
    cfg_a = agent_config(work, "hop-a", llama, str(gguf), pa, {}, mesh=(ma, mb), models=False)
    proc_b, _ = start_agent(cfg_b, pb, work / "hop-b.log")
    agent = Path(sys.executable).parent / "viiwork-agent"
    proc_a = subprocess.Popen([str(agent), "--config", str(cfg_a), "--log-level", "warning"],
                              stdout=open(work / "hop-a.log", "ab"), stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{pa}/v1/models", timeout=2) as r:
                    if any(m["id"] == "m" for m in json.load(r)["data"]):
                        break
            except (OSError, ValueError, KeyError):
                pass
            if time.monotonic() > deadline:
                return ["(hop not measured: agent A did not learn of B's model within 60 s)"]
            time.sleep(0.2)
        body = chat_body("m", False, 4)

        async def go() -> dict[str, Series]:
            out: dict[str, Series] = {}
            for round_ in range(2):
                for label, port in (("peer -> engine (B's API)", pb), ("origin -> peer -> engine (A)", pa)):
                    s = await run_series(label, f"http://127.0.0.1:{port}/v1/chat/completions", body, n // 2,
                                         warmup=20 if round_ == 0 else 5)
                    out.setdefault(label, Series(label)).samples += s.samples
                    out[label].errors += s.errors
            return out

        res = asyncio.run(go())
    finally:
        stop_process(proc_a, 15)
        stop_process(proc_b, 15)
    direct, hop = res["peer -> engine (B's API)"], res["origin -> peer -> engine (A)"]
    lines = ["#### (c) one forwarding hop, llama-server with the tiny random model (issue 5)", "",
             "Agent A has no models and forwards over the mesh (mutual TLS, open trust, loopback) to agent B, "
             "which runs the model; the reference is the same request sent to B's own API.", "",
             "| path | n | TTFB p50 ms | TTFB p99 ms | total p50 ms | total p99 ms | errors |",
             "|---|---|---|---|---|---|---|"]
    for s in (direct, hop):
        lines.append(f"| {s.name} | {len(s.samples)} | {ms(s.pct('ttfb_s', .5))} | {ms(s.pct('ttfb_s', .99))} | "
                     f"{ms(s.pct('total_s', .5))} | {ms(s.pct('total_s', .99))} | {s.errors} |")
    lines.append(f"| **added by the hop** | | **{ms(hop.pct('ttfb_s', .5) - direct.pct('ttfb_s', .5))}** | "
                 f"{ms(hop.pct('ttfb_s', .99) - direct.pct('ttfb_s', .99))} | "
                 f"{ms(hop.pct('total_s', .5) - direct.pct('total_s', .5))} | "
                 f"{ms(hop.pct('total_s', .99) - direct.pct('total_s', .99))} | |")
    return lines + [""]


def start_agent(config: Path, port: int, log: Path) -> tuple[subprocess.Popen, Agent]:
    """The agent and, once its backend is healthy, a handle to reach that engine directly."""
    agent = Path(sys.executable).parent / "viiwork-agent"
    proc = subprocess.Popen([str(agent), "--config", str(config), "--log-level", "warning"],
                            stdout=open(log, "ab"), stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"agent exited early; see {log}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/status", timeout=1) as r:
                doc = json.load(r)
            b = doc["models"][0]["backends"][0]
            if b["state"] == "healthy":
                return proc, Agent(proc, f"http://127.0.0.1:{port}", log, config.parent / config.stem)
        except (OSError, KeyError, IndexError, ValueError):
            pass
        time.sleep(0.1)
    stop_process(proc)
    raise TimeoutError(f"agent not healthy within 90 s; see {log}")


async def measure(direct: Agent, agent_port: int, n: int, tokens: int, stream_tokens: int
                  ) -> dict[str, Series]:
    out: dict[str, Series] = {}
    body = chat_body("m", False, tokens)
    sbody = chat_body("m", True, stream_tokens)
    for round_ in range(2):  # interleave to spread drift over both
        engine = {"unix_socket": direct.engine_socket("m"), "extra_headers": direct.engine_headers("m")}
        for label, url, target in (("direct", f"{ENGINE_URL}/v1/chat/completions", engine),
                                   ("agent", f"http://127.0.0.1:{agent_port}/v1/chat/completions", {})):
            s = await run_series(label, url, body, n // 2, warmup=20 if round_ == 0 else 5, **target)
            out.setdefault(label, Series(label)).samples += s.samples
            out[label].errors += s.errors
            st = await run_series(label + "-stream", url, sbody, max(50, n // 10), warmup=5,
                                  fresh_connections=True, **target)
            out.setdefault(label + "-stream", Series(label + "-stream")).samples += st.samples
            out[label + "-stream"].errors += st.errors
    return out


def table(title: str, res: dict[str, Series]) -> list[str]:
    d, a, ds, as_ = res["direct"], res["agent"], res["direct-stream"], res["agent-stream"]
    lines = [f"#### {title}", "",
             "| path | n | TTFB p50 ms | TTFB p99 ms | total p50 ms | total p99 ms | errors |",
             "|---|---|---|---|---|---|---|"]
    for s in (d, a):
        lines.append(f"| {s.name} | {len(s.samples)} | {ms(s.pct('ttfb_s', .5))} | {ms(s.pct('ttfb_s', .99))} | "
                     f"{ms(s.pct('total_s', .5))} | {ms(s.pct('total_s', .99))} | {s.errors} |")
    lines.append(f"| **added by the agent** | | **{ms(a.pct('ttfb_s', .5) - d.pct('ttfb_s', .5))}** | "
                 f"{ms(a.pct('ttfb_s', .99) - d.pct('ttfb_s', .99))} | "
                 f"**{ms(a.pct('total_s', .5) - d.pct('total_s', .5))}** | "
                 f"{ms(a.pct('total_s', .99) - d.pct('total_s', .99))} | |")
    lines += ["", "| streamed | n | chunks/stream | TTFB p50 ms | chunks/s (median) | per-chunk ms | errors |",
              "|---|---|---|---|---|---|---|"]
    for s in (ds, as_):
        chunks = s.samples[0].chunks if s.samples else 0
        lines.append(f"| {s.name} | {len(s.samples)} | {chunks} | {ms(s.pct('ttfb_s', .5))} | "
                     f"{1 / s.per_chunk_s:.0f} | {ms(s.per_chunk_s)} | {s.errors} |")
    lines.append(f"| **added per chunk** | | | | | **{ms(as_.per_chunk_s - ds.per_chunk_s)}** | |")
    return lines + [""]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("-n", type=int, default=600, help="requests per non-streamed series (>= 500)")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    lines = ["### Added latency of one agent (issue 2)", "",
             f"Machine: {platform.machine()}, {os.cpu_count()} CPUs, Python {platform.python_version()}. "
             "Client, agent and backend on one host over loopback; c=1; direct and through-agent series "
             "interleaved in one run.", "",
             "Command: `.venv/bin/python tests/bench/bench_proxy.py`", ""]
    with tempfile.TemporaryDirectory(prefix="vw-bench-") as tmp:
        work = Path(tmp)
        fake = fake_engine_binary(work)
        cases = [("(a) instant fake upstream", str(fake), "/dev/null", {"FAKE_LOAD_S": "0", "FAKE_TOKENS": "20"}, 1, 20)]
        llama = find_llama_server()
        if llama:
            from support.tiny_gguf import write_tiny_gguf

            gguf = work / "tiny.gguf"
            write_tiny_gguf(gguf)
            cases.append(("(b) llama-server, tiny random model", llama, str(gguf), {}, 4, 20))
        for i, (title, binary, model_path, env, tokens, stream_tokens) in enumerate(cases):
            port = free_port()
            cfg = agent_config(work, f"bench{i}", binary, model_path, port, env)
            proc, direct = start_agent(cfg, port, work / f"agent{i}.log")
            try:
                res = asyncio.run(measure(direct, port, args.n, tokens, stream_tokens))
            finally:
                stop_process(proc, 15)
            lines += table(title, res)
        if llama:
            lines += measure_hop(work, llama, gguf, args.n)
    text = "\n".join(lines)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
