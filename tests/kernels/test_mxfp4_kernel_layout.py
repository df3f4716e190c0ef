"""MXFP4 kernel layout (``mxfp4.prepare_for_kernel``): the repack and its inverse, the documented bit positions,
the in-kernel tile decode, and the fused MoE / expert-LoRA GEMMs that read it, against the references (fresh
random inputs, awkward shapes: M = 1 and 33, N not a multiple of BLOCK_N, K = 64k + 32, experts without tokens)."""

import pytest
import torch
import triton
import triton.language as tl

from loraplex.kernels import ops
from loraplex.kernels import reference_lora as ref
from loraplex.kernels.fused_moe_mxfp4 import fused_moe_mxfp4
from loraplex.kernels.mxfp4 import (dequantize_mxfp4, is_kernel_layout, kernel_k, prepare_for_kernel,
                                    quantize_mxfp4, restore_from_kernel)
from loraplex.kernels.mxfp4_dequant import (BF16_FOLD, decode_kernel_tile, kernel_tile_ptrs, load_kernel_tile,
                                            row_groups)
from tests.kernels.sm90_build import build_in_child
from tests.utils.tuning_files import committed_configs, config_id

CODE_BITS = ((15, 8, 7, 6), (12, 5, 4, 3), (9, 2, 1, 0), (13, 11, 10, 14))  # (sign, e1, e0, m), docstring's table


def _random_format(*shape: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Every byte value in the blocks, scales in the range the bf16 decode is exact for."""
    *lead, n, k = shape
    blocks = torch.randint(0, 256, (*lead, n, k // 2), dtype=torch.uint8)
    scales = torch.randint(100, 140, (*lead, n, k // 32), dtype=torch.uint8)
    return blocks, scales


@pytest.mark.parametrize("shape", [(16, 64), (3, 48, 96), (2, 2, 32, 160), (32, 32)])
def test_round_trip_and_dequantize(shape):
    blocks, scales = _random_format(*shape)
    words, kscales = prepare_for_kernel(blocks, scales)
    k = shape[-1]
    assert is_kernel_layout(words) and not is_kernel_layout(blocks)
    assert words.shape == (*shape[:-1], kernel_k(k) // 8) and kscales.shape == (*shape[:-1], kernel_k(k) // 32)
    back = restore_from_kernel(words, kscales, k)
    assert torch.equal(back[0], blocks) and torch.equal(back[1], scales)
    assert torch.equal(dequantize_mxfp4(words, kscales, k=k), dequantize_mxfp4(blocks, scales))
    padded = dequantize_mxfp4(words, kscales)  # default k: the padded K, zeros past K
    assert padded.shape[-1] == kernel_k(k) and not padded[..., k:].any()


def test_codes_land_where_the_docstring_says():
    """One nonzero code at a time: row 16 rg + 8 jr + g, k = 64 ka + 16 kt + 8 jk + 2 q + h goes to word
    (rg, ka, lane 4 g + q, kt), bits CODE_BITS[2 jk + jr] of half h; its scale to byte (rg, ka, g, kb, jr)."""
    n, k = 32, 192
    gen = torch.Generator().manual_seed(1)
    for _ in range(24):
        row, col = int(torch.randint(0, n, (), generator=gen)), int(torch.randint(0, k, (), generator=gen))
        code = int(torch.randint(1, 16, (), generator=gen))
        codes = torch.zeros(n, k, dtype=torch.uint8)
        codes[row, col] = code
        blocks = codes[:, 0::2] | (codes[:, 1::2] << 4)
        scales = torch.zeros(n, k // 32, dtype=torch.uint8)
        scales[row, col // 32] = 77
        words, kscales = prepare_for_kernel(blocks, scales)
        rg, jr, g = row // 16, (row % 16) // 8, row % 8
        ka, kt, jk, q, h = col // 64, (col % 64) // 16, (col % 16) // 8, (col % 8) // 2, col % 2
        flat = words.reshape(-1).to(torch.int64) & 0xFFFFFFFF
        index = ((rg * (k // 64) + ka) * 32 + 4 * g + q) * 4 + kt
        expect = sum(((code >> bit) & 1) << (pos + 16 * h) for bit, pos in zip((3, 2, 1, 0), CODE_BITS[2 * jk + jr]))
        assert flat[index] == expect and flat.count_nonzero() == 1
        kb = (col % 64) // 32
        sflat = kscales.reshape(-1)
        sindex = ((rg * (k // 64) + ka) * 8 + g) * 4 + 2 * kb + jr
        assert sflat[sindex] == 77 and sflat.count_nonzero() == 1


def test_bad_layout_input_is_refused():
    blocks, scales = _random_format(24, 64)
    with pytest.raises(ValueError, match="multiple of 16"):
        prepare_for_kernel(blocks, scales)
    words, kscales = prepare_for_kernel(*_random_format(16, 96))
    with pytest.raises(ValueError, match="does not match"):
        restore_from_kernel(words, kscales, 64)
    with pytest.raises(ValueError, match="int32 words and uint8 scales"):
        restore_from_kernel(words, kscales.to(torch.int8), 96)
    with pytest.raises(ValueError, match="do not match"):
        restore_from_kernel(words[:, :-1], kscales, 96)
    blocks, scales = _random_format(16, 64)
    scales[3, 1] = 192  # 2^65: past what the bf16 decode's factor 2^(s - 64) holds
    with pytest.raises(ValueError, match="checkpoint layout"):
        prepare_for_kernel(blocks, scales)


@triton.jit
def _decode_kernel(w_ptr, s_ptr, out_ptr, N, K, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr,
                   DTYPE: tl.constexpr):
    atoms = (K + 63) // 64
    w_ptrs, s_ptrs = kernel_tile_ptrs(w_ptr, s_ptr.to(tl.pointer_type(tl.int32)),
                                      row_groups(tl.program_id(0) * (BLOCK_N // 16), N // 16, BLOCK_N // 16), atoms,
                                      BLOCK_K)
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    k = tl.arange(0, BLOCK_K)
    for k0 in range(0, K, BLOCK_K):
        words, scales = load_kernel_tile(w_ptrs, s_ptrs, k0 // 64, atoms, not EVEN_K, BLOCK_K)
        tile = decode_kernel_tile(words, scales, BLOCK_N, BLOCK_K, DTYPE, 0).to(tl.float32)
        tl.store(out_ptr + rows[:, None] * K + (k0 + k)[None, :], tile,
                 mask=(rows < N)[:, None] & (k0 + k < K)[None, :])
        w_ptrs += BLOCK_K * 2
        s_ptrs += BLOCK_K // 8


@pytest.mark.parametrize("block_n,block_k", [(16, 64), (64, 128), (32, 256)])
@pytest.mark.parametrize("dtype", [tl.float32, tl.bfloat16])
def test_triton_tile_decode_equals_dequantize(block_n, block_k, dtype):
    """float32: the exact weights; bf16: weights * 2^-63 (the fold the epilogue undoes). N = 48 (the last row
    block clamped), K = 160 (a padded atom, a K tail)."""
    n, k = 48, 160
    blocks, scales = quantize_mxfp4(torch.randn(n, k) * torch.logspace(-3, 3, k))
    words, kscales = prepare_for_kernel(blocks, scales)
    out = torch.full((n, k), float("nan"))
    _decode_kernel[(triton.cdiv(n, block_n),)](words, kscales, out, n, k, BLOCK_N=block_n, BLOCK_K=block_k,
                                               EVEN_K=k % block_k == 0, DTYPE=dtype)
    want = dequantize_mxfp4(blocks, scales)
    if dtype == tl.bfloat16:
        want = want / BF16_FOLD.value
    assert torch.equal(out, want)


# ------------------------------------------------------------------------------------------ fused MoE

E, H, INTER = 8, 96, 160  # K = 64 + 32 (gate_up) and 2 x 64 + 32 (down); N = 160, 96: not multiples of BLOCK_N
CONFIGS = {
    "16x64x64": {"BLOCK_M": 16, "BLOCK_N": 64, "BLOCK_K": 64, "GROUP_M": 2, "num_warps": 4, "num_stages": 1},
    "16x128x128 split2": {"BLOCK_M": 16, "BLOCK_N": 128, "BLOCK_K": 128, "GROUP_M": 1, "SPLIT_K": 2,
                          "num_warps": 4, "num_stages": 1},
    "32x32x64 split3 bits": {"BLOCK_M": 32, "BLOCK_N": 32, "BLOCK_K": 64, "GROUP_M": 1, "SPLIT_K": 3,
                             "DECODE": "bits", "num_warps": 4, "num_stages": 1},
    "direct 16x64x128": {"BLOCK_M": 16, "BLOCK_N": 64, "BLOCK_K": 128, "GROUP_M": 2, "SPLIT_K": 2, "DIRECT": 1,
                         "num_warps": 4, "num_stages": 1},
    "8x64x64 gate_up split3": {"BLOCK_M": 8, "BLOCK_N": 64, "BLOCK_K": 64, "GROUP_M": 1, "SPLIT_K": 2,
                               "GU_SPLIT_K": 3, "PDL": 1, "num_warps": 4, "num_stages": 3},
    "fused 16x64x64 prefetch": {"BLOCK_M": 16, "BLOCK_N": 64, "BLOCK_K": 64, "GROUP_M": 2, "GU_FUSED": 1,
                                "PREFETCH": 1, "num_warps": 4, "num_stages": 1},
    "fused 8x32x128 split2 bits": {"BLOCK_M": 8, "BLOCK_N": 32, "BLOCK_K": 128, "GROUP_M": 1, "GU_FUSED": 1,
                                   "GU_SPLIT_K": 2, "SPLIT_K": 2, "DECODE": "bits", "num_warps": 2,
                                   "num_stages": 2},
    "fused 16x128x128": {"BLOCK_M": 16, "BLOCK_N": 128, "BLOCK_K": 128, "GROUP_M": 1, "GU_FUSED": 1,
                         "num_warps": 4, "num_stages": 3},  # the tuned verify-step (M = 64) tile's shape
    "8x64x64, down 128x128 prefetch": {"BLOCK_M": 8, "BLOCK_N": 64, "BLOCK_K": 64, "GROUP_M": 1, "SPLIT_K": 2,
                                       "DOWN_BLOCK_N": 128, "DOWN_BLOCK_K": 128, "DOWN_PREFETCH": 1,
                                       "DOWN_num_stages": 1, "DOWN_DECODE": "bits", "num_warps": 4,
                                       "num_stages": 2},  # down's own tile (DOWN_ keys)
    "64x64x64": {"BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_K": 64, "GROUP_M": 1, "num_warps": 4, "num_stages": 1},
    "direct prefetch 8x128x64 split3": {"BLOCK_M": 8, "BLOCK_N": 128, "BLOCK_K": 64, "GROUP_M": 1, "DIRECT": 1,
                                        "PREFETCH": 1, "GU_SPLIT_K": 3, "SPLIT_K": 3, "num_warps": 1,
                                        "num_stages": 1},
}


def _moe(num_tokens: int, top_k: int, with_bias: bool, dtype=torch.float32):
    x = torch.randn(num_tokens, H).to(dtype)
    w13 = torch.randn(E, 2 * INTER, H) / H ** 0.5
    w2 = torch.randn(E, H, INTER) / INTER ** 0.5
    scores = torch.rand(num_tokens, E)
    scores[:, -2:] = -1  # the last two experts receive no token
    weights, ids = torch.topk(scores.softmax(-1), top_k, dim=-1)
    b13 = torch.randn(E, 2 * INTER).to(dtype) if with_bias else None
    b2 = torch.randn(E, H).to(dtype) if with_bias else None
    q13, s13 = quantize_mxfp4(w13)
    q2, s2 = quantize_mxfp4(w2)
    return x, (q13, s13, q2, s2), (*prepare_for_kernel(q13, s13), *prepare_for_kernel(q2, s2)), weights, ids, b13, b2


@pytest.mark.parametrize("num_tokens,top_k,activation,with_bias,config", [
    (1, 4, "swiglu_clamp", True, "16x64x64"),
    (33, 2, "silu", False, "16x64x64"),
    (33, 4, "swiglu_clamp", True, "16x128x128 split2"),
    (7, 4, "silu", True, "32x32x64 split3 bits"),
    (2, 4, "swiglu_clamp", True, "direct 16x64x128"),
    (33, 4, "swiglu_clamp", True, "8x64x64 gate_up split3"),
    (9, 2, "silu", True, "fused 16x64x64 prefetch"),
    (33, 4, "swiglu_clamp", False, "fused 8x32x128 split2 bits"),
    (1, 4, "swiglu_clamp", True, "direct prefetch 8x128x64 split3"),
    (33, 4, "swiglu_clamp", True, "8x64x64, down 128x128 prefetch"),
])
def test_fused_moe_mxfp4_kernel_layout_matches_reference(num_tokens, top_k, activation, with_bias, config):
    x, plain, kernel, weights, ids, b13, b2 = _moe(num_tokens, top_k, with_bias)
    kw = dict(activation=activation, b13=b13, b2=b2, alpha=1.702, limit=7.0)
    got = fused_moe_mxfp4(x, *kernel, weights, ids, config=CONFIGS[config], **kw)
    want = ref.fused_moe_mxfp4(x, *plain, weights, ids, **kw)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(ref.fused_moe_mxfp4(x, *kernel, weights, ids, **kw), want, rtol=0, atol=0)


def test_fused_moe_mxfp4_kernel_layout_bf16_and_default_config():
    """bf16 activations (the 2^-63 fold; float32 arithmetic under the interpreter), the built-in config, and the
    dispatch: on CPU tensors ops runs the reference, which reads the kernel layout too."""
    x, plain, kernel, weights, ids, b13, b2 = _moe(5, 4, True, torch.bfloat16)
    kw = dict(activation="swiglu_clamp", b13=b13, b2=b2)
    got = fused_moe_mxfp4(x, *kernel, weights, ids, **kw)
    want = ref.fused_moe_mxfp4(x, *plain, weights, ids, **kw)
    assert got.dtype == torch.bfloat16
    assert ((got.float() - want.float()).norm() / want.float().norm()).item() < 1e-2
    assert torch.equal(ops.fused_moe_mxfp4(x, *kernel, weights, ids, **kw), want)


def test_fused_moe_mxfp4_kernel_layout_rejects_bad_input():
    x, plain, kernel, weights, ids, _, _ = _moe(3, 2, False)
    w13, s13, w2, s2 = kernel
    with pytest.raises(ValueError, match="BLOCK_K of 64"):
        fused_moe_mxfp4(x, *kernel, weights, ids, config={**CONFIGS["16x64x64"], "BLOCK_K": 32})
    with pytest.raises(ValueError, match="DECODE"):
        fused_moe_mxfp4(x, *kernel, weights, ids, config={**CONFIGS["16x64x64"], "DECODE": "lut"})
    with pytest.raises(ValueError, match="DOWN_BLOCK_M.*only"):  # down's row blocks are gate_up's
        fused_moe_mxfp4(x, *kernel, weights, ids, config={**CONFIGS["16x64x64"], "DOWN_BLOCK_M": 8})
    with pytest.raises(ValueError, match="BLOCK_N a multiple of 16"):
        fused_moe_mxfp4(x, *kernel, weights, ids, config={**CONFIGS["16x64x64"], "DOWN_BLOCK_N": 40})
    with pytest.raises(ValueError, match="share a layout"):
        fused_moe_mxfp4(x, w13, s13, plain[2], plain[3], weights, ids)
    with pytest.raises(ValueError, match="do not match"):
        fused_moe_mxfp4(x[:, :64].contiguous(), *kernel, weights, ids)


L, R = 3, 16
LORA_CFG = {"BLOCK_M": 16, "BLOCK_N": 32, "BLOCK_K": 32, "SPLIT_K": 2, "GROUP_M": 1, "num_warps": 4,
            "num_stages": 1}


def _lora_layer(x, plain, kernel, weights, ids, idx, scaling, config, **kw):
    """(moe_experts_lora on the kernel layout with ``config``, its reference on the plain layout)."""
    from loraplex.kernels.moe_experts_lora import moe_experts_lora

    w13, s13, w2, s2 = kernel
    got = moe_experts_lora(x, w13, w2, weights, ids, idx, scaling, w13_scale=s13, w2_scale=s2,
                           config=CONFIGS[config], lora_config_override=LORA_CFG, **kw)
    want = ref.moe_experts_lora(x, plain[0], plain[2], weights, ids, idx, scaling, w13_scale=plain[1],
                                w2_scale=plain[3], **kw)
    return got, want


@pytest.mark.parametrize("num_tokens,config", [(1, "16x128x128 split2"), (33, "fused 8x32x128 split2 bits"),
                                               (33, "fused 16x128x128")])
def test_moe_experts_lora_on_kernel_layout_matches_reference(num_tokens, config):
    x, plain, kernel, weights, ids, b13, b2 = _moe(num_tokens, 4, True)
    idx = torch.arange(num_tokens, dtype=torch.int32) % (L + 1) - 1  # -1 (no adapter), 0, 1, 2, ...
    scaling = torch.rand(L) + 0.5
    lora = [(torch.randn(L, E, R, k) / k ** 0.5, torch.randn(L, E, n, R) / R ** 0.5)
            for k, n in ((H, 2 * INTER), (INTER, H))]
    kw = dict(w13_lora=lora[0], w2_lora=lora[1], activation="swiglu_clamp", b13=b13, b2=b2)
    got, want = _lora_layer(x, plain, kernel, weights, ids, idx, scaling, config, **kw)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    w13, s13, w2, s2 = kernel
    torch.testing.assert_close(ref.moe_experts_lora(x, w13, w2, weights, ids, idx, scaling, w13_scale=s13,
                                                    w2_scale=s2, **kw), want, rtol=0, atol=0)


EPILOGUE_CASES = {  # (tokens, top_k, base config): 8- and 16-row blocks, so the deltas ride in the GEMMs' epilogues
    "both GEMMs split": (29, 4, "8x64x64 gate_up split3"),
    "gate/up in one product, bits decode, down split": (17, 2, "fused 8x32x128 split2 bits"),
    "one pair a block, register prefetch": (3, 4, "direct prefetch 8x128x64 split3"),
    "many pairs a block": (33, 4, "fused 8x32x128 split2 bits"),
    "down on its own tile": (21, 4, "8x64x64, down 128x128 prefetch"),
    "16-row blocks, the verify-step tile": (23, 4, "fused 16x128x128"),
}


def check_epilogue_case(case: str) -> None:
    """The decode-path expert layer of ``EPILOGUE_CASES[case]`` against the reference: slots at ranks 8 / 16 / 4,
    slot 3 without weights, tokens without an adapter, several slots (and one slot twice) in a row block; the deltas
    are there and tokens without weights get the base output."""
    from tests.kernels.lora_inputs import expert_table

    num_tokens, top_k, config = EPILOGUE_CASES[case]
    x, plain, kernel, weights, ids, b13, b2 = _moe(num_tokens, top_k, True)
    slots = 4
    idx = torch.randint(0, slots, (num_tokens,), dtype=torch.int32)
    idx[::5] = -1
    scaling = torch.rand(slots) + 0.5
    tables = (expert_table(slots, E, H, 2 * INTER, empty=(3,), max_rank=R, ranks=(8, 16, 4)),
              expert_table(slots, E, INTER, H, empty=(3,), max_rank=R, ranks=(8, 16, 4)))
    got, want = _lora_layer(x, plain, kernel, weights, ids, idx, scaling, config, w13_lora=tables[0],
                            w2_lora=tables[1], activation="swiglu_clamp", b13=b13, b2=b2)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    base = ref.moe_experts_lora(x, plain[0], plain[2], weights, ids, None, scaling, w13_scale=plain[1],
                                w2_scale=plain[3], activation="swiglu_clamp", b13=b13, b2=b2)
    adapted = (idx >= 0) & (idx != 3)
    assert adapted.any() and (got[adapted] - base[adapted]).abs().max() > 0.05  # the deltas are there
    torch.testing.assert_close(got[~adapted], base[~adapted], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("case", list(EPILOGUE_CASES))
def test_lora_in_the_gemm_epilogue_matches_reference(case, monkeypatch):
    """The decode path: shrink launches, the expands inside the MXFP4 GEMMs' epilogues; the separate expand kernel
    must not run."""
    from loraplex.kernels import fused_moe_lora as fml

    monkeypatch.setattr(fml, "_moe_lora_expand_kernel", None)  # any separate expand launch would fail
    check_epilogue_case(case)


@pytest.mark.parametrize("config", ["32x32x64 split3 bits", "64x64x64"])
def test_lora_epilogue_only_for_small_row_blocks(config, monkeypatch):
    """Row blocks above 16 pairs (prefill tiles) keep the separate expand launches."""
    from loraplex.kernels import fused_moe_lora as fml

    calls = []
    real = fml._moe_lora_expand_kernel
    monkeypatch.setattr(fml, "_moe_lora_expand_kernel", type("Spy", (), {
        "__getitem__": lambda self, grid: (calls.append(grid), real[grid])[1]})())
    x, plain, kernel, weights, ids, b13, b2 = _moe(7, 4, True)
    idx = torch.tensor([0, 1, -1, 2, 0, 1, 2], dtype=torch.int32)
    lora = [(torch.randn(L, E, R, k) / k ** 0.5, torch.randn(L, E, n, R) / R ** 0.5)
            for k, n in ((H, 2 * INTER), (INTER, H))]
    got, want = _lora_layer(x, plain, kernel, weights, ids, idx, torch.ones(L), config, w13_lora=lora[0],
                            w2_lora=lora[1], activation="silu")
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    assert len(calls) == 2


@pytest.mark.parametrize("config,num_tokens", [("64x64x64", 7), ("32x32x64 split3 bits", 12)])
def test_expands_apart_with_the_shrinks_first(config, num_tokens, monkeypatch):
    """Row blocks above 16 pairs where the base GEMMs are PDL launches: each target's shrink before its GEMM, the
    expand (``moe_lora_expand``) after it, and the layer equal to the reference; a FUSED LoRA config keeps its one
    kernel after the GEMM."""
    from loraplex.kernels import fused_moe_lora as fml
    from loraplex.kernels import moe_experts_lora as mel

    x, plain, kernel, weights, ids, b13, b2 = _moe(num_tokens, 4, True)
    idx = torch.arange(num_tokens, dtype=torch.int32) % 4 - 1
    scaling = torch.rand(3) + 0.5
    lora = [(torch.randn(3, E, 32, k) / k ** 0.5, torch.randn(3, E, n, 32) / 32 ** 0.5)
            for k, n in ((H, 2 * INTER), (INTER, H))]
    kw = dict(w13_lora=lora[0], w2_lora=lora[1], activation="swiglu_clamp", b13=b13, b2=b2)
    order = []
    for name in ("moe_lora_shrink", "moe_lora_expand", "fused_moe_lora"):
        real = getattr(fml, name)
        monkeypatch.setattr(fml, name, lambda *a, _n=name, _r=real, **k: (order.append(_n), _r(*a, **k))[1])
    for name in ("gate_up", "down"):
        real = getattr(mel.fm4, name)
        monkeypatch.setattr(mel.fm4, name, lambda *a, _n=name, _r=real, **k: (
            order.append(f"{_n} late" if k.get("late_wait") else _n), _r(*a, **k))[1])
    monkeypatch.setattr(mel, "_shrink_first", lambda cfg, device: True)
    got, want = _lora_layer(x, plain, kernel, weights, ids, idx, scaling, config, **kw)
    assert order == ["moe_lora_shrink", "gate_up late", "moe_lora_expand", "moe_lora_shrink", "down late",
                     "moe_lora_expand"]
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    order.clear()
    monkeypatch.setattr(mel, "_shrink_first", lambda cfg, device: False)  # no PDL: the deltas after the GEMMs
    _lora_layer(x, plain, kernel, weights, ids, idx, scaling, config, **kw)
    assert order == ["gate_up", "fused_moe_lora", "down", "fused_moe_lora"]
    order.clear()
    monkeypatch.setattr(mel, "_shrink_first", lambda cfg, device: True)
    monkeypatch.setattr("tests.kernels.test_mxfp4_kernel_layout.LORA_CFG",
                        {"BLOCK_M": 16, "BLOCK_N": 32, "BLOCK_K": 32, "SPLIT_K": 1, "GROUP_M": 1, "num_warps": 4,
                         "num_stages": 1, "FUSED": 1})
    fused, _ = _lora_layer(x, plain, kernel, weights, ids, idx, scaling, config, **kw)
    assert order == ["gate_up", "fused_moe_lora", "down", "fused_moe_lora"]
    torch.testing.assert_close(fused, want, rtol=1e-4, atol=1e-4)


BUILD_PRELUDE = r'''
import json, re, sys
sys.path.insert(0, "benchmarks/kernels")
from sm90_loops import build_sm90, loop_stats
import triton.language as tl
from loraplex.kernels import fused_moe_mxfp4 as fm

TYPES = {"w_ptr": "*i32", "s_ptr": "*u8", "weights_ptr": "*fp32", "sorted_ptr": "*i32", "expert_ids_ptr": "*i32",
         "num_post_ptr": "*i32", "alpha": "fp32", "limit": "fp32", "lora_buf_ptr": "*fp32",
         "lora_entries_ptr": "*i64", "lora_slot_ptr": "*i32"}
'''

BUILD = BUILD_PRELUDE + r'''

VEC16 = r"ld\.global(\.nc)?\.v4\.b32|cp\.async\.cg\.shared\.global[^;\n]*, 0x10"  # 16-byte loads

def build(kernel, consts, warps, stages):
    compiled = build_sm90(kernel, consts, TYPES, warps, stages)
    asm = compiled.asm
    ptx = asm["ptx"]
    # a decoded weight tile [BLOCK_N, BLOCK_K] put in shared memory (only x^T [BLOCK_K, BLOCK_M] belongs there)
    shape = "tensor<{}x{}x".format(consts["BLOCK_N"], consts["BLOCK_K"])
    tile = re.search(r"local_alloc %\S+ : \(" + shape, asm["ttgir"])
    return {"wgmma": "wgmma.mma_async" in ptx, "mma_sync": "mma.sync" in ptx, "shfl": "shfl.sync" in ptx,
            "asm": "fma.rn.bf16x2" in ptx, "pdl": "griddepcontrol.wait" in ptx, "smem_tile": tile is not None,
            "vec16": re.search(VEC16, ptx) is not None, "loop": loop_stats(compiled),
            # the live path's wait is the last in the code (a dead row block's may be laid out anywhere)
            "wait_after_mma": ptx.rfind("griddepcontrol.wait") > min(ptx.find(op) for op in ("mma.sync", "wgmma.")
                                                                   if op in ptx)}

out = []
# (BLOCK_M, DECODE, EVEN_K, SPLIT_K, DIRECT, FUSED, PREFETCH, warps, stages)
for bm, decode, even_k, split, direct, fused, prefetch, warps, stages in (
        (16, 2, True, 1, False, False, 0, 4, 3), (16, 1, False, 2, True, False, 0, 4, 3),
        (8, 2, True, 2, False, False, 0, 2, 3), (16, 2, False, 1, False, True, 1, 4, 1)):
    common = dict(HAS_BIAS=True, BLOCK_M=bm, BLOCK_N=64, BLOCK_K=128, GROUP_M=1, NUM_N=45, EVEN_K=even_k,
                  DECODE=decode, DIRECT=direct, SPLIT_K=split, FUSED=fused, PREFETCH=prefetch, USE_PDL=bm == 8,
                  LORA=False, LORA_PARTS=1, LORA_BLOCK_R=32, LORA_DTYPE=tl.bfloat16)
    out.append(build(fm._gate_up_kernel, {**common, "TOP_K": 4, "ACT": 1 if split == 1 else 2}, warps, stages))
    out.append(build(fm._down_kernel, common, warps, stages))
# the decode configs with the LoRA expand in the epilogue (4 split-K partials of the shrink)
lora = dict(HAS_BIAS=True, BLOCK_M=8, BLOCK_N=64, BLOCK_K=128, GROUP_M=1, NUM_N=45, EVEN_K=True, DECODE=2,
            DIRECT=False, SPLIT_K=1, FUSED=False, PREFETCH=1, USE_PDL=False, LORA=True, LORA_PARTS=4,
            LORA_BLOCK_R=32, LORA_DTYPE=tl.bfloat16)
out.append(build(fm._gate_up_kernel, {**lora, "TOP_K": 4, "ACT": 1}, 4, 1))
out.append(build(fm._down_kernel, lora, 4, 1))
# launched with PDL: the wait before the K loop, or with LATE_WAIT after it (before the epilogue reads the shrink)
for late in (False, True):
    pdl = dict(lora, USE_PDL=True, LATE_WAIT=late)
    out.append(build(fm._gate_up_kernel, {**pdl, "TOP_K": 4, "ACT": 1}, 4, 1))
    out.append(build(fm._down_kernel, pdl, 4, 1))
print("RESULT " + json.dumps(out))
'''


def test_kernel_layout_gemms_build_for_sm90():
    """The kernel-layout GEMMs compile for sm_90 (both decodes, K tail, split-K, both gate_up epilogues, with and
    without the alignment tables, gate/up in one product, register prefetch, PDL): to register-operand wgmma at 4
    warps and to mma.sync at 2, both times with the decoded fragment taken as it is (no lane shuffles, no trip
    through shared memory, the words in 16-byte loads, whatever the installed Triton's layout heuristics), with the
    inline-PTX bf16x2 scale multiply where DECODE is "asm" (2) and the grid-dependency wait where PDL is on (with a
    LoRA epilogue and LATE_WAIT: after the K loop)."""
    got = build_in_child(BUILD, timeout=900)
    with_lora, got = got[8:], got[:8]
    for b in with_lora:  # the epilogue's products leave the K loop's decoded fragment as it was (the LoRA
        # bookkeeping on the block's few rows, before and after the loop, may shuffle)
        assert b["asm"] and b["vec16"] and not b["smem_tile"] and b["loop"]["mma"] and not b["loop"]["shfl"], b
    # with PDL and LATE_WAIT the K loop's MMAs come before the grid-dependency wait, else after it
    assert [b["pdl"] for b in with_lora] == [False] * 2 + [True] * 4
    assert [b["wait_after_mma"] for b in with_lora[2:]] == [False, False, True, True]
    assert [b["wgmma"] for b in got] == [True] * 4 + [False] * 2 + [True] * 2
    assert [b["mma_sync"] for b in got] == [False] * 4 + [True] * 2 + [False] * 2
    assert [b["asm"] for b in got] == [True, True, False, False, True, True, True, True]
    assert not any(b["shfl"] for b in got)
    assert not any(b["smem_tile"] for b in got)  # the decoded tile is the MMA's register operand
    assert all(b["vec16"] for b in got)          # each lane's words in one 16-byte load
    assert [b["pdl"] for b in got] == [False] * 4 + [True] * 2 + [False] * 2


@pytest.mark.parametrize("cfg", committed_configs("fused_moe_mxfp4"), ids=config_id)
def test_committed_tuned_configs_match_the_reference(cfg):
    """Each config a device's tuning file holds (split-K, fused gate/up, prefetch, 4-stage prefill tiles) gives the
    reference on the kernel layout (the interpreter emulates the "asm" decode)."""
    x, plain, kernel, weights, ids, b13, b2 = _moe(19, 4, True)
    kw = dict(activation="swiglu_clamp", b13=b13, b2=b2, alpha=1.702, limit=7.0)
    got = fused_moe_mxfp4(x, *kernel, weights, ids, config=dict(cfg), **kw)
    torch.testing.assert_close(got, ref.fused_moe_mxfp4(x, *plain, weights, ids, **kw), rtol=1e-4, atol=1e-4)


L2_BUILD = BUILD_PRELUDE + r'''
# the decode tile the engine runs at batch 16 (8 pairs, 128 weight rows), with a LoRA epilogue, PDL, late wait
lora = dict(HAS_BIAS=True, BLOCK_M=8, BLOCK_N=128, BLOCK_K=128, GROUP_M=1, NUM_N=23, EVEN_K=True, DECODE=2,
            DIRECT=False, SPLIT_K=2, FUSED=False, PREFETCH=0, USE_PDL=True, LATE_WAIT=True, LORA=True, LORA_PARTS=1,
            LORA_BLOCK_R=32, LORA_DTYPE=tl.bfloat16)
out = []
for l2 in (False, True):
    for kernel, extra in ((fm._gate_up_kernel, {"TOP_K": 4, "ACT": 1, "SPLIT_K": 1}), (fm._down_kernel, {})):
        ptx = build_sm90(kernel, {**lora, **extra, "LORA_L2": l2, "LORA_LINE": 64}, TYPES, 4, 3).asm["ptx"]
        first_mma = min(ptx.find(op) for op in ("mma.sync", "wgmma.") if op in ptx)
        out.append({"prefetches": ptx.count("prefetch.global.L2"),
                    "before_mma": 0 <= ptx.find("prefetch.global.L2") < first_mma})
print("RESULT " + json.dumps(out))
'''


def test_lora_l2_prefetch_builds_before_the_k_loop_for_sm90():
    """With LORA_L2 the GEMMs with a LoRA epilogue issue L2 prefetches of the B tiles before the K loop's first MMA
    (gate_up: gate and up columns; down: one tile), and without it none; the interpreter never takes this path
    (``lora_l2``), so the sm_90 build is where it is checked on the CPU."""
    off_gu, off_dn, on_gu, on_dn = build_in_child(L2_BUILD, timeout=900)
    assert off_gu["prefetches"] == 0 and off_dn["prefetches"] == 0
    assert on_gu["prefetches"] >= 2 and on_dn["prefetches"] >= 1
    assert on_gu["before_mma"] and on_dn["before_mma"]


def test_lora_l2_applies_only_on_a_gpu_outside_the_interpreter(monkeypatch):
    """LORA_L2 is inline PTX: the launchers take it only for a CUDA device and never under the interpreter (which
    has no PTX), and only where the config asks for it."""
    from loraplex.kernels import fused_moe_mxfp4 as fm

    gpu, cpu = torch.device("cuda", 0), torch.device("cpu")
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert fm.lora_l2({"LORA_L2": 1}, gpu)
    assert not fm.lora_l2({"LORA_L2": 0}, gpu) and not fm.lora_l2({}, gpu)
    assert not fm.lora_l2({"LORA_L2": 1}, cpu)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert not fm.lora_l2({"LORA_L2": 1}, gpu)
