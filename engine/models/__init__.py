"""Model families. ``get_model_class(cfg.family)(cfg)`` builds the engine's own module for a ModelConfig."""
from __future__ import annotations

from loraplex.engine.config import ConfigError, SUPPORTED_FAMILIES
from loraplex.engine.models.gpt_oss import GptOssForCausalLM
from loraplex.engine.models.llama import LlamaForCausalLM
from loraplex.engine.models.mixtral import MixtralForCausalLM
from loraplex.engine.models.qwen3 import Qwen3ForCausalLM
from loraplex.engine.models.qwen3_moe import Qwen3MoeForCausalLM
from loraplex.engine.models.transformer import CausalLM

MODEL_REGISTRY: dict[str, type[CausalLM]] = {
    cls.family: cls
    for cls in (GptOssForCausalLM, Qwen3MoeForCausalLM, MixtralForCausalLM, LlamaForCausalLM, Qwen3ForCausalLM)
}


def get_model_class(family: str) -> type[CausalLM]:
    """The CausalLM subclass serving ``family``; ConfigError names the supported ones otherwise."""
    try:
        return MODEL_REGISTRY[family]
    except KeyError:
        raise ConfigError(f"model family {family!r} is not supported; supported: "
                          f"{', '.join(SUPPORTED_FAMILIES)}") from None


__all__ = ["CausalLM", "MODEL_REGISTRY", "get_model_class"]
