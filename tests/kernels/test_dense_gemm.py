"""The decode projection GEMM (``kernels/dense_gemm.py``) against ``F.linear`` under the Triton interpreter at
awkward sizes, ``linear``'s choice between it and ``F.linear``, and its sm_90 build: the weight rows' L2 prefetch
and the bias before the grid-dependency wait, x and every store after it."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from loraplex.kernels import dense_gemm as dg
from tests.kernels.sm90_build import build_in_child

SMALL = {"BLOCK_M": 16, "BLOCK_N": 16, "BLOCK_K": 32, "num_warps": 4, "num_stages": 1}


def _case(m, n, k, dtype, with_bias, gen):
    x = torch.randn(m, k, generator=gen).to(dtype)
    w = (torch.randn(n, k, generator=gen) / k ** 0.5).to(dtype)
    b = torch.randn(n, generator=gen).to(dtype) if with_bias else None
    return x, w, b


@pytest.mark.parametrize("m,n,k", [(1, 40, 96), (5, 72, 200), (16, 24, 130), (17, 50, 64), (33, 16, 40)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_float32_matches_linear(m, n, k, with_bias):
    x, w, b = _case(m, n, k, torch.float32, with_bias, torch.Generator().manual_seed(m * 1000 + n + k))
    torch.testing.assert_close(dg.dense_gemm(x, w, b, SMALL), F.linear(x, w, b), rtol=1e-5, atol=1e-5)


def test_half_matches_linear():
    """float16 (the interpreter's bfloat16 dot is wrong; the GPU check runs bfloat16)."""
    x, w, b = _case(7, 48, 160, torch.float16, True, torch.Generator().manual_seed(3))
    got = dg.dense_gemm(x, w, b, SMALL)
    assert got.dtype == torch.float16
    torch.testing.assert_close(got.float(), F.linear(x.float(), w.float(), b.float()), rtol=5e-3, atol=5e-3)


def test_bad_shapes_are_refused():
    with pytest.raises(ValueError, match=r"do not make x @ w.T"):
        dg.dense_gemm(torch.randn(2, 8), torch.randn(4, 6))
    with pytest.raises(ValueError, match=r"bias \(3,\) for 4 outputs"):
        dg.dense_gemm(torch.randn(2, 8), torch.randn(4, 8), torch.randn(3))


def test_linear_takes_the_kernel_only_where_it_fits(monkeypatch):
    w, b = torch.randn(48, 64).bfloat16(), torch.randn(48).bfloat16()
    x = torch.randn(2, 3, 64).bfloat16()  # leading dims folded into rows
    assert dg.fits(x, w, b)
    assert not dg.fits(torch.randn(dg.MAX_M + 1, 64).bfloat16(), w, b)  # a verify or prefill step
    assert not dg.fits(x.float(), w.float(), b.float())  # float32
    assert not dg.fits(x, w, b.float())
    assert not dg.fits(x, torch.randn(64, 48).bfloat16().t(), b)  # a weight not contiguous
    assert not dg.fits(x[..., :60], w[:, :60].contiguous(), b)  # rows of 120 bytes: no bulk prefetch
    big = torch.empty(dg.MAX_WEIGHT_BYTES // 2 // 64 + 1, 64, dtype=torch.bfloat16)  # an LM head's size class
    assert not dg.fits(x, big, None)
    assert not dg.use_kernel(x, w, b)  # on the CPU: no PDL, F.linear
    calls = []
    monkeypatch.setattr(dg, "step_pdl", lambda device: True)  # as on an sm_90 GPU
    monkeypatch.setattr(dg, "dense_gemm", lambda *a, **kw: calls.append(kw) or F.linear(*a[:3]))
    monkeypatch.delenv(dg.DENSE_GEMM_ENV, raising=False)
    assert dg.linear(x, w, b).shape == (2, 3, 48) and calls == [{"pdl": True, "prefetch_l2": True}]
    monkeypatch.setenv(dg.DENSE_GEMM_ENV, "0")
    assert torch.equal(dg.linear(x, w, b), F.linear(x, w, b)) and len(calls) == 1


BUILD = r'''
import json, re, sys
sys.path.insert(0, "benchmarks/kernels")
from sm90_loops import build_sm90
from loraplex.kernels import dense_gemm

def at(ptx, pattern):
    m = re.search(pattern, ptx)
    return m.start() if m else -1

out = {}
for pdl in (True, False):
    consts = dict(HAS_BIAS=True, BLOCK_M=16, BLOCK_N=64, BLOCK_K=256, EVEN_K=False, USE_PDL=pdl, PREFETCH_L2=pdl)
    ptx = build_sm90(dense_gemm._dense_gemm_kernel, consts, {"*": "*bf16"}, 4, 4).asm["ptx"]
    out[str(pdl)] = {"prefetch": at(ptx, r"cp\.async\.bulk\.prefetch\.L2\.global"),
                     "wait": at(ptx, r"griddepcontrol\.wait"), "trigger": at(ptx, r"griddepcontrol\.launch_dependents"),
                     "copy": at(ptx, r"cp\.async\.c[ag]\.shared\.global"), "store": at(ptx, r"\bst\.global"),
                     "mma": "mma.sync" in ptx or "wgmma" in ptx}
print("RESULT " + json.dumps(out))
'''


def test_builds_for_sm90_with_the_prefetch_before_the_wait():
    got = build_in_child(BUILD)
    on, off = got["True"], got["False"]
    assert 0 <= on["prefetch"] < on["wait"] < on["trigger"] < on["copy"] < on["store"], on
    assert on["mma"] and off["mma"]
    assert off["prefetch"] == off["wait"] == off["trigger"] == -1 and off["copy"] < off["store"], off
