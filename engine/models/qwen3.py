"""Qwen3: dense Llama with per-head RMSNorm on q and k before rope (``self_attn.q_norm/k_norm``)."""
from loraplex.engine.models.transformer import CausalLM


class Qwen3ForCausalLM(CausalLM):
    family = "qwen3"
