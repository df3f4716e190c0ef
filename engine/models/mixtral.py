"""Mixtral: every MLP a sparse MoE; softmax over experts -> top-k -> renormalise; router ``mlp.gate``.
(The checkpoint's ``block_sparse_moe`` is loaded into ``mlp``.)"""
from loraplex.engine.models.transformer import CausalLM, MoESpec


class MixtralForCausalLM(CausalLM):
    family = "mixtral"
    moe_spec = MoESpec(router_name="gate", scoring="softmax", activation="silu")
