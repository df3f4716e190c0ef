"""MXFP4 kernel-layout GEMMs with the weights read through TMA (``fused_moe_mxfp4`` config keys "TMA" and
"DOWN_TMA", ``mxfp4_dequant.load_kernel_atom``) against the reference under the interpreter at awkward sizes (K =
64 + 32, N not a multiple of BLOCK_N, boxes past the row groups, split-K, experts without tokens), with the LoRA
deltas in the epilogues, the refusals, and the sm_90 build (TMA copies, the decoded fragment kept in registers)."""

import pytest
import torch

from loraplex.kernels import reference_lora as ref
from loraplex.kernels.fused_moe_mxfp4 import fused_moe_mxfp4
from tests.kernels.sm90_build import build_in_child
from tests.kernels.test_mxfp4_kernel_layout import BUILD_PRELUDE, CONFIGS, EPILOGUE_CASES, _moe, check_epilogue_case
from tests.utils.tuning_files import committed_configs, config_id

TMA_CONFIGS = {
    "fused 8x64x64": {"BLOCK_M": 8, "BLOCK_N": 64, "BLOCK_K": 64, "GROUP_M": 1, "GU_FUSED": 1, "TMA": 1,
                      "DOWN_TMA": 1, "num_warps": 4, "num_stages": 3},
    "16x64x128 split2": {"BLOCK_M": 16, "BLOCK_N": 64, "BLOCK_K": 128, "GROUP_M": 2, "SPLIT_K": 2, "GU_SPLIT_K": 2,
                         "TMA": 1, "DOWN_TMA": 1, "num_warps": 4, "num_stages": 4},
    "fused 8x128x128 direct split3 bits": {"BLOCK_M": 8, "BLOCK_N": 128, "BLOCK_K": 128, "GROUP_M": 1,
                                           "GU_FUSED": 1, "DIRECT": 1, "SPLIT_K": 3, "GU_SPLIT_K": 3,
                                           "DECODE": "bits", "TMA": 1, "DOWN_TMA": 1, "num_warps": 4,
                                           "num_stages": 6},
    "gate_up only 32x32x64": {"BLOCK_M": 32, "BLOCK_N": 32, "BLOCK_K": 64, "GROUP_M": 1, "TMA": 1, "num_warps": 4,
                              "num_stages": 2},
    "down only 16x64x64, down 128 rows": {"BLOCK_M": 16, "BLOCK_N": 64, "BLOCK_K": 64, "GROUP_M": 1,
                                          "DOWN_TMA": 1, "DOWN_BLOCK_N": 128, "DOWN_BLOCK_K": 128,
                                          "num_warps": 4, "num_stages": 2},
}


@pytest.mark.parametrize("num_tokens,top_k,with_bias,config", [
    (1, 4, True, "fused 8x64x64"),
    (33, 4, True, "16x64x128 split2"),
    (2, 4, False, "fused 8x128x128 direct split3 bits"),
    (7, 2, True, "gate_up only 32x32x64"),
    (33, 4, True, "down only 16x64x64, down 128 rows"),
])
def test_tma_configs_match_reference(num_tokens, top_k, with_bias, config):
    x, plain, kernel, weights, ids, b13, b2 = _moe(num_tokens, top_k, with_bias)
    kw = dict(activation="swiglu_clamp", b13=b13, b2=b2, alpha=1.702, limit=7.0)
    got = fused_moe_mxfp4(x, *kernel, weights, ids, config=TMA_CONFIGS[config], **kw)
    want = ref.fused_moe_mxfp4(x, *plain, weights, ids, **kw)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def test_tma_with_bf16_activations():
    x, plain, kernel, weights, ids, b13, b2 = _moe(3, 4, True, torch.bfloat16)
    kw = dict(activation="silu", b13=b13, b2=b2)
    got = fused_moe_mxfp4(x, *kernel, weights, ids, config=TMA_CONFIGS["16x64x128 split2"], **kw)
    want = ref.fused_moe_mxfp4(x, *plain, weights, ids, **kw)
    assert got.dtype == torch.bfloat16
    assert ((got.float() - want.float()).norm() / want.float().norm()).item() < 1e-2


@pytest.mark.parametrize("tokens,top_k,config", [(29, 4, "16x64x128 split2"),
                                                  (3, 4, "fused 8x128x128 direct split3 bits")])
def test_tma_with_the_lora_deltas_in_the_epilogues(tokens, top_k, config, monkeypatch):
    """The decode path (shrinks, then the GEMMs with the expands in their epilogues) on TMA tiles."""
    monkeypatch.setitem(CONFIGS, "tma", TMA_CONFIGS[config])
    monkeypatch.setitem(EPILOGUE_CASES, "tma", (tokens, top_k, "tma"))
    check_epilogue_case("tma")


def test_tma_refusals():
    x, _, kernel, weights, ids, _, _ = _moe(3, 2, False)
    base = TMA_CONFIGS["fused 8x64x64"]
    with pytest.raises(ValueError, match="TMA and PREFETCH"):
        fused_moe_mxfp4(x, *kernel, weights, ids, config={**base, "PREFETCH": 1})
    with pytest.raises(ValueError, match="TMA and PREFETCH"):
        fused_moe_mxfp4(x, *kernel, weights, ids, config={**base, "DOWN_PREFETCH": 1})
    with pytest.raises(ValueError, match="TMA 2: expected 0 or 1"):
        fused_moe_mxfp4(x, *kernel, weights, ids, config={**base, "TMA": 2})


BUILD = BUILD_PRELUDE + r'''

def build(kernel, consts, warps, stages, halves, groups):
    types = dict(TYPES, w_ptr=f"tensordesc<i32[1, {halves}, {groups}, 4, 32]>",
                 s_ptr=f"tensordesc<i32[1, {halves}, {groups}, 8]>")
    compiled = build_sm90(kernel, consts, types, warps, stages)
    ptx = compiled.asm["ptx"]
    shape = "tensor<{}x64x".format(consts["BLOCK_N"])
    return {"tma": len(re.findall(r"cp\.async\.bulk\.tensor", ptx)),
            "asm": "fma.rn.bf16x2" in ptx, "loop": loop_stats(compiled),
            "smem_tile": re.search(r"local_alloc %\S+ : \(" + shape, compiled.asm["ttgir"]) is not None}

out = []
# the H200's decode tile (M = 1: 8-row blocks, 128 weight rows, gate and up in one product, split-K 2) with TMA
common = dict(HAS_BIAS=True, BLOCK_M=8, BLOCK_N=128, BLOCK_K=128, GROUP_M=1, NUM_N=45, EVEN_K=True, DECODE=2,
              DIRECT=False, SPLIT_K=2, PREFETCH=0, USE_PDL=True, TMA=True)
out.append(build(fm._gate_up_kernel, dict(common, FUSED=True, TOP_K=4, ACT=2), 4, 4, 2, 4))
out.append(build(fm._gate_up_kernel, dict(common, FUSED=False, TOP_K=4, ACT=2, BLOCK_N=64), 4, 4, 1, 4))
out.append(build(fm._down_kernel, dict(common, BLOCK_N=64), 4, 4, 1, 4))
print("RESULT " + json.dumps(out))
'''


def test_tma_gemms_build_for_sm90():
    """Built for sm_90 (no GPU needed): each K step's atoms are TMA copies, the products MMAs (wgmma or mma.sync, as
    the installed Triton picks for 8-row blocks) on the inline-PTX decode, and the decoded tile is the MMA's
    register operand (never put in shared memory) with no lane shuffles in the K loop: the one-atom boxes land in
    the fragments' lanes as they are."""
    for b in build_in_child(BUILD, timeout=900):
        assert b["tma"] > 0 and b["asm"] and not b["smem_tile"], b
        assert b["loop"]["mma"] and not b["loop"]["shfl"], b


def test_the_tuner_tries_tma_tiles_at_decode_sizes():
    from loraplex.kernels.tuning_cases import MXFP4_OWN_TILE_SPACE, MXFP4_TMA_SPACE, mxfp4_moe_space

    for m in (1, 4, 16):
        space = mxfp4_moe_space(m)
        n = len(MXFP4_OWN_TILE_SPACE)
        assert space[n:n + len(MXFP4_TMA_SPACE)] == MXFP4_TMA_SPACE  # right after the own-tile configs
    assert MXFP4_TMA_SPACE[3] in mxfp4_moe_space(64) and MXFP4_TMA_SPACE[0] not in mxfp4_moe_space(64)
    for m in (128, 2048):
        assert not any(c.get("TMA") or c.get("DOWN_TMA") for c in mxfp4_moe_space(m))


@pytest.mark.parametrize("index", range(4))
def test_tuner_tma_candidates_match_reference(index):
    from loraplex.kernels.tuning_cases import MXFP4_TMA_SPACE

    x, plain, kernel, weights, ids, b13, b2 = _moe(2, 4, True)
    kw = dict(activation="swiglu_clamp", b13=b13, b2=b2)
    got = fused_moe_mxfp4(x, *kernel, weights, ids, config=MXFP4_TMA_SPACE[index], **kw)
    torch.testing.assert_close(got, ref.fused_moe_mxfp4(x, *plain, weights, ids, **kw), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("cfg", [c for c in committed_configs("fused_moe_mxfp4") if int(c["BLOCK_M"]) <= 16],
                         ids=config_id)
def test_the_benchmarks_tma_variant_of_each_committed_decode_config_matches_reference(cfg):
    """``tuning_cases.mxfp4_variants``' "tma" row (what the kernel benchmark and the GPU check run beside the tuned
    config): the committed tile with both GEMMs through TMA, register prefetch and the one launch off."""
    from loraplex.kernels.tuning_cases import mxfp4_variants

    tma = mxfp4_variants(dict(cfg))["tma"]
    x, plain, kernel, weights, ids, b13, b2 = _moe(5, 4, True)
    kw = dict(activation="swiglu_clamp", b13=b13, b2=b2)
    got = fused_moe_mxfp4(x, *kernel, weights, ids, config=tma, **kw)
    torch.testing.assert_close(got, ref.fused_moe_mxfp4(x, *plain, weights, ids, **kw), rtol=1e-4, atol=1e-4)
