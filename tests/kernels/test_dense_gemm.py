"""The dense decode GEMM (``kernels/dense_gemm.py``) against ``F.linear`` under the Triton interpreter, at awkward
sizes and every split of K, and ``linear``'s choice between the kernel and ``F.linear``."""
from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

from loraplex.kernels import dense_gemm as dg
from loraplex.kernels import tuning
from tests.kernels.sm90_build import build_in_child


def _case(m, n, k, dtype, with_bias):
    x = torch.randn(m, k).to(dtype)
    w = (torch.randn(n, k) / k ** 0.5).to(dtype)
    b = torch.randn(n).to(dtype) if with_bias else None
    return x, w, b


@pytest.mark.parametrize("m,n,k", [(1, 40, 96), (5, 72, 200), (17, 24, 130), (33, 50, 64)])
@pytest.mark.parametrize("split", [1, 2, 3])
@pytest.mark.parametrize("with_bias", [False, True])
def test_float32_matches_linear(m, n, k, split, with_bias):
    x, w, b = _case(m, n, k, torch.float32, with_bias)
    cfg = {"BLOCK_M": 16, "BLOCK_N": 16, "BLOCK_K": 32, "SPLIT_K": split, "num_warps": 4, "num_stages": 1}
    got = dg.dense_gemm(x, w, b, cfg)
    torch.testing.assert_close(got, F.linear(x, w, b), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("m,n,k,split", [(3, 48, 160, 2), (16, 80, 96, 4)])
def test_half_matches_linear(m, n, k, split):
    """float16 (the interpreter's bfloat16 dot is broken; the GPU check runs bfloat16)."""
    x, w, b = _case(m, n, k, torch.float16, True)
    cfg = {"BLOCK_M": 16, "BLOCK_N": 32, "BLOCK_K": 32, "SPLIT_K": split, "num_warps": 4, "num_stages": 1}
    got = dg.dense_gemm(x, w, b, cfg)
    want = F.linear(x.float(), w.float(), b.float())
    assert got.dtype == torch.float16
    torch.testing.assert_close(got.float(), want, rtol=5e-3, atol=5e-3)


def test_counters_reset_between_calls_and_split_clamped_to_k():
    """Every tile's arrival counter is back at 0 after a split-K call, so the next call (other inputs, other
    tiles) sums the right partials; a split larger than K's BLOCK_K steps runs as fewer slices."""
    cfg = {"BLOCK_M": 16, "BLOCK_N": 16, "BLOCK_K": 32, "SPLIT_K": 3, "num_warps": 4, "num_stages": 1}
    for m, n in ((4, 64), (9, 40), (4, 64)):
        x, w, b = _case(m, n, 96, torch.float32, True)
        torch.testing.assert_close(dg.dense_gemm(x, w, b, cfg), F.linear(x, w, b), rtol=1e-5, atol=1e-5)
    assert int(dg._WORKSPACE.counts[torch.device("cpu")].abs().sum()) == 0
    x, w, b = _case(2, 24, 40, torch.float32, False)  # 2 BLOCK_K steps, 8 splits asked
    got = dg.dense_gemm(x, w, None, {**cfg, "SPLIT_K": 8})
    torch.testing.assert_close(got, F.linear(x, w), rtol=1e-5, atol=1e-5)


def test_rejects_mismatched_shapes():
    with pytest.raises(ValueError, match=r"do not make x @ w.T"):
        dg.dense_gemm(torch.randn(2, 8), torch.randn(4, 6))


@pytest.fixture
def tuned_dir(tmp_path, monkeypatch):
    """A tuning folder for this machine's device name ('cpu') with one dense_gemm entry: N = 48, K = 64."""
    folder = tmp_path / tuning.device_folder_name(tuning.current_device_name())
    folder.mkdir()
    entry = {"BLOCK_M": 16, "BLOCK_N": 16, "BLOCK_K": 32, "SPLIT_K": 2, "num_warps": 4, "num_stages": 1}
    (folder / "dense_gemm.json").write_text(json.dumps({"N=48,K=64": {"16": entry}}))
    monkeypatch.setenv(tuning.TUNING_DIR_ENV, str(tmp_path))
    tuning.clear_cache()
    yield
    tuning.clear_cache()


def test_linear_runs_the_kernel_only_where_tuned(tuned_dir, monkeypatch):
    calls = []
    real = dg.dense_gemm
    monkeypatch.setattr(dg, "dense_gemm", lambda *a, **kw: calls.append(a[0].shape) or real(*a, **kw))
    w, b = (torch.randn(48, 64) / 8).half(), torch.randn(48).half()
    x = torch.randn(2, 3, 64).half()  # leading dims folded into rows
    got = dg.linear(x, w, b)
    assert calls == [torch.Size([6, 64])] and got.shape == (2, 3, 48)
    torch.testing.assert_close(got.float(), F.linear(x.float(), w.float(), b.float()), rtol=2e-2, atol=2e-2)
    # untuned shape, too many rows, float32: F.linear, bit for bit
    for x_, w_, b_ in ((torch.randn(4, 64).half(), torch.randn(40, 64).half(), None),
                       (torch.randn(dg.MAX_M + 1, 64).half(), w, b),
                       (torch.randn(4, 64), w.float(), b.float())):
        assert torch.equal(dg.linear(x_, w_, b_), F.linear(x_, w_, b_.to(x_.dtype) if b_ is not None else None))
    assert len(calls) == 1
    assert tuning.find_config(dg.OP, dg.shape_of(40, 64), 4, dg.DEFAULT_CONFIG) is None


BUILD = r'''
import json, triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from loraplex.kernels.launch import jit_function
from loraplex.kernels import dense_gemm

names = jit_function(dense_gemm._dense_gemm_kernel).arg_names
out = {}
for split in (1, 4):
    consts = dict(HAS_BIAS=True, BLOCK_M=16, BLOCK_N=32, BLOCK_K=128, SPLIT_K=split, EVEN_K=True)
    types = {"x_ptr": "*bf16", "w_ptr": "*bf16", "b_ptr": "*bf16", "y_ptr": "*bf16", "part_ptr": "*fp32",
             "count_ptr": "*i32"}
    sig = {n: "constexpr" if n in consts else types.get(n, "i32") for n in names}
    src = ASTSource(fn=jit_function(dense_gemm._dense_gemm_kernel), signature=sig,
                    constexprs={(names.index(n),): v for n, v in consts.items()})
    ptx = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=4, num_stages=4)).asm["ptx"]
    out[split] = {"atom": ptx.count("atom."), "mma": ptx.count("mma.sync"), "cg": ptx.count("ld.global.cg")}
print("RESULT " + json.dumps(out))
'''


def test_builds_for_sm90():
    """Split-K's counter (an acq_rel atomic) and L2 reads of the partials survive the GPU compiler; without a
    split neither is emitted."""
    got = build_in_child(BUILD)
    assert got["1"]["atom"] == 0 and got["1"]["mma"] > 0
    assert got["4"]["atom"] >= 2 and got["4"]["cg"] > 0 and got["4"]["mma"] > 0
