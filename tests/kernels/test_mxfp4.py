"""MXFP4: the torch format (round trip, nearest rounding, byte layout), the in-kernel tile decode, and the fused
MoE GEMMs with MXFP4 weights (W_MXFP4) against the dequantise-then-float reference."""

import pytest
import torch
import triton
import triton.language as tl

from loraplex.kernels import ops, reference
from loraplex.kernels import reference_lora as ref
from loraplex.kernels.fused_moe_mxfp4 import fused_moe_mxfp4
from loraplex.kernels.mxfp4 import E2M1_VALUES, dequantize_mxfp4, quantize_mxfp4
from loraplex.kernels.mxfp4_dequant import load_mxfp4_tile
from tests.kernels.sm90_build import build_in_child


def _on_grid(n: int, k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Random MXFP4 tensors [n, k] whose every block holds a code of magnitude >= 4, so that quantising their
    dequantised values must give back the same bytes: (codes [n, k], scales [n, k/32], values)."""
    codes = torch.randint(0, 16, (n, k), dtype=torch.uint8)
    codes[codes == 8] = 0  # -0 quantises to +0
    codes[:, ::32] = torch.randint(6, 8, (n, k // 32), dtype=torch.uint8) | (torch.randint(0, 2, (n, k // 32),
                                                                                            dtype=torch.uint8) << 3)
    scales = torch.randint(2, 126, (n, k // 32), dtype=torch.uint8)  # 6 * 2^(125-127) .. stays finite in fp32
    blocks = codes[:, 0::2] | (codes[:, 1::2] << 4)
    return blocks, scales, dequantize_mxfp4(blocks, scales)


def test_values_on_the_grid_round_trip_exactly():
    blocks, scales, w = _on_grid(7, 96)
    got_blocks, got_scales = quantize_mxfp4(w)
    assert torch.equal(got_blocks, blocks) and torch.equal(got_scales, scales)
    assert torch.equal(dequantize_mxfp4(got_blocks, got_scales), w)
    assert torch.equal(dequantize_mxfp4(blocks, scales, torch.bfloat16).float(), w)  # exact in bf16 too


def test_random_values_round_to_the_nearest_grid_value():
    w = torch.randn(3, 5, 128) * torch.logspace(-4, 4, 128)  # blocks of very different magnitudes
    blocks, scales = quantize_mxfp4(w)
    assert blocks.shape == (3, 5, 64) and scales.shape == (3, 5, 4) and blocks.dtype == scales.dtype == torch.uint8
    deq = dequantize_mxfp4(blocks, scales)
    # the OCP shared exponent: floor(log2(block absmax)) - 2
    amax = w.view(3, 5, 4, 32).abs().amax(-1)
    assert torch.equal(scales.long() - 127, torch.floor(torch.log2(amax)).long() - 2)
    # every element is the nearest of the block's 16 representable values (saturating at +-6 * scale)
    grid = torch.tensor(E2M1_VALUES + tuple(-v for v in E2M1_VALUES))
    step = torch.ldexp(torch.ones(()), scales.float() - 127).repeat_interleave(32, -1)  # [3, 5, 128]
    candidates = grid * step[..., None]  # [3, 5, 128, 16]
    best = (w[..., None] - candidates).abs().min(-1).values
    torch.testing.assert_close((w - deq).abs(), best, rtol=1e-6, atol=0)
    rel = ((deq - w).norm() / w.norm()).item()
    assert 0 < rel < 0.15, rel


def test_hand_made_block_bytes_and_scales():
    w = torch.zeros(2, 64)
    w[0, :8] = torch.tensor([0.5, -1.0, 6.0, 0.25, 0.75, 1.25, 5.0, 7.0])  # absmax 7: exponent 2 - 2 = 0
    w[1, 32:36] = torch.tensor([-0.125, 0.0625, 0.1875, -0.09375])  # absmax 0.1875: exponent -3 - 2 = -5
    blocks, scales = quantize_mxfp4(w)
    # low nibble = even k: (0.5 -> 1, -1 -> 8|2), (6 -> 7, 0.25 ties to even -> 0), (0.75 ties to even -> 2,
    # 1.25 ties to even -> 2), (5 ties to even -> 6 (4.0), 7 saturates -> 7 (6.0)); block 1 of row 1 in units of
    # 2^-5: (-4 -> 8|6, 2 -> 4), (6 -> 7, -3 -> 8|5)
    assert blocks[0, :4].tolist() == [0x1 | 0xA << 4, 0x7, 0x2 | 0x2 << 4, 0x6 | 0x7 << 4]
    assert blocks[1, 16:18].tolist() == [0xE | 0x4 << 4, 0x7 | 0xD << 4]
    assert scales.tolist() == [[127, 0], [0, 122]]  # all-zero blocks: byte 0 (2^-127)
    assert dequantize_mxfp4(blocks, scales)[0, :8].tolist() == [0.5, -1.0, 6.0, 0.0, 1.0, 1.0, 4.0, 6.0]
    assert torch.equal(dequantize_mxfp4(blocks, scales)[1], w[1])


def test_bad_input_is_refused():
    with pytest.raises(ValueError, match="multiple of 32"):
        quantize_mxfp4(torch.randn(4, 48))
    with pytest.raises(ValueError, match="NaN or Inf"):
        quantize_mxfp4(torch.tensor([float("nan")] + [1.0] * 31))
    blocks, scales = quantize_mxfp4(torch.randn(4, 64))
    with pytest.raises(ValueError, match="do not match"):
        dequantize_mxfp4(blocks, scales[:, :1])
    with pytest.raises(ValueError, match="uint8 blocks and scales"):
        dequantize_mxfp4(blocks.to(torch.int8), scales)


@triton.jit
def _decode_kernel(w_ptr, s_ptr, out_ptr, N, K, stride_wn, stride_sn, BLOCK_K: tl.constexpr,
                   BLOCK_N: tl.constexpr, EVEN_K: tl.constexpr):
    cols = tl.arange(0, BLOCK_N)
    col_ok = cols < N
    k = tl.arange(0, BLOCK_K)
    w_ptrs = w_ptr + cols[None, :] * stride_wn + tl.arange(0, BLOCK_K // 2)[:, None]
    s_ptrs = s_ptr + cols[None, :] * stride_sn + tl.arange(0, BLOCK_K // 32)[:, None]
    for k0 in range(0, K, BLOCK_K):
        tile = load_mxfp4_tile(w_ptrs, s_ptrs, k0, K, col_ok, EVEN_K, BLOCK_K, BLOCK_N)
        tl.store(out_ptr + cols[None, :] * K + (k0 + k)[:, None], tile, mask=col_ok[None, :] & (k0 + k < K)[:, None])
        w_ptrs += BLOCK_K // 2
        s_ptrs += BLOCK_K // 32


@pytest.mark.parametrize("block_k", [32, 64, 128])
def test_triton_tile_decode_equals_dequantize(block_k):
    n, k = 5, 96  # 96: a multiple of 32, not of 64 or 128 (the masked K tail)
    blocks, scales = quantize_mxfp4(torch.randn(n, k) * torch.logspace(-3, 3, k))
    out = torch.full((n, k), float("nan"))
    _decode_kernel[(1,)](blocks, scales, out, n, k, blocks.stride(0), scales.stride(0), BLOCK_K=block_k, BLOCK_N=8,
                         EVEN_K=k % block_k == 0)
    assert torch.equal(out, dequantize_mxfp4(blocks, scales))


# ------------------------------------------------------------------------------------------ fused MoE

E, H, INTER = 8, 96, 160  # H, I multiples of 32, not of BLOCK_K = 64
CFG = {"BLOCK_M": 16, "BLOCK_N": 32, "BLOCK_K": 64, "GROUP_M": 2, "num_warps": 4, "num_stages": 1}


def _moe(num_tokens: int, top_k: int, with_bias: bool):
    x = torch.randn(num_tokens, H)
    w13 = torch.randn(E, 2 * INTER, H) / H ** 0.5
    w2 = torch.randn(E, H, INTER) / INTER ** 0.5
    scores = torch.rand(num_tokens, E)
    scores[:, -2:] = -1  # the last two experts receive no token
    weights, ids = torch.topk(scores.softmax(-1), top_k, dim=-1)
    b13 = torch.randn(E, 2 * INTER) if with_bias else None
    b2 = torch.randn(E, H) if with_bias else None
    return x, w13, w2, weights, ids, b13, b2


@pytest.mark.parametrize("num_tokens", [1, 7, 33])
@pytest.mark.parametrize("top_k", [2, 4])
@pytest.mark.parametrize("activation,with_bias", [("silu", False), ("swiglu_clamp", True)])
def test_fused_moe_mxfp4_matches_reference(num_tokens, top_k, activation, with_bias):
    x, w13, w2, weights, ids, b13, b2 = _moe(num_tokens, top_k, with_bias)
    q13, s13 = quantize_mxfp4(w13)
    q2, s2 = quantize_mxfp4(w2)
    kw = dict(activation=activation, b13=b13, b2=b2, alpha=1.702, limit=7.0)
    got = fused_moe_mxfp4(x, q13, s13, q2, s2, weights, ids, config=CFG, **kw)
    want = ref.fused_moe_mxfp4(x, q13, s13, q2, s2, weights, ids, **kw)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    # the reference is the float op on the dequantised weights
    deq = reference.fused_moe(x, dequantize_mxfp4(q13, s13), dequantize_mxfp4(q2, s2), weights, ids, **kw)
    torch.testing.assert_close(want, deq, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("block_k", [32, 128])  # 32: no K tail (EVEN_K); 128: one step wider than H = 96
def test_fused_moe_mxfp4_other_block_k(block_k):
    x, w13, w2, weights, ids, b13, b2 = _moe(7, 4, True)
    args = (x, *quantize_mxfp4(w13), *quantize_mxfp4(w2), weights, ids)
    kw = dict(activation="swiglu_clamp", b13=b13, b2=b2)
    got = fused_moe_mxfp4(*args, config={**CFG, "BLOCK_K": block_k}, **kw)
    torch.testing.assert_close(got, ref.fused_moe_mxfp4(*args, **kw), rtol=1e-4, atol=1e-4)


def test_fused_moe_mxfp4_default_config_and_dispatch():
    x, w13, w2, weights, ids, b13, b2 = _moe(5, 2, True)
    args = (x, *quantize_mxfp4(w13), *quantize_mxfp4(w2), weights, ids)
    kw = dict(activation="swiglu_clamp", b13=b13, b2=b2)
    want = ref.fused_moe_mxfp4(*args, **kw)
    torch.testing.assert_close(fused_moe_mxfp4(*args, **kw), want, rtol=1e-4, atol=1e-4)
    assert torch.equal(ops.fused_moe_mxfp4(*args, **kw), want)  # CPU tensors: the reference


def test_fused_moe_mxfp4_rejects_bad_weights():
    x, w13, w2, weights, ids, _, _ = _moe(3, 2, False)
    q13, s13 = quantize_mxfp4(w13)
    q2, s2 = quantize_mxfp4(w2)
    with pytest.raises(ValueError, match="uint8 blocks and scales"):
        fused_moe_mxfp4(x, q13.to(torch.int8), s13, q2, s2, weights, ids)
    with pytest.raises(ValueError, match="do not match"):
        fused_moe_mxfp4(x, q13, s13, q2[:, :, :-16].contiguous(), s2[:, :, :-1].contiguous(), weights, ids)
    with pytest.raises(ValueError, match="BLOCK_K"):
        fused_moe_mxfp4(x, q13, s13, q2, s2, weights, ids, config={**CFG, "BLOCK_K": 16})


# ------------------------------------------------------------------------ expert LoRA on MXFP4 weights

L, R = 3, 16
LORA_CFG = {"BLOCK_M": 16, "BLOCK_N": 32, "BLOCK_K": 32, "SPLIT_K": 2, "GROUP_M": 1, "num_warps": 4,
            "num_stages": 1}


def _expert_lora(k: int, n: int):
    return torch.randn(L, E, R, k) / k ** 0.5, torch.randn(L, E, n, R) / R ** 0.5


@pytest.mark.parametrize("num_tokens", [1, 33])
def test_moe_experts_lora_on_mxfp4_matches_reference(num_tokens):
    """The Triton op on MXFP4 blocks against its reference; the reference equals the float op on the dequantised
    weights."""
    from loraplex.kernels.moe_experts_lora import moe_experts_lora

    x, w13, w2, weights, ids, b13, b2 = _moe(num_tokens, 4, True)
    q13, s13 = quantize_mxfp4(w13)
    q2, s2 = quantize_mxfp4(w2)
    idx = torch.arange(num_tokens, dtype=torch.int32) % (L + 1) - 1  # -1 (no adapter), 0, 1, 2, ...
    scaling = torch.rand(L) + 0.5
    kw = dict(w13_lora=_expert_lora(H, 2 * INTER), w2_lora=_expert_lora(INTER, H), activation="swiglu_clamp",
              b13=b13, b2=b2, alpha=1.702, limit=7.0)
    got = moe_experts_lora(x, q13, q2, weights, ids, idx, scaling, w13_scale=s13, w2_scale=s2, config=CFG,
                           lora_config_override=LORA_CFG, **kw)
    want = ref.moe_experts_lora(x, q13, q2, weights, ids, idx, scaling, w13_scale=s13, w2_scale=s2, **kw)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    deq = ref.moe_experts_lora(x, dequantize_mxfp4(q13, s13), dequantize_mxfp4(q2, s2), weights, ids, idx, scaling,
                               **kw)
    torch.testing.assert_close(want, deq, rtol=1e-5, atol=1e-5)
    base = ref.fused_moe_mxfp4(x, q13, s13, q2, s2, weights, ids, activation="swiglu_clamp", b13=b13, b2=b2)
    if (idx >= 0).any():
        assert (got - base)[idx >= 0].abs().max() > 0.05  # the adapters change the result
    torch.testing.assert_close(got[idx < 0], base[idx < 0], rtol=1e-4, atol=1e-4)
    # without an adapter map: the base GEMMs alone
    got_base = moe_experts_lora(x, q13, q2, weights, ids, None, scaling, w13_scale=s13, w2_scale=s2, config=CFG, **kw)
    torch.testing.assert_close(got_base, base, rtol=1e-4, atol=1e-4)


def test_moe_experts_lora_refuses_mxfp4_without_both_scales():
    x, w13, w2, weights, ids, _, _ = _moe(3, 2, False)
    q13, s13 = quantize_mxfp4(w13)
    q2, _ = quantize_mxfp4(w2)
    with pytest.raises(ValueError, match="need both w13_scale and w2_scale"):
        ref.moe_experts_lora(x, q13, q2, weights, ids, None, torch.ones(L), w13_scale=s13)


BUILD = r'''
import json, triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from loraplex.kernels.launch import jit_function
from loraplex.kernels import fused_moe as fm

TYPES = {"w_ptr": "*u8", "scale_ptr": "*u8", "weights_ptr": "*fp32", "sorted_ptr": "*i32", "expert_ids_ptr": "*i32",
         "num_post_ptr": "*i32"}

def build(kernel, consts):
    sig = {n: "constexpr" if n in consts else TYPES.get(n, "*bf16") if n.endswith("_ptr")
           else "fp32" if n in ("alpha", "limit") else "i32" for n in kernel.arg_names}
    src = ASTSource(fn=jit_function(kernel), signature=sig, constexprs={(kernel.arg_names.index(n),): v for n, v in consts.items()})
    return "mxfp4" if triton.compile(src, target=GPUTarget("cuda", 90, 32)).asm["ptx"] else ""

out = []
for block_k, even_k, act in ((64, True, 1), (128, False, 2)):
    consts = dict(W_INT8=False, W_MXFP4=True, HAS_BIAS=True, BLOCK_M=16, BLOCK_N=64, BLOCK_K=block_k, GROUP_M=1,
                  NUM_N=45, EVEN_K=even_k)
    out += [build(fm._moe_gate_up_kernel, {**consts, "TOP_K": 4, "ACT": act}), build(fm._moe_down_kernel, consts)]
print("RESULT " + json.dumps(out))
'''


def test_mxfp4_kernels_build_for_sm90():
    """The W_MXFP4 GEMMs (tile decode with join / permute / reshape, which the interpreter runs without layouts)
    compile for sm_90, with and without the K tail mask."""
    assert build_in_child(BUILD, timeout=600) == ["mxfp4"] * 4


def test_tuning_case_runs_and_counts_4_25_bits_a_weight():
    """The fused_moe_mxfp4 case the tuner, the GPU check and the kernel benchmark run (none where H or I is not a
    multiple of 32)."""
    from loraplex.kernels.tuning_cases import ModelShapes, moe_cases

    shapes = ModelShapes("tiny", hidden=64, num_experts=4, top_k=2, moe_intermediate=32, num_heads=4, num_kv_heads=2,
                         head_dim=16, activation="swiglu_clamp", expert_bias=True)
    (case,) = moe_cases(shapes, 3, torch.float32, "cpu", weights="mxfp4")
    assert case.op == case.label == "fused_moe_mxfp4"
    assert case.check() < 1e-4
    case.run(case.default)
    assert case.space and all(c["BLOCK_K"] >= 32 for c in case.space)
    weights_per_expert = 2 * 32 * 64 + 64 * 32
    act_bytes = 3 * 64 * 4 * 2 + 3 * 2 * 32 * 4 * 2
    active = (case.nbytes - act_bytes) / (weights_per_expert * 4.25 / 8)
    assert active == int(active) and 1 <= active <= 4
    odd = ModelShapes("odd", hidden=72, num_experts=4, top_k=2, moe_intermediate=32, num_heads=4, num_kv_heads=2,
                      head_dim=16)
    assert moe_cases(odd, 3, torch.float32, "cpu", weights="mxfp4") == []
