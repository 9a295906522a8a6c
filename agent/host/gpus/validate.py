"""Validate a config's GPU references against this host's inventory.

The config loader (``viiwork.agent.config.load``) checks what it can without a host: duplicate
entries, a GPU named twice across models, ``gpus_per_backend`` dividing the list. This adds
what needs the host: every ``models[i].gpus`` entry must name a GPU that exists here (an
NVML index in PCI bus order, or a UUID), and two spellings of one GPU (``0`` and its UUID)
still make it belong to two models. Errors name the field (``models[0].gpus``) and list the
GPUs that do exist. The agent calls ``check_config_gpus`` at start; ``viiworkctl config check``
runs it by default, through the doctor's ``config.gpus`` check (viiwork.agent.host.config_host).
"""

from __future__ import annotations

from viiwork.agent.config.load import ConfigError, ConfigIssue
from viiwork.agent.config.schema import Config
from viiwork.agent.config.toml_lines import line_of
from viiwork.agent.host.gpus.inventory import GpuInventory, GpuRefError, SourceState


def gpu_config_issues(config: Config, inventory: GpuInventory, text: str | None = None) -> list[ConfigIssue]:
    """Every problem with the config's GPU references on this host (empty: all fine).

    ``text`` is the TOML source, used to add line numbers. Pure: no host access.
    """
    issues: list[ConfigIssue] = []
    owner: dict[str, tuple[int, str]] = {}  # gpu key -> (model index, model name)
    unreadable = [s for s in inventory.sources if s.state is SourceState.ERROR]
    for i, model in enumerate(config.models):
        path = ("models", i, "gpus")
        line = line_of(text, path) if text else None
        mine: dict[str, str] = {}
        for ref in model.gpus:
            try:
                gpu = inventory.resolve(ref)
            except GpuRefError as exc:
                message = f"{exc}; GPUs on this host: {inventory.describe()}"
                if unreadable:
                    message += "; cannot read " + "; ".join(f"{s.vendor.value}: {s.detail}" for s in unreadable)
                issues.append(ConfigIssue(path, message, line))
                continue
            if gpu.key in mine:
                issues.append(ConfigIssue(
                    path, f"{ref!r} and {mine[gpu.key]!r} are the same GPU ({gpu.label()})", line))
                continue
            mine[gpu.key] = str(ref)
            if gpu.key in owner and owner[gpu.key][0] != i:
                first, name = owner[gpu.key]
                issues.append(ConfigIssue(
                    path, f"{ref!r} is GPU {gpu.label()}, which already belongs to model {name!r} "
                          f"(models[{first}]); a GPU belongs to one model", line))
                continue
            owner[gpu.key] = (i, model.name)
    return issues


def check_config_gpus(config: Config, inventory: GpuInventory, source: str = "config",
                      text: str | None = None) -> None:
    """Raise ConfigError(source, issues) when any GPU reference fails ``gpu_config_issues``."""
    issues = gpu_config_issues(config, inventory, text)
    if issues:
        raise ConfigError(source, issues)
