"""A random EAGLE-3 draft of the tiny targets (``tiny.py``: hidden 72, vocabulary 320) in the published layout, for
tests and device checks: config.json (``LlamaForCausalLMEagle3``) and ``fc`` / ``midlayer.*`` / ``norm`` /
``lm_head`` / ``d2t`` / ``t2d`` tensors, a draft vocabulary of 200 of the target's ids (docs/engine.md, "EAGLE-3
drafts").

    folder = write_random_eagle3(tmp / "draft", [1, 2, 3])        # aux layer ids named in config.json
    folder = write_random_eagle3(tmp / "spec", [1, 2, 3], layout="speculators")   # the same, speculators layout
"""
from __future__ import annotations

import json
import os

import torch

VOCAB, DRAFT_VOCAB, HIDDEN = 320, 200, 72
HEADS, KV_HEADS, HEAD_DIM, INTER, EPS, THETA = 4, 2, 16, 64, 1e-5, 10000.0


def _draft_tensors(aux: int, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)

    def w(*shape, scale=1.0):
        return torch.randn(*shape, generator=g) * scale / shape[-1] ** 0.5

    def norm(n):
        return 1.0 + 0.1 * torch.randn(n, generator=g)

    H, q, kv = HIDDEN, HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM
    targets = torch.randperm(VOCAB, generator=g)[:DRAFT_VOCAB].sort().values
    t2d = torch.zeros(VOCAB, dtype=torch.bool)
    t2d[targets] = True
    return {
        "fc.weight": w(H, aux * H), "midlayer.hidden_norm.weight": norm(H),
        "midlayer.input_layernorm.weight": norm(H), "midlayer.post_attention_layernorm.weight": norm(H),
        "midlayer.self_attn.q_proj.weight": w(q, 2 * H, scale=2.0),
        "midlayer.self_attn.k_proj.weight": w(kv, 2 * H, scale=2.0),
        "midlayer.self_attn.v_proj.weight": w(kv, 2 * H), "midlayer.self_attn.o_proj.weight": w(H, q),
        "midlayer.mlp.gate_proj.weight": w(INTER, H), "midlayer.mlp.up_proj.weight": w(INTER, H),
        "midlayer.mlp.down_proj.weight": w(H, INTER), "norm.weight": norm(H),
        "lm_head.weight": w(DRAFT_VOCAB, H, scale=4.0), "d2t": targets - torch.arange(DRAFT_VOCAB), "t2d": t2d,
    }


def write_random_eagle3(folder, aux_ids: list[int] | None, *, seed: int = 0, fmt: str = "safetensors",
                        prefix: str = "", drop: str | None = None, reshape: str | None = None,
                        eagle: dict | None = None, layout: str = "published", **config) -> str:
    """A random EAGLE-3 draft of the tiny targets in the published layout (``prefix``: a name prefix such as
    "model."; ``drop`` / ``reshape``: a tensor left out / given a wrong shape; ``config``: config.json overrides;
    ``eagle``: more ``eagle_config`` keys). With ``norm_before_fc`` or ``fc_norm`` set (either place) it also holds
    ``input_norm.weight`` or ``fc_norm.<i>.weight``. ``layout="speculators"``: the same draft as the speculators
    library saves it (Eagle3Speculator: the layer's config nested in ``transformer_layer_config``, the EAGLE-3 fields
    and ``config`` overrides of them at the top level, ``layers.0.`` names)."""
    from safetensors.torch import save_file

    os.makedirs(folder, exist_ok=True)
    cfg = {"architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "hidden_size": HIDDEN,
           "num_attention_heads": HEADS, "num_key_value_heads": KV_HEADS, "head_dim": HEAD_DIM,
           "intermediate_size": INTER, "num_hidden_layers": 1, "rms_norm_eps": EPS, "rope_theta": THETA,
           "rope_scaling": None, "max_position_embeddings": 64, "vocab_size": VOCAB, "draft_vocab_size": DRAFT_VOCAB,
           "hidden_act": "silu", "tie_word_embeddings": False, **config}
    if aux_ids is not None or eagle:
        cfg["eagle_config"] = {"use_aux_hidden_state": True, **(eagle or {})}
        if aux_ids is not None:
            cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] = aux_ids
    flags = {**cfg, **cfg.get("eagle_config", {})}
    if layout == "speculators":
        cfg = _speculators_config(cfg)
    with open(os.path.join(folder, "config.json"), "w", encoding="utf-8") as f:
        json.dump(cfg, f)
    state = _draft_tensors(3, seed)
    g = torch.Generator().manual_seed(seed + 1)  # the other tensors as without these norms
    if flags.get("norm_before_fc"):
        state["input_norm.weight"] = 1.0 + 0.3 * torch.randn(3 * HIDDEN, generator=g)
    if flags.get("fc_norm"):
        state.update({f"fc_norm.{i}.weight": 1.0 + 0.3 * torch.randn(HIDDEN, generator=g) for i in range(3)})
    if drop:
        del state[drop]
    if reshape:
        state[reshape] = state[reshape][..., :-1].contiguous()
    if layout == "speculators":
        state = {name.replace("midlayer.", "layers.0."): t for name, t in state.items()}
    state = {(name if name == "lm_head.weight" else prefix + name): t for name, t in state.items()}
    if fmt == "bin":
        torch.save(state, os.path.join(folder, "pytorch_model.bin"))
    else:
        save_file(state, os.path.join(folder, "model.safetensors"))
    return str(folder)


def _speculators_config(published: dict) -> dict:
    """``published`` (write_random_eagle3's config) in the speculators layout."""
    from loraplex.engine.spec_decode.eagle3_draft import SPECULATORS_FIELDS

    layer = {k: v for k, v in published.items() if k not in ("architectures", "eagle_config")}
    top = {k: layer.pop(k) for k in (*SPECULATORS_FIELDS, "norm_before_residual", "speculators_model_type")
           if k in layer}
    top.update({k: v for k, v in published.get("eagle_config", {}).items() if k != "use_aux_hidden_state"})
    kind = top.pop("speculators_model_type", "eagle3")
    return {"architectures": ["Eagle3Speculator"], "speculators_model_type": kind,
            "transformer_layer_config": {**layer, "architectures": ["LlamaForCausalLM"]}, **top,
            "speculators_config": {"algorithm": "eagle3", "default_proposal_method": "greedy",
                                   "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": 3}],
                                   "verifier": {"name_or_path": "tiny-target", "architectures": ["LlamaForCausalLM"]}}}
