"""The inference runtime. Public names are imported lazily so that torch-free modules (``config``, ``lora.format``)
can be imported by the control plane without pulling in torch."""
from __future__ import annotations

import importlib

_EXPORTS = {
    "LLMEngine": "llm_engine",
    "AsyncEngine": "async_engine",
    "EngineConfig": "engine_config",
    "SamplingParams": "sampling_params",
    "RequestOutput": "outputs",
    "CompletionOutput": "outputs",
    "ModelConfig": "config",
}

__all__ = list(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(f"{__name__}.{_EXPORTS[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
