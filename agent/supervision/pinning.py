"""The environment an engine process starts with: GPU pinning and nothing of the agent's own.

Built in layers (later layers win), docs/architecture.md, "A backend's life":

1. the inherited environment, minus every device-selection variable (an agent started from a
   shell with ``CUDA_VISIBLE_DEVICES=0`` must not pin all its engines to GPU 0) and minus
   what belongs to the agent alone (systemd's notify socket, watchdog, socket activation,
   credentials, and every ``VIIWORK_*`` variable);
2. the pinning for the backend's GPUs:
   - NVIDIA: ``CUDA_DEVICE_ORDER=PCI_BUS_ID`` (without it CUDA numbers GPUs fastest first,
     which differs from nvidia-smi and NVML) and ``CUDA_VISIBLE_DEVICES``;
   - AMD: ``ROCR_VISIBLE_DEVICES`` (ROCm's recommended isolation variable on Linux). HIP's
     ``HIP_VISIBLE_DEVICES`` is not set as well: HIP indexes into the devices ROCr left
     visible, so the same indexes in both would select the wrong GPUs;
   - unknown vendor with GPUs: the NVIDIA variables (HIP also reads ``CUDA_VISIBLE_DEVICES``);
   - no GPUs (CPU): every GPU hidden, ``CUDA_VISIBLE_DEVICES``, ``HIP_VISIBLE_DEVICES`` and
     ``ROCR_VISIBLE_DEVICES`` set to ``-1`` (device lists stop at the first invalid entry,
     so nothing is visible);
3. the model's ``env`` from the config (the operator's last word on the model);
4. the engine adapter's ``LaunchCommand.env`` (device flags an engine build needs, e.g.
   Vulkan's ``GGML_VK_VISIBLE_DEVICES``).

Pure: no I/O, no ``os.environ`` reads (the caller passes the inherited environment).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

#: Variables that select devices for some runtime; never inherited by an engine.
DEVICE_VARIABLES: frozenset[str] = frozenset({
    "CUDA_VISIBLE_DEVICES",
    "CUDA_DEVICE_ORDER",
    "NVIDIA_VISIBLE_DEVICES",
    "HIP_VISIBLE_DEVICES",
    "ROCR_VISIBLE_DEVICES",
    "GPU_DEVICE_ORDINAL",
    "GGML_VK_VISIBLE_DEVICES",
    "ZE_AFFINITY_MASK",
    "ONEAPI_DEVICE_SELECTOR",
    "SYCL_DEVICE_FILTER",
    "MESA_VK_DEVICE_SELECT",
})

#: The agent's own variables (systemd service plumbing and credentials); never inherited.
AGENT_VARIABLES: frozenset[str] = frozenset({
    "NOTIFY_SOCKET",
    "WATCHDOG_USEC",
    "WATCHDOG_PID",
    "LISTEN_FDS",
    "LISTEN_PID",
    "LISTEN_FDNAMES",
    "INVOCATION_ID",
    "CREDENTIALS_DIRECTORY",
    "JOURNAL_STREAM",
    "MAINPID",
    "MANAGERPID",
    "SYSTEMD_EXEC_PID",
    "MONITOR_SERVICE_RESULT",
    "MONITOR_EXIT_CODE",
    "MONITOR_EXIT_STATUS",
    "MONITOR_INVOCATION_ID",
    "MONITOR_UNIT",
})

AGENT_PREFIXES: tuple[str, ...] = ("VIIWORK_",)

HIDE_ALL = "-1"


def inheritable(name: str) -> bool:
    """False for device-selection variables and the agent's own variables."""
    return not (
        name in DEVICE_VARIABLES
        or name in AGENT_VARIABLES
        or name.startswith(AGENT_PREFIXES)
    )


def pinning_variables(vendor: str, gpus: Sequence[str]) -> dict[str, str]:
    """The device variables for a backend on ``gpus`` (NVML indexes or UUIDs, as strings).

    ``vendor`` is "nvidia", "amd", "cpu" or anything else (treated as unknown). Empty
    ``gpus`` means the CPU whatever the vendor: every GPU is hidden.
    """
    if not gpus:
        return {
            "CUDA_VISIBLE_DEVICES": HIDE_ALL,
            "HIP_VISIBLE_DEVICES": HIDE_ALL,
            "ROCR_VISIBLE_DEVICES": HIDE_ALL,
        }
    devices = ",".join(gpus)
    if vendor == "amd":
        return {"ROCR_VISIBLE_DEVICES": devices}
    return {"CUDA_DEVICE_ORDER": "PCI_BUS_ID", "CUDA_VISIBLE_DEVICES": devices}


def engine_environment(
    inherited: Mapping[str, str],
    *,
    vendor: str,
    gpus: Sequence[str],
    model_env: Mapping[str, str] | None = None,
    engine_env: Mapping[str, str] | None = None,
) -> dict[str, str]:
    """The complete environment of one engine process (layers in the module docstring).

    Returns a new dict; ``inherited`` is usually ``os.environ``.
    """
    env = {k: v for k, v in inherited.items() if inheritable(k)}
    env.update(pinning_variables(vendor, gpus))
    env.update(model_env or {})
    env.update(engine_env or {})
    return env
