"""benchmarks/kernels/mxfp4_tma_gpu.py's candidates off the GPU: each is a two-launch TMA config the kernels accept
at the GPT-OSS-20B shape, none twice, the tuner's TMA tiles first; a sample gives the reference's result through
the interpreter (fresh random inputs, the awkward shapes of the kernel-layout tests)."""
import pytest
import torch

from loraplex.kernels import fused_moe_mxfp4 as fm
from loraplex.kernels import reference_lora as ref
from loraplex.kernels.tuning_cases import MXFP4_TMA_SPACE
from tests.kernels.test_mxfp4_kernel_layout import _moe
from tests.utils.scripts import load_script

SHAPE = dict(hidden=2880, inter=2880)


def _script():
    return load_script("kernels", "mxfp4_tma_gpu")


@pytest.mark.parametrize("m", [1, 2, 16])
def test_candidates_are_two_launch_tma_configs(m):
    cands = _script().candidates(m)
    committed = {**fm.DEFAULT_CONFIG, "BLOCK_M": 8, "ONE_LAUNCH": 1}
    assert cands[:len(MXFP4_TMA_SPACE)] == [{**c, "ONE_LAUNCH": 0} for c in MXFP4_TMA_SPACE]
    assert len({tuple(sorted(c.items())) for c in cands}) == len(cands)
    for c in cands:
        cfg = {**committed, **c}
        assert not cfg["ONE_LAUNCH"]
        assert fm.gate_up_constexprs(cfg, top_k=4, act=0, has_bias=True, pdl=False, **SHAPE)["TMA"]
        assert fm.down_constexprs(cfg, has_bias=True, pdl=False, **SHAPE)["TMA"]


@pytest.mark.parametrize("index", [4, 13, 22, 35])
def test_sampled_candidates_match_reference(index):
    cfg = {**fm.DEFAULT_CONFIG, **_script().candidates(2)[index]}
    x, plain, kernel, weights, ids, b13, b2 = _moe(2, 4, True)
    kw = dict(activation="swiglu_clamp", b13=b13, b2=b2)
    got = fm.fused_moe_mxfp4(x, *kernel, weights, ids, config=cfg, **kw)
    torch.testing.assert_close(got, ref.fused_moe_mxfp4(x, *plain, weights, ids, **kw), rtol=1e-4, atol=1e-4)


def test_sweep_outcome_keeps_the_committed_config_unless_a_candidate_wins():
    outcome = load_script("kernels", "mxfp4_gemm_gpu").sweep_outcome
    rows = [{"variant": "op, committed", "config": {"a": 0}, "us": 10.0},
            {"variant": "tma, x", "config": {"a": 1}, "us": 12.0},
            {"variant": "tma, y", "config": {"a": 2}, "error": "failed"}]
    assert outcome(rows, "tma") == (None, rows[1])
    rows[1]["us"] = 9.0
    assert outcome(rows, "tma") == ({"a": 1}, rows[1])
    assert outcome(rows[2:], "tma") == (None, None)
