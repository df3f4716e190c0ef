"""``moe_route_linear`` (router logits and top-k routing in one program per token) against the reference
(``F.linear`` then ``moe_route``) under the Triton interpreter, and its fallback for large steps."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from loraplex.kernels import moe_route as mr
from loraplex.kernels import reference
from tests.kernels.sm90_build import build_in_child

from .conftest import randn


@pytest.mark.parametrize("num_tokens,hidden", [(1, 96), (7, 200), (33, 64)])
@pytest.mark.parametrize("num_experts,top_k", [(8, 2), (32, 4), (60, 8)])
@pytest.mark.parametrize("scoring,renormalize", [("softmax", True), ("topk_softmax", False)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_fp32_matches_reference(num_tokens, hidden, num_experts, top_k, scoring, renormalize, with_bias):
    x = randn(num_tokens, hidden)
    w = randn(num_experts, hidden, scale=hidden ** -0.5 * 2)
    b = randn(num_experts) if with_bias else None
    got_w, got_ids = mr.moe_route_linear(x, w, b, top_k, scoring=scoring, renormalize=renormalize)
    want_w, want_ids = reference.moe_route_linear(x, w, b, top_k, scoring=scoring, renormalize=renormalize)
    assert got_ids.dtype == torch.int64 and got_w.dtype == torch.float32
    assert torch.equal(got_ids, want_ids)
    torch.testing.assert_close(got_w, want_w, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("split_k", [2, 3, 16])
def test_split_k_matches_and_counters_reset(split_k):
    """K in slices whose last arrival routes: the same picks as one slice, again on the next call (every token's
    counter back at 0), with fewer slices than asked where K has fewer BLOCK_K steps."""
    for num_tokens, hidden in ((5, 200), (12, 130), (5, 200)):
        x, w, b = randn(num_tokens, hidden), randn(32, hidden, scale=0.2), randn(32)
        got_w, got_ids = mr.moe_route_linear(x, w, b, 4, scoring="topk_softmax", renormalize=False, split_k=split_k)
        want_w, want_ids = reference.moe_route_linear(x, w, b, 4, scoring="topk_softmax", renormalize=False)
        assert torch.equal(got_ids, want_ids)
        torch.testing.assert_close(got_w, want_w, rtol=1e-5, atol=1e-6)
    assert int(mr._WORKSPACE.counts[torch.device("cpu")].abs().sum()) == 0


def test_default_split_fills_the_gpu():
    assert mr.linear_split_k(1, 2880, 128) == mr.MAX_SPLIT_K  # 23 BLOCK_K steps, 16 slices
    assert mr.linear_split_k(16, 2880, 128) == 16 and mr.linear_split_k(64, 2880, 128) == 5
    assert mr.linear_split_k(128, 2880, 128) == 3 and mr.linear_split_k(4, 100, 128) == 1


def test_half_logits_rounded_like_linear():
    """16-bit activations: the logits are rounded to x's dtype before routing, as F.linear's output is, so a
    ranking that only the rounding decides comes out as the unfused path's (float16: the interpreter's bfloat16
    arithmetic is unreliable)."""
    torch.manual_seed(3)
    x, w, b = randn(9, 128).half(), (randn(16, 128) / 8).half(), randn(16).half()
    got_w, got_ids = mr.moe_route_linear(x, w, b, 4, scoring="topk_softmax", renormalize=False)
    logits = (x.float() @ w.float().T + b.float()).half()  # exact products, one rounding
    want_w, want_ids = reference.moe_route(logits, 4, scoring="topk_softmax", renormalize=False)
    assert torch.equal(got_ids, want_ids)
    torch.testing.assert_close(got_w, want_w, rtol=1e-6, atol=1e-6)


def test_large_steps_take_linear_then_route(monkeypatch):
    """Past LINEAR_MAX_TOKENS tokens (prefill) every program would read the whole router weight: cuBLAS, then
    moe_route."""
    launches = []
    monkeypatch.setattr(mr, "_moe_route_linear_kernel",
                        type("Kernel", (), {"__getitem__": lambda self, grid: launches.append(grid)})())
    x, w = randn(mr.LINEAR_MAX_TOKENS + 1, 32), randn(8, 32)
    got_w, got_ids = mr.moe_route_linear(x, w, None, 2, scoring="softmax", renormalize=True)
    want_w, want_ids = reference.moe_route(F.linear(x, w), 2, scoring="softmax", renormalize=True)
    assert torch.equal(got_ids, want_ids) and launches == []
    torch.testing.assert_close(got_w, want_w, rtol=1e-6, atol=1e-6)


def test_rejects_bad_arguments():
    with pytest.raises(ValueError, match="do not make x @ w.T"):
        mr.moe_route_linear(randn(2, 8), randn(4, 6), None, 2, scoring="softmax", renormalize=True)
    with pytest.raises(ValueError, match="unknown MoE scoring"):
        mr.moe_route_linear(randn(2, 8), randn(4, 8), None, 2, scoring="sigmoid", renormalize=True)
    with pytest.raises(ValueError, match="top_k <= E"):
        mr.moe_route_linear(randn(2, 8), randn(4, 8), None, 5, scoring="softmax", renormalize=True)


BUILD = r'''
import json, triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from loraplex.kernels.launch import jit_function
from loraplex.kernels import moe_route

kernel = jit_function(moe_route._moe_route_linear_kernel)
names = kernel.arg_names
types = {"x_ptr": "*bf16", "w_ptr": "*bf16", "b_ptr": "*bf16", "weights_ptr": "*fp32", "ids_ptr": "*i64",
         "logits_ptr": "*bf16", "part_ptr": "*fp32", "count_ptr": "*i32"}

def ptx(kernel, consts):
    names = kernel.arg_names
    sig = {n: "constexpr" if n in consts else types.get(n, "i32") for n in names}
    src = ASTSource(fn=kernel, signature=sig, constexprs={(names.index(n),): v for n, v in consts.items()})
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=4)).asm["ptx"]

out = {}
for split in (1, 8):
    code = ptx(kernel, dict(HAS_BIAS=True, TOP_K=4, SOFTMAX_FIRST=False, RENORMALIZE=False, BLOCK_E=32, BLOCK_A=4,
                            BLOCK_K=128, SPLIT_K=split))
    out[split] = {"cvt_bf16": code.count("cvt.rn.bf16.f32"), "atom": code.count("atom."), "cg": code.count(".cg.")}
plain = ptx(jit_function(moe_route._moe_route_kernel), dict(TOP_K=4, SOFTMAX_FIRST=True, RENORMALIZE=True, BLOCK_E=32,
                                                            BLOCK_A=4))
out["route"] = len(plain)
print("RESULT " + json.dumps(out))
'''


def test_builds_for_sm90():
    """The fused router builds for the GPU at GPT-OSS-20B's tile (E = 32, top-4, bias), in one K slice and in 8
    (an acq_rel counter, the partials read from L2), rounding the logits to bf16 on the way; moe_route's own
    kernel builds with the routing helper it now shares."""
    got = build_in_child(BUILD)
    assert got["1"]["cvt_bf16"] >= 1 and got["1"]["atom"] == 0
    assert got["8"]["cvt_bf16"] >= 1 and got["8"]["atom"] >= 2 and got["8"]["cg"] >= 1
    assert got["route"] > 0  # moe_route's kernel, its routing now in the shared helper
