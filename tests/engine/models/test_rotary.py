"""The rope tables match transformers' inverse frequencies and attention scaling for every supported type."""
from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from loraplex.engine.config import ConfigError, ModelConfig
from loraplex.engine.models.layers.rotary import compute_cos_sin_cache, inv_freq_and_scaling

ROPES = {
    "default": dict(rope_type="default", rope_theta=10000.0),
    "linear": dict(rope_type="linear", rope_theta=10000.0, factor=2.5),
    "llama3": dict(rope_type="llama3", rope_theta=500000.0, factor=8.0, low_freq_factor=1.0,
                   high_freq_factor=4.0, original_max_position_embeddings=64),
    "yarn": dict(rope_type="yarn", rope_theta=150000.0, factor=32.0, beta_fast=32.0, beta_slow=1.0,
                 truncate=False, original_max_position_embeddings=128),
    "yarn_truncate": dict(rope_type="yarn", rope_theta=10000.0, factor=4.0, original_max_position_embeddings=64),
    "yarn_mscale": dict(rope_type="yarn", rope_theta=10000.0, factor=40.0, mscale=1.0, mscale_all_dim=0.707,
                        original_max_position_embeddings=64),
}
HEAD_DIM, MAX_POS = 64, 512


def _hf_config(params: dict) -> LlamaConfig:
    return LlamaConfig(hidden_size=HEAD_DIM * 4, num_attention_heads=4, head_dim=HEAD_DIM,
                       max_position_embeddings=MAX_POS, rope_parameters=dict(params))


@pytest.mark.parametrize("name", list(ROPES))
def test_inv_freq_and_scaling_match_transformers(name):
    hf_cfg = _hf_config(ROPES[name])
    rope_type = hf_cfg.rope_parameters["rope_type"]
    if rope_type == "default":
        base = hf_cfg.rope_parameters["rope_theta"]
        ref_inv = 1.0 / (base ** (torch.arange(0, HEAD_DIM, 2, dtype=torch.int64).float() / HEAD_DIM))
        ref_scale = 1.0
    else:
        ref_inv, ref_scale = ROPE_INIT_FUNCTIONS[rope_type](hf_cfg, "cpu")
    cfg = ModelConfig.from_hf_dict(dict(hf_cfg.to_dict(), model_type="llama"))
    inv, scale = inv_freq_and_scaling(cfg.rope, HEAD_DIM, MAX_POS)
    torch.testing.assert_close(inv, ref_inv.float(), rtol=0, atol=0)
    assert scale == pytest.approx(ref_scale, rel=1e-12)

    cache = compute_cos_sin_cache(cfg.rope, HEAD_DIM, MAX_POS)
    assert cache.shape == (MAX_POS, HEAD_DIM) and cache.dtype == torch.float32
    freqs = torch.arange(MAX_POS).float()[:, None] * ref_inv.float()[None]
    torch.testing.assert_close(cache[:, :HEAD_DIM // 2], freqs.cos() * ref_scale, rtol=0, atol=0)
    torch.testing.assert_close(cache[:, HEAD_DIM // 2:], freqs.sin() * ref_scale, rtol=0, atol=0)


def test_partial_rotary_is_refused():
    cfg = ModelConfig.from_hf_dict(dict(_hf_config(ROPES["default"]).to_dict(), model_type="llama"))
    cfg.rope.partial_rotary_factor = 0.5
    with pytest.raises(ConfigError, match="partial_rotary_factor"):
        inv_freq_and_scaling(cfg.rope, HEAD_DIM, MAX_POS)
