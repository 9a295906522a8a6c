"""The lines ``viiwork-agent`` prints once its API serves (agent/main.py): how to try it and where
things are, with full paths and commands that run from a clone (agent/cli/command_path.py)."""

from __future__ import annotations

from viiwork import __version__
from viiwork.agent.cli.command_path import command
from viiwork.agent.config.demo import DEMO_CONFIG_FILE
from viiwork.agent.config.schema import ApiConfig, Config


def ready_lines(host: str, port: int, config: Config, *, demo: bool = False) -> str:
    """The lines printed once the API serves: how to try it and where things are, with full
    paths (the demo's user has no config file to read them from)."""
    shown = "127.0.0.1" if host in ("0.0.0.0", "::") else host
    base = f"http://{shown}:{port}"
    ctl = command("viiworkctl")
    lines = [f"viiwork {__version__}: node {config.node.name!r}, API on {base}"]
    chat = [m.name for m in config.models if m.kind.value == "chat"]
    keys = config.auth.mode == "keys"
    if chat:
        lines += [
            "try:" + (f" (client keys are on: KEY from {ctl} keys issue, docs/install.md)" if keys else ""),
            f"  curl -s {base}/v1/chat/completions -H 'Content-Type: application/json' \\",
            *(["    -H \"Authorization: Bearer $KEY\" \\"] if keys else []),
            f"    -d '{{\"model\": \"{chat[0]}\", \"messages\": [{{\"role\": \"user\", \"content\": "
            "\"Say hello in five words.\"}], \"max_tokens\": 32}'",
        ]
    # viiworkctl finds a running demo by itself (agent/cli/target.py); another agent by its URL.
    lines.append(f"status: {ctl} status" + ("" if demo else f" --url {base}"))
    if demo or config.api.admin_socket != ApiConfig().admin_socket:  # viiworkctl's default would miss it
        lines.append(f"admin socket: {config.api.admin_socket}"
                     + ("" if demo else f" ({ctl} models --socket {config.api.admin_socket})"))
    if demo:
        lines += [f"state dir: {config.node.state_dir}",
                  f"engine logs: {config.supervisor.log_dir or config.node.state_dir / 'logs'} "
                  f"({ctl} logs {chat[0] if chat else 'MODEL'})",
                  f"config: {config.node.state_dir / DEMO_CONFIG_FILE} (written by the demo; "
                  f"{ctl} config check {config.node.state_dir / DEMO_CONFIG_FILE})"]
    return "\n".join(lines)
