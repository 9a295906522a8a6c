"""Checks of the config file: it loads, and the GPUs it names exist on this host."""

from __future__ import annotations

from pathlib import Path

import viiwork
from viiwork.agent.cli.command_path import command
from viiwork.agent.host.doctor.registry import CheckResult, Skip, Verdict, check, config_or_skip, plural, result_for
from viiwork.agent.host.facts import HostFacts
from viiwork.agent.host.gpus.inventory import GpuInventory
from viiwork.agent.host.gpus.validate import gpu_config_issues

# The commented example config: in a source checkout, and where the .deb puts a copy
# (debian/viiwork.examples; the package also installs it as /etc/viiwork/viiwork.toml).
EXAMPLE_CONFIGS = (Path(viiwork.__file__).resolve().parent.parent / "packaging" / "viiwork.toml",
                   Path("/usr/share/doc/viiwork/examples/viiwork.toml"))


def example_config() -> str:
    """The path of the example config on this box, or where to find it when none is here."""
    for path in EXAMPLE_CONFIGS:
        if path.is_file():
            return str(path)
    return "packaging/viiwork.toml of the source tree"


@check("config", "Configuration file")
def check_config(facts: HostFacts) -> CheckResult:
    """The config file exists and passes the agent's own loader (the one
    `viiworkctl config check` uses).

    - **fail**: the file is missing, unreadable or invalid. Every error names its field
      path and line. The agent refuses to start with it.
    """
    r = result_for("config")
    cf = facts.config
    if cf.config is None:
        if not cf.exists:
            return r(Verdict.FAIL, f"{cf.path} does not exist", "the agent cannot start without a config",
                     f"create {cf.path} from the example config ({example_config()}), or pass --config FILE; "
                     f"`{command('viiwork-agent')} --demo` runs without one")
        errors = "; ".join(str(i) for i in cf.issues[:5])
        more = f" (and {len(cf.issues) - 5} more)" if len(cf.issues) > 5 else ""
        return r(Verdict.FAIL, f"{cf.path}: {errors}{more}", "the agent refuses to start with this config",
                 f"fix the fields named; re-check with `{command('viiworkctl')} config check {cf.path}`")
    config = cf.config
    backends = sum(m.backend_count for m in config.models)
    mode = f"mesh (trust {config.mesh.trust})" if config.mesh else "standalone"
    return r(Verdict.OK, f"{cf.path}: {plural(len(config.models), 'model')}, {plural(backends, 'backend')}, {mode}")


@check("config.gpus", "Configured GPUs exist on this host")
def check_config_gpus(facts: HostFacts) -> list[CheckResult]:
    """Every `models[].gpus` entry names a GPU of this host: an NVML index in PCI bus order
    (what `nvidia-smi` shows), or a GPU UUID. Two spellings of one GPU (`0` and its UUID)
    in two models are caught here too.

    - **fail**: an entry names no GPU here (the message lists the GPUs that exist), or one
      GPU is given to two models. The agent refuses the config at start.
    - **skipped**: no model lists GPUs.
    """
    r = result_for("config.gpus")
    config = config_or_skip(facts)
    if not any(m.gpus for m in config.models):
        raise Skip("no model lists GPUs")
    inventory: GpuInventory = facts.need("gpus")
    issues = gpu_config_issues(config, inventory, facts.config.text)
    if not issues:
        refs = sum(len(m.gpus) for m in config.models)
        return [r(Verdict.OK, f"{plural(refs, 'GPU reference')} resolve to GPUs of this host")]
    return [r(Verdict.FAIL, str(issue), "the agent refuses this config at start",
              "name GPUs that exist (`nvidia-smi -L` or `rocm-smi --showuniqueid` list indexes and UUIDs)",
              subject=issue.dotted) for issue in issues]
