"""Rotary embedding tables (default, linear, llama3, yarn), computed to match transformers' numbers.

    cos_sin_cache [max_pos, D] = cat(cos [D/2], sin [D/2]) per position, any attention scaling folded in.
"""
from __future__ import annotations

import math

import torch
from torch import nn

from loraplex.engine.config import ConfigError, RopeConfig
from loraplex.kernels import ops


def _base_inv_freq(theta: float, dim: int) -> torch.Tensor:
    return 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))  # [D/2]


def _llama3_inv_freq(rope: RopeConfig, dim: int, max_pos: int) -> torch.Tensor:
    inv_freq = _base_inv_freq(rope.theta, dim)
    old_ctx = rope.original_max_position_embeddings or max_pos
    low_wavelen = old_ctx / rope.low_freq_factor
    high_wavelen = old_ctx / rope.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / rope.factor, inv_freq)
    smooth = (old_ctx / wavelen - rope.low_freq_factor) / (rope.high_freq_factor - rope.low_freq_factor)
    smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(medium, smoothed, scaled)


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _yarn_inv_freq(rope: RopeConfig, dim: int, max_pos: int) -> tuple[torch.Tensor, float]:
    """YaRN: blend interpolated (1/factor) and original frequencies over a ramp of dims; returns the
    attention factor that scales cos and sin."""
    factor = rope.factor
    orig = rope.original_max_position_embeddings or max_pos
    if rope.attention_factor is not None:
        attn_factor = rope.attention_factor
    elif rope.mscale and rope.mscale_all_dim:
        attn_factor = _yarn_mscale(factor, rope.mscale) / _yarn_mscale(factor, rope.mscale_all_dim)
    else:
        attn_factor = _yarn_mscale(factor)

    def correction_dim(num_rotations: float) -> float:
        return dim * math.log(orig / (num_rotations * 2 * math.pi)) / (2 * math.log(rope.theta))

    low, high = correction_dim(rope.beta_fast), correction_dim(rope.beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    pos_freqs = rope.theta ** (torch.arange(0, dim, 2).float() / dim)
    extrapolation = 1.0 / pos_freqs
    interpolation = 1.0 / (factor * pos_freqs)
    keep = 1 - ramp  # share of the original (extrapolated) frequency
    return interpolation * (1 - keep) + extrapolation * keep, float(attn_factor)


def inv_freq_and_scaling(rope: RopeConfig, head_dim: int, max_pos: int) -> tuple[torch.Tensor, float]:
    """Inverse frequencies [D/2] (float32) and the cos/sin scaling factor for ``rope``."""
    if rope.partial_rotary_factor != 1.0:
        raise ConfigError(f"partial_rotary_factor {rope.partial_rotary_factor} is not supported (need 1.0)")
    if rope.rope_type == "default":
        return _base_inv_freq(rope.theta, head_dim), 1.0
    if rope.rope_type == "linear":
        return _base_inv_freq(rope.theta, head_dim) / rope.factor, 1.0
    if rope.rope_type == "llama3":
        return _llama3_inv_freq(rope, head_dim, max_pos), 1.0
    if rope.rope_type == "yarn":
        return _yarn_inv_freq(rope, head_dim, max_pos)
    raise ConfigError(f"rope type {rope.rope_type!r} is not supported")


def compute_cos_sin_cache(rope: RopeConfig, head_dim: int, max_pos: int) -> torch.Tensor:
    """[max_pos, head_dim] float32 = cat(cos * s, sin * s) with s the rope's attention scaling."""
    inv_freq, scaling = inv_freq_and_scaling(rope, head_dim, max_pos)
    freqs = torch.arange(max_pos, dtype=torch.int64).float()[:, None] * inv_freq[None, :]  # [P, D/2]
    return torch.cat((freqs.cos() * scaling, freqs.sin() * scaling), dim=-1)


class RotaryEmbedding(nn.Module):
    """Holds the cos/sin table (a non-persistent buffer, shared by every attention layer of a model)."""

    def __init__(self, rope: RopeConfig, head_dim: int, max_pos: int) -> None:
        super().__init__()
        self.rope, self.head_dim, self.max_pos = rope, head_dim, max_pos
        self.register_buffer("cos_sin_cache", torch.empty(max_pos, head_dim), persistent=False)

    def materialize(self, device: torch.device | str) -> None:
        """Compute the table on ``device`` (the model is built on the meta device first)."""
        self.cos_sin_cache = compute_cos_sin_cache(self.rope, self.head_dim, self.max_pos).to(device)

    def rotate_and_cache(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                         k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor) -> torch.Tensor:
        """positions [T]; q [T, Q, D]; k, v [T, KV, D] -> rotated q; k rotated and v written into the paged caches
        at ``slot_mapping`` (-1 skips), one launch."""
        return ops.rotary_embedding_and_cache(positions, q, k, v, self.cos_sin_cache, k_cache, v_cache,
                                              slot_mapping)
