"""Options of the llama.cpp engine (the ``[models.llamacpp]`` block)."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

# Bounds (docs/configuration.md): no host has more CPUs than this, and no model more layers
# (operators write 999 to mean "all of them").
MAX_THREADS = 4096
MAX_GPU_LAYERS = 10_000
# llama.cpp's tensor_split holds one proportion per device (llama_max_devices(): 16 on CUDA builds,
# more elsewhere); 128 is past every build's device limit, so a longer list is a typo.
MAX_TENSOR_SPLIT = 128
# A proportion is relative (3,1 or 0.75,0.25; or GiB per device, 24,48): 1000 is past any of them.
MAX_PROPORTION = 1000.0


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
    rpc_binary: the rpc-server executable a gang's worker hosts run (a name on PATH or a path;
        docs/engines.md, "Gangs").
    split_mode: how layers are split over the devices (llama.cpp's ``--split-mode``: "layer"
        splits layers and KV cache, "row" splits weights by rows, "tensor" splits weights and
        KV, experimental in llama.cpp); None leaves it to llama.cpp ("layer").
    tensor_split: proportion of the model per device (``--tensor-split``), in llama.cpp's
        device order: a gang head's RPC servers first, in rank order, then its own GPUs.
        None: in proportion to each device's free memory.
    """

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True, allow_inf_nan=False)

    binary: str = Field(default="llama-server", min_length=1)
    threads: int | None = Field(default=None, ge=1, le=MAX_THREADS)
    gpu_layers: int | Literal["all"] = "all"
    device_selection: Literal["env", "vulkan"] = "env"
    metrics: bool = True
    rpc_binary: str = Field(default="rpc-server", min_length=1)
    split_mode: Literal["layer", "row", "tensor"] | None = None
    tensor_split: list[Annotated[float, Field(ge=0, le=MAX_PROPORTION)]] | None = Field(
        default=None, min_length=1, max_length=MAX_TENSOR_SPLIT)

    @field_validator("tensor_split")
    @classmethod
    def _proportions(cls, v: list[float] | None) -> list[float] | None:
        if v is not None and not any(x > 0 for x in v):
            raise ValueError(f"tensor_split needs at least one proportion > 0, got {v}")
        return v

    @field_validator("gpu_layers")
    @classmethod
    def _layers_in_range(cls, v: int | str) -> int | str:
        # A validator, not Field(ge, le): a constraint on the int of the union would report
        # one error per union member.
        if isinstance(v, int) and not 0 <= v <= MAX_GPU_LAYERS:
            raise ValueError(f"gpu_layers must be 0..{MAX_GPU_LAYERS} or \"all\", got {v}")
        return v
