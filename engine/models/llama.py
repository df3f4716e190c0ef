"""Llama: dense, optional attention/MLP bias, rope default/linear/llama3/yarn."""
from loraplex.engine.models.transformer import CausalLM


class LlamaForCausalLM(CausalLM):
    family = "llama"
