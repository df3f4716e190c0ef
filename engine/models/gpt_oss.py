"""GPT-OSS: attention sinks and bias, alternating sliding/full layers, YaRN rope; MoE with a biased router
(top-k over logits, softmax over the k), biased experts and the clamped SwiGLU (alpha, limit)."""
from loraplex.engine.models.transformer import CausalLM, MoESpec


class GptOssForCausalLM(CausalLM):
    family = "gpt_oss"
    moe_spec = MoESpec(router_name="router", scoring="topk_softmax", activation="swiglu_clamp")
