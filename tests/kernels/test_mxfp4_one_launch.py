"""Both MXFP4 expert GEMMs in one launch (``fused_moe_mxfp4_one_launch``) against the torch reference through the
interpreter (fresh random inputs; H = 96 and I = 160, so K tails, clamped row groups and a last intermediate tile
past I; experts without tokens), its config checks, the dispatch from ``fused_moe_mxfp4``, the benchmark's
candidates, and its sm_90 build (fence, atomics, PDL)."""
import pytest
import torch

from loraplex.kernels import fused_moe_mxfp4 as fm
from loraplex.kernels import fused_moe_mxfp4_one_launch as ol
from loraplex.kernels import reference_lora as ref
from tests.kernels.sm90_build import build_in_child
from tests.kernels.test_mxfp4_kernel_layout import H, _moe
from tests.utils.scripts import load_script

BASE = {"ONE_LAUNCH": 1, "BLOCK_M": 8, "GROUP_M": 1, "PDL": 1}
CONFIGS = {
    "direct 64/32, K 64, prefetch": {**BASE, "ONE_BLOCK_I": 64, "ONE_BLOCK_H": 32, "BLOCK_K": 64, "DIRECT": 1,
                                     "PREFETCH": 1, "num_warps": 4, "num_stages": 1},
    "aligned 128/64, fused, K 128": {**BASE, "ONE_BLOCK_I": 128, "ONE_BLOCK_H": 64, "BLOCK_K": 128, "GU_FUSED": 1,
                                     "num_warps": 4, "num_stages": 2},
    "aligned 16-pair blocks 64/16, bits": {**BASE, "BLOCK_M": 16, "ONE_BLOCK_I": 64, "ONE_BLOCK_H": 16,
                                           "BLOCK_K": 64, "DECODE": "bits", "num_warps": 2, "num_stages": 3},
    "direct 128/128, K 256, 8 warps": {**BASE, "ONE_BLOCK_I": 128, "ONE_BLOCK_H": 128, "BLOCK_K": 256, "DIRECT": 1,
                                       "num_warps": 8, "num_stages": 3},
    # a tuned entry's form: the two-launch keys for the LoRA path, the one launch's own under ONE_
    "ONE_ keys over a two-launch entry": {"BLOCK_M": 16, "BLOCK_N": 64, "BLOCK_K": 64, "SPLIT_K": 2, "GROUP_M": 1,
                                          "num_warps": 2, "num_stages": 1, "ONE_LAUNCH": 1, "ONE_BLOCK_I": 64,
                                          "ONE_BLOCK_H": 64, "ONE_BLOCK_M": 8, "ONE_BLOCK_K": 128, "ONE_DIRECT": 1,
                                          "ONE_GU_FUSED": 1, "ONE_num_warps": 4, "ONE_num_stages": 3},
    # gate_up's weights through TMA (w2's K slices by pointer)
    "tma direct 64/64, fused, K 128": {**BASE, "ONE_BLOCK_I": 64, "ONE_BLOCK_H": 64, "BLOCK_K": 128, "DIRECT": 1,
                                       "GU_FUSED": 1, "TMA": 1, "num_warps": 4, "num_stages": 4},
    "tma aligned 128/32, K 64, ONE_ keys": {"BLOCK_M": 16, "BLOCK_N": 64, "BLOCK_K": 64, "num_warps": 4,
                                            "num_stages": 3, "ONE_LAUNCH": 1, "ONE_BLOCK_I": 128, "ONE_BLOCK_H": 32,
                                            "ONE_BLOCK_M": 8, "ONE_TMA": 1, "ONE_num_stages": 6},
}


@pytest.mark.parametrize("num_tokens,top_k,activation,biases,config", [
    (1, 4, "swiglu_clamp", "both", "direct 64/32, K 64, prefetch"),
    (2, 4, "swiglu_clamp", "both", "aligned 128/64, fused, K 128"),
    (5, 2, "silu", "none", "aligned 16-pair blocks 64/16, bits"),
    (3, 4, "swiglu_clamp", "b13 only", "direct 128/128, K 256, 8 warps"),
    (1, 2, "silu", "both", "aligned 128/64, fused, K 128"),
    (2, 4, "swiglu_clamp", "both", "ONE_ keys over a two-launch entry"),
    (1, 4, "swiglu_clamp", "both", "tma direct 64/64, fused, K 128"),
    (3, 2, "silu", "b13 only", "tma aligned 128/32, K 64, ONE_ keys"),
])
def test_one_launch_matches_reference(num_tokens, top_k, activation, biases, config):
    x, plain, kernel, weights, ids, b13, b2 = _moe(num_tokens, top_k, biases != "none")
    if biases == "b13 only":
        b2 = None
    kw = dict(activation=activation, b13=b13, b2=b2, alpha=1.702, limit=7.0)
    got = fm.fused_moe_mxfp4(x, *kernel, weights, ids, config=CONFIGS[config], **kw)
    want = ref.fused_moe_mxfp4(x, *plain, weights, ids, **kw)
    assert got.shape == (num_tokens, H) and got.dtype == x.dtype
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def test_one_launch_in_bf16_rounds_h_like_the_two_launch_path():
    """bf16 activations: h rounded to bf16 before the down product, as the two-launch path stores it; the sums in
    float32, one rounding at the end."""
    x, plain, kernel, weights, ids, b13, b2 = _moe(2, 4, True, torch.bfloat16)
    kw = dict(activation="swiglu_clamp", b13=b13, b2=b2)
    got = fm.fused_moe_mxfp4(x, *kernel, weights, ids, config=CONFIGS["direct 64/32, K 64, prefetch"], **kw)
    two = fm.fused_moe_mxfp4(x, *kernel, weights, ids, config={"BLOCK_M": 8, "DIRECT": 1, "SPLIT_K": 2,
                                                               "num_stages": 1}, **kw)
    want = ref.fused_moe_mxfp4(x, *plain, weights, ids, **kw).float()
    assert got.dtype == torch.bfloat16
    err = ((got.float() - want).norm() / want.norm()).item()
    assert err < 1e-2 and err <= 2 * ((two.float() - want).norm() / want.norm()).item() + 1e-3


def test_fused_moe_mxfp4_dispatches_on_the_config_key(monkeypatch):
    calls = []
    real = ol.one_launch
    monkeypatch.setattr(ol, "one_launch", lambda *a, **k: calls.append(1) or real(*a, **k))
    x, _, kernel, weights, ids, b13, b2 = _moe(1, 4, True)
    kw = dict(activation="swiglu_clamp", b13=b13, b2=b2)
    fm.fused_moe_mxfp4(x, *kernel, weights, ids, config=CONFIGS["direct 64/32, K 64, prefetch"], **kw)
    fm.fused_moe_mxfp4(x, *kernel, weights, ids, config={"BLOCK_M": 8, "num_stages": 1}, **kw)
    assert calls == [1]


@pytest.mark.parametrize("bad,match", [({"ONE_BLOCK_I": 96}, "ONE_BLOCK_I"), ({"ONE_BLOCK_H": 24}, "ONE_BLOCK_H"),
                                       ({"ONE_BLOCK_I": 0}, "ONE_BLOCK_I"), ({"BLOCK_K": 96}, "BLOCK_K")])
def test_bad_one_launch_configs_are_refused(bad, match):
    x, _, kernel, weights, ids, b13, b2 = _moe(1, 4, True)
    cfg = {**CONFIGS["direct 64/32, K 64, prefetch"], **bad}
    with pytest.raises(ValueError, match=match):
        fm.fused_moe_mxfp4(x, *kernel, weights, ids, config=cfg, activation="silu", b13=b13, b2=b2)


def test_one_keys_override_for_the_one_launch_only():
    cfg = {**fm.DEFAULT_CONFIG, **CONFIGS["ONE_ keys over a two-launch entry"]}
    one = ol.one_config(cfg)
    assert (one["BLOCK_M"], one["BLOCK_K"], one["DIRECT"], one["num_warps"], one["num_stages"]) == (8, 128, 1, 4, 3)
    two = {k: v for k, v in cfg.items() if not k.startswith("ONE_")}
    shape = dict(hidden=2880, inter=2880)
    # the two-launch GEMMs (what moe_experts_lora runs from the same entry) launch as without the ONE_ keys
    assert (fm.gate_up_constexprs(cfg, top_k=4, act=1, has_bias=True, pdl=False, **shape)
            == fm.gate_up_constexprs(two, top_k=4, act=1, has_bias=True, pdl=False, **shape))
    assert (fm.down_constexprs(cfg, has_bias=True, pdl=False, **shape)
            == fm.down_constexprs(two, has_bias=True, pdl=False, **shape))
    meta, launch = ol.one_launch_constexprs(cfg, top_k=4, act=1, has_b13=True, has_b2=True, pdl=False,
                                            fence=False, **shape)
    assert (meta["BLOCK_M"], meta["BLOCK_K"], meta["DIRECT"], meta["FUSED"]) == (8, 128, True, True)
    assert launch == {"num_warps": 4, "num_stages": 3}
    with pytest.raises(ValueError, match="ONE_SPLIT_K"):
        ol.one_config({**cfg, "ONE_SPLIT_K": 2})


@pytest.mark.parametrize("m", [1, 2, 4])
def test_the_benchmarks_candidates_are_valid_one_launch_configs(m):
    mod = load_script("kernels", "mxfp4_one_launch_gpu")
    cands = mod.candidates(m)
    assert len({tuple(sorted(c.items())) for c in cands}) == len(cands) > 10
    for cand in cands:
        assert set(cand) <= {"ONE_" + k for k in ol.ONE_KEYS} | set(ol.OWN_KEYS) and cand["ONE_LAUNCH"] == 1
        assert not (cand["ONE_GU_FUSED"] and cand["ONE_num_warps"] > fm.FUSED_MAX_WARPS)
        meta, launch = ol.one_launch_constexprs({**fm.DEFAULT_CONFIG, **cand}, hidden=2880, inter=2880, top_k=4,
                                                act=1, has_b13=True, has_b2=True, pdl=True, fence=True)
        assert meta["NUM_I"] * meta["BLOCK_I"] >= 2880 and launch["num_warps"] == cand["ONE_num_warps"]
    assert any(c["ONE_DIRECT"] for c in cands) == (m <= 2)


def test_the_gpu_scripts_refuse_to_run_without_a_gpu(tmp_path, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    for name in ("mxfp4_one_launch_gpu", "mxfp4_graph_replay_gpu"):
        assert load_script("kernels", name).main(["--out", str(tmp_path)]) == 2
    assert not list(tmp_path.iterdir())


BUILD = r'''
import json, sys
sys.path.insert(0, "benchmarks/kernels")
from sm90_loops import build_sm90
from loraplex.kernels import fused_moe_mxfp4_one_launch as ol

TYPES = {"w13_ptr": "*i32", "w2_ptr": "*i32", "s13_ptr": "*u8", "s2_ptr": "*u8", "weights_ptr": "*fp32",
         "acc_ptr": "*fp32", "done_ptr": "*i32", "sorted_ptr": "*i32", "expert_ids_ptr": "*i32",
         "num_post_ptr": "*i32", "alpha": "fp32", "limit": "fp32"}
out = []
for fused, prefetch, direct, bi, bh, warps, stages, tma in ((True, 1, True, 64, 64, 4, 1, False),
                                                           (False, 0, False, 128, 128, 8, 3, False),
                                                           (True, 0, True, 64, 512, 4, 4, True)):
    meta = dict(TOP_K=4, ACT=1, HAS_B13=True, HAS_B2=True, BLOCK_M=8, BLOCK_I=bi, BLOCK_K=128, BLOCK_H=bh,
                NUM_I=-(-2880 // bi), EVEN_K=False, EVEN_I=2880 % bi == 0, DECODE=2, DIRECT=direct, FUSED=fused,
                PREFETCH=prefetch, USE_PDL=True, FENCE=True, FINAL=1024, TMA=tma)
    groups = bi // 16  # gate_up's box: BLOCK_I / 16 row groups of each half it reads
    types = dict(TYPES, w13_ptr=f"tensordesc<i32[1, {2 if fused else 1}, {groups}, 4, 32]>",
                 s13_ptr=f"tensordesc<i32[1, {2 if fused else 1}, {groups}, 8]>") if tma else TYPES
    ptx = build_sm90(ol._one_launch_kernel, meta, types, warps, stages).asm["ptx"]
    out.append({"tma": "cp.async.bulk.tensor" in ptx, "fence": ptx.count("fence.acq_rel.gpu"),
                "red": "red.global" in ptx or "atom.global.add.f32" in ptx,
                "counter": "atom.global.acq_rel" in ptx or "atom.acq_rel" in ptx or "atom.global.gpu.acq_rel" in ptx,
                "pdl": "griddepcontrol.wait" in ptx, "mma": "mma.sync" in ptx or "wgmma" in ptx,
                "asm": "fma.rn.bf16x2" in ptx})
print("RESULT " + json.dumps(out))
'''


def test_one_launch_builds_for_sm90():
    """The GPU build has what the interpreter skips: the fence in every program before it counts itself (and in
    the last one before it reads), the float32 atomic adds, the acquire-release counter, the PDL wait, tensor-core
    products and the inline-PTX decode."""
    got = build_in_child(BUILD, timeout=900)
    for b in got:
        assert b["fence"] >= 2 and b["red"] and b["counter"] and b["pdl"] and b["mma"] and b["asm"], b
    assert [b["tma"] for b in got] == [False, False, True]  # ONE_TMA: gate_up's weights by TMA copies


@pytest.mark.parametrize("index", [-2, -1])
def test_the_tuners_tma_one_launch_candidates_match_reference(index):
    from loraplex.kernels.tuning_cases import ONE_LAUNCH_SPACE

    cand = ONE_LAUNCH_SPACE[index]
    assert cand["ONE_TMA"] == 1
    x, plain, kernel, weights, ids, b13, b2 = _moe(2, 4, True)
    kw = dict(activation="swiglu_clamp", b13=b13, b2=b2)
    got = fm.fused_moe_mxfp4(x, *kernel, weights, ids, config={**fm.DEFAULT_CONFIG, **cand}, **kw)
    torch.testing.assert_close(got, ref.fused_moe_mxfp4(x, *plain, weights, ids, **kw), rtol=1e-4, atol=1e-4)

