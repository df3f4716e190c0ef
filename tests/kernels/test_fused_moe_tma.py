"""``fused_moe`` with ``"TMA": 1`` (``fused_moe_tma``: expert weight tiles through a tensor descriptor) against the
torch reference under the interpreter, at awkward sizes: K not a whole number of steps (the descriptor's zeros and
the masked activation loads), weight-row boxes that run into the next expert's rows and past the tensor, row
blocks with padding, with and without biases, both activations and the pre-activation the LoRA path stores.
Fresh random inputs each run."""
import pytest
import torch

from loraplex.kernels import fused_moe as fm, reference
from loraplex.kernels.moe_align import moe_align
from tests.kernels.sm90_build import build_in_child

TMA = {"BLOCK_M": 16, "BLOCK_N": 32, "BLOCK_K": 32, "GROUP_M": 2, "num_warps": 4, "num_stages": 2, "TMA": 1}


def _case(t, e, a, h, i, bias):
    x = torch.randn(t, h)
    w13, w2 = torch.randn(e, 2 * i, h) / h ** 0.5, torch.randn(e, h, i) / i ** 0.5
    b13 = torch.randn(e, 2 * i) * 0.1 if bias else None
    b2 = torch.randn(e, h) * 0.1 if bias else None
    values, ids = torch.topk(torch.randn(t, e), a, dim=-1)
    return x, w13, w2, b13, b2, torch.softmax(values, dim=-1), ids


@pytest.mark.parametrize("t,e,a,h,i,bias,activation", [
    (13, 5, 2, 72, 40, True, "swiglu_clamp"),   # H: two and a quarter K steps; I: a box and a quarter
    (9, 3, 3, 40, 24, False, "silu"),
    (1, 4, 2, 64, 32, True, "silu"),            # a decode row, whole steps
])
def test_tma_config_matches_reference(t, e, a, h, i, bias, activation):
    x, w13, w2, b13, b2, tw, ids = _case(t, e, a, h, i, bias)
    got = fm.fused_moe(x, w13, w2, tw, ids, activation=activation, b13=b13, b2=b2, config=TMA)
    want = reference.fused_moe(x, w13, w2, tw, ids, activation=activation, b13=b13, b2=b2)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def test_tma_gate_up_pre_activation_matches_the_pointer_kernel():
    """The LoRA path's gate_up stores [gate | up] before the activation (``activation=None``)."""
    x, w13, _, b13, _, _, ids = _case(11, 4, 2, 56, 40, True)
    align = moe_align(ids, 4, TMA["BLOCK_M"])
    plain = {k: v for k, v in TMA.items() if k != "TMA"}
    got = fm.gate_up(x, w13, align, TMA, top_k=2, activation=None, b13=b13)
    want = fm.gate_up(x, w13, align, plain, top_k=2, activation=None, b13=b13)
    assert got.shape == (22, 80)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_tma_config_is_refused_where_it_cannot_read_the_weights():
    x, w13, w2, _, _, tw, ids = _case(4, 3, 2, 36, 32, False)   # 36 fp32 = 144 bytes a row: aligned
    with pytest.raises(ValueError, match="BLOCK_K × element size"):
        fm.fused_moe(x, w13, w2, tw, ids, config={**TMA, "BLOCK_K": 64})  # 256-byte box rows
    x, w13, w2, _, _, tw, ids = _case(4, 3, 2, 38, 32, False)   # 152 bytes: not 16-byte aligned rows
    with pytest.raises(ValueError, match="16-byte aligned"):
        fm.fused_moe(x, w13, w2, tw, ids, config=TMA)
    q = torch.zeros(3, 64, 32, dtype=torch.int8)
    with pytest.raises(ValueError, match="not torch.int8"):
        fm.gate_up(torch.randn(4, 32), q, moe_align(ids, 3, 16), TMA, top_k=2, activation="silu",
                   w13_scale=torch.ones(3, 64))


BUILD = r'''
import json, re, triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from loraplex.kernels.launch import jit_function
from loraplex.kernels import fused_moe_tma as ft

TABLES = ("sorted_ptr", "expert_ids_ptr", "num_post_ptr")
TILE = dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, GROUP_M=8, NUM_N=23, EVEN_K=True, HAS_BIAS=True)


def arg_type(n, consts):
    if n in consts:
        return "constexpr"
    if n == "w_desc":
        return "tensordesc<bf16[128, 64]>"
    if n.endswith("_ptr"):
        return "*fp32" if n == "weights_ptr" else "*i32" if n in TABLES else "*bf16"
    return "fp32" if n in ("alpha", "limit") else "i32"


def counts(kernel, consts):
    names = kernel.arg_names
    sig = {n: arg_type(n, consts) for n in names}
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(names)
             if n not in consts and (n.endswith("_ptr") or n.startswith("stride") or n in ("N", "K"))}
    src = ASTSource(fn=jit_function(kernel), signature=sig, attrs=attrs,
                    constexprs={(names.index(n),): v for n, v in consts.items()})
    ptx = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 8, "num_stages": 3}).asm["ptx"]
    return {"tma": len(re.findall(r"cp\.async\.bulk\.tensor", ptx)), "wgmma": len(re.findall(r"wgmma\.mma_async", ptx))}


out = {"gate_up": counts(ft._gate_up_tma_kernel, dict(TILE, TOP_K=4, ACT=1)), "down": counts(ft._down_tma_kernel, TILE)}
print("RESULT " + json.dumps(out))
'''


def test_sm90_build_reads_the_weights_with_tma_and_multiplies_with_wgmma():
    """Built for sm_90 at the GPT-OSS prefill tile (no GPU needed), both kernels copy their weight tiles with
    ``cp.async.bulk.tensor`` (TMA) and run the products as ``wgmma``: the descriptor path is what the config gets."""
    out = build_in_child(BUILD)
    for name in ("gate_up", "down"):
        assert out[name]["tma"] > 0 and out[name]["wgmma"] > 0, out
