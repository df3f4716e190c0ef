"""benchmarks/kernels/mxfp4_gemm_tiles_gpu.py's candidate tiles and the tuner's own-tile configs off the GPU: every
candidate is a config the kernels accept, a down candidate changes only what the down GEMM runs, and the own-tile
configs give the reference's result through the interpreter (fresh random inputs)."""
import pytest
import torch

from loraplex.kernels import fused_moe_mxfp4 as fm
from loraplex.kernels import reference_lora as ref
from loraplex.kernels.moe_experts_lora import moe_experts_lora
from loraplex.kernels.mxfp4 import prepare_for_kernel, quantize_mxfp4
from loraplex.kernels.tuning_cases import (MXFP4_MID_SPACE, MXFP4_OWN_TILE_SPACE, MXFP4_PREFILL_SPACE,
                                           mxfp4_moe_space)
from tests.utils.scripts import load_script

SHAPE = dict(hidden=2880, inter=2880)


def _script():
    return load_script("kernels", "mxfp4_gemm_tiles_gpu")


@pytest.mark.parametrize("m", [1, 4, 16, 64, 256, 2048])
def test_candidates_are_valid_and_down_ones_touch_down_only(m):
    mod = _script()
    committed = {**fm.DEFAULT_CONFIG, "BLOCK_M": 8 if m <= 16 else 16 if m <= 64 else 64 if m <= 256 else 128}
    gu_meta = fm.gate_up_constexprs(committed, top_k=4, act=0, has_bias=True, pdl=False, **SHAPE)
    for tile in mod.gate_up_tiles(m):
        assert not any(k.startswith("DOWN_") for k in tile)
        fm.gate_up_constexprs({**committed, **tile}, top_k=4, act=0, has_bias=True, pdl=False, **SHAPE)
    dn_meta = fm.down_constexprs(committed, has_bias=True, pdl=False, **SHAPE)
    seen = set()
    for tile in mod.down_tiles(m):
        assert set(tile) <= {"DOWN_" + k for k in fm.DOWN_KEYS} | {"SPLIT_K"}
        cfg = {**committed, **tile}
        # gate_up launches exactly as with the committed config: a down candidate compiles down alone
        assert fm.gate_up_constexprs(cfg, top_k=4, act=0, has_bias=True, pdl=False, **SHAPE) == gu_meta
        meta = fm.down_constexprs(cfg, has_bias=True, pdl=False, **SHAPE)
        assert meta["BLOCK_N"] == tile["DOWN_BLOCK_N"] and meta["BLOCK_M"] == dn_meta["BLOCK_M"]
        seen.add(tuple(sorted(tile.items())))
    assert len(seen) == len(mod.down_tiles(m))  # no candidate twice


def test_the_tuner_tries_the_own_tile_configs_first_at_decode_sizes():
    for m in (1, 4, 16):
        assert mxfp4_moe_space(m)[:len(MXFP4_OWN_TILE_SPACE)] == MXFP4_OWN_TILE_SPACE
    assert all(c in mxfp4_moe_space(32) for c in MXFP4_OWN_TILE_SPACE[:3])
    assert not any("DOWN_BLOCK_N" in c for c in mxfp4_moe_space(64))
    for m in (256, 2048):  # at mid and prefill sizes too, each GEMM on its own tile first
        assert "DOWN_BLOCK_N" in mxfp4_moe_space(m)[0]


@pytest.mark.parametrize("m", [1, 16, 64, 256, 2048])
def test_no_candidate_fuses_gate_and_up_over_two_warpgroups(m):
    """GU_FUSED with 8 warps gives wrong pre-activations on the GPU; the launcher runs such a config unfused, so a
    candidate of that kind would only time the unfused tile under another name."""
    mod = _script()
    for cfg in mxfp4_moe_space(m) + mod.gate_up_tiles(m):
        assert not (int(cfg.get("GU_FUSED", 0)) and int(cfg.get("num_warps", 4)) > fm.FUSED_MAX_WARPS), cfg


def test_a_fused_config_of_two_warpgroups_launches_unfused():
    cfg = {**fm.DEFAULT_CONFIG, "BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 64, "GU_FUSED": 1}
    kw = dict(top_k=4, act=0, has_bias=True, pdl=False, **SHAPE)
    four = fm.gate_up_constexprs({**cfg, "num_warps": 4}, **kw)
    eight = fm.gate_up_constexprs({**cfg, "num_warps": 8}, **kw)
    assert four["FUSED"] and four["NUM_N"] == 2880 // 64
    assert not eight["FUSED"] and eight["NUM_N"] == -(-2880 // 128)
    assert eight == fm.gate_up_constexprs({**cfg, "num_warps": 8, "GU_FUSED": 0}, **kw)


OWN_TILES = MXFP4_OWN_TILE_SPACE + MXFP4_MID_SPACE[:1] + MXFP4_PREFILL_SPACE[:1]  # decode, mid-size, prefill


@pytest.mark.parametrize("index", range(len(OWN_TILES)))
def test_own_tile_configs_match_the_reference(index):
    """Each own-tile config at awkward sizes: N and K not multiples of the tiles (K = 64 k + 32), 9 tokens, without
    and with expert LoRA."""
    e, h, inter, top_k = 4, 96, 160, 4
    gen = torch.Generator().manual_seed(1000 + index)
    x = torch.randn(9, h, generator=gen)
    w13 = torch.randn(e, 2 * inter, h, generator=gen) / h ** 0.5
    w2 = torch.randn(e, h, inter, generator=gen) / inter ** 0.5
    b13, b2 = torch.randn(e, 2 * inter, generator=gen), torch.randn(e, h, generator=gen)
    weights, ids = torch.topk(torch.rand(9, e, generator=gen).softmax(-1), top_k, dim=-1)
    (q13, s13), (q2, s2) = quantize_mxfp4(w13), quantize_mxfp4(w2)
    kernel = (*prepare_for_kernel(q13, s13), *prepare_for_kernel(q2, s2))
    kw = dict(activation="swiglu_clamp", b13=b13, b2=b2)
    got = fm.fused_moe_mxfp4(x, *kernel, weights, ids, config=OWN_TILES[index], **kw)
    want = ref.fused_moe_mxfp4(x, q13, s13, q2, s2, weights, ids, **kw)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    # the LoRA path with the same base config: the pre-activation stored (row blocks past the epilogue's size) or the
    # deltas in the epilogues, two adapters of rank 4 on both expert targets, some tokens without one
    lora = dict(w13_lora=(torch.randn(2, e, 4, h, generator=gen) / h ** 0.5,
                          torch.randn(2, e, 2 * inter, 4, generator=gen) * 0.1),
                w2_lora=(torch.randn(2, e, 4, inter, generator=gen) / inter ** 0.5,
                         torch.randn(2, e, h, 4, generator=gen) * 0.1))
    idx, scaling = torch.tensor([0, 1, -1, 1, 0, 0, -1, 1, 1], dtype=torch.int32), torch.tensor([2.0, 0.5])
    got = moe_experts_lora(x, kernel[0], kernel[2], weights, ids, idx, scaling, w13_scale=kernel[1],
                           w2_scale=kernel[3], config=OWN_TILES[index], **lora, **kw)
    want = ref.moe_experts_lora(x, q13, q2, weights, ids, idx, scaling, w13_scale=s13, w2_scale=s2, **lora, **kw)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
