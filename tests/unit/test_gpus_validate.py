"""Config GPU references against a host's inventory: errors name models[i].gpus and list the GPUs."""

from __future__ import annotations

import pytest

from support.gpu_hosts import nvml_recording, write_drm_card
from viiwork.agent.config.load import ConfigError, parse_config
from viiwork.agent.host.gpus.amd import AmdSysfsReader
from viiwork.agent.host.gpus.inventory import GpuInventory, SourceState, SourceStatus, Vendor, read_inventory
from viiwork.agent.host.gpus.nvml import NvmlReader
from viiwork.agent.host.gpus.nvml_record import ReplayNvml
from viiwork.agent.host.gpus.validate import check_config_gpus, gpu_config_issues

UUID0 = "GPU-5b1c7a4e-91f3-2d6e-8a0b-3c4d5e6f7a8b"
UUID1 = "GPU-0e6f2a19-4c7d-8b3a-5f1e-9d2c6b8a4e70"


def nvidia_box(tmp_path, fixture="nvml-2x-h100"):
    return read_inventory([NvmlReader(ReplayNvml(nvml_recording(fixture))), AmdSysfsReader(tmp_path)])


def cpu_box(tmp_path):
    return nvidia_box(tmp_path, "nvml-driver-not-loaded")


def mixed_box(tmp_path):
    write_drm_card(tmp_path, 0, "0000:43:00.0")
    return nvidia_box(tmp_path)


def nvml_broken_box(tmp_path):
    return nvidia_box(tmp_path, "nvml-init-version-mismatch")


def config_text(*models: tuple[str, list]) -> str:
    out = []
    for name, gpus in models:
        entry = f'[[models]]\nname = "{name}"\nengine = "llamacpp"\npath = "/m/{name}.gguf"\ngpus = {gpus!r}\n'
        out.append(entry.replace("'", '"'))
    return "\n".join(out)


CASES = [
    # id, host, models, expected [(path, message fragment, line)]
    ("cpu-models-on-cpu-box", cpu_box, [("a", [])], []),
    ("index-exists", nvidia_box, [("a", [0, 1])], []),
    ("uuid-exists-any-case", nvidia_box, [("a", [UUID1.lower()])], []),
    ("index-and-uuid-two-models", nvidia_box, [("a", [0]), ("b", [UUID1])], []),
    ("index-missing", nvidia_box, [("a", [2])],
     [("models[0].gpus", "GPU 2 does not exist on this host; GPUs on this host: 0 (NVIDIA H100 80GB HBM3, "
                         f"{UUID0}, 0000:17:00.0); 1 (NVIDIA H100 80GB HBM3, {UUID1}, 0000:ca:00.0)", 5)]),
    ("uuid-missing", nvidia_box, [("a", ["GPU-00000000-dead-beef-0000-000000000000"])],
     [("models[0].gpus", "no GPU with UUID 'GPU-00000000-dead-beef-0000-000000000000' on this host", 5)]),
    ("same-gpu-twice-in-one-model", nvidia_box, [("a", [0, UUID0])],
     [("models[0].gpus", f"'{UUID0}' and '0' are the same GPU", 5)]),
    ("same-gpu-in-two-models", nvidia_box, [("a", [1]), ("b", [UUID1])],
     [("models[1].gpus", f"'{UUID1}' is GPU 1 (NVIDIA H100 80GB HBM3, {UUID1}, 0000:ca:00.0), which already "
                         "belongs to model 'a' (models[0])", 11)]),
    ("gpu-on-cpu-box", cpu_box, [("a", [0])],
     [("models[0].gpus", "GPU 0 does not exist on this host; GPUs on this host: none (nvidia: no NVIDIA driver "
                         "(the nvidia kernel module is not loaded); amd: no AMD GPU", 5)]),
    ("nvml-unreadable", nvml_broken_box, [("a", [0])],
     [("models[0].gpus", "cannot read nvidia: NVML cannot be read", 5)]),
    ("index-on-mixed-box", mixed_box, [("a", [0])],
     [("models[0].gpus", "GPU 0 is ambiguous on a host with nvidia and amd GPUs; name GPUs by UUID", 5)]),
    ("uuid-on-mixed-box", mixed_box, [("a", ["GPU-7f2c5a1d0b3e4c8a", UUID0])], []),
]


@pytest.mark.parametrize(("host", "models", "expected"), [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_gpu_references(tmp_path, host, models, expected):
    text = config_text(*models)
    config = parse_config(text)
    issues = gpu_config_issues(config, host(tmp_path), text)
    assert len(issues) == len(expected), [str(i) for i in issues]
    for issue, (path, fragment, line) in zip(issues, expected, strict=True):
        assert issue.dotted == path
        assert fragment in issue.message
        assert issue.line == line


def test_check_config_gpus_raises_config_error_naming_the_field(tmp_path):
    text = config_text(("a", [0]), ("b", [7]))
    with pytest.raises(ConfigError) as info:
        check_config_gpus(parse_config(text), nvidia_box(tmp_path), "/etc/viiwork/viiwork.toml", text)
    assert "models[1].gpus: GPU 7 does not exist on this host" in str(info.value)
    assert "(line 11)" in str(info.value)
    assert str(info.value).startswith("/etc/viiwork/viiwork.toml: 1 error in")


def test_check_config_gpus_passes_silently(tmp_path):
    check_config_gpus(parse_config(config_text(("a", [1]))), nvidia_box(tmp_path))


def test_resolve_rejects_booleans():
    inv = GpuInventory((), (SourceStatus(Vendor.NVIDIA, SourceState.ABSENT, "x"),))
    with pytest.raises(ValueError, match="neither an index nor a UUID"):
        inv.resolve(True)
