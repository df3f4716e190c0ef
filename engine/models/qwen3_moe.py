"""Qwen3-MoE: q/k norm; softmax -> top-k, renormalised only if ``norm_topk_prob``; ``mlp_only_layers`` dense."""
from loraplex.engine.models.transformer import CausalLM, MoESpec


class Qwen3MoeForCausalLM(CausalLM):
    family = "qwen3_moe"
    moe_spec = MoESpec(router_name="gate", scoring="softmax", activation="silu")
