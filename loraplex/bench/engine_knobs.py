"""EngineConfig keywords of the memory-bounded adapter pool and of tenant-fair scheduling, built from bench flags.

    kw.update(optional_engine_kwargs(adapter_memory_bytes=16 * adapter_nbytes(model, rank=32, dtype="bfloat16"),
                                     scheduling_policy="vtc"))

This is the one place that names those EngineConfig fields. Each keyword is passed only when its flag is set, so
a bench run without these flags builds exactly the EngineConfig it always did. Requests carry a tenant only in the
fairness scenario (``driver.LoadGroup.tenant``).
"""
from __future__ import annotations

from loraplex.bench.workload import adapter_tensor_shapes

ADAPTER_MEMORY_FIELD = "adapter_memory_bytes"   # GPU bytes resident adapters may take
POLICY_FIELD = "scheduling_policy"              # "vtc" (tenant-fair) | "fcfs"
_ELEM_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


def adapter_nbytes(model_config: dict, *, rank: int, dtype: str) -> int:
    """GPU bytes of one bench adapter (rank ``rank`` on attention and experts) at the engine's dtype: every factor
    at its own rank, as the adapter pool stores it."""
    elems = sum(a * b for a, b in adapter_tensor_shapes(model_config, rank).values())
    return elems * _ELEM_BYTES[dtype]


def optional_engine_kwargs(*, adapter_memory_bytes: int | None = None, scheduling_policy: str | None = None) -> dict:
    """The keywords above that are set (an empty dict when none is)."""
    kw: dict = {}
    if adapter_memory_bytes is not None:
        kw[ADAPTER_MEMORY_FIELD] = int(adapter_memory_bytes)
    if scheduling_policy is not None:
        kw[POLICY_FIELD] = scheduling_policy
    return kw
