"""Options of the llama.cpp engine (the ``[models.llamacpp]`` block)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

# Bounds (docs/configuration.md): no host has more CPUs than this, and no model more layers
# (operators write 999 to mean "all of them").
MAX_THREADS = 4096
MAX_GPU_LAYERS = 10_000


class LlamaCppOptions(BaseModel):
    """What the node decides about a llama-server backend.

    binary: the llama-server executable (a name on PATH or a path).
    threads: CPU threads per backend; None = a fair share of the host's CPUs across
        the model's backends on this node (at least 1).
    gpu_layers: layers offloaded when the backend has GPUs ("all", or a count).
    device_selection: how the build picks GPUs. "env" relies on the supervisor's
        CUDA_VISIBLE_DEVICES / HIP_VISIBLE_DEVICES; "vulkan" also sets
        GGML_VK_VISIBLE_DEVICES, which Vulkan builds read instead.
    metrics: pass --metrics so waiting requests (llamacpp:requests_deferred) are known.
    """

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True, allow_inf_nan=False)

    binary: str = Field(default="llama-server", min_length=1)
    threads: int | None = Field(default=None, ge=1, le=MAX_THREADS)
    gpu_layers: int | Literal["all"] = "all"
    device_selection: Literal["env", "vulkan"] = "env"
    metrics: bool = True

    @field_validator("gpu_layers")
    @classmethod
    def _layers_in_range(cls, v: int | str) -> int | str:
        # A validator, not Field(ge, le): a constraint on the int of the union would report
        # one error per union member.
        if isinstance(v, int) and not 0 <= v <= MAX_GPU_LAYERS:
            raise ValueError(f"gpu_layers must be 0..{MAX_GPU_LAYERS} or \"all\", got {v}")
        return v
