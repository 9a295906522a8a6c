"""Options of the SGLang engine (the ``[models.sglang]`` block)."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

from viiwork.engines.gang import MAX_PARALLEL_SIZE


class SglangOptions(BaseModel):
    """What the node decides about an SGLang backend.

    python: the Python interpreter of the environment SGLang is installed in (a name on
        PATH or a path, e.g. ``/opt/sglang/bin/python``); the backend runs
        ``PYTHON -m sglang.launch_server ...``, the entry point every SGLang release has.
    mem_fraction_static: fraction of each GPU's memory for weights and the KV-cache pool, in
        (0, 1); None leaves it to SGLang, which sizes it from the GPU's memory and the
        parallelism. Not passed for a CPU backend.
    tensor_parallel, pipeline_parallel: a gang's ``--tp-size`` and ``--pp-size`` (docs/engines.md,
        "Gangs"); their product is the gang's GPUs (hosts x this host's gpus: SGLang puts
        tp x pp / nnodes GPUs on every node). None: tensor-parallel over each host's GPUs,
        pipeline-parallel over the hosts. Only for a model with ``hosts``.
    """

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True, allow_inf_nan=False)

    python: str = Field(default="python3", min_length=1)
    mem_fraction_static: float | None = Field(default=None, gt=0, lt=1)
    tensor_parallel: int | None = Field(default=None, ge=1, le=MAX_PARALLEL_SIZE)
    pipeline_parallel: int | None = Field(default=None, ge=1, le=MAX_PARALLEL_SIZE)
